"""``SharedMapping``: a shared pool's memory mapped in another process (``kva_shared_attach``).

The owning process makes a ``Pool(..., shared=True)`` and hands ``pool.shared_fd()`` to another
process (``socket.send_fds`` over a Unix socket, or ``pass_fds`` to a child). There
``SharedMapping(fd)`` maps the same memory, read-write, at an address of its own: offset ``o``
of the owner's pool is ``mapping.base + o``. The mapping is memory only: the owner alone
allocates and frees (its metadata never leaves it), and tells the others which offsets to read
or write. A descriptor that is not a kvalloc shared pool raises ``InvalidArgument`` and maps
nothing. The mapping stays valid whatever the owner does (the memory lives while any process
maps it) until ``close()``; numpy views from ``view()`` keep it mapped past ``close()`` as a
pool's views do.
"""

from __future__ import annotations

import weakref
from ctypes import byref, c_void_p
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

from . import _ffi
from ._owner import ArrayAnchor, HandleOwner
from .errors import InvalidArgument
from .sizes import format_size

__all__ = ["SharedMapping"]


class SharedMapping(HandleOwner):
    """A shared pool's memory, mapped from the descriptor ``fd`` (which stays the caller's to
    close: the mapping does not need it).

    ``backend="cuda"`` imports a shared CUDA pool's allocation instead (the owner's
    ``shared_fd()`` of a ``Pool(backend="cuda", shared=True)``) and maps it for GPU ``device``:
    ``length`` is the owner's ``stats().mapped_bytes``, and ``base`` is a device address, which
    ``view()`` refuses as a CUDA pool's allocations do. One allocation is imported at most once
    per process at a time (``InvalidArgument`` for a second import)."""

    __slots__ = ("_lib", "_base", "_length", "_backend")

    _fork_rank = 1

    def __init__(self, fd: int, *, backend: str = "host", length: int | None = None,
                 device: int = 0) -> None:
        if isinstance(fd, bool) or not isinstance(fd, int):
            raise TypeError(f"fd must be an int, not {type(fd).__name__}")
        if fd < 0 or fd > 0x7FFFFFFF:
            raise InvalidArgument(f"descriptor {fd} is not a file descriptor")
        if backend not in ("host", "cuda"):
            raise InvalidArgument(f"backend {backend!r}: 'host' or 'cuda'")
        if (length is not None) != (backend == "cuda"):
            raise InvalidArgument("length is the imported CUDA allocation's, and only for "
                                  "backend='cuda'")
        lib = _ffi.load()
        handle = c_void_p()
        if backend == "cuda":
            if isinstance(device, bool) or not 0 <= device <= 0x7FFFFFFF:
                raise InvalidArgument(f"device {device} is not a GPU ordinal")
            if length is None or isinstance(length, bool) or not 0 < length < 1 << 64:
                raise InvalidArgument(f"length {length} is not a size")
            lib.kva_shared_attach_cuda(device, fd, length, byref(handle))
        else:
            lib.kva_shared_attach(fd, byref(handle))
        if not handle.value:
            raise InvalidArgument("kva_shared_attach returned no map")
        self._own(handle.value, lib.kva_shared_detach)
        self._lib = lib
        self._base = lib.kva_shared_base(handle.value) or 0
        self._length = lib.kva_shared_length(handle.value)
        self._backend = backend

    @property
    def backend(self) -> str:
        """``"host"``, or ``"cuda"`` for an imported CUDA allocation (device addresses)."""
        return self._backend

    def _describe(self) -> str:
        return f"{format_size(self._length)} at {self._base:#x}"

    @property
    def base(self) -> int:
        """The address of the owner's offset 0 in this process."""
        return self._base

    @property
    def length(self) -> int:
        """Bytes mapped: the owner's whole region (at least its capacity)."""
        return self._length

    def view(self, offset: int, nbytes: int,
             dtype: npt.DTypeLike = np.uint8) -> npt.NDArray[Any]:
        """A writable numpy array over ``nbytes`` bytes at the owner's ``offset``; it keeps the
        mapping alive."""
        if self._backend == "cuda":
            raise InvalidArgument(f"{self!r} is GPU memory, which the CPU cannot access: copy "
                                  "it with the CUDA API, or wrap the address in a GPU array")
        dt = np.dtype(dtype)
        if dt.hasobject or dt.itemsize == 0:
            raise InvalidArgument(f"dtype {dt} cannot view raw memory")
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                   for v in (offset, nbytes)):
            raise InvalidArgument(f"offset and nbytes must be integers, not {offset!r} and "
                                  f"{nbytes!r}")
        offset, nbytes = int(offset), int(nbytes)
        if offset < 0 or nbytes < 0 or offset + nbytes > self._length:
            raise InvalidArgument(f"[{offset}, {offset + nbytes}) is outside the "
                                  f"{self._length}-byte mapping")
        if nbytes % dt.itemsize:
            raise InvalidArgument(f"{nbytes} bytes are not a whole number of {dt}")
        with self._lock:
            self._open_handle()
            anchor = ArrayAnchor(self, self._base + offset, nbytes)
            released = weakref.finalize(anchor, self._user_gone)
            released.atexit = False
            self._add_user()
        return np.asarray(anchor).view(dt)
