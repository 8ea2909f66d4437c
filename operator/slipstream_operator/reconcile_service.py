"""InferenceService reconciler: ``(spec, observed, now) -> (children, status, pushes)``.

Pure. Given the spec, what the handler observed (pods with their sidecar
status, the latency window, the auth token, the latency model) and the
previous budget memory, it returns

* the child objects to apply (Secret with the control-API token, ConfigMap
  with the latency model and settings, Deployment, Service), each with an
  ownerReference to the InferenceService so deleting it garbage-collects them;
* the status to write (conditions Ready / SLOMet / BudgetReady, observed
  latency, budget, offline throughput, replica counts, and the engine's KV cache
  the budget search simulates);
* the Configure calls to push (ready pods whose configuration generation is
  behind), and the next budget memory. ``BudgetReady`` is ``Pushing`` while any
  ready pod is behind; the handler writes the status before it pushes, so the
  condition turns True on the first reconcile that sees every pod at the
  generation.

Latency model: the one in force (``modelchoice``): the profile's model times the
calibration scale refitted from the pods' predicted/observed step times
(``calibration``), else, for a service without a profile, the model a ready pod
learned from its own engine (never calibrated). The model in force is what the
Configure calls carry; the ConfigMap carries a profile's (scaled) model only, so
that a learned model appearing never changes the pod template. A refit or a new
learned revision makes a new search (the budget's ``model_key`` includes the scale,
or the learned model's pod and revision) and a ``LatencyModelRefit`` or
``LatencyModelLearned`` event; ``status.latencyModel`` and the ``BudgetReady``
message say which model is in force, and ``NoLatencyModel`` how far learning got.
The budget search is asked for through ``search_for`` with a
:class:`~slipstream_operator.searchpool.SearchSubject` (in the simulator's
``in-engine`` mode for ``scheduling.enforcement: engine``); its evidence (the
simulator trials) goes into the ``BudgetSearched`` event and the
``BudgetReady`` condition's message, and an unattainable SLO (even the
online-only budget misses it in simulation) makes ``BudgetReady`` say
``SLOUnattainable`` while the online-only budget is pushed. The search simulates the
engine's KV cache as the ready pods read it from their engines (each sidecar reports vLLM's
``num_gpu_blocks`` and ``block_size`` in Status), else as the engine's
``--num-gpu-blocks-override`` gives it; ``status.kvCache`` shows which.

Pod shape: vLLM listens on 127.0.0.1:8001 inside the pod (only the sidecar
reaches it) and runs ``--scheduling-policy priority``; the sidecar serves the
OpenAI API on ``httpPort`` (the Service's target) and control gRPC on
``grpcPort`` (dialled by the operator on the pod IP). The sidecar's image and
resources are ``spec.sidecar``'s when set, else the operator's cluster-wide
defaults (``ServiceObserved.sidecar_image`` / ``sidecar_resources``, from its
settings, i.e. the chart's ``sidecar.image`` / ``sidecar.resources``).
With ``scheduling.enforcement: engine`` vLLM instead listens on 0.0.0.0:8001 and
runs Slipstream's scheduler plugin (``--scheduler-cls``, on vLLM's async scheduler unless the
spec's args turn async scheduling off),
the Service targets vLLM's port, and both containers mount an ``emptyDir`` (the
engine channel: ``SLIPSTREAM_CHANNEL_DIR`` for vLLM, ``--engine-channel`` for the
sidecar; docs/plugin.md). The Deployment keeps its default rolling update; the
operator's own Deployment is the one with ``strategy: Recreate``.

Deliberately left out: applying anything (``handlers``), autoscaling (replicas
are the user's), Ingress/Gateway objects (route to the Service), and the
InferencePool of ``spec.gateway.inferencePool`` (``gateway``: the handler applies it after
these children, since a missing CRD must cost only a condition).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from slipstream_operator.api import (
    API_VERSION,
    DEFAULT_SIDECAR_IMAGE,
    ENGINE_PORT,
    ConditionStatus,
    Enforcement,
    InferenceServiceSpec,
    LatencyModelPolicy,
    ResourceRequirements,
    format_duration,
)
from slipstream_operator.budgets import (
    BudgetParams,
    BudgetSearch,
    BudgetState,
    ObservedSLO,
    SLOTargets,
    decide,
    worst_metric,
)
from slipstream_operator.calibration import (
    Calibration,
    CalibrationParams,
    StepSample,
    observe,
    scaled,
)
from slipstream_operator.conditions import rfc3339, set_condition
from slipstream_operator.modelchoice import LearnedParams, ModelChoice, ModelInForce, choose_model
from slipstream_operator.observe import WindowStats
from slipstream_operator.podspec import (
    DEFAULT_PLACEMENT,
    NO_JOB_STORAGE,
    TOKEN_KEY,
    GpuPlacement,
    JobStorage,
    engine_container,
    model_args,
    pod_template,
    sidecar_container,
)
from slipstream_operator.rates import TokenMeter
from slipstream_operator.searchpool import SearchSubject
from slipstream_operator.sidecar_client import ACTIVE_STATES, ConfigureCall, SidecarStatus
from slipstream_operator.simsearch import KvSize, engine_limits, service_kv
from slipstream_scheduler.latency import FEATURE_NAMES, LinearLatencyModel

SERVICE_LABEL = "slipstream.dev/service"
MANAGED_BY = {"app.kubernetes.io/managed-by": "slipstream-operator"}
PLUGIN_SCHEDULER_CLS = "slipstream_vllm.scheduler.SlipstreamScheduler"
"""The plugin on vLLM's AsyncScheduler (async scheduling on, vLLM's default)."""
PLUGIN_SYNC_SCHEDULER_CLS = "slipstream_vllm.scheduler.SlipstreamSyncScheduler"
"""The plugin on vLLM's synchronous Scheduler, for a spec whose args turn async off."""
"""vLLM's ``--scheduler-cls`` in engine mode (docs/plugin.md)."""
OFFLINE_RATE_WINDOW_S = 60.0  # status.offline.tokensPerSecond: output tokens over this window


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """Identity of the object being reconciled."""

    name: str
    namespace: str
    uid: str
    generation: int
    kind: str = "InferenceService"

    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True, slots=True)
