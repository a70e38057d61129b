"""DecodeStep: the buffers of a decode step that the cache reads in place.

An engine steps its running sequences together many times a second. ``KVCache.append_many``
takes the step as arrays the engine builds each time, and finding where each array's data lives
costs a few hundred nanoseconds an array through ctypes, more than the library spends on a
dozen sequences. A DecodeStep owns the arrays instead, for the life of the engine: it knows
their addresses once, the engine writes each step into them (the way it keeps persistent input
buffers for its kernels), and ``run(count)`` is one call into the library for the first
``count`` entries.

    step = cache.decode_step(256, content="keys")
    step.handles[:n] = running_handles          # Sequence.handle of each running request
    step.offsets[1:n + 1] = np.cumsum(fills)    # request i fills offsets[i+1] - offsets[i] blocks
    step.keys[:step.offsets[n]] = filled_keys   # their keys, in request order
    done = step.run(n)                          # requests [0, done) grew by num_tokens[i]
    for request, src, dst, tokens in step.copies:
        ...                                     # copies on write to do first

What ``run`` means is ``append_many``'s: the library checks every entry (a stale or repeated
handle, offsets that do not run from 0 upwards, a key length other than the sequence's) and a
refused step changes nothing; the first request that does not fit stops the step.
"""

from __future__ import annotations

import operator
from ctypes import byref, pointer
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _ffi
from .errors import InvalidArgument

if TYPE_CHECKING:
    import numpy.typing as npt

    from .kvcache import KVCache

# What a step's content holds (kva_kv_key_kind): nothing, the token ids appended, one 64-bit
# key per block filled, or one engine key per block filled.
CONTENTS = {None: 0, "tokens": 1, "block_keys": 2, "keys": 3}


