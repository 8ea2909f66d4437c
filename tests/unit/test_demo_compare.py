"""The demo's comparison: the shaped trace, per-run verdicts, the side-by-side rows, the plot."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from slipstream_cli import demo
from slipstream_cli.demo_compare import (
    RunResult,
    Slo,
    p99,
    plot_timelines,
    run_result,
    shape,
    side_by_side,
    timeline,
)
from slipstream_cli.loadgen import RequestResult, TraceRequest

pytestmark = pytest.mark.unit

SLO = Slo(ttft_p99_s=1.0, tbt_p99_s=0.05)


def result(i: int, at: float, ttft: float, gaps: tuple[float, ...], ok: bool = True
           ) -> RequestResult:
    return RequestResult(index=i, target="http://127.0.0.1:1", scheduled_s=at, sent_s=at,
                         ok=ok, status=200 if ok else 500, ttft_s=ttft if ok else None,
                         gaps_s=gaps if ok else (), output_tokens=len(gaps) + 1)


def test_shape_keeps_peaks_whole_and_thins_valleys() -> None:
    trace = [TraceRequest(i * 0.5, 10, 10) for i in range(80)]  # 40 s, 2 per second
    shaped = shape(trace, period_s=20.0, valley_keep=0.25)
    peak = [r for r in shaped if r.arrival_s % 20 < 10]
    valley = [r for r in shaped if r.arrival_s % 20 >= 10]
    assert len(peak) == 40 and len(valley) == 10
    assert shape(trace, period_s=20.0, valley_keep=0.25) == shaped  # deterministic
    with pytest.raises(ValueError):
        shape(trace, period_s=20.0, valley_keep=0.0)


def test_p99_nearest_rank() -> None:
    assert p99([]) is None
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([3.0]) == 3.0


def test_run_verdicts_per_metric() -> None:
    fast = [result(i, i, 0.2, (0.02,) * 10) for i in range(100)]
    good = run_result("slipstream", fast, SLO, offline_tokens_per_s=50.0,
                      offline_requests_done=10, preemptions=0.0)
    assert good.met(SLO) == {"ttft_p99": True, "tbt_p99": True}
    slow_gaps = [result(i, i, 0.2, (0.02,) * 9 + (0.2,)) for i in range(100)]
    bad = run_result("naive", slow_gaps, SLO, offline_tokens_per_s=90.0,
                     offline_requests_done=20, preemptions=None)
    assert bad.met(SLO) == {"ttft_p99": True, "tbt_p99": False}
    assert bad.tbt_attainment == pytest.approx(0.9)
    rows = side_by_side({"naive": bad, "slipstream": good}, SLO)
    by_label = {row[0]: row[1:] for row in rows}
    assert by_label["TBT p99 (SLO 50 ms)"] == ("200 ms BROKEN", "20 ms met")
    assert by_label["offline tokens/s"] == ("90.0", "50.0")
    assert by_label["offline preemptions"] == ("-", "0")
    nothing = run_result("naive", [result(0, 0, 0, (), ok=False)], SLO,
                         offline_tokens_per_s=None, offline_requests_done=0, preemptions=None)
    assert nothing.met(SLO) == {"ttft_p99": False, "tbt_p99": False}


def test_timeline_buckets_and_plot(tmp_path: Path) -> None:
    results = [result(i, i * 0.5, 0.1 * (i % 3), (0.01, 0.03)) for i in range(40)]
    tl = timeline(results, duration_s=20.0, bucket_s=5.0, offline=[(0.0, 10.0), (5.0, 20.0)])
    assert tl.t_s == (2.5, 7.5, 12.5, 17.5)
    assert tl.online_rps == (2.0, 2.0, 2.0, 2.0)
    assert tl.tbt_p99_s == (0.03,) * 4
    empty = timeline([], duration_s=10.0, bucket_s=5.0)
    assert empty.ttft_p99_s == (None, None)
    path = tmp_path / "timeline.png"
    plot_timelines(path, {"naive": tl, "slipstream": empty}, SLO)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_slo_spec_and_the_runs_manifests(tmp_path: Path) -> None:
    assert SLO.spec() == {"ttft": {"p99": "1000ms"}, "tbt": {"p99": "50ms"}}
    import yaml

    for run in ("naive", "slipstream"):
        path = demo.manifests(tmp_path, run, tmp_path / "in.jsonl", 64, SLO)
        service, job = yaml.safe_load_all(path.read_text())
        assert service["spec"]["slo"] == SLO.spec()
        assert service["spec"]["model"] == job["spec"]["model"] == demo.served_model(run)
        assert job["metadata"]["name"] == f"backlog-{run}"
    assert demo.served_model("naive") != demo.served_model("slipstream")
    assert demo.served_model("naive").startswith(demo.served_model("slipstream"))


def test_the_naive_run_turns_the_latency_model_off_and_real_vllm_learns_it(
        tmp_path: Path) -> None:
    import yaml

    for engine in ("model", "vllm"):
        runs = {}
        for run in ("naive", "slipstream"):
            path = demo.manifests(tmp_path, run, tmp_path / "in.jsonl", 64, SLO, mode="engine",
                                  engine=engine)
            service, _ = yaml.safe_load_all(path.read_text())
            runs[run] = service["spec"]
        assert runs["naive"]["scheduling"]["latencyModel"] == "none"
        assert "latencyModel" not in runs["slipstream"]["scheduling"]  # auto
        assert runs["slipstream"]["scheduling"]["enforcement"] == "engine"
    # Under real vLLM the Slipstream run serves a model no shipped profile describes.
    assert demo.served_model("slipstream", "vllm") == demo.VLLM_MODEL
    assert demo.served_model("slipstream", "model") == demo.SLIPSTREAM_MODEL
    assert demo.describe_model({"source": "learned", "revision": 2, "steps": 812,
                                "heldoutMAPE": 0.0813}) == (
        "learned r2: 812 steps, held-out 8.1 %")
    assert demo.describe_model({"source": "profiled", "revision": 1, "steps": 240,
                                "heldoutMAPE": 0.125}) == (
        "profiled r1: 240 steps, held-out 12.5 %")
    assert demo.describe_model({"source": "learned", "revision": 2, "steps": 812,
                                "heldoutMAPE": 0.0813, "held": "no ready pod reports"}) == (
        "learned r2: 812 steps, held-out 8.1 %, held")
    assert demo.describe_model({}) == "none"


def test_sidecar_mode_on_real_vllm_profiles_the_engine_at_start(tmp_path: Path) -> None:
    """With no plugin to learn from, the Slipstream run's sidecars profile their vLLM before
    they report ready; the naive run and the engine model never do, and the pods' start-up
    wait covers the profile."""
    import yaml

    def scheduling(run: str, engine: str, mode: str) -> dict[str, str]:
        path = demo.manifests(tmp_path, run, tmp_path / "in.jsonl", 64, SLO, mode=mode,
                              engine=engine)
        service, _ = yaml.safe_load_all(path.read_text())
        return dict(service["spec"]["scheduling"])

    assert scheduling("slipstream", "vllm", "sidecar")["profileAtStart"] == (
        f"{demo.PROFILE_AT_START_S:g}s")
    for run, engine, mode in (("naive", "vllm", "sidecar"), ("slipstream", "vllm", "engine"),
                              ("slipstream", "model", "sidecar")):
        assert "profileAtStart" not in scheduling(run, engine, mode), (run, engine, mode)
    assert demo.startup_s("slipstream", "vllm", "sidecar") == (
        demo.STARTUP_S["vllm"] + demo.PROFILE_AT_START_S + demo.PROFILE_GRACE_S)
    assert demo.startup_s("naive", "vllm", "sidecar") == demo.STARTUP_S["vllm"]
    from slipstream_sidecar.startprofile import GRACE_S

    assert demo.PROFILE_GRACE_S == GRACE_S
    good = run_result("slipstream", [], SLO, offline_tokens_per_s=1.0,
                      offline_requests_done=0, preemptions=None, latency_model="shipped")
    rows = {row[0]: row[1:] for row in side_by_side({"slipstream": good}, SLO)}
    assert rows["latency model in force"] == ("shipped",)


def test_offline_input_addresses_the_served_model(tmp_path: Path) -> None:
    import json

    path, total = demo.offline_input(tmp_path, "m-x", 3, 32)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert total == len(lines) == 3 * demo._sample_size()
    assert {line["body"]["model"] for line in lines} == {"m-x"}
    assert {line["body"]["max_tokens"] for line in lines} == {32}
    assert len({line["custom_id"] for line in lines}) == total


@pytest.mark.parametrize("argv", [["--valley", "0"], ["--valley", "1.5"], ["--duration", "-1"],
                                  ["--offline-copies", "0"], ["--engine", "gpu"],
                                  ["--slo-tbt", "x"]])
def test_bad_values_are_usage_errors(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(argv)
    assert info.value.code == 2


def test_run_result_carries_kubectl_lines() -> None:
    r = RunResult("naive", 1, 1, 0.1, 0.01, 1.0, 1.0, 5.0, 3, 0.0, ("NAME PHASE",), "")
    assert r.as_json(SLO)["kubectl_get"] == ["NAME PHASE"]
