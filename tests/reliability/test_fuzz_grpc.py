"""Garbage on the sidecar's gRPC control port (hypothesis), real process over loopback.

What is sent: random bytes as the request of every method on a raw channel (no
protobuf serialiser), with and without the bearer token; well-typed but wild
``Configure`` requests (NaN, infinities, negative budgets, unknown orderings and
latency-model kinds, random coefficients); ``AssignShard`` requests with
hostile shard ids (``../``), missing or unreadable inputs, odd schemes,
inverted and huge line ranges and non-JSON request defaults (outputs always
inside the test's folder: a valid-looking shard really runs); metadata of
1 MiB; and bytes that are not HTTP/2 at all on the port.

What must hold: every call returns within a bound; an unauthenticated call is
refused with ``UNAUTHENTICATED`` whatever its bytes; authenticated garbage
gets ``INVALID_ARGUMENT`` or grpc.aio's parse-error status naming the
``DecodeError``, never an unexplained ``UNKNOWN`` (a servicer that raised);
the sidecar stays alive, serves a completion afterwards, and comes back
after ``kill -9`` with whatever configuration the fuzzing left durable.

Deliberately left out: the HTTP port (``test_fuzz_http.py``).
"""

from __future__ import annotations

import itertools
import math
import socket
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rel_helpers import (
    TOKEN,
    RelStack,
    complete,
    fuzz_examples,
    fuzz_random,
    start_rel_stack,
)

from integration.helpers_procs import MODEL, bearer
from slipstream_sidecar.proto import sidecar_pb2 as pb

pytestmark = pytest.mark.integration

SERVICE = "/slipstream.sidecar.v1alpha1.Sidecar/"
UNARY = ["Configure", "AssignShard", "RevokeShard", "Status", "Drain"]
SAFE_WITH_TOKEN = ["Configure", "RevokeShard", "Status"]  # garbage that cannot write files
BOUND_S = 15.0


def undecodable(code: grpc.StatusCode, details: str) -> bool:
    """grpc.aio's answer to bytes that are not the method's message: names the parse error."""
    return code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and (
        "DecodeError" in details or "Error parsing message" in details
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelStack]:
    s = start_rel_stack(tmp_path_factory.mktemp("fuzz-grpc"), sidecar_seqs=8)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def channel(stack: RelStack) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as ch:
        yield ch


def fuzz_settings(default: int) -> settings:
    return settings(
        max_examples=fuzz_examples(default),
        deadline=None,
        database=None,
        derandomize=not fuzz_random(),
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def raw_call(
    channel: grpc.Channel, method: str, data: bytes, metadata: Any
) -> tuple[grpc.StatusCode, str]:
    if method == "WatchStatus":
        stream = channel.unary_stream(SERVICE + method)
        it = stream(data, metadata=metadata, timeout=BOUND_S)
        try:
            next(it)
            it.cancel()
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    unary = channel.unary_unary(SERVICE + method)
    try:
        unary(data, metadata=metadata, timeout=BOUND_S)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""


def status(channel: grpc.Channel) -> pb.StatusResponse:
    stub = channel.unary_unary(
        SERVICE + "Status",
        request_serializer=pb.StatusRequest.SerializeToString,
        response_deserializer=pb.StatusResponse.FromString,
    )
    reply: pb.StatusResponse = stub(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=BOUND_S)
    return reply


@fuzz_settings(80)
@given(method=st.sampled_from([*UNARY, "WatchStatus"]), data=st.binary(max_size=512),
       auth=st.sampled_from([None, bearer("wrong"), (("authorization", TOKEN),),
                             (("authorization", "Bearer " + TOKEN + "x"),)]))
def test_unauthenticated_garbage_is_refused(
    channel: grpc.Channel, method: str, data: bytes, auth: Any
) -> None:
    code, details = raw_call(channel, method, data, auth)
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: hung"
    # Undecodable bytes fail deserialisation before the interceptor's refusal runs (grpc.aio
    # answers UNKNOWN naming the DecodeError); the servicer is not reached either way.
    assert code == grpc.StatusCode.UNAUTHENTICATED or undecodable(code, details), (code, details)


@fuzz_settings(80)
@given(method=st.sampled_from(SAFE_WITH_TOKEN), data=st.binary(max_size=512))
def test_authenticated_garbage_gets_a_clear_error(
    channel: grpc.Channel, method: str, data: bytes
) -> None:
    code, details = raw_call(channel, method, data, bearer(TOKEN))
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: hung"
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT) or undecodable(
        code, details
    ), (code, details)


