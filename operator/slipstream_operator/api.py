"""The ``slipstream.dev/v1alpha1`` API: InferenceService and OfflineJob, as pydantic models.

These models are the single source of truth. ``crdgen`` turns them into the
CRD manifests under ``crds/`` (structural OpenAPI schema, CEL rules, printer
columns), ``apidocs`` into ``docs/reference/api.md``, and the operator parses
every object it reads through them. Field descriptions are what
``kubectl explain inferenceservices.slipstream.dev.spec`` prints.

Conventions: camelCase on the wire (Python names are snake_case with aliases);
optional fields are omitted rather than null (dump with ``exclude_none``);
durations are strings in Go's ``time.ParseDuration`` form restricted to
``ms``/``s``/``m``/``h`` (``600ms``, ``2s``, ``1h30m``) so that CEL's
``duration()`` can compare them on the API server; :func:`parse_duration`
reads them here.

Rules a schema cannot state are CEL (``x-kubernetes-validations``) attached
with :func:`_cel` and checked by the API server; :func:`validate_semantics`
repeats them in Python so that the pure code never trusts an object that
bypassed admission.

Deliberately left out: conversion between versions (there is only v1alpha1),
defaulting webhooks (schema defaults suffice), and per-request overrides of
a service's class or priority (both come from the objects, never a client).
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic.alias_generators import to_camel

GROUP = "slipstream.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CATEGORY = "slipstream"

DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
"""A Go duration limited to ms, s, m, h units: ``600ms``, ``2s``, ``1.5s``, ``1h30m``."""

_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

URI_PATTERN = r"^(file|s3|gs|az|memory)://.+$"
CAMEL_REASON_PATTERN = r"^[A-Z][A-Za-z0-9]*$"

Duration = Annotated[str, StringConstraints(pattern=DURATION_PATTERN, max_length=32)]
Uri = Annotated[str, StringConstraints(pattern=URI_PATTERN, min_length=8, max_length=2048)]
Quantity = int | str

DEFAULT_SIDECAR_IMAGE = "ghcr.io/slipstream-dev/slipstream:0.1.0"
"""The sidecar image when neither ``spec.sidecar.image`` nor the operator's setting names one."""


def parse_duration(text: str) -> float:
    """Seconds in a duration string (``"600ms"`` -> 0.6). Raises ValueError on bad input."""
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"not a duration (want e.g. 600ms, 2s, 1h30m): {text!r}")
    return sum(float(n) * _UNIT_S[u] for n, u in _DURATION_PART.findall(text))


def format_duration(seconds: float) -> str:
    """A short duration string that :func:`parse_duration` reads back.

    Below 10 s: whole milliseconds (``"45ms"``, ``"2500ms"``); below an hour:
    ``"1m30s"``; else ``"2h5m"``. Negative values clamp to ``"0ms"``.
    """
    if seconds < 10.0:
        return f"{max(0, round(seconds * 1000))}ms"
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _cel(*rules: tuple[str, str, str | None]) -> dict[str, Any]:
    """``json_schema_extra`` carrying CEL rules: (rule, message, fieldPath or None)."""
    out = []
    for rule, message, field_path in rules:
        entry: dict[str, str] = {"rule": rule, "message": message}
        if field_path is not None:
            entry["fieldPath"] = field_path
        out.append(entry)
    return {"x-kubernetes-validations": out}


class ApiModel(BaseModel):
    """Base of every API model: frozen, camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=False,
    )

    def wire(self) -> dict[str, Any]:
        """The object as it goes to the API server (camelCase, no nulls)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --------------------------------------------------------------------------- shared


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """One observation of an object's state (metav1.Condition)."""

    type: str = Field(
        description="Condition type in CamelCase, e.g. Ready, SLOMet, BudgetReady.",
        pattern=CAMEL_REASON_PATTERN,
        max_length=64,
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        description="Why the condition has its status, one CamelCase word, e.g. WithinTarget.",
        pattern=CAMEL_REASON_PATTERN,
        max_length=64,
    )
    message: str = Field(
        default="", description="Human-readable detail. Default: empty.", max_length=2048
    )
    last_transition_time: datetime = Field(
        description="When status last changed (RFC 3339); unchanged while status stays the same."
    )
    observed_generation: int = Field(
        default=0,
        description="metadata.generation the condition was computed for. Default: 0.",
        ge=0,
    )


