"""The bench's own local cluster: same control plane, a pod network nobody else uses.

:class:`~slipstream_testbed.cluster.LocalCluster` gives every cluster's pods IPs in
127.1.0.0/16, so two clusters on one machine hand out the same pod IPs, and the
stand-in's 2,000 listeners (ports 8000/9000 on each pod IP) would take the
addresses another engineer's e2e test binds its real sidecars to. The bench
cluster therefore moves its pods to :data:`BENCH_POD_NETWORK` (127.9.0.0/16):
the fake nodes' ``podCIDR`` and kwok's ``--cidr`` are rewritten, nothing else.

``cluster.py`` now has a general ``pod_network`` option ("auto" derives a /16 from
the state dir, never 127.9.0.0/16); the bench keeps its fixed network so that its
listeners never take an address any other cluster on the machine can hand out.

Deliberately left out: anything else that differs from :class:`LocalCluster`.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from slipstream_testbed.cluster import (
    POD_NETWORK,
    Component,
    LocalCluster,
    Rest,
    gpu_node_manifest,
    node_pod_prefix,
)

logger = logging.getLogger(__name__)

BENCH_POD_NETWORK = ipaddress.IPv4Network("127.9.0.0/16")


def bench_pod_cidr(index: int, nodes: int) -> ipaddress.IPv4Network:
    """Node ``index``'s pod CIDR inside :data:`BENCH_POD_NETWORK` (same sizes as the module's)."""
    prefix = node_pod_prefix(nodes)
    size = 1 << (32 - prefix)
    return ipaddress.IPv4Network((int(BENCH_POD_NETWORK.network_address) + index * size, prefix))


def bench_node_manifest(index: int, cluster: LocalCluster) -> dict[str, Any]:
    manifest = gpu_node_manifest(index, cluster.config)
    cidr = str(bench_pod_cidr(index, cluster.config.nodes))
    manifest["spec"] = {"podCIDR": cidr, "podCIDRs": [cidr]}
    return manifest


class BenchCluster(LocalCluster):
    """A :class:`LocalCluster` whose pods get IPs in :data:`BENCH_POD_NETWORK`."""

    def _components(self) -> list[Component]:
        out = []
        for component in super()._components():
            argv = [f"--cidr={BENCH_POD_NETWORK}" if a == f"--cidr={POD_NETWORK}" else a
                    for a in component.argv]
            out.append(replace(component, argv=argv))
        return out

    def _create_nodes(self, rest: Rest) -> None:
        started = time.monotonic()
        manifests = [bench_node_manifest(i, self) for i in range(self.config.nodes)]
        with ThreadPoolExecutor(max_workers=8) as pool:
            for _ in pool.map(lambda m: rest.create("/api/v1/nodes", m), manifests):
                pass
        logger.info("%d fake GPU nodes (pods in %s) created in %.1fs", len(manifests),
                    BENCH_POD_NETWORK, time.monotonic() - started)