_generation = count(1_000)
wild_float = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, -0.0, -1.0, 1e-300, 1e300, math.nan, math.inf]
)
SANE_MODEL = {"const": 0.004, "s_p": 2e-5, "n_d": 1e-4, "s_d_ctx": 1e-7}


def configure(channel: grpc.Channel, req: pb.ConfigureRequest) -> pb.ConfigureResponse:
    stub = channel.unary_unary(
        SERVICE + "Configure",
        request_serializer=pb.ConfigureRequest.SerializeToString,
        response_deserializer=pb.ConfigureResponse.FromString,
    )
    reply: pb.ConfigureResponse = stub(req, metadata=bearer(TOKEN), timeout=BOUND_S)
    return reply


def sane(channel: grpc.Channel) -> None:
    configure(channel, pb.ConfigureRequest(
        generation=next(_generation), budget_s=0.05, ordering="gittins",
        latency_model=pb.LatencyModelSpec(kind="context", coefficients=SANE_MODEL),
    ))


@fuzz_settings(60)
@given(
    budget=st.none() | st.floats(min_value=1e-6, max_value=10.0) | st.sampled_from([0.0, -1.0]),
    slo=st.dictionaries(st.sampled_from(["ttft_p99_s", "ttft_mean_s", "tbt_p99_s", "tbt_mean_s"]),
                        wild_float),
    ordering=st.sampled_from(["", "gittins", "fcfs", "sjf", "nope", "../x"]) | st.text(max_size=8),
    kind=st.sampled_from(["", "context", "linear", "nope"]) | st.text(max_size=8),
    coefficients=st.dictionaries(
        st.sampled_from([*SANE_MODEL, "x"]) | st.text(max_size=6),
        st.floats(min_value=-1.0, max_value=1.0), max_size=5,
    ),
)
def test_wild_configure_is_refused_or_keeps_serving(
    stack: RelStack, channel: grpc.Channel, budget: float | None, slo: dict[str, float],
    ordering: str, kind: str, coefficients: dict[str, float],
) -> None:
    """Finite but wild settings: refused (INVALID_ARGUMENT), or applied and online still served."""
    sane(channel)
    req = pb.ConfigureRequest(
        generation=next(_generation), slo=pb.Slo(**slo), ordering=ordering,
        latency_model=pb.LatencyModelSpec(kind=kind, coefficients=coefficients),
    )
    if budget is not None:
        req.budget_s = budget
    code, details = raw_call(channel, "Configure", req.SerializeToString(), bearer(TOKEN))
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    if code == grpc.StatusCode.OK:
        assert complete(stack.sidecar.url, timeout=BOUND_S)["choices"], "online stalled"
    status(channel)



@fuzz_settings(30)
@given(
    kind=st.sampled_from(["context+chunk+curve", "context+chunk", "context", ""]),
    scale=st.floats(min_value=0.0, max_value=1e-3) | wild_float,
    curve=st.lists(wild_float, max_size=6)
    | st.lists(st.floats(min_value=0.0, max_value=1e3), min_size=1, max_size=70).map(
        lambda steps: [0.0, *itertools.accumulate(steps)]
    ),
    step=st.sampled_from([0, 1, 32]) | st.integers(0, 2**32 - 1),
)
def test_wild_token_curves_are_refused_or_keep_serving(
    stack: RelStack, channel: grpc.Channel, kind: str, scale: float, curve: list[float],
    step: int,
) -> None:
    """Token curves of every shape (falling, NaN, huge steps, on kinds without a curve):
    refused with INVALID_ARGUMENT, or applied and online still served."""
    sane(channel)
    req = pb.ConfigureRequest(
        generation=next(_generation),
        latency_model=pb.LatencyModelSpec(
            kind=kind, coefficients={**SANE_MODEL, "tokens_over_knee": scale},
            token_curve=curve, curve_step_tokens=step,
        ),
    )
    code, details = raw_call(channel, "Configure", req.SerializeToString(), bearer(TOKEN))
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    if code == grpc.StatusCode.OK:
        assert complete(stack.sidecar.url, timeout=BOUND_S)["choices"], "online stalled"
    else:
        assert "latency_model" in details, details
    status(channel)


