"""Unit and property tests of the two-phase planner and the admission policies."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream_scheduler.admission import (
    ADMISSION_POLICIES,
    BudgetParams,
    PolicyConfigError,
    StaticCapParams,
    UnknownPolicyError,
    build_planner,
)
from slipstream_scheduler.latency import FEATURE_NAMES, FeatureSet, LinearLatencyModel
from slipstream_scheduler.planner import PlannerMode, TwoPhasePlanner
from slipstream_scheduler.protocols import Planner
from slipstream_scheduler.types import (
    Admission,
    BatchItem,
    EngineLimits,
    Phase,
    QueuedRequest,
    RequestClass,
    RunningRequest,
    Snapshot,
    StepPlan,
)

pytestmark = pytest.mark.unit

ON = RequestClass.ONLINE
OFF = RequestClass.OFFLINE

MODEL = LinearLatencyModel(
    FeatureSet.CONTEXT_CHUNK,
    tuple(
        {
            "const": 5e-3,
            "s_p": 5e-5,
            "s_p_sq": 1e-9,
            "n_p": 2e-4,
            "n_d": 4e-5,
            "s_d_ctx": 2e-8,
            "p_c": 1e-10,
        }.get(name, 0.0)
        for name in FEATURE_NAMES
    ),
)


def decoding(rid: str, cls: RequestClass, ctx: int = 500, arrival: float = 0.0) -> RunningRequest:
    return RunningRequest(rid, cls, ctx - 10, ctx - 10, 10, 1000, arrival)


def prefilling(rid: str, cls: RequestClass, prompt: int, done: int = 0) -> RunningRequest:
    return RunningRequest(rid, cls, prompt, done, 0, 100, 0.0)


def queued(rid: str, cls: RequestClass, prompt: int = 300, cached: int = 0) -> QueuedRequest:
    return QueuedRequest(rid, cls, prompt, 100, 1.0, cached_tokens=cached)


def snap(
    running: list[RunningRequest] | None = None,
    online: list[QueuedRequest] | None = None,
    offline: list[QueuedRequest] | None = None,
    *,
    free_kv: int = 10_000,
    budget: float | None = None,
    limits: EngineLimits | None = None,
) -> Snapshot:
    return Snapshot(
        now_s=0.0,
        running=tuple(running or ()),
        online_queue=tuple(online or ()),
        offline_queue=tuple(offline or ()),
        free_kv_blocks=free_kv,
        limits=limits or EngineLimits(),
        budget_s=budget,
    )


def ids(admissions: tuple[object, ...]) -> list[str]:
    return [a.request_id for a in admissions]  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- registry


def test_registry_names_and_protocol() -> None:
    assert set(ADMISSION_POLICIES) == {
        "online-only",
        "offline-only",
        "naive",
        "static-cap",
        "budget",
    }
    for name in ADMISSION_POLICIES:
        planner = build_planner(name, latency_model=MODEL)
        assert isinstance(planner, Planner)
        assert planner.name == name


def test_registry_errors() -> None:
    with pytest.raises(UnknownPolicyError, match="budget-psm"):
        build_planner("budget-psm")
    with pytest.raises(PolicyConfigError, match="latency model"):
        build_planner("budget")
    with pytest.raises(PolicyConfigError, match="max_offline_in_flight"):
        build_planner("static-cap", {"max_offline_in_flight": -1})
    with pytest.raises(PolicyConfigError):
        build_planner("naive", {"no_such_knob": 1})
    with pytest.raises(PolicyConfigError, match="expected"):
        build_planner("naive", StaticCapParams())


# ----------------------------------------------------------------------------- ITERATION


def test_online_is_served_before_offline_and_offline_fills_the_rest() -> None:
    s = snap(
        [decoding("on-run", ON), decoding("off-run", OFF)],
        online=[queued("on-1", ON, 200), queued("on-2", ON, 200)],
        offline=[queued("off-1", OFF, 300), queued("off-2", OFF, 5000)],
    )
    plan = build_planner("naive").plan(s)
    assert ids(plan.scheduled) == ["on-run", "off-run"]
    assert ids(plan.admitted) == ["on-1", "on-2", "off-1", "off-2"]
    # The token cap (2048) is shared: 2 decodes + 400 online + 300 offline leaves 1346.
    assert [a.tokens for a in plan.admitted] == [200, 200, 300, 2048 - 2 - 700]
    assert plan.preempted == ()
    assert plan.budget_s is None


def test_budget_bounds_offline_and_the_last_chunk_is_the_largest_that_fits() -> None:
    running = [decoding(f"on-{i}", ON) for i in range(8)]
    s = snap(running, offline=[queued("off-1", OFF, 4000)], budget=0.04)
    plan = build_planner("budget", latency_model=MODEL).plan(s)
    (adm,) = plan.admitted
    batch = [BatchItem(Phase.DECODE, 1, 500)] * 8
    assert MODEL.predict([*batch, BatchItem(Phase.PREFILL, adm.tokens, 0)]) <= 0.04
    assert MODEL.predict([*batch, BatchItem(Phase.PREFILL, adm.tokens + 1, 0)]) > 0.04
    assert plan.predicted_step_s == pytest.approx(
        MODEL.predict([*batch, BatchItem(Phase.PREFILL, adm.tokens, 0)])
    )
    naive = build_planner("naive", latency_model=MODEL).plan(s)
    assert naive.admitted[0].tokens > adm.tokens


def test_offline_decodes_stop_at_the_budget() -> None:
    running = [decoding(f"off-{i}", OFF, ctx=1000) for i in range(100)]
    one = MODEL.predict([BatchItem(Phase.DECODE, 1, 1000)] * 30)
    plan = build_planner("budget", latency_model=MODEL).plan(snap(running, budget=one))
    assert len(plan.scheduled) == 30
    assert plan.predicted_step_s == pytest.approx(one)
    assert len(build_planner("naive").plan(snap(running, budget=one)).scheduled) == 100


def test_online_alone_may_exceed_the_budget_and_then_no_offline_runs() -> None:
    s = snap(
        [decoding("off-run", OFF)],
        online=[queued("on-big", ON, 2000)],
        offline=[queued("off-1", OFF, 100)],
        budget=0.02,
    )
    plan = build_planner("budget", latency_model=MODEL).plan(s)
    assert ids(plan.admitted) == ["on-big"]
    assert plan.scheduled == ()  # the running offline decode waits (keeps its KV)
    assert plan.predicted_step_s > 0.02
    assert plan.preempted == ()


def test_online_chunks_can_be_sized_to_the_budget_with_a_floor() -> None:
    s = snap(online=[queued("on-big", ON, 2000)], budget=0.02)
    params = BudgetParams(online_chunks_in_budget=True, online_min_chunk_tokens=64)
    plan = build_planner("budget", params, latency_model=MODEL).plan(s)
    x = plan.admitted[0].tokens
    assert (
        MODEL.predict([BatchItem(Phase.PREFILL, x, 0)])
        <= 0.02
        < MODEL.predict([BatchItem(Phase.PREFILL, x + 1, 0)])
    )
    tight = build_planner("budget", params, latency_model=MODEL).plan(replace(s, budget_s=1e-4))
    assert tight.admitted[0].tokens == 64  # the floor: online always progresses


def test_online_preempts_the_latest_offline_when_kv_is_short() -> None:
    running = [
        RunningRequest("off-old", OFF, 320, 320, 0, 10, arrival_s=1.0),
        RunningRequest("off-new", OFF, 320, 320, 0, 10, arrival_s=5.0),
        RunningRequest("on-run", ON, 320, 320, 0, 10, arrival_s=9.0),
    ]
    s = snap(running, online=[queued("on-1", ON, 320)], free_kv=5)
    plan = build_planner("naive").plan(s)
    # 320 tokens = 20 blocks; one victim (20 blocks) is enough after the decodes' blocks.
    assert plan.preempted == ("off-new",)
    assert ids(plan.admitted) == ["on-1"]
    assert "off-new" not in ids(plan.scheduled)
    assert "off-old" in ids(plan.scheduled)


def test_online_preempts_offline_for_a_sequence_slot() -> None:
    running = [decoding("off-a", OFF, arrival=1.0), decoding("off-b", OFF, arrival=2.0)]
    s = snap(running, online=[queued("on-1", ON)], limits=EngineLimits(max_num_seqs=2))
    plan = build_planner("naive").plan(s)
    assert plan.preempted == ("off-b",)
    assert ids(plan.admitted) == ["on-1"]
    offline_only = build_planner("offline-only").plan(s)
    assert offline_only.preempted == () and offline_only.admitted == ()


def test_a_request_is_admitted_only_if_its_whole_sequence_fits_as_vllm_admits() -> None:
    # vLLM's scheduler_reserve_full_isl (its default): 640 tokens are 40 blocks; with 20
    # free the first 256-token chunk (16 blocks) fits, the whole sequence does not.
    lim = EngineLimits(long_prefill_token_threshold=256)
    loose = replace(lim, reserve_full_sequence=False)
    naive = build_planner("naive")
    assert lim.reserve_full_sequence
    assert naive.plan(snap(offline=[queued("off-1", OFF, 640)], free_kv=20, limits=lim)) == (
        StepPlan((), (), (), 0.0, None)
    )
    plan = naive.plan(snap(offline=[queued("off-1", OFF, 640)], free_kv=20, limits=loose))
    assert ids(plan.admitted) == ["off-1"]
    # Cached blocks are held already: with 320 tokens cached, 20 more blocks are enough.
    cached = [queued("off-1", OFF, 640, cached=320)]
    assert ids(naive.plan(snap(offline=cached, free_kv=20, limits=lim)).admitted) == ["off-1"]
    # An online request preempts offline work for its whole sequence, not only its chunk
    # (256 tokens here: another online request is decoding).
    running = [
        RunningRequest("off-a", OFF, 320, 320, 0, 10, arrival_s=1.0),
        RunningRequest("off-b", OFF, 320, 320, 0, 10, arrival_s=2.0),
        RunningRequest("on-run", ON, 300, 300, 21, 100, arrival_s=3.0),
    ]
    plan = naive.plan(snap(running, online=[queued("on-1", ON, 640)], free_kv=20, limits=lim))
    assert plan.preempted == ("off-b",)
    assert plan.admitted == (Admission("on-1", 256),)
    plan = naive.plan(snap(running, online=[queued("on-1", ON, 640)], free_kv=20, limits=loose))
    assert plan.preempted == () and ids(plan.admitted) == ["on-1"]


def test_static_cap_limits_offline_in_flight() -> None:
    running = [decoding("off-run", OFF)]
    s = snap(running, offline=[queued(f"off-{i}", OFF, 50) for i in range(10)])
    plan = build_planner("static-cap", {"max_offline_in_flight": 3}).plan(s)
    assert ids(plan.admitted) == ["off-0", "off-1"]
    assert len(build_planner("naive").plan(s).admitted) == 10


def test_online_only_and_offline_only() -> None:
    s = snap(
        [decoding("on-run", ON)],
        online=[queued("on-1", ON)],
        offline=[queued("off-1", OFF)],
    )
    online_only = build_planner("online-only").plan(s)
    assert ids(online_only.admitted) == ["on-1"]
    offline_only = build_planner("offline-only").plan(s)
    assert ids(offline_only.admitted) == ["off-1"]


def test_chunks_respect_the_long_prefill_threshold_and_the_prefix_cache() -> None:
    limits = EngineLimits(long_prefill_token_threshold=256)
    s = snap(
        [prefilling("on-pre", ON, 1000, done=100)],
        online=[queued("on-1", ON, 1000, cached=960)],
        offline=[queued("off-1", OFF, 1000)],
        limits=limits,
    )
    plan = build_planner("naive").plan(s)
    assert [a.tokens for a in plan.scheduled] == [256]
    assert [a.tokens for a in plan.admitted] == [40, 256]


def test_a_lone_online_request_takes_the_whole_token_cap_as_vllm_gives_it() -> None:
    # vLLM lifts the chunk threshold for a request with nobody to starve; the planner does
    # the same for an online request with no other online request beside it, since the
    # offline requests it shares the step with have no latency to protect.
    limits = EngineLimits(max_num_batched_tokens=2048, long_prefill_token_threshold=256)
    alone = snap(
        [decoding("off-run", OFF), prefilling("off-pre", OFF, 3000, done=512)],
        online=[queued("on-1", ON, 1500)],
        offline=[queued("off-1", OFF, 1000)],
        limits=limits,
    )
    plan = build_planner("naive").plan(alone)
    assert plan.admitted[0].request_id == "on-1" and plan.admitted[0].tokens == 1500
    running_alone = snap([prefilling("on-pre", ON, 4000, done=1000)], limits=limits)
    assert [a.tokens for a in build_planner("naive").plan(running_alone).scheduled] == [2048]
    # Another online request, decoding or waiting, brings the threshold back.
    beside_decode = replace(alone, running=(*alone.running, decoding("on-dec", ON)))
    assert build_planner("naive").plan(beside_decode).admitted[0].tokens == 256
    two_waiting = replace(alone, online_queue=(queued("on-1", ON, 1500), queued("on-2", ON)))
    assert [a.tokens for a in build_planner("naive").plan(two_waiting).admitted[:2]] == [256, 256]
    # Offline chunks keep the threshold whatever the online side does.
    offline_alone = snap(offline=[queued("off-1", OFF, 1000)], limits=limits)
    assert [a.tokens for a in build_planner("naive").plan(offline_alone).admitted] == [256]


def test_static_cap_per_step_bounds_the_offline_tokens_of_a_step() -> None:
    limits = EngineLimits(max_num_batched_tokens=2048, long_prefill_token_threshold=256)
    s = snap(
        [decoding("on-dec", ON), decoding("off-a", OFF), prefilling("off-pre", OFF, 900)],
        offline=[queued(f"off-{i}", OFF, 300) for i in range(4)],
        limits=limits,
    )
    params = StaticCapParams(max_offline_in_flight=None, max_offline_step_tokens=40)
    plan = build_planner("static-cap", params).plan(s)
    tokens = {a.request_id: a.tokens for a in (*plan.scheduled, *plan.admitted)}
    assert tokens == {"on-dec": 1, "off-a": 1, "off-pre": 39}  # 40 offline tokens
    none = build_planner("static-cap", {"max_offline_step_tokens": 0}).plan(s)
    assert ids(none.scheduled) == ["on-dec"] and none.admitted == ()
    # Online work is never held back by the offline cap.
    online = replace(s, online_queue=(queued("on-1", ON, 600),))
    plan = build_planner("static-cap", params).plan(online)
    assert ("on-1", 256) in [(a.request_id, a.tokens) for a in plan.admitted]
    # Without the per-step cap, offline work fills the step.
    uncapped = build_planner("static-cap", {"max_offline_in_flight": None}).plan(s)
    assert sum(a.tokens for a in (*uncapped.scheduled, *uncapped.admitted)) > 1000


def test_queue_window_bounds_the_work() -> None:
    offline = [queued(f"off-{i}", OFF, 20) for i in range(1000)]
    plan = build_planner("naive", {"queue_window": 5}).plan(snap(offline=offline))
    assert len(plan.admitted) == 5


def test_a_blocked_online_request_stops_the_online_queue() -> None:
    # Not enough KV for on-big and nothing to preempt: FCFS stops, offline gets nothing.
    s = snap(
        online=[queued("on-big", ON, 2000), queued("on-small", ON, 16)],
        offline=[queued("off-1", OFF, 16)],
        free_kv=0,
    )
    plan = build_planner("naive").plan(s)
    assert plan.admitted == ()


# ----------------------------------------------------------------------------- ADMISSION


def test_admission_mode_fills_offline_to_the_budget_then_stops() -> None:
    running = [decoding(f"on-{i}", ON) for i in range(4)]
    offline = [queued(f"off-{i}", OFF, 200) for i in range(50)]
    s = snap(running, offline=offline, budget=0.03)
    planner = build_planner("budget", latency_model=MODEL, mode=PlannerMode.ADMISSION)
    plan = planner.plan(s)
    assert plan.scheduled == ()
    n = len(plan.admitted)
    assert 0 < n < 50
    assert ids(plan.admitted) == [f"off-{i}" for i in range(n)]
    assert all(a.tokens == 200 for a in plan.admitted)
    assert plan.predicted_step_s <= 0.03
    # Peak by hand: the in-flight decodes, each admitted request's prefill + decode.
    peak = [BatchItem(Phase.DECODE, 1, 500)] * 4
    for _ in range(n + 1):
        peak += [BatchItem(Phase.PREFILL, 200, 0), BatchItem(Phase.DECODE, 1, 200)]
    assert MODEL.predict(peak) > 0.03  # the next one would not have fitted
    naive = build_planner("naive", mode=PlannerMode.ADMISSION).plan(s)
    assert len(naive.admitted) == 50


def test_admission_mode_preempts_offline_when_online_overruns_the_budget() -> None:
    running = [decoding(f"off-{i}", OFF, arrival=float(i)) for i in range(40)]
    s = snap(running, online=[queued("on-1", ON, 500)], budget=0.0315)
    params = BudgetParams(max_preemptions=40)
    planner = build_planner("budget", params, latency_model=MODEL, mode=PlannerMode.ADMISSION)
    plan = planner.plan(s)
    assert ids(plan.admitted) == ["on-1"]
    assert 0 < len(plan.preempted) < 40
    # vLLM's victim order: latest arrival first.
    assert list(plan.preempted) == [f"off-{39 - i}" for i in range(len(plan.preempted))]
    assert plan.predicted_step_s <= 0.0315
    kept = 40 - len(plan.preempted)
    peak = [BatchItem(Phase.PREFILL, 500, 0), BatchItem(Phase.DECODE, 1, 500)]
    assert MODEL.predict(peak + [BatchItem(Phase.DECODE, 1, 500)] * (kept + 1)) > 0.0315
    # When online work alone is over budget (its prefill chunk), every offline
    # request goes (HyGen's rule): each would only lengthen the online request's step.
    over = planner.plan(replace(s, budget_s=0.00623))
    assert ids(over.admitted) == ["on-1"]
    assert sorted(over.preempted) == sorted(f"off-{i}" for i in range(40))
    online_alone = MODEL.predict(peak)
    assert online_alone > 0.00623
    assert over.predicted_step_s == pytest.approx(online_alone)
    # keep_offline_margin: offline work may add to that step what the budget leaves
    # it beside the online decodes (here the new request's own decode): the decodes
    # beyond that margin go.
    margin_planner = build_planner(
        "budget",
        BudgetParams(max_preemptions=40, keep_offline_margin=True),
        latency_model=MODEL,
        mode=PlannerMode.ADMISSION,
    )
    kept_margin = margin_planner.plan(replace(s, budget_s=0.00623))
    kept = 40 - len(kept_margin.preempted)
    assert 0 < kept < 40
    margin = 0.00623 - MODEL.predict([BatchItem(Phase.DECODE, 1, 500)])
    assert kept_margin.predicted_step_s <= online_alone + margin
    extra = [BatchItem(Phase.DECODE, 1, 500)] * (kept + 1)
    assert MODEL.predict(peak + extra) > online_alone + margin
    # Without online work nobody is preempted either.
    idle = planner.plan(replace(s, online_queue=(), budget_s=0.001))
    assert idle.preempted == ()


def test_admission_mode_preempts_the_cheapest_offline_work_first() -> None:
    # In prefill first (its chunk is most of the step's cost), then the fewest
    # tokens held (least recompute), ties to the latest arrival.
    running = [
        decoding("off-big", OFF, ctx=3000, arrival=9.0),
        decoding("off-small", OFF, ctx=200, arrival=1.0),
        decoding("off-small-late", OFF, ctx=200, arrival=2.0),
        prefilling("off-pre", OFF, 400, done=144),
    ]
    s = snap(running, online=[queued("on-1", ON, 300)], free_kv=0, budget=1.0)
    params = BudgetParams(max_preemptions=2)
    planner = build_planner("budget", params, latency_model=MODEL, mode=PlannerMode.ADMISSION)
    plan = planner.plan(s)
    # the online request needs 19 KV blocks: the prefill frees 9, a small decode 13
    assert ids(plan.admitted) == ["on-1"]
    assert plan.preempted == ("off-pre", "off-small-late")
    s2 = replace(s, running=tuple(running[:3]))
    assert planner.plan(s2).preempted == ("off-small-late", "off-small")


def test_admission_mode_admits_no_offline_while_an_online_request_waits_for_room() -> None:
    # The online request cannot fit even after the preemptions the plan may make;
    # the room they freed must not go to new offline work (abort/admit churn).
    running = [decoding(f"off-{i}", OFF, ctx=100, arrival=float(i)) for i in range(4)]
    s = snap(
        running,
        online=[queued("on-1", ON, 3000)],
        offline=[queued("off-q", OFF, 50)],
        free_kv=10,
        budget=1.0,
    )
    params = BudgetParams(max_preemptions=2)
    plan = build_planner("budget", params, latency_model=MODEL, mode=PlannerMode.ADMISSION).plan(s)
    assert plan.admitted == ()
    assert len(plan.preempted) == 2


def test_admission_mode_progress_rule_admits_one_long_prompt_over_a_tight_budget() -> None:
    # A 2,000-token chunk predicts far above 20 ms: without the rule no offline
    # request would ever start. On an idle engine, one does.
    offline = [queued(f"off-{i}", OFF, 2000) for i in range(3)]
    planner = build_planner("budget", latency_model=MODEL, mode=PlannerMode.ADMISSION)
    idle = planner.plan(snap(offline=offline, budget=0.02))
    assert ids(idle.admitted) == ["off-0"]
    assert idle.predicted_step_s > 0.02
    # Anything in flight (online or offline, decoding or in prefill) keeps the budget.
    for busy in (decoding("off-d", OFF), prefilling("off-p", OFF, 2000), decoding("on-d", ON)):
        assert planner.plan(snap([busy], offline=offline, budget=0.02)).admitted == ()


def test_admission_mode_prices_a_candidate_as_it_will_be_priced_in_flight() -> None:
    # A 3,000-token prompt under a 256-token chunk cap: admitted only if its *last*
    # chunk (context 2,744) fits, the price the next plan gives it in flight, so
    # the next plan does not preempt what this one admitted.
    lim = EngineLimits(long_prefill_token_threshold=256)
    model = LinearLatencyModel(
        FeatureSet.CONTEXT_CHUNK,
        tuple(
            {"const": 5e-3, "s_p": 2e-5, "n_d": 5e-5, "p_c": 1e-8}.get(n, 0.0)
            for n in FEATURE_NAMES
        ),
    )
    planner = build_planner("budget", latency_model=model, mode=PlannerMode.ADMISSION)
    online = [decoding("on-d", ON, ctx=100)]
    cand = [queued("off-long", OFF, 3000)]
    first = model.predict(
        [
            BatchItem(Phase.DECODE, 1, 100),
            BatchItem(Phase.PREFILL, 256, 0),
            BatchItem(Phase.DECODE, 1, 3000),
        ]
    )
    last = model.predict(
        [
            BatchItem(Phase.DECODE, 1, 100),
            BatchItem(Phase.PREFILL, 256, 2744),
            BatchItem(Phase.DECODE, 1, 3000),
        ]
    )
    budget = (first + last) / 2
    assert planner.plan(snap(online, offline=cand, budget=budget, limits=lim)).admitted == ()
    plan = planner.plan(snap(online, offline=cand, budget=last, limits=lim))
    assert ids(plan.admitted) == ["off-long"]
    assert plan.admitted[0].tokens == 256
    # in flight, still in prefill, it is kept by the next plan with an online arrival
    after = [*online, RunningRequest("off-long", OFF, 3000, 2744, 0, 100, 1.0, 100)]
    keep = planner.plan(snap(after, budget=last, limits=lim))
    assert keep.preempted == ()


# ----------------------------------------------------------------------------- properties


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    block = draw(st.sampled_from([1, 16]))
    limits = EngineLimits(
        max_num_seqs=draw(st.integers(1, 24)),
        max_num_batched_tokens=draw(st.integers(1, 4096)),
        block_size=block,
        long_prefill_token_threshold=draw(st.sampled_from([0, 64, 512])),
    )
    n_running = draw(st.integers(0, limits.max_num_seqs))
    running = []
    for i in range(n_running):
        prompt = draw(st.integers(1, 3000))
        in_prefill = draw(st.booleans())
        computed = draw(st.integers(0, prompt - 1)) if in_prefill else prompt
        generated = 0 if in_prefill else draw(st.integers(1, 500))
        running.append(
            RunningRequest(
                f"r{i}",
                draw(st.sampled_from([ON, OFF])),
                prompt,
                computed,
                generated,
                1000,
                arrival_s=draw(st.floats(0, 100)),
                priority=draw(st.integers(0, 2)),
            )
        )

    def queue(prefix: str, cls: RequestClass) -> tuple[QueuedRequest, ...]:
        out = []
        for i in range(draw(st.integers(0, 12))):
            prompt = draw(st.integers(1, 3000))
            out.append(
                QueuedRequest(
                    f"{prefix}{i}",
                    cls,
                    prompt,
                    100,
                    1.0,
                    cached_tokens=draw(st.integers(0, prompt)),
                )
            )
        return tuple(out)

    return Snapshot(
        now_s=0.0,
        running=tuple(running),
        online_queue=queue("q-on-", ON),
        offline_queue=queue("q-off-", OFF),
        free_kv_blocks=draw(st.integers(0, 800)),
        limits=limits,
        budget_s=draw(st.one_of(st.none(), st.floats(0.004, 0.012), st.floats(0.001, 0.2))),
    )


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


def check_iteration_plan(
    s: Snapshot, plan: StepPlan, policy: str, planner: TwoPhasePlanner
) -> None:
    lim = s.limits
    bs = lim.block_size
    running = {r.request_id: r for r in s.running}
    queued_by_id = {q.request_id: q for q in (*s.online_queue, *s.offline_queue)}
    chunk_cap = lim.long_prefill_token_threshold or lim.max_num_batched_tokens
    # A lone online request (no other online request running or waiting) may take the
    # whole token cap, as vLLM gives a request with nobody to starve.
    online_prefilling = [r for r in s.running if r.cls is ON and r.in_prefill]
    online_decoding = [r for r in s.running if r.cls is ON and not r.in_prefill]
    # (Online requests a policy does not admit, offline-only's, starve nobody.)
    waiting = len(s.online_queue) if planner.rules.admit_online else 0
    lone = len(online_prefilling) + waiting == 1 and not online_decoding

    def cap_of(cls: RequestClass) -> int:
        return lim.max_num_batched_tokens if lone and cls is ON else chunk_cap

    # Only running offline requests are preempted, and they are not also scheduled.
    for rid in plan.preempted:
        assert running[rid].cls is OFF
    assert len(set(plan.preempted)) == len(plan.preempted)
    sched_ids = ids(plan.scheduled)
    assert len(set(sched_ids)) == len(sched_ids)
    assert not set(sched_ids) & set(plan.preempted)

    # Token cap, chunk cap, KV blocks, sequence slots.
    assert sum(a.tokens for a in plan.scheduled) + sum(a.tokens for a in plan.admitted) <= (
        lim.max_num_batched_tokens
    )
    kv_used = 0
    batch: list[BatchItem] = []
    cls_of: dict[str, RequestClass] = {}
    for a in plan.scheduled:
        r = running[a.request_id]
        cls_of[a.request_id] = r.cls
        assert a.tokens >= 1
        if r.in_prefill:
            assert a.tokens <= min(r.prompt_tokens - r.computed_tokens, cap_of(r.cls))
            kv_used += _blocks(r.computed_tokens + a.tokens, bs) - _blocks(r.computed_tokens, bs)
            batch.append(BatchItem(Phase.PREFILL, a.tokens, r.computed_tokens))
        else:
            assert a.tokens == 1
            kv_used += 1 if r.context_tokens % bs == 0 else 0
            batch.append(BatchItem(Phase.DECODE, 1, r.context_tokens))
    for a in plan.admitted:
        q = queued_by_id[a.request_id]
        cls_of[a.request_id] = q.cls
        ctx0 = max(0, min(q.cached_tokens, q.prompt_tokens - 1))
        assert 1 <= a.tokens <= min(q.prompt_tokens - ctx0, cap_of(q.cls))
        kv_used += _blocks(ctx0 + a.tokens, bs) - ctx0 // bs
        batch.append(BatchItem(Phase.PREFILL, a.tokens, ctx0))
    freed = sum(_blocks(running[rid].context_tokens, bs) for rid in plan.preempted)
    assert kv_used <= s.free_kv_blocks + freed
    if lim.reserve_full_sequence:  # vLLM's gate: the whole sequence must fit on admission
        for a in plan.admitted:
            q = queued_by_id[a.request_id]
            ctx0 = max(0, min(q.cached_tokens, q.prompt_tokens - 1))
            assert _blocks(q.prompt_tokens, bs) - ctx0 // bs <= s.free_kv_blocks + freed
    assert len(s.running) - len(plan.preempted) + len(plan.admitted) <= lim.max_num_seqs

    # The prediction is the model's prediction of exactly this batch.
    if planner.model is not None:
        assert plan.predicted_step_s == pytest.approx(planner.model.predict(batch), rel=1e-9)

    # Online first: scheduled online work precedes scheduled offline work, admitted
    # online precede admitted offline; a blocked online head
    # (within the window) means no new offline request.
    sched_classes = [running[a.request_id].cls for a in plan.scheduled]
    assert sched_classes == sorted(sched_classes)
    classes = [queued_by_id[a.request_id].cls for a in plan.admitted]
    assert classes == sorted(classes)
    n_online_admitted = classes.count(ON)
    window = planner.rules.queue_window
    online_blocked = n_online_admitted < min(len(s.online_queue), window)
    if online_blocked and policy not in ("offline-only",):
        assert OFF not in classes
    assert ids(plan.admitted)[:n_online_admitted] == [
        q.request_id for q in s.online_queue[:n_online_admitted]
    ]

    offline_work = any(c is OFF for c in cls_of.values())
    if policy == "online-only":
        assert OFF not in classes
    if policy == "offline-only":
        assert ON not in classes
        assert plan.preempted == ()
    if policy == "static-cap":
        cap = planner.rules.offline_cap
        assert cap is not None
        in_flight = sum(1 for r in s.running if r.cls is OFF) - len(plan.preempted)
        assert classes.count(OFF) == 0 or in_flight + classes.count(OFF) <= cap
    if policy == "budget" and s.budget_s is not None:
        # The documented rule: only online work may take the step over the budget.
        assert plan.budget_s == s.budget_s
        if plan.predicted_step_s > s.budget_s * (1 + 1e-12):
            assert not offline_work


POLICIES = sorted(ADMISSION_POLICIES)


@settings(max_examples=300, deadline=None)
@given(s=snapshots(), policy=st.sampled_from(POLICIES), cap=st.integers(0, 6))
def test_iteration_plans_respect_every_limit(s: Snapshot, policy: str, cap: int) -> None:
    params = {"max_offline_in_flight": cap} if policy == "static-cap" else None
    planner = build_planner(policy, params, latency_model=MODEL)
    plan = planner.plan(s)
    check_iteration_plan(s, plan, policy, planner)


@settings(max_examples=200, deadline=None)
@given(s=snapshots(), policy=st.sampled_from(POLICIES))
def test_admission_plans_respect_slots_kv_and_budget(s: Snapshot, policy: str) -> None:
    planner = build_planner(policy, latency_model=MODEL, mode=PlannerMode.ADMISSION)
    plan = planner.plan(s)
    assert plan.scheduled == ()
    running = {r.request_id: r for r in s.running}
    for rid in plan.preempted:
        assert running[rid].cls is OFF
    queued_by_id = {q.request_id: q for q in (*s.online_queue, *s.offline_queue)}
    classes = [queued_by_id[a.request_id].cls for a in plan.admitted]
    assert classes == sorted(classes)
    assert len(s.running) - len(plan.preempted) + len(plan.admitted) <= s.limits.max_num_seqs
    bs = s.limits.block_size
    need = 0
    for a in plan.admitted:
        q = queued_by_id[a.request_id]
        ctx0 = max(0, min(q.cached_tokens, q.prompt_tokens - 1))
        need += _blocks(q.prompt_tokens + 1, bs) - ctx0 // bs
    freed = sum(_blocks(running[rid].context_tokens, bs) for rid in plan.preempted)
    assert need <= s.free_kv_blocks + freed
    if policy == "online-only":
        assert OFF not in classes
    if policy == "offline-only":
        assert ON not in classes and plan.preempted == ()
    over = s.budget_s is not None and plan.predicted_step_s > s.budget_s
    if policy == "budget" and over and OFF in classes:
        # Over the budget only by the progress rule: one offline request, the plan's
        # only admission, on an idle engine.
        assert classes == [OFF]
        assert s.running == ()
