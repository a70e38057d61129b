"""Something else at a named pool's segment path (``/dev/shm/kvalloc.<pid>.<name>``, a
world-writable directory and a predictable name) before the pool is created: ``Pool(name=)`` and
``KVCache(name=)`` raise ``BackendError`` naming what is there, without waiting on a FIFO or
following a link, and leave it as it was. (tests/c/test_segment_path.c has every other kind.)

The name carries the creating process's pid, so each case plants and creates in a child process;
its timeout turns a creation that waits forever into a failure instead of a hung run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import clean_env, run_python

from pykvalloc import _ffi

SHM_DIR = Path("/dev/shm")

CHILD = """
import json, os, stat
from pathlib import Path
import pykvalloc

kind, api, name = {kind!r}, {api!r}, {name!r}
path = Path("/dev/shm") / f"kvalloc.{{os.getpid()}}.{{name}}"
target = Path("/dev/shm") / f"kvalloc.{{os.getpid()}}.{{name}}-target"
os.mkfifo(target if kind == "symlink" else path, 0o600)
if kind == "symlink":  # to a FIFO: following the link would wait on it too
    path.symlink_to(target)
before = os.lstat(path)
try:
    if api == "Pool":
        pykvalloc.Pool(4 << 20, name=name, pages="small").close()
    else:
        pykvalloc.KVCache(num_blocks=16, layers=1, kv_heads=1, head_dim=8, pages="small",
                          name=name).close()
    raised = None
except pykvalloc.KvallocError as exc:
    raised = {{"type": type(exc).__name__, "message": str(exc)}}
after = os.lstat(path)
print(json.dumps({{
    "raised": raised,
    "path": str(path),
    "same": (after.st_ino, after.st_mode, after.st_mtime_ns) == (before.st_ino, before.st_mode,
                                                                  before.st_mtime_ns),
    "link": os.readlink(path) if kind == "symlink" else None,
    "target": str(target),
    "fifo": stat.S_ISFIFO(os.stat(path).st_mode),
}}))
"""


@pytest.mark.parametrize("api", ["Pool", "KVCache"])
@pytest.mark.parametrize(("kind", "found"), [("fifo", "is a FIFO"), ("symlink", "is a symbolic link")])
def test_a_fifo_or_link_at_the_segment_path_is_named_and_left_alone(api, kind, found):
    name = f"segpath-{api}-{kind}"
    env = clean_env(**{_ffi.ENV_VAR: str(_ffi.find_library())})  # the library under test
    try:
        done = run_python(CHILD.format(kind=kind, api=api, name=name), env=env, timeout=60)
    finally:
        for left in SHM_DIR.glob(f"kvalloc.*.{name}*"):
            left.unlink()
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["raised"] is not None, "the pool was created over it"
    assert result["raised"]["type"] == "BackendError", result["raised"]
    assert found in result["raised"]["message"] and result["path"] in result["raised"]["message"]
    assert result["same"] and result["fifo"]  # still there, the same FIFO or link to one
    if kind == "symlink":
        assert result["link"] == result["target"]
