"""The sidecar profiles real ``vllm serve`` (CPU, the tiny model) at start, before it is ready.

A real ``slipstream sidecar --profile-at-start`` process in front of the shared live server:
``/ready`` answers 503 while ``slipstream profile engine`` runs (the engine itself is healthy
all along), then 200; the gRPC ``Status`` then reports the fitted model as ``learned_model``
with source ``profiled``, and the model is in the state directory. A restarted sidecar with
the same state directory reuses that file instead of profiling again. No error bound is
asserted: the CPU's step times are noisy.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from integration.helpers_procs import Proc, bearer, control_stub, eventually, sidecar_proc
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_sidecar.proto import sidecar_pb2 as pb
from slipstream_sidecar.startprofile import PROFILE_FILE, REPORT_FILE
from slipstream_testbed.vllm import DEFAULT_SERVED_NAME, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TOKEN = "vllm-tier-token"
BUDGET_S = 45


def ready_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def control_status(sc: Proc) -> Any:
    pair: tuple[Any, Any] = control_stub(sc.extra_ports["grpc"])
    ch, stub = pair
    with ch:
        return stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN))


def profiling_sidecar(vllm: VllmServer, tmp: Path, state: Path, name: str) -> Proc:
    token = tmp / "token"
    token.write_text(TOKEN)
    sc = sidecar_proc(tmp, vllm.url, token_file=token, state_dir=state, max_num_seqs=16,
                      name=name, extra=("--model", DEFAULT_SERVED_NAME,
                                        "--max-num-batched-tokens", "384",
                                        "--profile-at-start", str(BUDGET_S)))
    sc.args.insert(sc.args.index("sidecar"), "-v")  # INFO: the profile's summary in the log
    return sc.start(timeout_s=120)  # /health: the process serves, not yet ready


def test_the_sidecar_profiles_its_engine_before_it_is_ready(
    vllm_server: VllmServer, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    sc = profiling_sidecar(vllm_server, tmp_path, state, "sidecar")
    try:
        assert vllm_server.healthy()
        assert ready_status(sc.url) == 503, sc.log_tail()
        during = control_status(sc)
        assert not during.engine_ready and not during.HasField("learned_model")

        eventually("/ready 200 after the profile",
                   lambda: True if ready_status(sc.url) == 200 else None,
                   timeout=BUDGET_S + 60 + 120, interval=1.0)
        status = control_status(sc)
    finally:
        sc.stop()
    log = sc.log_tail(200_000)
    print("\n" + "\n".join(line for line in log.splitlines() if "profile" in line))
    assert status.engine_ready, log
    lm = status.learned_model
    assert lm.source == "profiled", log
    assert dict(lm.model.coefficients) and lm.model.kind, log
    assert lm.fit_steps >= 20 and lm.seen_steps == lm.fit_steps and lm.revision == 1
    assert math.isfinite(lm.heldout_mape) and lm.heldout_mape >= 0
    assert "held-out MAPE" in log

    kept = state / PROFILE_FILE
    assert kept.is_file() and (state / REPORT_FILE).is_file()
    model = LinearLatencyModel.from_json(kept.read_text())
    assert model.meta.source.startswith("slipstream profile engine")
    assert model.stats is not None and model.stats.rows == lm.fit_steps
    mtime = kept.stat().st_mtime

    again = profiling_sidecar(vllm_server, tmp_path, state, "sidecar-restarted")
    try:
        eventually("/ready 200 after the restart",
                   lambda: True if ready_status(again.url) == 200 else None,
                   timeout=120, interval=0.5)
        reused = control_status(again).learned_model
    finally:
        again.stop()
    relog = again.log_tail(200_000)
    assert "reusing" in relog and "profiling the engine" not in relog, relog
    assert reused.source == "profiled" and reused.fit_steps == lm.fit_steps
    assert dict(reused.model.coefficients) == pytest.approx(dict(lm.model.coefficients))
    assert kept.stat().st_mtime == mtime
