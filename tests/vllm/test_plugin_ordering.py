"""Online ordering inside vLLM's real v1 scheduler, under the plugin (engine mode).

``PluginEngine`` builds vLLM's scheduler with ``SlipstreamScheduler`` as ``--scheduler-cls``
does and applies a control document as the sidecar writes it. The checks read what vLLM's
``schedule()`` did (who ran, who was preempted), never the plugin's plan.
"""

from __future__ import annotations

from typing import Any

import pytest

from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.enginecontrol import EngineControl

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

OFFLINE_PRIORITY = 1 << 20


def _engine(cfg: EngineConfig, ordering: str, params: dict[str, Any], *, oracle: bool) -> Any:
    from slipstream_testbed.vllm.simplugin import PluginEngine

    control = EngineControl(
        generation=1, policy="naive", ordering=ordering, ordering_params=params
    )
    return PluginEngine(cfg, control=control, offline_priority=OFFLINE_PRIORITY,
                        oracle_lengths=oracle)


def _drain(eng: Any, max_steps: int = 20_000) -> list[Any]:
    steps = []
    while eng.has_work():
        steps.append(eng.step())
        assert len(steps) < max_steps
    return steps


@pytest.mark.parametrize(
    ("ordering", "params", "expected"),
    [
        ("fcfs", {}, [300, 50, 200, 10, 100, 5]),
        ("sjf", {"cost": "output"}, [300, 5, 10, 50, 100, 200]),
    ],
)
def test_waiting_online_requests_run_in_the_orderings_order(
    ordering: str, params: dict[str, Any], expected: list[int]
) -> None:
    # One slot: each request runs alone, so the order of first tokens is the queue's order.
    # The first arrives alone and runs at once; the other five wait behind it.
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, num_gpu_blocks=400,
                       noise_cv=0.0)
    eng = _engine(cfg, ordering, params, oracle=True)
    outs = [300, 50, 200, 10, 100, 5]
    eng.add_tokens("r0-300", eng.synth.prompt("p0", 32, ()), 300, arrival_s=0.0)
    eng.step()
    for i, out in enumerate(outs[1:], start=1):
        eng.add_tokens(f"r{i}-{out}", eng.synth.prompt(f"p{i}", 32, ()), out, arrival_s=float(i))
    order: list[int] = [300]
    while eng.has_work():
        eng.step()
        for r in eng.scheduler.running:
            n = int(r.request_id.split("-")[1])
            if n not in order:
                order.append(n)
    assert order == expected
    assert eng.stats().generation_tokens == sum(outs)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"cost": "output"}, [300, 5, 10, 50, 100, 200]),
        # r1 (200 tokens) is past its deadline when r0 finishes: it runs first, and the rest
        # are all past theirs when it finishes: arrival order.
        ({"cost": "output", "max_wait_s": 2.2}, [300, 200, 50, 10, 100, 5]),
    ],
)
def test_past_the_tail_guards_deadline_a_request_runs_in_deadline_order(
    params: dict[str, Any], expected: list[int]
) -> None:
    # One slot, as above; the virtual clock moves 10 ms a step, so r0 holds the slot for
    # about 3 s while r1..r5 arrive between 0.5 and 2.5 s.
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, num_gpu_blocks=400,
                       noise_cv=0.0)
    eng = _engine(cfg, "sjf", params, oracle=True)
    outs = [300, 200, 50, 10, 100, 5]
    eng.add_tokens("r0-300", eng.synth.prompt("p0", 32, ()), 300, arrival_s=0.0)
    now = 0.0
    eng.step(now)
    for i, out in enumerate(outs[1:], start=1):
        eng.add_tokens(f"r{i}-{out}", eng.synth.prompt(f"p{i}", 32, ()), out,
                       arrival_s=0.5 * i)
    order: list[int] = [300]
    while eng.has_work():
        now += 0.01
        eng.step(now)
        for r in eng.scheduler.running:
            n = int(r.request_id.split("-")[1])
            if n not in order:
                order.append(n)
    assert order == expected
    assert eng.stats().generation_tokens == sum(outs)


