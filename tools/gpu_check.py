#!/usr/bin/env python3
"""gpu_check.py — the CUDA backend on a real GPU, in well under three minutes.

    python tools/gpu_check.py                  # device 0, a 1 GiB pool
    python tools/gpu_check.py --device 1 --capacity 4G --iterations 2000
    python tools/gpu_check.py --quick          # seconds; what the tests run on the fake driver

It checks, in order:
  1. the driver and the device (name, memory, driver version);
  2. a CUDA pool (``pykvalloc.Pool(backend="cuda")``): allocations of every slab size class and of
     every buddy order up to an eighth of the pool, all distinct, aligned and inside the pool,
     with ``Pool.check()`` passing, and the device's free memory (cuMemGetInfo) down by at least
     what the pool mapped for them;
  3. the data: a distinct pattern copied into every one of them (cuMemcpyHtoD), then every one
     copied back (cuMemcpyDtoH) and compared byte for byte, so that two allocations sharing
     device memory, or a granule mapped twice, would show;
  4. trim: every other allocation freed, ``Pool.trim()``, the survivors' bytes read back intact
     (a trim that unmapped a granule still in use would lose them); then everything freed,
     trimmed to nothing mapped, and the device's free memory up by what was unmapped;
  5. the other ways memory is mapped and given back: a prefaulted pool maps its whole capacity
     at creation; with ``trim_watermark`` a free unmaps what lies idle beyond it by itself; a
     host pool pinned for the device (``pin=True``, cuMemHostRegister) copies to and from a
     device allocation intact;
  6. a shared pool (``Pool(backend="cuda", shared=True)``): its allocation exported as a POSIX
     file descriptor (GPUDirect RDMA capable where the device says so), passed over a Unix
     socket to a second process (this script again, ``--import-shared``), which imports it at
     its own device address (``SharedMapping(fd, backend="cuda")``), reads back the pattern the
     owner wrote and writes its own, which the owner then reads: both see the same device bytes;
  7. where torch with CUDA is installed, torch's CUDA tensors on kvalloc (pykvalloc.torch.enable,
     a CUDAPluggableAllocator over libkvalloc_torch.so) in a child process: results computed on
     two streams checked, then torch.empty/del latency against torch's own caching allocator in
     another child (skipped, saying why, without torch or CUDA);
  8. allocation latency against cuMemAlloc/cuMemFree, both called through ctypes so that each
     pays the same call overhead (the ctypes floor is reported beside them): for each size, the
     first call (which maps device memory for kvalloc) and the median and p99 of warm calls.
It prints a short report, then one line of JSON (``{"gpu_check": ...}``) for the record.
Exit status: 0 all checks passed, 1 a check failed (a driver call the library makes that the
driver refuses included), 2 no usable driver or GPU (the driver cannot be loaded or has no such
device, or refuses the first CUDA pool at creation).

The driver is the one libkvalloc loads: $KVA_CUDA_DRIVER if set, else libcuda.so.1. The numbers
are only meaningful on a real GPU; on the fake driver of tests/fake_cuda the script still runs
every step, which is how CI keeps it working.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from ctypes import POINTER, byref, c_char, c_int, c_size_t, c_uint, c_ulonglong, c_void_p
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pykvalloc  # noqa: E402
from pykvalloc import _ffi  # noqa: E402
from pykvalloc.pool import Backend  # noqa: E402

DEADLINE_S = 170.0  # the whole run, safely inside the three minutes it promises
MiB = 1 << 20
CUdeviceptr = c_ulonglong


class CheckFailed(Exception):
    """A check did not hold; the message says which."""


class NoDevice(Exception):
    """No driver, no such device, or no pool of device memory to be had on it (exit 2): the
    check cannot run here, as opposed to failing."""


class Driver:
    """The few CUDA driver calls the check makes itself, through ctypes."""

    def __init__(self, device: int) -> None:
        self.path = os.environ.get("KVA_CUDA_DRIVER") or "libcuda.so.1"
        try:
            self.lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise pykvalloc.BackendError(f"no CUDA driver: cannot load {self.path}: {exc}") from exc
        signatures: dict[str, list[Any]] = {
            "cuInit": [c_uint],
            "cuDriverGetVersion": [POINTER(c_int)],
            "cuDeviceGetCount": [POINTER(c_int)],
            "cuDeviceGet": [POINTER(c_int), c_int],
            "cuDeviceGetName": [POINTER(c_char), c_int, c_int],
            "cuDeviceTotalMem_v2": [POINTER(c_size_t), c_int],
            "cuDevicePrimaryCtxRetain": [POINTER(c_void_p), c_int],
            "cuDevicePrimaryCtxRelease_v2": [c_int],
            "cuCtxPushCurrent_v2": [c_void_p],
            "cuCtxPopCurrent_v2": [POINTER(c_void_p)],
            "cuMemGetInfo_v2": [POINTER(c_size_t), POINTER(c_size_t)],
            "cuMemAlloc_v2": [POINTER(CUdeviceptr), c_size_t],
            "cuMemFree_v2": [CUdeviceptr],
            "cuMemcpyHtoD_v2": [CUdeviceptr, c_void_p, c_size_t],
            "cuMemcpyDtoH_v2": [c_void_p, CUdeviceptr, c_size_t],
            "cuDeviceGetAttribute": [POINTER(c_int), c_int, c_int],
        }
        for name, argtypes in signatures.items():
            function = getattr(self.lib, name)
            function.argtypes = argtypes
            function.restype = c_int
            setattr(self, name.removesuffix("_v2"), function)
        self.lib.cuGetErrorName.argtypes = [c_int, POINTER(ctypes.c_char_p)]
        self.lib.cuGetErrorName.restype = c_int

        result = self.cuInit(0)
        if result != 0:
            raise pykvalloc.BackendError(f"cuInit failed: {self.error(result)}")
        count = c_int()
        self.call("cuDeviceGetCount", byref(count))
        if not 0 <= device < count.value:
            raise pykvalloc.BackendError(f"no CUDA device {device}: {count.value} visible")
        self.device = c_int()
        self.call("cuDeviceGet", byref(self.device), device)
        name = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", name, 256, self.device)
        self.name = name.value.decode(errors="replace")
        total, version = c_size_t(), c_int()
        self.call("cuDeviceTotalMem", byref(total), self.device)
        self.call("cuDriverGetVersion", byref(version))
        self.total_memory, self.version = total.value, version.value
        # Our own context for our own calls; the library pushes and pops its own around its calls.
        self.context = c_void_p()
        self.call("cuDevicePrimaryCtxRetain", byref(self.context), self.device)
        self.call("cuCtxPushCurrent", self.context)

    def error(self, result: int) -> str:
        name = ctypes.c_char_p()
        if self.lib.cuGetErrorName(result, byref(name)) == 0 and name.value:
            return name.value.decode()
        return f"CUresult {result}"

    def call(self, name: str, *args: Any) -> None:
        result = getattr(self, name)(*args)
        if result != 0:
            raise CheckFailed(f"{name}: {self.error(result)}")

    def free_memory(self) -> int:
        free, total = c_size_t(), c_size_t()
        self.call("cuMemGetInfo", byref(free), byref(total))
        return free.value

    def close(self) -> None:
        popped = c_void_p()
        self.cuCtxPopCurrent(byref(popped))
        self.cuDevicePrimaryCtxRelease(self.device)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def allocate_everything(pool: pykvalloc.Pool) -> list[pykvalloc.Allocation]:
    """One allocation of every slab class and of every buddy order up to capacity / 8."""
    sizes = list(pykvalloc.size_classes())
    block = pool.min_block
    while block <= pool.capacity // 8:
        if block > _ffi.KVA_SLAB_MAX_SIZE:
            sizes.append(block)
        block <<= 1
    live = [pool.alloc(size) for size in sizes]
    spans = sorted((a.offset, a.offset + pool.usable_size(a)) for a in live)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        check(end <= start, f"allocations overlap at offset {start}")
    for allocation in live:
        check(0 <= allocation.offset < pool.capacity, f"{allocation!r} lies outside the pool")
        if allocation.size > _ffi.KVA_SLAB_MAX_SIZE:
            check(allocation.address % pool.usable_size(allocation) == 0,
                  f"{allocation!r} is not aligned to its block size")
    pool.check()
    return live


def pattern(allocation: pykvalloc.Allocation) -> bytes:
    """Bytes that differ at every 8-byte word of the pool: each word holds its own offset in
    the pool. Two places that share device memory then always disagree, within one allocation
    (two of its granules mapped onto one) as between two."""
    words = (allocation.size + 7) // 8
    offsets = np.arange(words, dtype=np.uint64) * np.uint64(8) + np.uint64(allocation.offset)
    return offsets.astype("<u8").tobytes()[:allocation.size]


def write_all(driver: Driver, allocations: list[pykvalloc.Allocation]) -> int:
    """Each allocation's pattern to the device; the bytes moved."""
    for allocation in allocations:
        driver.call("cuMemcpyHtoD", allocation.address, pattern(allocation), allocation.size)
    return sum(a.size for a in allocations)


