"""An InferencePool per InferenceService that asks for one (``spec.gateway.inferencePool``).

A Gateway API Inference Extension gateway (llm-d, or any other GIE implementation) finds
model-server pods through an ``InferencePool`` (``inference.networking.k8s.io/v1``) and lets
its endpoint picker (EPP) choose one per request from the vLLM metrics it scrapes on the
pool's target port. With ``spec.gateway.inferencePool.enabled`` the operator applies a pool of
the service's name:

* ``selector.matchLabels``: the labels the operator puts on the service's pods and no other
  pods carry together (``slipstream.dev/service`` and ``app.kubernetes.io/managed-by``);
* ``targetPorts``: :func:`online_port`, the port online traffic enters;
* ``endpointPickerRef``: the spec's, as written there;
* an ownerReference to the InferenceService, so deleting the service garbage-collects it.

The pool is applied (server-side apply, like the other children) when it changes and again
every ``apply_resync_s``. Turning the setting off deletes the pool, once, if this service owns
it. The service's condition ``InferencePool`` says how it went: ``Applied``, or False with
``CRDNotInstalled`` (the API server does not serve ``inference.networking.k8s.io/v1``),
``Forbidden`` (the operator's RBAC has no ``inferencepools``: the chart's
``gateway.inferencePool.enabled``) or ``Invalid`` (the API server refused the object). Nothing
else in the tick depends on it: a missing CRD only costs that condition.

Deliberately left out: watching pools (the resync puts back an edited or deleted one), pools
spanning several services (one pool per service), and the gateway's own objects (Gateway,
HTTPRoute, the EPP's Deployment: ``docs/gateway.md`` shows them).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kubernetes import client

from slipstream_operator import kube
from slipstream_operator.api import ENGINE_PORT, Enforcement, InferenceServiceSpec
from slipstream_operator.conditions import find_condition, set_condition
from slipstream_operator.reconcile_service import (
    MANAGED_BY,
    SERVICE_LABEL,
    ObjectRef,
)

logger = logging.getLogger(__name__)

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_PLURAL = "inferencepools"
POOL_API_VERSION = f"{POOL_GROUP}/{POOL_VERSION}"
POOL_KIND = "InferencePool"
CONDITION = "InferencePool"

Runner = Callable[..., Awaitable[Any]]
"""How blocking client calls run: ``await run(fn, *args)`` (the handlers' kube executor)."""


def online_port(spec: InferenceServiceSpec) -> int:
    """The pod port online traffic enters, which is the pool's target port.

    With ``scheduling.enforcement: sidecar`` the sidecar serves the OpenAI API on
    ``spec.sidecar.httpPort`` and holds, orders and prices every online request there; vLLM
    listens on 127.0.0.1 only. With ``engine`` the scheduling runs inside vLLM (Slipstream's
    scheduler plugin), so online traffic enters at vLLM's own port.
    """
    if spec.scheduling.enforcement == Enforcement.ENGINE:
        return ENGINE_PORT
    return spec.sidecar.http_port


def pod_labels(ref: ObjectRef) -> dict[str, str]:
    """The labels that select exactly the service's pods (the operator sets both on them)."""
    return {SERVICE_LABEL: ref.name, **MANAGED_BY}


def render_pool(ref: ObjectRef, spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """The InferencePool for the spec, or None when the spec does not ask for one."""
    wanted = spec.gateway.inference_pool
    if not wanted.enabled or wanted.endpoint_picker_ref is None:
        return None
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": POOL_KIND,
        "metadata": {
            "name": ref.name,
            "namespace": ref.namespace,
            "labels": {SERVICE_LABEL: ref.name, **MANAGED_BY},
            "ownerReferences": [ref.owner_reference()],
        },
        "spec": {
            "selector": {"matchLabels": pod_labels(ref)},
            "targetPorts": [{"number": online_port(spec)}],
            "endpointPickerRef": wanted.endpoint_picker_ref.wire(),
        },
    }


# ------------------------------------------------------------------------ blocking calls


def apply_pool(api: client.ApiClient, pool: dict[str, Any]) -> None:
    """Server-side apply of the pool (field manager ``slipstream-operator``, forced)."""
    meta = pool["metadata"]
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        POOL_GROUP, POOL_VERSION, meta["namespace"], POOL_PLURAL, meta["name"], pool,
        field_manager=kube.FIELD_MANAGER, force=True, _content_type=kube.APPLY,
    )


def delete_owned_pool(api: client.ApiClient, namespace: str, name: str, owner_uid: str) -> bool:
    """Delete the pool ``name`` if the owner ``owner_uid`` owns it; whether one was deleted.

    A pool someone else made under that name is left alone; a missing one (or a missing CRD)
    counts as deleted already.
    """
    objects = client.CustomObjectsApi(api)
    try:
        pool = objects.get_namespaced_custom_object(POOL_GROUP, POOL_VERSION, namespace,
                                                    POOL_PLURAL, name)
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    meta = (pool.get("metadata") or {}) if isinstance(pool, dict) else {}
    if not any(o.get("uid") == owner_uid for o in meta.get("ownerReferences") or ()):
        return False
    try:
        objects.delete_namespaced_custom_object(
            POOL_GROUP, POOL_VERSION, namespace, POOL_PLURAL, name,
            body=client.V1DeleteOptions(preconditions=client.V1Preconditions(
                uid=str(meta.get("uid") or "") or None)))
    except client.ApiException as exc:
        if exc.status in (404, 409):  # gone already, or replaced by another object
            return False
        raise
    return True


