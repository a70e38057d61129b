"""Pools over memory the caller owns (``Pool.over``, ``external=``) and host pools shared with
other processes (``shared=True``, ``Pool.shared_fd``, ``SharedMapping``)."""

from __future__ import annotations

import gc
import mmap
import os
import socket
import subprocess
import sys
import weakref

import numpy as np
import pytest

import pykvalloc
from pykvalloc import _ffi
from pykvalloc.errors import InvalidArgument, PoolClosedError
from support import MiB, clean_env

ALIGN = 2 * MiB


def aligned_array(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A uint8 array of nbytes whose data starts on a multiple of align but not of 2 * align, so
    that the largest block is known (its base array keeps the memory)."""
    buf = np.zeros(nbytes + 3 * align, np.uint8)
    skip = (-buf.ctypes.data) % (2 * align) + align
    return buf[skip:skip + nbytes]


# -- memory the caller owns ---------------------------------------------------------------------

def test_pool_over_numpy_array_shares_its_bytes() -> None:
    arr = aligned_array(16 * MiB)
    with pykvalloc.Pool.over(arr, name="ext-py") as pool:
        assert pool.base == arr.ctypes.data
        stats = pool.stats()
        assert stats.page_kind is pykvalloc.PageKind.EXTERNAL
        assert stats.capacity == 16 * MiB and stats.mapped_bytes == 16 * MiB
        assert stats.max_alloc_size == ALIGN
        block = pool.alloc(MiB)
        view = block.view()
        view[:] = 9
        assert arr[block.offset] == 9 and arr[block.offset + MiB - 1] == 9
        arr[block.offset + 10] = 42  # the owner's writes show through the pool's view
        assert view[10] == 42
        assert [r for r in pool.walk() if r.kind.is_live][0].offset == block.offset
        pool.check()
        pool.publish()
        del view
        pool.free(block)
    # The pool never freed or unmapped the array: it is still there, with what was written.
    assert arr[block.offset + 10] == 42


def test_pool_keeps_its_owner_alive() -> None:
    arr = aligned_array(4 * MiB)
    owner_gone = weakref.ref(arr)
    pool = pykvalloc.Pool.over(arr)
    del arr
    gc.collect()
    assert owner_gone() is not None
    pool.close()
    del pool
    gc.collect()
    assert owner_gone() is None


def test_pool_over_mmap_holds_an_export() -> None:
    raw = mmap.mmap(-1, 8 * MiB + ALIGN)
    pool = pykvalloc.Pool(4 * MiB, external=_aligned_address(raw), owner=raw)
    assert pool.stats().page_kind is pykvalloc.PageKind.EXTERNAL
    pool.close()
    raw.close()
    # Pool.over takes the buffer itself and holds an export: the mmap cannot be closed under it.
    region = mmap.mmap(-1, 4 * MiB)
    try:
        over = pykvalloc.Pool.over(region)
    except InvalidArgument as exc:  # mmap gives page alignment; 64 KiB is needed
        assert "multiple of the slab chunk" in str(exc)
        return
    with pytest.raises(BufferError):
        region.close()
    over.close()
    del over
    gc.collect()
    region.close()


def _aligned_address(raw: mmap.mmap) -> int:
    import ctypes
    address = ctypes.addressof(ctypes.c_char.from_buffer(raw))
    return address + (-address) % ALIGN


@pytest.mark.parametrize("external, length, reason", [
    (0, 4 * MiB, "NULL"),
    (None, 4 * MiB + 100, "page"),
    ("+512", 4 * MiB, "slab chunk"),
    ("+4096", 4 * MiB, "slab chunk"),
])
def test_external_bad_ranges_are_refused(external: object, length: int, reason: str) -> None:
    arr = aligned_array(8 * MiB)
    base = arr.ctypes.data
    address = base if external is None else (base + int(str(external)[1:])
                                             if isinstance(external, str) else external)
    with pytest.raises(InvalidArgument, match=reason):
        pykvalloc.Pool(length, external=address, owner=arr)


@pytest.mark.parametrize("option", [
    {"prefault": True}, {"lock": True}, {"pin": True}, {"numa_node": 0}, {"pages": "small"},
    {"checked": True}, {"shared": True},
])
def test_external_refuses_what_does_not_apply(option: dict[str, object]) -> None:
    arr = aligned_array(4 * MiB)
    with pytest.raises(InvalidArgument, match=next(iter(option))):
        pykvalloc.Pool.over(arr, **option)


def test_overlapping_external_ranges_are_refused() -> None:
    arr = aligned_array(8 * MiB)
    with pykvalloc.Pool.over(arr) as first:
        block = first.alloc(4096)
        before = first.stats()
        for start, stop in [(0, 8), (4, 8), (0, 2)]:
            with pytest.raises(InvalidArgument, match="overlaps"):
                pykvalloc.Pool.over(arr[start * MiB:stop * MiB])
        after = first.stats()
        assert (after.bytes_in_use, after.live_allocations) == (before.bytes_in_use,
                                                                before.live_allocations)
        first.free(block)
    with pykvalloc.Pool.over(arr) as again:  # the range is free once its pool is closed
        again.check()


def test_owner_without_external_and_unusable_memory() -> None:
    with pytest.raises(InvalidArgument, match="owner"):
        pykvalloc.Pool(4 * MiB, owner=object())
    with pytest.raises(InvalidArgument, match="not memory"):
        pykvalloc.Pool.over(12345)
    with pytest.raises(InvalidArgument, match="read-only"):
        pykvalloc.Pool.over(b"\0" * (4 * MiB))
    frozen = aligned_array(4 * MiB)
    frozen.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        pykvalloc.Pool.over(frozen)
    with pytest.raises(InvalidArgument, match="contiguous"):
        pykvalloc.Pool.over(aligned_array(8 * MiB)[::2])
    # A buffer contiguous in Fortran order only (ctypes can take no export of it).
    fortran = aligned_array(8 * MiB).view(np.float64).reshape(1024, 1024).T
    with pytest.raises(InvalidArgument, match="contiguous"):
        pykvalloc.Pool.over(memoryview(fortran))
    with pytest.raises(InvalidArgument, match="contiguous"):
        pykvalloc.Pool.over(fortran)
    with pytest.raises(InvalidArgument):
        pykvalloc.Pool.over(bytearray())
    with pytest.raises(InvalidArgument):
        pykvalloc.Pool.over(aligned_array(4 * MiB)[:0])


class _Interface:
    """An object with a hand-written array interface, as another library might give."""

    def __init__(self, interface: object) -> None:
        self.__array_interface__ = interface


@pytest.mark.parametrize("interface", [
    {"shape": (4096,), "typestr": "|u1", "version": 3},  # no data
    {"shape": (4096,), "typestr": "|u1", "version": 3, "data": 12345},  # not a pair
    {"shape": 4096, "typestr": "|u1", "version": 3, "data": (1 << 30, False)},  # not a tuple
    {"shape": (4096,), "typestr": "nonsense", "version": 3, "data": (1 << 30, False)},
])
def test_malformed_array_interface_is_refused(interface: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument, match="array interface"):
        pykvalloc.Pool.over(_Interface(interface))


def test_cuda_array_interface_makes_a_cuda_pool_without_a_driver() -> None:
    """A CUDA array (a stand-in with the interface, at an address nothing maps: any touch would
    crash the child) gives a backend='cuda' external pool; no driver is loaded."""
    code = f"""
import pykvalloc
class DeviceArray:
    def __init__(self, address, nbytes):
        self.__cuda_array_interface__ = {{"version": 3, "shape": (nbytes,), "typestr": "|u1",
                                          "data": (address, False), "strides": None}}
address = {0x7F0000000000}
pool = pykvalloc.Pool.over(DeviceArray(address, 64 << 20))
s = pool.stats()
assert s.backend is pykvalloc.Backend.CUDA and s.page_kind is pykvalloc.PageKind.EXTERNAL, s
a = pool.alloc(1 << 20)
assert address <= a.address < address + (64 << 20)
try:
    a.view()
except pykvalloc.InvalidArgument:
    pass
else:
    raise AssertionError("a view of device memory")
pool.free(a)
pool.check()
print("ok")
"""
    env = clean_env(**{_ffi.ENV_VAR: str(_ffi.load().path),
                       "KVA_CUDA_DRIVER": "/nonexistent/libcuda.so.1"})
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# -- memory shared with other processes ---------------------------------------------------------

ATTACHER = """
import os, socket, sys
import numpy as np
import pykvalloc
sock = socket.socket(fileno=int(sys.argv[1]))
message, fds, _, _ = socket.recv_fds(sock, 64, 1)
read_offset, write_offset, length, owner_base = (int(x) for x in message.decode().split())
mapping = pykvalloc.SharedMapping(fds[0])
os.close(fds[0])
assert mapping.base != owner_base, "the same address as the owner"
seen = mapping.view(read_offset, length)
expected = (np.arange(length, dtype=np.uint64) * 7 + 1).astype(np.uint8)
assert (seen == expected).all(), "the owner's bytes differ"
mapping.view(write_offset, length)[:] = (np.arange(length, dtype=np.uint64) * 3 + 5).astype(np.uint8)
sock.sendall(b"done")
"""


def test_two_processes_share_blocks_by_offset() -> None:
    with pykvalloc.Pool(32 * MiB, shared=True, name="shared-py") as pool:
        length = 3 * MiB + 17
        mine, theirs = pool.alloc(length), pool.alloc(length)
        mine.view()[:] = (np.arange(length, dtype=np.uint64) * 7 + 1).astype(np.uint8)
        fd = pool.shared_fd()
        parent, child = socket.socketpair()
        env = clean_env(**{_ffi.ENV_VAR: str(_ffi.load().path)})
        worker = subprocess.Popen([sys.executable, "-c", ATTACHER, str(child.fileno())],
                                  pass_fds=[child.fileno()], env=env, stderr=subprocess.PIPE,
                                  text=True)
        child.close()
        message = f"{mine.offset} {theirs.offset} {length} {pool.base}".encode()
        socket.send_fds(parent, [message], [fd])
        os.close(fd)
        parent.settimeout(120)  # a bound against a hang, never a measure of speed
        assert parent.recv(4) == b"done"
        _, errors = worker.communicate(timeout=120)
        assert worker.returncode == 0, errors
        parent.close()
        answer = theirs.view()
        assert (answer == (np.arange(length, dtype=np.uint64) * 3 + 5).astype(np.uint8)).all()
        del answer
        pool.check()


def test_mapping_outlives_the_pool_and_views_outlive_close() -> None:
    pool = pykvalloc.Pool(4 * MiB, shared=True, pages="small")
    block = pool.alloc(8192)
    block.view()[:] = 0x3C
    fd = pool.shared_fd()
    mapping = pykvalloc.SharedMapping(fd)
    os.close(fd)
    assert mapping.length >= 4 * MiB
    offset = block.offset
    pool.close()
    seen = mapping.view(offset, 8192)
    mapping.close()
    assert mapping.closed and seen[0] == 0x3C and seen[-1] == 0x3C  # the view kept it mapped
    with pytest.raises(PoolClosedError):
        mapping.view(0, 1)
    del seen


def test_shared_fd_is_sealed() -> None:
    import fcntl
    with pykvalloc.Pool(4 * MiB, shared=True) as pool:
        fd = pool.shared_fd()
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 4096)
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        finally:
            os.close(fd)


def test_attach_refuses_what_is_not_a_shared_pool(tmp_path: object) -> None:
    read_end, write_end = os.pipe()
    plain = os.memfd_create("kvalloc.pool")
    os.ftruncate(plain, MiB)
    other = os.memfd_create("something-else")
    os.ftruncate(other, MiB)
    try:
        for fd in (read_end, plain, other):
            with pytest.raises(InvalidArgument, match="not a kvalloc shared pool"):
                pykvalloc.SharedMapping(fd)
        with pytest.raises(InvalidArgument):
            pykvalloc.SharedMapping(-1)
        with pytest.raises(InvalidArgument):
            pykvalloc.SharedMapping(2**31 - 1)
        with pytest.raises(TypeError):
            pykvalloc.SharedMapping("3")  # type: ignore[arg-type]
    finally:
        for fd in (read_end, write_end, plain, other):
            os.close(fd)


def test_attach_refuses_a_read_only_descriptor_of_a_pool() -> None:
    """The mapping is read-write: the pool's own object opened read-only is the caller's
    mistake (InvalidArgument), not a failure of the system."""
    with pykvalloc.Pool(4 * MiB, shared=True, pages="small") as pool:
        fd = pool.shared_fd()
        read_only = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            with pytest.raises(InvalidArgument, match="not open for reading and writing"):
                pykvalloc.SharedMapping(read_only)
            with pykvalloc.SharedMapping(fd) as mapping:
                assert mapping.length >= 4 * MiB
        finally:
            os.close(read_only)
            os.close(fd)


def test_shared_fd_of_a_private_pool_is_refused() -> None:
    with pykvalloc.Pool(4 * MiB) as pool:
        block = pool.alloc(4096)
        before = pool.stats()
        with pytest.raises(InvalidArgument, match="not shared"):
            pool.shared_fd()
        assert pool.stats().live_allocations == before.live_allocations
        pool.free(block)


def test_mapping_view_bounds() -> None:
    with pykvalloc.Pool(4 * MiB, shared=True) as pool:
        fd = pool.shared_fd()
        with pykvalloc.SharedMapping(fd) as mapping:
            os.close(fd)
            with pytest.raises(InvalidArgument, match="outside"):
                mapping.view(mapping.length - 4, 8)
            with pytest.raises(InvalidArgument, match="whole number"):
                mapping.view(0, 6, np.uint32)
            for offset, nbytes in ((0.5, 8), (0, "8"), (True, 8), (0, None)):
                with pytest.raises(InvalidArgument, match="integers"):
                    mapping.view(offset, nbytes)  # type: ignore[arg-type]
            assert mapping.view(0, 8, np.uint32).shape == (2,)
            assert mapping.view(np.int64(8), np.uint64(8)).shape == (8,)


def test_a_forked_child_neither_hands_out_nor_gives_back_the_owners_memory() -> None:
    # A child forked from the owner has a copy of the allocator over the owner's very bytes:
    # what it handed out the owner would hand out too, and a free's discard would zero the
    # owner's block; a KV cache over the pool is a copy of the owner's. The library refuses
    # every change in the child; the owner's block stays whole and its cache goes on.
    with pykvalloc.Pool(8 * MiB, shared=True, pages="small") as pool:
        small = pool.alloc(64)
        block = pool.alloc(MiB)
        block.view()[:] = 0x5A
        cache = pykvalloc.KVCache(num_blocks=8, block_tokens=16, layers=1, kv_heads=1,
                                  head_dim=8, pool=pool)
        seq = cache.allocate(20)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: answers through the pipe, never returns into pytest
            code = 1
            try:
                verdict = []
                for call in (lambda: pool.alloc(64), lambda: pool.alloc(MiB),
                             lambda: pool.free(block), lambda: pool.free(small), pool.trim,
                             lambda: cache.allocate(16), lambda: seq.append(1), seq.free):
                    try:
                        call()
                        verdict.append("served")
                    except pykvalloc.BackendError:
                        verdict.append("refused")
                verdict.append(str(int(block.view()[0])))
                verdict.append(str(cache.stats().sequences))  # reading the cache answers
                os.write(write, " ".join(verdict).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as answer:
            said = answer.read().decode()
        assert os.waitstatus_to_exitcode(status) == 0
        assert said == " ".join(["refused"] * 8 + ["90", "1"])
        assert (block.view() == 0x5A).all()
        assert seq.append(1) is None and seq.num_tokens == 21  # the owner's cache goes on
        seq.free()
        cache.close()
        pool.free(pool.alloc(64))
        pool.free(small)
        pool.free(block)
        pool.check()
