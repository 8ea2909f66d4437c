"""A service tick reads each pod's latency window from its Status, and scrapes only pods
whose Status does not carry it.

The real handler (``Handlers.service_tick``) against the local cluster's kube-apiserver, and
the fleet stand-in's fake sidecars over loopback gRPC and HTTP (the real ``.proto``), once as
current sidecars (``online_counters`` in Status) and once as older ones (without). Both must
give the same observed window; only the older ones are scraped on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, cast

import aiohttp
import kopf
import pytest
from helpers_standin import standin_service
from kopf._core.engines import posting
from kubernetes import client

from slipstream_operator.handlers import Handlers
from slipstream_operator.settings import OperatorSettings
from slipstream_operator.sidecar_client import OFFER_GUARD_S, GrpcSidecarControl
from slipstream_testbed.fleet.workload import MODEL

pytestmark = [pytest.mark.cluster, pytest.mark.integration]

_ports = itertools.count(47000 + (id(object()) % 400) * 8, 2)
TOKEN = "test-token-for-the-fake-sidecars"


def _service_body(namespace: str, name: str, grpc_port: int) -> dict[str, Any]:
    """A 3-replica InferenceService body for direct ``service_tick`` calls (kopf's event
    posting off, since no operator runs)."""
    kopf_settings = kopf.OperatorSettings()
    kopf_settings.posting.enabled = False
    posting.settings_var.set(kopf_settings)
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                     "generation": 1},
        "spec": {"model": MODEL,
                 "engine": {"image": "vllm/vllm-openai:v0.11.0", "gpus": 1, "gpuType": "h100"},
                 "replicas": 3,
                 "slo": {"ttft": {"p99": "2s"}, "tbt": {"p99": "150ms"}},
                 "sidecar": {"httpPort": grpc_port + 1, "grpcPort": grpc_port}},
        "status": {},
    }


async def _observed_after_ticks(api: client.ApiClient, namespace: str, name: str,
                                counters: bool, net: int) -> tuple[list[dict[str, Any]], int]:
    grpc_port = next(_ports)
    standin, pods_index = await standin_service(api, namespace, name, TOKEN, grpc_port=grpc_port,
                                                net=net, status_counters=counters)
    body = _service_body(namespace, name, grpc_port)
    grpc_client = GrpcSidecarControl(timeout_s=5.0)
    http = aiohttp.ClientSession()
    # A Status max age of 0: every tick asks every pod, as ticks an interval apart do.
    # Polled (no WatchStatus streams, as by default): each tick reads the pods as they are.
    handlers = Handlers(OperatorSettings(loopback_only=True, reconcile_interval_s=1e-9,
                                         status_watch=False),
                        api, grpc_client, http)
    seen: list[dict[str, Any]] = []
    try:
        for _ in range(4):
            patch = kopf.Patch()
            await handlers.service_tick(cast(kopf.Body, body), patch, name=name,
                                        namespace=namespace, uid=f"uid-{name}", generation=1,
                                        pods_index=pods_index)
            body["status"] = {**body["status"], **dict(patch.status or {})}
            seen.append(dict(body["status"]["observed"]))
            standin.bump()
        scrapes = sum(p.calls.get("metrics", 0) for p in standin.pods.values())
    finally:
        await handlers.settle()
        handlers.close()
        await http.close()
        await grpc_client.close()
        await standin.stop()
    return seen, scrapes


async def test_the_window_comes_from_status_and_older_sidecars_are_scraped(
    admin_api: client.ApiClient, namespace: str,
) -> None:
    current, current_scrapes = await _observed_after_ticks(admin_api, namespace, "cur",
                                                           counters=True, net=249)
    older, older_scrapes = await _observed_after_ticks(admin_api, namespace, "old",
                                                       counters=False, net=248)
    assert current_scrapes == 0
    assert older_scrapes == 4 * 3  # every pod, every tick
    # The same window either way: no samples until a bump has landed, then one more online
    # request per pod per bump (3 pods), with the stand-in's TTFT 0.3 s and TBT 40 ms.
    assert [o["samples"] for o in current] == [o["samples"] for o in older] == [0, 3, 6, 9]
    for observed in (current[-1], older[-1]):
        assert observed["source"] == "sidecar"
        assert observed["ttftMean"] == "300ms" and observed["tbtMean"] == "40ms"
    assert current[-1] == older[-1]


async def test_a_pods_change_wakes_its_services_tick_through_the_status_stream(
    admin_api: client.ApiClient, namespace: str,
) -> None:
    """With WatchStatus streams (``status_watch``), a bump reaches the status at a tick the change
    woke, long before the 60 s interval, and no tick after the first asks a pod."""
    name = "woken"
    grpc_port = next(_ports)
    standin, pods_index = await standin_service(admin_api, namespace, name, TOKEN,
                                                grpc_port=grpc_port, net=247)
    body = _service_body(namespace, name, grpc_port)
    grpc_client = GrpcSidecarControl(timeout_s=5.0)
    http = aiohttp.ClientSession()
    handlers = Handlers(OperatorSettings(loopback_only=True, reconcile_interval_s=60.0,
                                         status_watch=True, status_watch_gap_s=0.2),
                        admin_api, grpc_client, http)
    assert handlers.pacer is not None and handlers.feed is not None
    uid = f"uid-{name}"

    async def tick() -> dict[str, Any]:
        patch = kopf.Patch()
        await handlers.service_tick(cast(kopf.Body, body), patch, name=name,
                                    namespace=namespace, uid=uid, generation=1,
                                    pods_index=pods_index)
        body["status"] = {**body["status"], **dict(patch.status or {})}
        return dict(body["status"]["observed"])

    try:
        assert await handlers.pacer.turn(uid) == "due"
        first = await tick()  # asks the pods, opens their streams, pushes the budget
        deadline = asyncio.get_running_loop().time() + 30
        while handlers.feed.streaming(uid) < 3:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        seen = [first["samples"]]
        asked = 0
        for _ in range(2):
            # A tick may push a new budget. Snapshots within a second of a Configure are not
            # kept (they may predate it), and the new generation may wake the service: let
            # that settle, and that tick go, before the bump.
            for _ in range(10):
                await handlers.settle()
                await asyncio.sleep(OFFER_GUARD_S + 0.5)
                if not handlers.pacer.pending(uid):
                    break
                assert await asyncio.wait_for(handlers.pacer.turn(uid), timeout=30) == "change"
                assert (await tick())["samples"] == seen[-1]
            else:
                raise AssertionError("the service's budget never settled")
            before = handlers.control.asked
            standin.bump()
            turn = await asyncio.wait_for(handlers.pacer.turn(uid), timeout=30)
            assert turn == "change"
            seen.append((await tick())["samples"])
            asked += handlers.control.asked - before
        assert seen == [0, 3, 6]
        assert asked == 0  # the streams answered every look of the woken ticks
        assert sum(p.calls.get("WatchStatus", 0) for p in standin.pods.values()) == 3
    finally:
        await handlers.settle()
        handlers.close()
        await handlers.feed.close()
        await http.close()
        await grpc_client.close()
        await standin.stop()
