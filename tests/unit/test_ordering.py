"""Orderings (keys, refresh, preemption rules), the registry, and the keyed queue."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from slipstream_scheduler.gittins import gittins_rank, request_cost
from slipstream_scheduler.ordering import (
    ORDERINGS,
    GittinsOrdering,
    GittinsParams,
    KeyedQueue,
    Ordering,
    RequestView,
    SjfOrdering,
    SjfParams,
    TrailOrdering,
    TrailParams,
    UnknownOrderingError,
    make_ordering,
)

pytestmark = pytest.mark.unit


def view(rid: str, lengths: Sequence[float], arrival: float = 0.0, inp: int = 10) -> RequestView:
    return RequestView.create(rid, arrival, inp, lengths)


def order(o: Ordering, views: list[RequestView]) -> list[str]:
    return [v.request_id for v in sorted(views, key=lambda v: (o.key(v), v.arrival_s))]


def test_registry_names_and_params() -> None:
    assert set(ORDERINGS) == {"fcfs", "sjf", "trail", "gittins"}
    for name in ORDERINGS:
        o = make_ordering(name)
        assert isinstance(o, Ordering) and o.name == name
    g = make_ordering("gittins", {"preempt_margin": 0.2})
    assert isinstance(g, GittinsOrdering) and g.params.preempt_margin == 0.2
    with pytest.raises(ValidationError):
        make_ordering("gittins", {"bogus": 1})
    with pytest.raises(UnknownOrderingError):
        make_ordering("lifo")


def test_fcfs_is_arrival_order() -> None:
    vs = [view("b", [1], 2.0), view("a", [1000], 1.0), view("c", [5], 3.0)]
    assert order(make_ordering("fcfs"), vs) == ["a", "b", "c"]


def test_sjf_mean_cost_vs_cost_of_mean() -> None:
    # same mean length (100), different spread: E[O²] differs
    narrow = view("narrow", [100, 100])
    wide = view("wide", [0, 200])
    mean_cost = SjfOrdering()
    assert mean_cost.key(narrow) == pytest.approx(float(request_cost(10, 100)))
    assert mean_cost.key(wide) > mean_cost.key(narrow)
    com = SjfOrdering(SjfParams(key="cost_of_mean"))
    assert com.key(wide) == com.key(narrow)
    assert not mean_cost.preemptive and not mean_cost.refresh_needed(
        replace(narrow, keyed_at_tokens=0)
    )


def test_gittins_prefers_bimodal_that_sjf_ranks_last() -> None:
    bimodal = view("bimodal", [10] * 6 + [2000] * 4)
    steady = view("steady", [400] * 10)
    assert order(SjfOrdering(), [bimodal, steady]) == ["steady", "bimodal"]
    assert order(GittinsOrdering(), [bimodal, steady]) == ["bimodal", "steady"]


def test_gittins_key_is_rank_at_attained_service() -> None:
    v = replace(view("r", [100, 300, 900], inp=50), generated_tokens=250)
    want = gittins_rank(request_cost(50, np.array([300.0, 900.0])), float(request_cost(50, 250)))
    assert GittinsOrdering(GittinsParams(cost="memory")).key(v) == pytest.approx(want)


def test_refresh_at_bucket_boundaries() -> None:
    g = GittinsOrdering(GittinsParams(refresh_every_tokens=200))
    v = view("r", [500])
    assert g.refresh_needed(v)  # never keyed
    v = replace(v, keyed_at_tokens=0, generated_tokens=199)
    assert not g.refresh_needed(v)
    assert g.refresh_needed(replace(v, generated_tokens=200))
    assert TrailOrdering().refresh_needed(replace(v, generated_tokens=200))
    assert not make_ordering("fcfs").refresh_needed(replace(v, generated_tokens=200))


def test_gittins_preemption_margin_and_cap() -> None:
    g = GittinsOrdering(GittinsParams(preempt_margin=0.2, max_preemptions=1))
    running = view("run", [100])
    assert g.may_preempt(79.0, running, 100.0)
    assert not g.may_preempt(81.0, running, 100.0)  # inside the margin
    assert not g.may_preempt(1.0, replace(running, preemptions=1), 100.0)  # capped


def test_trail_preempts_only_early() -> None:
    t = TrailOrdering()  # c = 0.5, cap 1
    running = view("run", [400])  # E[O] = 400: preemptible while o < 200
    assert t.may_preempt(1.0, replace(running, generated_tokens=150), 10.0)
    assert not t.may_preempt(1.0, replace(running, generated_tokens=250), 10.0)
    assert not t.may_preempt(20.0, running, 10.0)
    assert not t.may_preempt(1.0, replace(running, preemptions=1), 10.0)


def test_trail_key_is_expected_remaining_cost_and_outlives_safely() -> None:
    mem = TrailParams(cost="memory")
    v = replace(view("r", [100, 300], inp=0), generated_tokens=200)
    assert TrailOrdering(mem).key(v) == pytest.approx(
        float(request_cost(0, 300) - request_cost(0, 200))
    )
    # outlived everything, no fallback: O_new = 2·o
    v = replace(v, generated_tokens=400)
    assert TrailOrdering(mem).key(v) == pytest.approx(
        float(request_cost(0, 800) - request_cost(0, 400))
    )
    # with a fallback sample, conditioned on O > o
    fb = RequestView.create("r", 0.0, 0, [100, 300], fallback=[1000, 50], generated_tokens=400)
    assert GittinsOrdering(GittinsParams(cost="memory")).key(fb) == pytest.approx(
        float(request_cost(0, 1000) - request_cost(0, 400))
    )


ops = st.lists(
    st.tuples(
        st.sampled_from(["push", "pop", "remove"]),
        st.integers(0, 9),
        st.floats(-100, 100, allow_nan=False),
    ),
    max_size=80,
)


@settings(max_examples=200)
@given(ops)
def test_keyed_queue_matches_a_sorted_reference(script: list[tuple[str, int, float]]) -> None:
    q = KeyedQueue()
    ref: dict[str, tuple[float, int]] = {}
    seq = 0
    for op, i, key in script:
        rid = f"r{i}"
        if op == "push":
            q.push(rid, key)
            ref[rid] = (key, seq)
            seq += 1
        elif op == "remove" and rid in ref:
            q.remove(rid)
            del ref[rid]
        elif op == "pop" and ref:
            want = min(ref, key=lambda r: ref[r])
            assert q.pop() == (want, ref.pop(want)[0])
        assert len(q) == len(ref)
        expected = sorted(ref, key=lambda r: ref[r])
        assert [r for r, _ in q.smallest(len(ref))] == expected
    while ref:
        want = min(ref, key=lambda r: ref[r])
        assert q.pop()[0] == want
        del ref[want]
    with pytest.raises(IndexError):
        q.peek()


def test_keyed_queue_compacts_stale_entries() -> None:
    q = KeyedQueue()
    for k in range(10_000):
        q.push("same", float(k))
    assert len(q) == 1 and q.key_of("same") == 9999.0
    assert len(q._heap) <= 2 * len(q) + 65


@pytest.mark.parametrize("name", ["trail", "gittins"])
def test_a_zero_preemption_cap_makes_an_ordering_non_preemptive(name: str) -> None:
    assert make_ordering(name).preemptive is True
    assert make_ordering(name, {"max_preemptions": 0}).preemptive is False


def test_output_cost_ranks_by_decode_steps_for_every_size_based_ordering() -> None:
    # Same output samples, very different prompts: the memory cost puts the short
    # prompt first, the output cost (decode steps) ties them and keeps arrival order.
    long_prompt = RequestView.create("long", 0.0, 4000, [100.0, 300.0])
    short_prompt = RequestView.create("short", 1.0, 10, [100.0, 300.0])
    for name in ("sjf", "trail", "gittins"):
        memory = make_ordering(name, {"cost": "memory"})
        output = make_ordering(name, {"cost": "output"})
        assert order(memory, [long_prompt, short_prompt]) == ["short", "long"]
        assert output.key(long_prompt) == output.key(short_prompt)
    sjf = make_ordering("sjf", {"cost": "output"})
    assert sjf.key(short_prompt) == pytest.approx(200.0)  # E[O]
    git = make_ordering("gittins", {"cost": "output"})
    at = replace(short_prompt, generated_tokens=150)
    assert git.key(at) == pytest.approx(gittins_rank(np.array([100.0, 300.0]), 150.0))
    assert float(request_cost(4000, 7.0, "output")) == 7.0
    with pytest.raises(ValidationError):
        make_ordering("gittins", {"cost": "kv"})


@pytest.mark.parametrize("name", ["trail", "gittins"])
def test_preemptive_orderings_default_to_the_output_cost_non_preemptive_to_memory(
    name: str,
) -> None:
    # The measured defaults (docs/benchmarks/ordering.md): output when preemptive,
    # SageSched's memory cost when not (what the sidecar runs); an explicit cost wins.
    assert make_ordering(name).params.cost == "output"  # type: ignore[attr-defined]
    np_params = make_ordering(name, {"max_preemptions": 0}).params  # type: ignore[attr-defined]
    assert np_params.cost == "memory"
    explicit = make_ordering(name, {"max_preemptions": 0, "cost": "output"})
    assert explicit.params.cost == "output"  # type: ignore[attr-defined]
    assert make_ordering("sjf").params.cost == "memory"  # type: ignore[attr-defined]
