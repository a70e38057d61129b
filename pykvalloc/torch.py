"""``pykvalloc.torch``: PyTorch's CUDA allocations served by libkvalloc (libkvalloc_torch.so).

``enable()`` makes kvalloc torch's CUDA allocator for the whole process
(``torch.cuda.memory.change_current_allocator`` with a ``CUDAPluggableAllocator``; torch allows
it only before its first CUDA allocation). ``mem_pool()`` gives a ``torch.cuda.MemPool`` over
the same allocator instead, for ``with torch.cuda.use_mem_pool(pool):`` blocks, where the
installed torch has MemPool. Per GPU one variable-size pool of ``capacity`` bytes (default half
the GPU's memory), mapped when the first tensor is made on that GPU.

Streams (libkvalloc/torch/kvalloc_torch.h says it in full): a tensor's memory freed on stream S
is not handed to another stream until the work queued on S before the free is done (an event
recorded at the free, queried before reuse, waited for when the pool is full); it may be taken
back on S itself at once. ``Tensor.record_stream`` uses on other streams are not tracked.

torch is imported by the calls here, never by ``import pykvalloc`` nor by importing this module.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, byref, c_int, c_size_t
from pathlib import Path
from typing import Any

from . import _ffi
from .errors import BackendError, InvalidArgument, LibraryNotFoundError

__all__ = ["library_path", "allocator", "enable", "mem_pool", "stats"]

ENV_VAR = "PYKVALLOC_TORCH_LIB"
ALLOC_FN, FREE_FN = "kva_torch_alloc", "kva_torch_free"

_library: ctypes.CDLL | None = None


def library_path() -> Path:
    """libkvalloc_torch.so: ``$PYKVALLOC_TORCH_LIB``, else the file beside the libkvalloc.so
    this package loads (a build directory or the installed package)."""
    override = os.environ.get(ENV_VAR)
    path = Path(override) if override else _ffi.load().path.with_name("libkvalloc_torch.so")
    if not path.is_file():
        raise LibraryNotFoundError(f"no libkvalloc_torch.so at {path} (build it with CMake, or set "
                                   f"{ENV_VAR})")
    return path


def _lib() -> ctypes.CDLL:
    global _library
    if _library is None:
        lib = ctypes.CDLL(str(library_path()))
        lib.kva_torch_configure.argtypes = [c_size_t]
        lib.kva_torch_configure.restype = c_int
        lib.kva_torch_stats.argtypes = [c_int, POINTER(c_size_t), POINTER(c_size_t),
                                        POINTER(c_size_t)]
        lib.kva_torch_stats.restype = c_int
        lib.kva_torch_last_error.restype = ctypes.c_char_p
        lib.kva_torch_rejected_frees.restype = ctypes.c_ulong
        _library = lib
    return _library


def _configure(capacity: int | None) -> None:
    if capacity is None:
        return
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 < capacity < 1 << 64:
        raise InvalidArgument(f"capacity {capacity!r} is not a size in bytes")
    lib = _lib()
    result = lib.kva_torch_configure(capacity)
    if result == -2:
        raise InvalidArgument(lib.kva_torch_last_error().decode(errors="replace"))
    if result != 0:
        raise InvalidArgument("a kvalloc torch pool exists already: its capacity is fixed")


def allocator(capacity: int | None = None) -> Any:
    """A ``torch.cuda.memory.CUDAPluggableAllocator`` over libkvalloc_torch.so, pools of
    ``capacity`` bytes (None: the library's default). BackendError where torch has no CUDA."""
    import torch  # noqa: PLC0415 - lazily: pykvalloc never imports torch by itself

    pluggable = getattr(torch.cuda.memory, "CUDAPluggableAllocator", None)
    if pluggable is None or not hasattr(torch._C, "_cuda_customAllocator"):
        raise BackendError(f"torch {torch.__version__} has no CUDA pluggable allocator (a CPU "
                           "build?)")
    _configure(capacity)
    return pluggable(str(library_path()), ALLOC_FN, FREE_FN)


def enable(capacity: int | None = None) -> Any:
    """Makes kvalloc the process's CUDA allocator for torch; returns the allocator. torch
    refuses (RuntimeError) once it has allocated CUDA memory with another."""
    import torch  # noqa: PLC0415

    chosen = allocator(capacity)
    torch.cuda.memory.change_current_allocator(chosen)
    return chosen


def mem_pool(capacity: int | None = None) -> Any:
    """A ``torch.cuda.MemPool`` whose memory comes from kvalloc, for
    ``torch.cuda.use_mem_pool``; BackendError where the installed torch has no MemPool."""
    import torch  # noqa: PLC0415

    pool_class = getattr(torch.cuda, "MemPool", None)
    if pool_class is None:
        raise BackendError(f"torch {torch.__version__} has no torch.cuda.MemPool: use enable()")
    return pool_class(allocator(capacity).allocator())


def stats(device: int = 0) -> dict[str, int] | None:
    """The device's pool: bytes live, bytes and blocks freed but waiting for their stream's
    work, frees ignored; None before its first allocation."""
    live, pending, blocks = c_size_t(), c_size_t(), c_size_t()
    lib = _lib()
    if lib.kva_torch_stats(device, byref(live), byref(pending), byref(blocks)) != 0:
        return None
    return {"live_bytes": live.value, "pending_bytes": pending.value,
            "pending_blocks": blocks.value, "rejected_frees": lib.kva_torch_rejected_frees()}
