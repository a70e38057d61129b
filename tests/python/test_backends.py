"""Backing memory from Python: ``Pool(backend=, numa_node=, numa_policy=, hugepages=, prefault=,
lock=, pin=, device=)``. NUMA policies are checked against the kernel (get_mempolicy); the CUDA
backend and pinning run against the fake driver of tests/fake_cuda, compiled here, each in a
fresh interpreter because the driver is loaded once per process; tools/gpu_check.py runs end to
end on it too."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import REPO_ROOT, MiB, clean_env, run_python

import pykvalloc
from pykvalloc.pool import Backend, PageKind, PageMode

FAKE_SOURCE = REPO_ROOT / "tests" / "fake_cuda" / "fake_cuda.c"
SYS_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}.get(platform.machine())
MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_F_ADDR = 0, 1, 2, 2


def policy_of(address: int) -> tuple[int, int]:
    """(mode, node mask word 0) of the page at address, from the kernel."""
    libc = ctypes.CDLL(None, use_errno=True)
    mode = ctypes.c_int(-1)
    mask = (ctypes.c_ulong * 64)()
    result = libc.syscall(ctypes.c_long(SYS_GET_MEMPOLICY), ctypes.byref(mode), mask,
                          ctypes.c_ulong(64 * 64), ctypes.c_void_p(address),
                          ctypes.c_ulong(MPOL_F_ADDR))
    assert result == 0, os.strerror(ctypes.get_errno())
    return mode.value, mask[0]


needs_get_mempolicy = pytest.mark.skipif(SYS_GET_MEMPOLICY is None,
                                         reason="get_mempolicy number unknown on this machine")


@pytest.fixture(scope="session")
def fake_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """libfakecuda.so built from its source, so it always matches the tree."""
    compiler = shutil.which("cc")
    if compiler is None or not FAKE_SOURCE.is_file():
        pytest.skip("needs a C compiler and the source tree")
    out = tmp_path_factory.mktemp("fake_cuda") / "libfakecuda.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-fvisibility=hidden", "-D_GNU_SOURCE",
                    "-I", str(REPO_ROOT / "libkvalloc" / "src"),
                    "-I", str(REPO_ROOT / "libkvalloc" / "include"),
                    str(FAKE_SOURCE), "-o", str(out), "-lpthread"], check=True)
    return out


def run_with_driver(code: str, driver: Path | str, **fake_env: str) -> subprocess.CompletedProcess:
    result = run_python(textwrap.dedent(code),
                        env=clean_env(KVA_CUDA_DRIVER=str(driver), **fake_env))
    assert result.returncode == 0, result.stdout + result.stderr
    return result


# ---- host pools --------------------------------------------------------------------------------


def test_host_defaults_in_the_stats():
    with pykvalloc.Pool(4 * MiB) as pool:
        stats = pool.stats()
        assert pool.backend is Backend.HOST and stats.backend is Backend.HOST
        assert stats.numa_node is None and not stats.pinned and not stats.locked
        assert stats.mapped_bytes >= stats.capacity


@needs_get_mempolicy
@pytest.mark.parametrize("policy, mode", [("bind", MPOL_BIND), ("preferred", MPOL_PREFERRED)])
def test_numa_node_binds_the_region(policy, mode):
    with pykvalloc.Pool(8 * MiB, numa_node=0, numa_policy=policy, hugepages=False) as pool:
        assert pool.stats().numa_node == 0
        for address in (pool.base, pool.base + pool.capacity - 1):
            assert policy_of(address) == (mode, 1)
        block = pool.alloc(MiB)
        block.view()[:] = 7  # touched pages obey the policy; the view still works
    with pykvalloc.Pool(4 * MiB) as pool:
        assert policy_of(pool.base)[0] == MPOL_DEFAULT


def test_a_node_that_does_not_exist_is_a_clear_error():
    with pytest.raises(pykvalloc.InvalidArgument, match="numa_node 9999 does not exist"):
        pykvalloc.Pool(4 * MiB, numa_node=9999)
    with pytest.raises(pykvalloc.InvalidArgument, match="numa_node -1"):
        pykvalloc.Pool(4 * MiB, numa_node=-1)
    with pytest.raises(TypeError):
        pykvalloc.Pool(4 * MiB, numa_node=True)  # type: ignore[arg-type]
    with pytest.raises(pykvalloc.InvalidArgument, match="'bind', 'preferred'"):
        pykvalloc.Pool(4 * MiB, numa_node=0, numa_policy="interleave")


def test_hugepages_chooses_the_page_mode():
    with pykvalloc.Pool(4 * MiB, hugepages=False) as pool:
        assert pool.stats().page_kind is PageKind.SMALL
    with pykvalloc.Pool(4 * MiB, hugepages=True) as pool:  # huge pages when the machine has them
        assert pool.stats().page_kind in (PageKind.HUGETLB, PageKind.THP, PageKind.SMALL)
    with pykvalloc.Pool(4 * MiB, hugepages="small") as pool:
        assert pool.stats().page_kind is PageKind.SMALL
    with pytest.raises(pykvalloc.InvalidArgument, match="pages or hugepages"):
        pykvalloc.Pool(4 * MiB, pages="small", hugepages=True)
    with pytest.raises(pykvalloc.InvalidArgument, match="pages must be one of"):
        pykvalloc.Pool(4 * MiB, hugepages="gigantic")
    assert PageMode.AUTO == 0  # the default when neither is given


def test_lock_and_prefault():
    with pykvalloc.Pool(4 * MiB, lock=True, prefault=True, hugepages=False) as pool:
        stats = pool.stats()
        assert stats.locked and not stats.pinned
        pool.alloc(4096).view()[:] = 1


def test_backend_and_device_arguments_are_checked():
    with pytest.raises(pykvalloc.InvalidArgument, match="'host', 'cuda'"):
        pykvalloc.Pool(4 * MiB, backend="gpu")
    with pytest.raises(pykvalloc.InvalidArgument, match="device -1"):
        pykvalloc.Pool(4 * MiB, device=-1)
    with pytest.raises(pykvalloc.InvalidArgument, match="trim_watermark applies to CUDA"):
        pykvalloc.Pool(4 * MiB, trim_watermark=MiB)
    with pytest.raises(pykvalloc.InvalidArgument, match="numa_node applies to host memory"):
        pykvalloc.Pool(4 * MiB, backend="cuda", numa_node=0)


# ---- the CUDA backend and pinning ---------------------------------------------------------------


def test_no_driver_is_a_backend_error_saying_so():
    run_with_driver("""
        import pykvalloc
        for options in ({"backend": "cuda"}, {"pin": True}):
            try:
                pykvalloc.Pool(64 << 20, **options)
            except pykvalloc.BackendError as exc:
                assert "no CUDA driver" in str(exc) and "/nonexistent/libcuda.so.1" in str(exc), exc
            else:
                raise AssertionError(f"{options} succeeded without a driver")
        """, "/nonexistent/libcuda.so.1")


def test_no_gpu_is_a_backend_error_saying_so(fake_driver):
    run_with_driver("""
        import pykvalloc
        try:
            pykvalloc.Pool(64 << 20, backend="cuda")
        except pykvalloc.BackendError as exc:
            assert "no CUDA GPU" in str(exc), exc
        else:
            raise AssertionError("a CUDA pool without a GPU")
        """, fake_driver, FAKE_CUDA_DEVICES="0")


def test_a_cuda_pool(fake_driver):
    run_with_driver("""
        import pykvalloc
        from pykvalloc.pool import Backend, PageKind
        MiB = 1 << 20
        with pykvalloc.Pool(64 * MiB, backend="cuda", device=0) as pool:
            stats = pool.stats()
            assert pool.backend is Backend.CUDA and stats.backend is Backend.CUDA
            assert stats.page_kind is PageKind.DEVICE and stats.page_size == 2 * MiB
            assert stats.mapped_bytes == 0 and stats.numa_node is None
            small = [pool.alloc(size) for size in (16, 100, 4000, 65536)]
            large = pool.alloc(8 * MiB)
            exact = pool.alloc_exact(3 * MiB)
            assert pool.stats().mapped_bytes >= 11 * MiB
            pool.check()
            assert sum(r.size for r in pool.walk()) == pool.capacity
            try:
                large.view()
            except pykvalloc.InvalidArgument as exc:
                assert "GPU memory" in str(exc)
            else:
                raise AssertionError("a numpy view of GPU memory")
            for block in small + [large, exact]:
                pool.free(block)
            assert pool.stats().mapped_bytes > 0  # idle until trimmed
            pool.trim()
            assert pool.stats().mapped_bytes == 0
            pool.check()
        with pykvalloc.Pool(8 * MiB, backend="cuda", prefault=True) as pool:
            assert pool.stats().mapped_bytes == 8 * MiB
        with pykvalloc.Pool(64 * MiB, backend="cuda", trim_watermark=2 * MiB) as pool:
            blocks = [pool.alloc(2 * MiB) for _ in range(4)]
            for block in blocks:
                pool.free(block)
            assert pool.stats().mapped_bytes == 2 * MiB
        """, fake_driver)


def test_gpu_memory_running_out_and_driver_refusals(fake_driver):
    run_with_driver("""
        import pykvalloc
        MiB = 1 << 20
        with pykvalloc.Pool(64 * MiB, backend="cuda") as pool:
            kept = pool.alloc(4 * MiB)
            before = pool.stats()
            try:
                pool.alloc(8 * MiB)
            except pykvalloc.OutOfMemory as exc:
                assert "CUDA_ERROR_OUT_OF_MEMORY" in str(exc), exc
            else:
                raise AssertionError("8 MiB more from a GPU of 6 MiB")
            after = pool.stats()
            assert after.bytes_free == before.bytes_free
            assert after.alloc_failures == before.alloc_failures + 1
            pool.check()
            try:
                pool.alloc(2 * MiB)  # the 4th cuMemMap is refused (FAKE_CUDA_FAIL)
            except pykvalloc.BackendError as exc:
                assert "cuMemMap" in str(exc), exc
            else:
                raise AssertionError("cuMemMap was to fail")
            pool.alloc(2 * MiB)
            pool.free(kept)
            pool.check()
        """, fake_driver, FAKE_CUDA_MEMORY=str(6 * MiB), FAKE_CUDA_FAIL="cuMemMap:4:1")


def test_pinned_host_pool(fake_driver):
    run_with_driver("""
        import pykvalloc
        with pykvalloc.Pool(4 << 20, pin=True) as pool:
            stats = pool.stats()
            assert stats.pinned and stats.backend == 0
            view = pool.alloc(4096).view()  # still host memory
            view[:] = 3
            del view
        """, fake_driver)


SHARED_CUDA_COMMON = """
    import ctypes, os, socket, subprocess, sys
    import pykvalloc
    fake = ctypes.CDLL(os.environ["KVA_CUDA_DRIVER"])
    ctx = ctypes.c_void_p()

    def copy(host, device, n, to_device):
        if not ctx.value:
            assert fake.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert fake.cuCtxPushCurrent_v2(ctx) == 0
        call = fake.cuMemcpyHtoD_v2 if to_device else fake.cuMemcpyDtoH_v2
        call.argtypes = ([ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t] if to_device else
                         [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t])
        assert (call(device, host, n) if to_device else call(host, device, n)) == 0
        assert fake.cuCtxPopCurrent_v2(None) == 0
