"""An independent pure-Python model of the KV-cache manager's policy (kva_kv_*, paged mode).

It shares no code and no data structure with the library: blocks live in Python lists and
deques, the LRU lists are OrderedDicts, and a prefix is named exactly, by interning the tuple
(parent prefix, block content, namespace), where the library uses 128-bit hashes. The policy it
implements, as the library documents it:

* Free blocks form a stack: taken from the top; a released unkeyed block goes on top; evicted
  blocks go below every free block. Initially block 0 is on top, then 1, 2, ...
* A request looks its given blocks up in order and stops at the first miss; each hit gains a
  reference (leaving its LRU list if it was cached) and takes the higher of its priority and the
  request's. The request fails, changing nothing, if it needs more new blocks than are free
  plus cached (its own cached hits excepted).
* A call first evicts what it needs beyond the free blocks: lowest priority first, least
  recently released first within a priority. Then it takes its new blocks, then registers its
  new given blocks under their prefixes unless a prefix is already registered.
* Release goes last block first; a block left with no reference is cached (newest end of its
  priority's LRU list) if registered, else free.
* Append: a copy on write first when the last block is shared and partly filled and tokens are
  added, then new blocks for the tokens beyond the last block.
* Compaction: with n blocks holding data (used or cached), the i-th such block at an id >= n
  moves to the i-th free id < n (both ascending); a block keeps its references, priority,
  prefix and place on its LRU list; the free stack becomes n, n+1, ... from the top.

For engines (kvalloc_kv.h's content, the block calls, events):

* Content is token ids or u64 keys, both chained onto the prefix before them and the
  namespace, or engine keys, named by (namespace, bytes) alone: the engine chained them.
* A request given all of its content (every token id, or a key per full block) keeps its chain:
  an append told what it adds commits each block it fills under the next name of the chain
  (token ids wait in the partial block until it is full); an append that is not told ends the
  chain when it fills a block (keyed by token ids: when it adds any token). A fork keeps the
  chain.
* The engine's references (``loose``) are counted apart from the tables': take gives each block
  one, ref adds one (a cached block is used again), unref drops them in the order given (a
  double unref, a block no one holds: refused, nothing changed), commit registers blocks the
  engine alone holds under engine keys (a key registered already leaves its block
  unregistered).
* evict_blocks / evict_keys drop registrations: a cached block goes below the free blocks, a
  used one stays used. reset drops every registration: the cached blocks first, in eviction
  order, below the free blocks, then the used ones; one cleared event and no removed ones.
* Re-admissions (``again``) count their queried and hit tokens apart too; pinned blocks are the
  distinct blocks the live pins' tables name.
* Namespaces: each namespace's live sequences, pins, table lengths and registered blocks
  (``namespace_totals``). The library tracks 32 of them one by one and pools the rest in one row;
  which ones it tracks follows the order of its lookups, so ``check_namespaces`` checks what must
  hold whatever that order: a tracked row equals its namespace's figures and the pooled row the
  sum of the untracked ones.
* Events, in order: stored (block, name, parent name or None, first token) per registration,
  removed (block, name) per registration dropped by eviction or evict_*, cleared; a ring of
  ``event_capacity`` that drops and counts what finds it full.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

PRIORITIES = 8


class NoRoom(Exception):
    """The model's out of memory: the request needs more blocks than are free or evictable."""


