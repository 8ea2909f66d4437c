"""The pod runner's real-vLLM engine: ``vllm serve`` argv and environment for a pod."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slipstream_testbed.podrunner import PodRunner, sidecar_args, vllm_engine_command

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
    assert argv[argv.index("--max-model-len") + 1] == "2048"  # the tiny model's positions
    assert "--max-num-batched-tokens" not in argv and "--enable-prefix-caching" not in argv
    engine_env = {**os.environ, **env}  # what the pod runner starts it with
    assert engine_env["VLLM_TARGET_DEVICE"] == "cpu" and engine_env["HF_HUB_OFFLINE"] == "1"


def test_vllm_engine_command_caps_the_context_at_the_tiny_models(tmp_path: Path) -> None:
    for asked, served in (("4096", "2048"), ("1024", "1024")):
        argv, _, _ = vllm_engine_command({"args": ["--max-model-len", asked]}, "127.1.0.7",
                                         model="m", python="py", model_dir=tmp_path)
        assert argv[argv.index("--max-model-len") + 1] == served


def test_pod_runner_refuses_an_unknown_engine(tmp_path: Path) -> None:
    from kubernetes import client

    with pytest.raises(ValueError, match="engine must be model or vllm"):
        PodRunner(client.ApiClient(), tmp_path, engine="gpu")


def test_engine_mode_carries_the_plugin_and_the_channel_to_vllm(tmp_path: Path) -> None:
    channel = tmp_path / "volumes" / "engine-channel"
    container = {
        "args": ["--model", "llama-2-7b", "--scheduling-policy", "priority",
                 "--scheduler-cls", "slipstream_vllm.scheduler.SlipstreamScheduler",
                 "--no-async-scheduling", "--port", "8001"],
        "env": [{"name": "SLIPSTREAM_CHANNEL_DIR", "value": "/var/run/slipstream/channel"}],
    }
    argv, port, env = vllm_engine_command(
        container, "127.1.0.9", model="llama-2-7b", python="py", model_dir=tmp_path,
        mounts={"/var/run/slipstream/channel": channel})
    assert port == 8001
    assert argv[argv.index("--scheduler-cls") + 1] == (
        "slipstream_vllm.scheduler.SlipstreamScheduler")
    assert "--no-async-scheduling" in argv
    assert env["SLIPSTREAM_CHANNEL_DIR"] == str(channel)


def test_sidecar_mode_runs_vllm_with_its_own_scheduler(tmp_path: Path) -> None:
    argv, _, env = vllm_engine_command({"args": ["--port", "8001"]}, "127.1.0.9", model="m",
                                       python="py", model_dir=tmp_path)
    assert "--scheduler-cls" not in argv and "--no-async-scheduling" not in argv
    assert "SLIPSTREAM_CHANNEL_DIR" not in env


def test_sidecar_args_point_the_engine_channel_at_the_pods_folder(tmp_path: Path) -> None:
    container = {"args": ["sidecar", "--engine-channel", "/var/run/slipstream/channel"]}
    assert sidecar_args(container, {"/var/run/slipstream/channel": tmp_path}) == [
        "--engine-channel", str(tmp_path)]
    assert sidecar_args({"args": ["sidecar"]}, {}) == []


def test_the_containers_model_on_a_mount_is_what_vllm_loads(tmp_path: Path) -> None:
    """A ``pvc://`` model source renders ``--model /mnt/models/<path>``: where the mount's folder
    holds a model there, vLLM loads it; a name that is no local model (a Hugging Face id, or a
    folder without ``config.json``) leaves the tiny model."""
    claim = tmp_path / "claim"
    (claim / "tiny").mkdir(parents=True)
    (claim / "tiny" / "config.json").write_text("{}")
    (claim / "empty").mkdir()
    tiny = tmp_path / "tiny-model"
    mounts = {"/mnt/models": claim}
    for asked, loads in (("/mnt/models/tiny", claim / "tiny"), ("/mnt/models/empty", tiny),
                         ("meta-llama/Llama-2-7b-hf", tiny), ("/mnt/other/tiny", tiny)):
        argv, _, _ = vllm_engine_command({"args": ["--model", asked]}, "127.1.0.7", model="m",
                                         python="py", model_dir=tiny, mounts=mounts)
        assert argv[3] == str(loads), asked


def test_the_resolved_environment_reaches_vllm_with_paths_on_mounts(tmp_path: Path) -> None:
    """``env`` (the container's environment as the pod runner resolved it: Secrets included)
    replaces the container's plain values; a path under a mount points at the local folder."""
    container = {"args": [], "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "hf-token", "key": "HF_TOKEN"}}}, {"name": "HF_HOME", "value": "/cache"}]}
    _, _, env = vllm_engine_command(
        container, "127.1.0.7", model="m", python="py", model_dir=tmp_path,
        mounts={"/cache": tmp_path / "cache"}, env={"HF_TOKEN": "hf_abc", "HF_HOME": "/cache/x"})
    assert env["HF_TOKEN"] == "hf_abc" and env["HF_HOME"] == str(tmp_path / "cache" / "x")
    _, _, plain = vllm_engine_command(container, "127.1.0.7", model="m", python="py",
                                      model_dir=tmp_path)
    assert "HF_TOKEN" not in plain and plain["HF_HOME"] == "/cache"
