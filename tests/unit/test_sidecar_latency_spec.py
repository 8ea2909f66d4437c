"""The latency model the operator pushes is rebuilt exactly in the sidecar."""

from __future__ import annotations

import pytest

from slipstream_operator.profiles import find_profile
from slipstream_scheduler.latency import FEATURE_NAMES
from slipstream_scheduler.types import BatchItem, Phase
from slipstream_sidecar.brain import latency_model_from_spec
from slipstream_sidecar.proto import sidecar_pb2 as pb

pytestmark = pytest.mark.unit

BATCHES = [
    [BatchItem(Phase.DECODE, 1, 900)] * 8,
    [BatchItem(Phase.PREFILL, 512, 0), *[BatchItem(Phase.DECODE, 1, 1500)] * 30],
    [BatchItem(Phase.PREFILL, 2048, 256)],
]


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_shipped_model_survives_the_wire(gpu: str) -> None:
    profile = find_profile("meta-llama/Llama-2-7b-hf", gpu)
    assert profile is not None
    model = profile.model
    assert model.knee_tokens > 0, "shipped profiles are expected to use the hinge"
    coefficients = {n: c for n, c in zip(FEATURE_NAMES, model.coefficients, strict=True) if c}
    wire = pb.LatencyModelSpec(
        kind=model.feature_set.value, coefficients=coefficients, knee_tokens=model.knee_tokens
    )
    received = pb.LatencyModelSpec.FromString(wire.SerializeToString())
    rebuilt = latency_model_from_spec(
        received.kind, dict(received.coefficients), received.knee_tokens
    )
    for batch in BATCHES:
        assert rebuilt.predict(batch) == pytest.approx(model.predict(batch), rel=1e-12)


def test_unknown_feature_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown latency-model features"):
        latency_model_from_spec("context", {"warp_speed": 1.0})
