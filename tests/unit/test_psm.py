"""PSM queue: DFS grouping of shared prefixes, the waiting bound, k-LPM, peeking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream_scheduler.psm import (
    DuplicateRequestError,
    EmptyQueueError,
    PsmParams,
    PsmPick,
    PsmQueue,
    UnknownRequestError,
)

pytestmark = pytest.mark.unit

BS = 4


def prompt(*groups: int, tail: int = 0) -> list[int]:
    """A prompt made of whole blocks, one per group id, plus a partial tail."""
    out: list[int] = []
    for g in groups:
        out += [g] * BS
    return out + [999] * tail


def q(**kw: object) -> PsmQueue:
    return PsmQueue(PsmParams(block_size=BS, **kw))  # type: ignore[arg-type]


def test_dfs_groups_shared_prefixes() -> None:
    # HyGen's example: (What is ML, How to code, What is AI, How to debug)
    queue = q(fairness="none")
    queue.push("what-ml", prompt(1, 2, 3), 0.0)
    queue.push("how-code", prompt(5, 6), 1.0)
    queue.push("what-ai", prompt(1, 2, 4), 2.0)
    queue.push("how-debug", prompt(5, 7), 3.0)
    assert [queue.pop(10.0) for _ in range(4)] == ["what-ml", "what-ai", "how-code", "how-debug"]
    with pytest.raises(EmptyQueueError):
        queue.pop(10.0)


def test_partial_blocks_are_not_shared() -> None:
    queue = q(fairness="none")
    queue.push("a", prompt(1, tail=3), 0.0)
    queue.push("b", [1] * BS + [2, 2, 2], 0.0)  # differs only inside the partial block
    queue.push("c", prompt(9), 0.0)
    assert queue.pop(0.0) == "a"
    assert queue.cached_tokens("b") == BS  # one whole block
    assert queue.cached_tokens("c") == 0
    assert queue.pop_pick(0.0).cached_tokens == BS


def test_insert_into_the_group_being_drained_joins_it() -> None:
    queue = q(fairness="none")
    queue.push("a1", prompt(1, 2), 0.0)
    queue.push("b1", prompt(3, 4), 1.0)
    queue.push("a2", prompt(1, 5), 2.0)
    assert queue.pop(0.0) == "a1"
    queue.push("a3", prompt(1, 2, 6), 3.0)  # longest match with the cursor
    assert [queue.pop(0.0) for _ in range(3)] == ["a3", "a2", "b1"]


def test_remove_and_errors() -> None:
    queue = q()
    queue.push("a", prompt(1), 0.0)
    with pytest.raises(DuplicateRequestError):
        queue.push("a", prompt(1), 0.0)
    queue.remove("a")
    assert len(queue) == 0 and "a" not in queue
    with pytest.raises(UnknownRequestError):
        queue.remove("a")
    with pytest.raises(UnknownRequestError):
        queue.cached_tokens("a")


def test_overdue_oldest_wins_over_prefix_reuse() -> None:
    queue = q(max_wait_s=10.0)
    queue.push("g1", prompt(1, 2), 0.0)
    queue.push("g2", prompt(1, 2), 5.0)
    queue.push("g3", prompt(1, 2), 5.0)
    queue.push("x", prompt(9), 2.0)
    assert queue.pop(3.0) == "g1"
    # inside the group the reuse (gain 1) outweighs x's age 2/10
    assert queue.pop_pick(4.0) == PsmPick("g2", 2 * BS, "dfs")
    # once x is overdue it beats the rest of the group
    assert queue.pop_pick(12.5) == PsmPick("x", 0, "overdue")
    assert queue.pop(12.5) == "g3"


def test_branch_point_starts_with_the_oldest_group() -> None:
    queue = q(max_wait_s=100.0)
    queue.push("young", prompt(1, 2), 5.0)
    queue.push("old", prompt(3, 4), 1.0)
    queue.push("old-sibling", prompt(3, 4), 6.0)
    # nothing cached yet (gain 0): the oldest starts, and its group follows
    assert queue.pop_pick(6.0) == PsmPick("old", 0, "oldest")
    assert queue.pop(6.0) == "old-sibling"
    assert queue.pop(6.0) == "young"


def test_klpm_takes_oldest_then_prefix_matches() -> None:
    queue = q(fairness="klpm", klpm_k=2, max_wait_s=1e9)
    queue.push("a1", prompt(1, 2), 0.0)
    queue.push("b1", prompt(3), 1.0)
    queue.push("a2", prompt(1, 2), 2.0)
    queue.push("b2", prompt(3), 3.0)
    queue.push("a3", prompt(1, 2), 4.0)
    # oldest (a1), LPM (a2), oldest (b1), LPM (b2), oldest (a3)
    assert [queue.pop(5.0) for _ in range(5)] == ["a1", "a2", "b1", "b2", "a3"]


def test_klpm_k1_is_fcfs() -> None:
    queue = q(fairness="klpm", klpm_k=1)
    for i, g in enumerate([1, 2, 1, 2, 3, 1]):
        queue.push(f"r{i}", prompt(g, i + 10), float(i))
    assert [queue.pop(100.0) for _ in range(6)] == [f"r{i}" for i in range(6)]


def test_peek_matches_pops_and_does_not_mutate() -> None:
    queue = q(max_wait_s=5.0)
    for i, g in enumerate([1, 2, 1, 3, 2, 1, 4]):
        queue.push(f"r{i}", prompt(g, 20 + i % 2), float(i))
    before = queue.peek_window(7, 9.0)
    assert queue.peek_window(7, 9.0) == before  # peeking twice changes nothing
    assert len(queue) == 7
    popped = [queue.pop_pick(9.0) for _ in range(7)]
    assert tuple(popped) == before
    assert queue.peek_order(3, 9.0) == ()


def test_version_moves_with_every_change_that_can_change_the_order() -> None:
    queue = q()
    v0 = queue.version
    queue.push("a", prompt(1, 2), 0.0)
    queue.push("b", prompt(1, 3), 1.0)
    v1 = queue.version
    assert v1 > v0
    queue.peek_window(2, 5.0)
    queue.cached_tokens("a")
    assert queue.version == v1  # reading changes nothing
    queue.take("a")  # moves the cursor too
    v2 = queue.version
    assert v2 > v1
    queue.pop(6.0)
    assert queue.version > v2
    queue.push("c", prompt(2), 7.0)
    v3 = queue.version
    queue.remove("c")
    assert queue.version > v3


prompts_st = st.lists(
    st.tuples(
        st.lists(st.integers(0, 2), min_size=0, max_size=3),  # block ids
        st.floats(min_value=0.0, max_value=100.0),  # arrival
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(prompts_st)
def test_shared_prefix_groups_come_out_consecutively(reqs: list[tuple[list[int], float]]) -> None:
    # Absent starvation (huge bound, no age): every subtree's requests are
    # popped as one contiguous run.
    queue = q(fairness="utility", max_wait_s=1e12)
    paths = {}
    for i, (blocks, arrival) in enumerate(reqs):
        queue.push(f"r{i}", prompt(*blocks), arrival)
        paths[f"r{i}"] = tuple(blocks)
    order = [paths[queue.pop(100.0)] for _ in range(len(reqs))]
    prefixes = {p[:k] for p in order for k in range(1, len(p) + 1)}
    for pre in prefixes:
        idx = [i for i, p in enumerate(order) if p[: len(pre)] == pre]
        assert idx == list(range(idx[0], idx[-1] + 1)), (pre, order)


ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.lists(st.integers(0, 3), max_size=3)),
        st.tuples(st.just("pop"), st.just([])),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops_st, st.sampled_from(["utility", "klpm"]), st.floats(0.5, 20.0))
def test_no_request_is_overtaken_once_it_waited_past_the_bound(
    ops: list[tuple[str, list[int]]], mode: str, bound: float
) -> None:
    # Virtual time advances by 1 s per operation. Once a request has waited
    # more than the bound, no younger request leaves before it; hence its wait
    # is at most the bound plus one pop per older queued request.
    queue = q(fairness=mode, max_wait_s=bound, klpm_k=3)
    arrival: dict[str, float] = {}
    now = 0.0
    for n, (op, blocks) in enumerate(ops):
        now += 1.0
        if op == "push":
            rid = f"r{n}"
            queue.push(rid, prompt(*blocks), now)
            arrival[rid] = now
        elif len(queue):
            rid = queue.pop(now)
            overdue = [r for r in arrival if r != rid and now - arrival[r] > bound]
            assert all(arrival[r] >= arrival[rid] for r in overdue), (rid, overdue)
            del arrival[rid]


def test_large_flat_queue_pops_in_linear_time() -> None:
    # 20k distinct one-block prompts under the root: each pop takes the first
    # child, O(1) with OrderedDict even after thousands of deletions.
    queue = q(fairness="none")
    for i in range(20_000):
        queue.push(f"r{i}", [i] * BS, 0.0)
    assert [queue.pop(0.0) for _ in range(20_000)][:3] == ["r0", "r1", "r2"]


@pytest.mark.parametrize("fairness", ["utility", "klpm"])
def test_a_request_pushed_again_keeps_its_place_among_equal_arrivals(fairness: str) -> None:
    # A backlog queued at one instant, distinct prompts: the oldest-first rules
    # serve it in push order. A popped request that comes back (preempted,
    # resumed as a continuation) must not fall behind the ones pushed after it.
    queue = q(fairness=fairness, klpm_k=1)
    for i in range(5):
        queue.push(f"r{i}", prompt(10 + i, 20 + i), 0.0)
    assert queue.pop(1.0) == "r0"
    assert queue.pop(1.0) == "r1"
    queue.push("r0", prompt(10, 20), 0.0)
    assert queue.peek_order(4, 2.0) == ("r0", "r2", "r3", "r4")
    queue.remove("r3")  # admitted by other means, then back
    queue.push("r3", prompt(13, 23), 0.0)
    assert [queue.pop(2.0) for _ in range(4)] == ["r0", "r2", "r3", "r4"]


def test_reentry_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import slipstream_scheduler.psm as psm

    monkeypatch.setattr(psm, "SEQ_MEMORY", 3)
    queue = q()
    for i in range(6):
        queue.push(f"r{i}", prompt(10 + i), 0.0)
    for _ in range(6):
        queue.pop(1.0)
    assert list(queue._left) == ["r3", "r4", "r5"]
