"""The KV-cache manager: the Python face of ``kva_kv``.

What an engine's scheduler calls::

    cache = pykvalloc.KVCache(num_blocks=4096, block_tokens=16, layers=32, kv_heads=8,
                              head_dim=128, dtype="float16")
    seq = cache.allocate(len(prompt), tokens=prompt)     # prefix caching by token ids
    seq.num_cached_tokens                                 # tokens whose KV is already there
    seq.block_table                                       # numpy uint32, no copy
    copy = seq.append(1)                                  # decoding; a CopyOnWrite or None
    child = seq.fork()                                    # beam search, parallel sampling
    seq.free()
    moves = cache.compact()                               # (src, dst) rows: data to the low ids
    cache.stats()                                         # KVStats: free/used/cached blocks, hits

Lifetime rules, each there so that no Python call can crash the interpreter (the cache owns its
C handle as every owner does: ``HandleOwner``, _owner.py):

* ``seq.block_table`` is a read-only numpy view of the table the library keeps. The library
  may move or rewrite that table when the sequence changes, so ``append()`` and ``free()``
  refuse (``TableInUseError``) while a view of it is alive, and ``cache.compact()`` while
  any view of the cache is: copy it (``np.array(...)``) to keep it longer. A view keeps its
  sequence and its cache alive.
* A sequence nobody frees is freed when it becomes garbage; a cache nobody closes is destroyed
  when it becomes garbage and no sequence or view needs it. ``close()`` is idempotent; views
  are users of the cache: with views alive the C cache is destroyed when the last one goes.
* Handles of freed sequences are recognised by the library (a generation per slot), so a stale
  ``Sequence`` gets ``InvalidArgument`` (``DoubleFree`` for a second ``free()``), never another
  sequence's blocks.
* The C cache has its own lock; this module adds one per cache for its own bookkeeping, so a
  cache may be shared between threads.
"""

from __future__ import annotations

import enum
import operator
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from ctypes import POINTER, addressof, byref, c_char, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass
from types import MappingProxyType
from typing import (
    TYPE_CHECKING,
    Any,
    NamedTuple,
    NoReturn,
    SupportsIndex,
    TypeVar,
    Union,
    cast,
)

import numpy as np

if TYPE_CHECKING:
    from ctypes import _Pointer

    import numpy.typing as npt  # annotations only: numpy.typing is missing from old numpy

    from .decode_step import DecodeStep

    # What the key and token arguments take: any iterable of integers, or a numpy integer array.
    IntegerArray = Union[Iterable[int], npt.NDArray[np.integer[Any]]]
    # Engine keys: bytes objects of one length, or a 2-D uint8 array, one key per row.
    KeyArray = Union[Iterable[bytes], npt.NDArray[np.uint8]]

from . import _ffi, _locks
from ._ffi import KV_CALL_KINDS, KVA_KV_AGAIN, KVA_KV_PRIORITIES
from ._ffi import KVA_KV_NAMESPACE_SLOTS as NAMESPACE_SLOTS
from ._owner import ArrayAnchor, HandleOwner, refuse_copy
from .errors import InvalidArgument, KvallocError, OutOfMemory
from .tensor import DEVICE_CPU, Tensor, TensorDType, tensor_dtype
from .pool import (
    PageMode,
    Pool,
    _enum_arg,
    _name_arg,
    _pages_arg,
    _returned_address,
    _size_arg,
    _snapshot,
)

__all__ = ["KVCache", "KVStats", "NamespaceShare", "KVCallLatency", "KV_CALL_KINDS", "KVInfo", "KVGroup", "KVLayerInfo", "Sequence", "Pin", "CopyOnWrite", "Move", "KVLayout",
           "KVMode", "TableInUseError", "dtype_bytes", "DEFAULT_BLOCK_TOKENS", "Blocks",
           "Admitted", "Extended", "Lookup", "LookupMany", "BlockStored", "BlockRemoved",
           "AllBlocksCleared", "KVEvent", "KVEvents", "EVENT_DTYPE", "MEDIA",
           "DEFAULT_EVENT_CAPACITY"]

#: Tokens per block when none is given: the default of the library's ``kva_kv_config_init``
#: (test_kv checks that the two agree). A constant, so that importing the package never needs
#: the library.
DEFAULT_BLOCK_TOKENS = 16
#: The event ring of ``KVCache(events=True)``.
DEFAULT_EVENT_CAPACITY = 1 << 16

_U32_MAX = 0xFFFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF
_NO_BLOCK = _U32_MAX
PRIORITIES = 8

# Element sizes of the dtypes a KV cache is kept in; names as numpy, torch ("torch.float16")
# and engines ("fp8", "bf16") spell them.
_DTYPE_BYTES = {
    "float64": 8, "double": 8, "fp64": 8,
    "float32": 4, "float": 4, "fp32": 4,
    "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e4m3": 1, "float8_e5m2": 1,
    "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "uint8": 1,
}


class KVGroup(NamedTuple):
    """Layers of one shape (``KVCache(groups=[...])``): ``parts`` vectors per token and layer
    (2: K and V; 1: one vector), each of ``kv_heads`` heads of ``head_dim`` elements."""

    layers: int
    kv_heads: int
    head_dim: int
    parts: int = 2

    @classmethod
    def mla(cls, layers: int, kv_lora_rank: int, rope_dim: int) -> KVGroup:
        """Multi-head latent attention (DeepSeek V2/V3): one latent vector of ``kv_lora_rank +
        rope_dim`` elements per token and layer (a Hugging Face config's ``kv_lora_rank`` and
        ``qk_rope_head_dim``), no separate K and V."""
        return cls(layers, 1, _u32("kv_lora_rank", kv_lora_rank) + _u32("rope_dim", rope_dim),
                   parts=1)


@dataclass(frozen=True)
class KVLayerInfo:
    """One layer's geometry (``kva_kv_layer``; kvalloc_kv.h describes each figure)."""

    group: int
    parts: int
    kv_heads: int
    head_dim: int
    slot_bytes: int
    part_bytes: int
    block_stride: int
    offset: int


def _group_arg(group: object) -> KVGroup:
    if not isinstance(group, tuple) or len(group) not in (3, 4):
        raise InvalidArgument(f"a group is a KVGroup(layers, kv_heads, head_dim, parts), not "
                              f"{group!r}")
    return KVGroup(*(_u32(name, value) for name, value in zip(KVGroup._fields, group)))


