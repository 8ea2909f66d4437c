"""What an online client and an OfflineJob of one namespace cannot do, on real processes.

* The serving port offers no control function: the control API's method paths,
  sent as HTTP to the serving port in every method, are 404/405, and nothing
  (generation, draining, shards) changes.
* An online client cannot choose its priority or class: a ``priority`` in the
  body (the offline priority, a huge one, a negative one) is replaced by the
  sidecar's; with offline work filling the engine, such a request still
  preempts offline work and is served.
* The control port refuses callers without the bearer token, whatever they send
  (also fuzzed in ``test_fuzz_grpc.py``).
* A shard of namespace ``team-a`` naming ``team-b``'s files must be refused
  (the namespace-root rule, ``slipstream_scheduler.storage_scope``); the
  sidecar does not apply it yet, which the strict xfail below records.

Deliberately left out: the operator's side of the namespace rule and RBAC
(``test_cluster_security.py``).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from rel_helpers import (
    TOKEN,
    RelStack,
    assign,
    complete,
    http_request,
    raw_exchange,
    records,
    start_rel_stack,
    wait_done,
)

from integration.helpers_procs import MODEL, bearer
from slipstream_scheduler.storage_scope import ScopeError, check_uri
from slipstream_sidecar.proto import sidecar_pb2 as pb

pytestmark = pytest.mark.integration

CONTROL = "/slipstream.sidecar.v1alpha1.Sidecar/"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[RelStack]:
    s = start_rel_stack(tmp_path, sidecar_seqs=4, mean_output_tokens=64)
    yield s
    s.stop()


def control_status(stack: RelStack) -> pb.StatusResponse:
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as ch:
        stub = ch.unary_unary(CONTROL + "Status",
                              request_serializer=pb.StatusRequest.SerializeToString,
                              response_deserializer=pb.StatusResponse.FromString)
        reply: pb.StatusResponse = stub(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=10)
    return reply


def test_serving_port_has_no_control_function(stack: RelStack) -> None:
    drain = pb.DrainRequest(timeout_s=1).SerializeToString()
    shard = pb.AssignShardRequest(shard=pb.Shard(
        shard_id="x", model=MODEL, input_uri="file:///etc/hostname",
        output_uri=f"file://{stack.tmp}/o.jsonl", error_uri=f"file://{stack.tmp}/e.jsonl",
        line_end=1)).SerializeToString()
    for method in ("Drain", "AssignShard", "Configure", "RevokeShard", "Status"):
        for verb in ("POST", "GET", "PUT"):
            body = drain if method == "Drain" else shard
            for ctype in ("application/grpc", "application/json"):
                res = raw_exchange(stack.sidecar.port, http_request(
                    verb, CONTROL + method, body, {"Content-Type": ctype}), read_all=True)
                assert res.status in (404, 405), (method, verb, res.data[:200])
    st = control_status(stack)
    assert st.generation == 0 and not st.draining and not st.shards
    assert not (stack.tmp / "o.jsonl").exists()


def test_online_priority_in_the_body_is_replaced(stack: RelStack, shared_data: Path) -> None:
    rows = json.loads((shared_data / "prompts" / "alpaca_5000.dev.json").read_text())[:12]
    lines = [json.dumps({"custom_id": f"o{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": r["instruction"], "max_tokens": 200,
                                  "ignore_eos": True}})
             for i, r in enumerate(rows)]
    (stack.tmp / "in.jsonl").write_text("\n".join(lines) + "\n")
    assign(stack, "bg", len(lines), stack.tmp)
    deadline = time.monotonic() + 60
    while control_status(stack).offline.in_flight < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    before = control_status(stack).offline.preempted_total
    # The offline priority (100), a huge and a negative one: each is replaced by the sidecar's
    # online priority, so each request preempts offline work and is served.
    for prio in (100, 2**40, -(2**40)):
        body = {"model": MODEL, "prompt": "Say hi.", "max_tokens": 4, "priority": prio}
        req = urllib.request.Request(stack.sidecar.url + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
    after = control_status(stack).offline.preempted_total
    assert after >= before + 3, "online requests with an offline priority must still preempt"
    assert wait_done(stack, "bg").state == pb.SHARD_STATE_SUCCEEDED
    assert len(records(stack.tmp / "out.jsonl")) == len(lines)
    assert complete(stack.sidecar.url)["choices"]


def test_a_shard_cannot_read_another_namespaces_file(tmp_path: Path) -> None:
    root = tmp_path / "storage"
    # This sidecar is scoped to the storage root, as the operator configures it.
    stack = start_rel_stack(
        tmp_path, sidecar_seqs=4, mean_output_tokens=64,
        env={"SLIPSTREAM_SIDECAR_STORAGE_ROOTS": json.dumps([f"file://{root}"])},
    )
    try:
        _assert_shard_refused(stack, root)
    finally:
        stack.stop()


def _assert_shard_refused(stack: RelStack, root: Path) -> None:
    (root / "team-b").mkdir(parents=True)
    (root / "team-a").mkdir()
    secret = root / "team-b" / "private.jsonl"
    secret.write_text(json.dumps({"custom_id": "b-secret", "method": "POST",
                                  "url": "/v1/completions",
                                  "body": {"model": MODEL, "prompt": "team b data",
                                           "max_tokens": 2}}) + "\n")
    roots = (f"file://{root}",)
    uri = f"file://{secret}"
    with pytest.raises(ScopeError):  # the rule itself refuses it
        check_uri(uri, namespace="team-a", roots=roots, field="input_uri")
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as ch:
        stub = ch.unary_unary(CONTROL + "AssignShard",
                              request_serializer=pb.AssignShardRequest.SerializeToString,
                              response_deserializer=pb.AssignShardResponse.FromString)
        shard = pb.Shard(shard_id="steal", job_namespace="team-a", job_name="j", model=MODEL,
                         input_uri=uri, line_end=1,
                         output_uri=f"file://{root}/team-a/out.jsonl",
                         error_uri=f"file://{root}/team-a/err.jsonl")
        try:
            stub(pb.AssignShardRequest(shard=shard), metadata=bearer(TOKEN), timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "input_uri" in (exc.details() or "")
            return
    wait_done(stack, "steal")
    leaked = records(root / "team-a" / "out.jsonl")
    pytest.fail(f"team-a's shard read team-b's file: {[r['custom_id'] for r in leaked]}")
