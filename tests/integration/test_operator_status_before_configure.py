"""A service tick writes its status without waiting for the Configure pushes it starts.

The real handler (``Handlers.service_tick``) against the local cluster's kube-apiserver (the
token Secret and the children are real API calls), the fleet stand-in's fake sidecars over
loopback gRPC and HTTP (the real ``.proto``), and a gate on the client's Configure calls: the
tick that changes the budget must return its status (``BudgetReady=False``, ``Pushing``)
while every Configure is still held, and the tick after the pushes must say
``BudgetReady=True`` with the pods' Status answered from the cache that Configure refreshed.
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
from slipstream_operator.sidecar_client import (
    ConfigureCall,
    GrpcSidecarControl,
    PodAddress,
    ShardAssignment,
    SidecarStatus,
)
from slipstream_testbed.fleet.workload import MODEL

pytestmark = [pytest.mark.cluster, pytest.mark.integration]

_ports = itertools.count(45000 + (id(object()) % 400) * 8, 2)
TOKEN = "test-token-for-the-fake-sidecars"


class GatedConfigure:
    """The real gRPC client; Configure calls wait at a gate, and the wire calls are counted."""

    def __init__(self, inner: GrpcSidecarControl) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.configure_waiting = 0
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    async def status(self, address: PodAddress) -> SidecarStatus:
        self._count("status")
        return await self.inner.status(address)

    async def configure(self, address: PodAddress, call: ConfigureCall) -> int:
        self.configure_waiting += 1
        await self.gate.wait()
        self.configure_waiting -= 1
        self._count("configure")
        return await self.inner.configure(address, call)

    async def assign(self, address: PodAddress, shard: ShardAssignment) -> bool:
        return await self.inner.assign(address, shard)

    async def revoke(self, address: PodAddress, shard_id: str) -> bool:
        return await self.inner.revoke(address, shard_id)


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions", [])}


async def test_the_status_is_written_before_configure_and_budget_ready_follows(
    admin_api: client.ApiClient, namespace: str,
) -> None:
    name = "svc"
    grpc_port = next(_ports)
    standin, pods_index = await standin_service(admin_api, namespace, name, TOKEN,
                                                grpc_port=grpc_port, net=253)
    ips = [p.ip for p in pods_index[(namespace, name)]]
    body = {
        "metadata": {"name": name, "namespace": namespace, "uid": "uid-status-first",
                     "generation": 1},
        "spec": {"model": MODEL,
                 "engine": {"image": "vllm/vllm-openai:v0.11.0", "gpus": 1, "gpuType": "h100"},
                 "replicas": 3,
                 "slo": {"ttft": {"p99": "2s", "mean": "600ms"},
                         "tbt": {"p99": "150ms", "mean": "60ms"}},
                 "scheduling": {"ordering": "gittins", "coLocation": True},
                 "sidecar": {"httpPort": grpc_port + 1, "grpcPort": grpc_port}},
        "status": {},
    }
    grpc_client = GrpcSidecarControl(timeout_s=5.0)
    gated = GatedConfigure(grpc_client)
    kopf_settings = kopf.OperatorSettings()
    kopf_settings.posting.enabled = False  # kopf.event needs its settings; nothing is posted
    posting.settings_var.set(kopf_settings)
    http = aiohttp.ClientSession()
    handlers = Handlers(OperatorSettings(loopback_only=True, reconcile_interval_s=60.0),
                        admin_api, gated, http)

    async def tick() -> dict[str, Any]:
        patch = kopf.Patch()
        await handlers.service_tick(cast(kopf.Body, body), patch, name=name,
                                    namespace=namespace, uid="uid-status-first", generation=1,
                                    pods_index=pods_index)
        status = {**body["status"], **dict(patch.status or {})}
        body["status"] = status
        return status

    try:
        # Ticks until the first online samples give the service a budget: that tick changes
        # it and starts the Configure pushes, which are held at the gate.
        for _ in range(5):
            standin.bump()
            ticking = asyncio.ensure_future(tick())
            while not ticking.done() and gated.configure_waiting < len(ips):
                await asyncio.sleep(0.01)
            assert ticking.done()  # never held by a Configure
            status = ticking.result()
            for _ in range(20):  # let the pushes it started (if any) reach the gate
                await asyncio.sleep(0)
            if gated.configure_waiting:
                break
        assert gated.configure_waiting == len(ips)
        assert "configure" not in gated.calls  # none reached a pod, yet the tick returned
        assert status["budget"]["configGeneration"] == 1
        ready = _conditions(status)["BudgetReady"]
        assert (ready["status"], ready["reason"]) == ("False", "Pushing")
        assert all(p.generation == 0 for p in standin.pods.values())

        gated.gate.set()
        await handlers.settle()
        assert gated.calls["configure"] == len(ips)
        assert all(p.generation == 1 for p in standin.pods.values())
        # The next tick (within the Status max age: a job tick, or a service tick asking
        # again) sees the new generation from the refreshed cache, without a new Status.
        asked = gated.calls["status"]
        status = await tick()
        assert gated.calls["status"] == asked
        ready = _conditions(status)["BudgetReady"]
        assert ready["status"] == "True" and "generation 1" in ready["message"]
        assert handlers.control.refreshed == len(ips)
    finally:
        gated.gate.set()
        await handlers.settle()
        handlers.close()
        await http.close()
        await grpc_client.close()
        await standin.stop()