"""


def test_shared_cuda_pool_in_two_processes(fake_driver):
    """The owner exports a shared CUDA pool's allocation; a second process imports it at its own
    device address and sees the owner's bytes (the fake's shareable memory is a memfd)."""
    importer = textwrap.dedent(SHARED_CUDA_COMMON) + textwrap.dedent("""
        sock = socket.socket(fileno=int(sys.argv[1]))
        message, fds, _, _ = socket.recv_fds(sock, 128, 1)
        offset, n, mapped, owner_base = (int(x) for x in message.decode().split())
        mapping = pykvalloc.SharedMapping(fds[0], backend="cuda", length=mapped)
        try:
            pykvalloc.SharedMapping(fds[0], backend="cuda", length=mapped)
        except pykvalloc.InvalidArgument:
            pass
        else:
            raise AssertionError("the allocation was imported twice")
        try:
            mapping.view(0, 16)
        except pykvalloc.InvalidArgument:
            pass
        else:
            raise AssertionError("a CPU view of device memory")
        seen = ctypes.create_string_buffer(n)
        copy(seen, mapping.base + offset, n, False)
        assert seen.raw == bytes(range(256)) * (n // 256), "the owner's bytes differ"
        copy(b"answer!!" * (n // 8), mapping.base + offset, n, True)
        mapping.close()
        os.close(fds[0])
        sock.sendall(b"done")
    """)
    owner = textwrap.dedent(SHARED_CUDA_COMMON) + textwrap.dedent(f"""
        importer = {importer!r}
        with pykvalloc.Pool(32 << 20, backend="cuda", shared=True) as pool:
            mapped = pool.stats().mapped_bytes
            block = pool.alloc(1 << 20)
            n = 1 << 20
            copy(bytes(range(256)) * (n // 256), block.address, n, True)
            fd = pool.shared_fd()
            parent, child = socket.socketpair()
            worker = subprocess.Popen([sys.executable, "-c", importer, str(child.fileno())],
                                      pass_fds=[child.fileno()], stderr=subprocess.PIPE, text=True)
            child.close()
            socket.send_fds(parent, [f"{{block.offset}} {{n}} {{mapped}} {{pool.base}}".encode()], [fd])
            os.close(fd)
            parent.settimeout(120)  # a bound against a hang
            assert parent.recv(4) == b"done"
            _, errors = worker.communicate(timeout=120)
            assert worker.returncode == 0, errors
            seen = ctypes.create_string_buffer(n)
            copy(seen, block.address, n, False)
            assert seen.raw == b"answer!!" * (n // 8)
            pool.check()
        print("ok")
    """)
    result = run_python(owner, env=clean_env(KVA_CUDA_DRIVER=str(fake_driver),
                                             PYKVALLOC_LIB=str(pykvalloc._ffi.load().path)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "ok"


def test_torch_allocator_entry_points_on_the_fake_driver(fake_driver):
    """libkvalloc_torch's entry points as torch calls them (no torch here): a block freed with
    its stream's work pending reaches no other stream; pykvalloc.torch.stats follows."""
    run_with_driver(f"""
        import ctypes, sys
        import pykvalloc.torch as kvtorch
        assert "torch" not in sys.modules
        lib = ctypes.CDLL(str(kvtorch.library_path()))
        lib.kva_torch_alloc.restype = ctypes.c_void_p
        lib.kva_torch_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.kva_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                       ctypes.c_void_p]
        fake = ctypes.CDLL({str(fake_driver)!r})
        fake.fake_cuda_stream_hold.argtypes = [ctypes.c_void_p, ctypes.c_int]
        assert kvtorch.stats(0) is None
        from pykvalloc.errors import InvalidArgument
        try:
            kvtorch._configure(100)  # below one 512-byte unit: no pool can have it
        except InvalidArgument as error:
            assert "capacity" in str(error), error
        else:
            raise AssertionError("a 100-byte capacity was taken")
        kvtorch._configure(64 << 20)
        a, b = 1, 2  # CU_STREAM_LEGACY and CU_STREAM_PER_THREAD: streams that always exist
        p = lib.kva_torch_alloc(1 << 20, 0, a)
        assert p
        fake.fake_cuda_stream_hold(a, 1)
        lib.kva_torch_free(p, 1 << 20, 0, a)
        assert kvtorch.stats(0)["pending_blocks"] == 1
        q = lib.kva_torch_alloc(1 << 20, 0, b)
        assert q and q != p, "a block reached another stream before its stream's work was done"
        fake.fake_cuda_stream_hold(a, 0)
        lib.kva_torch_free(q, 1 << 20, 0, b)
        lib.kva_torch_free(ctypes.c_void_p(16), 8, 0, a)
        r = lib.kva_torch_alloc(4096, 0, b)
        lib.kva_torch_free(r, 4096, 0, b)
        figures = kvtorch.stats(0)
        assert figures["rejected_frees"] == 1 and figures["pending_blocks"] == 1, figures
    """, fake_driver)


def test_shared_mapping_cuda_arguments():
    with pytest.raises(pykvalloc.InvalidArgument, match="length"):
        pykvalloc.SharedMapping(3, backend="cuda")
    with pytest.raises(pykvalloc.InvalidArgument, match="length"):
        pykvalloc.SharedMapping(3, length=4096)
    with pytest.raises(pykvalloc.InvalidArgument, match="backend"):
        pykvalloc.SharedMapping(3, backend="rocm")


def test_gpu_check_runs_end_to_end_on_the_fake_driver(fake_driver):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "gpu_check.py"), "--quick"],
                            capture_output=True, text=True, timeout=120,
                            env=clean_env(KVA_CUDA_DRIVER=str(fake_driver)))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])["gpu_check"]
    assert report["device"] == "Fake CUDA GPU 0" and report["allocations"] > 49
    assert report["roundtrip_bytes"] > 0
    assert report["trim"]["mapped_after"] == 0
    assert report["trim"]["device_free_gain"] >= report["trim"]["mapped_before"] > 0
    other = report["other_mappings"]
    assert other["prefault_mapped"] > 0 and other["pinned_copy_bytes"] > 0
    assert other["watermark_idle_mapped"] <= report["granularity"]
    for row in report["latency"]["sizes"].values():
        assert set(row) == {"kvalloc", "cuMemAlloc"}
    assert "host -> device -> host" in result.stdout


def gpu_check_on(fake_driver, **fake) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "gpu_check.py"), "--quick"],
                          capture_output=True, text=True, timeout=120,
                          env=clean_env(KVA_CUDA_DRIVER=str(fake_driver), **fake))


