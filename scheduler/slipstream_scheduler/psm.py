"""PSM: prefix-sharing-maximising order for the offline queue (HyGen), with anti-starvation.

Queued requests live in a trie over their prompt's token ids, cut into blocks
of ``block_size`` tokens (default 16, vLLM's KV block): only whole blocks are
shared, as in vLLM's prefix cache, and a trailing partial block is ignored.
A request sits on the node of its last whole block.

Order: DFS, continued from the last popped request (the *cursor*). The next
request is found by climbing from the cursor to the deepest node that still
has queued requests below it, then descending: a node's own requests first
(in arrival order), then its children (in insertion order). Requests that share
a prefix therefore come out back to back, and a request inserted into the
subtree being drained joins it at once (longest-prefix-match continuation).
Push, pop and remove cost O(prompt length / block size); children are kept in
``OrderedDict`` so taking the first is O(1) even after many deletions.

Anti-starvation (HyGen's "utility ratio" formula is unpublished; our rule,
adapted from ``research/algorithms.md`` §1.5). Let ``d`` be the DFS-next
request, ``o`` the oldest (the minimum of a ``SortedList`` keyed by arrival),
``s(x)`` the whole blocks ``x`` shares with the cursor and
``gain = (s(d) − s(o)) / blocks(d)`` the fraction of ``d``'s prompt whose
prefill DFS saves beyond what ``o`` would save (``d`` has the longest match,
so ``0 <= gain <= 1``). With ``A = max_wait_s``:

* hard bound (all fairness modes except ``none``): if ``now − arrival(o) > A``
  pick ``o``. Overdue requests thus leave strictly oldest first, and no
  request is overtaken by a younger one once it has waited ``A``;
* ``fairness="utility"`` (default): else pick ``o`` if ``age(o) / A >= gain``:
  the oldest wins as soon as its age makes up for the reuse DFS would gain.
  When the drained group leaves DFS at a branch point (``gain = 0``) this
  starts the next group at its oldest request; a started group is left early
  only for a request old enough to outweigh the reuse. (The digest's form
  ``U(x) = s(x)/blocks(x)`` can rank a short old prompt above ``d`` with no
  age at all and split a prefix group, so we normalise both by ``d``.)
* ``fairness="klpm"`` (k-LPM, Dexter et al. 2025): else every ``k``-th pop
  takes the oldest and the ``k − 1`` pops after it take the DFS-next (= the
  longest prefix match with the cursor); ``k = 1`` is FCFS;
* ``fairness="none"``: pure DFS.

Errors::

    PsmError
     ├── DuplicateRequestError(request_id)
     ├── UnknownRequestError(request_id)
     └── EmptyQueueError

Re-entry. A request pushed again after it was popped or removed (an offline
request preempted and resumed as a continuation) keeps the age key it had,
``(arrival, seq)``: with a fresh ``seq`` it fell behind every request of equal
arrival (a backlog queued at one instant), so the oldest-first rules served it
last, its KV was evicted meanwhile, and it paid its whole prefill again
(measured: budget-psm resumed continuations waited a median 92 s against 3.5 s
under FCFS, prefix hit rate 0.6 % against 68 %, half of budget's offline
throughput; ``docs/benchmarks/colocation.md``). The last
:data:`SEQ_MEMORY` ids that left the queue are remembered for this.

Deliberately left out: the KV cache itself (``cached_tokens`` is an estimate:
whole blocks shared with the last popped prompt), token counting, clocks (the
caller passes ``now_s``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from sortedcontainers import SortedList

__all__ = [
    "SEQ_MEMORY",
    "DuplicateRequestError",
    "EmptyQueueError",
    "PsmError",
    "PsmParams",
    "PsmPick",
    "PsmQueue",
    "UnknownRequestError",
]

Block = tuple[int, ...]
SEQ_MEMORY = 65536
"""Ids that left the queue whose age key is kept for a re-entry, at most (oldest forgotten)."""
PickReason = Literal["dfs", "oldest", "overdue"]


class PsmError(Exception):
    """Base of this module's errors."""


class DuplicateRequestError(PsmError):
    def __init__(self, request_id: str) -> None:
        super().__init__(f"request already queued: {request_id}")
        self.request_id = request_id


class UnknownRequestError(PsmError, KeyError):
    def __init__(self, request_id: str) -> None:
        super().__init__(f"request not queued: {request_id}")
        self.request_id = request_id


