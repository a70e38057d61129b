# The two commands of the README: `make demo` (the main job) and `make test` (every test).
# Each sets up what it needs: system packages, the C build, a virtual environment.

PYTHON ?= python3
BUILD  ?= build
VENV   ?= .venv
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)
FUZZ_SECONDS ?= 30
FUZZ_HARNESSES = pool pool_config kv kv_contig var

.PHONY: all deps build test test-c test-sanitize test-tsan test-py test-fuzz test-vllm test-torch fuzz venv demo bench clean

all: build

deps:
	@scripts/ensure-system-deps.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release
	cmake --build $(BUILD) -j $(JOBS)

# The C sources must be formatted as .clang-format says (scripts/format.sh rewrites them).
test-c: build
	scripts/format.sh --check
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# Every C test again under AddressSanitizer and UndefinedBehaviorSanitizer, in a Debug build: its
# assertions are on (KVA_DEBUG 3, internal.h), and some tests run a second time with the
# expensive ones on too (ctest label expensive, tests/c/CMakeLists.txt). Left out: the benchmark
# smoke run (it maps gigabytes, slow under ASan), the install test (packaging) and the strace test (LeakSanitizer cannot run under
# ptrace); all three run in test-c.
test-sanitize: deps
	cmake -S . -B $(BUILD)-asan -DCMAKE_BUILD_TYPE=Debug -DKVA_SANITIZE=address,undefined
	cmake --build $(BUILD)-asan -j $(JOBS)
	cd $(BUILD)-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 ctest --output-on-failure -j $(JOBS) -LE 'bench|install|strace'

# The multi-threaded tests (ctest label threads) under ThreadSanitizer: a data race in the
# library's thread caches or arenas fails the run. Only those tests are built (threads_tests).
test-tsan: deps
	cmake -S . -B $(BUILD)-tsan -DCMAKE_BUILD_TYPE=Debug -DKVA_SANITIZE=thread -DKVA_BUILD_TOOLS=OFF
	cmake --build $(BUILD)-tsan -j $(JOBS) --target threads_tests
	cd $(BUILD)-tsan && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 ctest -L threads --output-on-failure -j $(JOBS)

# The virtual environment holds the package installed in editable mode (scikit-build-core
# builds libkvalloc into it) and pytest.
# The editable install carries its own build of the library and of the benchmarks `kvalloc bench`
# runs: rebuild it when the C changes.
$(VENV)/.installed: pyproject.toml CMakeLists.txt $(wildcard libkvalloc/src/* libkvalloc/include/* tools/CMakeLists.txt tools/*.c tools/*.h) | deps
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# The type check (mypy's files: pyproject.toml), then every Python test.
test-py: venv
	$(VENV)/bin/mypy
	$(VENV)/bin/python -m pytest -q tests/python

# Opt-in, never part of make test: the tests against vLLM itself (tests/vllm, which make test's
# pytest does not collect), in .venv-vllm, which holds vLLM and torch (gigabytes) apart from
# .venv, and this package installed editable (its own build of the library), rebuilt when the C
# changes.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed: pyproject.toml CMakeLists.txt $(wildcard libkvalloc/src/* libkvalloc/include/*) | deps
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -c 'import vllm' 2>/dev/null || $(VLLM_VENV)/bin/pip install vllm
	$(VLLM_VENV)/bin/pip install --quiet pytest -e .
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm

# Opt-in, never part of make test: DLPack round trips through torch (tests/torch), with the
# interpreter of .venv-vllm (it has CPU torch), this tree first on its path and this build's
# library (the test checks that it imports these).
test-torch: build $(VLLM_VENV)/.installed
	PYTHONPATH=$(CURDIR) PYKVALLOC_LIB=$(CURDIR)/$(BUILD)/libkvalloc.so \
		$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/torch

# libFuzzer on the pool (one configuration; all of them), the KV manager (paged; contiguous) and the variable-size
# pools, FUZZ_SECONDS each, starting from the seed corpora
# in the repository; a crash fails the run and leaves the input in $(BUILD)-fuzz (crash-*).
test-fuzz: fuzz
fuzz:
	scripts/ensure-system-deps.sh fuzz
	CC=clang cmake -S . -B $(BUILD)-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVA_FUZZ=ON -DKVA_BUILD_TESTS=OFF -DKVA_BUILD_TOOLS=OFF
	cmake --build $(BUILD)-fuzz -j $(JOBS) --target $(addprefix fuzz_,$(FUZZ_HARNESSES))
	for harness in $(FUZZ_HARNESSES); do \
		mkdir -p $(BUILD)-fuzz/corpus-$$harness && \
		(cd $(BUILD)-fuzz && ./tests/fuzz/fuzz_$$harness -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
			corpus-$$harness $(CURDIR)/tests/fuzz/corpus/$$harness) || exit 1; \
	done

test: test-c test-sanitize test-tsan test-py test-fuzz

demo: venv
	$(VENV)/bin/kvalloc demo

bench: build
	tools/run_bench.sh

clean:
	rm -rf $(BUILD) $(VENV)