def read_all(driver: Driver, allocations: list[pykvalloc.Allocation], when: str) -> int:
    """Each allocation back from the device, compared with its pattern; the bytes moved. Only
    after every pattern is written: a write through one allocation that lands in another's
    memory then shows as the other's bytes changed."""
    for allocation in allocations:
        back = ctypes.create_string_buffer(allocation.size)
        driver.call("cuMemcpyDtoH", back, allocation.address, allocation.size)
        check(back.raw == pattern(allocation), f"{when}: the bytes of {allocation!r} changed")
    return sum(a.size for a in allocations)


def other_mappings(driver: Driver, device: int, granularity: int) -> dict[str, Any]:
    """Prefault, trim_watermark and a pinned host pool (step 5 of the module docstring)."""
    result: dict[str, Any] = {}
    capacity = 16 * granularity
    with pykvalloc.Pool(capacity, backend="cuda", device=device, prefault=True) as pool:
        mapped = pool.stats().mapped_bytes
        check(mapped == pool.capacity, f"a prefaulted pool of {pool.capacity} bytes maps {mapped}")
        result["prefault_mapped"] = mapped
    with pykvalloc.Pool(capacity, backend="cuda", device=device, trim_watermark=granularity) as pool:
        blocks = [pool.alloc(granularity) for _ in range(8)]
        check(pool.stats().mapped_bytes >= 8 * granularity, "eight granules in use but not mapped")
        for block in blocks:
            pool.free(block)
        idle = pool.stats().mapped_bytes
        check(idle <= granularity, f"{idle} bytes stay mapped past a watermark of {granularity}")
        result["watermark_idle_mapped"] = idle
    with pykvalloc.Pool(capacity, pin=True) as host, \
            pykvalloc.Pool(capacity, backend="cuda", device=device) as pool:
        check(host.stats().pinned, "the host pool is not pinned")
        source, target = host.alloc(4 * MiB), pool.alloc(4 * MiB)
        view = source.view()
        view[:] = bytearray(pattern(target)[: 4 * MiB])
        driver.call("cuMemcpyHtoD", target.address, source.address, 4 * MiB)
        view[:] = 0
        driver.call("cuMemcpyDtoH", source.address, target.address, 4 * MiB)
        check(bytes(view) == pattern(target)[: 4 * MiB], "a copy through pinned memory changed the bytes")
        del view
        result["pinned_copy_bytes"] = 8 * MiB
    return result