class PodView:
    """A pod of the service: its IP and, when reachable, its sidecar's status."""

    name: str
    ip: str
    running: bool
    sidecar: SidecarStatus | None = None

    @property
    def ready(self) -> bool:
        return (
            self.running
            and self.sidecar is not None
            and self.sidecar.engine_ready
            and not self.sidecar.draining
        )


@dataclass(frozen=True, slots=True)
class ServiceObserved:
    pods: tuple[PodView, ...]
    token: str
    window: WindowStats | None
    latency_model: LinearLatencyModel | None
    profile: str  # where the model came from, e.g. shipped:latency_x_h100.json
    window_label: str = "5m"
    window_source: str = "sidecar"  # or "prometheus"
    storage_roots: tuple[str, ...] = ()  # passed to the sidecars; empty: no scoping
    # The operator's sidecar defaults (settings sidecar_image / sidecar_resources), for a spec
    # that leaves spec.sidecar.image unset or spec.sidecar.resources empty.
    sidecar_image: str = DEFAULT_SIDECAR_IMAGE
    sidecar_resources: ResourceRequirements = field(default_factory=ResourceRequirements)
    # The node label each gpuType requires (settings gpu_node_label / gpu_node_values).
    placement: GpuPlacement = field(default_factory=GpuPlacement)
    # The job storage every sidecar mounts (settings job_storage).
    job_storage: JobStorage = NO_JOB_STORAGE


