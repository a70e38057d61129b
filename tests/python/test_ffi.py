"""The loader: where the library comes from, and that the ctypes mirror of the C structs has
exactly the layout the compiler gives them."""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap
from ctypes import sizeof
from pathlib import Path

import pytest
from support import REPO_ROOT, clean_env, run_python

import pykvalloc
from pykvalloc import _ffi

HEADER_DIR = REPO_ROOT / "libkvalloc" / "include"


def test_the_library_loads_once_with_every_function_declared():
    lib = _ffi.load()
    assert _ffi.load() is lib
    assert lib.path.is_file() and lib.path.name.startswith("libkvalloc.so")
    for name in ("kva_alloc", "kva_free", "kva_walk", "kva_get_stats", "kva_check"):
        function = getattr(lib, name)
        assert function.argtypes is not None and function.restype is not None
    assert lib.kva_strerror(1) == b"out of memory in the pool"


def test_candidates_cover_package_and_source_tree(monkeypatch):
    monkeypatch.delenv(_ffi.ENV_VAR, raising=False)
    candidates = _ffi.candidate_paths()
    package_dirs = [Path(p) for p in pykvalloc.__path__]
    assert candidates[0].parent in package_dirs
    assert candidates[-1] == Path(_ffi.__file__).resolve().parents[1] / "build" / "libkvalloc.so"


def test_environment_variable_overrides_the_location(tmp_path):
    copy = tmp_path / "libkvalloc-elsewhere.so"
    shutil.copy(_ffi.load().path, copy)
    result = run_python(
        "import pykvalloc, pykvalloc._ffi as f\n"
        "pool = pykvalloc.Pool(1 << 20); pool.alloc(64)\n"
        "print(f.load().path)",
        env=clean_env(PYKVALLOC_LIB=str(copy)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(copy)


def test_a_missing_override_is_reported_with_the_path_tried(tmp_path):
    missing = tmp_path / "nowhere" / "libkvalloc.so"
    result = run_python(
        "import pykvalloc\n"  # importing never needs the library; only using it does
        "try:\n"
        "    pykvalloc.Pool(1 << 20)\n"
        "except pykvalloc.LibraryNotFoundError as exc:\n"
        "    print(isinstance(exc, OSError)); print(exc)\n",
        env=clean_env(PYKVALLOC_LIB=str(missing)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("True\nlibkvalloc not found; tried:")
    assert str(missing) in result.stdout and "PYKVALLOC_LIB is set" in result.stdout


def test_a_file_that_is_not_the_library_is_reported(tmp_path):
    bogus = tmp_path / "libkvalloc.so"
    bogus.write_text("not an ELF file")
    result = run_python(
        "import pykvalloc\n"
        "try:\n"
        "    pykvalloc.Pool(1 << 20)\n"
        "except pykvalloc.LibraryNotFoundError as exc:\n"
        "    print(exc)\n",
        env=clean_env(PYKVALLOC_LIB=str(bogus)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"cannot load libkvalloc from {bogus}")


def test_a_library_without_the_api_is_reported(tmp_path):
    libc = subprocess.run(["sh", "-c", "ldd /bin/sh | awk '/libc.so/ {print $3}'"],
                          capture_output=True, text=True).stdout.strip()
    if not libc:
        pytest.skip("no libc path found through ldd")
    result = run_python(
        "import pykvalloc\n"
        "try:\n"
        "    pykvalloc.Pool(1 << 20)\n"
        "except pykvalloc.LibraryNotFoundError as exc:\n"
        "    print(exc)\n",
        env=clean_env(PYKVALLOC_LIB=libc))
    assert result.returncode == 0, result.stderr
    assert "does not export kva_strerror" in result.stdout


@pytest.mark.skipif(not (HEADER_DIR / "kvalloc.h").is_file(), reason="no source tree beside")
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_ctypes_structs_match_the_c_layout(tmp_path):
    # The compiler is the authority on the layout: print sizeof and offsetof of every field it
    # sees in kvalloc.h and compare them with what ctypes computed from our _fields_.
    lines = []
    for c_name, struct in _ffi.STRUCTS.items():
        lines.append(f'printf("{c_name} sizeof %zu\\n", sizeof({c_name}));')
        for field, _ in struct._fields_:
            lines.append(f'printf("{c_name} {field} %zu %zu\\n", offsetof({c_name}, {field}), '
                         f'sizeof((({c_name} *)0)->{field}));')
    for enum in ("kva_status", "kva_page_mode", "kva_page_kind", "kva_walk_kind"):
        lines.append(f'printf("{enum} sizeof %zu\\n", sizeof({enum}));')
    source = tmp_path / "probe.c"
    source.write_text(textwrap.dedent("""\
        #include <stddef.h>
        #include <stdio.h>
        #include "kvalloc.h"
        int main(void) {
        %s
            return 0;
        }
        """) % "\n".join("    " + line for line in lines))
    binary = tmp_path / "probe"
    subprocess.run(["cc", "-std=c11", "-I", str(HEADER_DIR), str(source), "-o", str(binary)],
                   check=True)
    from_c = subprocess.run([str(binary)], capture_output=True, text=True,
                            check=True).stdout.splitlines()

    expected = []
    for c_name, struct in _ffi.STRUCTS.items():
        expected.append(f"{c_name} sizeof {sizeof(struct)}")
        for field, _ in struct._fields_:
            descriptor = getattr(struct, field)
            expected.append(f"{c_name} {field} {descriptor.offset} {descriptor.size}")
    for enum in ("kva_status", "kva_page_mode", "kva_page_kind", "kva_walk_kind"):
        expected.append(f"{enum} sizeof {sizeof(_ffi.c_enum)}")
    assert from_c == expected


def test_header_constants_match(tmp_path):
    header = HEADER_DIR / "kvalloc.h"
    if not header.is_file():
        pytest.skip("no source tree beside")
    text = header.read_text()
    for name in ("KVA_MAX_ORDERS", "KVA_NUM_SIZE_CLASSES", "KVA_NAME_MAX", "KVA_SLAB_MIN_SIZE",
                 "KVA_SLAB_MAX_SIZE"):
        assert f"#define {name} {getattr(_ffi, name)} " in " ".join(text.split()), name
    version = tuple(int(text.split(f"#define KVA_VERSION_{part} ")[1].split()[0])
                    for part in ("MAJOR", "MINOR", "PATCH"))
    if pykvalloc.__version__ != "0+unknown":
        assert pykvalloc.__version__ == ".".join(map(str, version))


@pytest.mark.skipif(not (HEADER_DIR / "kvalloc.h").is_file(), reason="no source tree beside")
def test_every_public_function_is_declared_once():
    # One loader declares the whole API: each KVA_API function of the public headers is an
    # attribute of KvaLib with its C signature applied, written once in the class body.
    headers = ("kvalloc.h", "kvalloc_kv.h", "kvalloc_var.h")
    text = " ".join((HEADER_DIR / name).read_text() for name in headers)
    header = " ".join(text.split())
    public = set(re.findall(r"KVA_API [^;(]*?\b(kva_\w+)\(", header))
    declared = {name for name, value in vars(_ffi.KvaLib).items()
                if isinstance(value, _ffi._Declaration)}
    assert public and public == declared
    lib = _ffi.load()
    for name in public:
        assert getattr(lib, name).argtypes is not None, name
