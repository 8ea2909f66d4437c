"""InferenceService reconciler: ``(spec, observed, now) -> (children, status, pushes)``.

Pure. Given the spec, what the handler observed (pods with their sidecar
status, the latency window, the auth token, the latency model) and the
previous budget memory, it returns

* the child objects to apply (Secret with the control-API token, ConfigMap
  with the latency model and settings, Deployment, Service), each with an
  ownerReference to the InferenceService so deleting it garbage-collects them;
* the status to write (conditions Ready / SLOMet / BudgetReady, observed
  latency, budget, offline throughput, replica counts);
* the Configure calls to push (ready pods whose configuration generation is
  behind), and the next budget memory. ``BudgetReady`` is ``Pushing`` while any
  ready pod is behind; the handler writes the status before it pushes, so the
  condition turns True on the first reconcile that sees every pod at the
  generation.

Latency model: the profile's model times the calibration scale refitted from
the pods' predicted/observed step times (``calibration``); the scaled
coefficients are what the ConfigMap and the Configure calls carry, and a
refit makes a new search (the budget's ``model_key`` includes the scale).
The budget search is asked for through ``search_for`` with a
:class:`~slipstream_operator.searchpool.SearchSubject`; its evidence (the
simulator trials) goes into the ``BudgetSearched`` event and the
``BudgetReady`` condition's message, and an unattainable SLO (even the
online-only budget misses it in simulation) makes ``BudgetReady`` say
``SLOUnattainable`` while the online-only budget is pushed.

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
from slipstream_operator.observe import WindowStats
from slipstream_operator.podspec import (
    DEFAULT_PLACEMENT,
    TOKEN_KEY,
    GpuPlacement,
    engine_container,
    model_args,
    pod_template,
    sidecar_container,
)
from slipstream_operator.rates import TokenMeter
from slipstream_operator.searchpool import SearchSubject
from slipstream_operator.sidecar_client import ACTIVE_STATES, ConfigureCall, SidecarStatus
from slipstream_operator.simsearch import engine_limits
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
    placement: GpuPlacement = DEFAULT_PLACEMENT,
) -> tuple[dict[str, Any], ...]:
    """Secret, ConfigMap, Deployment and Service for the spec.

    The sidecar container runs ``spec.sidecar.image``, else ``sidecar_image`` (the operator's
    default), with ``spec.sidecar.resources`` unless both its requests and limits are empty,
    else ``sidecar_resources``. The pod is ``podspec``'s (the merge rule is there); raises
    :class:`~slipstream_operator.errors.SpecError` when the spec's nodeSelector contradicts
    ``placement``.
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
        storage_roots=storage_roots, latency_file=model is not None)
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
                sidecar=sidecar, placement=placement),
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
    }
    return hashlib.blake2b(json.dumps(doc).encode(), digest_size=8).hexdigest()


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
) -> ServiceOutcome:
    """One reconcile of an InferenceService (see the module docstring)."""
    targets = SLOTargets.from_spec(spec.slo)
    window = observed.window
    slo_obs = window.observed if window is not None else ObservedSLO(samples=0)
    events: list[tuple[str, str, str]] = []
    conditions: list[dict[str, Any]] = [dict(c) for c in previous_status.get("conditions", [])]
    gen = ref.generation

    # -- latency model calibration --------------------------------------------------------
    base_model = observed.latency_model
    cal = memory.calibration
    refit: float | None = None
    if base_model is not None:
        samples = [StepSample(p.sidecar.predicted_step_s, p.sidecar.observed_step_s,
                              p.sidecar.generation,
                              busy=p.sidecar.online_in_flight + p.sidecar.offline_in_flight > 0)
                   for p in observed.pods if p.ready and p.sidecar is not None]
        before = cal.scale
        cal, refit = observe(cal, samples, calibration or CalibrationParams())
        if refit is not None:
            events.append(("Normal", "LatencyModelRefit",
                           f"observed/predicted step time median {refit:.3g} over the last "
                           f"{(calibration or CalibrationParams()).window} samples; latency "
                           f"coefficients x{cal.scale:.3g} of {observed.profile} "
                           f"(was x{before:.3g})"))
    model = scaled(base_model, cal.scale) if base_model is not None else None
    model_key = observed.profile + (f" x{cal.scale:.3g} (refit)" if cal.scale != 1.0 else "")

    # -- budget ---------------------------------------------------------------------------
    budget = memory.budget
    if base_model is not None and window is not None:
        subject = SearchSubject(model_name=spec.model, gpu=spec.engine.gpu_type,
                                profile=observed.profile, model=base_model, scale=cal.scale,
                                limits=engine_limits(spec.engine.args))
        budget = decide(
            memory.budget,
            targets=targets,
            load=window.load,
            observed=slo_obs,
            search=search_for(subject),
            now_s=now_s,
            params=params,
            model_key=model_key,
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
    budget_s = budget.budget_s if budget is not None else None
    idle_budget_s = budget.searched.idle_budget_s if budget is not None else None

    # -- configuration generation ----------------------------------------------------------
    pods = observed.pods
    ready = [p for p in pods if p.ready]
    floor_gen = max(
        [memory.config_generation,
         int((previous_status.get("budget") or {}).get("configGeneration", 0))]
        + [p.sidecar.generation for p in pods if p.sidecar is not None]
    )
    call = _configure_call(floor_gen, budget_s, targets, spec, model,
                           idle_budget_s=idle_budget_s)
    fingerprint = _fingerprint(call)
    generation = memory.config_generation
    computed_at = memory.computed_at or rfc3339(now)
    if fingerprint != memory.config_fingerprint:
        generation = floor_gen + 1
        computed_at = rfc3339(now)
        call = _configure_call(generation, budget_s, targets, spec, model,
                               idle_budget_s=idle_budget_s)
    pushes = tuple((p.name, call) for p in ready
                   if p.sidecar is not None and p.sidecar.generation < generation)
    if refit is not None:
        cal = replace(cal, since_generation=generation)

    # -- conditions -------------------------------------------------------------------------
    if spec.replicas == 0:
        set_condition(conditions, "Ready", True, reason="ScaledToZero",
                      message="spec.replicas is 0", now=now, observed_generation=gen)
    elif len(ready) >= spec.replicas:
        set_condition(conditions, "Ready", True, reason="AllReplicasReady",
                      message=f"{len(ready)}/{spec.replicas} pods ready", now=now,
                      observed_generation=gen)
    else:
        reason = "NoReplicasReady" if not ready else "ReplicasNotReady"
        set_condition(conditions, "Ready", False, reason=reason,
                      message=f"{len(ready)}/{spec.replicas} pods ready", now=now,
                      observed_generation=gen)

    worst = worst_metric(targets, slo_obs)
    slo_summary = ""
    if slo_obs.samples < params.min_samples or worst is None:
        set_condition(conditions, "SLOMet", ConditionStatus.UNKNOWN, reason="InsufficientSamples",
                      message=f"{slo_obs.samples} online requests in the window (need "
                      f"{params.min_samples})", now=now, observed_generation=gen)
    else:
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

    evidence = ""
    pushed_reason = "Pushed"
    if budget is not None:
        evidence = "; " + budget.searched.summary(limit=4)
        if not budget.searched.feasible:
            pushed_reason = "SLOUnattainable"
    if model is None:
        set_condition(conditions, "BudgetReady", False, reason="NoLatencyModel",
                      message=f"no latency profile for {spec.model} on {spec.engine.gpu_type}",
                      now=now, observed_generation=gen)
    elif budget is None:
        set_condition(conditions, "BudgetReady", False, reason="AwaitingLoadStatistics",
                      message="no online statistics yet", now=now, observed_generation=gen)
    elif pushes or not ready:
        set_condition(conditions, "BudgetReady", False, reason="Pushing",
                      message=f"{len(ready) - len(pushes)}/{len(ready)} ready pods at "
                      f"generation {generation}{evidence}", now=now, observed_generation=gen)
    else:
        set_condition(conditions, "BudgetReady", True, reason=pushed_reason,
                      message=f"{len(ready)} pods at generation {generation}{evidence}",
                      now=now, observed_generation=gen)

    # -- status -----------------------------------------------------------------------------
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
    gone = frozenset(k for k in memory.offline_tokens.seen
                     if k[0] in answered or k[0] not in present)
    offline_tokens = memory.offline_tokens.advance(counters, now_s, OFFLINE_RATE_WINDOW_S,
                                                   forget=gone)
    offline_rate = offline_tokens.rate()
    if offline_rate is not None:
        offline_tps = offline_rate
    status: dict[str, Any] = {
        "observedGeneration": gen,
        "conditions": conditions,
        "replicas": len(pods),
        "readyReplicas": len(ready),
        "offline": {"tokensPerSecond": round(offline_tps, 2), "activeShards": active},
        "sloSummary": slo_summary,
    }
    obs: dict[str, Any] = {"window": observed.window_label, "samples": slo_obs.samples,
                           "source": observed.window_source if window is not None else "none"}
    for key in ("ttft_mean_s", "ttft_p99_s", "tbt_mean_s", "tbt_p99_s"):
        value = getattr(slo_obs, key)
        if value is not None and slo_obs.samples > 0:
            camel = key[:-2].replace("_mean", "Mean").replace("_p99", "P99")
            obs[camel] = format_duration(value)
    status["observed"] = obs
    if budget is not None:
        status["budget"] = {
            "iteration": format_duration(budget.budget_s),
            "searched": format_duration(budget.searched.budget_s),
            "computedAt": computed_at,
            "reason": budget.reason,
            "configGeneration": generation,
            "profile": model_key,
        }
    inputs = (ref, spec, observed.token, model, observed.storage_roots,
              observed.sidecar_image, observed.sidecar_resources, observed.placement)
    rendered = memory.rendered
    if rendered is None or rendered.inputs != inputs:
        rendered = RenderedChildren(inputs, children(
            ref, spec, observed.token, model, storage_roots=observed.storage_roots,
            sidecar_image=observed.sidecar_image, sidecar_resources=observed.sidecar_resources,
            placement=observed.placement))
    new_memory = ServiceMemory(
        budget=budget,
        config_generation=generation,
        config_fingerprint=fingerprint,
        computed_at=computed_at,
        calibration=cal,
        rendered=rendered,
        offline_tokens=offline_tokens,
    )
    return ServiceOutcome(
        children=rendered.objects,
        status=status,
        pushes=pushes,
        memory=new_memory,
        events=tuple(events),
    )
