"""Deleting an InferenceService drains its pods over real gRPC (loopback, in-process server)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest

from slipstream_operator.drain import DrainReport, GrpcDrainControl, drain_pods
from slipstream_operator.sidecar_client import GrpcSidecarControl, PodAddress
from slipstream_sidecar.proto import sidecar_pb2 as pb
from slipstream_sidecar.proto import sidecar_pb2_grpc

pytestmark = pytest.mark.unit

TOKEN = "drain-token"


@dataclass
class FakeSidecar(sidecar_pb2_grpc.SidecarServicer):
    """Status and Drain as the sidecar answers them; ``revokes`` False: an old sidecar."""

    shards: list[str] = field(default_factory=lambda: ["job-a-0", "job-a-1"])
    revokes: bool = True
    draining: bool = False
    drains: int = 0

    async def _auth(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        if metadata.get("authorization") != f"Bearer {TOKEN}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")

    async def Status(self, request: pb.StatusRequest,
                     context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        await self._auth(context)
        return pb.StatusResponse(
            engine_ready=True, draining=self.draining,
            shards=[pb.ShardProgress(shard_id=s, state=pb.SHARD_STATE_RUNNING, total=10)
                    for s in self.shards])

    async def Drain(self, request: pb.DrainRequest,
                    context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        await self._auth(context)
        self.drains += 1
        self.draining = True
        if self.revokes:
            self.shards.clear()
        return pb.DrainResponse(drained=True)


async def serve(sidecar: FakeSidecar) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    sidecar_pb2_grpc.add_SidecarServicer_to_server(sidecar, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.fixture
async def control() -> AsyncIterator[GrpcDrainControl]:
    status = GrpcSidecarControl(timeout_s=2.0)
    drainer = GrpcDrainControl(timeout_s=2.0, status_control=status)
    yield drainer
    await drainer.close()
    await status.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_drain_revokes_every_shard_and_marks_the_pods_draining(
    control: GrpcDrainControl,
) -> None:
    a, b = FakeSidecar(), FakeSidecar(shards=["job-b-3"])
    (sa, pa), (sb, pb_) = await serve(a), await serve(b)
    try:
        report = await drain_pods(control, [PodAddress("a", "127.0.0.1", pa, TOKEN),
                                            PodAddress("b", "127.0.0.1", pb_, TOKEN)],
                                  timeout_s=5.0)
    finally:
        await sa.stop(None)
        await sb.stop(None)
    assert report == DrainReport(pods=2, shards_before=3)
    assert report.complete and "3 offline shards" in report.summary()
    assert a.drains == b.drains == 1 and a.draining and not a.shards and not b.shards


async def test_unreachable_and_stubborn_pods_do_not_hold_the_deletion(
    control: GrpcDrainControl,
) -> None:
    old = FakeSidecar(revokes=False)
    server, port = await serve(old)
    try:
        report = await drain_pods(control, [
            PodAddress("old", "127.0.0.1", port, TOKEN),
            PodAddress("gone", "127.0.0.1", closed_port(), TOKEN),
            PodAddress("wrong-token", "127.0.0.1", port, "nope"),
        ], timeout_s=0.5, poll_s=0.1)
    finally:
        await server.stop(None)
    assert report.unreachable == ("gone", "wrong-token")
    assert report.still_active == ("old",) and report.shards_before == 2
    assert not report.complete and "still running shards" in report.summary()