class EmptyQueueError(PsmError, IndexError):
    def __init__(self) -> None:
        super().__init__("pop from an empty PSM queue")


class PsmParams(BaseModel):
    """Knobs of the PSM queue."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int = Field(
        default=16,
        ge=1,
        description="Tokens per trie edge; only whole blocks are shared. Default 16.",
    )
    fairness: Literal["utility", "klpm", "none"] = Field(
        default="utility",
        description="Anti-starvation rule (see module docstring). Default 'utility'.",
    )
    max_wait_s: float = Field(
        default=300.0,
        gt=0.0,
        description="A: hard waiting bound, and the age scale of the utility rule, seconds. "
        "Default 300.",
    )
    klpm_k: int = Field(
        default=8,
        ge=1,
        description="k of k-LPM: one oldest pick, then k−1 prefix-match picks. Default 8.",
    )


@dataclass(frozen=True, slots=True)
class PsmPick:
    """A chosen request, its estimated prefix-cache hit, and why it was chosen."""

    request_id: str
    cached_tokens: int
    reason: PickReason


@dataclass(eq=False, slots=True)
class _Node:
    parent: _Node | None
    key: Block | None
    depth: int
    children: OrderedDict[Block, _Node] = field(default_factory=OrderedDict)
    requests: OrderedDict[str, None] = field(default_factory=OrderedDict)
    count: int = 0  # queued requests in this subtree (self included)


@dataclass(frozen=True, slots=True)
class _Entry:
    request_id: str
    node: _Node
    arrival_s: float
    seq: int
    blocks: int  # whole blocks of the prompt (the node's depth)
    path: tuple[Block, ...]  # the block keys from the root to ``node``


class _Overlay:
    """Virtual removals, so ``peek`` can run the pop rule without touching the trie."""

    __slots__ = ("dec", "removed")

    def __init__(self) -> None:
        self.dec: dict[int, int] = {}
        self.removed: set[str] = set()

    def count(self, node: _Node) -> int:
        return node.count - self.dec.get(id(node), 0)

    def take(self, entry: _Entry) -> None:
        self.removed.add(entry.request_id)
        n: _Node | None = entry.node
        while n is not None:
            self.dec[id(n)] = self.dec.get(id(n), 0) + 1
            n = n.parent


class PsmQueue:
    """Offline queue in prefix-trie DFS order with a bounded wait (see module docstring)."""

    def __init__(self, params: PsmParams | None = None) -> None:
        self.params = params if params is not None else PsmParams()
        self._root = _Node(parent=None, key=None, depth=0)
        self._entries: dict[str, _Entry] = {}
        self._by_age: SortedList = SortedList()  # (arrival_s, seq, request_id)
        self._seq = itertools.count()
        self._cursor: list[Block] = []  # block keys of the last popped request
        self._pops = 0
        self._left: OrderedDict[str, int] = OrderedDict()  # id -> seq, for a re-entry
        self._version = 0  # bumped by every change of entries or cursor

    @property
    def version(self) -> int:
        """Changes whenever a request enters or leaves (so the DFS order may change); a
        caller may reuse a ``peek_window`` while it stands, up to the fairness rule's aging."""
        return self._version

    # ------------------------------------------------------------------ queue API

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def push(self, request_id: str, token_ids: Sequence[int], arrival_s: float) -> None:
        """Queue a request; O(len(token_ids))."""
        if request_id in self._entries:
            raise DuplicateRequestError(request_id)
        bs = self.params.block_size
        node = self._root
        path: list[Block] = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            key = tuple(token_ids[start : start + bs])
            path.append(key)
            child = node.children.get(key)
            if child is None:
                child = _Node(parent=node, key=key, depth=node.depth + 1)
                node.children[key] = child
            node = child
        node.requests[request_id] = None
        n: _Node | None = node
        while n is not None:
            n.count += 1
            n = n.parent
        seq = self._left.pop(request_id, None)
        if seq is None:
            seq = next(self._seq)
        self._entries[request_id] = _Entry(
            request_id, node, arrival_s, seq, node.depth, tuple(path)
        )
        self._by_age.add((arrival_s, seq, request_id))
        self._version += 1

    def remove(self, request_id: str) -> None:
        """Drop a queued request (cancelled, or admitted by other means); O(depth)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            raise UnknownRequestError(request_id)
        self._by_age.remove((entry.arrival_s, entry.seq, request_id))
        self._version += 1
        left = self._left
        left[request_id] = entry.seq
        if len(left) > SEQ_MEMORY:
            left.popitem(last=False)
        node = entry.node
        del node.requests[request_id]
        n: _Node | None = node
        while n is not None:
            n.count -= 1
            parent = n.parent
            if n.count == 0 and parent is not None and n.key is not None:
                del parent.children[n.key]
            n = parent

    def take(self, request_id: str) -> None:
        """Drop a request that was admitted from outside ``pop`` (an engine's scheduler walks
        its own queue) and continue the DFS from it, as ``pop`` would; O(depth)."""
        entry = self._entries.get(request_id)
        if entry is None:
            raise UnknownRequestError(request_id)
        self._cursor = list(entry.path)
        self._pops += 1
        self.remove(request_id)

    def pop_pick(self, now_s: float) -> PsmPick:
        """Take the next request (DFS unless the fairness rule picks the oldest)."""
        pick = self._select(now_s, _Overlay(), self._cursor, self._pops)
        entry = self._entries[pick.request_id]
        self._cursor = list(entry.path)
        self._pops += 1
        self.remove(pick.request_id)
        return pick

    def pop(self, now_s: float) -> str:
        return self.pop_pick(now_s).request_id

    def peek_window(self, n: int, now_s: float) -> tuple[PsmPick, ...]:
        """The next ``n`` picks as ``pop_pick`` would make them at ``now_s``, without popping.

        Each pick's ``cached_tokens`` is relative to the pick before it (they
        are expected to run back to back), the first one's to the real cursor.
        """
        overlay = _Overlay()
        cursor = self._cursor
        picks: list[PsmPick] = []
        for i in range(min(n, len(self._entries))):
            pick = self._select(now_s, overlay, cursor, self._pops + i)
            entry = self._entries[pick.request_id]
            overlay.take(entry)
            cursor = list(entry.path)
            picks.append(pick)
        return tuple(picks)

    def peek_order(self, n: int, now_s: float) -> tuple[str, ...]:
        return tuple(p.request_id for p in self.peek_window(n, now_s))

    def cached_tokens(self, request_id: str) -> int:
        """Tokens of the request's prompt shared (whole blocks) with the last popped prompt."""
        entry = self._entries.get(request_id)
        if entry is None:
            raise UnknownRequestError(request_id)
        return self._shared_blocks(entry.path, self._cursor) * self.params.block_size

    def oldest(self) -> str | None:
        return None if not self._by_age else str(self._by_age[0][2])

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _shared_blocks(path: tuple[Block, ...], cursor: list[Block]) -> int:
        """Leading blocks ``path`` shares with ``cursor`` (stops at the first difference)."""
        shared = 0
        for a, b in zip(path, cursor, strict=False):
            if a != b:
                break
            shared += 1
        return shared

    def _dfs_next(self, overlay: _Overlay, cursor: list[Block]) -> _Entry:
        path = [self._root]
        for key in cursor:
            child = path[-1].children.get(key)
            if child is None:
                break
            path.append(child)
        node = next((n for n in reversed(path) if overlay.count(n) > 0), None)
        if node is None:
            raise EmptyQueueError()
        while True:
            for rid in node.requests:
                if rid not in overlay.removed:
                    return self._entries[rid]
            node = next(c for c in node.children.values() if overlay.count(c) > 0)

    def _oldest(self, overlay: _Overlay) -> _Entry:
        for _, _, rid in self._by_age:
            if rid not in overlay.removed:
                return self._entries[rid]
        raise EmptyQueueError()

    def _select(self, now_s: float, overlay: _Overlay, cursor: list[Block], pops: int) -> PsmPick:
        bs = self.params.block_size
        d = self._dfs_next(overlay, cursor)
        mode = self.params.fairness
        chosen, reason = d, "dfs"
        if mode != "none":
            o = self._oldest(overlay)
            age = now_s - o.arrival_s
            if o is d:
                pass
            elif age > self.params.max_wait_s:
                chosen, reason = o, "overdue"
            elif mode == "klpm":
                if pops % self.params.klpm_k == 0:
                    chosen, reason = o, "oldest"
            else:
                shared_d = self._shared_blocks(d.path, cursor)
                gain = (shared_d - self._shared_blocks(o.path, cursor)) / max(d.blocks, 1)
                if age / self.params.max_wait_s >= gain:
                    chosen, reason = o, "oldest"
        cached = self._shared_blocks(chosen.path, cursor) * bs
        return PsmPick(chosen.request_id, cached, reason)  # type: ignore[arg-type]