RDMA_WITH_VMM_ATTRIBUTE = 110  # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
SHARED_BYTES = 4 * MiB


def shared_pattern(seed: int) -> bytes:
    return (np.arange(SHARED_BYTES, dtype=np.uint64) * seed + 1).astype(np.uint8).tobytes()


def shared_pool(driver: Driver, device: int) -> dict[str, Any]:
    """Step 6: one shared CUDA pool, its allocation imported by a second process."""
    rdma = c_int()
    rdma_known = driver.cuDeviceGetAttribute(byref(rdma), RDMA_WITH_VMM_ATTRIBUTE, driver.device) == 0
    with pykvalloc.Pool(64 * MiB, backend="cuda", device=device, shared=True) as pool:
        mapped = pool.stats().mapped_bytes
        check(mapped >= pool.capacity, "a shared CUDA pool does not map its capacity at creation")
        block = pool.alloc(SHARED_BYTES)
        written = shared_pattern(7)
        driver.call("cuMemcpyHtoD", block.address, written, SHARED_BYTES)
        fd = pool.shared_fd()
        parent, child = socket.socketpair()
        try:
            worker = subprocess.Popen(
                [sys.executable, __file__, "--device", str(device), "--import-shared",
                 str(child.fileno())], pass_fds=[child.fileno()], stderr=subprocess.PIPE, text=True)
            child.close()
            socket.send_fds(parent, [f"{block.offset} {mapped} {pool.base}".encode()], [fd])
            parent.settimeout(120)  # a bound against a hang, never a measure
            answer = parent.recv(64).decode()
            _, errors = worker.communicate(timeout=120)
        finally:
            os.close(fd)
            parent.close()
        check(worker.returncode == 0, f"the importing process failed: {errors.strip()}")
        imported_base = int(answer)
        seen = ctypes.create_string_buffer(SHARED_BYTES)
        driver.call("cuMemcpyDtoH", seen, block.address, SHARED_BYTES)
        check(seen.raw == shared_pattern(3), "the owner does not see what the importer wrote")
        pool.free(block)
        pool.check()
    return {"bytes": SHARED_BYTES, "owner_base": hex(pool.base), "importer_base": hex(imported_base),
            "rdma_with_vmm": bool(rdma.value) if rdma_known else None}


