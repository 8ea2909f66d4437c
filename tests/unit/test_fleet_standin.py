"""The fleet stand-in answers the operator's own clients like a sidecar (loopback sockets)."""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
import pytest

from slipstream_operator.errors import SidecarError
from slipstream_operator.observe import PodHistory, combine, parse_sample
from slipstream_operator.sidecar_client import (
    ConfigureCall,
    GrpcSidecarControl,
    PodAddress,
    ShardAssignment,
)
from slipstream_testbed.fleet.standin import Standin, StandinConfig, StandinError, render_metrics

pytestmark = pytest.mark.unit

_ports = itertools.count(42000 + (id(object()) % 500) * 8, 2)


def _config() -> StandinConfig:
    grpc_port = next(_ports)
    return StandinConfig(http_port=grpc_port + 1, grpc_port=grpc_port, lines_per_second=1000.0,
                         finish_shards=True)


def _shard(shard_id: str, lines: int) -> ShardAssignment:
    return ShardAssignment(shard_id=shard_id, job_namespace="ns", job_name="job", model="m",
                           input_uri="file:///in.jsonl", line_start=0, line_end=lines,
                           output_uri="file:///o", error_uri="file:///e", priority=0)


async def test_operator_client_sees_configure_shards_and_readiness() -> None:
    config = _config()
    standin = Standin(config)
    await standin.start()
    control = GrpcSidecarControl(timeout_s=5.0)
    try:
        await standin.add_pod("pod-a", "127.1.250.1", "secret-a")
        await standin.add_pod("pod-b", "127.1.250.2", "secret-b")
        a = PodAddress("pod-a", "127.1.250.1", config.grpc_port, "secret-a")
        status = await control.status(a)
        assert status.engine_ready and status.generation == 0 and not status.shards
        assert 0.2 <= status.spare_capacity <= 0.8

        assert await control.configure(a, ConfigureCall(generation=3, budget_s=0.05)) == 3
        assert await control.configure(a, ConfigureCall(generation=2, budget_s=0.09)) == 3
        assert (await control.status(a)).budget_s == pytest.approx(0.05)

        assert await control.assign(a, _shard("job-0001", 10))
        await asyncio.sleep(0.05)  # 1000 lines/s: the 10 lines are done
        shards = (await control.status(a)).shards
        assert [(s.shard_id, s.state, s.completed) for s in shards] == [
            ("job-0001", "succeeded", 10)]
        assert await control.revoke(a, "job-0001")
        assert not (await control.status(a)).shards
        # pod-b is a separate fake pod with its own state and token.
        b = PodAddress("pod-b", "127.1.250.2", config.grpc_port, "secret-b")
        assert (await control.status(b)).generation == 0
        with pytest.raises(SidecarError, match="UNAUTHENTICATED"):
            await control.status(PodAddress("pod-b", "127.1.250.2", config.grpc_port, "secret-a"))
        assert standin.totals()["Status"] >= 5
    finally:
        await control.close()
        await standin.stop()


async def test_metrics_move_with_each_bump_as_the_operator_reads_them() -> None:
    config = _config()
    standin = Standin(config)
    await standin.start()
    try:
        pods = [await standin.add_pod(f"p{i}", f"127.1.250.{10 + i}", "t") for i in range(3)]
        history: dict[str, PodHistory] = {}
        async with aiohttp.ClientSession() as http:

            async def scrape(at_s: float) -> None:
                for pod in pods:
                    async with http.get(f"http://{pod.ip}:{config.http_port}/metrics") as resp:
                        assert resp.status == 200
                        sample = parse_sample(await resp.text(), at_s)
                    history.setdefault(pod.name, PodHistory()).add(sample, 3600.0)

            await scrape(0.0)
            for bump in (1, 2):
                assert standin.bump() == bump
                await scrape(float(bump))
                stats = combine(history.values(), 1000.0, 200.0)
                assert stats.observed.samples == bump * len(pods)
                assert stats.observed.ttft_p99_s is not None
                assert 0.25 <= stats.observed.ttft_p99_s <= 0.5
    finally:
        await standin.stop()


def test_metrics_text_counts_online_requests() -> None:
    from slipstream_testbed.fleet.standin import FakePod

    pod = FakePod("p", "127.1.0.2", "t", online_requests=7)
    sample = parse_sample(render_metrics(pod), 1.0)
    assert sample.ttft.count == 7 and sample.admitted == 7 and sample.finished == 7


async def test_a_taken_address_is_reported_with_the_pod() -> None:
    config = _config()
    first, second = Standin(config), Standin(config)
    await first.start()
    await second.start()
    try:
        await first.add_pod("x", "127.1.250.40", "t")
        with pytest.raises(StandinError) as info:
            await second.add_pod("y", "127.1.250.40", "t")
        assert info.value.pod == "y" and "127.1.250.40" in info.value.address
    finally:
        await first.stop()
        await second.stop()