def _count(name: str, value: object, low: int, high: int) -> int:
    """An integer in [low, high], else InvalidArgument (a bool is not a count)."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or not low <= number <= high:
        raise InvalidArgument(f"{name} must be an integer in {low} .. {high}, not {value!r}")
    return number


def _fixed(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """A view of a buffer only the step holds: the library keeps its address, so the array must
    never move, and a view cannot be resized (numpy refuses: it does not own its data)."""
    fixed: npt.NDArray[Any] = array.view()
    return fixed


class DecodeStep:
    """Buffers for decode steps of up to ``capacity`` sequences of one cache (made by
    ``KVCache.decode_step``). ``handles``, ``num_tokens`` (1 each at first), ``offsets`` (0 at
    first) and the content array (``keys``, ``tokens`` or ``block_keys``, ``content_capacity``
    items) are the engine's to write in place (``step.handles[:n] = ...``); the arrays themselves
    cannot be replaced or resized, since the library reads them where they are. ``run(count)``
    reads their first ``count`` entries. A step belongs to one thread at a time, as its
    buffers do."""

    __slots__ = ("_cache", "_capacity", "_content_capacity", "_kind", "_handles", "_num_tokens",
                 "_offsets", "_content", "_copies", "_struct", "_step", "_step_ref", "_extend")

    def __init__(self, cache: KVCache, capacity: int, content: str | None,
                 content_capacity: int | None, key_len: int | None) -> None:
        from .kvcache import _U32_MAX, _address

        if content not in CONTENTS:
            raise InvalidArgument(f"content must be one of {', '.join(map(repr, CONTENTS))}, "
                                  f"not {content!r}")
        capacity = _count("capacity", capacity, 1, _U32_MAX)
        # A block filled by each request, or a token id for each, by default.
        content_capacity = _count("content_capacity",
                                  capacity if content_capacity is None else content_capacity,
                                  1, _U32_MAX)
        self._cache = cache
        self._capacity = capacity
        self._kind = CONTENTS[content]
        self._handles: npt.NDArray[np.uint64] = _fixed(np.zeros(capacity, dtype=np.uint64))
        self._num_tokens: npt.NDArray[np.uint32] = _fixed(np.ones(capacity, dtype=np.uint32))
        self._offsets: npt.NDArray[np.uint64] = _fixed(np.zeros(capacity + 1, dtype=np.uint64))
        self._copies = np.zeros((capacity, 4), dtype=np.uint32)
        self._struct = _ffi.KvaKvContent()
        self._struct.kind = self._kind
        content_array: npt.NDArray[Any] | None = None
        if content == "keys":
            max_key = cache._max_key_bytes
            length = max_key if key_len is None else key_len
            if not isinstance(length, int) or not 1 <= length <= max(max_key, 1) or not max_key:
                raise InvalidArgument(f"key_len {length!r} is not in 1 .. {max_key} (the cache's "
                                      "max_key_bytes)")
            content_array = _fixed(np.zeros((content_capacity, length), dtype=np.uint8))
            self._struct.key_len = length
            self._struct.key_bytes = _address(content_array)
        elif key_len is not None:
            raise InvalidArgument("key_len applies to content='keys' only")
        elif content == "tokens":
            content_array = _fixed(np.zeros(content_capacity, dtype=np.uint32))
            self._struct.tokens = _address(content_array)
        elif content == "block_keys":
            content_array = _fixed(np.zeros(content_capacity, dtype=np.uint64))
            self._struct.keys = _address(content_array)
        self._content = content_array
        self._content_capacity = content_capacity if content_array is not None else 0
        # The step's arrays, given to the library once: each run passes this and a count.
        step = self._step = _ffi.KvaKvStep()
        step.seqs = _address(self._handles)
        step.num_tokens = _address(self._num_tokens)
        if content_array is not None:
            step.content = pointer(self._struct)
            step.offsets = _address(self._offsets)
        step.copies = _address(self._copies)
        self._step_ref = byref(step)
        # The call with no argument converted (KvaLib.untyped): the cache's _handle_arg, the
        # struct by reference, the count as an int.
        self._extend = cache._lib.untyped("kva_kv_seq_extend_step")

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def handles(self) -> npt.NDArray[np.uint64]:
        """Sequence handles (``Sequence.handle``), one a request."""
        return self._handles

    @property
    def num_tokens(self) -> npt.NDArray[np.uint32]:
        """Tokens each request grows by (1 each until written)."""
        return self._num_tokens

    @property
    def offsets(self) -> npt.NDArray[np.uint64]:
        """Request i's content items are [offsets[i], offsets[i+1]); offsets[0] is 0."""
        return self._offsets

    @property
    def keys(self) -> npt.NDArray[np.uint8]:
        """content='keys': one engine key a row, for each block the step fills, in request
        order (request i's from row offsets[i] to offsets[i+1])."""
        return self._content_of("keys")

    @property
    def tokens(self) -> npt.NDArray[np.uint32]:
        """content='tokens': the token ids appended, request i's num_tokens[i] of them from
        offsets[i]."""
        return self._content_of("tokens")

    @property
    def block_keys(self) -> npt.NDArray[np.uint64]:
        """content='block_keys': one 64-bit key for each block the step fills."""
        return self._content_of("block_keys")

    def _content_of(self, name: str) -> npt.NDArray[Any]:
        if self._content is None or CONTENTS[name] != self._kind:
            raise AttributeError(f"this step's content is not {name}")
        return self._content

    @property
    def copies(self) -> npt.NDArray[np.uint32]:
        """The last run's copies on write, a row (request, src_block, dst_block, tokens) each,
        to do before the step's kernels run (a view, overwritten by the next run)."""
        return self._copies[:self._step.num_copies]

    def run(self, count: int) -> int:
        """Appends to the first ``count`` sequences of ``handles``, ``num_tokens[i]`` tokens
        each, with their content (the first ``count`` + 1 offsets say which items are whose).
        Returns how many were done: requests from there on did not fit and changed nothing.
        InvalidArgument (nothing changed) for a count above capacity, offsets past the content
        array, or any entry the library refuses; TableInUseError while a block-table view of the
        cache is alive; PoolClosedError once the cache is closed."""
        if type(count) is not int or not 0 <= count <= self._capacity:
            count = _count("count (at most the step's capacity)", count, 0, self._capacity)
        if self._kind and self._offsets.item(count) > self._content_capacity:
            raise InvalidArgument(f"offsets[{count}] is {self._offsets.item(count)}, beyond the "
                                  f"{self._content_capacity} content items the step holds")
        cache = self._cache
        with cache._call_lock:  # what append_many holds
            if cache._users or cache._closed:  # refused as append_many refuses
                cache._refuse_table_views("append to sequences")
                cache._open_handle()
            self._step.num_copies = 0  # a refused step leaves no copies of the last one
            status = self._extend(cache._handle_arg, self._step_ref, count)
            if status:
                cache._lib.raise_status(status, "kva_kv_seq_extend_step")
            done: int = self._step.done
            return done
