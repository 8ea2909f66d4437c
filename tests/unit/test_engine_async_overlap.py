"""vLLM's async scheduling in the engine model, and a scheduler plugin's host time.

A GPU-profile step is the device's work plus the host overhead (the profile's per-step and
per-sequence terms). With ``async_scheduling`` the host work overlaps the device's, so a
step takes the longer of the two; ``scheduler_overhead_*`` adds a plugin's host time to
every step, hidden by the overlap while it fits under the device's work. The engine's
decisions do not depend on time, so the same requests give the same steps either way and
each step's duration can be compared one to one.
"""

from __future__ import annotations

import pytest

from slipstream_cli.commands.sim import Scenario
from slipstream_cli.main import main
from slipstream_scheduler.engine.gpu import GpuTimingModel, load_profile
from slipstream_scheduler.engine.model import EngineConfig, EngineModel, EngineRequest

pytestmark = pytest.mark.unit

BASE = {"noise_cv": 0.0, "model": "llama-2-7b", "gpu": "a100"}


def _durations(**overrides: object) -> list[tuple[float, int]]:
    """(duration, sequences) of every step of one fixed mix of prefills and decodes."""
    eng = EngineModel(EngineConfig.model_validate({**BASE, **overrides}))
    for i in range(24):
        eng.add(EngineRequest(f"r{i}", 200 + 150 * (i % 5), max_tokens=40 + 10 * (i % 3),
                              arrival_s=0.0))
    out = []
    while eng.has_work():
        res = eng.step()
        if res.num_tokens:
            out.append((res.duration_s, len(res.batch)))
    return out


def _host(seqs: int) -> float:
    c = load_profile("llama-2-7b", "a100").calibration
    return c.step_overhead_s + c.per_seq_overhead_s * seqs


def test_step_parts_add_up_to_the_step_time() -> None:
    gpu = GpuTimingModel(load_profile("llama-2-7b", "a100"))
    for tokens, seqs, pairs, kv in ((512, 1, 131_328.0, 0), (40, 40, 0.0, 24_000),
                                    (300, 21, 45_150.0, 9_000)):
        device, host = gpu.step_parts(tokens, seqs, pairs, kv)
        assert device > 0 and host == pytest.approx(_host(seqs))
        assert device + host == pytest.approx(gpu.step_time(tokens, seqs, pairs, kv), rel=1e-12)
    assert gpu.step_parts(0, 0, 0.0, 0) == (0.0, 0.0)


def test_async_scheduling_takes_the_longer_of_device_and_host() -> None:
    sync, overlapped = _durations(), _durations(async_scheduling=True)
    assert [n for _, n in sync] == [n for _, n in overlapped]  # the same steps
    hidden = 0
    for (s, n), (a, _) in zip(sync, overlapped, strict=True):
        device, host = s - _host(n), _host(n)
        assert a == pytest.approx(max(device, host), rel=1e-9)
        hidden += a < s
    assert hidden == len(sync)  # every step had both parts, so every step got shorter


def test_a_plugins_host_time_adds_up_in_sync_and_hides_under_the_device_in_async() -> None:
    step_s, per_seq_s = 2e-4, 2e-5
    sync = _durations()
    extra = _durations(scheduler_overhead_s=step_s, scheduler_overhead_per_seq_s=per_seq_s)
    for (s, n), (e, _) in zip(sync, extra, strict=True):
        assert e == pytest.approx(s + step_s + per_seq_s * n, rel=1e-9)
    overlapped = _durations(async_scheduling=True)
    both = _durations(async_scheduling=True, scheduler_overhead_s=step_s,
                      scheduler_overhead_per_seq_s=per_seq_s)
    for (s, n), (a, _), (b, _) in zip(sync, overlapped, both, strict=True):
        device, host = s - _host(n), _host(n) + step_s + per_seq_s * n
        assert b == pytest.approx(max(device, host), rel=1e-9)
        if device >= host:  # the plugin's time hides under the device's work
            assert b == pytest.approx(a, rel=1e-9)


def test_only_in_engine_runs_carry_the_plugins_overhead() -> None:
    engine = EngineConfig(async_scheduling=True)
    scn = Scenario((), (), 60.0, engine, in_engine_overhead_s=(1e-4, 2e-5))
    assert scn.engine_for("sidecar") is engine
    inside = scn.engine_for("in-engine")
    assert (inside.scheduler_overhead_s, inside.scheduler_overhead_per_seq_s) == (1e-4, 2e-5)
    assert inside.async_scheduling
    assert Scenario((), (), 60.0, engine).engine_for("in-engine") is engine


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--plugin-overhead-us", "-1", "0"], "--plugin-overhead-us takes STEP"),
        (["--plugin-overhead-us", "0", "nan"], "--plugin-overhead-us takes STEP"),
        (["--engine", "vllm", "--async-scheduling"], "time the engine model's steps"),
    ],
)
def test_bad_timing_options_are_usage_errors(
    argv: list[str], message: str, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "colocation", "--json", f"{tmp_path}/out.json", *argv])
    assert code == 2
    assert message in capsys.readouterr().err
