"""Exceptions raised by pykvalloc.

Every failing ``kva_status`` from the C library becomes one of the classes below, carrying the
library's own words: the status name (``kva_strerror``) and the detail of this failure
(``kva_last_error``). A few misuses are caught in Python before they reach C, because passing
them on would be unsafe (a stale address may already belong to a newer allocation); those raise
the same classes, so callers handle one hierarchy whichever side noticed.

The classes that have a natural built-in counterpart also derive from it, so code that only
knows Python still does the right thing: ``except MemoryError`` catches an exhausted pool and
``except ValueError`` catches a bad argument.
"""

from __future__ import annotations

__all__ = [
    "KvallocError",
    "OutOfMemory",
    "InvalidArgument",
    "DoubleFree",
    "InvalidPointer",
    "BackendError",
    "CorruptionError",
    "PoolClosedError",
    "AllocationFreedError",
    "AllocationInUseError",
    "LibraryNotFoundError",
    "SegmentError",
    "SegmentNotFound",
    "SegmentUnreadable",
    "AmbiguousSegment",
    "BadMagic",
    "UnsupportedVersion",
    "CorruptSegment",
    "TruncatedSegment",
    "InconsistentSnapshot",
    "WriterGone",
    "DeadWriter",
    "SegmentRemoved",
    "error_for_status",
]


class KvallocError(Exception):
    """Base class of every error pykvalloc raises.

    ``status`` is the C ``kva_status`` value the error stands for (None for errors that only
    exist on the Python side), ``detail`` the library's description of this particular failure
    and ``function`` the C entry point that reported it (None when Python caught it first).
    """

    status: int | None = None

    def __init__(self, message: str, *, detail: str = "", function: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail
        self.function = function


class OutOfMemory(KvallocError, MemoryError):
    """The pool has no free range large enough right now (KVA_ERR_NOMEM)."""

    status = 1


class InvalidArgument(KvallocError, ValueError):
    """A bad argument or configuration (KVA_ERR_INVALID)."""

    status = 2


class DoubleFree(KvallocError):
    """The memory is already free (KVA_ERR_DOUBLE_FREE)."""

    status = 3


class InvalidPointer(KvallocError):
    """Not an allocation of this pool (KVA_ERR_BAD_POINTER)."""

    status = 4


class BackendError(KvallocError, OSError):
    """The backing memory could not be obtained: mmap or hugetlb refused (KVA_ERR_BACKEND)."""

    status = 5


class CorruptionError(KvallocError):
    """The pool's memory or metadata is damaged (KVA_ERR_CORRUPT): ``check()`` found a broken
    invariant, or a checked pool found its poison or a red zone overwritten (``free`` and
    ``alloc`` raise it then)."""

    status = 6


class PoolClosedError(KvallocError):
    """The pool was closed; its handle may no longer be used."""


class AllocationFreedError(KvallocError):
    """The allocation was freed; its memory may already belong to another allocation."""


class AllocationInUseError(KvallocError, BufferError):
    """The allocation cannot be freed while numpy views of it are alive.

    Freeing it would hand the same bytes to the next allocation while the old view can still
    write them. Like ``mmap.close()`` with exported buffers, the free is refused instead.
    """


class LibraryNotFoundError(KvallocError, OSError):
    """libkvalloc could not be found or loaded; the message lists every path tried."""


class SegmentError(KvallocError):
    """A pool's statistics segment (``pykvalloc.stats``) cannot be read; ``path`` names it.

    The segment is written by another process and read without trusting it, so each way it can
    be wrong has its own class below; ``kind`` names it in a word or two for people (a row of
    ``kvalloc ls``, the inspector's picker), where the class name is Python's.
    """

    kind = "unreadable"

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class SegmentNotFound(SegmentError, FileNotFoundError):
    """No segment matches the pool asked for."""

    kind = "not found"


class SegmentUnreadable(SegmentError, OSError):
    """A file named like a segment that cannot be read as one: it cannot be opened (permission,
    a symbolic link) or mapped, or it is not a regular file (a directory, a FIFO). Unlike
    ``SegmentNotFound``, the file is there: ``kvalloc ls`` lists it as unreadable."""


class AmbiguousSegment(SegmentError, LookupError):
    """Several segments match the pool asked for; the message lists them."""

    kind = "ambiguous"


class BadMagic(SegmentError):
    """The file does not start with the segment magic: it is not a kvalloc statistics segment."""

    kind = "not a segment"


class UnsupportedVersion(SegmentError):
    """The segment's layout version (``abi_major``) is not the one this reader understands."""

    kind = "unknown layout"


class CorruptSegment(SegmentError):
    """A field of the segment contradicts the segment itself: a section outside its bounds, a
    count larger than its section."""

    kind = "corrupt"


class TruncatedSegment(CorruptSegment):
    """The file is shorter than its header or than the size the header states."""

    kind = "truncated"


class InconsistentSnapshot(SegmentError):
    """The writer kept changing the segment: no consistent copy was had in the bounded number of
    attempts. Torn data is never returned instead."""

    kind = "inconsistent"


class WriterGone(SegmentError):
    """The pool behind the segment will publish no more: its process ended or it was destroyed."""

    kind = "gone"


class DeadWriter(WriterGone):
    """The process that wrote the segment is gone (killed before it could remove the segment);
    ``kvalloc ls --prune`` removes such leftovers."""

    kind = "dead writer"


class SegmentRemoved(WriterGone):
    """The segment was removed while it was being watched: the pool was destroyed or its process
    exited normally."""

    kind = "removed"


_BY_STATUS: dict[int, type[KvallocError]] = {
    cls.status: cls
    for cls in (OutOfMemory, InvalidArgument, DoubleFree, InvalidPointer, BackendError,
                CorruptionError)
    if cls.status is not None
}


def error_for_status(status: int, name: str, detail: str, function: str | None) -> KvallocError:
    """The exception for a failing ``kva_status``; an unknown status gets the base class."""
    cls = _BY_STATUS.get(status, KvallocError)
    message = f"{name}: {detail}" if detail else name
    error = cls(message, detail=detail, function=function)
    if cls is KvallocError:
        error.status = status
    return error
