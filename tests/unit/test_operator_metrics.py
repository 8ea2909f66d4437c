"""The operator's own metrics: samples from real API objects, scraped over a loopback socket.

Objects are built through the API models (``InferenceService``/``OfflineJob`` with a status
as the operator writes it, dumped with ``wire()``), so a renamed status field breaks these
tests rather than silently emptying a gauge. The HTTP test serves the real
prometheus-client server on 127.0.0.1 and parses what a scrape returns.
"""

from __future__ import annotations

import urllib.request
from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream_operator.api import InferenceService, OfflineJob
from slipstream_operator.metrics import (
    FAMILIES,
    PREFIX,
    OperatorMetrics,
    job_sample,
    register,
    serve,
    service_sample,
)

NOW = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)


def service(
    name: str = "chat", *, ready: int = 2, slo_met: str = "True", status: bool = True
) -> dict[str, Any]:
    body = InferenceService.model_validate(
        {
            "metadata": {"name": name, "namespace": "team-a", "generation": 3},
            "spec": {
                "model": "m",
                "engine": {"image": "vllm"},
                "replicas": 2,
                "slo": {"ttft": {"p99": "2s", "mean": "600ms"}, "tbt": {"p99": "150ms"}},
            },
            "status": {
                "observedGeneration": 3,
                "replicas": 2,
                "readyReplicas": ready,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "PodsReady",
                        "message": "",
                        "lastTransitionTime": NOW,
                        "observedGeneration": 3,
                    },
                    {
                        "type": "SLOMet",
                        "status": slo_met,
                        "reason": "WithinTarget",
                        "message": "ttft-p99 1.2s/2s",
                        "lastTransitionTime": NOW,
                        "observedGeneration": 3,
                    },
                ],
                "observed": {
                    "ttftP99": "1200ms",
                    "ttftMean": "400ms",
                    "tbtP99": "90ms",
                    "samples": 812,
                    "window": "5m",
                    "source": "sidecar",
                },
                "budget": {"iteration": "45ms", "computedAt": NOW, "reason": "Searched"},
                "offline": {"tokensPerSecond": 1234.5, "activeShards": 3},
            }
            if status
            else None,
        }
    ).wire()
    body["metadata"]["managedFields"] = [
        {
            "manager": "kopf",
            "operation": "Update",
            "subresource": "status",
            "time": "2026-11-30T05:59:00Z",
        },
        {"manager": "kubectl", "operation": "Apply", "time": "2026-11-30T05:00:00Z"},
    ]
    return body


def job(phase: str = "Running", completed: int = 120) -> dict[str, Any]:
    return OfflineJob.model_validate(
        {
            "metadata": {"name": "mmlu", "namespace": "team-a", "generation": 1},
            "spec": {
                "model": "m",
                "input": {"uri": "file:///d/in.jsonl"},
                "output": {"uri": "file:///d/out.jsonl"},
            },
            "status": {
                "observedGeneration": 1,
                "phase": phase,
                "requests": {"total": 1000, "completed": completed, "failed": 4},
                "shards": {"total": 8, "assigned": 2, "done": 1, "reassigned": 1},
                "tokensPerSecond": 88.5,
                "eta": "5m30s",
                "startTime": NOW,
            },
        }
    ).wire()


def values(sample_values: Any, metric: str) -> dict[tuple[tuple[str, str], ...], float]:
    return dict(sample_values.get(metric, {}))


