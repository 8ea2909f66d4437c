"""A token-curve latency model end to end: operator client -> real gRPC -> sidecar.

The sidecar runs in this process (its gRPC server on a loopback port), so both ends
of the wire can be compared: the model the operator holds (a shipped profile, as
``find_profile`` loads it) and the model the sidecar's planner and controller run
after ``Configure``, on the same batches, bit for bit. A second sidecar on the
same state directory stands for a restart. Refusals go over the same real channel.

Deliberately left out: the subprocess sidecar and ``kill -9`` (``test_sidecar_grpc.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest

from slipstream_operator.errors import SidecarError
from slipstream_operator.profiles import find_profile
from slipstream_operator.sidecar_client import ConfigureCall, GrpcSidecarControl, PodAddress
from slipstream_scheduler.latency import FEATURE_NAMES, FeatureSet, LinearLatencyModel
from slipstream_scheduler.types import BatchItem, Phase
from slipstream_sidecar.app import Sidecar
from slipstream_sidecar.grpc_server import serve_grpc
from slipstream_sidecar.settings import SidecarSettings

pytestmark = pytest.mark.integration

TOKEN = "curve-test-token"

BATCHES = [
    [BatchItem(Phase.DECODE, 1, 900)] * 8,
    [BatchItem(Phase.PREFILL, 300, 0), *[BatchItem(Phase.DECODE, 1, 1500)] * 30],
    [BatchItem(Phase.PREFILL, 2048, 256)],
    [BatchItem(Phase.PREFILL, 77, 4000), *[BatchItem(Phase.DECODE, 1, 60)] * 5],
]


@dataclass
class Pod:
    sidecar: Sidecar
    server: grpc.aio.Server
    address: PodAddress
    settings: SidecarSettings


async def _stop(pod: Pod) -> None:
    await pod.server.stop(None)
    await pod.sidecar.stop()


async def _start(settings: SidecarSettings) -> Pod:
    sidecar = Sidecar(settings)
    server, port = await serve_grpc(sidecar, "127.0.0.1", 0)
    return Pod(sidecar, server, PodAddress("pod-0", "127.0.0.1", port, TOKEN), settings)


@pytest.fixture
async def pod(tmp_path: Path) -> AsyncIterator[Pod]:
    (tmp_path / "token").write_text(TOKEN + "\n")
    settings = SidecarSettings(
        engine="http://127.0.0.1:9",
        auth_token_file=tmp_path / "token",
        state_dir=tmp_path / "state",
    )
    started = await _start(settings)
    yield started
    await _stop(started)


def _call(generation: int, model: LinearLatencyModel) -> ConfigureCall:
    return ConfigureCall(
        generation=generation,
        budget_s=0.05,
        latency_kind=model.feature_set.value,
        latency_coefficients={
            n: c for n, c in zip(FEATURE_NAMES, model.coefficients, strict=True) if c
        },
        latency_knee_tokens=model.knee_tokens,
        latency_token_curve=model.token_curve,
        latency_curve_step_tokens=model.curve_step_tokens,
    )


def _assert_runs(sidecar: Sidecar, model: LinearLatencyModel) -> None:
    running = sidecar.brain.latency_model
    assert running is not None and sidecar.controller.latency_model is running
    assert running.feature_set is model.feature_set
    assert running.token_curve == model.token_curve
    for batch in BATCHES:
        assert running.predict(batch) == model.predict(batch)


async def test_a_shipped_curve_model_reaches_the_sidecar_and_survives_a_restart(
    pod: Pod,
) -> None:
    profile = find_profile("meta-llama/Llama-2-7b-hf", "h100")
    assert profile is not None and profile.model.feature_set is FeatureSet.CONTEXT_CHUNK_CURVE
    model = profile.model
    control = GrpcSidecarControl(timeout_s=10.0)
    try:
        assert await control.configure(pod.address, _call(5, model)) == 5
        _assert_runs(pod.sidecar, model)
        status = await control.status(pod.address)
        assert status.latency_kind == "context+chunk+curve"
        assert status.latency_curve_knots == len(model.token_curve)
    finally:
        await control.close()
    await pod.server.stop(None)  # the fixture stops the rest
    restarted = await _start(pod.settings)  # same state directory: a restarted pod
    try:
        assert restarted.sidecar.generation == 5
        _assert_runs(restarted.sidecar, model)
    finally:
        await _stop(restarted)


async def test_a_bad_curve_is_refused_and_the_model_in_force_kept(pod: Pod) -> None:
    profile = find_profile("llama-3-8b", "a100")
    assert profile is not None
    model = profile.model
    control = GrpcSidecarControl(timeout_s=10.0)
    try:
        await control.configure(pod.address, _call(1, model))
        bent = list(model.token_curve)
        bent[3] = bent[2] - 1.0
        bad = replace(_call(2, model), latency_token_curve=tuple(bent))
        with pytest.raises(SidecarError, match=r"INVALID_ARGUMENT.*token_curve must be non-dec"):
            await control.configure(pod.address, bad)
        # What an operator that predates the curve would send: the kind without its curve.
        bare = replace(_call(3, model), latency_token_curve=(), latency_curve_step_tokens=0)
        with pytest.raises(SidecarError, match=r"INVALID_ARGUMENT.*latency_model\.token_curve"):
            await control.configure(pod.address, bare)
        assert pod.sidecar.generation == 1
        _assert_runs(pod.sidecar, model)
    finally:
        await control.close()


async def test_a_schema_2_hinge_model_is_still_accepted(pod: Pod) -> None:
    hinge = LinearLatencyModel(
        FeatureSet.CONTEXT_CHUNK_HINGE,
        (0.006, 1e-6, 1e-10, 2e-4, 3e-5, 0.0, 5e-8, 1e-10, 4e-5),
        knee_tokens=192,
    )
    control = GrpcSidecarControl(timeout_s=10.0)
    try:
        # As a pre-curve operator builds it: no curve fields at all.
        call = ConfigureCall(
            generation=1,
            budget_s=0.05,
            latency_kind=hinge.feature_set.value,
            latency_coefficients={
                n: c for n, c in zip(FEATURE_NAMES, hinge.coefficients, strict=True) if c
            },
            latency_knee_tokens=192,
        )
        assert await control.configure(pod.address, call) == 1
        _assert_runs(pod.sidecar, hinge)
        assert (await control.status(pod.address)).latency_curve_knots == 0
    finally:
        await control.close()


async def test_a_curve_profile_given_at_start_is_in_force_and_reported(tmp_path: Path) -> None:
    """``slipstream sidecar --latency-model latency_<model>_<gpu>.json`` with a schema-3 file."""
    profile = find_profile("llama-2-7b", "a100")
    assert profile is not None
    path = tmp_path / "latency.json"
    path.write_text(profile.model.to_json())
    sidecar = Sidecar(SidecarSettings(engine="http://127.0.0.1:9", latency_model_file=path))
    try:
        _assert_runs(sidecar, profile.model)
        assert sidecar.status().latency_model == sidecar.brain.latency_model
    finally:
        await sidecar.stop()
