"""WatchStatus on change: the stream's pacing, the operator's feed, and the ticks it wakes.

Timings here are only ever lower bounds (a slow host makes them longer, never shorter) or
generous upper bounds against intervals of a minute that only a change can beat.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from integration.helpers_procs import until
from slipstream_operator.errors import SidecarError
from slipstream_operator.sidecar_client import (
    GrpcSidecarControl,
    PodAddress,
    ShardAssignment,
    SharedSidecarControl,
    SidecarStatus,
)
from slipstream_operator.statusfeed import StatusFeed, TickPacer
from slipstream_sidecar.proto import sidecar_pb2 as pb
from slipstream_sidecar.watch import change_signature, paced_snapshots
from slipstream_testbed.fleet.standin import Standin, StandinConfig

pytestmark = pytest.mark.unit

_ports = itertools.count(24300, 2)


def _snap(generation: int = 1, completed: int = 0, admitted: int = 0) -> pb.StatusResponse:
    msg = pb.StatusResponse(generation=generation, engine_ready=True, spare_capacity=0.5,
                            shards=[pb.ShardProgress(shard_id="j-0001", state=2,
                                                     completed=completed)])
    msg.online_counters.admitted = admitted
    return msg


def test_the_signature_ignores_shards_and_spare_capacity_but_not_counters_or_budgets() -> None:
    base = change_signature(_snap())
    assert change_signature(_snap(completed=7)) == base
    moved = _snap()
    moved.spare_capacity = 0.9
    moved.predicted_step_s = 0.03
    assert change_signature(moved) == base
    assert change_signature(_snap(admitted=1)) != base
    assert change_signature(_snap(generation=2)) != base
    revoked = _snap()
    revoked.shards[0].state = 5
    assert change_signature(revoked) == base
    budget = _snap()
    budget.budget_s = 0.05
    assert change_signature(budget) != base
    draining = _snap()
    draining.draining = True
    assert change_signature(draining) != base


async def test_a_change_goes_out_at_once_progress_waits_for_the_heartbeat() -> None:
    state = {"generation": 1, "completed": 0}
    changed = asyncio.Event()
    stream = paced_snapshots(lambda: _snap(state["generation"], state["completed"]),
                             interval_s=60.0, min_interval_s=0.3, changed=changed)
    first = await anext(stream)
    started = time.monotonic()
    assert first.generation == 1
    # Progress alone (even announced) does not send a snapshot before the 60 s heartbeat.
    state["completed"] = 5
    changed.set()
    pending = asyncio.ensure_future(anext(stream))
    done, _ = await asyncio.wait({pending}, timeout=0.5)
    assert not done
    # A change does; it was within min_interval_s of the first snapshot only if the host was
    # fast, and then it was held until min_interval_s had passed.
    state["generation"] = 2
    changed.set()
    second = await asyncio.wait_for(pending, timeout=30)
    assert second.generation == 2 and second.shards[0].completed == 5
    assert time.monotonic() - started >= 0.3
    # A second change right after is held for min_interval_s.
    sent = time.monotonic()
    state["generation"] = 3
    changed.set()
    third = await asyncio.wait_for(anext(stream), timeout=30)
    assert third.generation == 3 and time.monotonic() - sent >= 0.25
    await stream.aclose()


async def test_without_min_interval_the_pacing_is_the_interval_only() -> None:
    state = {"generation": 1}
    stream = paced_snapshots(lambda: _snap(state["generation"]), interval_s=0.4)
    await anext(stream)
    started = time.monotonic()
    state["generation"] = 2
    second = await asyncio.wait_for(anext(stream), timeout=30)
    assert second.generation == 2 and time.monotonic() - started >= 0.35
    await stream.aclose()


async def test_the_pacer_ticks_on_its_grid_and_sooner_on_a_change() -> None:
    pacer = TickPacer(interval_s=60.0, min_gap_s=0.4, settle_s=0.05)
    assert await pacer.turn("svc") == "due"  # the first turn is due at once
    started = time.monotonic()
    pacer.wake("svc")
    # Woken right after a tick: held until min_gap_s after it, not until the 60 s grid.
    assert await asyncio.wait_for(pacer.turn("svc"), timeout=30) == "change"
    assert time.monotonic() - started >= 0.4
    pacer.wake("other")  # an owner that never took a turn: ignored
    waiting = asyncio.ensure_future(pacer.turn("svc"))
    await asyncio.sleep(0.5)  # past min_gap_s: a wake now is served after settle_s
    assert not waiting.done()
    woken = time.monotonic()
    pacer.wake("svc")
    assert await asyncio.wait_for(waiting, timeout=30) == "change"
    assert time.monotonic() - woken >= 0.05
    assert pacer.woken_turns == 2
    # Forgetting the owner (deleted) ends a waiting turn; so does kopf's stop flag.
    waiting = asyncio.ensure_future(pacer.turn("svc"))
    await asyncio.sleep(0.05)
    pacer.forget("svc")
    assert await asyncio.wait_for(waiting, timeout=30) == "stopped"
    stop = asyncio.Event()
    assert await pacer.turn("svc2") == "due"
    waiting = asyncio.ensure_future(pacer.turn("svc2", stop.wait))
    await asyncio.sleep(0.05)
    stop.set()
    assert await asyncio.wait_for(waiting, timeout=30) == "stopped"


async def test_the_pacer_keeps_its_grid_when_nothing_changes() -> None:
    pacer = TickPacer(interval_s=0.3, min_gap_s=0.15, settle_s=0.01)
    started = time.monotonic()
    reasons = [await pacer.turn("svc") for _ in range(4)]
    assert reasons == ["due"] * 4
    assert time.monotonic() - started >= 0.9  # three intervals after the first turn


class CountingStatus:
    """Counts unary Status calls to the inner control (streams bypass it)."""

    def __init__(self, inner: GrpcSidecarControl) -> None:
        self.inner = inner
        self.calls = 0

    async def status(self, address: PodAddress) -> SidecarStatus:
        self.calls += 1
        return await self.inner.status(address)

    async def configure(self, address: PodAddress, call: object) -> int:
        raise AssertionError("not used")

    async def assign(self, address: PodAddress, shard: ShardAssignment) -> bool:
        return await self.inner.assign(address, shard)

    async def revoke(self, address: PodAddress, shard_id: str) -> bool:
        return await self.inner.revoke(address, shard_id)


async def test_streamed_snapshots_answer_looks_and_a_change_wakes_the_owner() -> None:
    grpc_port = next(_ports)
    standin = Standin(StandinConfig(http_port=grpc_port + 1, grpc_port=grpc_port))
    await standin.start()
    grpc_client = GrpcSidecarControl(timeout_s=5.0)
    counting = CountingStatus(grpc_client)
    # A max age of 0: without the streams every look would ask the pod.
    shared = SharedSidecarControl(counting, max_age_s=0.0, limit=4)
    woken: list[str] = []
    feed = StatusFeed(shared, grpc_client.watch, interval_s=60.0, min_interval_s=0.1,
                      on_change=woken.append, retry_s=(0.05, 0.2))
    try:
        pods = [await standin.add_pod(f"pod-{i}", f"127.1.250.{20 + i}", "tok")
                for i in range(2)]
        addresses = [PodAddress(p.name, p.ip, grpc_port, "tok") for p in pods]
        feed.follow("svc-uid", addresses)
        await until("both pods' streams", lambda: feed.streaming("svc-uid") == 2
                    and shared.offered == 2, timeout=30.0)
        for a in addresses:
            assert (await shared.status(a, max_age_s=0.0)).online_sample is not None
        assert counting.calls == 0 and woken == []
        standin.bump()  # one online request on every pod
        await until("the owner woken twice", lambda: len(woken) == 2, timeout=30.0)
        assert woken == ["svc-uid", "svc-uid"]
        for a in addresses:
            sample = (await shared.status(a, max_age_s=0.0)).online_sample
            assert sample is not None and sample.admitted == 1
        assert counting.calls == 0
        # A call that changes the pod drops its reply, and a snapshot that arrives right after
        # may predate the change: the next look asks the pod.
        assert await shared.assign(addresses[0], ShardAssignment(
            "ns.job-0001", "ns", "job", "m", "file:///in", 0, 10, "file:///o", "file:///e", 0))
        after = await shared.status(addresses[0])
        assert [s.shard_id for s in after.shards] == ["ns.job-0001"] and counting.calls == 1
        # A pod whose stream breaks is asked again (here: it is gone, so the look fails).
        await standin.remove_pod(addresses[1].ip)
        await until("one stream left", lambda: feed.streaming("svc-uid") == 1, timeout=30.0)
        with pytest.raises(SidecarError):
            await shared.status(addresses[1], max_age_s=0.0)
        # Following fewer pods closes the others' streams; dropping the owner closes all.
        feed.follow("svc-uid", addresses[:1])
        feed.drop("svc-uid")
        assert feed.streaming() == 0
    finally:
        await feed.close()
        await grpc_client.close()
        await standin.stop()


async def test_a_stream_with_a_wrong_token_is_refused_and_retried() -> None:
    grpc_port = next(_ports)
    standin = Standin(StandinConfig(http_port=grpc_port + 1, grpc_port=grpc_port))
    await standin.start()
    grpc_client = GrpcSidecarControl(timeout_s=5.0)
    shared = SharedSidecarControl(grpc_client, max_age_s=0.0, limit=4)
    feed = StatusFeed(shared, grpc_client.watch, interval_s=60.0, min_interval_s=0.1,
                      on_change=lambda _: None, retry_s=(0.05, 0.1))
    try:
        pod = await standin.add_pod("pod-t", "127.1.250.40", "right")
        wrong = PodAddress("pod-t", pod.ip, grpc_port, "wrong")
        feed.follow("svc", [wrong])
        # refused, retried, refused ...
        await until("three tries", lambda: feed.opened >= 3, timeout=30.0)
        assert feed.snapshots == 0 and feed.streaming() == 0
        # The rotated token in the follow list replaces the stream.
        feed.follow("svc", [PodAddress("pod-t", pod.ip, grpc_port, "right")])
        await until("the rotated token's stream", lambda: feed.streaming() == 1, timeout=30.0)
    finally:
        await feed.close()
        await grpc_client.close()
        await standin.stop()
