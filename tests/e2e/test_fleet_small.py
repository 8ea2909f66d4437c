"""A small fleet on the shared local cluster: the real operator fed by the stand-in.

The same code path as ``slipstream bench fleet`` (:class:`FleetRun`), at a size
the test cluster holds (its GPU nodes, a few services, five jobs): the operator
(namespaced to the run's team namespaces, with its own service account) must
bring every service to Ready, place every shard, and write statuses that match
what the stand-in's fake sidecars hold and report. It runs once with one operator and
once with two operators sharded by namespace (one namespace each). Correctness only: the
timings it measures are printed, never asserted.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from slipstream_testbed.cluster import LocalCluster
from slipstream_testbed.fleet.clusterrun import FleetRun
from slipstream_testbed.fleet.workload import FleetPlan

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("SLIPSTREAM_DATA", REPO.parent / "shared" / "data"))


@pytest.mark.parametrize("shards", [1, 2], ids=["one-operator", "two-operator-shards"])
def test_small_fleet_is_ready_placed_and_reported(cluster: LocalCluster, tmp_path: Path,
                                                  shards: int) -> None:
    gpus = cluster.config.nodes * cluster.config.gpus_per_node
    services = max(2, min(10, gpus // 2 // 2))  # 2 replicas, half the GPUs at most
    plan = FleetPlan(nodes=cluster.config.nodes, services=services, replicas=2, jobs=5,
                     shards_per_job=12, services_per_namespace=max(1, services // 2),
                     pool_size=2)
    run = FleetRun(cluster, plan, tmp_path, data_dir=DATA,
                   prefix=f"t-fleet-{uuid.uuid4().hex[:6]}", interval_s=1.0, bumps=2,
                   bump_gap_s=1.0, clusterwide=False, timeout_s=300.0, lag_timeout_s=60.0,
                   operator_shards=shards)
    try:
        result = run.run()
    finally:
        run.cleanup()
    print(json.dumps(result.to_dict(), indent=1))
    checks = result.checks
    assert checks["services_ready"] == plan.services
    assert checks["ready_replicas"] == plan.pods
    # Every shard was planned (one line each) and placed, and the services' offline
    # columns count exactly the shards the fake sidecars hold.
    assert checks["shards_total"] == checks["shards_assigned"] == plan.shards
    assert checks["active_shards"] == plan.shards == result.standin["shards"]
    assert result.standin["pods"] == plan.pods
    assert result.standin["AssignShard"] >= plan.shards
    assert result.standin["Configure"] >= plan.pods  # each pod got the budget pushed
    # Two bumps of one online request per pod: every service's window shows 2 x replicas.
    assert checks["samples"] == [2 * plan.replicas]
    # etcd, read past the API server, holds the same count for every service of the run.
    assert checks["samples_etcd"] == {str(2 * plan.replicas): plan.services}
    # The bumps made every service write its status: the operators' own /metrics count it,
    # and say which fields those PATCHes carried (the samples are in "observed").
    assert result.status_writes_rps.get("InferenceService", 0) > 0
    assert result.status_writes_rps.get("InferenceService/observed", 0) > 0
    assert result.sidecar_status_rps.get("calls", 0) > 0  # polled or streamed, some are unary
    # The API server's writes to etcd: the bumps changed every service's status.
    assert result.etcd_writes_rps.get("inferenceservices", 0) > 0
    assert result.lag_timeouts == 0 and len(result.status_lags_s) == 2 * plan.services
    # The lag is stamped with the API server's own time of each status write (never later
    # than the probe read it), which the real server records in managedFields.
    assert checks["status_write_times"] == plan.services
    for bump in result.bumps:
        assert len(bump.arrival_lags_s) == len(bump.lags_s)
        assert all(stamp <= arrival + 1e-6
                   for stamp, arrival in zip(sorted(bump.lags_s), sorted(bump.arrival_lags_s),
                                             strict=True))
    assert checks["job_phases"] == ["Running"]
    assert result.steady.api_rps > 0 and result.operator_rss_mb > 0
    # Sharded by namespace: each operator served its own namespace (each one's services
    # reached Ready above, which only its operator could have written), and each did work.
    assert result.operator_shards == shards == len(result.shard_cpu_cores)
    assert all(cpu > 0 for cpu in result.shard_cpu_cores)
    # Where the host's time went besides the operator: the control plane's processes, and
    # the API server's request mix, in which the operator's status PATCHes show.
    assert {"etcd", "kube-apiserver", "kwok"} <= set(result.control_plane_cpu_cores)
    assert result.apiserver_top_rps
    assert "PATCH inferenceservices/status" in result.apiserver_top_rps
    # The bumps' status writes, as the API server timed them over the steady phase.
    writes = result.apiserver_latency["PATCH inferenceservices/status"]
    assert writes["count"] and writes["count"] > 0 and writes["p99_s"] is not None
