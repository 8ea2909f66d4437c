"""The pod of an InferenceService: ``spec -> pod template``, pure.

The operator owns a part of every pod and the spec adds the rest (the merge rule,
docs/install.md):

* **Owned** (reserved; a spec that sets any of it is invalid, ``api.pod_problems`` names the
  field): the containers ``vllm`` and ``sidecar`` with their images' entry arguments, vLLM's
  ``--model``, ``--served-model-name``, ``--host``, ``--port``, ``--scheduling-policy`` and
  ``--scheduler-cls``; vLLM's port 8001 and the sidecar's ``httpPort``/``grpcPort``; the
  volumes ``control-token``, ``config``, ``engine-channel``, ``dshm``, ``model-store``,
  ``job-storage`` and ``sidecar-state`` and the paths ``/var/run/slipstream``,
  ``/etc/slipstream``, ``/dev/shm`` (and ``/mnt/models`` with a ``pvc://`` model source);
  ``SLIPSTREAM_*`` environment variables; ``nvidia.com/gpu`` (from ``spec.engine.gpus``); the
  labels ``slipstream.dev/service`` and ``app.kubernetes.io/managed-by`` and the
  ``prometheus.io/*`` annotations the operator sets.
* **Added** as written: ``spec.engine.env``/``envFrom``/``volumeMounts``/``resources`` on the
  ``vllm`` container (the operator's own entries first), ``spec.template.metadata`` on the
  pod, and ``spec.template.spec``'s volumes, tolerations, affinity, image pull secrets,
  service account and priority class.
* **Merged**: ``nodeSelector`` is the spec's plus the GPU placement label
  (:class:`GpuPlacement`: ``gpuType`` -> a node label value, by default NVIDIA GPU feature
  discovery's ``nvidia.com/gpu.product``); the spec naming that label with another value is
  an error (:func:`placement_problems`), the same value is fine.

Model source: ``spec.modelSource.uri`` ``hf://org/name`` is vLLM's ``--model org/name`` with
``HF_TOKEN`` from the token Secret; ``pvc://claim/path`` mounts the claim read-only at
``/mnt/models`` and loads ``/mnt/models/path``; an absolute path is loaded as it is. vLLM
always serves the model as ``spec.model`` (``--served-model-name``), the name jobs and
clients use.

Job storage (:class:`JobStorage`, the operator's setting ``job_storage``, one for the whole
cluster; the chart's ``jobStorage``): the claim ``pvc.claim_name`` is mounted as the volume
``job-storage`` into the sidecar container at ``pvc.mount_path``, the path where the operator
(the chart mounts the same claim there) sees it, so a ``file://`` job path means the same file
in both; ``s3.credentials_secret`` is the sidecar's ``envFrom`` (the ``AWS_*`` keys s3fs reads)
and ``s3.endpoint_url`` its ``FSSPEC_S3_ENDPOINT_URL`` and ``AWS_ENDPOINT_URL``. Both name
objects of the pod's own namespace: every namespace that runs InferenceServices needs them.
The ``vllm`` container gets none of it.

Deliberately left out: the sidecar's own env and mounts (the operator's alone), init
containers, and a whole PodSpec passthrough (fields not named above are not offered).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from slipstream_operator.api import (
    DNS_NAME_PATTERN,
    ENGINE_PORT,
    GPU_RESOURCE,
    MODEL_MOUNT,
    RESERVED_MOUNT_PREFIXES,
    SHM_MOUNT,
    Enforcement,
    InferenceServiceSpec,
    ResourceRequirements,
)
from slipstream_operator.errors import SpecError
from slipstream_operator.simsearch import engine_limit_args

CHANNEL_VOLUME = "engine-channel"
CHANNEL_MOUNT = "/var/run/slipstream/channel"
"""Where both containers mount the engine channel's emptyDir in engine mode."""
STATE_VOLUME = "sidecar-state"
STATE_MOUNT = "/var/run/slipstream/state"
"""The sidecar's durable state (its shards, the configuration in force, a profile made at
start): an emptyDir, so it outlives a restart of the sidecar container, not the pod's."""
TOKEN_KEY = "token"
TOKEN_MOUNT = "/var/run/slipstream/control"
CONFIG_MOUNT = "/etc/slipstream"
SHM_VOLUME = "dshm"
MODEL_VOLUME = "model-store"
JOB_STORAGE_VOLUME = "job-storage"
"""The job storage claim's volume in every pod (reserved: ``api.RESERVED_VOLUMES``)."""
JOB_STORAGE_MOUNT = "/data/jobs"
"""Where the job storage claim is mounted unless ``job_storage.pvc.mount_path`` says otherwise."""
OPERATOR_POD_PATHS = ("/tmp",)
"""The operator pod's own mounts (the chart's writable ``/tmp``), beside the inference pods'."""
JOB_STORAGE_RESERVED_PATHS = (*RESERVED_MOUNT_PREFIXES, SHM_MOUNT, MODEL_MOUNT,
                              *OPERATOR_POD_PATHS)