def _fill_then_arrive(ordering: str, params: dict[str, Any]) -> tuple[Any, int]:
    """Three long requests fill the KV cache; then a short one of the same template arrives.
    Returns the engine and the steps until the short one's first token."""
    cfg = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, num_gpu_blocks=48,
                       noise_cv=0.0)
    eng = _engine(cfg, ordering, params, oracle=False)
    short = eng.synth.prompt("template-short", 64, ())
    long = eng.synth.prompt("template-long", 64, ())
    for i in range(10):  # the plugin's predictor learns the two templates' lengths
        eng.add_tokens(f"hs{i}", short, 4)
        eng.add_tokens(f"hl{i}", long, 200)
    _drain(eng)
    for i in range(3):
        eng.add_tokens(f"long{i}", long, 400)
    pool = eng.scheduler.kv_cache_manager.block_pool
    while pool.get_num_free_blocks() > 1:
        eng.step()
    # A new first block: no prefix-cache hit, while the embedding stays the template's.
    eng.add_tokens("short", eng.synth.prompt("fresh", 8, ()) + short[8:], 4)
    steps = 0
    while (r := eng.scheduler.requests.get("short")) is not None and r.num_output_tokens == 0:
        eng.step()
        steps += 1
        assert steps < 5_000
    return eng, steps


def test_a_preemptive_ordering_displaces_the_running_request_it_outranks_for_kv() -> None:
    fcfs, fcfs_steps = _fill_then_arrive("fcfs", {})
    gittins, gittins_steps = _fill_then_arrive("gittins", {"cost": "memory"})
    assert fcfs.scheduler.online_displacements == 0
    assert gittins.scheduler.online_displacements >= 1
    assert gittins.scheduler.online_displaced_tokens > 0
    report = gittins.scheduler.report()  # what the sidecar's metrics carry
    assert report.online_displacements == gittins.scheduler.online_displacements
    assert report.online_displaced_tokens == gittins.scheduler.online_displaced_tokens
    assert report.online_preemptions >= report.online_displacements
    assert gittins_steps < fcfs_steps
    for eng in (fcfs, gittins):  # the displaced request resumes and finishes in full
        _drain(eng)
        assert eng.stats().generation_tokens == 10 * 4 + 10 * 200 + 3 * 400 + 4


def test_a_non_preemptive_ordering_never_displaces() -> None:
    eng, _ = _fill_then_arrive("gittins", {"cost": "memory", "max_preemptions": 0})
    assert eng.scheduler.online_displacements == 0


@pytest.mark.parametrize(("ordering", "victim"), [("fcfs", "late-short"), ("sjf", "early-long")])
def test_when_kv_runs_out_vllm_preempts_the_orderings_last(ordering: str, victim: str) -> None:
    # Two requests outgrow a 40-block cache. vLLM's own rule preempts the later arrival;
    # under the plugin the walk preempts the request the ordering ranks last.
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, num_gpu_blocks=40,
                       noise_cv=0.0)
    params = {} if ordering == "fcfs" else {"cost": "output"}
    eng = _engine(cfg, ordering, params, oracle=True)
    eng.add_tokens("early-long", eng.synth.prompt("a", 64, ()), 400, arrival_s=0.0)
    eng.add_tokens("late-short", eng.synth.prompt("b", 64, ()), 300, arrival_s=1.0)
    first = next(res.preempted for res in _drain(eng) if res.preempted)
    assert first == (victim,)
    assert eng.stats().generation_tokens == 700


@pytest.mark.parametrize(
    ("global_lengths", "expected"),
    [(False, ["s1", "s2", "l1", "l2"]), (True, ["l1", "s1", "l2", "s2"])],
)
def test_the_plugins_predictor_tells_templates_apart_and_the_global_one_does_not(
    global_lengths: bool, expected: list[str]
) -> None:
    from slipstream_testbed.vllm.simplugin import PluginEngine

    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, num_gpu_blocks=400,
                       noise_cv=0.0)
    control = EngineControl(generation=1, policy="naive", ordering="sjf",
                            ordering_params={"cost": "output"})
    eng = PluginEngine(cfg, control=control, offline_priority=OFFLINE_PRIORITY,
                       global_lengths=global_lengths)
    short = eng.synth.prompt("template-short", 64, ())
    long = eng.synth.prompt("template-long", 64, ())
    for i in range(10):
        eng.add_tokens(f"hs{i}", short, 4)
        eng.add_tokens(f"hl{i}", long, 100)
    _drain(eng)
    eng.add_tokens("blocker", long, 50, arrival_s=100.0)
    eng.step()
    for i, (rid, ids) in enumerate([("l1", long), ("s1", short), ("l2", long), ("s2", short)]):
        # A new first block each: no prefix-cache hit, the template's embedding.
        tail = eng.synth.prompt(rid, 8, ()) + ids[8:]
        eng.add_tokens(rid, tail, 4 if rid.startswith("s") else 100, arrival_s=101.0 + i)
    order: list[str] = []
    while eng.has_work():
        eng.step()
        for r in eng.scheduler.running:
            if r.request_id != "blocker" and r.request_id not in order:
                order.append(r.request_id)
    assert order == expected
