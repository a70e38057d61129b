"""``pip install .`` and ``pip install -e .`` into a fresh virtual environment.

Slow (10 s to a minute: pip builds the C library and fetches the dependencies), so it carries the
``slow`` marker: ``pytest -m "not slow"`` leaves it out of a quick run; CI runs it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO_ROOT, clean_env

pytestmark = pytest.mark.slow

USE_IT = """
import sys, pykvalloc, pykvalloc._ffi as ffi, pykvalloc.stats as stats
import kvalloc_tui
with pykvalloc.Pool(16 << 20, name="installed") as pool:
    block = pool.alloc(4096)
    view = block.view("int32")
    view[:] = 5
    assert int(view.sum()) == 5 * 1024
    del view
    pool.free(block)
    pool.check()
    pool.publish()
    with stats.Segment.for_pool(pool) as segment:
        assert segment.snapshot().summary["alloc_count"] == 1
print(pykvalloc.__file__)
print(ffi.load().path)
print(pykvalloc.__version__)
print(kvalloc_tui.__file__)
"""


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=clean_env(),
                            stdin=subprocess.DEVNULL, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}\n{result.stderr}"
    return result


def test_pip_install_into_a_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = str(venv / "bin" / "python")
    site_packages = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path("
                                            "'platlib'))"], cwd=tmp_path).stdout.strip())

    # A regular install of the wheel, without extras, used from outside the source tree so
    # that only the installed copy can be imported.
    wheels = tmp_path / "wheels"
    _run([python, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels), str(REPO_ROOT)],
         cwd=tmp_path)
    wheel = next(wheels.glob("pykvalloc-*.whl"))
    _run([python, "-m", "pip", "install", str(wheel)], cwd=tmp_path)
    module, library, version, tui = _run([python, "-c", USE_IT], cwd=tmp_path).stdout.split()
    assert Path(module).parent == site_packages / "pykvalloc"
    assert Path(tui).parent == site_packages / "kvalloc_tui"  # the TUI under its own name
    assert Path(library).parent == site_packages / "pykvalloc"
    assert Path(library).name.startswith("libkvalloc.so")

    dist_info = next(site_packages.glob("pykvalloc-*.dist-info"))
    tags = [line.split(": ", 1)[1] for line in (dist_info / "WHEEL").read_text().splitlines()
            if line.startswith("Tag: ")]
    assert tags and all(tag.startswith("py3-none-") for tag in tags), tags
    record = (dist_info / "RECORD").read_text()
    assert "pykvalloc/py.typed" in record and "pykvalloc/libkvalloc.so" in record
    assert "kvalloc_cli/demo.py" in record and "pykvalloc/stats/reader.py" in record and "\ncli/" not in record
    assert "kvalloc_tui/app.py" in record and "\ntui/" not in record
    # The library needs numpy alone; the command's needs are extras.
    requires: dict[str, list[str]] = {}
    for line in (dist_info / "METADATA").read_text().splitlines():
        if line.startswith("Requires-Dist: "):
            requirement, _, marker = line.split(": ", 1)[1].partition(";")
            extra = marker.split("==")[1].strip().strip("'\"") if "extra ==" in marker else ""
            requires.setdefault(extra, []).append(requirement.strip())
    assert requires[""] == ["numpy"]
    assert sorted(requires["cli"]) == ["rich"]
    assert sorted(requires["tui"]) == ["rich", "textual"]
    assert requires["plot"] == ["matplotlib"]

    # The script is installed without them, and says what to install.
    bare = subprocess.run([str(venv / "bin" / "kvalloc"), "--version"], capture_output=True, text=True,
                          cwd=tmp_path, env=clean_env(), stdin=subprocess.DEVNULL, timeout=120)
    assert bare.returncode == 1 and bare.stdout == ""
    assert bare.stderr == "kvalloc: the command needs rich: pip install 'pykvalloc[cli]'\n"
    _run([python, "-m", "pip", "install", f"{wheel}[cli,tui]"], cwd=tmp_path)
    _run([python, "-c", "import kvalloc_tui.app"], cwd=tmp_path)

    script = _run([str(venv / "bin" / "kvalloc"), "--version"], cwd=tmp_path).stdout
    assert script.startswith(f"kvalloc (pykvalloc) {version}\nlibrary: {library}")
    _run([str(venv / "bin" / "kvalloc"), "ls"], cwd=tmp_path)
    # The benchmarks ship in the wheel, linked to the static library: they need no other file.
    for executable in ("bench_alloc", "bench_threads", "bench_kv", "bench_varpool"):
        assert f"pykvalloc/bench/{executable}," in record
    listed = _run([str(venv / "bin" / "kvalloc"), "bench", "--list"], cwd=tmp_path).stdout
    assert listed.count(str(site_packages / "pykvalloc" / "bench")) == 4, listed
    ran = subprocess.run([str(venv / "bin" / "kvalloc"), "bench", "varpool", "--quick"], capture_output=True,
                         text=True, cwd=tmp_path, env=clean_env(), stdin=subprocess.DEVNULL, timeout=600)
    assert ran.returncode in (0, 1) and "TLSF" in ran.stdout, ran.stdout + ran.stderr  # 1: a target missed

    # An editable install over it: the .py files come from the source tree, the library from
    # what scikit-build-core installed into site-packages.
    _run([python, "-m", "pip", "install", "--no-deps", "-e", str(REPO_ROOT)], cwd=tmp_path)
    module, library, _, tui = _run([python, "-c", USE_IT], cwd=tmp_path).stdout.split()
    assert Path(module).parent == REPO_ROOT / "pykvalloc"
    assert Path(tui).parent == REPO_ROOT / "tui" / "kvalloc_tui"
    assert Path(library).parent == site_packages / "pykvalloc"
    _run([str(venv / "bin" / "kvalloc"), "demo", "--requests", "100"], cwd=tmp_path)