"""Paths the job storage mount may neither equal nor lie above or below: the operator's
mounts in the inference pods and in its own pod (the chart lists the same,
``templates/deployment.yaml``)."""

GPU_NODE_LABEL = "nvidia.com/gpu.product"
"""The node label NVIDIA's GPU feature discovery sets to the GPU's product name."""
DEFAULT_GPU_PRODUCTS: dict[str, str] = {
    "h100": "NVIDIA-H100-80GB-HBM3",
    "a100": "NVIDIA-A100-SXM4-80GB",
}
"""``gpuType`` -> ``nvidia.com/gpu.product`` for the GPU types of the shipped profiles."""


@dataclass(frozen=True, slots=True)
class GpuPlacement:
    """Which node label a ``gpuType`` requires (the operator's settings ``gpu_node_label`` and
    ``gpu_node_values``). An empty label turns placement off; a ``gpuType`` missing from
    ``values`` (compared in lower case) and a service with ``gpus: 0`` get no label."""

    label: str = GPU_NODE_LABEL
    values: tuple[tuple[str, str], ...] = tuple(sorted(DEFAULT_GPU_PRODUCTS.items()))

    @classmethod
    def of(cls, label: str, values: Mapping[str, str]) -> GpuPlacement:
        return cls(label, tuple(sorted((k.lower(), v) for k, v in values.items())))

    def selector(self, spec: InferenceServiceSpec) -> dict[str, str]:
        """The node selector entry ``spec``'s GPU type requires (empty: none)."""
        if not self.label or spec.engine.gpus == 0:
            return {}
        value = dict(self.values).get(spec.engine.gpu_type.lower())
        return {} if value is None else {self.label: value}


DEFAULT_PLACEMENT = GpuPlacement()
"""``nvidia.com/gpu.product`` with :data:`DEFAULT_GPU_PRODUCTS`."""


def placement_problems(spec: InferenceServiceSpec, placement: GpuPlacement) -> list[str]:
    """A ``spec.template.spec.nodeSelector`` entry that contradicts the GPU placement."""
    return [
        f"spec.template.spec.nodeSelector[{key!r}]: {mine!r} contradicts gpuType "
        f"{spec.engine.gpu_type} ({key}={value})"
        for key, value in placement.selector(spec).items()
        if (mine := spec.template.spec.node_selector.get(key, value)) != value
    ]


def node_selector(spec: InferenceServiceSpec, placement: GpuPlacement) -> dict[str, str]:
    """The spec's node selector plus the GPU placement label; raises :class:`SpecError` on a
    conflict (the handler reports it first, as a ``Ready`` condition)."""
    problems = placement_problems(spec, placement)
    if problems:
        raise SpecError("; ".join(problems), field_path="spec.template.spec.nodeSelector")
    return {**spec.template.spec.node_selector, **placement.selector(spec)}


