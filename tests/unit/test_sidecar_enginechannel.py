"""The sidecar's end of the engine channel on real files: token, control document, report."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from slipstream_scheduler.enginecontrol import (
    OFFLINE_TOKEN_ARG,
    ClassLatency,
    EngineReport,
    decode_control,
)
from slipstream_scheduler.ordering import make_ordering
from slipstream_sidecar.enginechannel import (
    EngineChannel,
    EngineReportCollector,
    control_document,
    engine_ordering_params,
)


def test_token_is_created_once_private_and_reused(tmp_path: Path) -> None:
    a = EngineChannel(tmp_path / "chan")
    path = tmp_path / "chan" / "offline.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(a.token) == 64 and int(a.token, 16) >= 0
    assert path.read_text().strip() == a.token
    b = EngineChannel(tmp_path / "chan")
    assert b.token == a.token
    assert b.offline_xargs() == {OFFLINE_TOKEN_ARG: a.token}


def test_an_empty_token_file_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "offline.token").write_text("")
    ch = EngineChannel(tmp_path)
    assert len(ch.token) == 64
    assert (tmp_path / "offline.token").read_text().strip() == ch.token
    assert stat.S_IMODE((tmp_path / "offline.token").stat().st_mode) == 0o600


def test_write_replaces_the_document_and_leaves_no_temporary(tmp_path: Path) -> None:
    ch = EngineChannel(tmp_path)
    ch.write(control_document(generation=1, budget_s=None, idle_budget_s=None,
                              ordering="fcfs", latency_model=None, slo={}))
    first = os.stat(tmp_path / "control.json").st_ino
    ch.write(control_document(generation=2, budget_s=0.05, idle_budget_s=float("inf"),
                              ordering="gittins", latency_model={"kind": "x"},
                              slo={"ttft_p99_s": 0.5}))
    doc = decode_control((tmp_path / "control.json").read_text())
    assert (doc.generation, doc.policy, doc.budget_s, doc.ordering) == (2, "budget", 0.05,
                                                                        "gittins")
    assert doc.idle_budget_s == float("inf") and doc.slo == {"ttft_p99_s": 0.5}
    assert os.stat(tmp_path / "control.json").st_ino != first  # replaced, not rewritten
    assert sorted(p.name for p in tmp_path.iterdir()) == ["control.json", "offline.token"]
    assert ch.read_control() == doc


def test_policy_is_naive_without_a_model_or_a_budget() -> None:
    def policy(budget_s: float | None, model: dict[str, float] | None) -> str:
        return control_document(generation=0, budget_s=budget_s, idle_budget_s=None,
                                ordering="fcfs", latency_model=model, slo={}).policy

    assert policy(0.05, None) == "naive"
    assert policy(None, {}) == "naive"
    assert policy(0.05, {}) == "budget"


def test_report_absent_garbled_stale_and_fresh(tmp_path: Path) -> None:
    now = [1000.0]
    ch = EngineChannel(tmp_path, stale_after_s=10.0, clock=lambda: now[0])
    assert ch.report() is None
    (tmp_path / "status.json").write_text("{not json")
    assert ch.report() is None
    (tmp_path / "status.json").write_text(EngineReport(written_at=995.0, steps=7).model_dump_json())
    rep = ch.report()
    assert rep is not None and rep.steps == 7
    now[0] = 1006.0
    assert ch.report() is None
    old = ch.report(fresh_only=False)
    assert old is not None and old.steps == 7


def test_metrics_carry_the_report(tmp_path: Path) -> None:
    now = [1000.0]
    ch = EngineChannel(tmp_path, clock=lambda: now[0])
    reg = CollectorRegistry()
    reg.register(EngineReportCollector(ch))
    text = generate_latest(reg).decode()
    assert "slipstream_engine_up 0.0" in text and "slipstream_engine_steps" not in text
    rep = EngineReport(
        generation=4, policy="budget", ordering="gittins", budget_s=0.04, written_at=999.0,
        vllm_version="0.32.0", online_waiting=2, offline_waiting=30, online_running=3,
        offline_running=5, steps=100, predicted_step_s=0.031, measured_step_s=0.033,
        offline_preemptions=6, online_preemptions=3, online_displacements=2,
        online_displaced_tokens=900, forged_offline_tags=2,
        faults={"planner": 5, "psm": 1}, fault_steps=5, failsafe="5 faults within 60 s",
        online=ClassLatency(ttft_mean_s=0.1, ttft_p99_s=0.3, tbt_mean_s=0.02, tbt_p99_s=0.04),
        offline=ClassLatency(tbt_mean_s=0.05),
    )
    (tmp_path / "status.json").write_text(json.dumps(rep.model_dump()))
    text = generate_latest(reg).decode()
    for line in (
        "slipstream_engine_up 1.0",
        "slipstream_engine_report_age_seconds 1.0",
        "slipstream_engine_generation 4.0",
        "slipstream_engine_budget_seconds 0.04",
        'slipstream_engine_requests{class="offline",state="waiting"} 30.0',
        'slipstream_engine_requests{class="online",state="running"} 3.0',
        'slipstream_engine_step_seconds{source="predicted"} 0.031',
        'slipstream_engine_step_seconds{source="measured"} 0.033',
        'slipstream_engine_preemptions{class="offline"} 6.0',
        'slipstream_engine_preemptions{class="online"} 3.0',
        "slipstream_engine_online_displacements 2.0",
        "slipstream_engine_online_displaced_tokens 900.0",
        'slipstream_engine_ttft_seconds{class="online",stat="p99"} 0.3',
        'slipstream_engine_tbt_seconds{class="offline",stat="mean"} 0.05',
        "slipstream_engine_forged_offline_tags 2.0",
        'slipstream_engine_faults{part="planner"} 5.0',
        'slipstream_engine_faults{part="psm"} 1.0',
        "slipstream_engine_fault_steps 5.0",
        "slipstream_engine_failsafe 1.0",
        'slipstream_engine_info{ordering="gittins",policy="budget",vllm_version="0.32.0"} 1.0',
    ):
        assert line in text, line
    assert 'slipstream_engine_ttft_seconds{class="offline"' not in text
    now[0] = 1100.0  # an idle engine writes nothing: the report ages, its figures stay
    text = generate_latest(reg).decode()
    assert "slipstream_engine_up 0.0" in text
    assert "slipstream_engine_report_age_seconds 101.0" in text
    assert "slipstream_engine_steps 100.0" in text


def test_the_plugin_builds_its_planner_from_the_sidecars_document(tmp_path: Path) -> None:
    """What the plugin does with control.json (``SlipstreamScheduler.apply``), minus vLLM."""
    from slipstream_scheduler.admission import build_planner
    from slipstream_scheduler.latency import FEATURE_NAMES, FeatureSet, LinearLatencyModel
    from slipstream_scheduler.planner import PlannerMode

    model = LinearLatencyModel(
        FeatureSet.CONTEXT,
        tuple({"const": 0.004, "s_p": 2e-5, "n_d": 1e-4}.get(n, 0.0) for n in FEATURE_NAMES),
    )
    ch = EngineChannel(tmp_path)
    ch.write(control_document(generation=7, budget_s=0.05, idle_budget_s=float("inf"),
                              ordering="gittins", latency_model=model.to_dict(),
                              slo={"tbt_p99_s": 0.1}))
    doc = decode_control((tmp_path / "control.json").read_text())
    assert doc.latency_model is not None
    back = LinearLatencyModel.from_dict(doc.latency_model)
    assert back == model
    planner = build_planner(doc.policy, doc.policy_params, latency_model=back,
                            mode=PlannerMode.ITERATION)
    assert planner is not None and doc.policy == "budget"
    ordering = make_ordering(doc.ordering, doc.ordering_params or None)
    # Inside vLLM KV bounds the batch: the size-based orderings rank by SageSched's memory
    # cost there (the core's preemptive default, the output cost, suits a slot cap).
    assert doc.ordering_params == {"cost": "memory"}
    assert ordering.params.cost == "memory" and ordering.preemptive  # type: ignore[attr-defined]


@pytest.mark.parametrize(("name", "params"), [("fcfs", {}), ("sjf", {"cost": "memory"}),
                                              ("trail", {"cost": "memory"}),
                                              ("gittins", {"cost": "memory"})])
def test_engine_mode_orderings_rank_by_the_memory_cost(name: str, params: dict[str, str]) -> None:
    assert engine_ordering_params(name) == params
    assert make_ordering(name, params or None) is not None
