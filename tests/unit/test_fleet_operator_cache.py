"""The operator's fleet-scale parts: apply-on-change, status diffing, shared sidecar Status,
bounded fan-out and the views of watched bodies.

Sidecar calls go over real loopback gRPC to the fleet stand-in (the real ``.proto``); a thin
counting wrapper around the real client records what reached the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from slipstream_operator import kube
from slipstream_operator.errors import SidecarError
from slipstream_operator.handlers import ParsedSpecs, changed_status
from slipstream_operator.sidecar_client import (
    ConfigureCall,
    GrpcSidecarControl,
    PodAddress,
    ShardAssignment,
    SharedSidecarControl,
    SidecarStatus,
    gather_bounded,
)
from slipstream_testbed.fleet.standin import Standin, StandinConfig

pytestmark = pytest.mark.unit

_ports = itertools.count(44000 + (id(object()) % 500) * 8, 2)


def _deployment(replicas: int = 2, namespace: str = "ns", name: str = "svc") -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": {"a": "b"}},
        "spec": {"replicas": replicas, "template": {"metadata": {"labels": {"a": "b"}}}},
    }


# ----------------------------------------------------------------------------- apply on change


def test_a_child_is_applied_when_new_changed_or_due_for_resync() -> None:
    applied = kube.AppliedChildren(resync_s=60.0)
    child = _deployment()
    assert applied.due(child, 0.0)  # never applied
    applied.applied(child, 0.0)
    assert not applied.due(child, 1.0)
    assert not applied.due(_deployment(), 59.9)  # an equal rendering (a new dict) is not sent
    assert applied.due(_deployment(replicas=3), 1.0)  # changed
    assert applied.changed(_deployment(replicas=3)) and not applied.changed(child)
    # Resync (puts back a deleted or edited child) after 60-90 s, a fixed spread per child.
    period = kube.spread("Deployment/ns/svc", 60.0)
    assert 60.0 <= period < 90.0
    assert not applied.resync_due(child, period - 0.01)
    assert applied.resync_due(child, period) and applied.due(child, period)
    applied.applied(child, 90.0)
    assert not applied.due(child, 91.0)
    # Another child of the same name but another kind or namespace is tracked separately.
    other = dict(_deployment(), kind="Service")
    assert applied.due(other, 91.0)
    assert applied.due(_deployment(namespace="other"), 91.0)


def test_phase_spreads_first_ticks_over_the_interval() -> None:
    offsets = sorted(kube.phase(f"uid-{i}", 5.0) for i in range(500))
    assert offsets[0] >= 0.0 and offsets[-1] < 5.0
    # Spread over the whole interval, not bunched: every fifth of it holds 50-150 of 500.
    per_fifth = [sum(1 for o in offsets if k <= o < k + 1.0) for k in range(5)]
    assert min(per_fifth) > 50 and max(per_fifth) < 150
    assert kube.phase("uid-7", 5.0) == kube.phase("uid-7", 5.0)


def test_spread_keeps_periodic_work_of_many_objects_out_of_step() -> None:
    periods = [kube.spread(f"ns/svc-{i}", 60.0) for i in range(500)]
    assert all(60.0 <= p < 90.0 for p in periods)
    assert kube.spread("ns/svc-1", 60.0) == periods[1]  # fixed per key
    # Spread over the half period: every 3-second slot is used, none holds 1.6x its share.
    slots = [int((p - 60.0) // 3) for p in periods]
    assert set(slots) == set(range(10))
    assert max(slots.count(k) for k in set(slots)) < 80


def test_forget_drops_a_deleted_owners_children() -> None:
    applied = kube.AppliedChildren(resync_s=60.0)
    applied.applied(_deployment(name="a"), 0.0)
    applied.applied(_deployment(name="b"), 0.0)
    applied.forget("ns", {"a"})
    assert len(applied) == 1
    assert applied.due(_deployment(name="a"), 1.0)
    assert not applied.due(_deployment(name="b"), 1.0)


def test_digest_ignores_key_order_only() -> None:
    a = {"kind": "ConfigMap", "metadata": {"name": "x", "namespace": "n"}, "data": {"k": "1"}}
    b = {"data": {"k": "1"}, "metadata": {"namespace": "n", "name": "x"}, "kind": "ConfigMap"}
    assert kube.child_digest(a) == kube.child_digest(b)
    assert kube.child_digest(a) != kube.child_digest({**a, "data": {"k": "2"}})


def test_only_changed_status_keys_are_patched() -> None:
    previous = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                "observed": {"samples": 3, "ttftP99S": 0.5}}
    same = {"phase": "Running", "conditions": [{"status": "True", "type": "Ready"}],
            "observed": {"ttftP99S": 0.5, "samples": 3}}
    assert changed_status(same, previous) == {}
    bumped = {**same, "observed": {"samples": 4, "ttftP99S": 0.5}}
    assert changed_status(bumped, previous) == {"observed": {"samples": 4, "ttftP99S": 0.5}}
    assert changed_status({"shards": {"total": 5}}, previous) == {"shards": {"total": 5}}



def test_a_whole_float_is_not_a_change_from_the_integer_the_api_server_served() -> None:
    # The API server writes 32.0 back as 32: computing 32.0 again is no change (it used to
    # PATCH every job's status at every tick, each a no-op on the server).
    served = {"tokensPerSecond": 32, "offline": {"tokensPerSecond": 12, "activeShards": 4},
              "history": [1, 2]}
    computed = {"tokensPerSecond": 32.0,
                "offline": {"tokensPerSecond": 12.0, "activeShards": 4}, "history": [1.0, 2]}
    assert changed_status(computed, served) == {}
    assert changed_status({"tokensPerSecond": 32.5}, served) == {"tokensPerSecond": 32.5}
    assert changed_status({"tokensPerSecond": 31.0}, served) == {"tokensPerSecond": 31.0}
    assert changed_status({"offline": {"tokensPerSecond": 12.0, "activeShards": 5}},
                          served) == {"offline": {"tokensPerSecond": 12.0, "activeShards": 5}}
    assert changed_status({"ready": True}, {"ready": 1}) == {"ready": True}  # bool is no number


def test_statuses_compare_as_served_json_without_serializing() -> None:
    from datetime import UTC, datetime

    at = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    assert changed_status({"at": at, "pods": ("a", "b")}, {"at": str(at), "pods": ["a", "b"]}) == {}
    assert changed_status({"pods": ("a", "c")}, {"pods": ["a", "b"]}) == {"pods": ("a", "c")}
    assert changed_status({"x": {"y": [True]}}, {"x": {"y": [1]}}) == {"x": {"y": [True]}}
    assert changed_status({"x": float("nan")}, {"x": float("nan")}) == {}
    assert changed_status({"x": {"a": 1}}, {"x": {"a": 1, "b": 2}}) == {"x": {"a": 1}}
    assert changed_status({"x": "1"}, {"x": 1}) == {"x": "1"}  # text is no number


def test_a_spec_is_parsed_again_only_when_it_changed() -> None:
    from slipstream_operator.api import InferenceServiceSpec

    specs = ParsedSpecs()
    raw = {"model": "m", "engine": {"image": "vllm/vllm-openai:v0.11.0"}, "replicas": 2,
           "slo": {"tbt": {"p99": "100ms"}}}
    first, problems = specs.parse("uid-1", raw, InferenceServiceSpec)
    assert problems == () and first.replicas == 2
    again, _ = specs.parse("uid-1", {**raw, "engine": dict(raw["engine"])}, InferenceServiceSpec)
    assert again is first  # equal spec: the parsed one is reused
    raw["engine"]["image"] = "vllm/vllm-openai:v0.12.0"  # a nested edit is seen too
    edited, _ = specs.parse("uid-1", raw, InferenceServiceSpec)
    assert edited is not first and edited.engine.image.endswith("v0.12.0")
    with pytest.raises(ValueError, match="replicas"):
        specs.parse("uid-1", {**raw, "replicas": -1}, InferenceServiceSpec)
    with pytest.raises(ValueError, match="replicas"):  # a bad spec is never kept
        specs.parse("uid-1", {**raw, "replicas": -1}, InferenceServiceSpec)
    assert specs.parse("uid-1", raw, InferenceServiceSpec)[0] is edited
    specs.forget("uid-1")
    assert len(specs) == 0


# ----------------------------------------------------------------------------- watched bodies


def test_views_of_watched_bodies() -> None:
    pod = {"metadata": {"name": "p", "labels": {"slipstream.dev/service": "s"}},
           "status": {"phase": "Running", "podIP": "127.1.0.9"}}
    assert kube.pod_info(pod) == kube.PodInfo("p", "127.1.0.9", True,
                                              {"slipstream.dev/service": "s"})
    deleting = {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert not kube.pod_info(deleting).running
    assert not kube.pod_info({"metadata": {"name": "q"}, "status": {"phase": "Pending"}}).running
    service = {"metadata": {"name": "s", "uid": "u1", "labels": {"pool": "a"}},
               "spec": {"model": "m", "sidecar": {"grpcPort": 9100},
                        "scheduling": {"coLocation": False}}}
    assert kube.service_info(service) == kube.ServiceInfo("s", "u1", "m", False,
                                                          (("pool", "a"),), 9100)
    plain = kube.service_info({"metadata": {"name": "t", "uid": "u2"}, "spec": {"model": "m"}})
    assert plain.co_location and plain.grpc_port == 9000 and plain.labels == ()
    job = {"metadata": {"name": "j", "uid": "u3"}, "spec": {"priority": 7}}
    assert kube.job_info(job) == kube.JobInfo("j", "u3", 7)


# ----------------------------------------------------------------------------- bounded fan-out


async def test_gather_bounded_keeps_order_and_the_limit() -> None:
    running = 0
    peak = 0

    def call(i: int) -> Any:
        async def go() -> int:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.001 * (i % 3))
            running -= 1
            return i * i
        return go

    assert await gather_bounded([call(i) for i in range(40)], limit=5) == [
        i * i for i in range(40)]
    assert peak == 5

    async def boom() -> int:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await gather_bounded([call(1), boom, call(2)], limit=2)


# ----------------------------------------------------------------------------- shared Status


class Counting:
    """The real gRPC client, counting the calls that reached the wire and the peak in flight."""

    def __init__(self, inner: GrpcSidecarControl) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}
        self.flying = 0
        self.peak = 0

    async def _go(self, name: str, coro: Any) -> Any:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.flying += 1
        self.peak = max(self.peak, self.flying)
        try:
            return await coro
        finally:
            self.flying -= 1

    async def status(self, address: PodAddress) -> SidecarStatus:
        result: SidecarStatus = await self._go("status", self.inner.status(address))
        return result

    async def configure(self, address: PodAddress, call: ConfigureCall) -> int:
        result: int = await self._go("configure", self.inner.configure(address, call))
        return result

    async def assign(self, address: PodAddress, shard: ShardAssignment) -> bool:
        result: bool = await self._go("assign", self.inner.assign(address, shard))
        return result

    async def revoke(self, address: PodAddress, shard_id: str) -> bool:
        result: bool = await self._go("revoke", self.inner.revoke(address, shard_id))
        return result


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _shard(shard_id: str) -> ShardAssignment:
    return ShardAssignment(shard_id=shard_id, job_namespace="ns", job_name="job", model="m",
                           input_uri="file:///in.jsonl", line_start=0, line_end=10,
                           output_uri="file:///o", error_uri="file:///e", priority=0)


async def test_status_is_shared_per_pod_and_dropped_when_the_operator_changes_the_pod() -> None:
    grpc_port = next(_ports)
    standin = Standin(StandinConfig(http_port=grpc_port + 1, grpc_port=grpc_port,
                                    lines_per_second=0.001))
    await standin.start()
    grpc_client = GrpcSidecarControl(timeout_s=5.0)
    counting = Counting(grpc_client)
    clock = Clock()
    shared = SharedSidecarControl(counting, max_age_s=4.0, limit=3, clock=clock)
    try:
        addresses = []
        for i in range(6):
            ip = f"127.1.251.{10 + i}"
            await standin.add_pod(f"pod-{i}", ip, "tok")
            addresses.append(PodAddress(f"pod-{i}", ip, grpc_port, "tok"))
        a = addresses[0]
        # A service tick and three job ticks look at pod-0 at once: one call on the wire.
        replies = await asyncio.gather(*(shared.status(a) for _ in range(4)))
        assert counting.calls == {"status": 1} and shared.asked == 1
        assert len({r.generation for r in replies}) == 1
        clock.now += 3.9
        await shared.status(a)
        assert counting.calls["status"] == 1  # still fresh
        clock.now += 0.2
        await shared.status(a)
        assert counting.calls["status"] == 2  # older than max_age: asked again

        # Assigning a shard drops the cached reply: the next look sees the shard.
        assert await shared.assign(a, _shard("job-0001"))
        status = await shared.status(a)
        assert counting.calls["status"] == 3
        assert [s.shard_id for s in status.shards] == ["job-0001"]
        # A Configure the pod took at the call's generation updates the cached reply from the
        # call instead of dropping it: no Status on the wire, and the pod agrees.
        assert await shared.configure(a, ConfigureCall(generation=2, budget_s=0.1)) == 2
        refreshed = await shared.status(a)
        assert (refreshed.generation, refreshed.budget_s) == (2, 0.1)
        assert refreshed.shards == status.shards and counting.calls["status"] == 3
        on_pod = await grpc_client.status(a)
        assert (on_pod.generation, on_pod.budget_s) == (2, 0.1)
        assert await shared.revoke(a, "job-0001")
        assert not (await shared.status(a)).shards
        assert counting.calls == {"status": 4, "assign": 1, "configure": 1, "revoke": 1}

        # Fan-out over every pod stays within the limit.
        counting.peak = 0
        clock.now += 10.0
        await asyncio.gather(*(shared.status(x) for x in addresses for _ in range(3)))
        assert counting.peak <= 3
        assert counting.calls["status"] == 4 + 6  # one per pod, shared by the three askers

        # A pod that is gone is forgotten; a refused call is not cached.
        shared.forget_pods({"pod-1"})
        await shared.status(addresses[1])
        assert counting.calls["status"] == 11
        wrong = PodAddress("pod-2", addresses[2].ip, grpc_port, "not-the-token")
        for _ in range(2):
            with pytest.raises(SidecarError, match="UNAUTHENTICATED"):
                await shared.status(wrong)
        assert counting.calls["status"] == 13
        assert shared.failed == 2 and shared.asked == counting.calls["status"]
    finally:
        await grpc_client.close()
        await standin.stop()


async def test_a_reply_that_raced_a_change_is_not_kept() -> None:
    grpc_port = next(_ports)
    standin = Standin(StandinConfig(http_port=grpc_port + 1, grpc_port=grpc_port,
                                    lines_per_second=0.001))
    await standin.start()
    grpc_client = GrpcSidecarControl(timeout_s=5.0)
    counting = Counting(grpc_client)
    shared = SharedSidecarControl(counting, max_age_s=60.0, limit=8)
    try:
        await standin.add_pod("pod-r", "127.1.251.40", "tok")
        a = PodAddress("pod-r", "127.1.251.40", grpc_port, "tok")
        look = asyncio.ensure_future(shared.status(a))
        await asyncio.sleep(0)  # the Status call is in flight
        assert await shared.assign(a, _shard("job-0002"))
        await look
        # The in-flight reply may predate the assignment, so it was not kept.
        assert [s.shard_id for s in (await shared.status(a)).shards] == ["job-0002"]
        assert counting.calls["status"] == 2
    finally:
        await grpc_client.close()
        await standin.stop()


class Gated(Counting):
    """Status calls wait at a gate before going on the wire (to hold one in flight)."""

    def __init__(self, inner: GrpcSidecarControl) -> None:
        super().__init__(inner)
        self.gate = asyncio.Event()

    async def status(self, address: PodAddress) -> SidecarStatus:
        await self.gate.wait()
        return await super().status(address)


async def test_a_look_after_a_change_never_joins_a_call_from_before_it() -> None:
    grpc_port = next(_ports)
    standin = Standin(StandinConfig(http_port=grpc_port + 1, grpc_port=grpc_port,
                                    lines_per_second=0.001))
    await standin.start()
    grpc_client = GrpcSidecarControl(timeout_s=5.0)
    gated = Gated(grpc_client)
    shared = SharedSidecarControl(gated, max_age_s=60.0, limit=8)
    try:
        await standin.add_pod("pod-g", "127.1.251.50", "tok")
        a = PodAddress("pod-g", "127.1.251.50", grpc_port, "tok")
        early = asyncio.ensure_future(shared.status(a))  # held at the gate
        joined = asyncio.ensure_future(shared.status(a))  # joins the same call
        await asyncio.sleep(0.01)
        assert await shared.assign(a, _shard("job-0003"))
        late = asyncio.ensure_future(shared.status(a))  # must not join the early call
        await asyncio.sleep(0.01)
        gated.gate.set()
        # The early call's answer is the one its askers get: whatever it saw.
        early_reply, joined_reply, late_reply = await asyncio.gather(early, joined, late)
        assert early_reply is joined_reply
        assert [s.shard_id for s in late_reply.shards] == ["job-0003"]
        assert gated.calls["status"] == 2
    finally:
        await grpc_client.close()
        await standin.stop()


def test_a_preempted_shard_leaves_its_owners_placements() -> None:
    from kubernetes import client

    from slipstream_operator.handlers import Handlers
    from slipstream_operator.reconcile_job import JobMemory, Placement, job_prefix
    from slipstream_operator.settings import OperatorSettings

    handlers = Handlers(OperatorSettings(), client.ApiClient(), GrpcSidecarControl())
    try:
        low = job_prefix("ns", "low")
        handlers.state.job_uids[low] = "uid-low"
        kept = Placement("pod-a", 1.0, 1.0, 0)
        handlers.state.jobs["uid-low"] = JobMemory(
            placements={f"{low}-0001": kept, f"{low}-0002": Placement("pod-a", 1.0, 1.0, 0)}
        )
        own = f"{job_prefix('ns', 'high')}-0001"
        handlers._release_preempted("ns", "high", [f"{low}-0002", own, "ns-unknown-0001"])
        assert handlers.state.jobs["uid-low"].placements == {f"{low}-0001": kept}
    finally:
        handlers.close()


async def test_a_configure_at_another_generation_drops_the_cached_reply() -> None:
    grpc_port = next(_ports)
    standin = Standin(StandinConfig(http_port=grpc_port + 1, grpc_port=grpc_port))
    await standin.start()
    grpc_client = GrpcSidecarControl(timeout_s=5.0)
    counting = Counting(grpc_client)
    shared = SharedSidecarControl(counting, max_age_s=60.0, limit=4)
    try:
        pod = await standin.add_pod("pod-c", "127.1.251.60", "tok")
        a = PodAddress("pod-c", "127.1.251.60", grpc_port, "tok")
        assert await shared.configure(a, ConfigureCall(generation=5, budget_s=0.2)) == 5
        assert (await shared.status(a)).generation == 5  # nothing was cached: asked
        assert counting.calls["status"] == 1
        # An older generation is ignored by the pod (it answers 5): what is in force is not
        # the call's, so the reply is dropped, and the next look asks the pod.
        assert await shared.configure(a, ConfigureCall(generation=3, budget_s=0.9)) == 5
        again = await shared.status(a)
        assert (again.generation, again.budget_s) == (5, 0.2) and counting.calls["status"] == 2
        # A failed Configure drops it too.
        pod.token = "rotated"
        with pytest.raises(SidecarError, match="UNAUTHENTICATED"):
            await shared.configure(a, ConfigureCall(generation=6, budget_s=0.3))
        pod.token = "tok"
        assert (await shared.status(a)).generation == 5 and counting.calls["status"] == 3
        assert shared.refreshed == 0
    finally:
        await grpc_client.close()
        await standin.stop()


class Ordered(Counting):
    """Records the order in which Status calls reach the wire; the first one waits at a gate."""

    def __init__(self, inner: GrpcSidecarControl) -> None:
        super().__init__(inner)
        self.gate = asyncio.Event()
        self.order: list[str] = []

    async def status(self, address: PodAddress) -> SidecarStatus:
        self.order.append(address.pod)
        if len(self.order) == 1:
            await self.gate.wait()
        return await super().status(address)


async def test_a_service_ticks_status_is_served_before_job_ticks_calls() -> None:
    grpc_port = next(_ports)
    standin = Standin(StandinConfig(http_port=grpc_port + 1, grpc_port=grpc_port))
    await standin.start()
    grpc_client = GrpcSidecarControl(timeout_s=5.0)
    ordered = Ordered(grpc_client)
    shared = SharedSidecarControl(ordered, max_age_s=60.0, limit=1)
    try:
        addresses = {}
        for i, name in enumerate(["held", "job-a", "job-b", "svc", "both"]):
            ip = f"127.1.251.{70 + i}"
            await standin.add_pod(name, ip, "tok")
            addresses[name] = PodAddress(name, ip, grpc_port, "tok")
        held = asyncio.ensure_future(shared.status(addresses["held"]))  # takes the one slot
        await asyncio.sleep(0.01)
        # Job ticks queue first (a Status each and a Configure), then a service tick asks.
        jobs = [asyncio.ensure_future(shared.status(addresses[n]))
                for n in ("job-a", "both", "job-b")]
        configure = asyncio.ensure_future(
            shared.configure(addresses["job-a"], ConfigureCall(generation=1, budget_s=0.1)))
        await asyncio.sleep(0.01)
        service = asyncio.ensure_future(shared.status(addresses["svc"], urgent=True))
        # A service tick joining a job tick's call still waiting for a slot makes it urgent.
        joined = asyncio.ensure_future(shared.status(addresses["both"], urgent=True))
        await asyncio.sleep(0.01)
        assert ordered.order == ["held"] and shared._slots.waiting == 5
        ordered.gate.set()
        await asyncio.gather(held, service, joined, configure, *jobs)
        assert ordered.order == ["held", "svc", "both", "job-a", "job-b"]
        assert ordered.calls == {"status": 5, "configure": 1}
        assert (await joined) is (await jobs[1])
    finally:
        ordered.gate.set()
        await grpc_client.close()
        await standin.stop()


async def test_priority_slots_keep_the_limit_and_pass_on_a_cancelled_waiters_slot() -> None:
    from slipstream_operator.sidecar_client import PrioritySlots

    slots = PrioritySlots(2)
    first, second = slots.waiter(False), slots.waiter(True)
    await slots.acquire(first)
    await slots.acquire(second)  # both free slots taken at once
    late = [slots.waiter(False) for _ in range(3)]
    tasks = [asyncio.ensure_future(slots.acquire(w)) for w in late]
    await asyncio.sleep(0)
    assert slots.waiting == 3 and not any(t.done() for t in tasks)
    tasks[0].cancel()  # gives up while waiting: skipped
    slots.release()
    await asyncio.sleep(0)
    assert tasks[1].done() and not tasks[2].done() and tasks[0].cancelled()
    slots.release()
    slots.release()  # the last waiter is served; one slot is free again
    await asyncio.sleep(0)
    assert tasks[2].done() and slots.waiting == 0
    extra = slots.waiter(False)
    await slots.acquire(extra)  # the freed slot
    blocked = asyncio.ensure_future(slots.acquire(slots.waiter(False)))
    await asyncio.sleep(0)
    assert not blocked.done()  # the limit holds: two in use
    blocked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await blocked
    with pytest.raises(ValueError, match="at least 1"):
        PrioritySlots(0)


async def test_a_stream_of_urgent_calls_leaves_every_fourth_slot_to_the_rest() -> None:
    from slipstream_operator.sidecar_client import PrioritySlots

    slots = PrioritySlots(1)  # urgent_run 3
    await slots.acquire(slots.waiter(False))
    granted: list[str] = []

    async def take(name: str, urgent: bool) -> None:
        await slots.acquire(slots.waiter(urgent))
        granted.append(name)

    tasks = [asyncio.ensure_future(take(f"job-{i}", False)) for i in range(2)]
    tasks += [asyncio.ensure_future(take(f"svc-{i}", True)) for i in range(8)]
    await asyncio.sleep(0)
    for _ in range(10):
        slots.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert granted == ["svc-0", "svc-1", "svc-2", "job-0", "svc-3", "svc-4", "svc-5", "job-1",
                       "svc-6", "svc-7"]
    with pytest.raises(ValueError, match="urgent_run"):
        PrioritySlots(1, urgent_run=0)


@contextlib.asynccontextmanager
async def _one_pod(pod: str, ip: str) -> AsyncIterator[tuple[Standin, Counting, PodAddress]]:
    """A stand-in serving one fake pod, and a counting gRPC client for it."""
    grpc_port = next(_ports)
    standin = Standin(StandinConfig(http_port=grpc_port + 1, grpc_port=grpc_port))
    await standin.start()
    grpc_client = GrpcSidecarControl(timeout_s=5.0)
    try:
        await standin.add_pod(pod, ip, "tok")
        yield standin, Counting(grpc_client), PodAddress(pod, ip, grpc_port, "tok")
    finally:
        await grpc_client.close()
        await standin.stop()


async def test_a_look_may_ask_for_a_younger_reply_than_the_shared_max_age() -> None:
    """A service tick (its reply becomes the service's status) accepts a younger reply than a
    job tick: one a job tick cached just before a change on the pod would hide the change
    for one more tick."""
    async with _one_pod("pod-y", "127.1.251.70") as (standin, counting, a):
        clock = Clock()
        shared = SharedSidecarControl(counting, max_age_s=4.0, limit=4, clock=clock)
        first = await shared.status(a)  # a job tick's look
        standin.bump()  # the pod changes
        clock.now += 2.0
        assert await shared.status(a) is first  # a job tick still takes the cached reply
        fresh = await shared.status(a, urgent=True, max_age_s=1.0)  # a service tick's does not
        assert counting.calls["status"] == 2
        assert fresh.online_admitted_total == first.online_admitted_total + 1
        assert await shared.status(a) is fresh  # and the fresh reply is shared from then on


async def test_with_the_handlers_ages_job_ticks_ride_on_the_service_ticks_replies() -> None:
    """With the handlers' ages, a pod is asked once per interval by its service tick and job
    ticks in between never ask it; they ask only when the service tick is more than 1.2
    intervals late, and the service sees every change at its next tick."""
    from slipstream_operator.handlers import SERVICE_STATUS_MAX_AGE, STATUS_MAX_AGE

    interval = 5.0
    async with _one_pod("pod-z", "127.1.251.71") as (standin, counting, a):
        clock = Clock()
        shared = SharedSidecarControl(counting, max_age_s=STATUS_MAX_AGE * interval, limit=4,
                                      clock=clock)
        service_age = SERVICE_STATUS_MAX_AGE * interval
        start = clock.now
        admitted = []
        for tick in range(4):  # service ticks every interval, job ticks at every second between
            clock.now = start + tick * interval
            standin.bump()
            seen = await shared.status(a, urgent=True, max_age_s=service_age)
            admitted.append(seen.online_admitted_total)
            for second in range(1, int(interval)):
                clock.now = start + tick * interval + second
                assert await shared.status(a) is seen
        assert counting.calls["status"] == 4  # one per service tick, none for the job ticks
        assert admitted == [admitted[0] + i for i in range(4)]  # every bump seen at once
        # A service tick that is late: job ticks ask the pod themselves after 1.2 intervals.
        clock.now = start + 3 * interval + STATUS_MAX_AGE * interval + 0.1
        await shared.status(a)
        assert counting.calls["status"] == 5
