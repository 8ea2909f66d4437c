"""The control API over real gRPC: authentication, versioned Configure, Status, Drain."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers_procs import MODEL, Proc, bearer, control_stub, engine_proc, sidecar_proc

from slipstream_sidecar.proto import sidecar_pb2 as pb

pytestmark = pytest.mark.integration

TOKEN = "grpc-test-token"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Proc, Proc, Path]]:
    (tmp_path / "token").write_text(TOKEN + "\n")
    eng = engine_proc(tmp_path).start()
    sc = sidecar_proc(tmp_path, eng.url, token_file=tmp_path / "token",
                      state_dir=tmp_path / "state").start()
    yield eng, sc, tmp_path
    sc.stop()
    eng.stop()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


@pytest.mark.parametrize("metadata", [None, bearer("wrong"), (("authorization", TOKEN),)])
def test_unauthenticated_calls_are_refused(stack: tuple[Proc, Proc, Path],
                                           metadata: Any) -> None:
    _, sc, _ = stack
    ch, stub = control_stub(sc.extra_ports["grpc"])
    with ch:
        calls = [
            lambda: stub.Status(pb.StatusRequest(), metadata=metadata),
            lambda: stub.Configure(pb.ConfigureRequest(generation=99, budget_s=0.001),
                                   metadata=metadata),
            lambda: next(iter(stub.WatchStatus(pb.WatchStatusRequest(interval_s=0.05),
                                               metadata=metadata))),
            lambda: stub.Drain(pb.DrainRequest(), metadata=metadata),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Nothing was changed by the refused calls.
        st = stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN))
    assert st.generation == 0 and not st.draining and not st.HasField("budget_s")


def test_configure_is_versioned_idempotent_and_durable(stack: tuple[Proc, Proc, Path]) -> None:
    _, sc, _ = stack
    ch, stub = control_stub(sc.extra_ports["grpc"])
    md = bearer(TOKEN)
    coeffs = {"const": 0.004, "s_p": 2e-5, "n_d": 1e-4, "s_d_ctx": 1e-7}
    with ch:
        r = stub.Configure(pb.ConfigureRequest(
            generation=2, budget_s=0.05, ordering="fcfs", idle_budget_s=0.2,
            latency_model=pb.LatencyModelSpec(kind="context", coefficients=coeffs),
        ), metadata=md)
        assert (r.generation, r.applied) == (2, True)
        r = stub.Configure(pb.ConfigureRequest(generation=1, budget_s=9.0), metadata=md)
        assert (r.generation, r.applied) == (2, False)  # older: ignored
        r = stub.Configure(pb.ConfigureRequest(generation=2, budget_s=9.0), metadata=md)
        assert (r.generation, r.applied) == (2, False)  # same generation: no-op
        st = stub.Status(pb.StatusRequest(), metadata=md)
        assert st.budget_s == pytest.approx(0.05) and st.ordering == "fcfs"
        assert st.idle_budget_s == pytest.approx(0.2)
        with pytest.raises(grpc.RpcError) as info:
            stub.Configure(pb.ConfigureRequest(generation=3, ordering="nope"), metadata=md)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        watch = stub.WatchStatus(pb.WatchStatusRequest(interval_s=0.05), metadata=md)
        snaps = [next(watch) for _ in range(3)]
        watch.cancel()
    assert all(s.generation == 2 and s.engine_ready for s in snaps)
    with urllib.request.urlopen(sc.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert "slipstream_budget_seconds 0.05" in metrics
    assert "slipstream_config_generation 2.0" in metrics
    sc.kill()
    sc.start()
    ch, stub = control_stub(sc.extra_ports["grpc"])
    with ch:
        r = stub.Configure(pb.ConfigureRequest(generation=1, budget_s=1.0), metadata=md)
        assert (r.generation, r.applied) == (2, False), "the generation survives a restart"
        st = stub.Status(pb.StatusRequest(), metadata=md)
        assert st.budget_s == pytest.approx(0.05) and st.idle_budget_s == pytest.approx(0.2)


def test_watch_status_sends_a_change_at_once_and_a_heartbeat_otherwise(
        stack: tuple[Proc, Proc, Path]) -> None:
    """With min_interval_s, a Configure shows on the stream without waiting for the interval;
    a stream without it keeps the old fixed pacing."""
    import time

    _, sc, _ = stack
    ch, stub = control_stub(sc.extra_ports["grpc"])
    md = bearer(TOKEN)
    with ch:
        watch = stub.WatchStatus(pb.WatchStatusRequest(interval_s=60.0, min_interval_s=0.2),
                                 metadata=md)
        first = next(watch)  # at once
        sent = time.monotonic()
        stub.Configure(pb.ConfigureRequest(generation=first.generation + 1, budget_s=0.04),
                       metadata=md)
        changed = next(watch)
        waited = time.monotonic() - sent
        stub.Configure(pb.ConfigureRequest(generation=first.generation + 2, budget_s=0.05),
                       metadata=md)
        again = next(watch)
        gap = time.monotonic() - sent
        watch.cancel()
        paced = stub.WatchStatus(pb.WatchStatusRequest(interval_s=0.05), metadata=md)
        snaps = [next(paced) for _ in range(3)]
        paced.cancel()
    # The interval is 60 s: only the change can have sent these two.
    assert changed.generation == first.generation + 1 and waited < 30
    assert changed.budget_s == pytest.approx(0.04)
    assert again.generation == first.generation + 2 and gap >= 0.2  # not before min_interval_s
    assert all(s.generation == first.generation + 2 for s in snaps)


def test_drain_stops_new_work(stack: tuple[Proc, Proc, Path]) -> None:
    _, sc, _ = stack
    ch, stub = control_stub(sc.extra_ports["grpc"])
    with ch:
        r = stub.Drain(pb.DrainRequest(timeout_s=5), metadata=bearer(TOKEN))
        assert r.drained and r.online_in_flight == 0
        assert stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN)).draining
        shard = pb.Shard(shard_id="late", model=MODEL, input_uri="file:///dev/null",
                         output_uri="file:///tmp/x", error_uri="file:///tmp/y")
        assert not stub.AssignShard(pb.AssignShardRequest(shard=shard),
                                    metadata=bearer(TOKEN)).accepted
    assert _status(sc.url + "/ready") == 503
    req = urllib.request.Request(
        sc.url + "/v1/completions",
        data=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 503
    info.value.close()


async def test_the_operator_client_pushes_the_idle_budget_to_a_real_sidecar(
    stack: tuple[Proc, Proc, Path],
) -> None:
    from slipstream_operator.sidecar_client import ConfigureCall, GrpcSidecarControl, PodAddress

    _, sc, _ = stack
    address = PodAddress("pod-0", "127.0.0.1", sc.extra_ports["grpc"], TOKEN)
    control = GrpcSidecarControl(timeout_s=10.0)
    try:
        assert await control.configure(
            address, ConfigureCall(generation=3, budget_s=0.05, idle_budget_s=0.25)) == 3
        ch, stub = control_stub(sc.extra_ports["grpc"])
        with ch:
            st = stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN))
            assert st.idle_budget_s == pytest.approx(0.25)
            assert st.budget_s == pytest.approx(0.05)
            # 0 clears it: the online budget then applies always.
            await control.configure(address, ConfigureCall(generation=4, budget_s=0.05,
                                                           idle_budget_s=0.0))
            st = stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN))
            assert not st.HasField("idle_budget_s")
    finally:
        await control.close()


def _spec_model(spec: pb.LatencyModelSpec) -> Any:
    from slipstream_sidecar.brain import latency_model_from_spec

    return latency_model_from_spec(
        spec.kind,
        dict(spec.coefficients),
        spec.knee_tokens,
        token_curve=spec.token_curve,
        curve_step_tokens=spec.curve_step_tokens,
    )


def test_a_curve_model_is_configured_reported_and_durable(stack: tuple[Proc, Proc, Path]) -> None:
    """A shipped token-curve profile over the wire to the real process; Status reports the
    model in force, which predicts what the operator's copy predicts, before and after
    ``kill -9``; a broken curve is refused naming the field."""
    from slipstream_operator.profiles import find_profile
    from slipstream_scheduler.types import BatchItem, Phase
    from slipstream_sidecar.grpc_server import latency_spec_pb

    _, sc, _ = stack
    profile = find_profile("llama-3-8b", "a100")
    assert profile is not None and profile.model.token_curve
    model = profile.model
    batches = [
        [BatchItem(Phase.DECODE, 1, 700)] * 12,
        [BatchItem(Phase.PREFILL, 200, 64), *[BatchItem(Phase.DECODE, 1, 2000)] * 20],
        [BatchItem(Phase.PREFILL, 1999, 0)],
    ]
    md = bearer(TOKEN)
    ch, stub = control_stub(sc.extra_ports["grpc"])
    with ch:
        st = stub.Status(pb.StatusRequest(), metadata=md)
        assert not st.latency_model.kind, "no model before the first Configure"
        spec = latency_spec_pb(model)
        r = stub.Configure(pb.ConfigureRequest(generation=7, budget_s=0.05, latency_model=spec),
                           metadata=md)
        assert r.applied
        bad = pb.LatencyModelSpec()
        bad.CopyFrom(spec)
        bad.token_curve[5] = -1.0
        with pytest.raises(grpc.RpcError) as info:
            stub.Configure(pb.ConfigureRequest(generation=8, latency_model=bad), metadata=md)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "latency_model.token_curve[5]" in (info.value.details() or "")
        st = stub.Status(pb.StatusRequest(), metadata=md)
    assert st.generation == 7 and st.latency_model == spec
    for batch in batches:
        assert _spec_model(st.latency_model).predict(batch) == model.predict(batch)
    sc.kill()
    sc.start()
    ch, stub = control_stub(sc.extra_ports["grpc"])
    with ch:
        st = stub.Status(pb.StatusRequest(), metadata=md)
    assert st.generation == 7 and st.latency_model == spec, "the curve survives a restart"


async def test_status_carries_the_same_online_counters_as_metrics(
    stack: tuple[Proc, Proc, Path],
) -> None:
    """The operator reads its latency window from Status alone: the histograms and counters
    there must be the ones the real sidecar's /metrics shows after real online traffic."""
    from slipstream_operator.observe import parse_sample
    from slipstream_operator.sidecar_client import GrpcSidecarControl, PodAddress

    _, sc, _ = stack
    for stream in (False, True, True):
        body = {"model": MODEL, "prompt": "one two three", "max_tokens": 6, "stream": stream}
        req = urllib.request.Request(sc.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
            resp.read()
    address = PodAddress("pod-0", "127.0.0.1", sc.extra_ports["grpc"], TOKEN)
    control = GrpcSidecarControl(timeout_s=10.0)
    try:
        status = await control.status(address)
        with urllib.request.urlopen(sc.url + "/metrics", timeout=10) as resp:
            scraped = parse_sample(resp.read().decode(), 0.0)
    finally:
        await control.close()
    sample = status.online_sample
    assert sample is not None
    assert sample.admitted == scraped.admitted == 3
    assert sample.finished == scraped.finished == 3
    assert sample.output_tokens == scraped.output_tokens > 0
    assert sample.ttft == scraped.ttft and sample.ttft.count >= 2  # the streamed two at least
    assert sample.tbt == scraped.tbt and sample.tbt.count > 0
