"""The latency model the operator pushes is rebuilt exactly in the sidecar.

Both ends of the wire: the spec the sidecar echoes in Status (``latency_spec_pb``), the
spec the operator sends (``ConfigureCall`` fields), protobuf serialisation between them,
and ``latency_model_from_spec`` rebuilding the model; plus the checks that refuse a bad
token curve with a message naming the field.
"""

from __future__ import annotations

import math
import re

import pytest

from slipstream_operator.profiles import find_profile
from slipstream_scheduler.latency import (
    FEATURE_NAMES,
    MAX_CURVE_KNOTS,
    BatchFeatures,
    FeatureSet,
    LinearLatencyModel,
)
from slipstream_scheduler.types import BatchItem, Phase
from slipstream_sidecar.brain import latency_model_from_spec
from slipstream_sidecar.grpc_server import configure_problem, latency_spec_pb
from slipstream_sidecar.proto import sidecar_pb2 as pb

pytestmark = pytest.mark.unit

BATCHES = [
    [BatchItem(Phase.DECODE, 1, 900)] * 8,
    [BatchItem(Phase.PREFILL, 512, 0), *[BatchItem(Phase.DECODE, 1, 1500)] * 30],
    [BatchItem(Phase.PREFILL, 2048, 256)],
    [BatchItem(Phase.PREFILL, 37, 4000), *[BatchItem(Phase.DECODE, 1, 77)] * 3],
    [BatchItem(Phase.PREFILL, 5000, 0)],  # past the curve's last knot
]

SHIPPED = [(m, g) for m in ("meta-llama/Llama-2-7b-hf", "llama-3-8b") for g in ("a100", "h100")]

HINGE = LinearLatencyModel(
    FeatureSet.CONTEXT_CHUNK_HINGE,
    (0.006, 1e-6, 1e-10, 2e-4, 3e-5, 0.0, 5e-8, 1e-10, 4e-5),
    knee_tokens=192,
)


def _rebuilt(spec: pb.LatencyModelSpec) -> LinearLatencyModel:
    received = pb.LatencyModelSpec.FromString(spec.SerializeToString())
    return latency_model_from_spec(
        received.kind,
        dict(received.coefficients),
        received.knee_tokens,
        token_curve=received.token_curve,
        curve_step_tokens=received.curve_step_tokens,
    )


def _same_predictions(a: LinearLatencyModel, b: LinearLatencyModel) -> None:
    for batch in BATCHES:
        assert b.predict(batch) == a.predict(batch)  # bit for bit: the same doubles


@pytest.mark.parametrize(("model_name", "gpu"), SHIPPED)
def test_shipped_models_survive_the_wire(model_name: str, gpu: str) -> None:
    profile = find_profile(model_name, gpu)
    assert profile is not None
    model = profile.model
    assert model.feature_set is FeatureSet.CONTEXT_CHUNK_CURVE, "shipped profiles use the curve"
    assert len(model.token_curve) >= 2 and model.curve_step_tokens == 32
    rebuilt = _rebuilt(latency_spec_pb(model))
    assert rebuilt.token_curve == model.token_curve
    assert rebuilt.coefficients == model.coefficients
    _same_predictions(model, rebuilt)
    # The chunk solver agrees too (it walks the curve's knots).
    acc = BatchFeatures.of(BATCHES[1])
    for budget in (0.01, 0.03, 0.08):
        assert rebuilt.max_prefill_tokens(acc, 100, budget, 8192) == model.max_prefill_tokens(
            acc, 100, budget, 8192
        )


def test_the_operator_call_carries_what_the_sidecar_echoes() -> None:
    """``GrpcSidecarControl.configure`` builds the request from ``ConfigureCall``'s fields."""
    profile = find_profile("llama-3-8b", "h100")
    assert profile is not None
    model = profile.model
    echoed = latency_spec_pb(model)
    sent = pb.LatencyModelSpec(
        kind=model.feature_set.value,
        coefficients={n: c for n, c in zip(FEATURE_NAMES, model.coefficients, strict=True) if c},
        knee_tokens=model.knee_tokens,
        token_curve=model.token_curve,
        curve_step_tokens=model.curve_step_tokens,
    )
    assert sent == echoed