@dataclass(frozen=True, slots=True)
class ServiceMemory:
    """What the operator remembers between reconciles of one service (lost on restart)."""

    budget: BudgetState | None = None
    config_generation: int = 0
    config_fingerprint: str = ""
    computed_at: str = ""
    calibration: Calibration = field(default_factory=Calibration)
    rendered: RenderedChildren | None = None
    offline_tokens: TokenMeter = field(default_factory=TokenMeter)  # offline output tokens
    # The latency model last in force (kept through reconciles without one, so that a pod
    # missing one tick neither loses its place nor announces its model again).
    in_force: ModelInForce | None = None


@dataclass(frozen=True, slots=True)
class RenderedChildren:
    """The children as last rendered, and everything they were rendered from: a tick whose
    inputs are equal reuses the same objects instead of building them again (the latency
    model's JSON alone was 6 % of the operator's event loop at 1,000 nodes)."""

    inputs: tuple[Any, ...]
    objects: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class ServiceOutcome:
    children: tuple[dict[str, Any], ...]
    status: dict[str, Any]
    pushes: tuple[tuple[str, ConfigureCall], ...]  # (pod name, call)
    memory: ServiceMemory
    events: tuple[tuple[str, str, str], ...] = field(default=())  # (type, reason, message)



def plugin_class(engine_args: list[str]) -> str:
    """The plugin class that matches the engine's scheduling: vLLM schedules asynchronously
    unless the spec's args say ``--no-async-scheduling`` (or ``--async-scheduling false``)."""
    off = "--no-async-scheduling" in engine_args or any(
        a == "--async-scheduling" and i + 1 < len(engine_args)
        and engine_args[i + 1].lower() in ("false", "0")
        for i, a in enumerate(engine_args)
    )
    return PLUGIN_SYNC_SCHEDULER_CLS if off else PLUGIN_SCHEDULER_CLS

def names(ref: ObjectRef) -> dict[str, str]:
    """Child object names."""
    return {
        "deployment": ref.name,
        "service": ref.name,
        "configmap": f"{ref.name}-slipstream",
        "secret": f"{ref.name}-control-token",
    }


def _meta(ref: ObjectRef, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": {SERVICE_LABEL: ref.name, **MANAGED_BY},
        "ownerReferences": [ref.owner_reference()],
    }


def children(
    ref: ObjectRef, spec: InferenceServiceSpec, token: str, model: LinearLatencyModel | None,
    *, storage_roots: tuple[str, ...] = (), sidecar_image: str = DEFAULT_SIDECAR_IMAGE,
    sidecar_resources: ResourceRequirements | None = None,
    placement: GpuPlacement = DEFAULT_PLACEMENT, job_storage: JobStorage = NO_JOB_STORAGE,
) -> tuple[dict[str, Any], ...]:
    """Secret, ConfigMap, Deployment and Service for the spec.

    The sidecar container runs ``spec.sidecar.image``, else ``sidecar_image`` (the operator's
    default), with ``spec.sidecar.resources`` unless both its requests and limits are empty,
    else ``sidecar_resources``. The pod is ``podspec``'s (the merge rule is there); raises
    :class:`~slipstream_operator.errors.SpecError` when the spec's nodeSelector contradicts
    ``placement``. ``job_storage`` is mounted into the sidecar container.
    """
    n = names(ref)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(ref, n["secret"]),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }
    config_data = {
        "model": spec.model,
        "ordering": spec.scheduling.ordering.value,
        "coLocation": "true" if spec.scheduling.co_location else "false",
    }
    if model is not None:
        config_data["latency.json"] = model.to_json()
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(ref, n["configmap"]),
        "data": config_data,
    }
    selector = {SERVICE_LABEL: ref.name}
    engine_mode = spec.scheduling.enforcement == Enforcement.ENGINE
    engine_args = [
        *model_args(spec),
        "--scheduling-policy", "priority",
        # Engine mode: the Service sends online traffic to vLLM itself.
        "--host", "0.0.0.0" if engine_mode else "127.0.0.1",
        "--port", str(ENGINE_PORT),
        *(("--scheduler-cls", plugin_class(spec.engine.args)) if engine_mode else ()),
        *spec.engine.args,
    ]
    own = spec.sidecar.resources
    sidecar = sidecar_container(
        spec, image=spec.sidecar.image or sidecar_image,
        resources=(own if own.requests or own.limits or sidecar_resources is None
                   else sidecar_resources),
        storage_roots=storage_roots, latency_file=model is not None, job_storage=job_storage)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(ref, n["deployment"]),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector},
            "template": pod_template(
                spec, labels={**selector, **MANAGED_BY}, secret=n["secret"],
                configmap=n["configmap"], engine=engine_container(spec, engine_args),
                sidecar=sidecar, placement=placement, job_storage=job_storage),
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ref, n["service"]),
        "spec": {
            "selector": selector,
            # Online traffic: the sidecar's port, or vLLM's own in engine mode.
            "ports": [{"name": "http", "port": spec.sidecar.http_port,
                       "targetPort": "engine" if engine_mode else "http"}],
        },
    }
    return (secret, configmap, deployment, service)


