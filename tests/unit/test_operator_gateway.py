"""The InferencePool a service asks for (``gateway.render_pool``) and its spec's rules."""

from __future__ import annotations

from typing import Any

import pytest

from slipstream_operator.api import InferenceServiceSpec, validate_semantics
from slipstream_operator.gateway import online_port, pod_labels, render_pool
from slipstream_operator.reconcile_service import ObjectRef, children

pytestmark = pytest.mark.unit

REF = ObjectRef("chat", "llm", "uid-1", 3)


def spec(**extra: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({
        "model": "llama-2-7b", "engine": {"image": "vllm/vllm-openai:v0.11.0"},
        "slo": {"tbt": {"p99": "150ms"}}, **extra})


def pooled(**extra: Any) -> InferenceServiceSpec:
    return spec(gateway={"inferencePool": {"enabled": True, "endpointPickerRef": {
        "name": "chat-epp", "port": {"number": 9002}}}}, **extra)


def test_off_by_default_and_when_disabled() -> None:
    assert render_pool(REF, spec()) is None
    assert render_pool(REF, spec(gateway={"inferencePool": {"enabled": False}})) is None


def test_the_pool_selects_the_pods_the_deployment_makes_on_the_online_port() -> None:
    s = pooled(sidecar={"httpPort": 8100, "grpcPort": 9100})
    pool = render_pool(REF, s)
    assert pool is not None
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["kind"] == "InferencePool"
    assert pool["metadata"]["name"] == "chat" and pool["metadata"]["namespace"] == "llm"
    assert pool["metadata"]["ownerReferences"] == [REF.owner_reference()]
    assert pool["spec"]["targetPorts"] == [{"number": 8100}] == [{"number": online_port(s)}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "", "kind": "Service", "name": "chat-epp", "port": {"number": 9002},
        "failureMode": "FailClose"}
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector == pod_labels(REF)
    deployment = next(c for c in children(REF, s, "token", None) if c["kind"] == "Deployment")
    template = deployment["spec"]["template"]
    assert all(template["metadata"]["labels"].get(k) == v for k, v in selector.items())
    ports = [p["containerPort"] for c in template["spec"]["containers"]
             for p in c.get("ports", ()) if p["name"] == "http"]
    assert ports == [online_port(s)]
    # The Deployment's own selector is looser: a pod that only borrows the service label is
    # not the pool's.
    assert set(selector) > set(deployment["spec"]["selector"]["matchLabels"])


def test_enabled_needs_a_picker_and_a_service_picker_needs_a_port() -> None:
    no_picker = spec(gateway={"inferencePool": {"enabled": True}})
    assert validate_semantics(no_picker) == [
        "spec.gateway.inferencePool.endpointPickerRef: required when enabled"]
    no_port = spec(gateway={"inferencePool": {"enabled": True,
                                              "endpointPickerRef": {"name": "epp"}}})
    assert validate_semantics(no_port) == [
        "spec.gateway.inferencePool.endpointPickerRef.port: required when kind is Service"]
    other_kind = spec(gateway={"inferencePool": {"enabled": True, "endpointPickerRef": {
        "name": "epp", "kind": "Backend", "group": "gateway.envoyproxy.io"}}})
    assert validate_semantics(other_kind) == []
    assert validate_semantics(pooled()) == []