def test_a_schema_2_hinge_model_still_survives_the_wire() -> None:
    spec = latency_spec_pb(HINGE)
    assert not spec.token_curve and spec.curve_step_tokens == 0 and spec.knee_tokens == 192
    assert configure_problem(pb.ConfigureRequest(generation=1, latency_model=spec)) is None
    _same_predictions(HINGE, _rebuilt(spec))
    # As a pre-curve operator sends it: the three original fields only.
    legacy = pb.LatencyModelSpec(
        kind=spec.kind, coefficients=dict(spec.coefficients), knee_tokens=spec.knee_tokens
    )
    _same_predictions(HINGE, _rebuilt(legacy))


def test_no_model_is_an_empty_spec() -> None:
    assert latency_spec_pb(None) == pb.LatencyModelSpec()


def test_unknown_feature_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown latency-model features"):
        latency_model_from_spec("context", {"warp_speed": 1.0})


def test_unknown_kind_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"latency_model\.kind 'linear'"):
        latency_model_from_spec("linear", {"const": 0.01})


def test_a_curve_kind_without_its_curve_is_refused() -> None:
    """What a pre-curve operator would send for a curve profile: refused, never mis-built."""
    profile = find_profile("llama-2-7b", "a100")
    assert profile is not None
    spec = latency_spec_pb(profile.model)
    with pytest.raises(ValueError, match=r"latency_model\.token_curve"):
        latency_model_from_spec(spec.kind, dict(spec.coefficients), spec.knee_tokens)


def test_a_curve_on_a_set_without_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"latency_model\.token_curve"):
        latency_model_from_spec(
            "context", {"const": 0.01}, token_curve=(0.0, 1.0), curve_step_tokens=32
        )


def test_a_coefficient_outside_the_set_is_a_value_error() -> None:
    # Used to escape as ModelFormatError (an UNKNOWN gRPC status instead of INVALID_ARGUMENT).
    with pytest.raises(ValueError, match=r"latency_model\.coefficients\['s_d_ctx'\]"):
        latency_model_from_spec("tokens", {"const": 0.01, "s_d_ctx": 1e-7})


GOOD = pb.LatencyModelSpec(
    kind="context+chunk+curve",
    coefficients={"const": 0.005, "s_p": 1e-6, "tokens_over_knee": 3e-5},
    token_curve=[0.0, 10.0, 40.0, 96.0],
    curve_step_tokens=32,
)


def _with(**changes: object) -> pb.LatencyModelSpec:
    spec = pb.LatencyModelSpec()
    spec.CopyFrom(GOOD)
    for name, value in changes.items():
        spec.ClearField(name)  # type: ignore[arg-type]
        if isinstance(value, list):
            getattr(spec, name).extend(value)
        else:
            setattr(spec, name, value)
    return spec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (_with(token_curve=[0.0, 10.0, 9.0, 96.0]), r"token_curve must be non-decreasing: \[2\]"),
        (_with(token_curve=[0.0, -1.0, 40.0]), r"token_curve\[1\] must be finite and non-neg"),
        (_with(token_curve=[0.0, math.nan, 40.0]), r"token_curve\[1\] must be finite"),
        (_with(token_curve=[0.0, 10.0, math.inf]), r"token_curve\[2\] must be finite"),
        (_with(token_curve=[1.0, 10.0, 40.0]), r"token_curve\[0\] must be 0"),
        (_with(token_curve=[0.0]), r"token_curve must hold 2 to"),
        (_with(token_curve=[0.0] * (MAX_CURVE_KNOTS + 1)), r"token_curve must hold 2 to 4097"),
        (_with(token_curve=[0.0] * 4000, curve_step_tokens=64), r"token_curve spans 255936"),
        (_with(curve_step_tokens=0), r"curve_step_tokens must be positive"),
        (_with(token_curve=[]), r"curve_step_tokens is 32 but token_curve is empty"),
    ],
)
def test_bad_curves_are_refused_naming_the_field(spec: pb.LatencyModelSpec, message: str) -> None:
    problem = configure_problem(pb.ConfigureRequest(generation=1, latency_model=spec))
    assert problem is not None
    assert problem.startswith("latency_model.")
    assert re.search(message, problem), problem


def test_a_good_curve_passes_and_rebuilds() -> None:
    assert configure_problem(pb.ConfigureRequest(generation=1, latency_model=GOOD)) is None
    model = _rebuilt(GOOD)
    assert model.token_curve == (0.0, 10.0, 40.0, 96.0)
    # phi(48) lies halfway between the knots at 32 (10) and 64 (40).
    one = BatchItem(Phase.PREFILL, 48, 0)
    expected = 0.005 + 1e-6 * 48 + 3e-5 * 25.0
    assert model.predict([one]) == pytest.approx(expected, rel=1e-12)
