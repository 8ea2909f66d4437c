"""API models: parsing, durations, defaults and the Python copy of the CEL rules."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from slipstream_operator.api import (
    InferenceService,
    InferenceServiceSpec,
    LabelSelector,
    OfflineJob,
    OfflineJobSpec,
    format_duration,
    parse_duration,
    validate_semantics,
)

pytestmark = pytest.mark.unit


def service_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": "meta-llama/Llama-2-7b-hf",
        "engine": {"image": "vllm/vllm-openai:v0.11.0"},
        "slo": {"ttft": {"p99": "2s", "mean": "600ms"}},
    }
    spec.update(overrides)
    return spec


def job_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": "meta-llama/Llama-2-7b-hf",
        "input": {"uri": "file:///data/in.jsonl"},
        "output": {"uri": "file:///data/out.jsonl"},
    }
    spec.update(overrides)
    return spec


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("600ms", 0.6), ("2s", 2.0), ("1.5s", 1.5), ("1h30m", 5400.0), ("24h", 86400.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "2", "2 s", "-1s", "1d", "ms", "1.s"])
def test_parse_duration_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


@pytest.mark.parametrize("seconds", [0.0, 0.045, 1.234, 9.9, 42.0, 600.0, 7300.0])
def test_format_duration_round_trips_within_rounding(seconds: float) -> None:
    text = format_duration(seconds)
    assert parse_duration(text) == pytest.approx(seconds, abs=60 if seconds >= 3600 else 1.0)


def test_service_defaults_and_camel_case_wire_form() -> None:
    spec = InferenceServiceSpec.model_validate(service_spec())
    assert spec.replicas == 1 and spec.engine.gpus == 1
    assert spec.scheduling.ordering == "gittins" and spec.scheduling.co_location
    wire = spec.wire()
    assert wire["scheduling"] == {"ordering": "gittins", "coLocation": True,
                                  "enforcement": "sidecar", "latencyModel": "auto"}
    assert wire["sidecar"]["grpcPort"] == 9000
    assert "tbt" not in wire["slo"]  # omitted, never null
    assert validate_semantics(spec) == []


def test_unknown_fields_are_rejected() -> None:
    with pytest.raises(ValidationError, match="replica"):
        InferenceServiceSpec.model_validate(service_spec(replica=2))


def test_bad_duration_names_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        InferenceServiceSpec.model_validate(service_spec(slo={"tbt": {"p99": "fast"}}))
    assert info.value.errors()[0]["loc"] == ("slo", "tbt", "p99")


@pytest.mark.parametrize(
    ("slo", "problem"),
    [
        ({}, "spec.slo: set at least one SLO"),
        ({"ttft": {}}, "spec.slo.ttft: set at least one"),
        ({"tbt": {"mean": "200ms", "p99": "150ms"}}, "spec.slo.tbt.p99: p99 must be at least"),
    ],
)
def test_semantic_rules(slo: dict[str, Any], problem: str) -> None:
    spec = InferenceServiceSpec.model_validate(service_spec(slo=slo))
    problems = validate_semantics(spec)
    assert any(p.startswith(problem) for p in problems), problems


def test_p99_equal_to_mean_is_fine_and_units_are_compared_not_strings() -> None:
    spec = InferenceServiceSpec.model_validate(
        service_spec(slo={"tbt": {"mean": "900ms", "p99": "1s"}})
    )
    assert validate_semantics(spec) == []  # "1s" < "900ms" as strings, not as durations


def test_job_rules() -> None:
    same = OfflineJobSpec.model_validate(
        job_spec(output={"uri": "file:///data/in.jsonl"})
    )
    assert validate_semantics(same) == ["spec.output.uri: input and output URIs must differ"]
    short = OfflineJobSpec.model_validate(job_spec(completionWindow="30s"))
    assert validate_semantics(short) == ["spec.completionWindow: must be between 1m and 720h"]
    ok = OfflineJobSpec.model_validate(job_spec())
    assert validate_semantics(ok) == []
    assert ok.output.errors == "file:///data/out.errors.jsonl"
    assert ok.completion_window == "24h" and ok.shard_size == 256


def test_uri_scheme_is_checked() -> None:
    with pytest.raises(ValidationError, match="input"):
        OfflineJobSpec.model_validate(job_spec(input={"uri": "/data/in.jsonl"}))


def test_full_objects_parse() -> None:
    svc = InferenceService.model_validate(
        {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "chat"}, "spec": service_spec()}
    )
    assert svc.spec.model.endswith("7b-hf")
    job = OfflineJob.model_validate(
        {"apiVersion": "slipstream.dev/v1alpha1", "kind": "OfflineJob",
         "metadata": {"name": "j"}, "spec": job_spec(), "status": {"phase": "Running"}}
    )
    assert job.status is not None and job.status.phase == "Running"


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ({}, {"a": "1"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
        ({"matchExpressions": [{"key": "t", "operator": "In", "values": ["x"]}]}, {"t": "x"}, True),
        ({"matchExpressions": [{"key": "t", "operator": "NotIn", "values": ["x"]}]}, {"t": "x"},
         False),
        ({"matchExpressions": [{"key": "t", "operator": "Exists"}]}, {}, False),
        ({"matchExpressions": [{"key": "t", "operator": "DoesNotExist"}]}, {}, True),
    ],
)
def test_label_selector(selector: dict[str, Any], labels: dict[str, str], expected: bool) -> None:
    assert LabelSelector.model_validate(selector).matches(labels) is expected


def test_request_defaults_reach_the_sidecar_as_openai_body_fields() -> None:
    from slipstream_operator.api import RequestDefaults

    defaults = RequestDefaults.model_validate({"maxTokens": 64, "temperature": 0.5})
    assert defaults.body_fields() == {"max_tokens": 64, "temperature": 0.5}
    assert RequestDefaults().body_fields() == {}
