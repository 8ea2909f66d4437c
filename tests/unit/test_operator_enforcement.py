"""``spec.scheduling.enforcement``: the pod, Service and pool the operator renders per mode."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from slipstream_operator.api import Enforcement, InferenceServiceSpec
from slipstream_operator.gateway import online_port, render_pool
from slipstream_operator.reconcile_service import ENGINE_PORT, ObjectRef, children

pytestmark = pytest.mark.unit

REF = ObjectRef("chat", "llm", "uid-1", 3)
PLUGIN = "slipstream_vllm.scheduler.SlipstreamScheduler"


def spec(enforcement: str | None = None, **extra: Any) -> InferenceServiceSpec:
    scheduling = {} if enforcement is None else {"enforcement": enforcement}
    return InferenceServiceSpec.model_validate({
        "model": "llama-2-7b", "engine": {"image": "vllm/vllm-openai:v0.11.0",
                                          "args": ["--max-num-seqs", "64"]},
        "slo": {"tbt": {"p99": "150ms"}}, "scheduling": scheduling,
        "sidecar": {"httpPort": 8100, "grpcPort": 9100},
        "gateway": {"inferencePool": {"enabled": True, "endpointPickerRef": {
            "name": "chat-epp", "port": {"number": 9002}}}}, **extra})


def rendered(s: InferenceServiceSpec) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any],
                                               dict[str, Any]]:
    objs = {c["kind"]: c for c in children(REF, s, "token", None)}
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    cs = {c["name"]: c for c in pod["containers"]}
    return cs["vllm"], cs["sidecar"], pod, objs["Service"]


def _port_of(containers: list[dict[str, Any]], name: str) -> int:
    found = [p["containerPort"] for c in containers for p in c.get("ports", ())
             if p["name"] == name]
    assert len(found) == 1, found
    return int(found[0])


def test_sidecar_is_the_default_and_rejects_unknown_modes() -> None:
    assert spec().scheduling.enforcement == Enforcement.SIDECAR
    assert spec("engine").scheduling.enforcement == Enforcement.ENGINE
    with pytest.raises(ValidationError):
        spec("kernel")


def test_sidecar_mode_keeps_vllm_private_and_stock() -> None:
    vllm, sidecar, pod, service = rendered(spec())
    args = vllm["args"]
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert "--scheduler-cls" not in args and "--no-async-scheduling" not in args
    assert "env" not in vllm and "volumeMounts" not in vllm and "ports" not in vllm
    assert sidecar["args"] == ["sidecar"]
    assert all(v["name"] != "engine-channel" for v in pod["volumes"])
    assert service["spec"]["ports"] == [{"name": "http", "port": 8100, "targetPort": "http"}]
    assert online_port(spec()) == 8100 == _port_of(pod["containers"], "http")
    pool = render_pool(REF, spec())
    assert pool is not None and pool["spec"]["targetPorts"] == [{"number": 8100}]


def test_engine_mode_runs_the_plugin_and_sends_online_traffic_to_vllm() -> None:
    s = spec("engine")
    vllm, sidecar, pod, service = rendered(s)
    args = vllm["args"]
    assert args[args.index("--scheduler-cls") + 1] == PLUGIN
    assert "--no-async-scheduling" not in args  # vLLM's default, async scheduling, stays on
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert args[args.index("--port") + 1] == str(ENGINE_PORT)
    assert args[-2:] == ["--max-num-seqs", "64"]  # the spec's own args stay last
    # One emptyDir, mounted at the same path in both containers; each side finds it.
    vols = [v for v in pod["volumes"] if v["name"] == "engine-channel"]
    assert vols == [{"name": "engine-channel", "emptyDir": {}}]
    (vmount,) = [m for m in vllm["volumeMounts"] if m["name"] == "engine-channel"]
    (smount,) = [m for m in sidecar["volumeMounts"] if m["name"] == "engine-channel"]
    assert vmount["mountPath"] == smount["mountPath"]
    assert not vmount.get("readOnly") and not smount.get("readOnly")
    assert {"name": "SLIPSTREAM_CHANNEL_DIR", "value": vmount["mountPath"]} in vllm["env"]
    assert sidecar["args"] == ["sidecar", "--engine-channel", smount["mountPath"]]
    # Online traffic: the Service and the pool go to vLLM's port, not the sidecar's.
    assert service["spec"]["ports"] == [{"name": "http", "port": 8100, "targetPort": "engine"}]
    assert online_port(s) == ENGINE_PORT == _port_of(pod["containers"], "engine")
    pool = render_pool(REF, s)
    assert pool is not None and pool["spec"]["targetPorts"] == [{"number": ENGINE_PORT}]
    # The sidecar keeps its control API, /metrics and the offline shards.
    assert _port_of(pod["containers"], "grpc") == 9100
    assert _port_of(pod["containers"], "http") == 8100


def test_engine_mode_with_async_scheduling_turned_off_runs_the_synchronous_plugin() -> None:
    from slipstream_operator.reconcile_service import (
        PLUGIN_SCHEDULER_CLS,
        PLUGIN_SYNC_SCHEDULER_CLS,
        plugin_class,
    )

    assert plugin_class([]) == PLUGIN_SCHEDULER_CLS == PLUGIN
    assert plugin_class(["--no-async-scheduling"]) == PLUGIN_SYNC_SCHEDULER_CLS
    assert plugin_class(["--async-scheduling", "false"]) == PLUGIN_SYNC_SCHEDULER_CLS
    assert plugin_class(["--async-scheduling", "true"]) == PLUGIN_SCHEDULER_CLS
