"""Thin kopf handlers: observe, call the pure reconcilers, apply what they return.

:func:`build_registry` registers, on an explicit ``kopf.OperatorRegistry``
(no import side effects), a timer per InferenceService and per OfflineJob
(every ``reconcile_interval_s``) plus delete handlers guarded by the
operator's own finalizer, and kopf indexes (watch-backed, in memory) of the
pods labelled with a service, of the InferenceServices and of the OfflineJobs.
A tick:

* InferenceService: the control token (kept in memory, re-read every
  ``apply_resync_s``), the latency profile, the service's pods from the pod
  index, each running pod's Status (gRPC, pod IP, shared with the job ticks;
  it carries the pod's online latency counters, and ``/metrics`` is scraped
  only from a sidecar whose Status does not), then ``reconcile_service``; apply the
  children that changed since they were last applied (or are due for a
  resync), write the status keys that changed, emit events, and push Configure
  to pods behind the generation in the background (the status is not held for
  it; ``BudgetReady`` turns True on the tick that sees every pod at the new
  generation).
* OfflineJob: plan the input once (file thread), the matching services from
  the service index and their pods from the pod index, their sidecars' Status
  (concurrently), verify finished shards against their logs (one file-thread
  hop), then ``reconcile_job``; revoke and assign (concurrently), merge, write
  the status keys that changed.

Nothing in a tick lists objects: at steady state a tick makes no Kubernetes API
call at all unless its status changed. Blocking ``kubernetes``-client calls run
on the operator's own executor (``kube_threads``) and file work on another, so
neither waits behind the other, nor job ticks behind service ticks; sidecar
calls go through one :class:`~slipstream_operator.sidecar_client.SharedSidecarControl`
(``sidecar_concurrency`` in flight, one Status per pod per interval, a service tick's
Status served before job ticks' calls).

Handlers return None (kopf would otherwise store return values under
``status.<handler>``, which the structural schema prunes). kopf's own state
lives under the ``slipstream.dev`` annotation prefix; the finalizer is
``slipstream.dev/finalizer``. Errors from the Kubernetes API or a sidecar
are logged and retried on the next tick; a spec the reconcilers cannot use
gets a ``Ready``/``Admitted`` condition saying why.

Deliberately left out: webhooks (CEL covers validation) and status from
Prometheus beyond the queries in ``observe.promql_queries``.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
import math
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

import aiohttp
import kopf
from kubernetes import client

from slipstream_operator import kube
from slipstream_operator.api import (
    GROUP,
    VERSION,
    InferenceServiceSpec,
    OfflineJobSpec,
    validate_semantics,
)
from slipstream_operator.budgets import BudgetSearch
from slipstream_operator.conditions import set_condition
from slipstream_operator.drain import GrpcDrainControl, drain_service
from slipstream_operator.errors import InputError, OperatorError, OutputError, SidecarError
from slipstream_operator.gateway import InferencePools
from slipstream_operator.modelchoice import LearnedParams
from slipstream_operator.observe import (
    PodHistory,
    WindowStats,
    combine,
    parse_sample,
    promql_queries,
    stats_from_prometheus,
)
from slipstream_operator.podspec import TOKEN_KEY, GpuPlacement, placement_problems
from slipstream_operator.profiles import Profile, find_profile
from slipstream_operator.reconcile_job import (
    CandidatePod,
    JobMemory,
    JobObserved,
    JobOutcome,
    JobSettings,
    candidate_pod,
    job_prefix,
    reconcile_job,
    storage_error,
)
from slipstream_operator.reconcile_service import (
    SERVICE_LABEL,
    ObjectRef,
    PodView,
    ServiceMemory,
    ServiceObserved,
    names,
    reconcile_service,
)
from slipstream_operator.searchpool import BudgetSearches, SearchSubject
from slipstream_operator.settings import OperatorSettings
from slipstream_operator.shards import (
    MergeResult,
    Plan,
    PlanOptions,
    count_shard,
    merge_outputs,
    plan_input,
)
from slipstream_operator.sidecar_client import (
    ACTIVE_STATES,
    ConfigureCall,
    PodAddress,
    ShardAssignment,
    SharedSidecarControl,
    SidecarControl,
    SidecarStatus,
)
from slipstream_operator.staging import work_dir_for
from slipstream_operator.statusfeed import StatusFeed, TickPacer

logger = logging.getLogger(__name__)

FINALIZER = f"{GROUP}/finalizer"
T = TypeVar("T")

PodIndex = Mapping[tuple[str, str], Iterable[kube.PodInfo]]
"""(namespace, service name) -> the service's pods, from the watch (kopf index)."""
ServiceIndex = Mapping[str, Iterable[kube.ServiceInfo]]
"""namespace -> its InferenceServices, from the watch (kopf index)."""
JobIndex = Mapping[str, Iterable[kube.JobInfo]]
"""namespace -> its OfflineJobs, from the watch (kopf index)."""

POD_INDEX = "slipstream_pods"
SERVICE_INDEX = "slipstream_services"
JOB_INDEX = "slipstream_jobs"
"""Ids of the kopf indexes; kopf passes each index to handlers as the keyword of its id."""

STATUS_MAX_AGE = 1.2
"""A job tick reuses a pod's cached Status for this fraction of the reconcile interval: longer
than one interval, so the reply the pod's service tick asked for serves every job tick until
the next service tick, and job ticks ask a pod themselves only when its service ticks lag."""
SERVICE_STATUS_MAX_AGE = 0.2
"""A service tick (its reply becomes the service's status) reuses one only this young: a reply
cached before a change on the pod would hide the change for one more tick."""
FILE_THREADS = 4
"""Threads for planning, shard-log counting and merging (file work, off the kube executor)."""


