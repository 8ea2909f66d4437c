"""Fixtures of the reliability tests: a private local cluster for fault injection.

``private_cluster`` (session) is a :class:`LocalCluster` with its own state dir and ports, so
that killing its kube-apiserver and etcd disturbs no other session's cluster. Pod IPs come from
one fixed loopback range (127.1.0.0/16, a /24 per node) in every local cluster, and other
sessions run sidecars on the first nodes' addresses (a 100-node fleet cluster uses
127.1.0-99.x); so this cluster has 120 nodes and all but the last two are cordoned: our pods
get 127.1.118.x and 127.1.119.x. Tests still check the ports are free before binding.

Deliberately left out: building the Kubernetes binaries (``make cluster-build``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from slipstream_testbed.cluster import ClusterConfig, ClusterError, LocalCluster, Ports

NODES = 120
OUR_NODES = (NODES - 2, NODES - 1)


def _kubectl(cluster: LocalCluster, *args: str) -> None:
    env = dict(os.environ, KUBECONFIG=str(cluster.admin_kubeconfig))
    subprocess.run([str(cluster.kubectl), *args], env=env, capture_output=True, text=True,
                   check=True, timeout=120)


@pytest.fixture(scope="session")
def private_cluster() -> Iterator[LocalCluster]:
    cache = Path(os.environ.get("SLIPSTREAM_CACHE", Path.home() / ".cache" / "slipstream"))
    cfg = ClusterConfig.from_env(
        state_dir=cache / "reliability-cluster",
        ports=Ports.from_base(int(os.environ.get("SLIPSTREAM_RELIABILITY_PORT_BASE", "25200"))),
        nodes=NODES,
    )
    local = LocalCluster(cfg)
    try:
        local.up(build=False, timeout=300)
    except ClusterError as exc:
        pytest.fail(f"private cluster did not come up: {exc}", pytrace=False)
    local.acquire()
    _kubectl(local, "cordon", "-l", "type=kwok")
    for i in OUR_NODES:
        _kubectl(local, "uncordon", f"gpu-node-{i}")
    _kubectl(local, "apply", "-f", str(Path(__file__).resolve().parents[2] / "crds"))
    yield local
    if local.release() and os.environ.get("SLIPSTREAM_KEEP_CLUSTER", "") not in ("1", "true"):
        local.down()