@pytest.mark.parametrize("nth", [2, 75])
def test_gpu_check_sees_granules_sharing_memory(fake_driver, nth):
    # A driver (or a library) that maps a granule onto the memory of the one mapped before it:
    # two slab chunks of different allocations (the 2nd map), or two granules of one 32 MiB
    # block (the 75th of the 81 the check's first pool maps). Every allocation is written before
    # any is read back, and every 8-byte word holds its own offset, so either shows.
    result = gpu_check_on(fake_driver, FAKE_CUDA_ALIAS=str(nth))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED" in result.stderr and "changed" in result.stderr


def test_gpu_check_fails_on_a_refused_driver_call(fake_driver):
    # A driver refusing what the library asks once the pool exists is the failure the check is
    # for, not "no usable device" (exit 2, which CI reads as a skip).
    result = gpu_check_on(fake_driver, FAKE_CUDA_FAIL="cuMemUnmap:1:999")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED" in result.stderr and "cuMemUnmap" in result.stderr


@pytest.mark.parametrize("fake", [{"FAKE_CUDA_NO_VMM": "1"},
                                  {"FAKE_CUDA_FAIL": "cuDevicePrimaryCtxRetain:1:2"},
                                  {"FAKE_CUDA_FAIL": "cuDeviceGetCount:1:3"}])
def test_gpu_check_without_a_usable_device_skips(fake_driver, fake):
    # No virtual memory management, no context to be had (another process holds the GPU in
    # exclusive mode, or its memory), a driver that cannot count its devices: exit 2.
    result = gpu_check_on(fake_driver, **fake)
    assert result.returncode == 2 and "no usable CUDA device" in result.stderr, result.stderr


def test_gpu_check_without_a_driver_says_so():
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "gpu_check.py"), "--quick"],
                            capture_output=True, text=True, timeout=60,
                            env=clean_env(KVA_CUDA_DRIVER="/nonexistent/libcuda.so.1"))
    assert result.returncode == 2
    assert "no usable CUDA device" in result.stderr
