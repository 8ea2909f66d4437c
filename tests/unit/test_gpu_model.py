"""The GPU timing model: shipped profiles, shape of the step-time function, the
profile builder against the real measurements, and its validation error."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from slipstream_scheduler.engine import (
    Curve,
    GpuProfile,
    GpuTimingModel,
    ProfileFormatError,
    ProfileNotFoundError,
    available_profiles,
    load_profile,
)
from slipstream_scheduler.types import BatchItem, Phase

pytestmark = pytest.mark.unit

PAIRS = [("llama-2-7b", "a100"), ("llama-2-7b", "h100"), ("llama-3-8b", "a100"),
         ("llama-3-8b", "h100")]


def test_four_profiles_ship_with_attribution() -> None:
    assert set(PAIRS) <= set(available_profiles())
    for model, gpu in PAIRS:
        p = load_profile(model, gpu)
        assert (p.model, p.gpu, p.tp) == (model, gpu, 1)
        text = " ".join(p.attribution)
        assert "Vidur" in text and "MIT" in text and "ML.ENERGY" in text and "Apache-2.0" in text


def test_missing_and_malformed_profiles_raise() -> None:
    with pytest.raises(ProfileNotFoundError):
        load_profile("gpt-9", "tpu")
    doc = load_profile("llama-2-7b", "a100").to_dict()
    doc["schema_version"] = 99
    with pytest.raises(ProfileFormatError):
        GpuProfile.from_dict(doc)
    with pytest.raises(ProfileFormatError):
        Curve((1.0, 1.0), (2.0, 3.0))


def test_profile_round_trips() -> None:
    p = load_profile("llama-3-8b", "h100")
    assert GpuProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_curve_interpolates_and_extrapolates_proportionally() -> None:
    c = Curve((1.0, 3.0), (10.0, 30.0))
    assert c(2.0) == pytest.approx(20.0)
    assert c(6.0) == pytest.approx(60.0)
    assert c(0) == 0.0


@pytest.mark.parametrize(("model", "gpu"), PAIRS)
def test_step_time_is_monotone_in_every_input(model: str, gpu: str) -> None:
    t = GpuTimingModel(load_profile(model, gpu))
    base = t.step_time(512, 32, 1e5, 20_000)
    assert t.step_time(1024, 32, 1e5, 20_000) > base
    assert t.step_time(512, 64, 1e5, 20_000) > base
    assert t.step_time(512, 32, 1e6, 20_000) > base
    assert t.step_time(512, 32, 1e5, 200_000) > base
    assert t.step_time(0, 0, 0, 0) == 0.0


def test_predict_matches_aggregates_and_decode_cost_grows_with_context() -> None:
    t = GpuTimingModel(load_profile("llama-2-7b", "a100"))
    batch = [BatchItem(Phase.PREFILL, 100, 50), BatchItem(Phase.DECODE, 1, 999)]
    assert t.predict(batch) == pytest.approx(t.step_time(101, 2, 100 * (50 + 50.5), 1000))
    short = t.predict([BatchItem(Phase.DECODE, 1, 100)] * 64)
    long = t.predict([BatchItem(Phase.DECODE, 1, 4000)] * 64)
    assert long > short * 1.1


def test_h100_is_faster_than_a100_and_scales_sensibly() -> None:
    a = GpuTimingModel(load_profile("llama-3-8b", "a100"))
    h = GpuTimingModel(load_profile("llama-3-8b", "h100"))
    prefill = [BatchItem(Phase.PREFILL, 2048, 0)]
    assert h.predict(prefill) < a.predict(prefill)
    # A 2048-token prefill of an 8B model on an A100: tens of ms, not micro- or whole seconds.
    assert 0.03 < a.predict(prefill) < 0.5


def test_kv_capacity_matches_model_size() -> None:
    l2 = GpuTimingModel(load_profile("llama-2-7b", "a100")).kv_capacity_blocks(16, 0.9)
    l3 = GpuTimingModel(load_profile("llama-3-8b", "a100")).kv_capacity_blocks(16, 0.9)
    # Llama-3-8B has GQA (8 KV heads vs 32): about 4x the blocks in similar free memory.
    assert 3000 < l2 < 10_000
    assert 3.0 < l3 / l2 < 4.5


# --------------------------------------------------------------------------- built from data


def test_shipped_profiles_match_a_rebuild_from_the_shared_data(shared_data: Path) -> None:
    from slipstream_cli.commands.profile import build_profile

    for model, gpu in PAIRS:
        shipped = load_profile(model, gpu)
        rebuilt = build_profile(model, gpu, calibration=shipped.calibration)
        assert json.loads(json.dumps(rebuilt.to_dict())) == shipped.to_dict(), (model, gpu)


def test_linear_curve_is_the_sum_of_the_vidur_ops(shared_data: Path) -> None:
    import csv

    path = shared_data / "profiling/vidur/compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv"
    with path.open(newline="") as fh:
        rows = [
            r for r in csv.DictReader(fh)
            if r["num_tensor_parallel_workers"] == "1" and r["num_tokens"] == "1024"
        ]
    ops = ["input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
           "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj"]

    def med(op: str) -> float:
        return sum(float(r[f"time_stats.{op}.median"]) for r in rows) / len(rows)

    expected = 32 * (sum(med(op) for op in ops) + 2 * med("add")) + med("emb")
    got = load_profile("llama-2-7b", "a100").forward_linear_ms(1024)
    assert got == pytest.approx(expected, rel=1e-4)


def test_validation_errors_against_end_to_end_measurements(shared_data: Path) -> None:
    from slipstream_cli.commands.profile import check_rows

    cals = {gpu: load_profile("llama-2-7b", gpu).calibration for gpu in ("a100", "h100")}
    rows = check_rows(cals)
    ml = [r for r in rows if r.source == "ML.ENERGY TPOT"]
    assert len(ml) == 6
    assert all(r.mape < 0.15 for r in ml)  # documented table: 2-11 %
    sw_tok = [r for r in rows if r.source == "Splitwise" and "token" in r.what]
    assert all(r.mape < 0.35 for r in sw_tok)


def test_profiles_are_package_data() -> None:
    names = {e.name for e in resources.files("slipstream_scheduler.engine.profiles").iterdir()}
    assert {f"latency_{m}_{g}.json" for m, g in PAIRS} <= names