@pytest.mark.parametrize("field", [
    "budget_nan",
    "budget_inf",
    "coefficient_nan",
    "curve_nan",
    "curve_too_long",
])
def test_non_finite_settings_are_refused(channel: grpc.Channel, field: str) -> None:
    sane(channel)
    req = pb.ConfigureRequest(generation=next(_generation))
    if field == "budget_nan":
        req.budget_s = math.nan
    elif field == "budget_inf":
        req.budget_s = math.inf
    elif field.startswith("curve"):
        values = [0.0, math.nan, 2.0] if field == "curve_nan" else [float(i) for i in range(5000)]
        req.latency_model.CopyFrom(pb.LatencyModelSpec(
            kind="context+chunk+curve", coefficients={**SANE_MODEL, "tokens_over_knee": 1e-5},
            token_curve=values, curve_step_tokens=32))
    else:
        req.latency_model.CopyFrom(pb.LatencyModelSpec(
            kind="context", coefficients={**SANE_MODEL, "const": math.nan}))
    try:
        reply = configure(channel, req)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        return
    finally:
        sane(channel)
    pytest.fail(f"{field} was accepted (applied={reply.applied})")


_shard_no = count()


@fuzz_settings(40)
@given(
    shard_id=st.sampled_from(["ok", "../escape", "/abs", "a/b", ".", ""]) | st.text(max_size=12),
    source=st.sampled_from(["missing", "dir", "devnull", "bogus-scheme", "memory", "empty", ""]),
    line_start=st.integers(0, 2**64 - 1) | st.integers(0, 4),
    line_end=st.integers(0, 2**64 - 1) | st.integers(0, 4),
    defaults=st.sampled_from(["", "{}", "[]", "null", "{bad", '{"max_tokens": -1}', '"x"']),
    model=st.sampled_from([MODEL, "", "other"]),
)
def test_hostile_shards_are_refused_or_fail_cleanly(
    stack: RelStack, channel: grpc.Channel, shard_id: str, source: str, line_start: int,
    line_end: int, defaults: str, model: str,
) -> None:
    base = stack.tmp / "shards"
    base.mkdir(exist_ok=True)
    n = next(_shard_no)
    inputs = {
        "missing": f"file://{base}/nope-{n}.jsonl", "dir": f"file://{base}",
        "devnull": "file:///dev/null", "bogus-scheme": "bogus://x/in.jsonl",
        "memory": "memory://in.jsonl", "empty": "", "": f"file://{base}/ok.jsonl",
    }
    (base / "ok.jsonl").write_text(
        '{"custom_id":"a","method":"POST","url":"/v1/completions",'
        f'"body":{{"model":"{MODEL}","prompt":"hi","max_tokens":2}}}}\n'
    )
    shard = pb.Shard(
        shard_id=f"{shard_id}-{n}" if shard_id else "", job_namespace="default", job_name="fz",
        model=model, input_uri=inputs[source], line_start=line_start, line_end=line_end,
        output_uri=f"file://{base}/out-{n}.jsonl", error_uri=f"file://{base}/err-{n}.jsonl",
        request_defaults_json=defaults,
    )
    data = pb.AssignShardRequest(shard=shard).SerializeToString()
    code, details = raw_call(channel, "AssignShard", data, bearer(TOKEN))
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    status(channel)  # still answering
    # Nothing may be written outside the test's folder, whatever the shard id.
    for path in (stack.tmp.parent / "escape", Path("/abs")):
        assert not path.exists()


def test_huge_metadata_and_non_http2_bytes(stack: RelStack, channel: grpc.Channel) -> None:
    huge = (("authorization", "Bearer " + "x" * (1 << 20)),)
    code, _ = raw_call(channel, "Status", b"", huge)
    assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE), code
    many = tuple((f"x-k{i}", "v" * 100) for i in range(2000))
    code, _ = raw_call(channel, "Status", b"", (*bearer(TOKEN), *many))
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 4096, b"PRI * HTTP/2.0\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", stack.grpc_port), timeout=BOUND_S) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            try:
                while s.recv(65536):
                    pass
            except (TimeoutError, ConnectionResetError):
                pass
    assert status(channel).engine_ready


def test_sidecar_survives_and_restarts_after_fuzzing(stack: RelStack) -> None:
    """Runs last: alive and serving; after kill -9 it comes back with its durable state.

    It configures a generation of its own first, so it also holds when ``-k`` deselects
    the fuzzing tests before it.
    """
    assert stack.healthy()
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as ch:
        sane(ch)
        before = status(ch).generation
    assert before >= 1_000
    stack.sidecar.kill()
    stack.sidecar.start()
    assert stack.healthy(), stack.sidecar.log_tail()
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as ch:
        assert status(ch).generation == before