class LabelSelectorRequirement(ApiModel):
    """One set-based requirement of a label selector."""

    key: str = Field(description="Label key.", max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In, NotIn, Exists or DoesNotExist."
    )
    values: list[Annotated[str, StringConstraints(max_length=63)]] = Field(
        default_factory=list,
        description="Values for In/NotIn; must be empty for Exists/DoesNotExist. Default: empty.",
        max_length=64,
    )


class LabelSelector(ApiModel):
    """A Kubernetes label selector; an empty selector matches every object."""

    match_labels: dict[str, str] = Field(
        default_factory=dict, description="Labels that must all be present with these values."
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list,
        description="Set-based requirements, all of which must hold.",
        max_length=16,
    )

    def matches(self, labels: dict[str, str]) -> bool:
        """Whether an object with ``labels`` is selected."""
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        for req in self.match_expressions:
            present = req.key in labels
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
            if req.operator == "In" and labels.get(req.key) not in req.values:
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
        return True


# --------------------------------------------------------------------------- InferenceService


class LatencyTarget(ApiModel):
    """Targets for one latency metric; set the mean, the P99, or both."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("has(self.mean) || has(self.p99)", "set at least one of mean and p99", None),
            (
                "!has(self.mean) || !has(self.p99) || duration(self.p99) >= duration(self.mean)",
                "p99 must be at least the mean",
                ".p99",
            ),
        )
    )

    mean: Duration | None = Field(
        default=None,
        description="Target for the mean over the status window, e.g. 600ms. Unset: none.",
    )
    p99: Duration | None = Field(
        default=None, description="Target for the 99th percentile over the status window, e.g. 2s."
    )


class SLOSpec(ApiModel):
    """Latency SLOs of the online traffic; every target set is enforced."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("has(self.ttft) || has(self.tbt)", "set at least one SLO (ttft or tbt)", None)
        )
    )

    ttft: LatencyTarget | None = Field(
        default=None, description="Time to first token (queueing included)."
    )
    tbt: LatencyTarget | None = Field(
        default=None, description="Time between tokens of one stream."
    )


class EngineSpec(ApiModel):
    """The vLLM engine container of each replica."""

    image: str = Field(description="vLLM container image.", min_length=1, max_length=512)
    args: list[str] = Field(
        default_factory=list,
        description="Extra vLLM arguments. The operator adds --scheduling-policy priority, "
        "--host 127.0.0.1 (0.0.0.0 with enforcement engine) and --port 8001 itself, and "
        "with enforcement engine --scheduler-cls and --no-async-scheduling. Default: none.",
        max_length=64,
    )
    gpus: int = Field(
        default=1, description="GPUs per replica (nvidia.com/gpu). Default: 1.", ge=0, le=16
    )
    gpu_type: str = Field(
        default="h100",
        description="GPU family; picks the shipped latency profile latency_<model>_<gpuType>.json. "
        "Default: h100.",
        max_length=32,
    )


class Ordering(StrEnum):
    FCFS = "fcfs"
    SJF = "sjf"
    TRAIL = "trail"
    GITTINS = "gittins"


class Enforcement(StrEnum):
    SIDECAR = "sidecar"
    ENGINE = "engine"


class SchedulingSpec(ApiModel):
    """How each pod's sidecar orders and co-locates work."""

    ordering: Ordering = Field(
        default=Ordering.GITTINS,
        description="Online queue order: fcfs, sjf, trail or gittins. Default: gittins.",
    )
    co_location: bool = Field(
        default=True, description="Run offline work on this service's pods. Default: true."
    )
    enforcement: Enforcement = Field(
        default=Enforcement.SIDECAR,
        description="Where the latency budget is enforced. sidecar: online traffic enters "
        "the sidecar, which admits every request into a stock vLLM. engine: vLLM runs "
        "Slipstream's scheduler plugin (--scheduler-cls; engine.image must include it, see "
        "docs/plugin.md), online traffic goes straight to vLLM's port and the sidecar keeps "
        "the control API and the offline shards. Default: sidecar.",
    )


