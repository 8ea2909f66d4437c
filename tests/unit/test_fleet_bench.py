"""The fleet bench's result shaping (no cluster, no simulation)."""

from __future__ import annotations

import pytest

from slipstream_cli.benches.fleet import BEGIN, END, markdown, splice, summary

pytestmark = pytest.mark.unit


def _scale(nodes: int, ok: bool = True) -> dict[str, object]:
    row: dict[str, object] = {"nodes": nodes, "services": nodes // 2, "pods": 2 * nodes,
                              "jobs": nodes // 5, "shards": 100 * nodes, "ok": ok}
    if ok:
        row.update({"ready_s": 1.0 * nodes, "status_lag_p99_s": 0.1 * nodes,
                    "status_lag_p50_s": 0.05 * nodes, "operator_cpu_cores": 0.001 * nodes,
                    "operator_rss_mb": 100.0, "api_rps": 0.7 * nodes, "pods_running_s": 2.0,
                    "ramp": {"cpu_cores": 0.2, "api_rps": 3.0}})
    else:
        row["error"] = "shards placed: not reached after 1200s"
    return row


def test_summary_reports_the_largest_scale_reached() -> None:
    result = summary([_scale(100), _scale(250), _scale(500, ok=False)], None)
    assert result["nodes"] == 250 and result["api_rps"] == pytest.approx(175.0)
    assert [s["nodes"] for s in result["scales"]] == [100, 250, 500]
    table = markdown(result)
    assert "| 250 | 125 | 500 | 50 | 25000 |" in table and "failed: shards placed" in table
    assert summary([], None)["nodes"] is None


def test_splice_replaces_only_the_results_block() -> None:
    doc = splice("# Fleet\n\nwhy\n", "| old |\n")
    assert doc.startswith("# Fleet\n\nwhy\n\n" + BEGIN) and doc.endswith(END + "\n")
    again = splice(doc + "\nafter\n", "| new |\n")
    assert "| old |" not in again and "| new |" in again
    assert again.startswith("# Fleet\n\nwhy\n") and again.endswith("\nafter\n")
    assert splice("", "| t |\n") == f"{BEGIN}\n| t |\n{END}\n"


def test_baseline_rows_are_shown_but_never_the_headline() -> None:
    before = dict(_scale(500), operator="before", baseline=True)
    after = dict(_scale(100), operator="after")
    result = summary([before, after], None)
    assert result["nodes"] == 100  # the baseline's larger scale is not the result
    table = markdown(result)
    assert "| operator | nodes |" in table
    assert "| before | 500 | 250 |" in table and "| after | 100 | 50 |" in table
    assert "| operator" not in markdown(summary([_scale(100)], None))


def test_lags_are_reported_per_bump_and_overall() -> None:
    from slipstream_testbed.fleet.clusterrun import BumpLags, FleetResult, Phase
    from slipstream_testbed.fleet.workload import plan_for_nodes

    first = BumpLags(1, tuple(float(x) for x in range(1, 101)))  # 1..100 s
    second = BumpLags(2, (2.0,) * 99 + (120.0,), timeouts=1)
    phase = Phase(1.0, 0.5, 10.0, 20.0)
    result = FleetResult(
        plan=plan_for_nodes(25), interval_s=5.0, pods_running_s=1.0, services_ready_s=1.0,
        shards_placed_s=1.0, ready_s=1.0,
        status_lags_s=first.lags_s + second.lags_s, lag_timeouts=1, ramp=phase, steady=phase,
        operator_rss_mb=1.0, operator_hwm_mb=1.0, bumps=(first, second),
    ).to_dict()
    # The overall keys keep their meaning: over all 200 lags.
    assert result["status_lag_samples"] == 200 and result["status_lag_max_s"] == 120.0
    assert result["status_lag_p99_s"] == 100.0 and result["status_lag_timeouts"] == 1
    one, two = result["status_lag_bumps"]
    assert (one["bump"], one["p50_s"], one["p99_s"], one["max_s"]) == (1, 51.0, 100.0, 100.0)
    assert (two["p50_s"], two["p99_s"], two["max_s"], two["timeouts"]) == (2.0, 120.0, 120.0, 1)
    # Stamps 1 s apart are no burst; 99 services stamped at one instant are.
    assert (one["largest_burst"], two["largest_burst"]) == (1, 99)
    assert one["probe_reopened"] == two["probe_reopened"] == 0
    assert one["probe_relisted"] == two["probe_relisted"] == 0
    assert one["waiting_samples"] == {}
    stuck = BumpLags(2, (120.0,) * 3, timeouts=3, waiting_samples={4: 2, -1: 1}).to_dict()
    assert stuck["waiting_samples"] == {"-1": 1, "4": 2}  # by count; -1: never seen
    assert BumpLags(3, (5.0, 5.02, 5.04, 5.06, 9.0)).largest_burst() == 3
    row = dict(_scale(25), status_lag_bumps=[one, two])
    table = markdown(summary([row], None))
    assert "| nodes | bump | services seen | timeouts | lag p50 s |" in table
    assert "| 25 | 1 | 100 | 0 | 51.0 | 100.0 | 100.0 |" in table
    assert "| 25 | 2 | 100 | 1 | 2.0 | 120.0 | 120.0 |" in table


def test_namespaces_are_dealt_round_robin_to_operator_shards() -> None:
    from slipstream_testbed.fleet.clusterrun import shard_namespaces

    spaces = [f"team-{i}" for i in range(10)]
    groups = shard_namespaces(spaces, 3)
    assert groups == [["team-0", "team-3", "team-6", "team-9"], ["team-1", "team-4", "team-7"],
                      ["team-2", "team-5", "team-8"]]
    assert sorted(ns for g in groups for ns in g) == sorted(spaces)  # each exactly once
    assert shard_namespaces(spaces, 1) == [spaces]
    for bad in (0, 11):
        with pytest.raises(ValueError, match="between 1 and the 10 namespaces"):
            shard_namespaces(spaces, bad)


def test_the_operator_shards_cpu_and_memory_are_summed() -> None:
    import os

    from slipstream_testbed.fleet.clusterrun import procs_sample

    me = os.getpid()
    one = procs_sample([me])
    two = procs_sample([me, me])
    # The same process counted twice: twice its CPU and memory (each read a moment apart).
    assert two.cpu_s >= 2 * one.cpu_s - 0.05
    assert two.rss_mb >= 1.5 * one.rss_mb


def test_the_api_servers_request_mix_is_ranked_by_rate() -> None:
    from slipstream_testbed.fleet.clusterrun import request_mix, top_rates

    def text(patches: int, lists: int) -> str:
        return (
            "# HELP apiserver_request_total Counter of apiserver requests.\n"
            "# TYPE apiserver_request_total counter\n"
            'apiserver_request_total{code="200",component="apiserver",group="slipstream.dev",'
            'resource="inferenceservices",subresource="status",verb="PATCH",version="v1alpha1"} '
            f"{patches}\n"
            'apiserver_request_total{code="409",component="apiserver",group="slipstream.dev",'
            'resource="inferenceservices",subresource="status",verb="PATCH",version="v1alpha1"} '
            "3\n"
            'apiserver_request_total{code="200",component="apiserver",group="",'
            f'resource="pods",subresource="",verb="LIST",version="v1"}} {lists}\n'
            'apiserver_request_total{code="200",component="apiserver",group="",'
            'resource="nodes",subresource="",verb="GET",version="v1"} 7\n'
        )

    before, after = request_mix(text(100, 10)), request_mix(text(600, 20))
    # Codes are summed into one kind; a subresource is kept apart from its resource.
    assert before == {"PATCH inferenceservices/status": 103.0, "LIST pods": 10.0,
                      "GET nodes": 7.0}
    # Rates over 10 s, busiest first; a kind that did not move is left out.
    assert list(top_rates(before, after, 10.0).items()) == [
        ("PATCH inferenceservices/status", 50.0), ("LIST pods", 1.0)]
    assert top_rates(before, after, 10.0, limit=1) == {"PATCH inferenceservices/status": 50.0}


def test_the_api_servers_etcd_writes_are_kept_apart_from_its_requests() -> None:
    from slipstream_testbed.fleet.clusterrun import _requests, request_mix, top_rates

    def text(patches: int, updates: int) -> str:
        return (
            "# TYPE apiserver_request_total counter\n"
            'apiserver_request_total{code="200",resource="offlinejobs",subresource="status",'
            f'verb="PATCH"}} {patches}\n'
            "# TYPE etcd_requests_total counter\n"
            'etcd_requests_total{group="slipstream.dev",operation="update",'
            f'resource="offlinejobs"}} {updates}\n'
            'etcd_requests_total{group="slipstream.dev",operation="get",'
            'resource="offlinejobs"} 50\n'
        )

    before, after = request_mix(text(100, 40)), request_mix(text(400, 50))
    assert before == {"PATCH offlinejobs/status": 100.0, "etcd update offlinejobs": 40.0}
    # 30 PATCHes/s reached the server, 1 write/s reached etcd: the rest changed nothing.
    assert top_rates(*_requests(before, after), 10.0) == {"PATCH offlinejobs/status": 30.0}
    assert top_rates(*_requests(before, after, etcd=True), 10.0) == {
        "etcd update offlinejobs": 1.0}


def test_status_write_latency_and_queue_wait_come_from_bucket_deltas() -> None:
    from slipstream_testbed.fleet.clusterrun import (
        PRIORITY_LEVEL,
        bucket_quantiles,
        latency_buckets,
    )

    def text(fast: int, slow: int) -> str:
        lines = ["# HELP apiserver_request_duration_seconds Response latency.",
                 "# TYPE apiserver_request_duration_seconds histogram"]
        for scope in ("resource", "namespace"):  # summed over the other labels
            for le, count in (("0.1", fast), ("1.0", fast), ("5.0", fast + slow),
                              ("+Inf", fast + slow)):
                lines.append(
                    'apiserver_request_duration_seconds_bucket{component="apiserver",'
                    'group="slipstream.dev",resource="inferenceservices",'
                    f'scope="{scope}",subresource="status",verb="PATCH",version="v1alpha1",'
                    f'le="{le}"}} {count}')
        lines += ["# HELP apiserver_flowcontrol_request_wait_duration_seconds Wait.",
                  "# TYPE apiserver_flowcontrol_request_wait_duration_seconds histogram",
                  'apiserver_flowcontrol_request_wait_duration_seconds_bucket{execute="true",'
                  f'flow_schema="x",priority_level="{PRIORITY_LEVEL}",le="0.5"}} {fast}',
                  'apiserver_flowcontrol_request_wait_duration_seconds_bucket{execute="true",'
                  f'flow_schema="x",priority_level="{PRIORITY_LEVEL}",le="+Inf"}} {fast + slow}',
                  'apiserver_flowcontrol_request_wait_duration_seconds_bucket{execute="true",'
                  'flow_schema="y",priority_level="other",le="+Inf"} 999']
        return "\n".join(lines) + "\n"

    before, after = latency_buckets(text(10, 0)), latency_buckets(text(108, 2))
    writes = bucket_quantiles(before["PATCH inferenceservices/status"],
                              after["PATCH inferenceservices/status"])
    # 196 fast writes and 4 slow ones (both scopes) since the first reading.
    assert writes["count"] == 200
    assert writes["p50_s"] == pytest.approx(0.1 * 100 / 196, abs=1e-3)
    assert writes["p99_s"] == pytest.approx(1.0 + 4.0 * (198 - 196) / 4, abs=1e-3)
    wait = bucket_quantiles(before["APF queue wait (operator)"],
                            after["APF queue wait (operator)"])
    assert wait["count"] == 100  # the other priority level is not counted
    assert wait["p99_s"] == 0.5  # past the last finite bucket: its bound
    assert after["PATCH offlinejobs/status"] == {}
    assert bucket_quantiles({}, {})["p99_s"] is None


def test_the_operators_status_writes_are_read_from_its_metrics_as_rates() -> None:
    from slipstream_testbed.fleet.clusterrun import (
        gc_summary,
        loop_lag,
        rates_of,
        status_writes,
        write_rates,
    )

    text = (
        "# TYPE slipstream_operator_status_writes_total counter\n"
        'slipstream_operator_status_writes_total{kind="InferenceService"} 30.0\n'
        'slipstream_operator_status_writes_total{kind="OfflineJob"} 4.0\n'
        "# TYPE slipstream_operator_status_field_writes_total counter\n"
        'slipstream_operator_status_field_writes_total{field="observed",'
        'kind="InferenceService"} 20.0\n'
        "# TYPE slipstream_operator_status_calls_total counter\n"
        "slipstream_operator_status_calls_total 99.0\n"
        "# TYPE slipstream_operator_status_streams gauge\n"
        "slipstream_operator_status_streams 7.0\n"
        "# TYPE slipstream_operator_gc_seconds_total counter\n"
        'slipstream_operator_gc_seconds_total{generation="2"} 1.5\n'
        "# TYPE slipstream_operator_gc_collections_total counter\n"
        'slipstream_operator_gc_collections_total{generation="2"} 7.0\n'
        "# TYPE slipstream_operator_gc_longest_pause_seconds gauge\n"
        'slipstream_operator_gc_longest_pause_seconds{generation="2"} 0.5\n'
        "# TYPE slipstream_operator_event_loop_lag_seconds histogram\n"
        'slipstream_operator_event_loop_lag_seconds_bucket{le="0.01"} 90.0\n'
        'slipstream_operator_event_loop_lag_seconds_bucket{le="1.0"} 100.0\n'
        'slipstream_operator_event_loop_lag_seconds_bucket{le="+Inf"} 100.0\n'
        "slipstream_operator_event_loop_lag_seconds_sum 3.0\n"
        "slipstream_operator_event_loop_lag_seconds_count 100.0\n")
    after = status_writes(text)
    assert after == {"InferenceService": 30.0, "OfflineJob": 4.0,
                     "InferenceService/observed": 20.0, "Status/calls": 99.0, "GC/2": 1.5,
                     "GCn/2": 7.0, "GCmax/2": 0.5, "Lag/0.01": 90.0, "Lag/1.0": 100.0,
                     "Lag/inf": 100.0}
    lag = loop_lag({"Lag/0.01": 40.0, "Lag/1.0": 40.0, "Lag/inf": 40.0}, after)
    assert lag == {"count": 60.0, "p50_s": pytest.approx(0.01 * 30 / 50),
                   "p99_s": pytest.approx(0.01 + 0.99 * (59.4 - 50) / 10, abs=1e-3)}
    assert loop_lag(None, after) == {} and loop_lag({}, {}) == {}
    assert gc_summary({"GC/2": 0.5, "GCn/2": 2.0}, after, 10.0) == {
        "2": {"cores": 0.1, "per_s": 0.5, "longest_s": 0.5}}
    assert rates_of(None, after, 10.0) == {}
    assert rates_of({"GC/2": 0.5, "GCn/2": 2.0, "GCmax/2": 0.1}, after, 10.0) == {
        "Status/calls": 9.9, "InferenceService": 3.0, "InferenceService/observed": 2.0,
        "OfflineJob": 0.4, "GCn/2": 0.5, "GC/2": 0.1}
    for key in ("Status/calls", "GC/2", "GCn/2", "GCmax/2", "Lag/0.01", "Lag/1.0", "Lag/inf"):
        del after[key]
    before = {"InferenceService": 10.0, "OfflineJob": 4.0, "InferenceService/observed": 5.0}
    rates = write_rates(before, after, 10.0)
    assert rates == {"InferenceService": 2.0, "InferenceService/observed": 1.5}  # 0/s left out
    assert list(rates) == ["InferenceService", "InferenceService/observed"]  # largest first


def test_a_process_sample_counts_its_live_children() -> None:
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from slipstream_testbed.fleet.clusterrun import child_pids, proc_sample

    burn = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n" \
           "time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the child has burnt its 0.5 s of CPU
            stat = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
            if (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK") >= 0.5:
                break
            time.sleep(0.05)
        assert child.pid in child_pids(os.getpid())
        alone, whole = proc_sample(os.getpid(), children=False), proc_sample(os.getpid())
        assert whole.cpu_s - alone.cpu_s >= 0.45  # the child's CPU, not the test's
        assert whole.rss_mb > alone.rss_mb
    finally:
        child.kill()
        child.wait()
    assert child_pids(2**22 + 12345) == []  # no such process
