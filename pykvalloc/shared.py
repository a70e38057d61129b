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
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

from . import _ffi
from ._owner import HandleOwner, refuse_copy
from .errors import InvalidArgument
from .sizes import format_size

__all__ = ["SharedMapping"]


class _MappingAnchor:
    """The numpy base object of a view: it keeps its mapping alive."""

    __slots__ = ("mapping", "_interface", "__weakref__")

    def __init__(self, mapping: SharedMapping, address: int, nbytes: int) -> None:
        self.mapping = mapping
        self._interface = {"version": 3, "shape": (nbytes,), "typestr": "|u1",
                           "data": (address, False)}

    @property
    def __array_interface__(self) -> dict[str, object]:
        return self._interface

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        refuse_copy(self)


class SharedMapping(HandleOwner):
    """A shared pool's memory, mapped from the descriptor ``fd`` (which stays the caller's to
    close: the mapping does not need it)."""

    __slots__ = ("_lib", "_base", "_length")

    _fork_rank = 1

    def __init__(self, fd: int) -> None:
        if isinstance(fd, bool) or not isinstance(fd, int):
            raise TypeError(f"fd must be an int, not {type(fd).__name__}")
        if fd < 0 or fd > 0x7FFFFFFF:
            raise InvalidArgument(f"descriptor {fd} is not a file descriptor")
        lib = _ffi.load()
        handle = c_void_p()
        lib.kva_shared_attach(fd, byref(handle))
        if not handle.value:
            raise InvalidArgument("kva_shared_attach returned no map")
        self._own(handle.value, lib.kva_shared_detach)
        self._lib = lib
        self._base = lib.kva_shared_base(handle.value) or 0
        self._length = lib.kva_shared_length(handle.value)

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
        dt = np.dtype(dtype)
        if dt.hasobject or dt.itemsize == 0:
            raise InvalidArgument(f"dtype {dt} cannot view raw memory")
        if isinstance(offset, bool) or isinstance(nbytes, bool):
            raise TypeError("offset and nbytes are ints")
        if offset < 0 or nbytes < 0 or offset + nbytes > self._length:
            raise InvalidArgument(f"[{offset}, {offset + nbytes}) is outside the "
                                  f"{self._length}-byte mapping")
        if nbytes % dt.itemsize:
            raise InvalidArgument(f"{nbytes} bytes are not a whole number of {dt}")
        with self._lock:
            self._open_handle()
            anchor = _MappingAnchor(self, self._base + offset, nbytes)
            released = weakref.finalize(anchor, self._user_gone)
            released.atexit = False
            self._add_user()
        return np.asarray(anchor).view(dt)