class Refused(Exception):
    """The model's refusal of a call's arguments; ``error`` names the library's status."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error  # "invalid" or "double_free"


@dataclass
class ModelSeq:
    table: list[int]
    tokens: int
    priority: int
    namespace: int
    cached_tokens: int
    pin: bool = False
    kind: str | None = None  # the content kind of its chain: "tokens", "key", "bytes"; None: none
    last: int | None = None  # the name of its last full block (None: the root)
    partial: list[int] = field(default_factory=list)  # token ids of its partial last block
    key_len: int = 0  # keyed by engine keys: their length


@dataclass
class KVModel:
    num_blocks: int
    block_tokens: int
    free: deque[int] = field(init=False)
    refs: list[int] = field(init=False)
    priority: list[int] = field(init=False)
    prefix_of: list[int | None] = field(init=False)  # the registered prefix of each block
    registry: dict[int, int] = field(default_factory=dict)  # prefix -> block
    lru: list[OrderedDict[int, None]] = field(init=False)
    seqs: dict[int, ModelSeq] = field(default_factory=dict)
    interned: dict[tuple, int] = field(default_factory=dict)
    event_capacity: int = 0
    max_key_bytes: int = 0
    events: deque[tuple] = field(default_factory=deque)
    dropped: int = 0
    loose: list[int] = field(init=False)  # references the engine holds, per block
    engine_keys: dict[int, bytes] = field(default_factory=dict)  # name -> an engine key's bytes
    name_namespace: dict[int, int] = field(default_factory=dict)
    decoded: set[int] = field(default_factory=set)  # names of blocks decoding filled
    hit_tokens: int = 0
    query_tokens: int = 0
    evictions: int = 0
    cow_copies: int = 0
    forks: int = 0
    readmit_hit_tokens: int = 0
    readmit_query_tokens: int = 0

    def __post_init__(self) -> None:
        self.free = deque(range(self.num_blocks))
        self.refs = [0] * self.num_blocks
        self.priority = [0] * self.num_blocks
        self.prefix_of = [None] * self.num_blocks
        self.lru = [OrderedDict() for _ in range(PRIORITIES)]
        self.loose = [0] * self.num_blocks

    # -- prefixes ---------------------------------------------------------------------------

    def name(self, parent: int | None, content: tuple, namespace: int) -> int:
        """The exact name of a block: an engine key's is its namespace and bytes, any other's
        its content chained on its parent's name and the namespace."""
        if content[0] == "bytes":
            name = self.interned.setdefault(("bytes", namespace, content[1]), len(self.interned))
            self.engine_keys[name] = content[1]
        else:
            name = self.interned.setdefault((parent, content, namespace), len(self.interned))
        self.name_namespace[name] = namespace
        return name

    def namespace_of(self, name: int) -> int:
        """The namespace a name was made in."""
        return self.name_namespace[name]

    def prefixes(self, contents: list, namespace: int) -> list[int]:
        """The exact name of each given block's prefix."""
        names, parent = [], None
        for content in contents:
            parent = self.name(parent, content, namespace)
            names.append(parent)
        return names

    def contents(self, block_keys=None, tokens=None, keys=None) -> list:
        if keys is not None and len(keys):
            return [("bytes", bytes(k)) for k in keys]
        if block_keys is not None and len(block_keys):
            return [("key", int(k)) for k in block_keys]
        if tokens is not None:
            bt = self.block_tokens
            return [("tokens", tuple(int(t) for t in tokens[i * bt:(i + 1) * bt]))
                    for i in range(len(tokens) // bt)]
        return []

    # -- blocks -----------------------------------------------------------------------------

    def cached_count(self) -> int:
        return sum(len(lru) for lru in self.lru)

    def _ref(self, block: int, priority: int) -> None:
        if self.refs[block] == 0:  # cached
            del self.lru[self.priority[block]][block]
        self.refs[block] += 1
        self.priority[block] = max(self.priority[block], priority)

    def evict(self, count: int, announce: bool = True) -> int:
        done = 0
        for lru in self.lru:
            while lru and done < count:
                block = next(iter(lru))
                del lru[block]
                if announce:
                    self._event("removed", block, self.prefix_of[block])
                del self.registry[self.prefix_of[block]]
                self.prefix_of[block] = None
                self.free.append(block)
                done += 1
        self.evictions += done
        return done

    # -- events -----------------------------------------------------------------------------

    def _event(self, *event) -> None:
        if not self.event_capacity:
            return
        if len(self.events) == self.event_capacity:
            self.dropped += 1
        else:
            self.events.append(event)

    def take_events(self, capacity: int) -> tuple[list[tuple], int]:
        taken = [self.events.popleft() for _ in range(min(capacity, len(self.events)))]
        dropped, self.dropped = self.dropped, 0
        return taken, dropped

    def _register(self, block: int, name: int, parent: int | None, first_token: int) -> int:
        """Registers block under name unless name is registered; the block registered now."""
        holder = self.registry.get(name)
        if holder is not None:
            return holder
        self.registry[name] = block
        self.prefix_of[block] = name
        self._event("stored", block, name, parent, first_token)
        return block

    def _take(self, count: int, priority: int) -> list[int]:
        if count > len(self.free):
            self.evict(count - len(self.free))
        taken = [self.free.popleft() for _ in range(count)]
        for block in taken:
            self.refs[block] = 1
            self.priority[block] = priority
        return taken

    def _release(self, table: list[int]) -> None:
        for block in reversed(table):
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            if self.prefix_of[block] is not None:
                self.lru[self.priority[block]][block] = None
            else:
                self.free.appendleft(block)

    def _hits(self, names: list[int]) -> list[int]:
        hits = []
        for name in names:
            block = self.registry.get(name)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- the calls --------------------------------------------------------------------------

    def allocate(self, handle: int, num_tokens: int, contents: list, namespace: int,
                 priority: int, again: bool = False) -> ModelSeq:
        bt = self.block_tokens
        blocks = -(-num_tokens // bt)
        names = self.prefixes(contents, namespace)
        hits = self._hits(names)
        cached_hits = sum(1 for b in hits if self.refs[b] == 0)
        need = blocks - len(hits)
        if blocks > self.num_blocks or need > len(self.free) + self.cached_count() - cached_hits:
            raise NoRoom
        for block in hits:
            self._ref(block, priority)
        table = hits + self._take(need, priority)
        for i in range(len(hits), len(names)):
            self._register(table[i], names[i], names[i - 1] if i else None, i * bt)
        seq = ModelSeq(table, num_tokens, priority, namespace, len(hits) * bt)
        self.seqs[handle] = seq
        self.query_tokens += num_tokens
        self.hit_tokens += len(hits) * bt
        if again:
            self.readmit_query_tokens += num_tokens
            self.readmit_hit_tokens += len(hits) * bt
        return seq

    def admit_check(self, num_tokens: int, kind: str | None, items: list, priority: int,
                    key_len: int = 0) -> None:
        """kva_kv_seq_admit's checks beyond the handle: Refused("invalid") when it refuses."""
        self.content_check(kind, key_len)
        full = num_tokens // self.block_tokens
        if priority >= PRIORITIES or priority < 0:
            raise Refused("invalid")
        if kind == "tokens" and len(items) > num_tokens:
            raise Refused("invalid")
        if kind in ("key", "bytes") and len(items) > full:
            raise Refused("invalid")

    def content_check(self, kind: str | None, key_len: int) -> None:
        if kind == "bytes" and not 1 <= key_len <= self.max_key_bytes:
            raise Refused("invalid")

    def block_contents(self, kind: str | None, items: list) -> list:
        """The contents of the blocks items name."""
        if kind == "tokens":
            return self.contents(tokens=items)
        if kind == "key":
            return self.contents(block_keys=items)
        if kind == "bytes":
            return self.contents(keys=items)
        return []

    def admit(self, handle: int, num_tokens: int, kind: str | None, items: list, namespace: int,
              priority: int, key_len: int = 0, again: bool = False) -> ModelSeq:
        """kva_kv_seq_admit: allocate, and a request given all of its content keeps its chain."""
        self.admit_check(num_tokens, kind, items, priority, key_len)
        seq = self.allocate(handle, num_tokens, self.block_contents(kind, items), namespace,
                            priority, again)
        full = num_tokens // self.block_tokens
        if kind is not None and len(items) == (num_tokens if kind == "tokens" else full):
            seq.kind = kind
            seq.key_len = key_len
            names = self.prefixes(self.block_contents(kind, items), namespace)
            seq.last = names[-1] if names else None
            if kind == "tokens":
                seq.partial = [int(t) for t in items[full * self.block_tokens:]]
        return seq

    def extend_check(self, handle: int, num_tokens: int, kind: str | None, items: list,
                     key_len: int = 0) -> None:
        """kva_kv_seq_extend's checks: Refused when it refuses (a freed handle included)."""
        self.content_check(kind, key_len)
        seq = self.seqs.get(handle)
        if seq is None or seq.pin:
            raise Refused("invalid")
        if seq.tokens + num_tokens > 0xFFFFFFFF:
            raise Refused("invalid")
        if seq.kind is None or kind is None or not items:
            return
        if kind != seq.kind or (kind == "bytes" and key_len != seq.key_len):
            raise Refused("invalid")
        bt = self.block_tokens
        want = num_tokens if kind == "tokens" else (seq.tokens + num_tokens) // bt - seq.tokens // bt
        if len(items) != want:
            raise Refused("invalid")

    def extend(self, handle: int, num_tokens: int, kind: str | None = None,
               items: list | None = None, key_len: int = 0) -> tuple[int, int, int] | None:
        """kva_kv_seq_extend: append, then the commit of the blocks it filled."""
        items = items or []
        self.extend_check(handle, num_tokens, kind, items, key_len)
        seq = self.seqs[handle]
        old = seq.tokens
        copy = self.append(handle, num_tokens)
        if seq.kind is None:
            return copy
        bt = self.block_tokens
        first, end = old // bt, (old + num_tokens) // bt
        if kind is None or not items:
            if (num_tokens != 0) if seq.kind == "tokens" else end != first:
                seq.kind = None
            return copy
        if seq.kind == "tokens":
            pending = seq.partial + [int(t) for t in items]
            contents = []
            while len(pending) >= bt:
                contents.append(("tokens", tuple(pending[:bt])))
                pending = pending[bt:]
            seq.partial = pending
        else:
            contents = self.block_contents(seq.kind, items)
        for offset, content in enumerate(contents):
            i = first + offset
            name = self.name(seq.last, content, seq.namespace)
            self._register(seq.table[i], name, seq.last if i else None, i * bt)
            self.decoded.add(name)
            seq.last = name
        return copy

    # -- the block calls --------------------------------------------------------------------

    def _ids_check(self, ids: list[int]) -> None:
        if any(not 0 <= b < self.num_blocks for b in ids):
            raise Refused("invalid")

    def block_take(self, count: int, priority: int = 0) -> list[int]:
        if not 0 <= priority < PRIORITIES:
            raise Refused("invalid")
        if count > len(self.free) + self.cached_count():
            raise NoRoom
        taken = self._take(count, priority)
        for block in taken:
            self.loose[block] = 1
        return taken

    def block_unref(self, ids: list[int]) -> None:
        self._ids_check(ids)
        loose = list(self.loose)
        for block in ids:
            if loose[block] == 0:
                raise Refused("double_free" if self.refs[block] == self.loose[block] else "invalid")
            loose[block] -= 1
        self.loose = loose
        for block in ids:
            self._release([block])

    def block_ref(self, ids: list[int]) -> None:
        self._ids_check(ids)
        if any(self.refs[b] == 0 and self.prefix_of[b] is None for b in ids):
            raise Refused("invalid")  # a free block
        for block in ids:
            self._ref(block, 0)
            self.loose[block] += 1

    def block_commit(self, ids: list[int], keys: list[bytes], key_len: int, namespace: int,
                     parent: bytes | None = None, first_token: int = 0) -> list[int]:
        self.content_check("bytes", key_len)
        self._ids_check(ids)
        if len(set(ids)) != len(ids) or any(
                self.refs[b] == 0 or self.loose[b] != self.refs[b] or self.prefix_of[b] is not None
                for b in ids):
            raise Refused("invalid")
        previous = None if parent is None else self.name(None, ("bytes", parent), namespace)
        registered = []
        for j, (block, key) in enumerate(zip(ids, keys)):
            name = self.name(None, ("bytes", key), namespace)
            registered.append(self._register(block, name, previous,
                                             first_token + j * self.block_tokens))
            previous = name
        return registered

    def _forget(self, block: int) -> None:
        self._event("removed", block, self.prefix_of[block])
        del self.registry[self.prefix_of[block]]
        self.prefix_of[block] = None
        if self.refs[block] == 0:
            del self.lru[self.priority[block]][block]
            self.free.append(block)
        self.evictions += 1

    def evict_blocks(self, ids: list[int]) -> int:
        self._ids_check(ids)
        dropped = 0
        for block in ids:
            if self.prefix_of[block] is not None:
                self._forget(block)
                dropped += 1
        return dropped

    def evict_keys(self, keys: list[bytes], key_len: int, namespace: int) -> int:
        self.content_check("bytes", key_len)
        dropped = 0
        for key in keys:
            block = self.registry.get(self.name(None, ("bytes", key), namespace))
            if block is not None:
                self._forget(block)
                dropped += 1
        return dropped

    def reset_prefix_cache(self) -> None:
        self.evict(self.cached_count(), announce=False)
        for block in list(self.registry.values()):
            self.prefix_of[block] = None
        self.evictions += len(self.registry)
        self.registry.clear()
        self._event("cleared")

    def lookup(self, contents: list, namespace: int) -> list[int]:
        return self._hits(self.prefixes(contents, namespace))

    def pin(self, handle: int, contents: list, namespace: int) -> ModelSeq:
        hits = self._hits(self.prefixes(contents, namespace))
        for block in hits:
            self._ref(block, 0)
        seq = ModelSeq(hits, len(hits) * self.block_tokens, 0, namespace,
                       len(hits) * self.block_tokens, pin=True)
        self.seqs[handle] = seq
        return seq

    def append(self, handle: int, num_tokens: int) -> tuple[int, int, int] | None:
        seq, bt = self.seqs[handle], self.block_tokens
        new_tokens = seq.tokens + num_tokens
        new_len = -(-new_tokens // bt)
        fill = seq.tokens % bt
        cow = bool(num_tokens and fill and self.refs[seq.table[-1]] > 1)
        need = new_len - len(seq.table) + cow
        if need > len(self.free) + self.cached_count():
            raise NoRoom
        if need > len(self.free):
            self.evict(need - len(self.free))
        copy = None
        if cow:
            src = seq.table[-1]
            (dst,) = self._take(1, seq.priority)
            self._release([src])
            seq.table[-1] = dst
            copy = (src, dst, fill)
            self.cow_copies += 1
        seq.table += self._take(new_len - len(seq.table), seq.priority)
        seq.tokens = new_tokens
        return copy

    def fork(self, handle: int, child: int) -> ModelSeq:
        parent = self.seqs[handle]
        for block in parent.table:
            self._ref(block, parent.priority)
        seq = ModelSeq(list(parent.table), parent.tokens, parent.priority, parent.namespace,
                       parent.cached_tokens, kind=parent.kind, last=parent.last,
                       partial=list(parent.partial), key_len=parent.key_len)
        self.seqs[child] = seq
        self.forks += 1
        return seq

    def compact(self) -> list[tuple[int, int]]:
        n = self.num_blocks - len(self.free)
        free = set(self.free)
        holes = [b for b in range(n) if b in free]
        sources = [b for b in range(n, self.num_blocks) if b not in free]
        assert len(holes) == len(sources)
        moves = list(zip(sources, holes))
        where = dict(moves)
        for src, dst in moves:
            self.refs[dst], self.refs[src] = self.refs[src], 0
            self.priority[dst], self.priority[src] = self.priority[src], 0
            self.prefix_of[dst], self.prefix_of[src] = self.prefix_of[src], None
            self.loose[dst], self.loose[src] = self.loose[src], 0
        self.registry = {name: where.get(b, b) for name, b in self.registry.items()}
        self.lru = [OrderedDict((where.get(b, b), None) for b in lru) for lru in self.lru]
        for seq in self.seqs.values():
            seq.table = [where.get(b, b) for b in seq.table]
        self.free = deque(range(n, self.num_blocks))
        return moves

    def free_seq(self, handle: int) -> None:
        self._release(self.seqs.pop(handle).table)

    def stats(self) -> dict[str, int]:
        cached = self.cached_count()
        return {
            "num_blocks": self.num_blocks,
            "free_blocks": len(self.free),
            "cached_blocks": cached,
            "used_blocks": self.num_blocks - len(self.free) - cached,
            "registered_blocks": len(self.registry),
            "sequences": sum(1 for s in self.seqs.values() if not s.pin),
            "pins": sum(1 for s in self.seqs.values() if s.pin),
            "hit_tokens": self.hit_tokens,
            "query_tokens": self.query_tokens,
            "evictions": self.evictions,
            "cow_copies": self.cow_copies,
            "forks": self.forks,
            "pinned_blocks": len({b for s in self.seqs.values() if s.pin for b in s.table}),
            "readmit_hit_tokens": self.readmit_hit_tokens,
            "readmit_query_tokens": self.readmit_query_tokens,
        }

    def namespace_totals(self) -> dict[int, tuple[int, int, int, int]]:
        """Each namespace with anything in the cache: (sequences, pins, blocks, registered
        blocks), blocks being its tables' lengths summed."""
        totals: dict[int, list[int]] = {}
        for seq in self.seqs.values():
            row = totals.setdefault(seq.namespace, [0, 0, 0, 0])
            row[1 if seq.pin else 0] += 1
            row[2] += len(seq.table)
        for name in self.registry:
            totals.setdefault(self.namespace_of(name), [0, 0, 0, 0])[3] += 1
        return {ns: (row[0], row[1], row[2], row[3]) for ns, row in totals.items()}


NAMESPACE_SLOTS = 32


def check_namespaces(rows, totals: dict[int, tuple[int, int, int, int]], where: str = "") -> None:
    """rows: KVCache.namespaces() (or a snapshot's kv_namespaces); totals: the model's
    namespace_totals(). Each tracked row is its namespace's figures; the pooled row (namespace
    None) sums the namespaces without a row, and is listed only when they hold anything."""
    tracked = {row.namespace: (row.sequences, row.pins, row.blocks, row.registered_blocks)
               for row in rows if row.namespace is not None}
    assert len(tracked) == len([row for row in rows if row.namespace is not None]), where
    assert len(tracked) <= NAMESPACE_SLOTS, where
    for ns, figures in tracked.items():
        assert figures == totals.get(ns), (where, ns, figures, totals.get(ns))
    rest = [sum(figures[i] for ns, figures in totals.items() if ns not in tracked)
            for i in range(4)]
    other = [row for row in rows if row.namespace is None]
    if any(rest):
        assert len(other) == 1 and (other[0].sequences, other[0].pins, other[0].blocks,
                                    other[0].registered_blocks) == tuple(rest), (where, other, rest)
        assert rows[-1].namespace is None, where
    else:
        assert not other, (where, other)


class EventNames:
    """Checks the library's event records against the model's events. A library key (token ids
    or u64 keys chained in C, 128 bits) cannot be computed here: the first record that shows a
    model name fixes its bytes, and every later record must keep that correspondence both ways
    (one name, one key). An engine key's bytes are checked exactly."""

    def __init__(self, model: KVModel) -> None:
        self.model = model
        self.by_name: dict[int, tuple[int, bytes]] = {}
        self.by_key: dict[tuple[int, bytes], int] = {}

    def _same(self, name: int, namespace: int, key: bytes, library: bool, where: str) -> None:
        engine = self.model.engine_keys.get(name)
        if engine is not None:
            assert not library and key == engine, f"{where}: engine key {key!r} != {engine!r}"
            return
        assert library, f"{where}: a chained name under an engine key"
        seen = self.by_name.setdefault(name, (namespace, key))
        assert seen == (namespace, key), f"{where}: name {name} was {seen}, now {(namespace, key)}"
        owner = self.by_key.setdefault((namespace, key), name)
        assert owner == name, f"{where}: key {key.hex()} names {owner} and {name}"

    def check(self, records, expected: list[tuple]) -> None:
        """records: take_event_records' array; expected: the model's events, as many."""
        assert len(records) == len(expected), (len(records), len(expected), expected[:5])
        for i, (record, event) in enumerate(zip(records, expected)):
            where = f"event {i} {event}"
            kind = {"stored": 1, "removed": 2, "cleared": 3}[event[0]]
            assert int(record["kind"]) == kind, where
            if event[0] == "cleared":
                assert int(record["block"]) == 0xFFFFFFFF, where
                continue
            block, name = event[1], event[2]
            assert int(record["block"]) == block, where
            namespace = self.model.namespace_of(name)
            assert int(record["namespace_id"]) == namespace, where
            key = bytes(record["key"][:int(record["key_len"])])
            self._same(name, namespace, key, bool(record["library_key"]), where)
            if event[0] == "stored":
                parent, first_token = event[3], event[4]
                assert int(record["first_token"]) == first_token, where
                assert int(record["num_tokens"]) == self.model.block_tokens, where
                if parent is None:
                    assert int(record["parent_len"]) == 0, where
                else:
                    raw = bytes(record["parent"][:int(record["parent_len"])])
                    self._same(parent, namespace, raw, bool(record["library_key"]), where)


STAT_NAMES = ("num_blocks", "free_blocks", "used_blocks", "cached_blocks", "registered_blocks",
              "sequences", "pins", "hit_tokens", "query_tokens", "evictions", "cow_copies", "forks",
              "pinned_blocks", "readmit_hit_tokens", "readmit_query_tokens")


class SideBySide:
    """A cache and the model driven with the same calls: the checks every random stream makes
    after its operations, and a count of what it did."""

    def __init__(self, cache, model: KVModel) -> None:
        self.cache = cache
        self.model = model
        self.names = EventNames(model)
        self.counts: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def same_state(self, where: str) -> None:
        """Every statistic the model keeps, and the cache's own invariants."""
        stats = self.cache.stats()
        assert {name: getattr(stats, name) for name in STAT_NAMES} == self.model.stats(), where
        check_namespaces(self.cache.namespaces(), self.model.namespace_totals(), where)
        self.cache.check()

    def drain(self, max_events: int | None = None) -> None:
        """Takes the oldest events (all by default) from both and compares them."""
        records, dropped = self.cache.take_event_records(max_events)
        expected, model_dropped = self.model.take_events(
            len(self.model.events) if max_events is None else max_events)
        assert dropped == model_dropped
        self.names.check(records, expected)
        self.count("events")