@pytest.mark.unit
def test_service_sample_reads_every_status_field_the_operator_writes() -> None:
    s = service_sample(service())
    assert (s.kind, s.namespace, s.name) == ("InferenceService", "team-a", "chat")
    v = s.values
    assert values(v, "ready_replicas") == {(): 2.0}
    assert values(v, "spec_replicas") == {(): 2.0}
    assert values(v, "slo_met") == {(): 1.0}
    assert values(v, "budget_seconds") == {(): pytest.approx(0.045)}
    assert values(v, "offline_tokens_per_second") == {(): 1234.5}
    assert values(v, "observed_latency_seconds") == {
        (("metric", "ttft"), ("stat", "p99")): pytest.approx(1.2),
        (("metric", "ttft"), ("stat", "mean")): pytest.approx(0.4),
        (("metric", "tbt"), ("stat", "p99")): pytest.approx(0.09),
    }
    assert values(v, "slo_target_seconds") == {
        (("metric", "ttft"), ("stat", "p99")): 2.0,
        (("metric", "ttft"), ("stat", "mean")): pytest.approx(0.6),
        (("metric", "tbt"), ("stat", "p99")): pytest.approx(0.15),
    }
    assert values(v, "condition")[(("condition", "SLOMet"), ("status", "True"))] == 1.0
    assert values(v, "condition")[(("condition", "SLOMet"), ("status", "False"))] == 0.0
    assert s.status_time == datetime(2026, 11, 30, 5, 59, tzinfo=UTC).timestamp()
    # Every family the sample fills is documented (FAMILIES feeds the help text and docs).
    assert set(v) <= set(FAMILIES["InferenceService"])


@pytest.mark.unit
def test_unknown_slo_and_missing_status_leave_gauges_out_rather_than_guess() -> None:
    unknown = service_sample(service(slo_met="Unknown")).values
    assert "slo_met" not in unknown
    assert unknown["condition"][(("condition", "SLOMet"), ("status", "Unknown"))] == 1.0
    bare = service_sample(service(status=False))
    assert set(bare.values) == {"metadata_generation", "spec_replicas", "slo_target_seconds"}
    broken = service()
    broken["status"]["budget"]["iteration"] = "soon"
    broken["status"]["readyReplicas"] = "two"
    assert not {"budget_seconds", "ready_replicas"} & set(service_sample(broken).values)


@pytest.mark.unit
def test_job_sample_has_progress_phase_rate_and_eta() -> None:
    s = job_sample(job())
    v = s.values
    assert values(v, "input_requests") == {(): 1000.0}
    assert values(v, "finished_requests") == {
        (("outcome", "completed"),): 120.0,
        (("outcome", "failed"),): 4.0,
    }
    assert values(v, "phase") == {
        (("phase", p),): float(p == "Running")
        for p in ("Pending", "Running", "Suspended", "Succeeded", "Failed")
    }
    assert values(v, "eta_seconds") == {(): 330.0}
    assert values(v, "tokens_per_second") == {(): 88.5}
    assert values(v, "shards")[(("state", "planned"),)] == 8.0
    assert set(v) <= set(FAMILIES["OfflineJob"])


@pytest.mark.unit
def test_status_change_time_falls_back_to_the_clock_only_when_the_status_changes() -> None:
    clock = iter([10.0, 20.0, 30.0, 40.0]).__next__
    m = OperatorMetrics(clock=clock)  # 10: start
    body = job()
    m.observe(None, body)  # no managedFields: first seen at 20
    m.observe("MODIFIED", body)  # same status: stays 20
    assert _scrape(m.render())["slipstream_offlinejob_status_change_timestamp_seconds"] == {
        (("name", "mmlu"), ("namespace", "team-a")): 20.0
    }
    m.observe("MODIFIED", job(completed=130))  # changed: 30
    assert _scrape(m.render())["slipstream_offlinejob_status_change_timestamp_seconds"] == {
        (("name", "mmlu"), ("namespace", "team-a")): 30.0
    }
    m.observe("MODIFIED", service())  # the API server's time wins when the body has it
    got = _scrape(m.render())["slipstream_inferenceservice_status_change_timestamp_seconds"]
    assert got == {
        (("name", "chat"), ("namespace", "team-a")): datetime(
            2026, 11, 30, 5, 59, tzinfo=UTC
        ).timestamp()
    }


