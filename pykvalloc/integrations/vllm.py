"""pykvalloc as vLLM's KV offloading tier: the scheduler side of vLLM's CPU offloading, backed by
a KVCache.

vLLM's published extension point for a KV store outside the GPU prefix cache is the offloading
connector's spec (``vllm/v1/kv_offload``): ``--kv-transfer-config`` names a spec class by
``spec_name`` and ``spec_module_path``, and vLLM imports it. ``KvallocOffloadingSpec`` is vLLM's
own ``CPUOffloadingSpec`` with one method changed, ``get_manager()``: it returns
``KvallocOffloadingManager`` in place of vLLM's ``CPUOffloadingManager``. vLLM's GPU worker
still copies the KV between the GPU and its shared host region, by the chunk ids the manager
hands out; the manager decides which ids, keeps the index of what is stored, evicts, and
reports events::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 8589934592,
        "spec_name": "KvallocOffloadingSpec",
        "spec_module_path": "pykvalloc.integrations.vllm"}}'

The manager is a metadata-only KVCache (one block a chunk, one byte of KV each: the bytes live
in vLLM's region) created with engine keys and events:

* A chunk's key is vLLM's ``OffloadKey``: the block hash (the engine key, 16 or 32 bytes, already
  chained by vLLM) and the KV-cache group (the last 4 bytes, the namespace). Keys of different
  groups never match.
* ``prepare_store`` takes blocks (``cache.blocks.take``): free ones first, then the least
  recently used idle chunks evicted; the evicted keys come back as the cache's removed events.
  The chunks being stored stay out of the index until ``complete_store`` commits them under their
  keys (``cache.blocks.commit``), so a lookup says HIT_PENDING meanwhile; a failed store
  releases its chunks unregistered.
* A load pins its chunks (a reference the manager holds) until ``complete_load``.
* Recency is the cache's LRU: a chunk is as recent as the last time it was released (stored,
  loaded, touched). vLLM's LRU policy ranks a request's chunks by position within the request
  (its tail evicted first) and ranks them all as new when the request finishes; the manager
  keeps that order by releasing a request's idle chunks again, tail first, whenever one of them
  changes (``_refresh``). Where vLLM's order depends on requests running at once (provisional
  ranks) or on touching a chunk while it is pinned, the release order differs: see
  tests/vllm/test_offloading.py for those cases.

vLLM is imported when the classes are first used (a module ``__getattr__``), never by
``import pykvalloc``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import OutOfMemory
from ..kvcache import KVCache

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["KvallocOffloadingSpec", "KvallocOffloadingManager"]

_GROUP_BYTES = 4  # an OffloadKey ends with its group index, 4 bytes big-endian
_EVENT_STORED, _EVENT_REMOVED = 1, 2


class _RequestKeys:
    """The keys a request has seen (stored, loaded or offered), with their positions: what
    vLLM's LRU policy ranks by. One per request and manager (vLLM's ReqContext state)."""

    __slots__ = ("owner", "generation", "positions", "finished")

    def __init__(self, owner: object, generation: int) -> None:
        self.owner = owner
        self.generation = generation
        self.positions: dict[bytes, int] = {}
        self.finished = False


def _vllm(module: str) -> Any:
    return importlib.import_module(f"vllm.{module}")


def _build() -> dict[str, type]:
    """The classes, defined on first use: they subclass vLLM's."""
    try:
        base = _vllm("v1.kv_offload.base")
        spec_module = _vllm("v1.kv_offload.cpu.spec")
        common = _vllm("v1.kv_offload.cpu.common")
    except ImportError as exc:
        raise ImportError(f"pykvalloc.integrations.vllm needs vLLM's KV offloading "
                          f"(vllm.v1.kv_offload, vLLM 0.33): pip install 'pykvalloc[vllm]' "
                          f"({exc})") from exc
    OffloadingEvent, Medium, LookupResult = base.OffloadingEvent, base.Medium, base.LookupResult
    PrepareStoreOutput, RequestOffloadingContext = (base.PrepareStoreOutput,
                                                    base.RequestOffloadingContext)
    CPULoadStoreSpec = common.CPULoadStoreSpec
    ManagerBase: Any = base.OffloadingManager
    SpecBase: Any = spec_module.CPUOffloadingSpec

    class KvallocOffloadingManager(ManagerBase):  # type: ignore[misc]
        """vLLM's OffloadingManager over a KVCache: see the module's docstring."""

        def __init__(self, num_chunks: int, enable_events: bool = False,
                     **ignored: Any) -> None:
            # ``ignored``: CPUOffloadingManager's policy settings (cache_policy,
            # store_threshold, ...), which have no meaning here.
            self._num_chunks = int(num_chunks)
            self._events_on = bool(enable_events)
            self._events: list[Any] = []
            self._pending: dict[bytes, int] = {}  # key -> chunk of a store in flight
            self._generation = 0
            self._cache = self._new_cache()

        def _new_cache(self) -> KVCache | None:
            if self._num_chunks == 0:
                return None
            # Room for every event one call can make (each chunk evicted and stored once),
            # drained after each call.
            events = min(1 << 20, 2 * self._num_chunks + 64)
            return KVCache(num_blocks=self._num_chunks, block_tokens=1, layers=1, kv_heads=1,
                           head_dim=1, dtype="int8", max_key_bytes=32, events=events,
                           event_medium="CPU")

        # -- keys ---------------------------------------------------------------------------

        @staticmethod
        def _rows(keys: list[bytes]) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint64]]:
            """Each key's hash as a row of engine-key bytes, and its group as a namespace."""
            length = len(keys[0]) - _GROUP_BYTES if keys else 1
            hashes = b"".join(key[:-_GROUP_BYTES] for key in keys)
            groups = b"".join(key[-_GROUP_BYTES:] for key in keys)
            rows = np.frombuffer(hashes, dtype=np.uint8).reshape(len(keys), length)
            namespaces = np.frombuffer(groups, dtype=">u4").astype(np.uint64)
            return rows, namespaces

        def _find(self, keys: list[bytes]) -> npt.NDArray[np.int64]:
            """The chunk stored under each key, or -1 (one lookup_many for all of them)."""
            if not keys or self._cache is None:
                return np.full(len(keys), -1, dtype=np.int64)
            rows, namespaces = self._rows(keys)
            found = self._cache.lookup_many(keys=rows, namespaces=namespaces,
                                            offsets=np.arange(len(keys) + 1, dtype=np.uint64))
            assert found.ids is not None
            return np.where(found.hits == 1, found.ids.astype(np.int64), -1)

        def _drain(self) -> list[bytes]:
            """The cache's events since the last drain: the keys it evicted, in order."""
            assert self._cache is not None
            records, dropped = self._cache.take_event_records()
            if dropped:  # the ring holds more than one call can make
                raise RuntimeError(f"{dropped} KV events lost: evicted keys are unknown")
            removed = records[records["kind"] == _EVENT_REMOVED]
            return [bytes(r["key"][:int(r["key_len"])]) + int(r["namespace_id"]).to_bytes(
                _GROUP_BYTES, "big") for r in removed]

        def _event(self, keys: list[bytes], removed: bool, metadata_only: bool = False) -> None:
            if keys and self._events_on:
                self._events.append(OffloadingEvent(keys=keys, medium=Medium.CPU,
                                                    removed=removed,
                                                    metadata_only=metadata_only))

        # -- recency ------------------------------------------------------------------------

        def _state(self, ctx: Any) -> _RequestKeys:
            state: _RequestKeys | None = ctx.get_state(_RequestKeys)
            if state is None or state.owner is not self or state.generation != self._generation:
                state = _RequestKeys(self, self._generation)
                ctx.set_state(state)
            return state

        def _see(self, ctx: Any, keys: list[bytes]) -> None:
            positions = self._state(ctx).positions
            for key in keys:
                position = ctx.get_offload_key_position(key)
                if position is not None:
                    positions[key] = position

        def _refresh(self, ctx: Any) -> None:
            """Releases the request's idle chunks again, tail first: its head is then the most
            recently used, and its chunks newer than any other's (vLLM's request ranks)."""
            if self._cache is None:
                return
            positions = self._state(ctx).positions
            keys = sorted(positions, key=positions.__getitem__, reverse=True)
            ids = self._find(keys)
            ids = ids[ids >= 0].astype(np.uint32)
            if ids.size:
                blocks = self._cache.blocks
                blocks.ref(ids)
                blocks.unref(ids)  # in order: the last released is the newest

        # -- OffloadingManager --------------------------------------------------------------

        def on_new_request(self, req_context: Any) -> Any:
            self._state(req_context)
            return RequestOffloadingContext()

        def lookup(self, key: bytes, req_context: Any) -> Any:
            if key in self._pending:
                return LookupResult.HIT_PENDING
            return LookupResult.HIT if self._find([key])[0] >= 0 else LookupResult.MISS

        def prepare_load(self, keys: Any, req_context: Any) -> Any:
            keys = list(keys)
            ids = self._find(keys)
            if keys and (ids < 0).any():
                raise KeyError(f"prepare_load of keys not stored: "
                               f"{[k for k, i in zip(keys, ids) if i < 0][:3]}")
            if ids.size:
                assert self._cache is not None
                self._cache.blocks.ref(ids.astype(np.uint32))  # pinned until complete_load
            self._see(req_context, keys)
            return CPULoadStoreSpec(ids.tolist())

        def touch(self, keys: Any, req_context: Any) -> None:
            ids = self._find(list(keys))[::-1]  # the first key becomes the most recent
            ids = ids[ids >= 0].astype(np.uint32)
            if ids.size:
                assert self._cache is not None
                self._cache.blocks.ref(ids)
                self._cache.blocks.unref(ids)

        def complete_load(self, keys: Any, req_context: Any) -> None:
            ids = self._find(list(keys))
            if (ids < 0).any():
                raise KeyError("complete_load of keys not stored")
            if ids.size:
                assert self._cache is not None
                self._cache.blocks.unref(ids[::-1].astype(np.uint32))
            self._refresh(req_context)

        def prepare_store(self, keys: Any, req_context: Any) -> Any:
            keys = list(keys)
            ids = self._find(keys)
            keys_to_store = [k for k, i in zip(keys, ids) if i < 0 and k not in self._pending]
            ready = np.unique(ids[ids >= 0]).astype(np.uint32)
            self._see(req_context, keys_to_store + [k for k, i in zip(keys, ids) if i >= 0])
            if not keys_to_store:
                self._refresh(req_context)
                return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec([]),
                                          evicted_keys=[])
            cache = self._cache
            if cache is None:
                return None
            # The offered keys stored already are protected: held while blocks are taken.
            cache.blocks.ref(ready)
            try:
                taken = cache.blocks.take(len(keys_to_store))
            except OutOfMemory:
                return None
            finally:
                cache.blocks.unref(ready)
                self._refresh(req_context)
            evicted = self._drain()
            self._event(evicted, removed=True)
            self._pending.update(zip(keys_to_store, taken.tolist()))
            return PrepareStoreOutput(keys_to_store=keys_to_store,
                                      store_spec=CPULoadStoreSpec(taken.tolist()),
                                      evicted_keys=evicted)

        def complete_store(self, keys: Any, req_context: Any, success: bool = True) -> None:
            done = [k for k in dict.fromkeys(keys) if k in self._pending]
            if not done:
                return
            assert self._cache is not None
            ids = np.array([self._pending.pop(k) for k in done], dtype=np.uint32)
            if success:
                rows, namespaces = self._rows(done)
                for group in np.unique(namespaces):
                    mine = namespaces == group
                    self._cache.blocks.commit(ids[mine], rows[mine], namespace=int(group))
                self._drain()
                self._cache.blocks.unref(ids[::-1])
                self._refresh(req_context)
                self._event(done, removed=False)
            else:  # released unregistered: free again, the first to be taken
                self._cache.blocks.unref(ids)
                self._event(done, removed=True, metadata_only=True)

        def on_request_finished(self, req_context: Any) -> None:
            state = req_context.get_state(_RequestKeys)
            if (state is None or state.owner is not self or state.generation != self._generation
                    or state.finished):
                return
            self._refresh(req_context)
            state.finished = True

        def reset_cache(self) -> None:
            # Every chunk forgotten, pinned and in-flight ones included (vLLM completes no job
            # from before a reset): a new cache, whose chunk ids start again from 0.
            if self._cache is not None:
                self._cache.close()
            self._pending.clear()
            self._generation += 1
            self._cache = self._new_cache()

        def take_events(self) -> Any:
            events, self._events = self._events, []
            for event in events:
                if event.metadata_only:  # a key stored again since is not announced as gone
                    ids = self._find(list(event.keys))
                    event.keys = [k for k, i in zip(event.keys, ids)
                                  if i < 0 and k not in self._pending]
                    if not event.keys:
                        continue
                yield event

        def shutdown(self) -> None:
            if self._cache is not None:
                self._cache.close()

    class KvallocOffloadingSpec(SpecBase):  # type: ignore[misc]
        """vLLM's CPUOffloadingSpec whose manager is KvallocOffloadingManager."""

        _manager: Any

        def get_manager(self) -> Any:
            if not self._manager:
                self._manager = KvallocOffloadingManager(
                    num_chunks=self.num_chunks,
                    enable_events=self.kv_events_config.enable_kv_cache_events)
            return self._manager

    return {"KvallocOffloadingManager": KvallocOffloadingManager,
            "KvallocOffloadingSpec": KvallocOffloadingSpec}


def __getattr__(name: str) -> type:
    if name in __all__:
        globals().update(_build())
        return globals()[name]  # type: ignore[no-any-return]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
