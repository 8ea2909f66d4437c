"""vLLM's KV block pool with automatic prefix caching, counted rather than stored.

No token or tensor is kept: a block is a key. A *cached* block's key is its
content hash (the caller's chained prefix-block hash for prompt blocks; the
engine's ``(request_id, index)`` for blocks past them, which only that request
can hit again, after a preemption). A *plain* block has a fresh unique key.

Semantics follow vLLM v1's ``BlockPool``:

* ``ref`` maps every cached key to its reference count; a count of 0 means the
  block is free but still holds its hash (a cache hit can revive it).
* Free blocks form one queue: blocks without a hash first (never used, or a
  request's partly filled last block: vLLM 0.32 puts a freed block without a
  hash at the front of its free queue; such blocks are alike, so they are one
  counter), then freed full blocks in the order they were freed (LRU; vLLM
  hashes every full block). Allocation takes from the front and evicts the
  hash of a cached block it takes.
* A request frees its blocks tail first, so its prefix is evicted last.

Deliberately left out: block ids and tables (nothing reads them), hybrid or
sliding-window KV groups, KV offloading, and swap-based preemption.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class KvBlockPool:
    """Free-block accounting and the prefix-cache hash table. Mutable, not thread-safe.

    The free queue holds one entry per cached free block (value 1) and one entry
    per *run* of full blocks without a cache key freed together (value = run
    length); unhashed blocks are the ``_fresh`` count in front of it.
    """

    __slots__ = ("_free_q", "_fresh", "_nfree", "num_blocks", "ref")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._fresh = num_blocks  # never-used blocks: the front of the free queue
        self._free_q: OrderedDict[Hashable, int] = OrderedDict()
        self._nfree = 0  # blocks in _free_q
        self.ref: dict[Hashable, int] = {}

    @property
    def free(self) -> int:
        """Blocks that can be allocated now (including free blocks that keep a hash)."""
        return self._fresh + self._nfree

    def take(self, n: int) -> None:
        """Allocate ``n`` plain blocks (caller checked ``n <= free``); evicts LRU hashes."""
        fresh = self._fresh
        if n <= fresh:
            self._fresh = fresh - n
            return
        self._fresh = 0
        n -= fresh
        self._nfree -= n
        free_q, ref = self._free_q, self.ref
        while n > 0:
            key, count = free_q.popitem(last=False)
            if count > n:  # part of a plain run: the rest stays at the front
                free_q[key] = count - n
                free_q.move_to_end(key, last=False)
                return
            n -= count
            if count == 1:
                ref.pop(key, None)

    def longest_hit(self, keys: Sequence[Hashable]) -> tuple[int, int]:
        """(blocks of ``keys`` cached as a prefix, how many of them are free)."""
        ref = self.ref
        hits = evictable = 0
        for key in keys:
            count = ref.get(key)
            if count is None:
                break
            hits += 1
            if count == 0:
                evictable += 1
        return hits, evictable

    def touch(self, keys: Sequence[Hashable]) -> None:
        """Take a reference on cached blocks (a prefix hit); revives free ones."""
        ref, free_q = self.ref, self._free_q
        for key in keys:
            count = ref[key]
            if count == 0:
                del free_q[key]
                self._nfree -= 1
            ref[key] = count + 1

    def register(self, key: Hashable) -> bool:
        """Mark a just-filled block as cached under ``key``; False if the key is taken."""
        if key in self.ref:
            return False
        self.ref[key] = 1
        return True

    def release(self, blocks: Sequence[Hashable | None], full: int | None = None) -> None:
        """Free one request's blocks (``None`` = plain block), tail first.

        As vLLM's ``BlockPool.free_blocks``: a block with a hash joins the back of the free
        queue (LRU eviction), one without its front (reused first). vLLM hashes every
        *full* block, so the first ``full`` blocks (default: all) go to the back even when
        only their own request could hit them; the ones after them (a partly filled last
        block) are alike, so they join the never-used count at the front.
        """
        ref, free_q = self.ref, self._free_q
        n_full = len(blocks) if full is None else min(full, len(blocks))
        run = 0
        for j in range(len(blocks) - 1, -1, -1):
            key = blocks[j]
            if key is None:
                if j >= n_full:
                    self._fresh += 1
                else:
                    run += 1
                continue
            count = ref[key] - 1
            ref[key] = count
            if count == 0:
                if run:
                    free_q[object()] = run
                    self._nfree += run
                    run = 0
                free_q[key] = 1
                self._nfree += 1
        if run:
            free_q[object()] = run
            self._nfree += run

    def cached_free(self) -> int:
        """Free blocks that still hold a hash (for tests and stats)."""
        return sum(1 for key in self._free_q if key in self.ref)
