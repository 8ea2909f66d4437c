"""Real ``vllm serve`` (CPU, the tiny model built from a seed) answers vLLM's HTTP API.

Killing and restarting it on the same port is exercised by ``test_sidecar_on_vllm.py``'s
kill -9 test, behind a sidecar."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from slipstream_testbed.vllm import DEFAULT_SERVED_NAME, VllmServer
from slipstream_testbed.vllm.server import ENGINE_CORE_NICE, group_threads

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def test_completion_chat_and_metrics(vllm_server: VllmServer) -> None:
    out = _post(vllm_server.url + "/v1/completions",
                {"model": DEFAULT_SERVED_NAME, "prompt": "the model", "max_tokens": 8,
                 "temperature": 0, "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 8  # type: ignore[index]
    chat = _post(vllm_server.url + "/v1/chat/completions",
                 {"model": DEFAULT_SERVED_NAME, "max_tokens": 4, "ignore_eos": True,
                  "messages": [{"role": "user", "content": "a batch job"}]})
    assert chat["choices"][0]["message"]["role"] == "assistant"  # type: ignore[index]
    with urllib.request.urlopen(vllm_server.url + "/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    assert "vllm:num_requests_waiting" in metrics
    assert "vllm:cache_config_info" in metrics and "num_gpu_blocks=" in metrics


def test_the_engine_core_runs_at_the_lowest_priority_and_the_worker_does_not(
    vllm_server: VllmServer,
) -> None:
    """The testbed's servers give the engine core's threads ENGINE_CORE_NICE once up (its
    spin would otherwise take the core the API server, a sidecar and the test share); the
    worker that runs the model keeps the default."""
    assert vllm_server.proc is not None
    core = vllm_server.engine_core_threads()
    assert core, "no VLLM::EngineCore threads in the server's process group"
    assert {os.getpriority(os.PRIO_PROCESS, t) for t in core} == {ENGINE_CORE_NICE}
    others = [t for t in group_threads(vllm_server.proc.pid) if t not in set(core)]
    assert others and {os.getpriority(os.PRIO_PROCESS, t) for t in others} == {0}