@dataclass
class OperatorState:
    """In-process memory of the handlers, keyed by object uid (lost on restart, rebuilt)."""

    services: dict[str, ServiceMemory] = field(default_factory=dict)
    histories: dict[str, dict[str, PodHistory]] = field(default_factory=dict)
    jobs: dict[str, JobMemory] = field(default_factory=dict)
    plans: dict[str, Plan] = field(default_factory=dict)
    done: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    merged: dict[str, MergeResult] = field(default_factory=dict)
    addresses: dict[str, dict[str, PodAddress]] = field(default_factory=dict)
    tokens: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)
    job_uids: dict[str, str] = field(default_factory=dict)
    """Job prefix (``job_prefix``) -> the job's uid, to find the owner of a preempted shard."""
    """(namespace, service) -> (control token, monotonic time it was read or made)."""


PACED_REARM_S = 0.05
"""Seconds kopf waits after a paced service tick before calling the handler again (which then
waits for the service's next turn itself)."""

HANDLER_BACKOFF_S = 5.0
"""Seconds kopf waits before retrying a failed handler (its default, 60 s, would leave every
object unreconciled for a minute after an API-server restart)."""


def configure_kopf(settings: kopf.OperatorSettings, *, clusterwide: bool = True) -> None:
    """The kopf settings this operator relies on (finalizer, storages, posting, scanning).

    Namespaced (``clusterwide=False``): kopf's scans of CRDs and namespaces are switched off,
    since the chart's namespaced Role forbids them (kopf would log each refusal at ERROR).
    """
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 60
    settings.execution.max_workers = 8
    if not clusterwide:
        settings.scanning.disabled = True


def _now() -> tuple[datetime, float]:
    return datetime.now(tz=UTC), time.monotonic()