class JobStoragePvc(BaseModel):
    """A PersistentVolumeClaim holding the ``file://`` job storage."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    claim_name: str = Field(
        default="", max_length=253, pattern=f"^$|{DNS_NAME_PATTERN}",
        description="Claim mounted into the sidecar container of every InferenceService pod "
        "(a claim of this name in each namespace that runs InferenceServices) and, by the "
        "chart, into the operator. Empty: no claim. Default: empty.",
    )
    mount_path: str = Field(
        default=JOB_STORAGE_MOUNT, min_length=1, max_length=1024,
        description="Absolute path of the claim, the same in the operator and the sidecars, "
        "so a file:// job URI under it names the same file in both; not the operator's own "
        "paths (" + ", ".join(JOB_STORAGE_RESERVED_PATHS) + f"). Default: {JOB_STORAGE_MOUNT}.",
    )
    read_only: bool = Field(
        default=False,
        description="Mount the claim read-only in the sidecars (outputs then need other "
        "storage). Default: false.",
    )


class JobStorageS3(BaseModel):
    """Credentials for ``s3://`` job URIs (s3fs through fsspec)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    credentials_secret: str = Field(
        default="", max_length=253, pattern=f"^$|{DNS_NAME_PATTERN}",
        description="Secret whose keys (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_SESSION_TOKEN, ...) become the sidecar container's environment (envFrom), "
        "read from each InferenceService's namespace; the chart gives the operator the one of "
        "its own namespace. Empty: none. Default: empty.",
    )
    endpoint_url: str = Field(
        default="", max_length=1024, pattern=r"^$|^https?://[^\s]+$",
        description="S3 endpoint (e.g. MinIO's), as FSSPEC_S3_ENDPOINT_URL and "
        "AWS_ENDPOINT_URL. Empty: AWS. Default: empty.",
    )


class JobStorage(BaseModel):
    """Where OfflineJob files live, made reachable from every inference pod's sidecar: a
    claim mounted at the operator's path and S3 credentials (the operator's setting
    ``job_storage``; the chart's ``jobStorage``). Empty: nothing is added to the pods."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pvc: JobStoragePvc = Field(default_factory=JobStoragePvc, description="The claim.")
    s3: JobStorageS3 = Field(default_factory=JobStorageS3, description="S3 credentials.")

    @model_validator(mode="after")
    def _valid(self) -> JobStorage:
        problems = job_storage_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def staging_root(self) -> str | None:
        """Where object-store outputs' work folders live: the claim's mount path when a
        writable claim is set (the operator and every sidecar see it there), else None."""
        pvc = self.pvc
        return pvc.mount_path if pvc.claim_name and not pvc.read_only else None

    def sidecar_env(self) -> list[dict[str, Any]]:
        """The sidecar's S3 endpoint variables (none without an endpoint)."""
        url = self.s3.endpoint_url
        return ([{"name": "FSSPEC_S3_ENDPOINT_URL", "value": url},
                 {"name": "AWS_ENDPOINT_URL", "value": url}] if url else [])

    def sidecar_env_from(self) -> list[dict[str, Any]]:
        secret = self.s3.credentials_secret
        return [{"secretRef": {"name": secret}}] if secret else []

    def sidecar_mounts(self) -> list[dict[str, Any]]:
        if not self.pvc.claim_name:
            return []
        mount: dict[str, Any] = {"name": JOB_STORAGE_VOLUME, "mountPath": self.pvc.mount_path}
        if self.pvc.read_only:
            mount["readOnly"] = True
        return [mount]

    def volumes(self) -> list[dict[str, Any]]:
        if not self.pvc.claim_name:
            return []
        claim: dict[str, Any] = {"claimName": self.pvc.claim_name}
        if self.pvc.read_only:
            claim["readOnly"] = True
        return [{"name": JOB_STORAGE_VOLUME, "persistentVolumeClaim": claim}]


def job_storage_problems(storage: JobStorage) -> list[str]:
    """What makes ``storage`` unusable, one message per problem naming the setting: a relative
    mount path, or one that equals, contains or lies inside an operator path."""
    where = "job_storage.pvc.mount_path"
    raw = storage.pvc.mount_path
    if not raw.startswith("/"):
        return [f"{where}: {raw!r} is not an absolute path"]
    path = raw.rstrip("/") or "/"
    parts = path.split("/")
    if "." in parts or ".." in parts:
        return [f"{where}: {raw!r} has . or .. segments"]
    clash = [r for r in JOB_STORAGE_RESERVED_PATHS
             if path in ("/", r) or path.startswith(r + "/") or r.startswith(path + "/")]
    if clash:
        return [f"{where}: {raw!r} overlaps the operator's {clash[0]} (reserved: "
                f"{', '.join(JOB_STORAGE_RESERVED_PATHS)})"]
    return []


NO_JOB_STORAGE = JobStorage()
"""No claim, no credentials: the pods get nothing for job storage."""


def _engine_mode(spec: InferenceServiceSpec) -> bool:
    return spec.scheduling.enforcement == Enforcement.ENGINE