class ResourceRequirements(ApiModel):
    """Container resource requests and limits (Kubernetes quantities)."""

    requests: dict[str, Quantity] = Field(default_factory=dict, description="Minimum resources.")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Maximum resources.")


class SidecarSpec(ApiModel):
    """The Slipstream sidecar container of each replica."""

    image: str | None = Field(
        default=None,
        description="Sidecar image. Unset: the operator's default (the chart's sidecar.image, "
        "env SLIPSTREAM_OPERATOR_SIDECAR_IMAGE; " + DEFAULT_SIDECAR_IMAGE + " unless "
        "changed), so one setting moves every service that does not name its own.",
        min_length=1,
        max_length=512,
    )
    http_port: int = Field(
        default=8000,
        description="OpenAI-compatible HTTP port (the pod's serving port). Default: 8000.",
        ge=1,
        le=65535,
    )
    grpc_port: int = Field(
        default=9000,
        description="Control gRPC port the operator dials. Default: 9000.",
        ge=1,
        le=65535,
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Sidecar container resources. Empty (no requests and no limits): the "
        "operator's default (the chart's sidecar.resources, env "
        "SLIPSTREAM_OPERATOR_SIDECAR_RESOURCES; none unless set).",
    )


class PortNumber(ApiModel):
    """A port by number (the Gateway API Inference Extension's ``Port``)."""

    number: int = Field(description="Port number, 1 to 65535.", ge=1, le=65535)


class EndpointPickerRef(ApiModel):
    """The endpoint picker (EPP) the InferencePool names; copied into the pool as it is."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("self.kind != 'Service' || has(self.port)",
             "port is required when kind is Service", ".port"),
        )
    )

    group: str = Field(
        default="",
        description="API group of the picker object; empty is the core group. Default: empty.",
        max_length=253,
        pattern=r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
    )
    kind: str = Field(
        default="Service",
        description="Kind of the picker object. Default: Service.",
        min_length=1,
        max_length=63,
        pattern=r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
    )
    name: str = Field(
        description="Name of the picker object (same namespace), e.g. the EPP's Service.",
        min_length=1,
        max_length=253,
    )
    port: PortNumber | None = Field(
        default=None,
        description="The picker Service's port (its service port, e.g. 9002); required when "
        "kind is Service.",
    )
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose",
        description="What the gateway does when the picker does not answer: FailOpen or "
        "FailClose. Default: FailClose.",
    )


class InferencePoolSpec(ApiModel):
    """An InferencePool (inference.networking.k8s.io/v1) for this service's pods."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("!self.enabled || has(self.endpointPickerRef)",
             "endpointPickerRef is required when enabled", ".endpointPickerRef"),
        )
    )

    enabled: bool = Field(
        default=False,
        description="Create and own an InferencePool of the same name whose selector matches "
        "exactly this service's pods and whose target port is the one online traffic enters. "
        "Needs the InferencePool CRD (a condition InferencePool says when it is missing) and, "
        "with the chart, gateway.inferencePool.enabled. Default: false.",
    )
    endpoint_picker_ref: EndpointPickerRef | None = Field(
        default=None,
        description="The endpoint picker that routes to the pool; required when enabled.",
    )


class GatewaySpec(ApiModel):
    """How an inference gateway (Gateway API Inference Extension, llm-d) reaches the pods."""

    inference_pool: InferencePoolSpec = Field(
        default_factory=lambda: InferencePoolSpec.model_validate({}),
        description="The InferencePool for this service. Default: none.",
    )


