# The two commands of the README: `make demo` (the main job) and `make test` (every test).
# Each sets up what it needs: system packages, the C build, a virtual environment.

PYTHON ?= python3
BUILD  ?= build
VENV   ?= .venv
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: all deps build test test-c test-py venv demo bench clean

all: build

deps:
	@scripts/ensure-system-deps.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release
	cmake --build $(BUILD) -j $(JOBS)

test-c: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The virtual environment holds the package installed in editable mode (scikit-build-core
# builds libkvalloc into it) and pytest.
# The editable install carries its own build of the library: rebuild it when the C changes.
$(VENV)/.installed: pyproject.toml CMakeLists.txt $(wildcard libkvalloc/src/* libkvalloc/include/*) | deps
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed

test-py: venv
	$(VENV)/bin/python -m pytest -q tests/python

test: test-c test-py

demo: venv
	$(VENV)/bin/kvalloc demo

bench: build
	tools/run_bench.sh

clean:
	rm -rf $(BUILD) $(VENV)
