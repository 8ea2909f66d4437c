"""One InferenceService's pods served by the fleet stand-in, for tests of the real handlers.

Creates the service's control-token Secret in the test namespace (the handler reads it from
the API server), starts a stand-in with three fake sidecars on loopback addresses
``127.1.<net>.10-12`` and returns it with the pod index the handler takes.
"""

from __future__ import annotations

from kubernetes import client

from slipstream_operator import kube
from slipstream_operator.reconcile_service import SERVICE_LABEL, TOKEN_KEY
from slipstream_testbed.fleet.standin import Standin, StandinConfig

PodIndex = dict[tuple[str, str], list[kube.PodInfo]]


async def standin_service(api: client.ApiClient, namespace: str, name: str, token: str, *,
                          grpc_port: int, net: int, replicas: int = 3,
                          status_counters: bool = True) -> tuple[Standin, PodIndex]:
    client.CoreV1Api(api).create_namespaced_secret(namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(name=f"{name}-control-token"),
        string_data={TOKEN_KEY: token}))
    standin = Standin(StandinConfig(http_port=grpc_port + 1, grpc_port=grpc_port,
                                    status_counters=status_counters))
    await standin.start()
    ips = [f"127.1.{net}.{10 + i}" for i in range(replicas)]
    for i, ip in enumerate(ips):
        await standin.add_pod(f"{name}-{i}", ip, token)
    return standin, {(namespace, name): [
        kube.PodInfo(f"{name}-{i}", ip, True, {SERVICE_LABEL: name}) for i, ip in enumerate(ips)
    ]}