def import_shared(device: int, sock_fd: int) -> int:
    """The second process of step 6: import, compare, answer with its own pattern."""
    driver = Driver(device)
    try:
        sock = socket.socket(fileno=sock_fd)
        message, fds, _, _ = socket.recv_fds(sock, 256, 1)
        offset, mapped, owner_base = (int(x) for x in message.decode().split())
        with pykvalloc.SharedMapping(fds[0], backend="cuda", length=mapped, device=device) as mapping:
            os.close(fds[0])
            seen = ctypes.create_string_buffer(SHARED_BYTES)
            driver.call("cuMemcpyDtoH", seen, mapping.base + offset, SHARED_BYTES)
            check(seen.raw == shared_pattern(7), "the importer does not see the owner's bytes")
            driver.call("cuMemcpyHtoD", mapping.base + offset, shared_pattern(3), SHARED_BYTES)
            sock.sendall(str(mapping.base).encode())
        return 0
    except (CheckFailed, pykvalloc.KvallocError) as exc:
        print(f"import: {exc}", file=sys.stderr)
        return 1
    finally:
        driver.close()


TORCH_CHILD = r"""
import json, statistics, sys, time
import torch
use_kvalloc = sys.argv[1] == "kvalloc"
if use_kvalloc:
    import pykvalloc.torch as kvtorch
    kvtorch.enable(capacity=int(sys.argv[2]))
device = torch.device("cuda", int(sys.argv[3]))
iterations = int(sys.argv[4])
side, other = torch.cuda.Stream(device), torch.cuda.Stream(device)
with torch.cuda.stream(side):
    a = torch.arange(1 << 20, device=device, dtype=torch.float32)
    b = a * 2
with torch.cuda.stream(other):
    other.wait_stream(side)
    c = (a + b).sum().item()
expected = 3.0 * ((1 << 20) - 1) * (1 << 20) / 2
assert abs(c - expected) <= expected * 1e-6, (c, expected)
del a, b
torch.cuda.synchronize(device)
latency = {}
for size in (256, 64 << 10, 2 << 20, 64 << 20):
    samples = []
    for _ in range(iterations):
        began = time.perf_counter_ns()
        x = torch.empty(size, dtype=torch.uint8, device=device)
        del x
        samples.append(time.perf_counter_ns() - began)
    latency[size] = round(statistics.median(samples) / 1000, 2)
report = {"alloc_free_p50_us": latency}
if use_kvalloc:
    report["pool"] = kvtorch.stats(device.index)
print(json.dumps(report))
"""