def _patch_status(patch: kopf.Patch, status: dict[str, Any],
                  previous: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """Put the keys of ``status`` that differ from ``previous`` into the patch; returns them.

    An unchanged status leaves the patch empty, and kopf then sends nothing.
    """
    changed = changed_status(status, previous or {})
    for key, value in changed.items():
        patch.status[key] = value
    return tuple(changed)


class StatusWrites:
    """Counts of the status PATCHes the ticks asked kopf to send, per kind and per top-level
    field they carried (the operator's metrics read them from another thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._patches: Counter[str] = Counter()
        self._fields: Counter[tuple[str, str]] = Counter()

    def record(self, kind: str, fields: Iterable[str]) -> None:
        keys = tuple(fields)
        if not keys:
            return
        with self._lock:
            self._patches[kind] += 1
            self._fields.update((kind, key) for key in keys)

    def snapshot(self) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
        """(patches per kind, patches per (kind, field))."""
        with self._lock:
            return dict(self._patches), dict(self._fields)


SpecT = TypeVar("SpecT", InferenceServiceSpec, OfflineJobSpec)


class ParsedSpecs:
    """Each object's spec as last parsed, so a tick validates a spec only when it changed.

    A tick used to run pydantic over the whole spec every interval (7 % of the event loop at
    1,000 nodes); comparing the body's spec with the one parsed last is a plain dict
    comparison. A spec that fails to parse is not kept: it raises again at every tick.
    """

    def __init__(self, placement: GpuPlacement | None = None) -> None:
        self._last: dict[str, tuple[dict[str, Any], Any, tuple[str, ...]]] = {}
        # An InferenceService's nodeSelector is also checked against the GPU placement.
        self._placement = placement

    def parse(self, uid: str, raw: Mapping[str, Any],
              model: type[SpecT]) -> tuple[SpecT, tuple[str, ...]]:
        """``(spec, semantic problems)``; raises ``ValueError`` (pydantic) on a bad spec."""
        body = dict(raw)
        hit = self._last.get(uid)
        if hit is not None and hit[0] == body and isinstance(hit[1], model):
            return hit[1], hit[2]
        spec = model.model_validate(body)
        problems = tuple(validate_semantics(spec))
        if isinstance(spec, InferenceServiceSpec) and self._placement is not None:
            problems += tuple(placement_problems(spec, self._placement))
        self._last[uid] = (copy.deepcopy(body), spec, problems)
        return spec, problems

    def forget(self, uid: str) -> None:
        self._last.pop(uid, None)

    def __len__(self) -> int:
        return len(self._last)


def _as_served(value: Any) -> Any:
    """``value`` as the API server hands it back: it writes a whole float as an integer
    (32.0 comes back as 32), so a float with no fraction is compared as an int."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {k: _as_served(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_served(v) for v in value]
    return value


def _canon(value: Any) -> str:
    return json.dumps(_as_served(value), sort_keys=True, default=str)


def _same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` serve as the same JSON: numbers by value (32.0 is 32), never a bool
    for a number, a tuple like the list it is served as, anything else by its text."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if type(a) is type(b) and a == b:
        return True
    return _canon(a) == _canon(b)  # e.g. a datetime against its served text


def changed_status(status: Mapping[str, Any], previous: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level keys of ``status`` whose JSON value differs from ``previous``'s (the last
    status read back from the API server, so numbers compare as it serves them).

    Compared in place (:func:`_same`) rather than by serializing both sides: the service
    ticks of a large fleet spent 6 % of the event loop writing JSON to compare statuses."""
    return {k: v for k, v in status.items() if k not in previous or not _same(v, previous[k])}


class Handlers:
    """The handler bodies, with their dependencies injected."""

    def __init__(
        self,
        settings: OperatorSettings,
        api: client.ApiClient,
        control: SidecarControl,
        http: aiohttp.ClientSession | None = None,
    ) -> None:
        self.settings = settings
        self.api = api
        self.control = (control if isinstance(control, SharedSidecarControl) else
                        SharedSidecarControl(
                            control, limit=settings.sidecar_concurrency,
                            max_age_s=STATUS_MAX_AGE * settings.reconcile_interval_s))
        self.http = http
        self.state = OperatorState()
        self.applied = kube.AppliedChildren(settings.apply_resync_s)
        self.pools = InferencePools(api, settings.apply_resync_s, self._kube)  # gateway.py
        self.budget_searches = BudgetSearches(settings.budget_search)
        self._kube_pool = ThreadPoolExecutor(settings.kube_threads, thread_name_prefix="kube")
        kube.widen_connection_pool(api, settings.kube_threads)
        self._file_pool = ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="files")
        self._placing: dict[str, asyncio.Lock] = {}
        self._profiles: dict[tuple[str, str], tuple[Profile | None, float]] = {}
        self._resyncing: dict[str, asyncio.Future[None]] = {}
        self._refreshing: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._pushing: dict[str, asyncio.Future[None]] = {}  # service uid -> its Configure round
        # WatchStatus streams (statusfeed.py): they keep the pods' replies current and wake a
        # service's tick when one of its pods changes. None: poll Status at every tick.
        self.pacer: TickPacer | None = None
        self.feed: StatusFeed | None = None
        watch = getattr(self.control.inner, "watch", None)
        if settings.status_watch and watch is not None:
            gap = settings.status_watch_gap_s or settings.reconcile_interval_s / 2
            if settings.status_watch_wake:
                self.pacer = TickPacer(interval_s=settings.reconcile_interval_s, min_gap_s=gap)
            self.feed = StatusFeed(self.control, watch, interval_s=settings.reconcile_interval_s,
                                   min_interval_s=gap,
                                   on_change=self.pacer.wake if self.pacer else lambda _: None)
        self.kube_calls = 0
        """Blocking Kubernetes client calls made (applies and Secret reads)."""
        self.status_writes = StatusWrites()
        self.placement = GpuPlacement.of(settings.gpu_node_label, settings.gpu_node_values)
        self.specs = ParsedSpecs(self.placement)
        self._child_digests: dict[str, tuple[tuple[dict[str, Any], ...], tuple[str, ...]]] = {}

    def status_stats(self) -> dict[str, float]:
        """How pods' Status reached the ticks: streams, snapshots, changes, woken ticks and
        unary calls (for the operator's metrics; read from the metrics thread)."""
        stats = {"status_calls": float(self.control.asked),
                 "status_call_failures": float(self.control.failed)}
        if self.feed is not None:
            stats.update(self.feed.stats())
        if self.pacer is not None:
            stats["woken_ticks"] = float(self.pacer.woken_turns)
        return stats

    async def _kube(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking Kubernetes client call on the operator's kube executor."""
        self.kube_calls += 1
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._kube_pool, functools.partial(fn, *args))

    async def _files(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking file work (plan, count, merge) on the file executor."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._file_pool, functools.partial(fn, *args))

    def close(self) -> None:
        """Stop the executors (running calls finish; nothing new starts)."""
        self._kube_pool.shutdown(wait=False, cancel_futures=True)
        self._file_pool.shutdown(wait=False, cancel_futures=True)
        self.budget_searches.close()

    # ------------------------------------------------------------------ InferenceService

    def _search_for(self, subject: SearchSubject) -> BudgetSearch:
        # Simulated in a worker thread and cached; analytic (provisional) meanwhile.
        return self.budget_searches.search_for(subject)

    async def _resync(self, uid: str, ref: ObjectRef, token: str,
                      children: list[dict[str, Any]], now_s: float) -> None:
        """Re-apply unchanged children (puts back deleted or edited ones); errors are logged,
        and the next due tick tries again.

        The token is read from its Secret first: when someone rotated it, nothing is applied
        (that would put the old token back); the next tick renders the children with the new
        one and applies them as changed.
        """
        try:
            if await self._read_token(ref, now_s) != token:
                logger.info("control token of %s/%s changed; re-rendering", ref.namespace,
                            ref.name)
                return
            for child in children:
                await self._kube(kube.apply, self.api, child)
                self.applied.applied(child, now_s)
        except Exception as exc:  # a background task: log whatever it was, retry when due
            logger.warning("resync of %s failed: %s", uid, exc)
        finally:
            self._resyncing.pop(uid, None)

    def _profile(self, model: str, gpu: str, now_s: float) -> Profile | None:
        """The latency profile for (model, gpu), read from disk once per ``apply_resync_s``.

        Kept in memory so that a tick reads no file, and so that the same model object (and
        hence the same budget search) serves every tick until the profile is read again.
        """
        kept = self._profiles.get((model, gpu))
        if kept is None or now_s - kept[1] >= self.settings.apply_resync_s:
            kept = (find_profile(model, gpu, self.settings.profiles_dir), now_s)
            self._profiles[(model, gpu)] = kept
        return kept[0]

    async def _token(self, ref: ObjectRef, now_s: float) -> str:
        """The service's control token: from memory, read from its Secret once per resync.

        A new token is made when the Secret does not exist yet (the service tick applies it).
        The first answer kept wins, so two ticks that race on a missing Secret agree.
        """
        key = (ref.namespace, ref.name)
        kept = self.state.tokens.get(key)
        if kept is not None:
            if (now_s - kept[1] >= kube.spread("/".join(key), self.settings.apply_resync_s)
                    and key not in self._refreshing):
                self._refreshing[key] = asyncio.ensure_future(self._refresh_token(ref, now_s))
            return kept[0]
        return await self._read_token(ref, now_s)

    async def _refresh_token(self, ref: ObjectRef, now_s: float) -> None:
        """Re-read a kept token in the background (a rotated Secret is picked up)."""
        try:
            await self._read_token(ref, now_s)
        except Exception as exc:  # a background task: log whatever it was, retry when due
            logger.warning("re-reading the token of %s/%s failed: %s", ref.namespace, ref.name,
                           exc)
        finally:
            self._refreshing.pop((ref.namespace, ref.name), None)

    async def _read_token(self, ref: ObjectRef, now_s: float) -> str:
        key = (ref.namespace, ref.name)
        secret = names(ref)["secret"]
        read = await self._kube(kube.read_secret_value, self.api, ref.namespace, secret,
                                TOKEN_KEY)
        if read is None:
            again = self.state.tokens.get(key)
            token = again[0] if again is not None else secrets.token_urlsafe(32)
        else:
            token = read
        self.state.tokens[key] = (token, now_s)
        return token

    async def _scrape(self, ip: str, port: int) -> str | None:
        if self.http is None:
            return None
        try:
            async with self.http.get(
                f"http://{ip}:{port}/metrics",
                timeout=aiohttp.ClientTimeout(total=self.settings.sidecar_timeout_s),
            ) as response:
                if response.status != 200:
                    return None
                return await response.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def _pod_view(
        self, pod: kube.PodInfo, token: str, spec: InferenceServiceSpec,
        history: dict[str, PodHistory], now_s: float,
    ) -> PodView:
        if not pod.running or not kube.dialable(pod.ip, self.settings.loopback_only):
            if pod.running:
                logger.warning("not dialling pod %s at %s (loopback-only)", pod.name, pod.ip)
            return PodView(pod.name, pod.ip, False)
        address = PodAddress(pod.name, pod.ip, spec.sidecar.grpc_port, token)

        async def ask() -> SidecarStatus | None:
            try:
                # Urgent: this tick holds the service's status; job ticks' looks can wait.
                return await self.control.status(
                    address, urgent=True,
                    max_age_s=SERVICE_STATUS_MAX_AGE * self.settings.reconcile_interval_s)
            except SidecarError as exc:
                logger.info("%s", exc)
                return None

        # Status carries the online histograms and counters, so one call per pod gives the
        # latency window; a sidecar that does not send them (older, or a malformed histogram)
        # is scraped on /metrics, as is one whose Status failed.
        status = await ask()
        sample = status.online_sample if status is not None else None
        if sample is None:
            text = await self._scrape(pod.ip, spec.sidecar.http_port)
            if text is not None:
                sample = parse_sample(text, now_s)
        if sample is not None:
            history.setdefault(pod.name, PodHistory()).add(sample, self.settings.window_s)
        return PodView(pod.name, pod.ip, True, status)

    async def service_tick(
        self, body: kopf.Body, patch: kopf.Patch, *, name: str, namespace: str, uid: str,
        generation: int, pods_index: PodIndex,
    ) -> None:
        now, now_s = _now()
        ref = ObjectRef(name, namespace, uid, generation)
        previous = dict(body.get("status") or {})
        try:
            spec, problems = self.specs.parse(uid, body["spec"], InferenceServiceSpec)
        except ValueError as exc:
            self._invalid(patch, previous, "Ready", generation=generation, message=str(exc),
                          now=now)
            return
        if problems:
            self._invalid(patch, previous, "Ready", generation=generation,
                          message="; ".join(problems), now=now)
            return
        token = await self._token(ref, now_s)
        profile = self._profile(spec.model, spec.engine.gpu_type, now_s)
        pods = sorted(pods_index.get((namespace, name), ()), key=lambda p: p.name)
        if self.feed is not None:
            self.feed.follow(uid, [
                PodAddress(p.name, p.ip, spec.sidecar.grpc_port, token) for p in pods
                if p.running and kube.dialable(p.ip, self.settings.loopback_only)])
        history = self.state.histories.setdefault(uid, {})
        gone = set(history) - {p.name for p in pods}
        for pod_name in gone:
            del history[pod_name]
        if gone:
            # Their counters leave the window: the observed figures restart without them.
            logger.info("%s/%s: pods %s left the window", namespace, name, sorted(gone))
            self.control.forget_pods(gone)
        # Prometheus runs alongside the pod reads under its own short deadline, so the pods'
        # readiness never waits on it; when it fails the sidecars' /metrics stand in.
        prometheus = (asyncio.ensure_future(self._prometheus_window(namespace, name))
                      if self.settings.prometheus_url else None)
        views = await asyncio.gather(
            *(self._pod_view(p, token, spec, history, now_s) for p in pods)
        )
        window: WindowStats | None = None
        source = "sidecar"
        if prometheus is not None:
            window, cause = await prometheus
            if window is not None:
                source = "prometheus"
            else:
                logger.warning("Prometheus unavailable for %s/%s (%s); using the sidecars' "
                               "/metrics", namespace, name, cause)
        if window is None and history:
            window = combine(history.values(), self.settings.default_prompt_tokens,
                             self.settings.default_output_tokens)
        observed = ServiceObserved(
            pods=tuple(views),
            token=token,
            window=window,
            latency_model=profile.model if profile else None,
            profile=profile.name if profile else "",
            window_label=f"{int(self.settings.window_s)}s",
            window_source=source,
            storage_roots=tuple(self.settings.storage_roots),
            sidecar_image=self.settings.sidecar_image,
            sidecar_resources=self.settings.sidecar_resources,
            placement=self.placement,
            job_storage=self.settings.job_storage,
        )
        outcome = reconcile_service(
            ref, spec, observed, self.state.services.get(uid, ServiceMemory()),
            previous_status=previous, now=now, now_s=now_s, params=self.settings.budget,
            search_for=self._search_for, calibration=self.settings.calibration,
            learned=LearnedParams(max_mape=self.settings.learned_max_mape,
                                  min_steps=self.settings.learned_min_steps),
        )
        # Changed children are applied now, in order (the Secret before the Deployment). A
        # resync of unchanged ones runs in the background, so it never delays the status.
        digests = self._digests(uid, outcome.children)
        changed = [(c, d) for c, d in zip(outcome.children, digests, strict=True)
                   if self.applied.changed(c, d)]
        for child, digest in changed:
            await self._kube(kube.apply, self.api, child)
            self.applied.applied(child, now_s, digest)
        stale = [c for c in outcome.children
                 if all(c is not d for d, _ in changed) and self.applied.resync_due(c, now_s)]
        if stale and uid not in self._resyncing:
            self._resyncing[uid] = asyncio.ensure_future(
                self._resync(uid, ref, token, stale, now_s))
        self.state.services[uid] = outcome.memory
        # The status is written first (kopf PATCHes it when the tick returns); Configure goes
        # to the pods behind in the background, and BudgetReady turns True on the tick that
        # sees every ready pod at the new generation. One push round per service at a time.
        if outcome.pushes and uid not in self._pushing:
            by_ip = {v.name: v.ip for v in views}
            self._pushing[uid] = asyncio.ensure_future(self._push(
                uid, namespace, name, [(PodAddress(pod, by_ip[pod], spec.sidecar.grpc_port,
                                                   token), call)
                                       for pod, call in outcome.pushes]))
        # spec.gateway.inferencePool: the pool and its condition (gateway.py).
        await self.pools.sync(ref, spec, outcome.status["conditions"], now=now, now_s=now_s)
        self.status_writes.record("InferenceService",
                                  _patch_status(patch, outcome.status, previous))
        for type_, reason, message in outcome.events:
            kopf.event(body, type=type_, reason=reason, message=message)

    def forget_parsed(self, uid: str) -> None:
        """Drop a deleted service's parsed spec and its children's digests."""
        self.specs.forget(uid)
        self._child_digests.pop(uid, None)

    def _digests(self, uid: str, objects: tuple[dict[str, Any], ...]) -> tuple[str, ...]:
        """``kube.child_digest`` of each child, computed once per rendering: a tick that
        reuses the rendered children (``RenderedChildren``) reuses their digests too."""
        last = self._child_digests.get(uid)
        if last is not None and last[0] is objects:
            return last[1]
        digests = tuple(kube.child_digest(c) for c in objects)
        self._child_digests[uid] = (objects, digests)
        return digests

    async def _push(self, uid: str, namespace: str, name: str,
                    pushes: list[tuple[PodAddress, ConfigureCall]]) -> None:
        """Push Configure to the pods behind (a background task of the service tick)."""

        async def one(address: PodAddress, call: ConfigureCall) -> bool:
            try:
                return await self.control.configure(address, call) >= call.generation
            except SidecarError as exc:
                logger.warning("%s", exc)
                return False

        try:
            acked = sum(await asyncio.gather(*(one(a, c) for a, c in pushes)))
            logger.debug("configured %d/%d pods of %s/%s", acked, len(pushes), namespace, name)
        except Exception as exc:  # a background task: log whatever it was, the next tick retries
            logger.warning("Configure of %s/%s failed: %s", namespace, name, exc)
        finally:
            self._pushing.pop(uid, None)

    async def settle(self) -> None:
        """Wait for the Configure pushes in flight (the ticks that started them returned)."""
        while self._pushing:
            await asyncio.gather(*self._pushing.values(), return_exceptions=True)

    async def _prometheus_window(
        self, namespace: str, name: str
    ) -> tuple[WindowStats | None, str]:
        """The window from Prometheus (``observe.promql_queries``) and, when None, why.

        The queries run concurrently (one worker thread each, no client retries) under one
        overall deadline of ``prometheus_timeout_s``; a refused, silent or failing Prometheus
        costs the tick at most that long.
        """
        from prometheus_api_client import PrometheusConnect
        from prometheus_api_client.exceptions import PrometheusApiClientException
        from urllib3.util.retry import Retry

        url = self.settings.prometheus_url
        assert url is not None
        deadline = self.settings.prometheus_timeout_s
        queries = promql_queries(namespace, name, f"{int(self.settings.window_s)}s")
        # The client's timeout is an int of seconds; the overall deadline below is the bound.
        prom = PrometheusConnect(url=url, timeout=max(1, math.ceil(deadline)),
                                 retry=Retry(total=0, raise_on_status=False))

        def query(promql: str) -> float | None:
            result = prom.custom_query(promql)
            return float(result[0]["value"][1]) if result else None

        keys = list(queries)
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(asyncio.to_thread(query, queries[k]) for k in keys)),
                timeout=deadline,
            )
        except TimeoutError:
            return None, f"no answer within {deadline:g} s"
        except (PrometheusApiClientException, OSError, ValueError, KeyError,
                IndexError) as exc:
            return None, f"{type(exc).__name__}: {exc}"
        values = dict(zip(keys, results, strict=True))
        return stats_from_prometheus(values, self.settings.window_s,
                                     self.settings.default_prompt_tokens,
                                     self.settings.default_output_tokens), ""

    def _invalid(self, patch: kopf.Patch, previous: dict[str, Any], type_: str, *,
                 generation: int, message: str, now: datetime) -> None:
        conditions = [dict(c) for c in previous.get("conditions", [])]
        set_condition(conditions, type_, False, reason="InvalidSpec", message=message[:2000],
                      now=now, observed_generation=generation)
        patch.status["conditions"] = conditions
        patch.status["observedGeneration"] = generation

    # ------------------------------------------------------------------ OfflineJob

    async def _plan(self, uid: str, namespace: str, name: str, spec: OfflineJobSpec) -> Plan:
        plan = self.state.plans.get(uid)
        if plan is None:
            options = PlanOptions(shard_size=spec.shard_size,
                                  prefix_chars=self.settings.prefix_chars,
                                  run_lines=self.settings.plan_run_lines)
            work = work_dir_for(spec.output.uri, namespace=namespace, name=name,
                                staging_root=self.settings.job_storage.staging_root())
            plan = await self._files(
                functools.partial(plan_input, work_dir=work),
                spec.input.uri, spec.output.uri, job_prefix(namespace, name), options,
            )
            self.state.plans[uid] = plan
        return plan

    async def job_tick(
        self, body: kopf.Body, patch: kopf.Patch, *, name: str, namespace: str, uid: str,
        generation: int, pods_index: PodIndex, services_index: ServiceIndex,
        jobs_index: JobIndex,
    ) -> None:
        now, now_s = _now()
        previous = dict(body.get("status") or {})
        try:
            spec, problems = self.specs.parse(uid, body["spec"], OfflineJobSpec)
        except ValueError as exc:
            self._invalid(patch, previous, "Admitted", generation=generation, message=str(exc),
                          now=now)
            return
        if problems:
            self._invalid(patch, previous, "Admitted", generation=generation,
                          message="; ".join(problems), now=now)
            return
        if previous.get("phase") in ("Succeeded", "Failed"):
            return
        roots = tuple(self.settings.storage_roots)
        settings = JobSettings(max_shards_per_pod=self.settings.max_shards_per_pod,
                               stall_timeout_s=self.settings.stall_timeout_s,
                               preempt_after_s=self.settings.preempt_after_s,
                               storage_roots=roots,
                               staging_root=self.settings.job_storage.staging_root())
        if storage_error(spec, namespace, name, settings)[1]:
            # Refused before planning: nothing is read or staged for this job.
            refused = reconcile_job(namespace, name, generation, spec,
                                    observed=JobObserved(plan=None, pods=(), done={}),
                                    memory=self.state.jobs.get(uid, JobMemory()),
                                    previous_status=previous, now=now, now_s=now_s,
                                    settings=settings)
            await self._apply_job_outcome(body, patch, refused, uid=uid, namespace=namespace,
                                          name=name, spec=spec, plan=None,
                                          addresses=self.state.addresses.get(uid, {}),
                                          previous=previous)
            return
        self.state.job_uids[job_prefix(namespace, name)] = uid
        plan: Plan | None = None
        plan_error = ""
        try:
            plan = await self._plan(uid, namespace, name, spec)
        except (InputError, OSError) as exc:
            plan_error = str(exc)
        # Jobs of one namespace share its pods: one places at a time, so none plans on a
        # load another is about to change (the other ticks of the fleet run alongside).
        async with self._placing.setdefault(namespace, asyncio.Lock()):
            prefix = job_prefix(namespace, name)
            priorities = {
                job_prefix(namespace, j.name): j.priority
                for j in jobs_index.get(namespace, ()) if j.uid != uid
            }
            selected = sorted(
                (s for s in services_index.get(namespace, ())
                 if s.model == spec.model and s.co_location
                 and spec.service_selector.matches(dict(s.labels))),
                key=lambda s: s.name,
            )
            tokens = await asyncio.gather(
                *(self._token(ObjectRef(s.name, namespace, s.uid, 0), now_s) for s in selected)
            )
            targets: list[tuple[str, PodAddress]] = []
            for svc, token in zip(selected, tokens, strict=True):
                pods = sorted(pods_index.get((namespace, svc.name), ()), key=lambda p: p.name)
                for pod in pods:
                    if pod.running and kube.dialable(pod.ip, self.settings.loopback_only):
                        address = PodAddress(pod.name, pod.ip, svc.grpc_port, token)
                        targets.append((svc.name, address))

            async def ask(address: PodAddress) -> SidecarStatus | None:
                try:
                    return await self.control.status(address)
                except SidecarError as exc:
                    logger.info("%s", exc)
                    return None

            statuses = await asyncio.gather(*(ask(a) for _, a in targets))
            addresses: dict[str, PodAddress] = {}
            candidates: list[CandidatePod] = []
            silent: set[str] = set()  # Running, but no answer this tick: not gone
            for (svc_name, address), status in zip(targets, statuses, strict=True):
                if status is None:
                    silent.add(address.pod)
                    continue
                addresses[address.pod] = address
                candidates.append(candidate_pod(
                    address.pod, svc_name, ready=status.engine_ready and not status.draining,
                    spare_capacity=status.spare_capacity, by_job=status.by_job, job=prefix,
                    priority=spec.priority, priorities=priorities,
                ))
            done = self.state.done.setdefault(uid, {})
            if plan is not None:
                await self._verify(plan, candidates, done, self.state.jobs.get(uid, JobMemory()))
            memory = self.state.jobs.get(uid, JobMemory())
            observed = JobObserved(plan=plan, pods=tuple(candidates), done=dict(done),
                                   merged=self.state.merged.get(uid), plan_error=plan_error,
                                   services_selected=len(selected), silent=frozenset(silent))

            def run(obs: JobObserved, mem: JobMemory) -> Any:
                return reconcile_job(namespace, name, generation, spec, observed=obs, memory=mem,
                                     previous_status=previous, now=now, now_s=now_s,
                                     settings=settings)

            outcome = run(observed, memory)
            if outcome.merge and plan is not None:
                try:
                    merged = await self._files(merge_outputs, plan, spec.output.uri,
                                               spec.output.errors)
                except (OutputError, OSError) as exc:
                    logger.warning("merge of %s/%s not possible yet: %s", namespace, name, exc)
                else:
                    self.state.merged[uid] = merged
                    outcome = run(replace(observed, merged=merged), memory)
            await self._apply_job_outcome(body, patch, outcome, uid=uid, namespace=namespace,
                                          name=name, spec=spec, plan=plan, addresses=addresses,
                                          previous=previous)

    async def _apply_job_outcome(
        self, body: kopf.Body, patch: kopf.Patch, outcome: JobOutcome, *, uid: str,
        namespace: str, name: str, spec: OfflineJobSpec, plan: Plan | None,
        addresses: dict[str, PodAddress], previous: Mapping[str, Any],
    ) -> None:
        """Revoke, assign (each concurrently), remember, write the changed status keys and
        emit the events of one reconcile."""
        memory = outcome.memory

        async def revoke(pod_name: str, shard_id: str) -> str | None:
            try:
                await self.control.revoke(addresses[pod_name], shard_id)
            except SidecarError as exc:
                logger.warning("%s", exc)
                return None
            return shard_id

        revoked = await asyncio.gather(*(revoke(p, s) for p, s in outcome.revoke
                                         if p in addresses))
        # Only a revoke the pod confirmed frees the shard: one that failed may still be
        # running there, and placing it again would run it twice.
        self._release_preempted(namespace, name, [s for s in revoked if s is not None])
        defaults = json.dumps(spec.request_defaults.body_fields())

        async def assign(pod_name: str, shard: Any) -> bool:
            assert plan is not None
            assignment = ShardAssignment(
                shard_id=shard.shard_id, job_namespace=namespace, job_name=name,
                model=spec.model, input_uri=plan.staged_uri, line_start=shard.start,
                line_end=shard.end, output_uri=plan.shard_output_uri(shard.shard_id),
                error_uri=plan.shard_error_uri(shard.shard_id),
                priority=-spec.priority, request_defaults_json=defaults,
            )
            try:
                return await self.control.assign(addresses[pod_name], assignment)
            except SidecarError as exc:
                logger.warning("%s", exc)
                return False

        accepted = await asyncio.gather(*(assign(p, s) for p, s in outcome.assign))
        refused = {s.shard_id for (_, s), ok in zip(outcome.assign, accepted, strict=True)
                   if not ok}
        if refused:
            placements = {k: v for k, v in memory.placements.items() if k not in refused}
            memory = replace(memory, placements=placements)
        self.state.jobs[uid] = memory
        self.state.addresses[uid] = addresses
        self.status_writes.record("OfflineJob", _patch_status(patch, outcome.status, previous))
        for type_, reason, message in outcome.events:
            kopf.event(body, type=type_, reason=reason, message=message)

    def _release_preempted(self, namespace: str, name: str, revoked: list[str]) -> None:
        """Drop other jobs' shards that this reconcile preempted from those jobs' placements,
        so that their next tick places them again (the pod no longer runs them)."""
        own = job_prefix(namespace, name) + "-"
        for shard_id in revoked:
            if shard_id.startswith(own):
                continue
            victim = self.state.job_uids.get(shard_id.rsplit("-", 1)[0], "")
            memory = self.state.jobs.get(victim)
            if memory is not None and shard_id in memory.placements:
                placements = {k: v for k, v in memory.placements.items() if k != shard_id}
                self.state.jobs[victim] = replace(memory, placements=placements)

    async def _verify(self, plan: Plan, pods: list[CandidatePod],
                      done: dict[str, tuple[int, int]], memory: JobMemory) -> None:
        """Count the logs of shards that may have finished: reported succeeded, or unplaced.

        ``pods`` carry this job's own shard reports only (:func:`candidate_pod`)."""
        active = {r.shard_id for p in pods for r in p.shards if r.state in ACTIVE_STATES}
        succeeded = {r.shard_id for p in pods for r in p.shards if r.state == "succeeded"}
        first = not memory.history  # a fresh operator checks every shard once
        todo = [
            shard for shard in plan.shards
            if shard.shard_id not in done and shard.shard_id not in active
            and (shard.shard_id in succeeded or shard.shard_id in memory.placements or first)
        ]
        if not todo:
            return

        def count_all() -> list[Any]:  # one file-thread hop for the whole list
            return [count_shard(plan, shard) for shard in todo]

        for shard, result in zip(todo, await self._files(count_all), strict=True):
            if result.completed + result.failed >= shard.size:
                done[shard.shard_id] = (result.completed, result.failed)

    async def job_deleted(self, name: str, namespace: str, uid: str) -> None:
        """Revoke this job's shards everywhere (outputs stay on storage)."""
        memory = self.state.jobs.pop(uid, None)
        self.specs.forget(uid)
        addresses = self.state.addresses.pop(uid, {})
        self.state.plans.pop(uid, None)
        self.state.done.pop(uid, None)
        self.state.merged.pop(uid, None)
        self.state.job_uids.pop(job_prefix(namespace, name), None)
        if memory is None:
            return
        logger.info("job %s/%s deleted; revoking %d shards", namespace, name,
                    len(memory.placements))

        async def revoke(address: PodAddress, shard_id: str) -> None:
            try:
                await self.control.revoke(address, shard_id)
            except SidecarError as exc:
                logger.warning("%s", exc)

        await asyncio.gather(*(revoke(addresses[p.pod], sid)
                               for sid, p in memory.placements.items() if p.pod in addresses))


def build_registry(handlers: Handlers) -> kopf.OperatorRegistry:
    """An explicit kopf registry with this operator's handlers."""
    registry = kopf.OperatorRegistry()
    interval = handlers.settings.reconcile_interval_s

    # Watch-backed indexes: kopf keeps them current from its watches and starts the timers
    # only once they are filled, so a tick reads pods, services and jobs from memory.
    @kopf.index("", "v1", "pods", labels={SERVICE_LABEL: kopf.PRESENT}, registry=registry,
                id=POD_INDEX)
    def slipstream_pods(*, body: kopf.Body, namespace: str | None, labels: kopf.Labels,
                        **_: Any) -> dict[tuple[str, str], kube.PodInfo]:
        return {(namespace or "default", str(labels[SERVICE_LABEL])): kube.pod_info(body)}

    @kopf.index(GROUP, VERSION, "inferenceservices", registry=registry, id=SERVICE_INDEX)
    def slipstream_services(*, body: kopf.Body, namespace: str | None,
                            **_: Any) -> dict[str, kube.ServiceInfo]:
        return {namespace or "default": kube.service_info(body)}

    @kopf.index(GROUP, VERSION, "offlinejobs", registry=registry, id=JOB_INDEX)
    def slipstream_jobs(*, body: kopf.Body, namespace: str | None,
                        **_: Any) -> dict[str, kube.JobInfo]:
        return {namespace or "default": kube.job_info(body)}

    def first_tick_after(*, meta: kopf.Meta, **_: Any) -> float:
        return kube.phase(str(meta.get("uid", "")), interval)

    # Sharp: a service ticks on a fixed grid of `interval` from its first tick, not `interval`
    # after the previous tick and its status PATCH ended. That bounds the status lag by one
    # interval plus one tick, where the default added the tick and the PATCH twice. Each
    # service's grid is offset by a hash of its uid: services applied together would
    # otherwise tick together forever, in bursts.
    #
    # With WatchStatus streams (the default) the handler itself waits for the service's turn
    # (TickPacer: the same grid, or sooner when a pod sends a change), and kopf re-arms it a
    # moment after each tick's status PATCH.
    paced = handlers.pacer is not None
    @kopf.timer(GROUP, VERSION, "inferenceservices",
                interval=PACED_REARM_S if paced else interval, idle=0, sharp=not paced,
                initial_delay=first_tick_after, backoff=HANDLER_BACKOFF_S, registry=registry,
                id="reconcile")
    async def service_timer(*, body: kopf.Body, patch: kopf.Patch, name: str,
                            namespace: str | None, uid: str, meta: kopf.Meta,
                            **kwargs: Any) -> None:
        namespace = namespace or "default"
        if handlers.pacer is not None:
            stopped = kwargs.get("stopped")
            turn = await handlers.pacer.turn(uid, stopped.wait if stopped is not None else None)
            if turn == "stopped":
                return
        try:
            await handlers.service_tick(body, patch, name=name, namespace=namespace, uid=uid,
                                        generation=int(meta.get("generation", 0)),
                                        pods_index=kwargs[POD_INDEX])
        except (OperatorError, client.ApiException) as exc:
            logger.warning("reconcile of InferenceService %s/%s failed: %s", namespace, name, exc)

    @kopf.timer(GROUP, VERSION, "offlinejobs", interval=interval, idle=0,
                backoff=HANDLER_BACKOFF_S, registry=registry, id="reconcile")
    async def job_timer(*, body: kopf.Body, patch: kopf.Patch, name: str,
                        namespace: str | None, uid: str, meta: kopf.Meta,
                        **kwargs: Any) -> None:
        namespace = namespace or "default"
        try:
            await handlers.job_tick(body, patch, name=name, namespace=namespace, uid=uid,
                                    generation=int(meta.get("generation", 0)),
                                    pods_index=kwargs[POD_INDEX],
                                    services_index=kwargs[SERVICE_INDEX],
                                    jobs_index=kwargs[JOB_INDEX])
        except (OperatorError, client.ApiException) as exc:
            logger.warning("reconcile of OfflineJob %s/%s failed: %s", namespace, name, exc)

    @kopf.on.delete(GROUP, VERSION, "offlinejobs", registry=registry, id="cleanup",
                    backoff=HANDLER_BACKOFF_S)
    async def job_delete(*, name: str, namespace: str | None, uid: str, **_: Any) -> None:
        await handlers.job_deleted(name, namespace or "default", uid)

    # -- InferenceService deletion: drain its pods' offline shards first (operator/drain.py) --
    drain_control = GrpcDrainControl(handlers.settings.sidecar_timeout_s)

    @kopf.on.delete(GROUP, VERSION, "inferenceservices", registry=registry, id="drain",
                    backoff=HANDLER_BACKOFF_S)
    async def service_delete(*, body: kopf.Body, spec: kopf.Spec, name: str,
                             namespace: str | None, uid: str, **_: Any) -> None:
        namespace = namespace or "default"
        port = int((dict(spec).get("sidecar") or {}).get("grpcPort", 9000))
        report = await drain_service(
            handlers.api, drain_control, namespace=namespace, name=name, grpc_port=port,
            token_secret=names(ObjectRef(name, namespace, uid, 0))["secret"],
            token_key=TOKEN_KEY, selector=f"{SERVICE_LABEL}={name}",
            timeout_s=handlers.settings.delete_drain_timeout_s,
            loopback_only=handlers.settings.loopback_only)
        # Forget what the ticks kept for it: its state, the children's applied digests,
        # the token, and its pods' cached sidecar replies.
        handlers.state.services.pop(uid, None)
        handlers.forget_parsed(uid)
        handlers.pools.forget(uid)
        pods = set(handlers.state.histories.pop(uid, None) or ())
        handlers.applied.forget(namespace, set(names(ObjectRef(name, namespace, uid, 0)).values()))
        handlers.state.tokens.pop((namespace, name), None)
        if handlers.feed is not None:
            handlers.feed.drop(uid)
        if handlers.pacer is not None:
            handlers.pacer.forget(uid)
        if pods:
            handlers.control.forget_pods(pods)
        logger.info("InferenceService %s/%s deleted: %s", namespace, name, report.summary())
        kopf.event(body, type="Normal" if report.complete else "Warning",
                   reason="Drained" if report.complete else "DrainIncomplete",
                   message=report.summary())

    del service_delete

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings, clusterwide=not handlers.settings.namespaces)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # kopf's own login handlers live on its default registry; this one reads the same
        # kubeconfig ($KUBECONFIG) or in-cluster account as the kubernetes client.
        info: kopf.ConnectionInfo | None = kopf.login_with_kubeconfig(**kwargs)
        return info or kopf.login_with_service_account(**kwargs)

    del slipstream_pods, slipstream_services, slipstream_jobs
    del service_timer, job_timer, job_delete, startup, login
    return registry