def model_args(spec: InferenceServiceSpec) -> list[str]:
    """vLLM's ``--model`` (the source's id or path, else ``spec.model``), ``--served-model-name``
    (always ``spec.model``) and, for a Hugging Face source with one, ``--revision``."""
    source = spec.model_source
    args = ["--model", source.vllm_model() if source is not None else spec.model,
            "--served-model-name", spec.model]
    if source is not None and source.revision is not None:
        args += ["--revision", source.revision]
    return args


def _engine_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    own = spec.engine.resources
    resources: dict[str, Any] = {}
    if own.requests:
        resources["requests"] = own.wire()["requests"]
    limits = dict(own.wire()["limits"])
    if spec.engine.gpus:
        limits[GPU_RESOURCE] = str(spec.engine.gpus)
    if limits:
        resources["limits"] = limits
    return resources


def engine_container(spec: InferenceServiceSpec, args: list[str]) -> dict[str, Any]:
    """The ``vllm`` container running ``args``: the operator's env and mounts first, then the
    spec's."""
    engine_mode = _engine_mode(spec)
    env: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if engine_mode:
        env.append({"name": "SLIPSTREAM_CHANNEL_DIR", "value": CHANNEL_MOUNT})
        mounts.append({"name": CHANNEL_VOLUME, "mountPath": CHANNEL_MOUNT})
    source = spec.model_source
    if source is not None and source.hf_token_secret is not None:
        ref = source.hf_token_secret
        env.append({"name": "HF_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    if source is not None and source.claim() is not None:
        mounts.append({"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True})
    if spec.engine.shm_size is not None:
        mounts.append({"name": SHM_VOLUME, "mountPath": SHM_MOUNT})
    env += [e.wire() for e in spec.engine.env]
    mounts += [m.wire() for m in spec.engine.volume_mounts]
    container: dict[str, Any] = {
        "name": "vllm",
        "image": spec.engine.image,
        "args": args,
        "resources": _engine_resources(spec),
    }
    if env:
        container["env"] = env
    if spec.engine.env_from:
        container["envFrom"] = [e.wire() for e in spec.engine.env_from]
    if engine_mode:
        container["ports"] = [{"name": "engine", "containerPort": ENGINE_PORT}]
    if mounts:
        container["volumeMounts"] = mounts
    return container


def sidecar_container(
    spec: InferenceServiceSpec, *, image: str, resources: ResourceRequirements,
    storage_roots: tuple[str, ...], latency_file: bool,
    job_storage: JobStorage = NO_JOB_STORAGE,
) -> dict[str, Any]:
    """The ``sidecar`` container (the operator's alone), with the job storage's claim, S3
    credentials and endpoint."""
    engine_mode = _engine_mode(spec)
    env = [
        {"name": "SLIPSTREAM_SIDECAR_ENGINE", "value": f"http://127.0.0.1:{ENGINE_PORT}"},
        {"name": "SLIPSTREAM_SIDECAR_HOST", "value": "0.0.0.0"},
        {"name": "SLIPSTREAM_SIDECAR_HTTP_PORT", "value": str(spec.sidecar.http_port)},
        {"name": "SLIPSTREAM_SIDECAR_GRPC_PORT", "value": str(spec.sidecar.grpc_port)},
        {"name": "SLIPSTREAM_SIDECAR_MODEL", "value": spec.model},
        {"name": "SLIPSTREAM_SIDECAR_ORDERING", "value": spec.scheduling.ordering.value},
        {"name": "SLIPSTREAM_SIDECAR_AUTH_TOKEN_FILE", "value": f"{TOKEN_MOUNT}/{TOKEN_KEY}"},
        {"name": "SLIPSTREAM_SIDECAR_STATE_DIR", "value": STATE_MOUNT},
    ]
    # The sidecar prices batches as the engine forms them: it gets the engine's batching
    # flags that the spec sets (the rest keep vLLM's defaults on both sides).
    env += [{"name": f"SLIPSTREAM_SIDECAR_{name.upper()}", "value": str(value)}
            for name, value in engine_limit_args(spec.engine.args).items()]
    if storage_roots:
        # pydantic-settings reads a list setting from the environment as JSON.
        env.append({"name": "SLIPSTREAM_SIDECAR_STORAGE_ROOTS",
                    "value": json.dumps(list(storage_roots))})
    if latency_file:
        env.append({"name": "SLIPSTREAM_SIDECAR_LATENCY_MODEL_FILE",
                    "value": f"{CONFIG_MOUNT}/latency.json"})
    profile_s = spec.scheduling.profile_at_start_s()
    if profile_s > 0:
        # /ready answers 503 while the sidecar profiles the engine; the readiness probe only
        # keeps the pod out of the Service meanwhile (no liveness or startup probe restarts it).
        env.append({"name": "SLIPSTREAM_SIDECAR_PROFILE_AT_START_S", "value": f"{profile_s:g}"})
    env += job_storage.sidecar_env()
    container: dict[str, Any] = {
        "name": "sidecar",
        "image": image,
        "args": ["sidecar", *(("--engine-channel", CHANNEL_MOUNT) if engine_mode else ())],
        "env": env,
        "ports": [
            {"name": "http", "containerPort": spec.sidecar.http_port},
            {"name": "grpc", "containerPort": spec.sidecar.grpc_port},
        ],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
        "resources": resources.wire(),
        "volumeMounts": [
            {"name": "control-token", "mountPath": TOKEN_MOUNT, "readOnly": True},
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": STATE_VOLUME, "mountPath": STATE_MOUNT},
            *([{"name": CHANNEL_VOLUME, "mountPath": CHANNEL_MOUNT}] if engine_mode else []),
            *job_storage.sidecar_mounts(),
        ],
    }
    env_from = job_storage.sidecar_env_from()
    if env_from:
        container["envFrom"] = env_from
    return container


def pod_volumes(spec: InferenceServiceSpec, *, secret: str, configmap: str,
                job_storage: JobStorage = NO_JOB_STORAGE) -> list[dict[str, Any]]:
    """The operator's volumes (the job storage claim's among them), then
    ``spec.template.spec.volumes``."""
    volumes: list[dict[str, Any]] = [
        {"name": "control-token", "secret": {"secretName": secret}},
        {"name": "config", "configMap": {"name": configmap}},
        {"name": STATE_VOLUME, "emptyDir": {}},
    ]
    if _engine_mode(spec):
        volumes.append({"name": CHANNEL_VOLUME, "emptyDir": {}})
    if spec.engine.shm_size is not None:
        volumes.append({"name": SHM_VOLUME,
                        "emptyDir": {"medium": "Memory", "sizeLimit": spec.engine.shm_size}})
    claim = spec.model_source.claim() if spec.model_source is not None else None
    if claim is not None:
        volumes.append({"name": MODEL_VOLUME,
                        "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
    volumes += job_storage.volumes()
    return volumes + [v.wire() for v in spec.template.spec.volumes]


def pod_template(
    spec: InferenceServiceSpec, *, labels: Mapping[str, str], secret: str, configmap: str,
    engine: dict[str, Any], sidecar: dict[str, Any], placement: GpuPlacement,
    job_storage: JobStorage = NO_JOB_STORAGE,
) -> dict[str, Any]:
    """The Deployment's pod template: the operator's labels and annotations over the spec's
    (the spec cannot name the operator's keys), both containers, and the pod-level fields;
    ``job_storage`` is the claim the ``sidecar`` container mounts."""
    overrides = spec.template.spec
    pod: dict[str, Any] = {
        "containers": [engine, sidecar],
        "volumes": pod_volumes(spec, secret=secret, configmap=configmap,
                               job_storage=job_storage),
    }
    selector = node_selector(spec, placement)
    if selector:
        pod["nodeSelector"] = selector
    if overrides.tolerations:
        pod["tolerations"] = [t.wire() for t in overrides.tolerations]
    if overrides.affinity is not None:
        pod["affinity"] = overrides.affinity
    if overrides.image_pull_secrets:
        pod["imagePullSecrets"] = [s.wire() for s in overrides.image_pull_secrets]
    if overrides.service_account_name is not None:
        pod["serviceAccountName"] = overrides.service_account_name
    if overrides.priority_class_name is not None:
        pod["priorityClassName"] = overrides.priority_class_name
    meta = spec.template.metadata
    return {
        "metadata": {
            "labels": {**meta.labels, **labels},
            "annotations": {**meta.annotations, "prometheus.io/scrape": "true",
                            "prometheus.io/port": str(spec.sidecar.http_port)},
        },
        "spec": pod,
    }
