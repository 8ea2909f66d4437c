"""``slipstream bench front-load`` and its load generator: the command lines, the summary,
the CPU burner. The rounds themselves run in the vllm tier (``tests/vllm/test_front_load.py``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from slipstream_cli.benches.front_load import (
    FIGURES,
    Round,
    _explained,
    burner,
    group_cpu_s,
    round_order,
    summarise,
)
from slipstream_testbed.vllm.bench_serve import RandomWorkload, RoundResult, require_loopback

pytestmark = pytest.mark.unit


def test_a_round_is_a_vllm_bench_serve_command_line_on_loopback(tmp_path: Path) -> None:
    argv = RandomWorkload(Path("/models/tiny"), input_len=8, output_len=4, seed=3).argv(
        "http://127.0.0.1:8000", concurrency=64, num_prompts=200,
        result_file=tmp_path / "r.json", label="front")
    flags = dict(zip(argv[::2], argv[1::2], strict=False))
    assert flags["--tokenizer"] == flags["--model"] == "/models/tiny"  # nothing from a hub
    assert (flags["--max-concurrency"], flags["--num-prompts"], flags["--seed"]) == (
        "64", "200", "3")
    assert flags["--temperature"] == "0.0" and "--ignore-eos" in argv
    assert flags["--result-dir"] == str(tmp_path) and flags["--result-filename"] == "r.json"
    with pytest.raises(ValueError, match="loopback"):
        require_loopback("http://10.0.0.1:8000")
    assert require_loopback("http://localhost:1") == "http://localhost:1"
    # A testbed pod's address: anywhere in 127.0.0.0/8.
    assert require_loopback("http://127.1.0.1:8001") == "http://127.1.0.1:8001"
    assert require_loopback("http://[::1]:8000") == "http://[::1]:8000"
    for far in ("http://192.168.1.5:80", "http://example.com:80", "http://128.0.0.1:1"):
        with pytest.raises(ValueError, match="loopback"):
            require_loopback(far)


def test_a_rounds_json_is_read_with_its_failures() -> None:
    doc = {
        "completed": 9, "failed": 1, "duration": 2.0, "request_throughput": 4.5,
        "output_throughput": 72.0, "mean_ttft_ms": 10.0, "p50_ttft_ms": 9.0,
        "p99_ttft_ms": 30.0, "mean_tpot_ms": 2.0, "p50_tpot_ms": 2.0, "p99_tpot_ms": 5.0,
        "generated_texts": ["a", ""], "errors": ["", "Traceback: boom"],
    }
    r = RoundResult.from_json(doc)
    assert (r.completed, r.failed, r.errors) == (9, 1, ("Traceback: boom",))
    assert r.generated_texts == ("a", "")
    assert r.figures()["p99_ttft_ms"] == 30.0


def _round(path: str, repeat: int, scale: float, texts: tuple[str, ...] = ("x", "y")) -> Round:
    figures = {f: 100.0 * scale for f in FIGURES} | {"failed": 0.0, "completed": 2.0,
                                                      "duration_s": 1.0}
    cpu = {"vllm": 1.0, "sidecar": 0.1, "sidecar_estimate": 0.0, "client": 0.2, "burner": 0.0}
    return Round(path, repeat, figures, texts, (), cpu, 2.0, 0.0)


def test_the_summary_gives_ratios_to_direct_and_what_the_control_explains() -> None:
    rounds = [
        _round("direct", 0, 1.0), _round("front", 0, 1.5), _round("control", 0, 1.25),
        _round("direct", 1, 1.2), _round("front", 1, 1.7, ("x", "z")),
        _round("control", 1, 1.35),
    ]
    row = summarise(rounds, num_prompts=2)
    assert row["paths"]["direct"]["median"]["mean_ttft_ms"] == pytest.approx(110.0)
    assert row["ratio_front"]["mean_ttft_ms"] == pytest.approx(160 / 110)
    assert row["ratio_control"]["mean_ttft_ms"] == pytest.approx(130 / 110)
    assert row["direct_spread"]["mean_ttft_ms"] == pytest.approx(1.2)
    assert row["resolved_front"]["mean_ttft_ms"]  # 1.45x, outside direct's 1.2x
    assert row["explained_by_cpu"]["mean_ttft_ms"] == pytest.approx((130 - 110) / (160 - 110))
    assert not row["resolved_control"]["mean_ttft_ms"]  # 1.18x: within direct's spread
    assert row["outputs"] == {"identical": False, "differing_per_repeat": {"front": [0, 1]}}
    assert row["paths"]["front"]["cpu_ms_per_request"]["sidecar"] == pytest.approx(50.0)


def test_the_control_explains_only_what_the_run_resolves() -> None:
    tight = dict.fromkeys(FIGURES, 1.001)
    level = dict.fromkeys(FIGURES, 1.01)
    assert set(_explained(level, level, tight).values()) == {None}  # the front is level
    front, control = dict.fromkeys(FIGURES, 1.5), dict.fromkeys(FIGURES, 1.25)
    assert set(_explained(front, control, dict.fromkeys(FIGURES, 2.0)).values()) == {None}
    assert set(_explained(front, control, tight).values()) == {0.5}


def test_the_first_repeat_runs_front_before_control() -> None:
    paths = ("direct", "front", "control", "front_estimate")
    order = round_order(paths, 0)
    assert order.index("front") < order.index("control")
    for rep in range(4):
        assert sorted(round_order(paths, rep)) == sorted(paths)


def test_the_burner_uses_the_cpu_it_is_asked_for() -> None:
    with burner(0.5) as group:
        assert group is not None
        start, t0 = group_cpu_s(group), time.monotonic()
        time.sleep(2.0)
        used = (group_cpu_s(group) - start) / (time.monotonic() - t0)
    assert 0.0 < used < 0.8  # half a CPU, less when the host is busy (a spin ends with its period)
    with burner(0.0) as none:
        assert none is None
    assert group_cpu_s(os.getpgrp()) > 0