def _layer_shape(info: KVInfo, layer: _ffi.KvaKvLayer, hnd: bool
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides (elements) of one layer's KV tensor; see KVCache.kv_tensor."""
    size = info.dtype_bytes
    tokens, heads, dim = info.block_tokens, layer.kv_heads, layer.head_dim
    inner: tuple[int, ...]
    inner_strides: tuple[int, ...]
    if layer.parts == 1 and heads == 1:
        inner, inner_strides = (tokens, dim), (dim, 1)
    elif hnd:
        inner, inner_strides = (heads, tokens, dim), (tokens * dim, dim, 1)
    else:
        inner, inner_strides = (tokens, heads, dim), (heads * dim, dim, 1)
    if layer.parts == 2:
        inner, inner_strides = (2,) + inner, (layer.part_bytes // size,) + inner_strides
    return (info.num_blocks,) + inner, (layer.block_stride // size,) + inner_strides


class _TensorCount:
    """How many KV tensors of a cache are alive (they are users of it, as the block-table views
    are, but block no table change)."""

    __slots__ = ("_views",)

    def __init__(self) -> None:
        self._views = 0


def _cache_dtype(dtype: object, size: int) -> TensorDType:
    """The element type of a cache's tensors: ``dtype`` when pykvalloc.tensor knows it, else the
    unsigned integer of its size (the cache takes any type of 1, 2, 4 or 8 bytes)."""
    try:
        element = tensor_dtype(dtype)
    except InvalidArgument:
        return tensor_dtype(f"uint{8 * size}")
    return element if element.itemsize == size else tensor_dtype(f"uint{8 * size}")


class KVLayout(enum.IntEnum):
    """Where (block, layer, K|V) lives (``kva_kv_layout``)."""

    BLOCKS = 0  # a block holds all its layers: [block][layer][K|V]
    LAYERS = 1  # one region per layer, indexed by block id: [layer][block][K|V]


class KVMode(enum.IntEnum):
    """``kva_kv_mode``."""

    PAGED = 0       # blocks, block tables, prefix caching, fork
    CONTIGUOUS = 1  # one buffer per sequence in a power-of-two bucket of tokens


class TableInUseError(KvallocError, BufferError):
    """A sequence cannot change while numpy views of its block table are alive: the library may
    move or rewrite the table they show. Copy the table to keep it (``np.array(view)``)."""


class CopyOnWrite(NamedTuple):
    """After ``append``: the last block was shared; copy its first ``tokens`` tokens, every
    layer's K and V, from block ``src`` to block ``dst`` (the sequence now holds ``dst``)."""

    src: int
    dst: int
    tokens: int


class Move(NamedTuple):
    """After ``append`` in contiguous mode: the sequence moved from the buffer at address
    ``src`` (a bucket of ``src_bucket`` tokens) to ``dst`` (``dst_bucket`` tokens). For each
    layer l and part p (0 K, 1 V), copy ``tokens`` slots of ``slot_bytes`` from
    ``src + (2l+p)*src_bucket*slot_bytes`` to ``dst + (2l+p)*dst_bucket*slot_bytes``. The old
    buffer stays allocated until the sequence's next append or free."""

    src: int
    dst: int
    tokens: int
    src_bucket: int
    dst_bucket: int


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of a dtype given as a name, a numpy dtype or a torch dtype."""
    if dtype is None:  # numpy reads None as float64; a KV cache's element type is never implied
        raise InvalidArgument("dtype must be given (a name such as 'float16', or a numpy or torch dtype)")
    if isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
    else:
        name = str(dtype).lower().removeprefix("torch.")
        if name not in _DTYPE_BYTES:
            try:
                numpy_dtype = np.dtype(dtype)  # type: ignore[call-overload]  # any object is tried
            except TypeError:
                numpy_dtype = None
            if numpy_dtype is not None and numpy_dtype.kind in "fiu" and numpy_dtype.itemsize in (1, 2, 4, 8):
                return int(numpy_dtype.itemsize)
    if name not in _DTYPE_BYTES:
        raise InvalidArgument(f"unknown KV dtype {dtype!r}; use one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def _unsigned(name: str, value: object, bits: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{name} must be an integer, not {type(value).__name__}")
    number = int(value)
    if not 0 <= number < 1 << bits:
        raise InvalidArgument(f"{name} {number} is outside 0 .. 2^{bits}-1")
    return number


def _u32(name: str, value: object) -> int:
    return _unsigned(name, value, 32)


def _u64(name: str, value: object) -> int:
    return _unsigned(name, value, 64)


def _readmission_bit(priority: int) -> InvalidArgument:
    return InvalidArgument(f"priority {priority} is not in 0..{KVA_KV_PRIORITIES - 1} (a "
                           "re-admission is again=True)")


def _priority_arg(priority: object, again: object) -> int:
    """An admission's priority as C takes it: KVA_KV_AGAIN ORed in for a re-admission. A
    priority carrying that bit itself is refused here, as C refuses 9: the package says
    re-admission only through ``again`` (C checks every other bit itself)."""
    if not isinstance(again, (bool, np.bool_)):
        raise InvalidArgument(f"again must be a bool, not {type(again).__name__}")
    prio = _u32("priority", priority)
    if prio & KVA_KV_AGAIN:
        raise _readmission_bit(prio)
    return prio | KVA_KV_AGAIN if again else prio


def _again_priorities(prios: npt.NDArray[Any] | None, again: object,
                      count: int) -> npt.NDArray[Any] | None:
    """allocate_many's priorities with KVA_KV_AGAIN (bit 7 of each uint8) ORed in where
    ``again`` says: a bool for every request, or one bool a request. The caller's array is never
    written."""
    if isinstance(again, (bool, np.bool_)):
        if not again:
            return prios
        flags = np.full(count, KVA_KV_AGAIN, dtype=np.uint8)
    else:
        try:
            marks = np.asarray(again)
        except (TypeError, ValueError):
            marks = None
        if marks is not None and marks.shape == (0,):
            marks = marks.astype(np.bool_)  # an empty list is float64 to numpy: no marks at all
        if marks is None or marks.ndim != 1 or marks.dtype != np.bool_:
            raise InvalidArgument("again must be a bool or a one-dimensional array of bools, one "
                                  "per request")
        if marks.size != count:
            raise InvalidArgument(f"again has {marks.size} entries for {count} requests")
        flags = np.where(marks, np.uint8(KVA_KV_AGAIN), np.uint8(0)).astype(np.uint8)
    return flags if prios is None else np.ascontiguousarray(prios | flags, dtype=np.uint8)


def _array_arg(name: str, values: IntegerArray | None, dtype: type[np.uint32] | type[np.uint64]
               ) -> npt.NDArray[np.unsignedinteger[Any]] | None:
    """A C-contiguous array of exactly dtype for a pointer argument (no copy when it is one).

    Anything but an array is read item by item: numpy would make a float64 array of a list that
    mixes 64-bit keys at or above 2**63 with smaller ones (and a 0-d object array of a
    generator), where every item is a valid key."""
    if values is None:
        return None
    if isinstance(values, np.ndarray):
        array = values
    else:
        try:
            items = list(values)
        except TypeError:
            raise InvalidArgument(f"{name} must be an iterable of integers, not "
                                  f"{type(values).__name__}") from None
        limit = int(np.iinfo(dtype).max)
        for item in items:
            if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, np.integer)):
                raise InvalidArgument(f"{name} must hold integers, not {type(item).__name__}")
            if not 0 <= item <= limit:
                raise InvalidArgument(f"{name} holds values outside {np.dtype(dtype)}")
        array = np.array(items, dtype=dtype)
    if array.size > 0xFFFFFFFF:  # the C counts are 32-bit
        raise InvalidArgument(f"{name} holds {array.size} values; at most {0xFFFFFFFF}")
    if array.ndim != 1:
        raise InvalidArgument(f"{name} must be one-dimensional, not of shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must hold integers, not {array.dtype}")
    # A dtype that holds only values of dtype (uint32 for uint32, uint8 for uint64) needs no
    # look at the values.
    if (array.size and not np.can_cast(array.dtype, dtype, "safe")
            and (array.min() < 0 or array.max() > np.iinfo(dtype).max)):
        raise InvalidArgument(f"{name} holds values outside {np.dtype(dtype)}")
    return np.ascontiguousarray(array, dtype=dtype)


_U8, _U32, _U64 = np.dtype(np.uint8), np.dtype(np.uint32), np.dtype(np.uint64)


def _batch_array(name: str, values: object, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """A C-contiguous array of exactly dtype for a batch call, with no work per element when
    it is one already (the engine's own arrays): what each value means is checked in C.

    An array of another integer dtype is taken when every value fits (uint8 for uint32), and
    refused otherwise, not checked value by value: a cast would wrap a negative token id into a
    valid one. A list (or any other sequence) of integers is converted by numpy, which refuses
    integers that do not fit; one numpy reads as something else (floats, booleans, or ints on
    both sides of 2**63, which it makes float64) is read item by item (_array_arg)."""
    if type(values) is np.ndarray:
        array: npt.NDArray[Any] = values
        if array.dtype is dtype and array.ndim == 1 and array.flags.c_contiguous:
            return array  # the engine's own array, as it is: nothing to look at
    elif isinstance(values, np.ndarray):
        array = np.asarray(values)
    else:
        try:
            inferred = np.asarray(values)
        except (TypeError, ValueError, OverflowError):
            inferred = None
        if inferred is None or (inferred.size and inferred.dtype.kind not in "iu"):
            checked = _array_arg(name, cast("IntegerArray", values),
                                 np.uint64 if dtype is _U64 else np.uint32)
            assert checked is not None
            if dtype is _U8 and checked.size and int(checked.max()) > 0xFF:
                raise InvalidArgument(f"{name} holds values outside uint8")
            return np.ascontiguousarray(checked, dtype=dtype)
        try:
            with warnings.catch_warnings():  # numpy < 2 wraps out-of-range ints with a warning
                warnings.simplefilter("error")
                array = np.array(values, dtype=dtype)
        except (TypeError, ValueError, OverflowError, DeprecationWarning) as exc:
            raise InvalidArgument(f"{name} must hold integers of {dtype} ({exc})"
                                  ) from None
    if array.dtype != dtype:
        if array.size and (array.dtype.kind not in "iu"
                           or not np.can_cast(array.dtype, dtype, "safe")):
            raise InvalidArgument(
                f"{name} must be a {dtype} array (or a dtype it holds safely), not "
                f"{array.dtype}: convert it with .astype(np.{dtype}) if every value "
                "fits")
        array = array.astype(dtype)
    if array.ndim != 1:
        raise InvalidArgument(f"{name} must be one-dimensional, not of shape {array.shape}")
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array


def _key_rows(name: str, keys: object, empty_len: int) -> npt.NDArray[np.uint8]:
    """Engine keys as a C-contiguous uint8 array of shape (n, key_len): from such an array, or
    from a sequence of bytes-like objects of one length (joined once, by bytes.join); an empty
    sequence is keys of ``empty_len`` bytes (the cache's max_key_bytes: a (0, n) array says
    another length). The key length itself is checked in C (1 .. max_key_bytes)."""
    if type(keys) is np.ndarray and keys.dtype is _U8 and keys.ndim == 2 \
            and keys.flags.c_contiguous:
        return keys  # the engine's own rows, as they are
    if isinstance(keys, np.ndarray):
        if keys.ndim != 2 or keys.dtype != np.uint8:
            raise InvalidArgument(f"{name} must be a 2-D uint8 array (one key per row), not "
                                  f"{keys.dtype} of shape {keys.shape}")
        return np.ascontiguousarray(keys)
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        raise InvalidArgument(f"{name} must be a sequence of keys (bytes objects), not one "
                              f"{type(keys).__name__}")
    try:
        items = keys if isinstance(keys, (list, tuple)) else list(keys)  # type: ignore[call-overload]
        lengths = set(map(len, items))
        joined = b"".join(items)
    except TypeError:
        raise InvalidArgument(f"{name} must be a sequence of bytes objects of one length"
                              ) from None
    if len(lengths) > 1:
        raise InvalidArgument(f"{name} must all have one length, not {sorted(lengths)}")
    length = lengths.pop() if lengths else empty_len
    rows = np.frombuffer(joined, dtype=np.uint8) if joined else np.zeros(0, np.uint8)
    return rows.reshape(len(items), length)


class _Content:
    """One request's content (or a batch's, flattened) as kva_kv_content: the struct and the
    arrays it points into, kept alive together for the call."""

    __slots__ = ("struct", "count", "array", "kind")

    def __init__(self, kind: int, array: npt.NDArray[Any], count: int, key_len: int = 0,
                 struct: _ffi.KvaKvContent | None = None) -> None:
        self.kind = kind
        self.array = array
        self.count = count
        if struct is None:
            struct = _ffi.KvaKvContent()
        struct.kind = kind
        struct.key_len = key_len
        address = _address(array)
        struct.tokens = address if kind == _KEY_TOKENS else None
        struct.keys = address if kind == _KEY_U64 else None
        struct.key_bytes = address if kind == _KEY_BYTES else None
        self.struct = struct


_KEY_NONE, _KEY_TOKENS, _KEY_U64, _KEY_BYTES = 0, 1, 2, 3


def _one_kind(tokens: object, block_keys: object, keys: object) -> None:
    if (tokens is not None) + (block_keys is not None) + (keys is not None) > 1:
        raise InvalidArgument("give one of tokens, block_keys and keys")


def _content(tokens: IntegerArray | None, block_keys: IntegerArray | None,
             keys: KeyArray | None, key_len: int) -> _Content | None:
    """One request's content, checked item by item (the single calls)."""
    _one_kind(tokens, block_keys, keys)
    if tokens is not None:
        array = _array_arg("tokens", tokens, np.uint32)
        assert array is not None
        return _Content(_KEY_TOKENS, array, array.size)
    if block_keys is not None:
        array = _array_arg("block_keys", block_keys, np.uint64)
        assert array is not None
        return _Content(_KEY_U64, array, array.size)
    if keys is not None:
        rows = _key_rows("keys", keys, key_len)
        if rows.shape[0] > _U32_MAX:
            raise InvalidArgument(f"keys holds {rows.shape[0]} keys; at most {_U32_MAX}")
        return _Content(_KEY_BYTES, rows, rows.shape[0], rows.shape[1])
    return None


def _batch_content(tokens: object, block_keys: object, keys: object, key_len: int,
                   struct: _ffi.KvaKvContent | None = None) -> _Content | None:
    """A batch's content, every request's items one after the other: arrays taken as they are
    (in ``struct`` when given: a caller's reused one)."""
    _one_kind(tokens, block_keys, keys)
    if tokens is not None:
        array = _batch_array("tokens", tokens, _U32)
        return _Content(_KEY_TOKENS, array, array.size, struct=struct)
    if block_keys is not None:
        array = _batch_array("block_keys", block_keys, _U64)
        return _Content(_KEY_U64, array, array.size, struct=struct)
    if keys is not None:
        rows = _key_rows("keys", keys, key_len)
        return _Content(_KEY_BYTES, rows, rows.shape[0], rows.shape[1], struct=struct)
    return None


def _content_ref(content: _Content | None) -> Any:
    return None if content is None else byref(content.struct)


def _within(offsets: npt.NDArray[np.uint64], content: _Content) -> None:
    """The library checks a batch's offsets but cannot see how many items the content holds:
    the last offset must not pass them (one look, at the last entry)."""
    if offsets.size and int(offsets[-1]) > content.count:
        raise InvalidArgument(f"offsets end at {int(offsets[-1])}, beyond the {content.count} "
                              "items given")


def _address(array: npt.NDArray[Any]) -> int:
    """The address of an array's data, for a pointer argument: through ctypes' buffer protocol
    (a few hundred ns) where the array is writable, else numpy's ctypes view (several times
    that); NULL for an empty array, which the library never reads (every call takes NULL for a
    count of 0)."""
    if not array.size:
        return 0
    try:
        return addressof(c_char.from_buffer(cast(Any, array)))
    except (TypeError, ValueError):  # read-only, or no byte to point at
        return int(array.ctypes.data)


_CType = TypeVar("_CType", c_uint32, c_uint64)


def _pointer(array: npt.NDArray[Any] | None, ctype: type[_CType]) -> _Pointer[_CType] | None:
    return None if array is None else array.ctypes.data_as(POINTER(ctype))


@dataclass(frozen=True)
class KVInfo:
    """The geometry of a KV cache (``kva_kv_info``; kvalloc.h describes each figure)."""

    mode: KVMode
    layout: KVLayout
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_tokens: int
    num_blocks: int      # paged mode; 0 in contiguous mode
    max_context: int     # contiguous mode: the largest bucket; 0 in paged mode
    block_bytes: int     # all layers, all parts (K and V, or MLA's one vector), of one block
    token_bytes: int     # all layers, all parts, of one token
    slot_bytes: int      # K (or V) of one token in one layer
    part_bytes: int      # K (or V) of one block in one layer
    block_stride: int
    layer_stride: int
    base: int            # paged mode: the address of the KV memory (block 0, layer 0, K)
    kv_bytes: int        # paged: num_blocks * block_bytes; contiguous: the pool's capacity

    @classmethod
    def _from_c(cls, raw: _ffi.KvaKvInfo) -> KVInfo:
        return _snapshot(cls, raw, mode=KVMode(raw.mode), layout=KVLayout(raw.layout),
                         base=raw.base or 0)


@dataclass(frozen=True)
class KVStats:
    """A snapshot of ``kva_kv_stats``; see kvalloc.h for the exact meaning of each figure."""

    num_blocks: int
    free_blocks: int           # hold nothing
    used_blocks: int           # referenced by live sequences or pins
    cached_blocks: int         # referenced by none, kept for prefix hits, evictable
    registered_blocks: int     # with a key in the prefix table
    sequences: int             # live sequences, pins excluded
    pins: int
    trimmed_blocks: int        # free, their memory given back (trim)
    hit_tokens: int            # cached tokens summed over allocations
    query_tokens: int          # tokens summed over allocations
    evictions: int
    cow_copies: int
    forks: int
    allocations: int
    frees: int
    appends: int
    moves: int                 # contiguous mode: bucket changes; paged mode: compaction moves
    moved_bytes: int
    alloc_failures: int
    rejected_calls: int
    bytes_in_use: int          # KV bytes held by sequences
    block_metadata_bytes: int
    metadata_bytes: int        # all host bytes of the cache's bookkeeping
    # Calls timed lock to lock, every kind together: with trace=True every call, otherwise a
    # sample of about one in call_sample_period of each kind.
    timed_calls: int
    timed_ns: int
    call_ns_log2: tuple[int, ...]  # calls that took [2^i, 2^(i+1)) ns
    # Peaks since creation or reset_peaks(): the most at the end of any call.
    peak_used_blocks: int
    peak_cached_blocks: int
    peak_bytes_in_use: int
    call_sample_period: int        # 1: every call timed (trace); else one in this many per kind
    # Per kind of call ("allocate", "append", "free", "lookup", "evict", "other"; KV_CALL_KINDS).
    call_latency: Mapping[str, KVCallLatency]
    pinned_blocks: int             # distinct blocks held by live pins (a subset of used_blocks)
    # The part of hit_tokens / query_tokens that re-admissions (allocate(..., again=True)) made;
    # first admissions made the rest.
    readmit_hit_tokens: int
    readmit_query_tokens: int

    @property
    def hit_rate(self) -> float:
        """The share of the tokens asked for that the prefix cache held (0 before any)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def first_admission_hit_rate(self) -> float:
        """``hit_rate`` of first admissions alone (0 before any)."""
        query = self.query_tokens - self.readmit_query_tokens
        return (self.hit_tokens - self.readmit_hit_tokens) / query if query else 0.0

    @property
    def readmission_hit_rate(self) -> float:
        """``hit_rate`` of re-admissions alone (0 before any)."""
        return (self.readmit_hit_tokens / self.readmit_query_tokens
                if self.readmit_query_tokens else 0.0)



    @classmethod
    def _from_c(cls, raw: _ffi.KvaKvStats) -> KVStats:
        # The arrays are read whole, each once: a ctypes array indexed element by element made
        # stats() cost hundreds of microseconds, and the replay reads it every step.
        timed, timed_ns = list(raw.kind_timed_calls), list(raw.kind_timed_ns)
        histograms = np.ctypeslib.as_array(raw.kind_ns_log2).tolist()
        latency = MappingProxyType({
            kind: KVCallLatency(timed_calls=timed[k], timed_ns=timed_ns[k], ns_log2=tuple(histograms[k]))
            for k, kind in enumerate(KV_CALL_KINDS)})
        return _snapshot(cls, raw, call_ns_log2=tuple(np.ctypeslib.as_array(raw.call_ns_log2).tolist()),
                         call_latency=latency)


@dataclass(frozen=True)
class NamespaceShare:
    """One namespace's share of a KV cache (``KVCache.namespaces()``, kva_kv_namespaces): its
    live ``sequences`` and ``pins``, ``blocks`` (their block tables' lengths summed: a block two
    tables share counts twice) and ``registered_blocks`` (its keys in the prefix table).
    ``namespace`` None is the row pooling every namespace past the first
    ``NAMESPACE_SLOTS`` tracked ones."""

    namespace: int | None
    sequences: int
    pins: int
    blocks: int
    registered_blocks: int


class KVGauges(NamedTuple):
    """What a KV cache holds at one moment (``KVCache.gauges()``), as ``KVStats`` counts it."""

    used_blocks: int
    cached_blocks: int
    free_blocks: int
    sequences: int
    bytes_in_use: int


@dataclass(frozen=True)
class KVCallLatency:
    """The timed calls of one kind: how many, their total ns, and their log2 histogram
    (``ns_log2[i]``: calls that took [2^i, 2^(i+1)) ns; bucket 0 also 0 ns)."""

    timed_calls: int
    timed_ns: int
    ns_log2: tuple[int, ...]


# -- KV events -------------------------------------------------------------------------------

#: One ``kva_kv_event`` as numpy reads it: 96 bytes, the C fields in order.
EVENT_DTYPE = np.dtype(_ffi.KvaKvEvent)

_EVENT_STORED, _EVENT_REMOVED, _EVENT_CLEARED = 1, 2, 3
#: The tiers as vLLM names them (``kva_kv_config.event_medium`` 0, 1, 2; any other value is
#: an engine's own tier, reported as its number).
MEDIA = ("GPU", "CPU", "STORAGE")
# Events moved out of the library per call: a bounded buffer however large the ring is.
_EVENT_CHUNK = 4096

BlockHash = Union[bytes, int]


@dataclass(frozen=True)
class BlockStored:
    """Blocks registered in the prefix cache, one chain of them: vLLM's ``BlockStored`` fields
    (``distributed/kv_events.py``), then pykvalloc's own. Consecutive registrations that extend
    one chain (a prompt's blocks, a commit) form one event, as vLLM's ``cache_full_blocks``
    makes one.

    ``block_hashes``: the blocks' keys, each an engine key as the engine gave it or the
    library's 128-bit key (16 bytes, low 64 bits first, each little-endian); with
    ``hashes="int"``, vLLM's default event form of a hash, its last 8 bytes as a big-endian
    unsigned int. ``parent_block_hash``: the key of the block before the first (None: the chain
    starts at block 0). ``token_ids`` is empty: the library keeps no token ids (the blocks hold
    tokens ``[first_token, first_token + len(block_hashes) * block_size)`` of their request).
    ``lora_id`` is None: adapters are namespaces here (``namespace``)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    block_ids: tuple[int, ...]
    namespace: int
    first_token: int


@dataclass(frozen=True)
class BlockRemoved:
    """A block's registration dropped (eviction, ``evict*``): vLLM's ``BlockRemoved`` fields,
    then the block's id and namespace. One key per event."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None
    block_ids: tuple[int, ...]
    namespace: int


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every registration dropped (``reset_prefix_cache``): vLLM's ``AllBlocksCleared``."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEvents(NamedTuple):
    """What ``take_events`` drained: the events in order, and how many the library dropped
    since the previous take because its ring was full (nonzero: a router's view misses some and
    should be rebuilt)."""

    events: list[KVEvent]
    dropped: int


def _medium_name(medium: int) -> str:
    return MEDIA[medium] if medium < len(MEDIA) else str(medium)


def _hash_of(raw: bytes, as_int: bool) -> BlockHash:
    return int.from_bytes(raw[-8:], "big") if as_int else raw


def _events_from_records(records: npt.NDArray[Any], as_int: bool) -> list[KVEvent]:
    """The dataclasses of drained records, stored registrations that extend one chain merged."""
    events: list[KVEvent] = []
    run: list[tuple[bytes, int]] = []  # the (key, block) of the stored chain being merged
    start: Any = None  # its first record

    def close_run() -> None:
        if run:
            parent_len = int(start["parent_len"])
            parent = bytes(start["parent"][:parent_len]) if parent_len else None
            events.append(BlockStored(
                block_hashes=tuple(_hash_of(key, as_int) for key, _ in run),
                parent_block_hash=None if parent is None else _hash_of(parent, as_int),
                token_ids=(), block_size=int(start["num_tokens"]), lora_id=None,
                medium=_medium_name(int(start["medium"])),
                block_ids=tuple(block for _, block in run), namespace=int(start["namespace_id"]),
                first_token=int(start["first_token"])))
            run.clear()

    for record in records:
        kind = int(record["kind"])
        if kind == _EVENT_STORED:
            key = bytes(record["key"][:int(record["key_len"])])
            parent_len = int(record["parent_len"])
            if (run and parent_len and bytes(record["parent"][:parent_len]) == run[-1][0]
                    and record["namespace_id"] == start["namespace_id"]
                    and record["medium"] == start["medium"]
                    and int(record["first_token"]) == int(start["first_token"])
                    + len(run) * int(start["num_tokens"])):
                run.append((key, int(record["block"])))
                continue
            close_run()
            start = record
            run.append((key, int(record["block"])))
            continue
        close_run()
        if kind == _EVENT_REMOVED:
            key = bytes(record["key"][:int(record["key_len"])])
            events.append(BlockRemoved(block_hashes=(_hash_of(key, as_int),),
                                       medium=_medium_name(int(record["medium"])),
                                       block_ids=(int(record["block"]),),
                                       namespace=int(record["namespace_id"])))
        else:
            events.append(AllBlocksCleared())
    close_run()
    return events


# -- results of the batch calls ----------------------------------------------------------------

class Admitted(NamedTuple):
    """What ``allocate_many`` did: requests ``[0, done)`` were admitted, ``handles[i]`` naming
    request i's sequence and ``cached_tokens[i]`` its prefix hit; the others were not (the first
    of them did not fit) and changed nothing."""

    handles: npt.NDArray[np.uint64]
    cached_tokens: npt.NDArray[np.uint32]
    done: int


class Extended(NamedTuple):
    """What ``append_many`` did: requests ``[0, done)`` were extended; ``copies`` holds a row
    (request, src_block, dst_block, tokens) for each copy on write the engine must do first, in
    request order. Requests from ``done`` on did not fit and changed nothing."""

    copies: npt.NDArray[np.uint32]
    done: int


class Lookup(NamedTuple):
    """A chain looked up: ``hits`` blocks matched from its first, ``ids`` their block ids."""

    hits: int
    ids: npt.NDArray[np.uint32]


class LookupMany(NamedTuple):
    """Chains looked up: ``hits[i]`` blocks of request i matched; with ids, request i's hit
    blocks are ``ids[offsets[i] : offsets[i] + hits[i]]`` (ids has one entry per item given,
    0xFFFFFFFF where nothing matched)."""

    hits: npt.NDArray[np.uint32]
    ids: npt.NDArray[np.uint32] | None


class _AdmitBuffers:
    """What allocate reuses from one call to the next, under its cache's lock, when an engine
    admits a prompt by its keys as an array: the content struct, the out-values and the
    admission's function with no argument converted (KvaLib.untyped: the cache as its
    _handle_arg, the namespace, a u64, as a c_uint64, the rest as ints)."""

    __slots__ = ("content", "content_ref", "seq", "seq_ref", "cached", "cached_ref", "call",
                 "no_namespace")

    def __init__(self, lib: _ffi.KvaLib) -> None:
        self.content = _ffi.KvaKvContent()
        self.content.kind = _KEY_BYTES
        self.content_ref = byref(self.content)
        self.seq = c_uint64()
        self.seq_ref = byref(self.seq)
        self.cached = c_uint32()
        self.cached_ref = byref(self.cached)
        self.call = lib.untyped("kva_kv_seq_admit")
        self.no_namespace = c_uint64(0)


class _AppendBuffers:
    """What Sequence.append reuses from one call to the next, under its cache's lock, for a
    growth without content (a decode token): the copy struct the library writes on success and
    kva_kv_seq_extend with no argument converted."""

    __slots__ = ("copy", "copy_ref", "call")

    def __init__(self, lib: _ffi.KvaLib) -> None:
        self.copy = _ffi.KvaKvCopy()
        self.copy_ref = byref(self.copy)
        self.call = lib.untyped("kva_kv_seq_extend")


class _StepBuffers:
    """What append_many, the call of every decode step, reuses from one call to the next under
    its cache's lock: the per-request token counts of a step where every request grows by n,
    their offsets into the step's token ids, the rows for copies on write and the out-counts,
    each with its address, so that a step costs the addresses of the caller's own arrays and
    one C call."""

    __slots__ = ("count_value", "counts", "counts_address", "offsets_value", "offsets",
                 "offsets_address", "copies", "copies_address", "content", "num_copies",
                 "done", "num_copies_ref", "done_ref", "content_kind", "content_ref")

    def __init__(self) -> None:
        self.count_value = -1
        self.counts = np.empty(0, dtype=np.uint32)
        self.counts_address = 0
        self.offsets_value = -1
        self.offsets = np.empty(0, dtype=np.uint64)
        self.offsets_address = 0
        self.copies = np.empty((0, 4), dtype=np.uint32)
        self.copies_address = 0
        self.content = _ffi.KvaKvContent()
        self.content_ref = byref(self.content)
        self.content_kind = -1  # the kind content was last set up for (-1: not known)
        self.num_copies = c_uint32()
        self.done = c_uint32()
        self.num_copies_ref = byref(self.num_copies)
        self.done_ref = byref(self.done)

    def uniform_counts(self, count: int, n: int) -> int:
        """The address of count entries of n."""
        if n != self.count_value or count > self.counts.size:
            self.counts = np.full(_room(count, self.counts.size), n, dtype=np.uint32)
            self.counts_address = _address(self.counts)
            self.count_value = n
        return self.counts_address

    def uniform_offsets(self, count: int, n: int) -> int:
        """The address of count + 1 offsets 0, n, 2n, ...: n token ids a request."""
        if n != self.offsets_value or count + 1 > self.offsets.size:
            size = _room(count + 1, self.offsets.size)
            self.offsets = np.arange(size, dtype=np.uint64) * np.uint64(n)
            self.offsets_address = _address(self.offsets)
            self.offsets_value = n
        return self.offsets_address

    def copy_rows(self, count: int) -> int:
        if count > self.copies.shape[0]:
            self.copies = np.empty((_room(count, self.copies.shape[0]), 4), dtype=np.uint32)
            self.copies_address = _address(self.copies)
        return self.copies_address


def _room(needed: int, size: int) -> int:
    """The entries of a reused buffer that must hold needed: its size while that is enough,
    else doubled (at least 64), so that growing batches reallocate O(log n) times."""
    return size if needed <= size else max(needed, 2 * size, 64)


_NO_COPIES = np.empty((0, 4), dtype=np.uint32)
_NO_COPIES.flags.writeable = False


class KVCache(HandleOwner):
    """A KV cache of ``num_blocks`` blocks of ``block_tokens`` tokens (or ``capacity_bytes``
    bytes' worth), for a model with ``layers`` layers of ``kv_heads`` KV heads of ``head_dim``
    elements of ``dtype`` (a name such as ``"float16"`` or ``"fp8"``, a numpy or a torch dtype).

    ``layout``: ``"layers"`` (default; one region per layer, a block id indexes each, what
    paged-attention kernels index) or ``"blocks"`` (all layers of a block together).
    ``mode="contiguous"`` gives each sequence one buffer in a power-of-two bucket of tokens (64
    .. ``max_context``) instead of blocks. ``hash_seed`` keys the prefix hashes (a secret random
    value keeps clients from precomputing them). The memory comes from a pool the cache creates
    (``pages`` as for ``Pool``, default transparent huge pages) or from ``pool``, an open
    ``pykvalloc.Pool``; closing that pool before the cache closes it to its own calls, and
    destroys it once the cache is gone. ``name`` names the pool the cache creates,
    which then publishes the pool's and the cache's statistics for ``kvalloc top`` (``trace``
    also times every call); a given ``pool`` brings its own name.

    ``groups`` describes a model whose layers are not all ``kv_heads`` x ``head_dim`` K and V
    (then leave ``layers``, ``kv_heads`` and ``head_dim`` out): a list of ``KVGroup(layers,
    kv_heads, head_dim, parts=2)``, layers numbered through them in order, and
    ``KVGroup.mla(layers, kv_lora_rank, rope_dim)`` for DeepSeek's latent attention (one vector
    per token and layer). ``kv_tensor`` gives the memory as tensors in the layouts attention
    kernels read; ``layer_info`` each layer's geometry.

    For engines: ``max_key_bytes`` (1 .. 32) lets the cache take the engine's own block keys
    (``keys=``: vLLM's block hashes, SGLang's digests), stored exactly, that many host bytes per
    block. ``events`` keeps KV events (``take_events``) in a ring of that many (True: 65,536;
    96 host bytes each), each naming ``event_medium`` ("GPU", "CPU", "STORAGE" or a tier
    number).
    """

    __slots__ = ("_lib", "_pool_lock", "_call_lock", "_handle_arg", "_append1", "_info", "_pool_handle", "_max_key_bytes", "_step",
                 "_admit", "_dtype", "_dl_device", "_kv_tensors", "_groups")

    def __init__(self, num_blocks: int | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 layers: int | None = None, kv_heads: int | None = None,
                 head_dim: int | None = None, dtype: object = "float16", *,
                 groups: Iterable[KVGroup] | None = None, capacity_bytes: int | None = None,
                 layout: str | KVLayout = "layers", mode: str | KVMode = "paged",
                 max_context: int | None = None, hash_seed: int = 0, pool: Pool | None = None,
                 pages: str | PageMode = "thp", name: str | None = None,
                 trace: bool = False, max_key_bytes: int = 0, events: int | bool = 0,
                 event_medium: str | int = "GPU") -> None:
        lib = _ffi.load()
        config = _ffi.KvaKvConfig()
        lib.kva_kv_config_init(byref(config))
        if groups is None:
            config.layers = _u32("layers", 32 if layers is None else layers)
            config.kv_heads = _u32("kv_heads", 8 if kv_heads is None else kv_heads)
            config.head_dim = _u32("head_dim", 128 if head_dim is None else head_dim)
            shapes: tuple[KVGroup, ...] = (KVGroup(config.layers, config.kv_heads,
                                                   config.head_dim),)
            group_array = None
        else:
            if layers is not None or kv_heads is not None or head_dim is not None:
                raise InvalidArgument("give layers, kv_heads and head_dim, or groups, not both")
            shapes = tuple(_group_arg(group) for group in groups)
            group_array = (_ffi.KvaKvGroup * max(len(shapes), 1))(
                *(_ffi.KvaKvGroup(group.layers, group.parts, group.kv_heads, group.head_dim)
                  for group in shapes))
            config.groups = group_array
            config.num_groups = _u32("the number of groups", len(shapes))
        config.dtype_bytes = dtype_bytes(dtype)
        config.block_tokens = _u32("block_tokens", block_tokens)
        config.num_blocks = 0 if num_blocks is None else _u32("num_blocks", num_blocks)
        if capacity_bytes is not None:
            config.capacity_bytes = _size_arg("capacity_bytes", capacity_bytes)
        config.layout = _enum_arg("layout", layout, KVLayout)
        config.mode = _enum_arg("mode", mode, KVMode)
        config.max_context = 0 if max_context is None else _u32("max_context", max_context)
        try:
            seed = operator.index(hash_seed) if not isinstance(hash_seed, bool) else None
        except TypeError:
            seed = None
        if seed is None or not 0 <= seed < 1 << 64:
            raise InvalidArgument("hash_seed must be an integer in 0 .. 2^64-1")
        config.hash_seed = seed
        config.pages = _pages_arg(pages)
        config.name = _name_arg(name)  # C copies the name at creation
        config.trace = 1 if trace else 0
        config.max_key_bytes = _u32("max_key_bytes", max_key_bytes)
        if events is True:
            config.event_capacity = DEFAULT_EVENT_CAPACITY
        else:
            config.event_capacity = _u32("events", events or 0)
        if isinstance(event_medium, str):
            if event_medium.upper() not in MEDIA:
                raise InvalidArgument(f"event_medium {event_medium!r} is not one of {MEDIA} "
                                      "(or a tier number)")
            config.event_medium = MEDIA.index(event_medium.upper())
        else:
            config.event_medium = _u32("event_medium", event_medium)
        if pool is not None and not isinstance(pool, Pool):
            raise InvalidArgument(f"pool must be a pykvalloc.Pool, not {type(pool).__name__}")
        element = _cache_dtype(dtype, config.dtype_bytes)

        def create(pool_handle: int | None) -> int:
            handle = c_void_p()
            lib.kva_kv_create(byref(config), pool_handle, byref(handle))
            return _returned_address(handle, "kva_kv_create")

        handle = self._create_over(pool, create)
        self._own(handle, lib.kva_kv_destroy, pool)
        self._lib = lib
        # The lock of a caller's Pool, which serializes the Python calls into its C pool: the
        # cache takes it for its own (creation, destruction, contiguous buffers).
        self._pool_lock = pool._lock if pool is not None else None
        # What a call that may touch the pool holds: the cache's lock, then the caller's pool's
        # (the cache's lock alone over a pool of its own), entered as one context manager.
        self._call_lock: AbstractContextManager[object] = (
            self._lock if self._pool_lock is None else _locks.LockPair(self._lock, self._pool_lock))
        info = _ffi.KvaKvInfo()
        lib.kva_kv_get_info(handle, byref(info))
        self._info = KVInfo._from_c(info)
        # The C pool the memory comes from (a caller's, or the one C made for the cache).
        self._pool_handle: int = info.pool
        self._max_key_bytes = int(config.max_key_bytes)
        self._step = _StepBuffers()
        # The handle as the calls made with no argument converted take it (KvaLib.untyped):
        # made once, for allocate's and append's own paths and the decode steps.
        self._handle_arg = c_void_p(handle)
        self._admit = _AdmitBuffers(lib)
        self._append1 = _AppendBuffers(lib)
        self._dtype = element
        self._dl_device = pool._dl_device if pool is not None else (DEVICE_CPU, 0)
        self._kv_tensors = _TensorCount()
        self._groups = shapes

    def _describe(self) -> str:
        info = self._info
        return (f"{info.mode.name.lower()} {info.num_blocks} blocks of {info.block_tokens} "
                f"tokens, {info.block_bytes} bytes each,")

    # -- the pool -----------------------------------------------------------------------------

    def pool_fragmentation(self) -> float:
        """The fragmentation (1 - largest free block / free bytes) of the pool the cache's
        memory comes from: what limits contiguous mode."""
        raw = _ffi.KvaStats()
        with self._call_lock:
            self._open_handle()
            self._lib.kva_get_stats(self._pool_handle, byref(raw))
        return float(raw.fragmentation)

    def publish(self) -> None:
        """Publishes the statistics of the cache's pool, the cache's own section included, now
        (a named cache; otherwise nothing happens). A named cache also publishes on its own from
        its calls, at most every ``publish_interval_ms`` of its pool."""
        with self._call_lock:
            self._open_handle()
            self._lib.kva_stats_publish(self._pool_handle)

    # -- sequences --------------------------------------------------------------------------

    def allocate(self, num_tokens: int, block_keys: IntegerArray | None = None,
                 tokens: IntegerArray | None = None, namespace: int = 0,
                 priority: int = 0, *, keys: KeyArray | None = None,
                 again: bool = False) -> Sequence:
        """A sequence of ``num_tokens`` tokens. The content of its first blocks is given as
        ``tokens`` (token ids; their whole blocks are hashed and chained here), ``block_keys``
        (one 64-bit key per full block, such as a trace's hash ids, chained here) or ``keys``
        (the engine's own keys, already chained, one per full block: bytes objects of one length
        or a 2-D uint8 array; a cache created with ``max_key_bytes``). The longest cached prefix
        is reused (``num_cached_tokens``) and the other given blocks are cached for later
        requests. A sequence given the content of all of it (every token id, or a key for each
        full block) keeps its chain: ``append`` commits the blocks its decoding fills. Blocks
        are shared only within one ``namespace`` (64 bits: a tenant, an adapter, a salt).
        ``priority`` (0..7): lower priorities' blocks are evicted first. ``again=True`` says the
        request is a re-admission (a preempted request admitted again): its tokens count in
        ``stats()``' readmit_* figures too. ``OutOfMemory`` if the blocks are not there, with
        nothing changed."""
        if (type(keys) is np.ndarray and tokens is None and block_keys is None
                and type(num_tokens) is int and type(namespace) is int and type(priority) is int
                and type(again) is bool):
            admitted = self._admit_keyed(num_tokens, keys, namespace, priority, again)
            if admitted is not None:
                return admitted
        n = _u32("num_tokens", num_tokens)
        content = _content(tokens, block_keys, keys, self._max_key_bytes)
        ns = _u64("namespace", namespace)
        prio = _priority_arg(priority, again)
        seq = c_uint64()
        cached = c_uint32()
        with self._call_lock:
            self._lib.kva_kv_seq_admit(self._open_handle(), n, ns, prio, _content_ref(content),
                                       0 if content is None else content.count, byref(seq),
                                       byref(cached))
        return Sequence._new(self, seq.value, cached.value)

    def _admit_keyed(self, num_tokens: int, keys: npt.NDArray[Any], namespace: int,
                     priority: int, again: bool) -> Sequence | None:
        """allocate's admission as an engine makes it, by its keys as a C-contiguous uint8
        array of one key a row, every other argument a plain int in range: nothing converted,
        the reused struct and out-values, one C call. None when an argument is anything else,
        for the general path to convert or refuse with its messages."""
        if not (keys.dtype is _U8 and keys.ndim == 2 and keys.flags.c_contiguous
                and 0 <= num_tokens <= _U32_MAX and 0 <= namespace <= _U64_MAX
                and 0 <= priority <= _U32_MAX and keys.shape[0] <= _U32_MAX):
            return None
        if priority & KVA_KV_AGAIN:
            raise _readmission_bit(priority)
        if again:
            priority |= KVA_KV_AGAIN
        admit = self._admit
        with self._call_lock:
            self._open_handle()
            content = admit.content
            content.key_len = keys.shape[1]
            content.key_bytes = _address(keys)
            status = admit.call(self._handle_arg, num_tokens,
                                c_uint64(namespace) if namespace else admit.no_namespace,
                                priority, admit.content_ref, keys.shape[0], admit.seq_ref,
                                admit.cached_ref)
            if status:
                self._lib.raise_status(status, "kva_kv_seq_admit")
            seq, cached = admit.seq.value, admit.cached.value
        return Sequence._new(self, seq, cached)

    def pin(self, block_keys: IntegerArray | None = None,
            tokens: IntegerArray | None = None, namespace: int = 0, *,
            keys: KeyArray | None = None) -> Pin:
        """Pins the longest cached prefix of the given blocks (content as for ``allocate``): it
        is not evicted until ``unpin()``. ``Pin.num_tokens`` says how much was cached and is
        pinned now."""
        content = _content(tokens, block_keys, keys, self._max_key_bytes)
        ns = _u64("namespace", namespace)
        handle = c_uint64()
        pinned = c_uint32()
        with self._lock:
            self._lib.kva_kv_pin_content(self._open_handle(), ns, _content_ref(content),
                                         0 if content is None else content.count, byref(handle),
                                         byref(pinned))
        return Pin._new(self, handle.value, pinned.value)

    def lookup(self, keys: KeyArray | None = None, *, tokens: IntegerArray | None = None,
               block_keys: IntegerArray | None = None, namespace: int = 0) -> Lookup:
        """Looks a chain of blocks up (content as for ``allocate``) without changing anything:
        no reference, no LRU order, no statistic. Returns (hits, ids): the blocks matched from
        the first, stopping at the first miss, and their ids."""
        content = _content(tokens, block_keys, keys, self._max_key_bytes)
        ns = _u64("namespace", namespace)
        count = 0 if content is None else content.count
        ids = np.empty(count, dtype=np.uint32)
        hits = c_uint32()
        with self._lock:
            self._lib.kva_kv_lookup(self._open_handle(), ns, _content_ref(content), count,
                                    _address(ids), byref(hits))
        return Lookup(hits.value, ids[:hits.value])

    # -- batches: one call per scheduler step -----------------------------------------------
    #
    # Every per-request figure is a numpy array taken as it is (uint32 token counts and ids,
    # uint64 handles, namespaces, keys and offsets, uint8 priorities; a list is converted once),
    # and content is one array of every request's items one after the other, request i's being
    # items [offsets[i], offsets[i + 1]). The library checks every argument of every request
    # before it changes anything: a bad one raises with nothing changed. Sequences are named by
    # their handles (uint64): they are the caller's to free (free_many), and closing the cache
    # frees the rest.

    def _table_views(self) -> int:
        """The block-table views alive: the cache's users other than its KV tensors, which no
        table change touches."""
        return self._users - self._kv_tensors._views

    def _refuse_table_views(self, what: str) -> None:
        if self._table_views():
            raise TableInUseError(
                f"cannot {what}: {self._table_views()} block_table view(s) of this cache alive, and this "
                "call may move the tables they show; copy them (np.array(seq.block_table)) or "
                "drop the views first")

    def allocate_many(self, num_tokens: object, *, tokens: object = None,
                      block_keys: object = None, keys: object = None, offsets: object = None,
                      namespaces: object = None, priorities: object = None,
                      again: object = False) -> Admitted:
        """Admits len(num_tokens) sequences in one call, request i of ``num_tokens[i]`` tokens
        with its content items ``[offsets[i], offsets[i+1])`` of ``tokens``, ``block_keys`` or
        ``keys`` (as for ``allocate``), in ``namespaces[i]`` with ``priorities[i]`` (default 0
        for all), re-admissions where ``again`` says so (a bool for all, or one per request; see
        ``allocate``). Without ``offsets``, token ids are every token of every request and keys one
        per full block. A request hits the blocks an earlier one registered. Running out of
        blocks stops at the first request that does not fit (``Admitted.done``); a bad argument
        raises with nothing changed."""
        counts = _batch_array("num_tokens", num_tokens, _U32)
        count = counts.size
        content = _batch_content(tokens, block_keys, keys, self._max_key_bytes)
        offs = self._offsets(offsets, content, counts, full_blocks=True)
        ns = None if namespaces is None else _batch_array("namespaces", namespaces, _U64)
        prios = None if priorities is None else _batch_array("priorities", priorities, _U8)
        if (ns is not None and ns.size != count) or (prios is not None and prios.size != count):
            raise InvalidArgument(f"namespaces and priorities need {count} entries, one per "
                                  "request")
        if prios is not None and prios.size and prios.max() >= KVA_KV_AGAIN:
            first = int(np.flatnonzero(prios >= KVA_KV_AGAIN)[0])
            raise InvalidArgument(f"priorities[{first}]: {_readmission_bit(int(prios[first]))}")
        prios = _again_priorities(prios, again, count)
        handles = np.empty(count, dtype=np.uint64)
        cached = np.empty(count, dtype=np.uint32)
        done = c_uint32()
        with self._call_lock:
            self._lib.kva_kv_seq_admit_many(
                self._open_handle(), count, _address(counts),
                None if ns is None else _address(ns),
                None if prios is None else _address(prios), _content_ref(content),
                None if offs is None else _address(offs), _address(handles),
                _address(cached), byref(done))
        n = done.value
        return Admitted(handles[:n], cached[:n], n)

    def append_many(self, handles: object, num_tokens: object = 1, *, tokens: object = None,
                    block_keys: object = None, keys: object = None,
                    offsets: object = None) -> Extended:
        """One decode step for many sequences in one call: sequence ``handles[i]`` grows by
        ``num_tokens[i]`` tokens (an int: the same for all), with its content items
        ``[offsets[i], offsets[i+1])`` (as for ``Sequence.append``). Without ``offsets``, token
        ids are every token appended (request i's ``num_tokens[i]`` of them in turn); keys, one
        per block filled, need offsets. Returns the copies on write to do first and how many
        requests were done (the first that does not fit stops the batch); a bad handle or
        argument raises with nothing changed. Refused (``TableInUseError``) while a block-table
        view of this cache is alive."""
        if (type(keys) is np.ndarray and type(offsets) is np.ndarray and type(handles) is np.ndarray
                and tokens is None and block_keys is None and type(num_tokens) is int):
            done = self._append_keyed(handles, num_tokens, keys, offsets)
            if done is not None:
                return done
        seqs = _batch_array("handles", handles, _U64)
        count = seqs.size
        uniform = -1
        if isinstance(num_tokens, (int, np.integer)) and not isinstance(num_tokens, bool):
            uniform = _u32("num_tokens", num_tokens)
            counts = None
        else:
            counts = _batch_array("num_tokens", num_tokens, _U32)
            if counts.size != count:
                raise InvalidArgument(f"num_tokens has {counts.size} entries for {count} handles")
        step = self._step
        with self._call_lock:
            content = None
            if tokens is not None or block_keys is not None or keys is not None:
                content = _batch_content(tokens, block_keys, keys, self._max_key_bytes,
                                         step.content)
                step.content_kind = -1 if content is None else content.kind
            self._refuse_table_views("append to sequences")
            handle = self._open_handle()
            if counts is None:
                counts_address = step.uniform_counts(count, uniform)
            else:
                counts_address = _address(counts)
            offsets_address = None
            if content is not None:
                if offsets is None and uniform >= 0 and content.kind == _KEY_TOKENS:
                    if content.count < count * uniform:
                        raise InvalidArgument(f"{content.count} token ids for {count} requests "
                                              f"of {uniform}")
                    offsets_address = step.uniform_offsets(count, uniform)
                else:
                    if counts is None:
                        counts = step.counts[:count]
                    offs = self._offsets(offsets, content, counts, full_blocks=False)
                    assert offs is not None
                    offsets_address = _address(offs)
            elif offsets is not None:
                raise InvalidArgument("offsets without content (tokens, block_keys or keys)")
            self._lib.kva_kv_seq_extend_many(
                handle, count, _address(seqs), counts_address, _content_ref(content),
                offsets_address, step.copy_rows(count), step.num_copies_ref, step.done_ref)
            copied = step.num_copies.value
            copies = step.copies[:copied].copy() if copied else _NO_COPIES
            return Extended(copies, step.done.value)

    def _append_keyed(self, handles: npt.NDArray[Any], num_tokens: int, keys: npt.NDArray[Any],
                      offsets: npt.NDArray[Any]) -> Extended | None:
        """append_many's decode step as an engine makes it, every argument an array exactly as
        the library reads it: the engine's handles, one token each (or n), the keys of the blocks
        filled and their offsets. Each array is looked at once, and nothing is copied or
        converted; None when an argument is anything else, for the general path to convert or
        refuse with its messages."""
        count = handles.size
        if not (handles.dtype is _U64 and handles.ndim == 1 and handles.flags.c_contiguous
                and keys.dtype is _U8 and keys.ndim == 2 and keys.flags.c_contiguous
                and offsets.dtype is _U64 and offsets.ndim == 1 and offsets.flags.c_contiguous
                and offsets.size == count + 1 and offsets.item(-1) <= keys.shape[0]
                and 0 <= num_tokens <= _U32_MAX):
            return None
        step = self._step
        with self._call_lock:
            if self._users or self._closed:  # refused as on the general path
                self._refuse_table_views("append to sequences")
                self._open_handle()
            content = step.content
            if step.content_kind != _KEY_BYTES:
                content.kind = _KEY_BYTES
                content.tokens = content.keys = None
                step.content_kind = _KEY_BYTES
            content.key_len = keys.shape[1]
            content.key_bytes = _address(keys)
            self._lib.kva_kv_seq_extend_many(
                self._handle, count, _address(handles), step.uniform_counts(count, num_tokens),
                step.content_ref, _address(offsets), step.copy_rows(count), step.num_copies_ref,
                step.done_ref)
            copied = step.num_copies.value
            return Extended(step.copies[:copied].copy() if copied else _NO_COPIES,
                            step.done.value)

    def decode_step(self, capacity: int, *, content: str | None = None,
                    content_capacity: int | None = None, key_len: int | None = None
                    ) -> DecodeStep:
        """Buffers for decode steps of up to ``capacity`` sequences that this cache reads in
        place (``pykvalloc.decode_step`` says how an engine uses them): ``append_many`` without
        finding each array's memory every step. ``content``: None, ``"tokens"``,
        ``"block_keys"`` or ``"keys"`` (engine keys of ``key_len`` bytes, the cache's
        max_key_bytes by default), ``content_capacity`` items of it (default ``capacity``)."""
        from .decode_step import DecodeStep

        return DecodeStep(self, capacity, content, content_capacity, key_len)

    def free_many(self, handles: object) -> None:
        """Frees the sequences ``handles`` names, in order, in one call (as ``Sequence.free``).
        All or nothing: a handle freed before or listed twice raises ``DoubleFree``, one this
        cache never gave ``InvalidArgument``, and nothing is freed. Refused
        (``TableInUseError``) while a block-table view of this cache is alive."""
        seqs = _batch_array("handles", handles, _U64)
        with self._call_lock:
            self._refuse_table_views("free sequences")
            self._lib.kva_kv_seq_free_many(self._open_handle(), seqs.size, _address(seqs))

    def lookup_many(self, *, tokens: object = None, block_keys: object = None,
                    keys: object = None, offsets: object = None, namespaces: object = None,
                    ids: bool = True) -> LookupMany:
        """Looks up many chains in one call, changing nothing: request i's content is items
        ``[offsets[i], offsets[i+1])`` in ``namespaces[i]`` (default 0). Returns each request's
        hit in blocks and, with ``ids``, the hit blocks' ids (see ``LookupMany``)."""
        content = _batch_content(tokens, block_keys, keys, self._max_key_bytes)
        if content is None or offsets is None:
            raise InvalidArgument("lookup_many needs content (tokens, block_keys or keys) and "
                                  "offsets")
        offs = _batch_array("offsets", offsets, _U64)
        if offs.size == 0:
            raise InvalidArgument("offsets needs count + 1 entries (at least [0])")
        count = offs.size - 1
        ns = None if namespaces is None else _batch_array("namespaces", namespaces, _U64)
        if ns is not None and ns.size != count:
            raise InvalidArgument(f"namespaces needs {count} entries, one per request")
        _within(offs, content)
        hits = np.empty(count, dtype=np.uint32)
        found = np.full(content.count, _NO_BLOCK, dtype=np.uint32) if ids else None
        with self._lock:
            self._lib.kva_kv_lookup_many(
                self._open_handle(), count, None if ns is None else _address(ns),
                _content_ref(content), _address(offs), _address(hits),
                None if found is None else _address(found))
        return LookupMany(hits, found)

    def _offsets(self, offsets: object, content: _Content | None,
                 counts: npt.NDArray[np.uint32], full_blocks: bool
                 ) -> npt.NDArray[np.uint64] | None:
        """A batch's offsets: given, or by default every token id of each request (token ids)
        or, at admission, a key per full block. The library checks them; here only that they
        end within the content given, which it cannot see."""
        if content is None:
            if offsets is not None:
                raise InvalidArgument("offsets without content (tokens, block_keys or keys)")
            return None
        if offsets is not None:
            offs = _batch_array("offsets", offsets, _U64)
            if offs.size != counts.size + 1:
                raise InvalidArgument(f"offsets needs {counts.size + 1} entries (count + 1), "
                                      f"not {offs.size}")
        elif content.kind == _KEY_TOKENS or full_blocks:
            per = counts if content.kind == _KEY_TOKENS else counts // self._info.block_tokens
            offs = np.zeros(counts.size + 1, dtype=np.uint64)
            np.cumsum(per, out=offs[1:])
        else:
            raise InvalidArgument("keys of a decode step need offsets: which requests fill a "
                                  "block is the caller's to say")
        _within(offs, content)
        return offs

    def block_table(self, handle: int) -> npt.NDArray[np.uint32]:
        """A copy of the block table of the sequence ``handle`` names (a batch's handle, or
        ``Sequence.handle``)."""
        table = POINTER(c_uint32)()
        length = c_uint32()
        with self._lock:
            self._lib.kva_kv_seq_block_table(self._open_handle(), _u64("handle", handle),
                                              byref(table), byref(length))
            if not length.value:
                return np.empty(0, dtype=np.uint32)
            copied: npt.NDArray[np.uint32] = np.ctypeslib.as_array(
                table, shape=(length.value,)).copy()
            return copied

    # -- the block calls: an engine that keeps its own prefix structure -----------------------

    @property
    def blocks(self) -> Blocks:
        """The block calls (``take``, ``ref``, ``unref``, ``commit``): the engine holds
        references to blocks directly, as vLLM's BlockPool does."""
        return Blocks(self)

    def evict_blocks(self, ids: object) -> int:
        """Drops the registration of each listed block that has one (vLLM's ``evict_blocks``):
        a cached block becomes free, a used one stays with its holders, unregistered. Returns
        how many registrations were dropped (each a BlockRemoved event)."""
        blocks = _batch_array("ids", ids, _U32)
        evicted = c_uint32()
        with self._lock:
            self._lib.kva_kv_evict_blocks(self._open_handle(), _address(blocks), blocks.size,
                                          byref(evicted))
        return evicted.value

    def evict_keys(self, keys: KeyArray, namespace: int = 0) -> int:
        """``evict_blocks`` by engine key: each key registered in ``namespace`` has its block's
        registration dropped; keys not registered are passed over. Returns how many were."""
        rows = _key_rows("keys", keys, self._max_key_bytes)
        ns = _u64("namespace", namespace)
        evicted = c_uint32()
        with self._lock:
            self._lib.kva_kv_evict_keys(self._open_handle(), ns, _address(rows), rows.shape[1],
                                        rows.shape[0], byref(evicted))
        return evicted.value

    def reset_prefix_cache(self) -> None:
        """Empties the prefix cache: every registration dropped, cached blocks free, used ones
        kept by their holders, unregistered; one AllBlocksCleared event. Sequences keep their
        chains: what they fill later is registered afresh."""
        with self._lock:
            self._lib.kva_kv_reset_prefix_cache(self._open_handle())

    # -- events -------------------------------------------------------------------------------

    def take_event_records(self, max_events: int | None = None
                           ) -> tuple[npt.NDArray[Any], int]:
        """The oldest events, at most ``max_events`` (default: all), as a numpy array of
        EVENT_DTYPE (the C ``kva_kv_event``), and the number dropped since the previous take.
        Events beyond ``max_events`` stay for the next take."""
        limit = None if max_events is None else _u32("max_events", max_events)
        parts: list[npt.NDArray[Any]] = []
        dropped_total = 0
        count = c_uint32()
        dropped = c_uint64()
        with self._lock:
            handle = self._open_handle()
            while True:
                # 0 goes to C as it is: refused there, as a buffer with no room.
                room = _EVENT_CHUNK if limit is None else min(_EVENT_CHUNK, limit)
                buf = np.empty(max(room, 1), dtype=EVENT_DTYPE)
                self._lib.kva_kv_take_events(handle, _address(buf), room, byref(count),
                                             byref(dropped))
                dropped_total += dropped.value
                parts.append(buf[:count.value])
                if limit is not None:
                    limit -= count.value
                if count.value < room or limit == 0:
                    break
        records = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return records, dropped_total

    def take_events(self, max_events: int | None = None, *, hashes: str = "bytes") -> KVEvents:
        """Drains the KV events (a cache created with ``events``): BlockStored, BlockRemoved and
        AllBlocksCleared with vLLM's field names, in order, and the number dropped. At most
        ``max_events`` records are taken (a stored chain of n blocks is n records); the rest
        stay for the next take. ``hashes="int"``: each hash in vLLM's default event form (its
        last 8 bytes, big-endian, unsigned) instead of its bytes."""
        if hashes not in ("bytes", "int"):
            raise InvalidArgument(f"hashes must be 'bytes' or 'int', not {hashes!r}")
        records, dropped = self.take_event_records(max_events)
        return KVEvents(_events_from_records(records, hashes == "int"), dropped)

    def evict(self, max_blocks: int | None = None) -> int:
        """Evicts up to ``max_blocks`` cached blocks now (all of them by default), least
        recently used and lowest priority first. Returns how many."""
        count = _U32_MAX if max_blocks is None else _u32("max_blocks", max_blocks)
        evicted = c_uint32()
        with self._lock:
            self._lib.kva_kv_evict(self._open_handle(), count, byref(evicted))
        return evicted.value

    def compact(self) -> npt.NDArray[np.uint32]:
        """Moves every block that holds data (used, or cached for prefix hits: those keep their
        hits; ``evict()`` first to drop them instead) to the lowest ids, so that afterwards the
        free blocks are the top ids, ``used_blocks + cached_blocks`` onwards: the tail of
        the KV memory (of each layer's region with the layers layout). Every sequence's and
        pin's block table is rewritten in place, so this refuses (``TableInUseError``) while any
        block-table view of the cache is alive.

        Returns the moves as a numpy uint32 array of shape (n, 2), rows (src, dst): copy every
        layer's K and V of block src to block dst. No block is both a source and a destination,
        so the copies may run in any order or as one batch (``kv[:, dst] = kv[:, src]``); they
        must all be done before the next forward pass, and any pending ``CopyOnWrite`` before
        this call. Paged mode only (``InvalidArgument`` otherwise)."""
        count = c_uint32()
        with self._lock:
            if self._table_views():
                raise TableInUseError(
                    f"cannot compact: {self._table_views()} block_table view(s) alive; copy the tables "
                    "(np.array(seq.block_table)) or drop the views first")
            handle = self._open_handle()
            capacity = 0
            while True:
                moves = np.empty((capacity, 2), dtype=np.uint32)
                try:
                    self._lib.kva_kv_compact(handle, _address(moves) if capacity else None,
                                             capacity, byref(count))
                except OutOfMemory:
                    capacity = count.value  # the size the library asked for; nothing changed
                    continue
                return moves[:count.value]

    def trim(self) -> int:
        """Gives back the memory of the free blocks at the top ids: after ``compact()`` every
        free block is there, so compacting then trimming frees every whole GPU granule (or host
        page) of the KV memory that holds no data. Their content is gone: every copy
        ``compact()`` returned (its sources are free top blocks) and any kernel still reading a
        freed block must be finished, the device synchronized, before this call. The trimmed
        blocks still count as free for capacity: a call that needs them maps their memory again
        first (or evicts cached blocks if the memory cannot be had). A pool whose memory must
        stay (prefault, lock, pin, checked, hugetlb) gives nothing back. Returns the number of trimmed
        blocks (``stats().trimmed_blocks``). Paged mode only (``InvalidArgument``
        otherwise)."""
        trimmed = c_uint32()
        with self._lock:
            self._lib.kva_kv_trim(self._open_handle(), byref(trimmed))
        return trimmed.value

    # -- introspection ----------------------------------------------------------------------

    def stats(self) -> KVStats:
        """Counters and gauges: free_blocks, used_blocks, cached_blocks, hit_tokens,
        query_tokens, evictions, cow_copies, forks, ... and hit_rate."""
        raw = _ffi.KvaKvStats()
        with self._lock:
            self._lib.kva_kv_get_stats(self._open_handle(), byref(raw))
        return KVStats._from_c(raw)

    def gauges(self) -> KVGauges:
        """What the cache holds now (used, cached and free blocks, sequences, bytes in use), as
        ``stats()`` counts them, without building the rest of its figures: a scheduler that
        asks every step (the replay's) pays the call alone."""
        raw = _ffi.KvaKvStats()
        with self._lock:
            self._lib.kva_kv_get_stats(self._open_handle(), byref(raw))
        return KVGauges(raw.used_blocks, raw.cached_blocks, raw.free_blocks, raw.sequences,
                        raw.bytes_in_use)

    def reset_peaks(self) -> None:
        """Starts the peaks of ``stats()`` afresh from the figures as they stand."""
        with self._lock:
            self._lib.kva_kv_reset_peaks(self._open_handle())

    def namespaces(self) -> list[NamespaceShare]:
        """Each namespace's share of the cache, exact: a row for each of the ``NAMESPACE_SLOTS``
        namespaces holding a slot (namespace 0 from creation, then the others as they are
        seen; a slot whose counts are all zero goes to a new namespace only while the pooled row
        is zero), in slot order, then one pooling the rest (``namespace`` None); rows with
        nothing in them are left out. kvalloc_kv.h (kva_kv_namespaces) has the rules."""
        rows = (_ffi.KvaKvNamespaceShare * (NAMESPACE_SLOTS + 1))()
        count = c_uint32()
        with self._lock:
            self._lib.kva_kv_namespaces(self._open_handle(), byref(rows[0]), NAMESPACE_SLOTS + 1,
                                        byref(count))
        return [NamespaceShare(None if row.is_other else int(row.namespace_id), int(row.sequences),
                               int(row.pins), int(row.blocks), int(row.registered_blocks))
                for row in rows[:count.value]]

    def check(self) -> None:
        """Walks every invariant of the cache; ``CorruptionError`` names the first broken one."""
        with self._call_lock:
            self._lib.kva_kv_check(self._open_handle())

    def block_address(self, block: int, layer: int, kind: str | int = "K") -> int:
        """The address of the K (``kind="K"``) or V part of one layer of one block."""
        part = None
        if isinstance(kind, str):
            part = {"k": 0, "v": 1}.get(kind.lower())
        elif isinstance(kind, (int, np.integer)) and not isinstance(kind, bool) and kind in (0, 1):
            part = int(kind)
        if part is None:
            raise InvalidArgument(f"kind must be 'K' or 'V', not {kind!r}")
        out = c_void_p()
        with self._lock:
            self._lib.kva_kv_block_address(self._open_handle(), _u32("block", block),
                                           _u32("layer", layer), part, byref(out))
        return out.value or 0

    def kv_tensor(self, layer: int | None = None, *, group: int | None = None,
                  layout: str = "NHD", dtype: object = None) -> Tensor:
        """The KV memory as a ``pykvalloc.Tensor`` in the layout attention kernels read, indexed
        by block id: the ids of a block table index its first dimension as they are.

        ``layer`` an int: that layer's K and V, shape ``(num_blocks, 2, block_tokens, kv_heads,
        head_dim)`` for ``layout="NHD"`` (vLLM's and FlashInfer's NHD) or ``(num_blocks, 2,
        kv_heads, block_tokens, head_dim)`` for ``"HND"``; ``[b, 0]`` is the K part of block b
        and starts at ``block_address(b, layer, "K")``, ``[b, 1]`` at ``block_address(b, layer,
        "V")``. A layer of one part (``KVGroup.mla``) has no K/V dimension: ``(num_blocks,
        block_tokens, head_dim)`` for MLA's latent vectors (one head; what vLLM's MLA backends
        read), ``(num_blocks, block_tokens, kv_heads, head_dim)`` (or HND) with more heads.
        ``group``: the layers of that group (``groups=``) with one more leading dimension;
        neither: every layer, which needs all layers to have one shape. ``[l]`` of either is
        that layer's tensor.

        With the cache's ``layout="layers"`` (the default) a layer's and a group's tensors are
        contiguous, and so is the all-layer tensor of a cache without groups; with
        ``layout="blocks"`` they have the honest strides of memory where a block holds all its
        layers (``block_bytes`` between blocks), and are not contiguous (the permutation
        ``(num_blocks, layers, ...)`` of an all-layer tensor is).

        NHD and HND are two readings of the same bytes: the library never reads or copies what
        a part holds (in paged mode), so the order of tokens and heads inside a part is the
        engine's choice. Choose one and keep to it; a ``CopyOnWrite``'s ``tokens`` then count
        in that order.

        ``dtype`` (default: the cache's) may be any type of the cache's element size
        (``"bfloat16"`` for a cache made with ``"float16"``); another size raises
        InvalidArgument. The tensor keeps the cache's memory alive (a ``close()`` waits for the
        last one) and does not block ``compact()`` or the sequence calls: compaction's moves
        are data the engine copies through it. Paged mode only."""
        element = self._dtype if dtype is None else tensor_dtype(dtype)
        info = self._info
        if element.itemsize != info.dtype_bytes:
            raise InvalidArgument(f"dtype {element.name} has {element.itemsize} bytes per element;"
                                  f" this cache's elements have {info.dtype_bytes}")
        if not isinstance(layout, str) or layout.upper() not in ("NHD", "HND"):
            raise InvalidArgument(f"layout must be 'NHD' or 'HND', not {layout!r}")
        if info.mode is not KVMode.PAGED:
            raise InvalidArgument("KV tensors need a paged cache: a contiguous one has no block "
                                  "ids to index")
        if layer is not None and group is not None:
            raise InvalidArgument("give layer or group, not both")
        first, count = self._layer_range(layer, group)
        with self._lock:
            handle = self._open_handle()
            geometry = self._layer_geometry(handle, first)
            shape, strides = _layer_shape(info, geometry, layout.upper() == "HND")
            address = info.base + geometry.offset
            if layer is None:
                if count > 1:
                    step = self._layer_geometry(handle, first + 1).offset - geometry.offset
                else:
                    step = geometry.block_stride * info.num_blocks
                shape, strides = (count,) + shape, (step // info.dtype_bytes,) + strides
            counter = self._kv_tensors
            return Tensor._new(address, shape, strides, element, self._dl_device,
                               lambda: self._add_user(counter),
                               lambda: self._user_gone(counter))

    def _layer_range(self, layer: int | None, group: int | None) -> tuple[int, int]:
        """The first layer and the number of layers a KV tensor spans."""
        layers = self._info.layers
        if layer is not None:
            layer = _u32("layer", layer)
            if layer >= layers:
                raise InvalidArgument(f"layer {layer} is out of range ({layers} layers)")
            return layer, 1
        if group is not None:
            group = _u32("group", group)
            if group >= len(self._groups):
                raise InvalidArgument(f"group {group} is out of range ({len(self._groups)} "
                                      "groups)")
            return sum(g.layers for g in self._groups[:group]), self._groups[group].layers
        if self._info.kv_heads == 0:  # layers of different shapes (kva_kv_info)
            raise InvalidArgument("the layers differ in shape: take one tensor per layer "
                                  "(layer=) or per group (group=)")
        return 0, layers

    def _layer_geometry(self, handle: int, layer: int) -> _ffi.KvaKvLayer:
        geometry = _ffi.KvaKvLayer()
        self._lib.kva_kv_layer_info(handle, layer, byref(geometry))
        return geometry

    def layer_info(self, layer: int) -> KVLayerInfo:
        """One layer's geometry (``kva_kv_layer``): its group, parts (2: K and V; 1: one vector,
        MLA), heads, head_dim, and where its blocks are: ``block_address(b, layer, part) = base
        + offset + b * block_stride + part * part_bytes``. Paged mode only."""
        with self._lock:
            raw = self._layer_geometry(self._open_handle(), _u32("layer", layer))
        return _snapshot(KVLayerInfo, raw)

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """The cache's layers as groups of one shape (one group without ``groups=``)."""
        return self._groups

    @property
    def dtype(self) -> TensorDType:
        """The element type the cache was made with (what ``kv_tensor`` gives by default)."""
        return self._dtype

    @property
    def info(self) -> KVInfo:
        """The geometry: block_bytes, token_bytes, slot_bytes, part_bytes, block_stride,
        layer_stride, base (address), kv_bytes, num_blocks, max_context, mode, layout, ..."""
        return self._info

    @property
    def num_blocks(self) -> int:
        return self._info.num_blocks

    @property
    def block_tokens(self) -> int:
        return self._info.block_tokens

    @property
    def block_bytes(self) -> int:
        return self._info.block_bytes


class Blocks:
    """The block calls of a cache (``KVCache.blocks``), for an engine that keeps its own prefix
    structure (a vLLM BlockPool, a radix tree): it takes blocks, holds and drops references to
    them itself, and commits them under its own keys. Ids go in and out as numpy uint32 arrays;
    every call checks all its ids in C before it changes anything."""

    __slots__ = ("_cache",)

    def __init__(self, cache: KVCache) -> None:
        self._cache = cache

    def take(self, count: int, priority: int = 0) -> npt.NDArray[np.uint32]:
        """``count`` blocks, free ones first, then cached ones evicted (lowest priority, least
        recently released first), each used and unregistered with one reference the engine
        holds. All or nothing: ``OutOfMemory`` when fewer are free and evictable."""
        n = _u32("count", count)
        prio = _u32("priority", priority)
        ids = np.empty(n, dtype=np.uint32)
        cache = self._cache
        with cache._lock:
            cache._lib.kva_kv_block_take(cache._open_handle(), n, prio, _address(ids))
        return ids

    def unref(self, ids: object) -> None:
        """Drops one of the engine's references to each listed block, in order (an id listed n
        times drops n): a block left with none is cached at the newest end of the LRU if
        registered (so the order given is the order of eviction), else free. ``DoubleFree`` for
        a block no one holds; nothing changed on an error."""
        blocks = _batch_array("ids", ids, _U32)
        cache = self._cache
        with cache._lock:
            cache._lib.kva_kv_block_unref(cache._open_handle(), _address(blocks), blocks.size)

    def ref(self, ids: object) -> None:
        """Adds a reference the engine holds to each listed block (vLLM's ``touch``): a cached
        block leaves the LRU and is used again. ``InvalidArgument`` for a free block."""
        blocks = _batch_array("ids", ids, _U32)
        cache = self._cache
        with cache._lock:
            cache._lib.kva_kv_block_ref(cache._open_handle(), _address(blocks), blocks.size)

    def commit(self, ids: object, keys: KeyArray, namespace: int = 0, *,
               parent: bytes | None = None, first_token: int = 0) -> npt.NDArray[np.uint32]:
        """Registers full blocks the engine filled under its own keys, a chain (vLLM's
        ``cache_full_blocks``): ``ids[j]`` under ``keys[j]`` in ``namespace``. A key registered
        already leaves its block unregistered (a duplicate, freed when released). Returns, for
        each key, the block registered under it: ``ids[j]`` or the one that held it before.
        ``parent`` (the key before the first) and ``first_token`` only shape the stored
        events."""
        blocks = _batch_array("ids", ids, _U32)
        rows = _key_rows("keys", keys, self._cache._max_key_bytes)
        if rows.shape[0] != blocks.size:
            raise InvalidArgument(f"{blocks.size} blocks but {rows.shape[0]} keys")
        ns = _u64("namespace", namespace)
        start = _u32("first_token", first_token)
        if parent is not None and (not isinstance(parent, bytes) or len(parent) != rows.shape[1]):
            raise InvalidArgument(f"parent must be a key of {rows.shape[1]} bytes, as keys are")
        registered = np.empty(blocks.size, dtype=np.uint32)
        cache = self._cache
        with cache._lock:
            cache._lib.kva_kv_block_commit(
                cache._open_handle(), ns, _address(blocks), blocks.size, _address(rows),
                rows.shape[1], parent, start, _address(registered))
        return registered


def _free_forgotten(cache: KVCache, handle: int, pin: bool) -> None:
    """A finalizer: a sequence or pin became garbage without being freed."""
    locks = [cache._lock] + ([cache._pool_lock] if cache._pool_lock is not None else [])
    _locks.run_or_defer(locks, _free_forgotten_locked, cache, handle, pin)


def _free_forgotten_locked(cache: KVCache, handle: int, pin: bool) -> None:
    # A cache and its forgotten sequence collected together (a cycle, or an object of the
    # engine that held both): the collector runs the cache's finalizer, which destroys the C
    # cache, before the sequence's __del__. Its blocks went with it.
    if cache._closed or not cache._finalizer.alive:
        return
    try:
        (cache._lib.kva_kv_unpin if pin else cache._lib.kva_kv_seq_free)(cache._handle, handle)
    except KvallocError:
        pass  # freed another way already; nothing to give back


def _copy_of(copy: _ffi.KvaKvCopy) -> CopyOnWrite | Move | None:
    """What an append's copy struct tells the engine to copy first, if anything."""
    if copy.src_block != _NO_BLOCK:
        return CopyOnWrite(copy.src_block, copy.dst_block, copy.tokens)
    if copy.src:
        return Move(copy.src, copy.dst or 0, copy.tokens, copy.src_bucket, copy.dst_bucket)
    return None


_Seq = TypeVar("_Seq", bound="Sequence")


class Sequence:
    """One request's KV: a block table (paged) or a buffer (contiguous). Made by
    ``KVCache.allocate`` and ``Sequence.fork``."""

    __slots__ = ("_cache", "_handle", "_cached", "_views", "_freed", "__weakref__")
    _is_pin = False

    _cache: KVCache
    _handle: int
    _cached: int
    _views: int  # block-table views alive: users of the cache
    _freed: bool

    @classmethod
    def _new(cls: type[_Seq], cache: KVCache, handle: int, cached: int) -> _Seq:
        self = cls.__new__(cls)
        self._cache = cache
        self._handle = handle
        self._cached = cached
        self._views = 0
        self._freed = False
        return self

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        """A sequence forgotten without ``free()`` gives its blocks back here. A method rather
        than a weakref.finalize, which costs every admission an object, a weak reference and a
        registry entry (about 4 us of a 60 us prefill in ``kvalloc bench engines``). Nothing is
        done at interpreter exit, when the memory goes with the process (as a finalizer with
        atexit off); a cache already destroyed is recognized in _free_forgotten_locked."""
        if not getattr(self, "_freed", True) and not _finalizing():
            _free_forgotten(self._cache, self._handle, self._is_pin)

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("sequences come from KVCache.allocate() and Sequence.fork()")

    @property
    def handle(self) -> int:
        """The library's handle (``kva_kv_seq``)."""
        return self._handle

    @property
    def num_cached_tokens(self) -> int:
        """Tokens found in the prefix cache when the sequence was allocated."""
        return self._cached

    def _seq_info(self) -> _ffi.KvaKvSeqInfo:
        raw = _ffi.KvaKvSeqInfo()
        cache = self._cache
        with cache._lock:
            cache._lib.kva_kv_seq_get_info(cache._open_handle(), self._handle, byref(raw))
        return raw

    @property
    def num_tokens(self) -> int:
        return int(self._seq_info().num_tokens)

    @property
    def num_blocks(self) -> int:
        return int(self._seq_info().num_blocks)

    @property
    def namespace(self) -> int:
        raw = self._seq_info()
        return int(raw.namespace_hi) << 32 | int(raw.namespace_id)

    @property
    def priority(self) -> int:
        return int(self._seq_info().priority)

    @property
    def buffer(self) -> tuple[int, int]:
        """Contiguous mode: (address, bucket_tokens) of the sequence's buffer."""
        raw = self._seq_info()
        return (raw.buffer or 0, raw.bucket_tokens)

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def block_table(self) -> npt.NDArray[np.uint32]:
        """The block ids, in order, as a read-only numpy uint32 view of the library's table (no
        copy). While it is alive, ``append()`` and ``free()`` refuse: see the module docs."""
        cache = self._cache
        table = POINTER(c_uint32)()
        length = c_uint32()
        with cache._lock:
            cache._lib.kva_kv_seq_block_table(cache._open_handle(), self._handle, byref(table),
                                              byref(length))
            address = c_void_p.from_buffer(table).value or 0
            anchor = ArrayAnchor(self, address, length.value, "<u4", readonly=True)
            # The view is a user of the cache: a close() leaves the C cache to the last view.
            released = weakref.finalize(anchor, cache._user_gone, self)
            released.atexit = False
            cache._add_user(self)
        view: npt.NDArray[np.uint32] = np.asarray(anchor)
        view.flags.writeable = False
        return view

    def _refuse_with_views(self, what: str) -> None:
        if self._views:
            raise TableInUseError(
                f"cannot {what} {self!r}: {self._views} block_table view(s) alive; copy the table "
                "(np.array(seq.block_table)) or drop the views first")

    def append(self, num_tokens: int = 1, *, tokens: IntegerArray | None = None,
               block_keys: IntegerArray | None = None,
               keys: KeyArray | None = None) -> CopyOnWrite | Move | None:
        """Grows the sequence by ``num_tokens`` (decoding). Returns what the engine must copy
        first (a ``CopyOnWrite`` of the shared last block, or in contiguous mode a ``Move``),
        else None. ``OutOfMemory`` with nothing changed if the blocks are not there.

        A sequence that keeps its chain (``allocate`` was given all of its content) commits the
        blocks this call fills to the prefix cache when told what they hold, in the sequence's
        own kind: ``tokens`` (the ``num_tokens`` token ids appended), or ``block_keys`` /
        ``keys`` (one per block this call fills). A later request (the next turn of a
        conversation) then hits them. Without content, a call that fills a block (or, keyed by
        token ids, appends any token) ends the chain: no later block is registered."""
        cache = self._cache
        if (tokens is None and block_keys is None and keys is None and type(num_tokens) is int
                and 0 <= num_tokens <= _U32_MAX):
            return self._append_plain(cache, num_tokens)
        n = _u32("num_tokens", num_tokens)
        content = _content(tokens, block_keys, keys, self._cache._max_key_bytes)
        copy = _ffi.KvaKvCopy()
        with cache._call_lock:
            self._refuse_with_views("append to")
            cache._lib.kva_kv_seq_extend(cache._open_handle(), self._handle, n,
                                         _content_ref(content),
                                         0 if content is None else content.count, byref(copy))
        return _copy_of(copy)

    def _append_plain(self, cache: KVCache, n: int) -> CopyOnWrite | Move | None:
        """append(n) without content, as a decode step of one sequence makes it: the reused
        copy struct and one call with nothing converted (the handle as a c_uint64, n an int)."""
        plain = cache._append1
        with cache._call_lock:
            self._refuse_with_views("append to")
            cache._open_handle()
            status = plain.call(cache._handle_arg, c_uint64(self._handle), n, None, 0,
                                plain.copy_ref)
            if status:
                cache._lib.raise_status(status, "kva_kv_seq_extend")
            return _copy_of(plain.copy)

    def fork(self) -> Sequence:
        """A new sequence sharing every block of this one (reference counted); the first append
        into a shared, partly filled last block copies it (see ``append``)."""
        child = c_uint64()
        cache = self._cache
        with cache._lock:
            cache._lib.kva_kv_seq_fork(cache._open_handle(), self._handle, byref(child))
        return Sequence._new(cache, child.value, self._cached)

    def free(self) -> None:
        """Releases the sequence: its blocks lose a reference; full prefix blocks stay cached
        until evicted. A second ``free()`` raises ``DoubleFree``."""
        cache = self._cache
        with cache._call_lock:
            self._refuse_with_views("free")
            self._release_call(cache)(cache._open_handle(), self._handle)
            self._freed = True

    def _release_call(self, cache: KVCache) -> Callable[[int, int], int]:
        return cache._lib.kva_kv_seq_free

    def __enter__(self: _Seq) -> _Seq:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._freed:
            self.free()

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        refuse_copy(self)

    def __repr__(self) -> str:
        state = "freed" if self._freed else "live"
        return f"<pykvalloc.{type(self).__name__} {self._handle:#x} {state}>"


class Pin(Sequence):
    """A pinned prefix (``KVCache.pin``): never evicted until ``unpin()``."""

    __slots__ = ()
    _is_pin = True

    @property
    def num_tokens(self) -> int:
        """Tokens pinned."""
        return self._cached

    def unpin(self) -> None:
        self.free()

    def _release_call(self, cache: KVCache) -> Callable[[int, int], int]:
        return cache._lib.kva_kv_unpin

    def append(self, num_tokens: int = 1, *, tokens: IntegerArray | None = None,
               block_keys: IntegerArray | None = None,
               keys: KeyArray | None = None) -> NoReturn:
        raise InvalidArgument("a pin does not grow")

    def fork(self) -> Sequence:
        raise InvalidArgument("a pin cannot be forked")

