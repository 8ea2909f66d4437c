"""The engine's KV cache in front of an engine that does not publish it.

A real engine model (``slipstream engine``: vLLM's HTTP API and ``vllm:`` metrics, but not
``vllm:cache_config_info``) behind a real sidecar started without ``--kv-blocks`` or
``--block-size``: the sidecar serves on the old defaults (8,192 blocks of 16 tokens), says so
in its log once, also after the engine restarts, keeps serving while the engine is gone, and
reports where its numbers came from in Status. Given settings win without the engine.
``tests/vllm/test_sidecar_on_vllm.py`` checks the numbers a real vLLM publishes.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers_procs import Proc, bearer, control_stub, engine_proc, eventually, sidecar_proc

from slipstream_sidecar.proto import sidecar_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOKEN = "kv-cache-token"
UNPUBLISHED = "the engine's /metrics has no vllm:cache_config_info"


def status(sc: Proc) -> Any:
    ch, stub = control_stub(sc.extra_ports["grpc"])
    with ch:
        return stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN))


def kv(sc: Proc) -> tuple[int, int, str, str]:
    c = status(sc).kv_cache
    return c.num_blocks, c.block_size, c.num_blocks_source, c.block_size_source


def test_an_engine_without_the_family_leaves_the_defaults_said_once(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    eng = engine_proc(tmp_path).start()
    sc = sidecar_proc(tmp_path, eng.url, token_file=token, kv_blocks=None)
    again: Proc | None = None
    try:
        sc.start(ready_path="/ready")
        assert kv(sc) == (8192, 16, "default", "default")
        eng.kill()
        eventually("the engine's loss", lambda: True if not status(sc).engine_ready else None)
        with urllib.request.urlopen(sc.url + "/health", timeout=10) as resp:
            assert resp.status == 200  # the sidecar itself still serves
        again = engine_proc(tmp_path, port=eng.port, name="engine-again").start()
        eventually("the engine back", lambda: True if status(sc).engine_ready else None)
        assert kv(sc) == (8192, 16, "default", "default")
    finally:
        sc.stop()
        if again is not None:
            again.stop()
        eng.stop()
    log = sc.log_path.read_text()
    assert log.count(UNPUBLISHED) == 1, log[-4000:]
    assert "admitting with 8192 KV blocks of 16 tokens" in log


def test_given_settings_win_with_no_engine_at_all(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    sc = sidecar_proc(
        tmp_path,
        "http://127.0.0.1:9",
        token_file=token,
        kv_blocks=300,
        extra=("--block-size", "32"),
    ).start()
    try:
        assert kv(sc) == (300, 32, "setting", "setting")
        assert not status(sc).engine_ready
    finally:
        sc.stop()
    assert UNPUBLISHED not in sc.log_path.read_text()
