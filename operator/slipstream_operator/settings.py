"""Process settings of the operator, read once in ``__main__`` and passed down.

Environment variables use the prefix ``SLIPSTREAM_OPERATOR_`` (nested budget
knobs with ``__``, e.g. ``SLIPSTREAM_OPERATOR_BUDGET__DECREASE_FACTOR``);
command-line flags of ``slipstream operator`` override them.

One active replica: the operator runs kopf with ``--standalone`` semantics
(no peering) and ships as a one-replica Deployment with ``strategy:
Recreate``, because kopf peering freezes equal-priority peers instead of
electing a leader. Deliberately left out: leader election.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from slipstream_operator.api import DEFAULT_SIDECAR_IMAGE, ResourceRequirements
from slipstream_operator.budgets import BudgetParams
from slipstream_operator.calibration import CalibrationParams
from slipstream_operator.podspec import DEFAULT_GPU_PRODUCTS, GPU_NODE_LABEL, JobStorage
from slipstream_operator.simsearch import SimSearchParams


class OperatorSettings(BaseSettings):
    """Everything the operator process needs."""

    model_config = SettingsConfigDict(
        env_prefix="SLIPSTREAM_OPERATOR_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    namespaces: list[str] = Field(
        default_factory=list, description="Namespaces to watch; empty: all namespaces."
    )
    loopback_only: bool = Field(
        default=False,
        description="Test setting: skip (never dial) pods whose IP is outside 127.0.0.0/8. "
        "Default: false.",
    )
    reconcile_interval_s: float = Field(
        default=5.0, gt=0, description="Seconds between reconciles of one object. Default: 5."
    )
    sidecar_timeout_s: float = Field(
        default=5.0, gt=0, description="Deadline of one sidecar control call (s). Default: 5."
    )
    window_s: float = Field(
        default=300.0,
        gt=0,
        description="Window of the observed latency statistics (s). Default: 300.",
    )
    prometheus_url: str | None = Field(
        default=None,
        description="Prometheus base URL; unset: the sidecars' own latency counters, which "
        "each pod's Status carries (its /metrics for a sidecar without them).",
    )
    default_prompt_tokens: float = Field(
        default=1000.0,
        gt=0,
        description="Mean online prompt length assumed by the search (tokens).",
    )
    default_output_tokens: float = Field(
        default=200.0, gt=0, description="Mean online output length until observed (tokens)."
    )
    max_shards_per_pod: int = Field(
        default=2, ge=1, description="Offline shards (all jobs) one pod runs at once. Default: 2."
    )
    stall_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Seconds without progress before a shard moves. Default: 120.",
    )
    preempt_after_s: float = Field(
        default=30.0,
        ge=0,
        description=(
            "Seconds an OfflineJob finds no free shard slot before it preempts jobs of lower "
            "priority; restarted whenever more ready pods appear. Default: 30."
        ),
    )
    prefix_chars: int = Field(
        default=256,
        ge=1,
        description="Prompt characters that form the PSM prefix key. Default: 256.",
    )
    plan_run_lines: int = Field(
        default=20_000,
        ge=100,
        description="Lines sorted in memory per run while planning. Default: 20000.",
    )
    profiles_dir: Path | None = Field(
        default=None,
        description="Extra folder of latency_<model>_<gpu>.json profiles (searched first).",
    )
    storage_roots: list[str] = Field(
        default_factory=list,
        description="Storage roots (URIs, e.g. file:///var/lib/slipstream, s3://batch): an "
        "OfflineJob of namespace ns may only name input/output/error URIs under "
        "<root>/<ns>/ (slipstream_scheduler.storage_scope); passed on to the sidecars as "
        "SLIPSTREAM_SIDECAR_STORAGE_ROOTS. Default: empty = no scoping, which is unsafe on a "
        "multi-tenant cluster (any job can read and overwrite any file the operator and "
        "sidecars can reach).",
    )
    job_storage: JobStorage = Field(
        default_factory=JobStorage,
        description="Where OfflineJob files live, made reachable from every InferenceService "
        "pod: a PersistentVolumeClaim (pvc.claim_name) mounted into each sidecar container at "
        "pvc.mount_path, the path where the operator sees it (the chart's jobStorage mounts "
        "it there), and a Secret of S3 credentials (s3.credentials_secret, the sidecar's "
        "envFrom) with an optional s3.endpoint_url. From the environment as JSON, e.g. "
        '{"pvc": {"claim_name": "jobs", "mount_path": "/data/jobs"}}. A relative mount path, '
        "or one overlapping the operator's own paths, is refused. Default: none.",
    )
    prometheus_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="Overall deadline of one tick's Prometheus queries (s); past it the tick "
        "uses the sidecars' /metrics instead. Default: 2.",
    )
    apply_resync_s: float = Field(
        default=60.0,
        gt=0,
        description="Seconds after which an InferenceService's children (Secret, ConfigMap, "
        "Deployment, Service) are re-applied and its control token re-read even when the "
        "rendered objects did not change; this bounds how long a deleted or edited child, or "
        "a rotated token, goes unnoticed. Default: 60.",
    )
    kube_threads: int = Field(
        default=32,
        ge=1,
        description="Threads of the operator's own executor for blocking Kubernetes client "
        "calls (server-side applies, Secret reads). Default: 32.",
    )
    status_watch: bool = Field(
        default=False,
        description="Follow each InferenceService pod's Status as a WatchStatus stream (one per "
        "pod): its snapshots answer the ticks' looks while the stream is up, and a change the "
        "sidecar sends (budget or generation in force, readiness, draining, online counters) "
        "wakes the service's tick instead of waiting for the next interval. False: "
        "poll Status at every tick. Default: false (at 1,000 nodes on a 2-core host the streams "
        "measured worse than polling: docs/scale.md).",
    )
    status_watch_wake: bool = Field(
        default=True,
        description="With status_watch: a change a pod sends wakes its InferenceService's tick "
        "(sooner than its next interval). False: the streams only keep the replies current, "
        "and every service ticks on its fixed grid. Default: true.",
    )
    status_watch_gap_s: float = Field(
        default=0.0,
        ge=0,
        description="With status_watch: the shortest time between two change snapshots of one "
        "pod, and between two ticks of one InferenceService woken by changes (s). 0: half of "
        "reconcile_interval_s. Default: 0.",
    )
    sidecar_concurrency: int = Field(
        default=64,
        ge=1,
        description="Sidecar control calls (Status, Configure, AssignShard, RevokeShard) in "
        "flight at once, across all objects. Default: 64.",
    )
    sidecar_image: str = Field(
        default=DEFAULT_SIDECAR_IMAGE,
        min_length=1,
        max_length=512,
        description="Image of the sidecar container of every InferenceService that does not "
        "set spec.sidecar.image (the chart sets it from sidecar.image, by default the "
        f"operator's own image). Default: {DEFAULT_SIDECAR_IMAGE}.",
    )
    sidecar_resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Requests and limits (Kubernetes quantities) of the sidecar container of "
        "every InferenceService whose spec.sidecar.resources is empty; a service that sets "
        "either requests or limits keeps its own whole. From the environment as JSON, e.g. "
        '{"requests": {"cpu": "500m", "memory": "512Mi"}}. Default: none.',
    )
    gpu_node_label: str = Field(
        default=GPU_NODE_LABEL,
        max_length=317,
        description="Node label that places an InferenceService's pods by spec.engine.gpuType "
        "(a nodeSelector entry label=gpu_node_values[gpuType], for services with gpus above "
        "0); a spec.template.spec.nodeSelector naming it with another value is invalid. "
        f"Empty: no placement. Default: {GPU_NODE_LABEL} (set by NVIDIA GPU feature "
        "discovery).",
    )
    gpu_node_values: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_GPU_PRODUCTS),
        description="gpuType (lower case) -> value of gpu_node_label; a gpuType not listed "
        "gets no placement. From the environment as JSON, replacing the whole map. Default: "
        + json.dumps(DEFAULT_GPU_PRODUCTS) + ".",
    )
    budget: BudgetParams = Field(
        default_factory=lambda: BudgetParams.model_validate({}),
        description="Budget adaptation knobs.",
    )
    budget_search: SimSearchParams = Field(
        default_factory=lambda: SimSearchParams.model_validate({}),
        description="Simulated budget search (HyGen's profiler) and its cache "
        "(docs/concepts/budgets.md).",
    )
    calibration: CalibrationParams = Field(
        default_factory=lambda: CalibrationParams.model_validate({}),
        description="Latency-model refit from the sidecars' step timings.",
    )
    learned_max_mape: float = Field(
        default=0.10,
        gt=0,
        description="Largest held-out error (mean absolute percentage error on recent steps "
        "the fit did not see, as a fraction) at which a latency model a pod learned from its "
        "own engine is used, for a service without a latency profile. Default: 0.1.",
    )
    learned_min_steps: int = Field(
        default=200,
        ge=1,
        description="Fewest engine steps a learned latency model must have been learned from "
        "(steps the pod's sidecar has seen) to be used. Default: 200.",
    )
    gc_young_threshold: int = Field(
        default=50_000,
        ge=0,
        description="Allocations between two collections of the youngest generation of "
        "Python's garbage collector; larger lets objects that live for one tick die young "
        "instead of being promoted to the costly oldest generation. 0: Python's default "
        "(700). Default: 50000.",
    )
    gc_freeze_interval_s: float = Field(
        default=600.0,
        ge=0,
        description="Freeze what is alive (gc.freeze) so that routine collections skip the "
        "long-lived heap: first after 60 s, the gaps doubling up to this many seconds; a "
        "freeze once this long after the last full one first collects everything (one pause), "
        "so cyclic garbage is still freed. 0: never. Default: 600.",
    )
    delete_drain_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="On InferenceService deletion, seconds to wait for its pods to give up "
        "their offline shards (revoked so OfflineJobs re-place them) before the finalizer is "
        "released. Default: 30.",
    )