def pools_served(api: client.ApiClient) -> bool:
    """Whether the API server serves ``inference.networking.k8s.io/v1`` (the CRD is installed)."""
    try:
        client.CustomObjectsApi(api).get_api_resources(POOL_GROUP, POOL_VERSION)
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


# ------------------------------------------------------------------------ per-tick sync


@dataclass(frozen=True, slots=True)
class _Verdict:
    ok: bool
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class _Applied:
    digest: str
    at_s: float
    verdict: _Verdict


def _refusal(exc: client.ApiException) -> str:
    import json

    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)[:1000]
    except ValueError:
        return str(exc.reason)[:1000]


class InferencePools:
    """Keeps each service's InferencePool as its spec says, and its ``InferencePool`` condition.

    :meth:`sync` runs in the service tick after the other children are applied: it applies a
    changed pool, re-applies an unchanged one every ``resync_s`` (spread per pool), deletes one
    the spec no longer asks for, and sets or removes the condition in the status it is given.
    """

    def __init__(self, api: client.ApiClient, resync_s: float, run: Runner) -> None:
        self.api = api
        self.resync_s = resync_s
        self._run = run
        self._applied: dict[str, _Applied] = {}

    async def sync(self, ref: ObjectRef, spec: InferenceServiceSpec,
                   conditions: list[dict[str, Any]], *, now: datetime, now_s: float) -> None:
        pool = render_pool(ref, spec)
        if pool is None:
            await self._remove(ref, conditions, now=now)
            return
        digest = kube.child_digest(pool)
        last = self._applied.get(ref.uid)
        due = kube.spread(f"{POOL_KIND}/{ref.namespace}/{ref.name}", self.resync_s)
        if last is None or last.digest != digest or now_s - last.at_s >= due:
            verdict = await self._apply(pool)
            if verdict is None:
                return  # a transient failure: logged, the next tick tries again
            last = _Applied(digest, now_s, verdict)
            self._applied[ref.uid] = last
        set_condition(conditions, CONDITION, last.verdict.ok, reason=last.verdict.reason,
                      message=last.verdict.message, now=now, observed_generation=ref.generation)

    def forget(self, uid: str) -> None:
        """Drop what is kept for a deleted service (its pool goes with it, by ownerReference)."""
        self._applied.pop(uid, None)

    async def _apply(self, pool: dict[str, Any]) -> _Verdict | None:
        meta = pool["metadata"]
        try:
            await self._run(apply_pool, self.api, pool)
        except client.ApiException as exc:
            if exc.status == 404:
                try:
                    served = await self._run(pools_served, self.api)
                except client.ApiException as probe:
                    logger.warning("InferencePool %s/%s: discovery failed: %s",
                                   meta["namespace"], meta["name"], probe)
                    return None
                if not served:
                    return _Verdict(False, "CRDNotInstalled",
                                    f"the API server does not serve {POOL_API_VERSION} "
                                    "inferencepools: install the InferencePool CRD of the "
                                    "Gateway API Inference Extension (docs/gateway.md)")
            if exc.status == 403:
                logger.warning("InferencePool %s/%s: %s", meta["namespace"], meta["name"],
                               _refusal(exc))
                return _Verdict(False, "Forbidden",
                                "the operator may not manage inferencepools: install the chart "
                                "with gateway.inferencePool.enabled=true")
            if exc.status in (400, 422):
                return _Verdict(False, "Invalid", _refusal(exc))
            logger.warning("applying InferencePool %s/%s failed: %s", meta["namespace"],
                           meta["name"], exc)
            return None
        ports = ",".join(str(p["number"]) for p in pool["spec"]["targetPorts"])
        selector = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())
        picker = pool["spec"]["endpointPickerRef"]
        return _Verdict(True, "Applied",
                        f"InferencePool {meta['name']} selects {selector} on port {ports}; "
                        f"endpoint picker {picker.get('kind', 'Service')}/{picker['name']}")

    async def _remove(self, ref: ObjectRef, conditions: list[dict[str, Any]], *,
                      now: datetime) -> None:
        """Delete the pool once the spec stops asking for it (known from the condition, which
        survives an operator restart), then drop the condition."""
        if find_condition(conditions, CONDITION) is None and ref.uid not in self._applied:
            return
        try:
            deleted = await self._run(delete_owned_pool, self.api, ref.namespace, ref.name,
                                      ref.uid)
        except client.ApiException as exc:
            if exc.status == 403:
                set_condition(conditions, CONDITION, False, reason="Forbidden",
                              message="spec.gateway.inferencePool is off but the operator may "
                              "not delete its InferencePool: delete it by hand or allow "
                              "inferencepools (chart gateway.inferencePool.enabled)", now=now,
                              observed_generation=ref.generation)
                return
            logger.warning("deleting InferencePool %s/%s failed: %s", ref.namespace, ref.name,
                           exc)
            return
        if deleted:
            logger.info("InferencePool %s/%s deleted (spec.gateway.inferencePool is off)",
                        ref.namespace, ref.name)
        self._applied.pop(ref.uid, None)
        conditions[:] = [c for c in conditions if c.get("type") != CONDITION]
