"""The pod runner's real-vLLM engine: ``vllm serve`` argv and environment for a pod."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slipstream_testbed.podrunner import PodRunner, vllm_engine_command

pytestmark = pytest.mark.unit


def test_vllm_engine_command_keeps_the_pods_address_name_and_limits(tmp_path: Path) -> None:
    container = {"args": ["--max-num-seqs", "64", "--enable-prefix-caching", "--port=8001",
                          "--max-num-batched-tokens", "not-a-number"]}
    argv, port, env = vllm_engine_command(container, "127.1.0.7", model="llama-2-7b",
                                          python="/opt/vllm/bin/python", model_dir=tmp_path)
    assert port == 8001
    assert argv[:4] == ["/opt/vllm/bin/python", "-m", "slipstream_vllm.serve", str(tmp_path)]
    assert argv[argv.index("--host") + 1] == "127.1.0.7"
    assert argv[argv.index("--port") + 1] == "8001"
    assert argv[argv.index("--served-model-name") + 1] == "llama-2-7b"
    assert argv[argv.index("--max-num-seqs") + 1] == "64"
    assert "--max-num-batched-tokens" not in argv and "--enable-prefix-caching" not in argv
    engine_env = {**os.environ, **env}  # what the pod runner starts it with
    assert engine_env["VLLM_TARGET_DEVICE"] == "cpu" and engine_env["HF_HUB_OFFLINE"] == "1"


def test_pod_runner_refuses_an_unknown_engine(tmp_path: Path) -> None:
    from kubernetes import client

    with pytest.raises(ValueError, match="engine must be model or vllm"):
        PodRunner(client.ApiClient(), tmp_path, engine="gpu")