def _reason_for(metric: str) -> str:
    """``ttft-p99`` -> ``TTFTP99Exceeded``, ``tbt-mean`` -> ``TBTMeanExceeded``."""
    kind, stat = metric.split("-")
    return f"{kind.upper()}{stat.capitalize() if stat == 'mean' else stat.upper()}Exceeded"


def _configure_call(
    generation: int, budget_s: float | None, targets: SLOTargets, spec: InferenceServiceSpec,
    model: LinearLatencyModel | None, *, idle_budget_s: float | None = None,
) -> ConfigureCall:
    """The Configure call for ``generation``. The idle budget is always sent (0: none, the
    budget applies always), so a pod never keeps one the operator no longer means; with
    co-location off both are 0: no offline work at all."""
    coefficients: dict[str, float] = {}
    kind = ""
    knee = 0
    if model is not None:
        kind = model.feature_set.value
        knee = model.knee_tokens
        coefficients = {
            n: c for n, c in zip(FEATURE_NAMES, model.coefficients, strict=True) if c != 0.0
        }
    return ConfigureCall(
        generation=generation,
        budget_s=budget_s if spec.scheduling.co_location else 0.0,
        ttft_mean_s=targets.ttft_mean_s,
        ttft_p99_s=targets.ttft_p99_s,
        tbt_mean_s=targets.tbt_mean_s,
        tbt_p99_s=targets.tbt_p99_s,
        ordering=spec.scheduling.ordering.value,
        latency_kind=kind,
        latency_coefficients=coefficients,
        latency_knee_tokens=knee,
        latency_token_curve=model.token_curve if model is not None else (),
        latency_curve_step_tokens=model.curve_step_tokens if model is not None else 0,
        idle_budget_s=(idle_budget_s or 0.0) if spec.scheduling.co_location else 0.0,
        max_wait_s=spec.scheduling.max_wait_s(),
    )


