"""The dispatcher's bookkeeping and decisions, driven by hand with the real planner."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream_scheduler.admission import build_planner
from slipstream_scheduler.dispatcher import (
    Abort,
    Dispatcher,
    DispatcherConfig,
    DispatcherError,
    DuplicateRequestError,
    FifoQueue,
    Incoming,
    PsmOfflineQueue,
    Submit,
    UnknownRequestError,
)
from slipstream_scheduler.latency import FeatureSet, LinearLatencyModel
from slipstream_scheduler.planner import InFlight, PlannerMode
from slipstream_scheduler.psm import PsmParams, PsmQueue
from slipstream_scheduler.sim.workload import unique_block_hashes
from slipstream_scheduler.types import BatchItem, EngineLimits, Phase, RequestClass

pytestmark = pytest.mark.unit

ON, OFF = RequestClass.ONLINE, RequestClass.OFFLINE


def _model() -> LinearLatencyModel:
    # 5 ms per step + 0.02 ms per prefill token + 0.05 ms per decode sequence
    coef = (0.005, 2e-5, 0.0, 0.0, 5e-5, 0.0, 0.0, 0.0)
    return LinearLatencyModel(FeatureSet.CONTEXT, coef)


def _disp(
    policy: str = "naive",
    *,
    seqs: int = 8,
    kv: int = 10_000,
    budget: float | None = None,
    cfg: DispatcherConfig | None = None,
    params: dict[str, object] | None = None,
) -> Dispatcher:
    planner = build_planner(
        policy,
        params,
        latency_model=_model() if policy == "budget" else None,
        mode=PlannerMode.ADMISSION,
    )
    return Dispatcher(
        cfg or DispatcherConfig(),
        planner,
        limits=EngineLimits(max_num_seqs=seqs),
        kv_blocks=kv,
        budget_s=budget,
    )


def _inc(rid: str, cls: RequestClass, prompt: int = 100, out: int = 50, t: float = 0.0) -> Incoming:
    return Incoming(rid, cls, prompt, out, t, block_hashes=unique_block_hashes(hash(rid), prompt))


def test_online_is_submitted_with_priority_zero_and_offline_behind() -> None:
    d = _disp()
    d.arrive(_inc("on1", ON), 0.0)
    d.arrive(_inc("off1", OFF), 0.0)
    dec = d.decide(0.0)
    assert Submit("on1", 0, 0) in dec.submit
    assert Submit("off1", 100, 0) in dec.submit
    assert dec.abort == ()
    st = d.stats()
    assert (st.online_inflight, st.offline_inflight, st.online_queued) == (1, 1, 0)


def test_decide_is_a_no_op_when_nothing_changed() -> None:
    d = _disp()
    d.arrive(_inc("on1", ON), 0.0)
    assert d.decide(0.0).submit
    while d.decide(0.0):
        pass
    plans = d.stats().plans
    d.progress("on1", 1, 0.1)  # first token: the estimate changes shape
    d.decide(0.1)
    d.progress("on1", 2, 0.2)  # steady decode: no re-plan
    assert not d.decide(0.2)
    assert d.stats().plans <= plans + 1


def test_online_only_never_submits_offline() -> None:
    d = _disp("online-only", cfg=DispatcherConfig(admit_offline=False))
    d.arrive(_inc("off1", OFF), 0.0)
    d.arrive(_inc("on1", ON), 0.0)
    subs = [s.request_id for s in d.decide(0.0).submit]
    assert subs == ["on1"]
    assert d.stats().offline_queued == 1


def test_online_waits_in_the_dispatcher_when_seqs_are_full() -> None:
    d = _disp("online-only", seqs=2)
    for i in range(4):
        d.arrive(_inc(f"on{i}", ON, t=i), float(i))
    assert [s.request_id for s in d.decide(3.0).submit] == ["on0", "on1"]
    assert not d.decide(3.0)
    d.finished("on0", 50, 4.0)
    assert [s.request_id for s in d.decide(4.0).submit] == ["on2"]


def test_preempted_offline_keeps_its_output_and_resumes_first() -> None:
    d = _disp("naive", seqs=2)
    d.arrive(_inc("off1", OFF), 0.0)
    d.arrive(_inc("off2", OFF), 0.0)
    d.arrive(_inc("off3", OFF), 0.0)
    assert [s.request_id for s in d.decide(0.0).submit] == ["off1", "off2"]
    d.progress("off2", 7, 1.0)
    d.progress("off1", 7, 1.0)
    d.arrive(_inc("on1", ON, t=1.0), 1.0)
    dec = d.decide(1.0)
    assert dec.abort == (Abort("off2", "preempt"),)  # vLLM's victim: latest arrival
    assert [s.request_id for s in dec.submit] == ["on1"]
    d.aborted("off2", 1.0)
    assert d.request_state("off2") == (False, 7, 1)
    d.finished("on1", 50, 2.0)
    dec = d.decide(2.0)
    # off2 is older than off3: it goes first, as a continuation of its 7 tokens
    assert dec.submit[0] == Submit("off2", 100, 7)
    d.progress("off2", 43, 3.0)
    d.finished("off2", 43, 3.0)
    assert d.stats().preemptions == 1
    assert d.stats().resumed == 1


def test_budget_holds_offline_back_when_the_step_would_exceed_it() -> None:
    # a 2000-token offline prefill predicts 5 + 40 = 45 ms > 20 ms budget
    d = _disp("budget", budget=0.020)
    d.arrive(_inc("on1", ON, prompt=50), 0.0)
    d.arrive(_inc("big", OFF, prompt=2000), 0.0)
    assert [s.request_id for s in d.decide(0.0).submit] == ["on1"]
    d.progress("on1", 1, 0.1)
    assert not d.decide(0.1).submit  # online work in flight: the budget holds
    d.set_budget(0.100)
    assert [s.request_id for s in d.decide(0.2).submit] == ["big"]


def test_a_long_prompt_starts_on_an_idle_engine_under_a_tight_budget() -> None:
    # The progress rule: on an idle engine one offline request may exceed the
    # budget (else a budget below one prefill chunk stalls the job for good).
    d = _disp("budget", budget=0.020)
    for i in range(3):
        d.arrive(_inc(f"big{i}", OFF, prompt=2000), 0.0)
    assert [s.request_id for s in d.decide(0.0).submit] == ["big0"]
    assert not d.decide(0.0)  # big0 is in flight: the budget holds
    d.progress("big0", 1, 0.1)
    assert not d.decide(0.1)
    d.finished("big0", 50, 0.2)
    assert [s.request_id for s in d.decide(0.2).submit] == ["big1"]


def test_static_cap_bounds_offline_in_flight() -> None:
    d = _disp("static-cap", seqs=16, params={"max_offline_in_flight": 3})
    for i in range(6):
        d.arrive(_inc(f"off{i}", OFF), 0.0)
    n = 0
    while dec := d.decide(0.0):
        n += len(dec.submit)
    assert n == 3 == d.stats().offline_inflight


class _Recording:
    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def predict(
        self, vector: npt.NDArray[np.float32] | None, input_tokens: int
    ) -> npt.NDArray[np.float64]:
        return np.array([10.0])

    def observe(
        self, vector: npt.NDArray[np.float32] | None, input_tokens: int, output_tokens: int
    ) -> None:
        self.seen.append((input_tokens, output_tokens))


def test_finished_online_feeds_the_length_predictor() -> None:
    pred = _Recording()
    planner = build_planner("naive", mode=PlannerMode.ADMISSION)
    d = Dispatcher(DispatcherConfig(), planner, length_predictor=pred)
    d.arrive(_inc("on1", ON, prompt=30), 0.0)
    d.arrive(_inc("off1", OFF), 0.0)
    d.decide(0.0)
    d.finished("on1", 12, 1.0)
    d.finished("off1", 50, 1.0)
    assert pred.seen == [(30, 12)]


def test_errors_carry_the_request_id() -> None:
    d = _disp()
    d.arrive(_inc("a", ON), 0.0)
    with pytest.raises(DuplicateRequestError):
        d.arrive(_inc("a", ON), 0.0)
    with pytest.raises(UnknownRequestError) as e:
        d.progress("nope", 1, 0.0)
    assert e.value.request_id == "nope"
    with pytest.raises(DispatcherError):
        d.aborted("a", 0.0)


def test_failed_request_leaves_queue_or_flight() -> None:
    d = _disp()
    d.arrive(_inc("a", ON), 0.0)
    d.arrive(_inc("b", OFF), 0.0)
    d.failed("b", 0.0)
    d.decide(0.0)
    d.failed("a", 0.1)
    st = d.stats()
    assert (st.online_inflight, st.offline_queued, st.failed) == (0, 0, 2)
    assert st.est_free_kv_blocks == 10_000


def test_kv_estimate_counts_shared_prefix_blocks_once() -> None:
    d = _disp(kv=1000)
    shared = unique_block_hashes(1, 320)
    d.arrive(Incoming("a", OFF, 330, 5, 0.0, block_hashes=shared), 0.0)
    d.arrive(Incoming("b", OFF, 330, 5, 0.0, block_hashes=shared), 0.0)
    d.decide(0.0)
    # 20 shared prompt blocks + one partial tail block each
    assert d.stats().est_free_kv_blocks == 1000 - 20 - 2


def _psm_inc(rid: str, prefix: int) -> Incoming:
    hashes = unique_block_hashes(prefix, 160) + unique_block_hashes(hash(rid), 64)
    return Incoming(rid, OFF, 224, 1, 0.0, block_hashes=hashes)


def test_psm_queue_groups_shared_prefixes() -> None:
    q = PsmOfflineQueue(PsmQueue(PsmParams(block_size=1, fairness="none")))
    for rid, p in [("a1", 1), ("b1", 2), ("a2", 1), ("b2", 2), ("a3", 1)]:
        q.push(_psm_inc(rid, p))
    order: list[str] = []
    while len(q):
        rid = q.head(1, 0.0)[0]
        q.take(rid, 0.0)
        order.append(rid)
    groups = [r[0] for r in order]
    assert groups in (["a", "a", "a", "b", "b"], ["b", "b", "a", "a", "a"])


def test_fifo_queue_reinserts_at_old_place() -> None:
    q = FifoQueue()
    for rid in "abc":
        q.push(_inc(rid, OFF))
    q.take("a", 0.0)
    q.push(_inc("a", OFF))
    assert q.head(3, 0.0) == ["a", "b", "c"]


def _idle_disp(budget: float, idle: float = 0.060) -> Dispatcher:
    # Online budget ``budget``; ``idle`` while no online request is held or in flight.
    return _disp("budget", budget=budget, cfg=DispatcherConfig(idle_budget_s=idle))


def test_offline_fills_the_idle_budget_while_no_online_request_is_in_flight() -> None:
    d = _idle_disp(0.010, idle=0.030)
    for i in range(8):
        d.arrive(_inc(f"off{i}", OFF, prompt=500), float(i))
    # each offline request: a 500-token chunk (10 ms) + one decode; the 10 ms
    # budget admits none, the 30 ms idle budget admits (30 - 5) // 10.05 = 2
    assert [s.request_id for s in d.decide(8.0).submit] == ["off0", "off1"]
    assert not d.decide(8.0)
    # with an online request held the online budget applies again: nothing more
    d.arrive(_inc("on1", ON, prompt=100), 9.0)
    dec = d.decide(9.0)
    assert [s.request_id for s in dec.submit] == ["on1"]
    assert all(a.reason == "preempt" for a in dec.abort)


def test_online_arrival_preempts_offline_until_the_next_step_fits_the_budget() -> None:
    model = _model()
    d = _idle_disp(0.00712)
    for i in range(4):
        d.arrive(_inc(f"off{i}", OFF, prompt=500), float(i))
    assert len(d.decide(4.0).submit) == 4
    d.progress("off0", 5, 5.0)  # off0, off1 decode; off2, off3 still in prefill
    d.progress("off1", 5, 5.0)
    d.arrive(_inc("on1", ON, prompt=100), 6.0)
    dec = d.decide(6.0)
    assert [s.request_id for s in dec.submit] == ["on1"]
    # latest arrival first, until the predicted peak fits: both prefills go,
    # then off1's decode; off0's decode fits and stays
    assert dec.abort == tuple(Abort(f"off{i}", "preempt") for i in (3, 2, 1))
    kept = [BatchItem(Phase.PREFILL, 100, 0), BatchItem(Phase.DECODE, 1, 100)]
    kept.append(BatchItem(Phase.DECODE, 1, 505))
    assert model.predict(kept) <= 0.00712 < model.predict([*kept, BatchItem(Phase.DECODE, 1, 505)])
    for a in dec.abort:
        d.aborted(a.request_id, 6.0)
    # nothing produced is lost: off1 keeps its 5 tokens and resumes from them
    assert d.request_state("off1") == (False, 5, 1)
    assert d.request_state("off0") == (True, 5, 0)
    d.progress("on1", 1, 7.0)
    d.finished("on1", 50, 8.0)
    resumed = d.decide(8.0).submit
    assert Submit("off1", 100, 5) in resumed
    assert {s.request_id for s in resumed} == {"off1", "off2", "off3"}


def test_online_prefill_over_the_budget_preempts_every_offline_request() -> None:
    def run(params: dict[str, object] | None) -> set[str]:
        d = _disp(
            "budget", budget=0.00712, cfg=DispatcherConfig(idle_budget_s=0.060), params=params
        )
        for i in range(3):
            d.arrive(_inc(f"off{i}", OFF, prompt=500), float(i))
        assert len(d.decide(3.0).submit) == 3
        for i in range(3):
            d.progress(f"off{i}", 2, 4.0)
        # a 1000-token online prefill alone predicts 25 ms, over the 7.12 ms budget
        d.arrive(_inc("on1", ON, prompt=1000), 5.0)
        dec = d.decide(5.0)
        assert [s.request_id for s in dec.submit] == ["on1"]
        return {a.request_id for a in dec.abort}

    assert run(None) == {"off0", "off1", "off2"}
    # keep_offline_margin: the three decodes add 0.15 ms, within what the budget
    # leaves them beside the online decode (7.12 - 5.05 ms): they stay
    assert run({"keep_offline_margin": True}) == set()


def _context_model() -> LinearLatencyModel:
    # 5 ms + 0.02 ms per prefill token + 0.05 ms per decode + attention: 1e-8 s per
    # prefill token per context token (a chunk late in a long prompt costs more)
    coef = (0.005, 2e-5, 0.0, 0.0, 5e-5, 0.0, 0.0, 1e-8)
    return LinearLatencyModel(FeatureSet.CONTEXT_CHUNK, coef)


def test_steady_online_arrivals_do_not_churn_long_offline_prompts() -> None:
    # vLLM chunks prompts at 256 tokens; offline prompts are 3,000 tokens. The
    # first chunk (context 0) fits the budget beside an online decode, the last
    # (context 2,744) does not. Admission must price what the next plan keeps,
    # else every plan admits what the one before aborted (the demo's 86k aborts).
    model = _context_model()
    lim = EngineLimits(max_num_seqs=64, long_prefill_token_threshold=256)
    planner = build_planner("budget", latency_model=model, mode=PlannerMode.ADMISSION)
    d = Dispatcher(DispatcherConfig(), planner, limits=lim, kv_blocks=100_000, budget_s=0.0125)
    for i in range(8):
        d.arrive(_inc(f"off{i}", OFF, prompt=3000), 0.0)
    t = 1.0
    for k in range(20):  # online arrivals, each decoding while the next arrives
        d.arrive(_inc(f"on{k}", ON, prompt=64), t)
        for _ in range(64):  # the sidecar's loop: decide until quiet
            dec = d.decide(t)
            if not dec:
                break
            for a in dec.abort:
                d.aborted(a.request_id, t)
            for sub in dec.submit:
                if sub.request_id.startswith("on"):
                    d.progress(sub.request_id, 1, t)
        t += 1.0
        if k:
            d.finished(f"on{k - 1}", 5, t)
    st = d.stats()
    assert st.preemptions <= 8, st


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10_000)), max_size=80))
def test_incremental_in_flight_sums_match_a_full_rebuild(ops: list[tuple[int, int]]) -> None:
    # The dispatcher keeps its in-flight view as running sums; planning from them
    # must equal planning from a snapshot of every request rebuilt from scratch.
    model = _context_model()
    lim = EngineLimits(max_num_seqs=12, long_prefill_token_threshold=64)
    planner = build_planner("budget", latency_model=model, mode=PlannerMode.ADMISSION)
    d = Dispatcher(DispatcherConfig(), planner, limits=lim, kv_blocks=400, budget_s=0.02)
    n = 0
    t = 0.0
    for op, x in ops:
        t += 0.01
        inflight = [r for r in d._inflight.values() if not r.aborting]
        if op == 0:
            cls = ON if x % 3 == 0 else OFF
            d.arrive(_inc(f"r{n}", cls, prompt=1 + x % 400, out=20), t)
            n += 1
        elif op == 1:
            dec = d.decide(t)
            for a in dec.abort:
                d.aborted(a.request_id, t)
        elif op == 2 and inflight:
            rec = inflight[x % len(inflight)]
            d.progress(rec.request_id, rec.generated - rec.resume_from + 1 + x % 3, t)
        elif op == 3 and inflight:
            rec = inflight[x % len(inflight)]
            d.finished(rec.request_id, rec.generated - rec.resume_from, t)
        elif op == 4 and inflight:
            d.failed(inflight[x % len(inflight)].request_id, t)
        fast = d._in_flight_sums()
        full = InFlight.of(tuple(d._running_view()))
        assert (fast.count, fast.online_n, fast.online_ctx, fast.offline_n, fast.offline_ctx) == (
            full.count,
            full.online_n,
            full.online_ctx,
            full.offline_n,
            full.offline_ctx,
        )
        assert list(fast.prefilling) == list(full.prefilling)
        assert sorted(fast.offline(), key=str) == sorted(full.offline(), key=str)
        on_q = [d._queued_view(d._recs[r]) for r in d.online_queue.head(8, t)]
        off_q = [d._queued_view(d._recs[r]) for r in d.offline_queue.head(8, t)]
        kw = {"free_kv_blocks": d.est_free_kv_blocks, "limits": lim, "budget_s": 0.01}
        a = planner.plan_in_flight(fast, online_queue=on_q, offline_queue=off_q, **kw)
        b = planner.plan_in_flight(full, online_queue=on_q, offline_queue=off_q, **kw)
        assert a == b


def test_cached_prefill_views_follow_a_replaced_limit_or_priority() -> None:
    # A prefilling request's planner view is built once at submission; a chunk
    # limit or priority replaced later must still show in the next plan's input.
    lim = EngineLimits(max_num_seqs=8, long_prefill_token_threshold=64)
    planner = build_planner("budget", latency_model=_context_model(), mode=PlannerMode.ADMISSION)
    d = Dispatcher(DispatcherConfig(), planner, limits=lim, kv_blocks=10_000, budget_s=1.0)
    for k, cls in enumerate((ON, OFF, ON)):
        d.arrive(_inc(f"r{k}", cls, prompt=300 + 100 * k), 0.0)
    assert len(d.decide(0.0).submit) == 3
    before = list(d._in_flight_sums().prefilling)
    assert before == list(InFlight.of(tuple(d._running_view())).prefilling)
    d.limits = EngineLimits(max_num_seqs=8, long_prefill_token_threshold=128)
    d.config = DispatcherConfig(offline_priority=50)
    after = list(d._in_flight_sums().prefilling)
    assert after == list(InFlight.of(tuple(d._running_view())).prefilling)
    assert [r.computed_tokens for r in after] == [r.computed_tokens - 64 for r in before]
    assert {r.priority for r in after} == {0, 50}


def test_the_online_allowance_is_what_a_decision_would_submit() -> None:
    d = _disp("naive", seqs=4)
    d.arrive(_inc("off0", OFF), 0.0)
    d.arrive(_inc("on0", ON), 0.0)
    d.decide(0.0)
    n, blocks = d.online_allowance()
    assert n == 3  # four slots, one online in flight; offline in flight takes none
    assert blocks == d.est_free_kv_blocks > 0
    for i in range(n + 1):
        d.arrive(_inc(f"on{i + 1}", ON, t=1.0), 1.0)
    subs = [s.request_id for s in d.decide(1.0).submit]
    assert subs == ["on1", "on2", "on3"]  # exactly the allowance; the fourth is held
    assert d.online_allowance() == (0, 0)  # held online: no newcomer may overtake it


def test_the_online_allowance_is_bounded_by_the_kv_estimate() -> None:
    d = _disp("naive", seqs=64, kv=20)
    d.arrive(_inc("on0", ON, prompt=160), 0.0)  # ten 16-token blocks
    d.decide(0.0)
    assert d.online_allowance() == (63, 10)
    d.arrive(_inc("on1", ON, prompt=160), 0.0)
    d.decide(0.0)
    assert d.online_allowance() == (0, 0)  # no KV left


@pytest.mark.parametrize("submitted", [False, True])
def test_an_online_arrival_sent_under_the_allowance_is_as_if_decided(submitted: bool) -> None:
    # The preemption scenario above, with on1 either decided or sent on arrival: the
    # state after it, and the offline work its arrival preempts, are the same.
    d = _idle_disp(0.00712)
    for i in range(4):
        d.arrive(_inc(f"off{i}", OFF, prompt=500), float(i))
    assert len(d.decide(4.0).submit) == 4
    d.progress("off0", 5, 5.0)
    d.progress("off1", 5, 5.0)
    assert d.online_allowance()[0] >= 1
    if submitted:
        dec = d.arrive_submitted([_inc("on1", ON, prompt=100)], 6.0)
    else:
        d.arrive(_inc("on1", ON, prompt=100), 6.0)
        dec = d.decide(6.0)
    assert dec.submit == (Submit("on1", 0, 0),)
    assert dec.abort == tuple(Abort(f"off{i}", "preempt") for i in (3, 2, 1))
    st = d.stats()
    assert (st.online_inflight, st.online_queued, st.submitted) == (1, 0, 5)
    assert d.request_state("on1") == (True, 0, 0)
    d.progress("on1", 1, 7.0)
    d.finished("on1", 50, 8.0)
    assert d.stats().finished == 1


def test_an_arrival_sent_on_a_stale_allowance_is_taken_in_flight_all_the_same() -> None:
    d = _disp("online-only", seqs=1)
    d.arrive(_inc("on0", ON), 0.0)
    d.decide(0.0)
    assert d.online_allowance() == (0, 0)
    dec = d.arrive_submitted([_inc("on1", ON)], 1.0)  # the engine has it: it is in flight
    assert dec.submit == (Submit("on1", 0, 0),)
    st = d.stats()
    assert (st.online_inflight, st.online_queued) == (2, 0)
    d.finished("on1", 50, 2.0)
    d.finished("on0", 50, 2.0)
    assert d.stats().online_inflight == 0


def test_only_online_requests_arrive_submitted() -> None:
    d = _disp()
    with pytest.raises(DispatcherError, match="only online"):
        d.arrive_submitted([_inc("off1", OFF)], 0.0)


def test_a_burst_sent_on_arrival_is_decided_in_lookahead_windows_not_one_by_one() -> None:
    d = _disp("naive", seqs=256)
    burst = [_inc(f"on{i}", ON, t=1.0) for i in range(70)]
    assert d.online_allowance()[0] >= len(burst)
    dec = d.arrive_submitted(burst, 1.0)
    assert [s.request_id for s in dec.submit] == [r.request_id for r in burst]
    st = d.stats()
    assert (st.online_inflight, st.online_queued, st.submitted) == (70, 0, 70)
    assert st.plans == 3  # windows of 32: 32 + 32 + 6


def test_online_passthrough_submits_every_online_request_past_kv_and_slots() -> None:
    # Engine mode: the engine's own queue holds online requests; the dispatcher gates none.
    cfg = DispatcherConfig(online_passthrough=True, max_online_inflight=1)
    d = _disp(seqs=2, kv=20, cfg=cfg)  # 20 blocks: a 100-token prompt takes 7
    for i in range(5):
        d.arrive(_inc(f"on{i}", ON, t=float(i)), float(i))
    d.arrive(_inc("off1", OFF), 0.0)
    dec = d.decide(5.0)
    assert [s.request_id for s in dec.submit if s.request_id.startswith("on")] == [
        f"on{i}" for i in range(5)
    ]
    assert all(s.priority == 0 for s in dec.submit if s.request_id.startswith("on"))
    st = d.stats()
    assert (st.online_inflight, st.online_queued) == (5, 0)
    # Without it, the same dispatcher holds them back (the slot cap of 1).
    held = _disp(seqs=2, kv=20, cfg=DispatcherConfig(max_online_inflight=1))
    for i in range(5):
        held.arrive(_inc(f"on{i}", ON, t=float(i)), float(i))
    assert len([s for s in held.decide(5.0).submit if s.request_id.startswith("on")]) == 1