def _scrape(text: bytes | str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    raw = text.decode() if isinstance(text, bytes) else text
    for family in text_string_to_metric_families(raw):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _get(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return _scrape(resp.read())


@pytest.mark.integration
def test_scrape_over_loopback_follows_changes_and_deletions() -> None:
    m = OperatorMetrics()
    server = serve(m, "127.0.0.1", 0)
    assert server is not None
    try:
        ns_chat = (("name", "chat"), ("namespace", "team-a"))
        m.observe(None, service(ready=1, slo_met="False"))
        m.observe("ADDED", job(phase="Pending", completed=0))
        m.observe("ADDED", service("search"))
        got = _get(server.port)
        assert got["slipstream_inferenceservice_ready_replicas"][ns_chat] == 1.0
        assert got["slipstream_inferenceservice_slo_met"][ns_chat] == 0.0
        assert got["slipstream_operator_watched_objects"] == {
            (("kind", "InferenceService"),): 2.0,
            (("kind", "OfflineJob"),): 1.0,
        }
        assert (
            got["slipstream_operator_watch_events_total"][
                (("kind", "InferenceService"), ("type", "LISTED"))
            ]
            == 1.0
        )
        (build,) = got["slipstream_operator_build_info"]
        assert dict(build)["version"]

        m.observe("MODIFIED", service(ready=2, slo_met="True"))
        m.observe("MODIFIED", job(phase="Succeeded", completed=996))
        got = _get(server.port)
        assert got["slipstream_inferenceservice_ready_replicas"][ns_chat] == 2.0
        assert got["slipstream_inferenceservice_slo_met"][ns_chat] == 1.0
        job_labels = (("name", "mmlu"), ("namespace", "team-a"))
        assert (
            got["slipstream_offlinejob_finished_requests"][(*job_labels, ("outcome", "completed"))]
            == 996.0
        )
        assert got["slipstream_offlinejob_phase"][(*job_labels, ("phase", "Succeeded"))] == 1.0

        m.observe("DELETED", service())
        m.observe("DELETED", job())
        got = _get(server.port)
        for name, series in got.items():
            if name.startswith(("slipstream_inferenceservice_", "slipstream_offlinejob_")):
                assert not any(dict(k).get("name") in ("chat", "mmlu") for k in series), name
        assert got["slipstream_inferenceservice_ready_replicas"] == {
            (("name", "search"), ("namespace", "team-a")): 2.0
        }
        assert got["slipstream_operator_watched_objects"][(("kind", "OfflineJob"),)] == 0.0
    finally:
        server.close()


@pytest.mark.integration
def test_a_taken_port_is_reported_not_fatal() -> None:
    m = OperatorMetrics()
    first = serve(m, "127.0.0.1", 0)
    assert first is not None
    try:
        assert serve(OperatorMetrics(), "127.0.0.1", first.port) is None
    finally:
        first.close()


@pytest.mark.unit
def test_every_family_name_is_prefixed_and_in_base_units() -> None:
    for kind, families in FAMILIES.items():
        for suffix in families:
            name = PREFIX[kind] + suffix
            assert name.startswith(("slipstream_inferenceservice_", "slipstream_offlinejob_"))
            assert not name.endswith(("_ms", "_milliseconds", "_total")), name


@pytest.mark.unit
def test_register_adds_one_read_only_event_handler_per_kind() -> None:
    import kopf

    registry = kopf.OperatorRegistry()
    register(registry, OperatorMetrics())
    watching = registry._watching.get_all_handlers()
    assert sorted(str(h.selector.any_name) for h in watching if h.selector) == [
        "inferenceservices",
        "offlinejobs",
    ]
    # No change or timer handlers: nothing that patches, and no finalizer to add.
    assert not registry._changing.get_all_handlers()
    assert not registry._spawning.get_all_handlers()


@pytest.mark.unit
def test_every_family_is_documented_with_its_labels() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()
    section = doc[doc.index("## The operator's own metrics"):doc.index("## The Grafana")]
    families = OperatorMetrics(
        status_writes=lambda: ({}, {("OfflineJob", "shards"): 1})).registry.collect()
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        short = next((name.removeprefix(p) for p in PREFIX.values() if name.startswith(p)),
                     None)
        assert f"`{name}`" in section or f"`_{short}`" in section, name
    for label in ("`metric`", "`stat`", "`phase`", "`outcome`", "`state`", "`condition`",
                  "`kind`", "`type`"):
        assert label in section, label


@pytest.mark.integration
def test_the_status_path_counters_are_served_when_the_handlers_give_them() -> None:
    stats = {"streams": 3.0, "opened": 4.0, "snapshots": 17.0, "changes": 5.0,
             "woken_ticks": 2.0, "status_calls": 6.0, "status_call_failures": 1.0}
    m = OperatorMetrics(status_stats=lambda: stats)
    server = serve(m, "127.0.0.1", 0)
    assert server is not None
    try:
        got = _get(server.port)
        assert got["slipstream_operator_status_streams"] == {(): 3.0}
        assert got["slipstream_operator_status_snapshots_total"] == {(): 17.0}
        assert got["slipstream_operator_status_changes_total"] == {(): 5.0}
        assert got["slipstream_operator_status_stream_opens_total"] == {(): 4.0}
        assert got["slipstream_operator_woken_ticks_total"] == {(): 2.0}
        assert got["slipstream_operator_status_calls_total"] == {(): 6.0}
        assert got["slipstream_operator_status_call_failures_total"] == {(): 1.0}
        stats["streams"] = 1.0  # read at every scrape
        assert _get(server.port)["slipstream_operator_status_streams"] == {(): 1.0}
    finally:
        server.close()
    # Polling handlers give only the call count; without handlers nothing is shown.
    assert "slipstream_operator_status_streams" not in OperatorMetrics().render().decode()
    polled = OperatorMetrics(status_stats=lambda: {"status_calls": 1.0}).render().decode()
    assert "slipstream_operator_status_calls_total 1.0" in polled
    assert "slipstream_operator_status_streams" not in polled


@pytest.mark.unit
def test_status_writes_are_counted_per_kind_and_per_field_they_carried() -> None:
    from slipstream_operator.handlers import StatusWrites

    writes = StatusWrites()
    writes.record("InferenceService", ("observed", "conditions"))
    writes.record("InferenceService", ("observed",))
    writes.record("OfflineJob", ())  # nothing changed: kopf sends no PATCH, none counted
    writes.record("OfflineJob", iter(["shards"]))
    m = OperatorMetrics(status_writes=writes.snapshot)
    got = {f.name: {tuple(sorted(s.labels.items())): s.value for s in f.samples
                    if s.name.endswith("_total")}
           for f in text_string_to_metric_families(m.render().decode())}
    assert got["slipstream_operator_status_writes"] == {
        (("kind", "InferenceService"),): 2.0, (("kind", "OfflineJob"),): 1.0}
    assert got["slipstream_operator_status_field_writes"] == {
        (("field", "conditions"), ("kind", "InferenceService")): 1.0,
        (("field", "observed"), ("kind", "InferenceService")): 2.0,
        (("field", "shards"), ("kind", "OfflineJob")): 1.0}


@pytest.mark.unit
def test_garbage_collections_are_timed_per_generation() -> None:
    import gc

    from slipstream_operator.gctimes import GcTimes

    ticks = iter(i / 64 for i in range(10_000))  # exact binary fractions
    times = GcTimes(clock=lambda: next(ticks))
    times.install()
    try:
        times.install()  # once only
        assert gc.callbacks.count(times._callback) == 1
        gc.collect()  # a full collection: start and stop, 1/64 s apart on this clock
    finally:
        times.uninstall()
    full = times.snapshot()[2]
    assert full.collections >= 1 and full.seconds >= 1 / 64 and full.longest_s == 1 / 64
    assert times._callback not in gc.callbacks
    text = OperatorMetrics(gc_times=times.snapshot).render().decode()
    got = {f.name: {s.labels.get("generation"): s.value for s in f.samples}
           for f in text_string_to_metric_families(text)}
    assert got["slipstream_operator_gc_collections"]["2"] == float(full.collections)
    assert got["slipstream_operator_gc_seconds"]["2"] == pytest.approx(full.seconds)
    assert got["slipstream_operator_gc_longest_pause_seconds"]["2"] == 1 / 64
    assert "slipstream_operator_gc" not in OperatorMetrics().render().decode()


@pytest.mark.unit
def test_the_collector_is_tuned_and_refrozen_on_a_schedule() -> None:
    import asyncio
    import gc
    import itertools

    from slipstream_operator.gctimes import refreeze, refreeze_forever, refreeze_schedule, tune

    assert list(itertools.islice(refreeze_schedule(600.0), 7)) == [
        (60, False), (120, False), (240, False), (480, True), (600, True), (600, True),
        (600, True)]  # full once 600 s passed since the last full one: 900 s, then every 600
    assert list(itertools.islice(refreeze_schedule(30.0), 2)) == [(30, True), (30, True)]
    assert list(itertools.islice(refreeze_schedule(100.0), 4)) == [
        (60, False), (100, True), (100, True), (100, True)]
    before = gc.get_threshold()
    try:
        assert tune(0) == before  # 0: Python's own
        assert tune(50_000) == (50_000, *before[1:])
        kept = [[i] for i in range(100)]  # alive at the freeze
        assert refreeze() >= len(kept)
        frozen = gc.get_freeze_count()
        more = [[i] for i in range(100)]
        assert refreeze(full=False) >= frozen + len(more)  # added to, no collection
        gaps: list[float] = []

        async def sleep(gap: float) -> None:
            gaps.append(gap)
            if len(gaps) == 3:
                raise asyncio.CancelledError

        with pytest.raises(asyncio.CancelledError):
            asyncio.run(refreeze_forever(100.0, sleep=sleep))
        assert gaps == [60, 100, 100] and gc.get_freeze_count() > 0
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


@pytest.mark.unit
def test_the_event_loop_lag_is_a_histogram_of_late_wake_ups() -> None:
    import asyncio
    import time

    from slipstream_operator.looplag import BUCKETS, LoopLag

    with pytest.raises(ValueError, match="period_s"):
        LoopLag(period_s=0)
    lag = LoopLag(period_s=0.01)
    lag.observe(-0.5)  # early (a coarse clock): no lag
    lag.observe(0.003)
    lag.observe(100.0)  # past the last bucket: +Inf

    async def main() -> None:
        probe = asyncio.ensure_future(lag.run())
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # hold the loop: the probe wakes at least this late
        await asyncio.sleep(0.05)
        probe.cancel()

    asyncio.run(main())
    got = lag.snapshot()
    assert len(got.counts) == len(BUCKETS) + 1 and got.counts[-1] == 1
    assert got.counts[0] >= 1 and got.counts[1] >= 1  # the 0 and the 3 ms
    assert sum(got.counts[BUCKETS.index(0.5):]) >= 2  # the held loop (>= 0.29 s) and the 100 s
    assert got.sum_s >= 100.28 and got.count == sum(got.counts) >= 5
    text = OperatorMetrics(loop_lag=lag.snapshot).render().decode()
    family = next(f for f in text_string_to_metric_families(text)
                  if f.name == "slipstream_operator_event_loop_lag_seconds")
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("slipstream_operator_event_loop_lag_seconds_bucket", "+Inf")] == got.count
    assert samples[("slipstream_operator_event_loop_lag_seconds_count", None)] == got.count
    assert samples[("slipstream_operator_event_loop_lag_seconds_sum", None)] == pytest.approx(
        got.sum_s)