def _fingerprint(call: ConfigureCall) -> str:
    doc = {
        "budget": None if call.budget_s is None else round(call.budget_s, 6),
        "slo": [call.ttft_mean_s, call.ttft_p99_s, call.tbt_mean_s, call.tbt_p99_s],
        "ordering": call.ordering,
        "kind": call.latency_kind,
        "coefficients": sorted(call.latency_coefficients.items()),
        "knee": call.latency_knee_tokens,
        "curve": [call.latency_curve_step_tokens, *call.latency_token_curve],
        "idle": None if call.idle_budget_s is None else round(call.idle_budget_s, 6),
        "max_wait": call.max_wait_s,
    }
    return hashlib.blake2b(json.dumps(doc).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class _Latency:
    """The latency model in force for one reconcile, calibrated."""

    choice: ModelChoice
    calibration: Calibration
    refit: float | None  # the median ratio when this reconcile refitted the scale
    scale: float  # 1 for a learned model (never calibrated)
    model: LinearLatencyModel | None  # the model in force times the scale
    key: str  # the budget search's model key
    events: tuple[tuple[str, str, str], ...]


def _latency(
    spec: InferenceServiceSpec, observed: ServiceObserved, memory: ServiceMemory,
    learned: LearnedParams, calibration: CalibrationParams,
) -> _Latency:
    """Which model is in force (``modelchoice``) and its calibration (profiles only)."""
    ready = [p for p in observed.pods if p.ready and p.sidecar is not None]
    policy = spec.scheduling.latency_model
    if policy is LatencyModelPolicy.NONE:
        choice = ModelChoice(None, "spec.scheduling.latencyModel is none: offline work fills "
                             "free capacity without a budget")
    else:
        reports = ((p.name, p.sidecar.learned) for p in ready if p.sidecar is not None
                   and policy is LatencyModelPolicy.AUTO)
        what = f"{spec.model} on {spec.engine.gpu_type}"
        choice = choose_model(observed.latency_model, observed.profile, reports, learned,
                              held=memory.in_force if policy is LatencyModelPolicy.AUTO
                              else None, what=what)
        if choice.in_force is None and policy is LatencyModelPolicy.PROFILE:
            choice = ModelChoice(None, f"no latency profile for {what}; "
                                 "spec.scheduling.latencyModel is profile (learned models off)")
    in_force = choice.in_force
    cal = memory.calibration
    refit: float | None = None
    events: list[tuple[str, str, str]] = []
    if in_force is not None and in_force.calibrated:
        samples = [StepSample(p.sidecar.predicted_step_s, p.sidecar.observed_step_s,
                              p.sidecar.generation,
                              busy=p.sidecar.online_in_flight + p.sidecar.offline_in_flight > 0)
                   for p in ready if p.sidecar is not None]
        before = cal.scale
        cal, refit = observe(cal, samples, calibration)
        if refit is not None:
            events.append(("Normal", "LatencyModelRefit",
                           f"observed/predicted step time median {refit:.3g} over the last "
                           f"{calibration.window} samples; latency coefficients "
                           f"x{cal.scale:.3g} of {observed.profile} (was x{before:.3g})"))
    elif in_force is not None and (memory.in_force is None
                                   or memory.in_force.key != in_force.key):
        events.append(("Normal", "LatencyModelLearned",
                       f"latency model in force: {in_force.describe()}; the budget is "
                       f"searched with it"[:1000]))
    if in_force is None:
        return _Latency(choice, cal, refit, 1.0, None, "", tuple(events))
    scale = cal.scale if in_force.calibrated else 1.0
    key = in_force.key + (f" x{scale:.3g} (refit)" if scale != 1.0 else "")
    return _Latency(choice, cal, refit, scale, scaled(in_force.model, scale), key,
                    tuple(events))


def _engine_kv(spec: InferenceServiceSpec, pods: tuple[PodView, ...]) -> KvSize | None:
    """The engine's KV cache: as the ready pods read it from their engines (vLLM's
    ``vllm:cache_config_info``), else as the engine's args give it (``service_kv``)."""
    reported = []
    for pod in pods:
        kv = pod.sidecar.kv_cache if pod.ready and pod.sidecar is not None else None
        if kv is not None and kv.from_engine:
            reported.append((kv.num_blocks, kv.block_size))
    return service_kv(spec.engine.args, reported)


def _budget(
    spec: InferenceServiceSpec, observed: ServiceObserved, memory: ServiceMemory,
    latency: _Latency, targets: SLOTargets, *, kv: KvSize | None, now_s: float,
    params: BudgetParams, search_for: Callable[[SearchSubject], BudgetSearch],
    events: list[tuple[str, str, str]],
) -> BudgetState | None:
    """The next budget: searched with the model in force once there are online statistics,
    on the engine's KV cache ``kv`` where known."""
    window = observed.window
    in_force = latency.choice.in_force
    if in_force is None or window is None:
        return memory.budget
    slo_obs = window.observed
    engine_mode = spec.scheduling.enforcement == Enforcement.ENGINE
    limits = engine_limits(spec.engine.args)
    if kv is not None:
        limits = replace(limits, block_size=kv.block_size)
    subject = SearchSubject(model_name=spec.model, gpu=spec.engine.gpu_type,
                            profile=in_force.key, model=in_force.model, scale=latency.scale,
                            limits=limits,
                            mode="in-engine" if engine_mode else "sidecar",
                            timing_cv=in_force.heldout_mape if in_force.from_pod else None,
                            kv_blocks=kv.blocks if kv is not None else None)
    budget = decide(
        memory.budget,
        targets=targets,
        load=window.load,
        observed=slo_obs,
        search=search_for(subject),
        now_s=now_s,
        params=params,
        model_key=latency.key,
    )
    new_search = memory.budget is None or budget.searched is not memory.budget.searched
    if new_search and not budget.searched.provisional and budget.searched.trials:
        events.append(("Normal", "BudgetSearched",
                       f"iteration budget {format_duration(budget.budget_s)}; "
                       f"{budget.searched.summary()}"[:1000]))
        if not budget.searched.feasible:
            events.append(("Warning", "SLOUnattainable",
                           "no budget meets the SLOs in simulation, not even online-only "
                           f"serving; pushing the online-only budget "
                           f"{format_duration(budget.budget_s)}"))
    elif memory.budget is None or budget.budget_s != memory.budget.budget_s:
        events.append(("Normal", f"Budget{budget.reason}",
                       f"iteration budget {format_duration(budget.budget_s)}"))
    return budget


def _ready_conditions(
    conditions: list[dict[str, Any]], spec: InferenceServiceSpec, ready: int, *,
    now: datetime, gen: int,
) -> None:
    if spec.replicas == 0:
        set_condition(conditions, "Ready", True, reason="ScaledToZero",
                      message="spec.replicas is 0", now=now, observed_generation=gen)
    elif ready >= spec.replicas:
        set_condition(conditions, "Ready", True, reason="AllReplicasReady",
                      message=f"{ready}/{spec.replicas} pods ready", now=now,
                      observed_generation=gen)
    else:
        reason = "NoReplicasReady" if not ready else "ReplicasNotReady"
        set_condition(conditions, "Ready", False, reason=reason,
                      message=f"{ready}/{spec.replicas} pods ready", now=now,
                      observed_generation=gen)


def _slo_condition(
    conditions: list[dict[str, Any]], targets: SLOTargets, slo_obs: ObservedSLO,
    params: BudgetParams, events: list[tuple[str, str, str]], *, now: datetime, gen: int,
) -> str:
    """SLOMet; returns the SLO summary (``status.sloSummary``)."""
    worst = worst_metric(targets, slo_obs)
    if slo_obs.samples < params.min_samples or worst is None:
        set_condition(conditions, "SLOMet", ConditionStatus.UNKNOWN, reason="InsufficientSamples",
                      message=f"{slo_obs.samples} online requests in the window (need "
                      f"{params.min_samples})", now=now, observed_generation=gen)
        return ""
    metric, value, target = worst
    slo_summary = f"{metric} {format_duration(value)}/{format_duration(target)}"
    if value > target:
        changed = set_condition(conditions, "SLOMet", False, reason=_reason_for(metric),
                                message=slo_summary, now=now, observed_generation=gen)
        if changed:
            events.append(("Warning", "SLOMissed", slo_summary))
    else:
        set_condition(conditions, "SLOMet", True, reason="WithinTarget",
                      message=slo_summary, now=now, observed_generation=gen)
    return slo_summary


def _budget_condition(
    conditions: list[dict[str, Any]], choice: ModelChoice, budget: BudgetState | None, *,
    ready: int, behind: int, generation: int, now: datetime, gen: int,
) -> None:
    """BudgetReady, naming the latency model in force (or why there is none yet)."""
    in_force = choice.in_force
    if in_force is None:
        set_condition(conditions, "BudgetReady", False, reason="NoLatencyModel",
                      message=choice.waiting, now=now, observed_generation=gen)
        return
    model = f"; latency model {in_force.describe()}"
    if budget is None:
        set_condition(conditions, "BudgetReady", False, reason="AwaitingLoadStatistics",
                      message=f"no online statistics yet{model}", now=now,
                      observed_generation=gen)
        return
    evidence = "; " + budget.searched.summary(limit=4)
    reason = "Pushed" if budget.searched.feasible else "SLOUnattainable"
    if behind or not ready:
        set_condition(conditions, "BudgetReady", False, reason="Pushing",
                      message=f"{ready - behind}/{ready} ready pods at generation "
                      f"{generation}{model}{evidence}", now=now, observed_generation=gen)
    else:
        set_condition(conditions, "BudgetReady", True, reason=reason,
                      message=f"{ready} pods at generation {generation}{model}{evidence}",
                      now=now, observed_generation=gen)


def _offline(
    pods: tuple[PodView, ...], ready: list[PodView], meter: TokenMeter, now_s: float,
) -> tuple[dict[str, Any], TokenMeter]:
    """``status.offline`` and the next offline-token meter."""
    offline_tps = 0.0
    active = 0
    counters: dict[tuple[str, str], int] = {}
    for pod in ready:
        assert pod.sidecar is not None
        for shard in pod.sidecar.shards:
            counters[(pod.name, shard.shard_id)] = shard.output_tokens
            if shard.state in ACTIVE_STATES:
                active += 1
                offline_tps += shard.tokens_per_second
    # A key leaves the meter when its pod answered without it or the pod is gone; a pod
    # that did not answer keeps its keys, so its counters are not counted twice.
    answered = {pod.name for pod in ready}
    present = {pod.name for pod in pods}
    gone = frozenset(k for k in meter.seen if k[0] in answered or k[0] not in present)
    offline_tokens = meter.advance(counters, now_s, OFFLINE_RATE_WINDOW_S, forget=gone)
    offline_rate = offline_tokens.rate()
    if offline_rate is not None:
        offline_tps = offline_rate
    return {"tokensPerSecond": round(offline_tps, 2), "activeShards": active}, offline_tokens


def _observed_status(observed: ServiceObserved, slo_obs: ObservedSLO) -> dict[str, Any]:
    """``status.observed``."""
    obs: dict[str, Any] = {"window": observed.window_label, "samples": slo_obs.samples,
                           "source": observed.window_source if observed.window is not None
                           else "none"}
    for key in ("ttft_mean_s", "ttft_p99_s", "tbt_mean_s", "tbt_p99_s"):
        value = getattr(slo_obs, key)
        if value is not None and slo_obs.samples > 0:
            camel = key[:-2].replace("_mean", "Mean").replace("_p99", "P99")
            obs[camel] = format_duration(value)
    return obs


def _rendered(
    ref: ObjectRef, spec: InferenceServiceSpec, observed: ServiceObserved,
    model: LinearLatencyModel | None, rendered: RenderedChildren | None,
) -> RenderedChildren:
    """The children, rendered again only when what they come from changed."""
    inputs = (ref, spec, observed.token, model, observed.storage_roots,
              observed.sidecar_image, observed.sidecar_resources, observed.placement,
              observed.job_storage)
    if rendered is not None and rendered.inputs == inputs:
        return rendered
    return RenderedChildren(inputs, children(
        ref, spec, observed.token, model, storage_roots=observed.storage_roots,
        sidecar_image=observed.sidecar_image, sidecar_resources=observed.sidecar_resources,
        placement=observed.placement, job_storage=observed.job_storage))


def _generation(
    memory: ServiceMemory, previous_status: dict[str, Any], pods: tuple[PodView, ...],
    make: Callable[[int], ConfigureCall], now: datetime,
) -> tuple[int, ConfigureCall, str, str]:
    """The configuration generation, its call, fingerprint and computedAt: a new generation
    (above every pod's) whenever the call's content changed."""
    floor_gen = max(
        [memory.config_generation,
         int((previous_status.get("budget") or {}).get("configGeneration", 0))]
        + [p.sidecar.generation for p in pods if p.sidecar is not None]
    )
    call = make(floor_gen)
    fingerprint = _fingerprint(call)
    generation = memory.config_generation
    computed_at = memory.computed_at or rfc3339(now)
    if fingerprint != memory.config_fingerprint:
        generation = floor_gen + 1
        computed_at = rfc3339(now)
        call = make(generation)
    return generation, call, fingerprint, computed_at


def reconcile_service(
    ref: ObjectRef,
    spec: InferenceServiceSpec,
    observed: ServiceObserved,
    memory: ServiceMemory,
    *,
    previous_status: dict[str, Any],
    now: datetime,
    now_s: float,
    params: BudgetParams,
    search_for: Callable[[SearchSubject], BudgetSearch],
    calibration: CalibrationParams | None = None,
    learned: LearnedParams | None = None,
) -> ServiceOutcome:
    """One reconcile of an InferenceService (see the module docstring)."""
    targets = SLOTargets.from_spec(spec.slo)
    window = observed.window
    slo_obs = window.observed if window is not None else ObservedSLO(samples=0)
    conditions: list[dict[str, Any]] = [dict(c) for c in previous_status.get("conditions", [])]
    gen = ref.generation
    latency = _latency(spec, observed, memory, learned or LearnedParams(),
                       calibration or CalibrationParams())
    events = list(latency.events)
    in_force = latency.choice.in_force
    kv = _engine_kv(spec, observed.pods)
    budget = _budget(spec, observed, memory, latency, targets, kv=kv, now_s=now_s,
                     params=params, search_for=search_for, events=events)
    budget_s = budget.budget_s if budget is not None else None
    idle_budget_s = budget.searched.idle_budget_s if budget is not None else None

    pods = observed.pods
    ready = [p for p in pods if p.ready]
    generation, call, fingerprint, computed_at = _generation(
        memory, previous_status, pods,
        lambda g: _configure_call(g, budget_s, targets, spec, latency.model,
                                  idle_budget_s=idle_budget_s), now)
    pushes = tuple((p.name, call) for p in ready
                   if p.sidecar is not None and p.sidecar.generation < generation)
    cal = latency.calibration
    if latency.refit is not None:
        cal = replace(cal, since_generation=generation)

    _ready_conditions(conditions, spec, len(ready), now=now, gen=gen)
    slo_summary = _slo_condition(conditions, targets, slo_obs, params, events, now=now, gen=gen)
    _budget_condition(conditions, latency.choice, budget, ready=len(ready), behind=len(pushes),
                      generation=generation, now=now, gen=gen)

    offline, offline_tokens = _offline(pods, ready, memory.offline_tokens, now_s)
    status: dict[str, Any] = {
        "observedGeneration": gen,
        "conditions": conditions,
        "replicas": len(pods),
        "readyReplicas": len(ready),
        "offline": offline,
        "sloSummary": slo_summary,
        "observed": _observed_status(observed, slo_obs),
        "latencyModel": (in_force.status(latency.scale) if in_force is not None
                         else {"source": "none"}),
    }
    if kv is not None:
        status["kvCache"] = kv.status()
    if budget is not None:
        status["budget"] = {"iteration": format_duration(budget.budget_s),
                            "searched": format_duration(budget.searched.budget_s),
                            "computedAt": computed_at, "reason": budget.reason,
                            "configGeneration": generation, "profile": latency.key}
    # The ConfigMap carries a profile's model only: a learned one reaches the pods through
    # Configure, and the pod template (which names the file) must not change when one appears.
    file_model = latency.model if in_force is not None and in_force.calibrated else None
    rendered = _rendered(ref, spec, observed, file_model, memory.rendered)
    new_memory = ServiceMemory(budget=budget, config_generation=generation,
                               config_fingerprint=fingerprint, computed_at=computed_at,
                               calibration=cal, rendered=rendered,
                               offline_tokens=offline_tokens,
                               in_force=in_force or memory.in_force)
    return ServiceOutcome(children=rendered.objects, status=status, pushes=pushes,
                          memory=new_memory, events=tuple(events))