class InferenceServiceSpec(ApiModel):
    """Desired state of an online LLM service whose pods may also run offline work."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "self.sidecar.httpPort != self.sidecar.grpcPort",
                "sidecar httpPort and grpcPort must differ",
                ".sidecar.grpcPort",
            ),
        )
    )

    model: str = Field(
        description="Served model name, e.g. meta-llama/Llama-2-7b-hf.",
        min_length=1,
        max_length=256,
    )
    engine: EngineSpec = Field(description="The vLLM engine container.")
    replicas: int = Field(default=1, description="Number of pods. Default: 1.", ge=0, le=1000)
    slo: SLOSpec = Field(description="Latency SLOs; at least one target.")
    scheduling: SchedulingSpec = Field(
        default_factory=lambda: SchedulingSpec.model_validate({}),
        description="Ordering and co-location.",
    )
    sidecar: SidecarSpec = Field(
        default_factory=lambda: SidecarSpec.model_validate({}), description="Sidecar container."
    )
    gateway: GatewaySpec = Field(
        default_factory=lambda: GatewaySpec.model_validate({}),
        description="Inference-gateway integration (an InferencePool). Default: none.",
    )


class ObservedLatency(ApiModel):
    """Online latency measured over the window (durations)."""

    ttft_mean: Duration | None = Field(default=None, description="Mean time to first token.")
    ttft_p99: Duration | None = Field(default=None, description="P99 time to first token.")
    tbt_mean: Duration | None = Field(default=None, description="Mean time between tokens.")
    tbt_p99: Duration | None = Field(default=None, description="P99 time between tokens.")
    window: Duration = Field(default="5m", description="Window the statistics cover. Default: 5m.")
    samples: int = Field(default=0, description="Online requests in the window. Default: 0.", ge=0)
    source: Literal["sidecar", "prometheus", "none"] = Field(
        default="none", description="Where the numbers came from: sidecar, prometheus or none."
    )


class BudgetStatus(ApiModel):
    """The per-iteration latency budget pushed to the pods."""

    iteration: Duration = Field(description="Predicted-iteration-time cap in force, e.g. 45ms.")
    searched: Duration | None = Field(
        default=None, description="Budget the SLO-aware search found for the current load and SLOs."
    )
    computed_at: datetime = Field(description="When the budget was last changed.")
    reason: str = Field(
        description="Why it has this value: Searched, Tightened, Loosened, Held.",
        pattern=CAMEL_REASON_PATTERN,
        max_length=64,
    )
    config_generation: int = Field(
        default=0, description="Generation of the Configure call that carried it. Default: 0.", ge=0
    )
    profile: str = Field(
        default="", description="Latency profile used, e.g. shipped:llama-2-7b-hf_h100."
    )


class OfflineStatus(ApiModel):
    """Offline work running on this service's pods."""

    tokens_per_second: float = Field(
        default=0.0, description="Offline output tokens per second over all pods. Default: 0.", ge=0
    )
    active_shards: int = Field(
        default=0, description="Offline shards assigned now. Default: 0.", ge=0
    )


