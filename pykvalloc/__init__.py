"""pykvalloc: Python bindings (ctypes) for libkvalloc, a KV-cache memory allocator.

    >>> import pykvalloc
    >>> with pykvalloc.Pool(64 << 20, name="kv") as pool:
    ...     page = pool.alloc(4096)
    ...     keys = page.view("float16")   # a numpy array over the pool's memory
    ...     keys[:] = 1.0
    ...     del keys                      # a live view pins its allocation
    ...     pool.free(page)

The shared library is loaded on first use; ``$PYKVALLOC_LIB`` overrides where it comes from.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from .errors import (
    AllocationFreedError,
    AllocationInUseError,
    BackendError,
    CorruptionError,
    DoubleFree,
    InvalidArgument,
    InvalidPointer,
    KvallocError,
    LibraryNotFoundError,
    OutOfMemory,
    PoolClosedError,
    SegmentError,
)
from .decode_step import DecodeStep
from .kvcache import (
    DEFAULT_BLOCK_TOKENS,
    Admitted,
    AllBlocksCleared,
    BlockRemoved,
    Blocks,
    BlockStored,
    CopyOnWrite,
    Extended,
    KVCache,
    KVEvent,
    KVEvents,
    KVGauges,
    NamespaceShare,
    KVGroup,
    KVInfo,
    KVLayerInfo,
    KVLayout,
    KVMode,
    KVStats,
    Lookup,
    LookupMany,
    Move,
    Pin,
    Sequence,
    TableInUseError,
)
from .pool import (
    Allocation,
    Backend,
    ClassStats,
    HeapRegion,
    NumaPolicy,
    PageKind,
    PageMode,
    Pool,
    PoolOptions,
    Stats,
    WalkKind,
)
from .shared import SharedMapping
from .sizes import format_size, parse_size, size_class_of, size_classes
from .tensor import ExportError, Tensor, TensorDType
from .varpool import VarPool, VarStats

try:
    __version__: str = _metadata.version("pykvalloc")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Tensor",
    "TensorDType",
    "ExportError",
    "KVCache",
    "KVGroup",
    "KVLayerInfo",
    "KVStats",
    "NamespaceShare",
    "KVGauges",
    "KVInfo",
    "DEFAULT_BLOCK_TOKENS",
    "Sequence",
    "Pin",
    "CopyOnWrite",
    "Move",
    "Blocks",
    "DecodeStep",
    "Admitted",
    "Extended",
    "Lookup",
    "LookupMany",
    "KVEvents",
    "KVEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVLayout",
    "KVMode",
    "TableInUseError",
    "Pool",
    "SharedMapping",
    "VarPool",
    "VarStats",
    "Allocation",
    "Stats",
    "PoolOptions",
    "ClassStats",
    "HeapRegion",
    "PageMode",
    "PageKind",
    "Backend",
    "NumaPolicy",
    "WalkKind",
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
    "size_classes",
    "size_class_of",
    "parse_size",
    "format_size",
    "__version__",
]
