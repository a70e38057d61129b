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
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

PRIORITIES = 8


class NoRoom(Exception):
    """The model's out of memory: the request needs more blocks than are free or evictable."""


@dataclass
class ModelSeq:
    table: list[int]
    tokens: int
    priority: int
    namespace: int
    cached_tokens: int
    pin: bool = False


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
    hit_tokens: int = 0
    query_tokens: int = 0
    evictions: int = 0
    cow_copies: int = 0
    forks: int = 0

    def __post_init__(self) -> None:
        self.free = deque(range(self.num_blocks))
        self.refs = [0] * self.num_blocks
        self.priority = [0] * self.num_blocks
        self.prefix_of = [None] * self.num_blocks
        self.lru = [OrderedDict() for _ in range(PRIORITIES)]

    # -- prefixes ---------------------------------------------------------------------------

    def prefixes(self, contents: list, namespace: int) -> list[int]:
        """The exact name of each given block's prefix."""
        names, parent = [], None
        for content in contents:
            parent = self.interned.setdefault((parent, content, namespace), len(self.interned))
            names.append(parent)
        return names

    def contents(self, block_keys=None, tokens=None) -> list:
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

    def evict(self, count: int) -> int:
        done = 0
        for lru in self.lru:
            while lru and done < count:
                block = next(iter(lru))
                del lru[block]
                del self.registry[self.prefix_of[block]]
                self.prefix_of[block] = None
                self.free.append(block)
                done += 1
        self.evictions += done
        return done

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
                 priority: int) -> ModelSeq:
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
            if names[i] not in self.registry:
                self.registry[names[i]] = table[i]
                self.prefix_of[table[i]] = names[i]
        seq = ModelSeq(table, num_tokens, priority, namespace, len(hits) * bt)
        self.seqs[handle] = seq
        self.query_tokens += num_tokens
        self.hit_tokens += len(hits) * bt
        return seq

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
                       parent.cached_tokens)
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
        }