class InferenceServiceStatus(ApiModel):
    """Observed state of an InferenceService, written by the operator."""

    observed_generation: int = Field(
        default=0, description="Last metadata.generation acted on.", ge=0
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, SLOMet, BudgetReady and, with spec.gateway.inferencePool, "
        "InferencePool.",
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    replicas: int = Field(default=0, description="Pods that exist.", ge=0)
    ready_replicas: int = Field(default=0, description="Pods whose sidecar reports ready.", ge=0)
    observed: ObservedLatency | None = Field(default=None, description="Measured online latency.")
    budget: BudgetStatus | None = Field(default=None, description="Budget in force.")
    offline: OfflineStatus | None = Field(
        default=None, description="Offline throughput on these pods."
    )
    slo_summary: str = Field(
        default="", description="Observed vs target for the tightest SLO, e.g. ttft-p99 1.2s/2s."
    )


class InferenceService(ApiModel):
    """An online LLM service with latency SLOs whose pods also run offline work."""

    api_version: Literal["slipstream.dev/v1alpha1"] = Field(
        default="slipstream.dev/v1alpha1", alias="apiVersion"
    )
    kind: Literal["InferenceService"] = "InferenceService"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None


# --------------------------------------------------------------------------- OfflineJob


class InputSpec(ApiModel):
    """Where the job's requests are (OpenAI Batch API JSONL)."""

    uri: Uri = Field(description="file:// or s3:// URI of the input JSONL file.")


class OutputSpec(ApiModel):
    """Where results go (OpenAI Batch API output JSONL)."""

    uri: Uri = Field(description="URI of the output JSONL file (written atomically at the end).")
    error_uri: Uri | None = Field(
        default=None, description="URI of the error JSONL file. Default: <uri> with .errors.jsonl."
    )

    @property
    def errors(self) -> str:
        if self.error_uri is not None:
            return self.error_uri
        base = self.uri[: -len(".jsonl")] if self.uri.endswith(".jsonl") else self.uri
        return f"{base}.errors.jsonl"


class RequestDefaults(ApiModel):
    """Body fields added to each request that does not set them."""

    max_tokens: int | None = Field(
        default=None, description="Default max_tokens.", ge=1, le=1_000_000
    )
    temperature: float | None = Field(default=None, description="Default temperature.", ge=0, le=2)

    def body_fields(self) -> dict[str, Any]:
        """The defaults as OpenAI request-body fields (``max_tokens``, not ``maxTokens``)."""
        return self.model_dump(by_alias=False, exclude_none=True, mode="json")


class Phase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class OfflineJobSpec(ApiModel):
    """Desired state of a batch of OpenAI Batch API requests run on spare capacity."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "self.input.uri != self.output.uri",
                "input and output URIs must differ",
                ".output.uri",
            ),
            (
                "!has(self.output.errorUri) || (self.output.errorUri != self.output.uri"
                " && self.output.errorUri != self.input.uri)",
                "output.errorUri must differ from the input and output URIs",
                ".output.errorUri",
            ),
            (
                "duration(self.completionWindow) >= duration('1m')"
                " && duration(self.completionWindow) <= duration('720h')",
                "completionWindow must be a duration between 1m and 720h, e.g. 24h",
                ".completionWindow",
            ),
        )
    )

    model: str = Field(
        description="Model name; must equal the hosting services' spec.model.",
        min_length=1,
        max_length=256,
    )
    input: InputSpec = Field(description="Input JSONL.")
    output: OutputSpec = Field(description="Output and error JSONL.")
    service_selector: LabelSelector = Field(
        default_factory=LabelSelector,
        description="Labels of the InferenceServices (same namespace) that may host the job. "
        "Default: every service of the same model.",
    )
    priority: int = Field(
        default=0,
        description="Higher runs first among jobs sharing pods. Default: 0.",
        ge=-1000,
        le=1000,
    )
    completion_window: Duration = Field(
        default="24h",
        description="Time from start after which unfinished requests fail. Default: 24h.",
    )
    suspend: bool = Field(
        default=False, description="Stop assigning work and revoke running shards."
    )
    request_defaults: RequestDefaults = Field(
        default_factory=lambda: RequestDefaults.model_validate({}),
        description="Defaults for request bodies.",
    )
    shard_size: int = Field(
        default=256,
        description="Requests per shard (the unit of placement). Default: 256.",
        ge=1,
        le=100_000,
    )


class RequestCounts(ApiModel):
    """Request counts (OpenAI Batch request_counts)."""

    total: int = Field(default=0, description="Lines in the input.", ge=0)
    completed: int = Field(
        default=0, description="Requests with a result in the output file.", ge=0
    )
    failed: int = Field(default=0, description="Requests with a record in the error file.", ge=0)


class ShardCounts(ApiModel):
    """Shard bookkeeping."""

    total: int = Field(default=0, description="Shards planned.", ge=0)
    assigned: int = Field(default=0, description="Shards running on a pod now.", ge=0)
    done: int = Field(default=0, description="Shards whose every request has a record.", ge=0)
    reassigned: int = Field(default=0, description="Times a shard moved to another pod.", ge=0)


class OfflineJobStatus(ApiModel):
    """Observed state of an OfflineJob, written by the operator."""

    observed_generation: int = Field(
        default=0, description="Last metadata.generation acted on.", ge=0
    )
    phase: Phase = Field(
        default=Phase.PENDING, description="Pending, Running, Suspended, Succeeded or Failed."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Admitted, Running, Suspended, Complete, Failed.",
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    requests: RequestCounts = Field(
        default_factory=lambda: RequestCounts.model_validate({}), description="Request counts."
    )
    shards: ShardCounts = Field(
        default_factory=lambda: ShardCounts.model_validate({}), description="Shard counts."
    )
    progress: str = Field(default="", description="done/total requests, e.g. 120/1000.")
    tokens_per_second: float = Field(
        default=0.0, description="Offline output tokens/s of this job.", ge=0
    )
    eta: str = Field(
        default="", description="Estimated time to completion at the current rate, e.g. 5m0s."
    )
    start_time: datetime | None = Field(
        default=None, description="When the first shard was assigned."
    )
    completion_time: datetime | None = Field(default=None, description="When the job finished.")
    output_uri: str = Field(default="", description="Where the merged output is, once Succeeded.")


class OfflineJob(ApiModel):
    """A batch of OpenAI Batch API requests run on the spare capacity of InferenceServices."""

    api_version: Literal["slipstream.dev/v1alpha1"] = Field(
        default="slipstream.dev/v1alpha1", alias="apiVersion"
    )
    kind: Literal["OfflineJob"] = "OfflineJob"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: OfflineJobSpec
    status: OfflineJobStatus | None = None


# --------------------------------------------------------------------------- semantics


def validate_semantics(spec: InferenceServiceSpec | OfflineJobSpec) -> list[str]:
    """The CEL rules, in Python: messages naming the field, empty when the spec is valid."""
    problems: list[str] = []
    if isinstance(spec, InferenceServiceSpec):
        if spec.slo.ttft is None and spec.slo.tbt is None:
            problems.append("spec.slo: set at least one SLO (ttft or tbt)")
        for name, target in (("ttft", spec.slo.ttft), ("tbt", spec.slo.tbt)):
            if target is None:
                continue
            if target.mean is None and target.p99 is None:
                problems.append(f"spec.slo.{name}: set at least one of mean and p99")
            if (
                target.mean is not None
                and target.p99 is not None
                and parse_duration(target.p99) < parse_duration(target.mean)
            ):
                problems.append(f"spec.slo.{name}.p99: p99 must be at least the mean")
        if spec.sidecar.http_port == spec.sidecar.grpc_port:
            problems.append("spec.sidecar.grpcPort: sidecar httpPort and grpcPort must differ")
        pool = spec.gateway.inference_pool
        if pool.enabled and pool.endpoint_picker_ref is None:
            problems.append("spec.gateway.inferencePool.endpointPickerRef: required when enabled")
        ref = pool.endpoint_picker_ref
        if ref is not None and ref.kind == "Service" and ref.port is None:
            problems.append("spec.gateway.inferencePool.endpointPickerRef.port: required when "
                            "kind is Service")
    else:
        if spec.input.uri == spec.output.uri:
            problems.append("spec.output.uri: input and output URIs must differ")
        if spec.output.error_uri is not None and spec.output.error_uri in (
            spec.output.uri,
            spec.input.uri,
        ):
            problems.append("spec.output.errorUri: must differ from the input and output URIs")
        window = parse_duration(spec.completion_window)
        if not 60.0 <= window <= 720 * 3600.0:
            problems.append("spec.completionWindow: must be between 1m and 720h")
    return problems


KINDS: dict[str, tuple[type[ApiModel], type[ApiModel], type[ApiModel]]] = {
    "InferenceService": (InferenceService, InferenceServiceSpec, InferenceServiceStatus),
    "OfflineJob": (OfflineJob, OfflineJobSpec, OfflineJobStatus),
}
"""kind -> (object model, spec model, status model)."""
