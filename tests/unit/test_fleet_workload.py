"""Fleet workload builders, the bench cluster's pod network and the pod watcher's filter."""

from __future__ import annotations

import ipaddress
import json
from collections import Counter
from types import SimpleNamespace

import pytest

from slipstream_operator.api import InferenceServiceSpec, OfflineJobSpec
from slipstream_testbed.cluster import POD_NETWORK
from slipstream_testbed.fleet.benchcluster import BENCH_POD_NETWORK, bench_pod_cidr
from slipstream_testbed.fleet.clusterrun import dispatched
from slipstream_testbed.fleet.podwatch import pod_event
from slipstream_testbed.fleet.workload import (
    POOL_LABEL,
    FleetPlan,
    batch_lines,
    job_manifests,
    namespace_names,
    plan_for_nodes,
    service_manifests,
    shards_per_pod_needed,
)

pytestmark = pytest.mark.unit


def test_the_issue_scale_has_the_issue_counts() -> None:
    plan = plan_for_nodes(1000)
    assert plan.to_dict() == {"nodes": 1000, "services": 500, "pods": 2000, "jobs": 200,
                              "shards": 100_000}
    assert len(namespace_names(plan, "f")) == 10
    assert shards_per_pod_needed(plan, "f") == 50  # 4 jobs x 500 shards on a 40-pod pool


def test_manifests_are_valid_specs_and_jobs_select_existing_pools() -> None:
    plan = FleetPlan(nodes=40, services=23, replicas=2, jobs=9, shards_per_job=7,
                     services_per_namespace=10, pool_size=4)
    services = service_manifests(plan, "p")
    jobs = job_manifests(plan, "p", "file:///in.jsonl", "/out")
    assert len(services) == 23 and len(jobs) == 9
    pools = {(s["metadata"]["namespace"], s["metadata"]["labels"][POOL_LABEL]) for s in services}
    for svc in services:
        InferenceServiceSpec.model_validate(svc["spec"])
    for job in jobs:
        spec = OfflineJobSpec.model_validate(job["spec"])
        assert (job["metadata"]["namespace"],
                spec.service_selector.match_labels[POOL_LABEL]) in pools
    assert len({j["spec"]["output"]["uri"] for j in jobs}) == 9
    per_ns = Counter(s["metadata"]["namespace"] for s in services)
    assert sorted(per_ns.values()) == [3, 10, 10]
    assert shards_per_pod_needed(plan, "p") >= 7 * 9 // (23 * 2)


def test_batch_lines_have_unique_prefixes() -> None:
    lines = [json.loads(x) for x in batch_lines(["same question", "other"], 5)]
    assert [x["custom_id"] for x in lines] == [f"q-{i:06d}" for i in range(5)]
    assert len({x["body"]["prompt"][:20] for x in lines}) == 5
    with pytest.raises(ValueError):
        batch_lines([], 3)


def test_bench_pod_cidrs_are_disjoint_and_outside_the_shared_pod_network() -> None:
    cidrs = [bench_pod_cidr(i, 1000) for i in range(1000)]
    assert all(c.subnet_of(BENCH_POD_NETWORK) for c in cidrs)
    assert not any(c.overlaps(POD_NETWORK) for c in cidrs)
    assert len({c.network_address for c in cidrs}) == 1000
    assert ipaddress.ip_address("127.9.0.0") in cidrs[0]


def _pod(ns: str, labels: dict[str, str], phase: str, ip: str | None) -> SimpleNamespace:
    meta = SimpleNamespace(namespace=ns, name="p", labels=labels, deletion_timestamp=None)
    return SimpleNamespace(metadata=meta, status=SimpleNamespace(phase=phase, pod_ip=ip))


def test_pod_events_need_the_service_label_and_a_running_ip() -> None:
    label = {"slipstream.dev/service": "chat"}
    assert pod_event("ADDED", _pod("a", {}, "Running", "127.9.0.2")) is None
    running = pod_event("MODIFIED", _pod("a", label, "Running", "127.9.0.2"))
    assert running is not None and running.running and running.service == "chat"
    pending = pod_event("ADDED", _pod("a", label, "Pending", None))
    assert pending is not None and not pending.running
    gone = pod_event("DELETED", _pod("a", label, "Running", "127.9.0.2"))
    assert gone is not None and not gone.running


def test_dispatched_counts_only_the_flow_schema() -> None:
    text = (
        "# TYPE apiserver_flowcontrol_dispatched_requests_total counter\n"
        'apiserver_flowcontrol_dispatched_requests_total{flow_schema="mine",priority_level="x"} 7\n'
        'apiserver_flowcontrol_dispatched_requests_total{flow_schema="other"} 5\n'
        "# TYPE apiserver_request_total counter\n"
        'apiserver_request_total{verb="GET",code="200"} 30\n'
        'apiserver_request_total{verb="LIST",code="200"} 12\n'
    )
    assert dispatched(text, "mine") == (7.0, 42.0)