def torch_allocator(device: int, capacity: int, iterations: int) -> dict[str, Any]:
    """Step 7, each side in a child: torch's allocator can be chosen only before a process's
    first CUDA allocation."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0 or probe.stdout.strip() != "True":
        reason = "no torch" if probe.returncode != 0 else "torch sees no CUDA device"
        return {"skipped": reason}
    result: dict[str, Any] = {}
    for side in ("kvalloc", "caching"):
        done = subprocess.run([sys.executable, "-c", TORCH_CHILD, side, str(capacity), str(device),
                               str(iterations)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        check(done.returncode == 0, f"torch on the {side} allocator failed: {done.stderr.strip()[-500:]}")
        result[side] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def percentile(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def latency(driver: Driver, capacity: int, device: int, sizes: list[int], iterations: int,
            deadline: float) -> dict[str, Any]:
    """Alloc and free timings (µs) of kva_alloc/kva_free and cuMemAlloc/cuMemFree."""
    lib = _ffi.load()
    config = _ffi.KvaConfig()
    lib.kva_config_init(byref(config))
    config.capacity = capacity
    config.backend = int(Backend.CUDA)
    config.device = device
    handle = c_void_p()
    lib.kva_pool_create(byref(config), byref(handle))
    clock = time.perf_counter_ns
    out = c_void_p()
    dptr = CUdeviceptr()
    floor = []
    for _ in range(min(iterations, 1000)):
        start = clock()
        lib.kva_usable_size(handle, None)
        floor.append(clock() - start)
    results: dict[str, Any] = {"ctypes_floor_us": percentile(floor, 0.5), "sizes": {}}
    try:
        for size in sizes:
            row: dict[str, Any] = {}
            for name, alloc, free in (
                    ("kvalloc", lambda s: lib.kva_alloc(handle, s, byref(out)) or out.value,
                     lambda p: lib.kva_free(handle, p)),
                    ("cuMemAlloc",
                     lambda s: driver.call("cuMemAlloc", byref(dptr), s) or dptr.value,
                     lambda p: driver.call("cuMemFree", p))):
                start = clock()
                first = alloc(size)
                first_ns = clock() - start
                free(first)
                allocs, frees = [], []
                for _ in range(iterations):
                    if time.monotonic() > deadline:
                        break
                    start = clock()
                    pointer = alloc(size)
                    middle = clock()
                    free(pointer)
                    allocs.append(middle - start)
                    frees.append(clock() - middle)
                row[name] = {"first_alloc_us": first_ns / 1000.0, "samples": len(allocs),
                             "alloc_p50_us": percentile(allocs, 0.5) if allocs else None,
                             "alloc_p99_us": percentile(allocs, 0.99) if allocs else None,
                             "free_p50_us": percentile(frees, 0.5) if frees else None,
                             "free_p99_us": percentile(frees, 0.99) if frees else None}
            results["sizes"][str(size)] = row
    finally:
        lib.kva_pool_destroy(handle)
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    deadline = began + (DEADLINE_S if not args.quick else 30.0)
    try:
        driver = Driver(args.device)
    except (pykvalloc.BackendError, CheckFailed) as exc:  # no driver, no device, no context
        raise NoDevice(str(exc)) from exc
    report: dict[str, Any] = {"device": driver.name, "device_index": args.device,
                              "device_memory": driver.total_memory,
                              "driver_version": driver.version, "driver": driver.path}
    try:
        try:
            first_pool = pykvalloc.Pool(args.capacity, backend="cuda", device=args.device)
        except pykvalloc.BackendError as exc:  # no virtual memory management on this device
            raise NoDevice(str(exc)) from exc
        with first_pool as pool:
            stats = pool.stats()
            check(stats.backend is Backend.CUDA, "the pool is not a CUDA pool")
            check(stats.mapped_bytes == 0, "a fresh CUDA pool already maps memory")
            granularity = stats.page_size
            report.update(capacity=pool.capacity, granularity=granularity, base=hex(pool.base))

            free_at_start = driver.free_memory()
            live = allocate_everything(pool)
            mapped = pool.stats().mapped_bytes
            taken = free_at_start - driver.free_memory()
            check(mapped > 0, "allocations were made but nothing is mapped")
            check(taken >= mapped, f"the pool maps {mapped} bytes but the device lost only {taken}")
            report["allocations"] = len(live)
            report["mapped_after_allocating"] = mapped
            try:
                live[0].view()
                raise CheckFailed("a view of GPU memory was allowed")
            except pykvalloc.InvalidArgument:
                pass

            check(any(a.size > granularity for a in live), "no allocation spans several granules")
            moved = write_all(driver, live)
            moved += read_all(driver, live, "after writing every allocation")
            report["roundtrip_bytes"] = moved

            # Half freed and trimmed: the other half's bytes must survive.
            for allocation in live[::2]:
                pool.free(allocation)
            pool.trim()
            survivors = live[1::2]
            report["roundtrip_bytes"] += read_all(driver, survivors, "after trimming around it")
            pool.check()

            free_before = driver.free_memory()
            for allocation in survivors:
                pool.free(allocation)
            before_trim = pool.stats().mapped_bytes
            check(before_trim > 0, "nothing stays mapped once freed, so trim has nothing to show")
            pool.trim()
            after_trim = pool.stats().mapped_bytes
            gained = driver.free_memory() - free_before
            check(after_trim == 0, f"{after_trim} bytes still mapped after trim")
            check(gained >= before_trim, f"trim unmapped {before_trim} bytes but the device "
                                         f"gained only {gained}")
            pool.check()
            report["trim"] = {"mapped_before": before_trim, "mapped_after": after_trim,
                              "device_free_gain": gained}

        report["other_mappings"] = other_mappings(driver, args.device, granularity)
        report["shared"] = shared_pool(driver, args.device)
        report["torch"] = torch_allocator(args.device, args.capacity, args.iterations)
        sizes = [256, 64 << 10, 2 * MiB, 64 * MiB] if not args.quick else [256, 2 * MiB]
        report["latency"] = latency(driver, args.capacity, args.device, sizes, args.iterations,
                                    deadline)
    finally:
        driver.close()
    report["elapsed_s"] = round(time.monotonic() - began, 2)
    return report


def print_report(report: dict[str, Any]) -> None:
    gib = report["device_memory"] / (1 << 30)
    print(f"device {report['device_index']}: {report['device']} ({gib:.1f} GiB), "
          f"driver {report['driver_version']} ({report['driver']})")
    print(f"pool: {report['capacity'] >> 20} MiB at {report['base']}, "
          f"granularity {report['granularity'] >> 10} KiB")
    print(f"allocations: {report['allocations']} (every slab class and buddy order), "
          f"{report['mapped_after_allocating'] >> 20} MiB mapped; check passed")
    print(f"data: {report['roundtrip_bytes']} bytes host -> device -> host, every allocation "
          f"written before any was read, and the survivors of a trim read again: identical")
    other = report["other_mappings"]
    print(f"prefault maps {other['prefault_mapped'] >> 20} MiB at creation; with a watermark "
          f"{other['watermark_idle_mapped'] >> 10} KiB stay mapped once freed; "
          f"{other['pinned_copy_bytes'] >> 20} MiB copied through pinned host memory")
    shared = report["shared"]
    rdma = {True: "RDMA capable", False: "no RDMA with VMM", None: "RDMA unknown"}[shared["rdma_with_vmm"]]
    print(f"shared pool: {shared['bytes'] >> 20} MiB written by the owner at {shared['owner_base']} "
          f"read by a second process at {shared['importer_base']}, and back ({rdma})")
    torch_report = report["torch"]
    if "skipped" in torch_report:
        print(f"torch allocator: skipped ({torch_report['skipped']})")
    else:
        print("torch.empty + del, µs p50 (kvalloc / torch caching allocator): " + ", ".join(
            f"{int(size)} B {torch_report['kvalloc']['alloc_free_p50_us'][size]} / "
            f"{torch_report['caching']['alloc_free_p50_us'][size]}"
            for size in torch_report["kvalloc"]["alloc_free_p50_us"]))
    trim = report["trim"]
    print(f"trim: {trim['mapped_before'] >> 20} MiB mapped -> {trim['mapped_after']}; "
          f"device free memory +{trim['device_free_gain'] >> 20} MiB")
    lat = report["latency"]
    print(f"latency, µs (ctypes call floor {lat['ctypes_floor_us']:.2f}):")
    print(f"  {'size':>10}  {'allocator':<10} {'first':>9} {'alloc p50':>9} {'p99':>9} "
          f"{'free p50':>9} {'p99':>9}")
    for size, row in lat["sizes"].items():
        for name, figures in row.items():
            cells = [figures["first_alloc_us"], figures["alloc_p50_us"], figures["alloc_p99_us"],
                     figures["free_p50_us"], figures["free_p99_us"]]
            text = " ".join(f"{c:9.2f}" if c is not None else f"{'-':>9}" for c in cells)
            print(f"  {int(size):>10}  {name:<10} {text}")
    print(f"elapsed: {report['elapsed_s']} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--capacity", type=pykvalloc.parse_size, default=1 << 30,
                        help="pool bytes (suffixes K, M, G); default 1G")
    parser.add_argument("--iterations", type=int, default=1000,
                        help="timed alloc/free pairs per size and allocator")
    parser.add_argument("--quick", action="store_true", help="small sizes, 30 s budget")
    parser.add_argument("--import-shared", type=int, metavar="SOCKET_FD", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.import_shared is not None:
        return import_shared(args.device, args.import_shared)
    if args.quick:
        args.capacity = min(args.capacity, 256 * MiB)
        args.iterations = min(args.iterations, 50)
    try:
        report = run(args)
    except NoDevice as exc:
        print(f"gpu_check: no usable CUDA device: {exc}", file=sys.stderr)
        return 2
    except (CheckFailed, pykvalloc.KvallocError) as exc:
        print(f"gpu_check: FAILED: {exc}", file=sys.stderr)
        return 1
    print_report(report)
    print(json.dumps({"gpu_check": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
