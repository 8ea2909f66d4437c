"""A real local Kubernetes control plane for tests and the demo: ``slipstream cluster``.

Starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok as background
processes bound to 127.0.0.1, from the binaries that ``hack/cluster/build.sh`` builds from Go
modules and caches under ``~/.cache/slipstream/bin/k8s-<version>``. It writes a PKI, an admin
kubeconfig (``system:masters``) and a restricted one (a token for a namespaced service account
bound to a small Role), and creates kwok fake nodes with ``nvidia.com/gpu`` capacity whose
pod CIDRs lie in a loopback /16 (127.1.0.0/16 unless ``pod_network`` says otherwise), so that
a test can bind a real process on a pod's IP. ``pod_network="auto"`` (or
``$SLIPSTREAM_CLUSTER_POD_NETWORK=auto``) derives the /16 from the state dir
(:func:`pod_network_for`), so that clusters with different state dirs on one machine hand out
different pod IPs.

Everything it sends goes to 127.0.0.0/8: numeric addresses everywhere, no DNS names, pods
get loopback IPs, and even ClusterIPs come from a loopback range (127.3.0.0/16), though nothing
routes them (no kube-proxy, and Endpoints refuse loopback pod IPs, so the endpoint controllers
are left off): address pods by ``status.podIP``.

State (PKI, kubeconfigs, etcd data, PID files, logs) lives in ``$SLIPSTREAM_CLUSTER_DIR``
(default ``~/.cache/slipstream/cluster``). ``up`` reuses a healthy cluster started from the same
state dir with the same settings. What it leaves out: kubelets, container runtimes, kube-proxy,
DNS, Services that route, and any multi-user isolation of the state dir.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LOG = logging.getLogger(__name__)

DEFAULT_K8S_VERSION = "1.37.2"
POD_NETWORK = ipaddress.IPv4Network("127.1.0.0/16")
AUTO_NETWORK = "auto"
# Second octets that "auto" may pick: not 127.0/16 (127.0.0.1 serves the control plane), not
# the fixed node, service and default pod networks, not the fleet bench's 127.9.0.0/16.
AUTO_OCTETS = tuple(range(16, 255))
NODE_NETWORK = ipaddress.IPv4Network("127.2.0.0/16")
# Loopback too (the apiserver accepts it): a ClusterIP dialled by mistake stays on `lo`.
SERVICE_NETWORK = "127.3.0.0/16"
MAX_NODES = 1000
LOOPBACK = "127.0.0.1"
LOOPBACK_NETWORK = ipaddress.IPv4Network("127.0.0.0/8")
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"
FAKE_NODE_LABEL = "type"
KWOK_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
)
COMPONENT_ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
BINARIES = (*COMPONENT_ORDER, "kubectl", "helm")
RESTRICTED_ROLE_RULES: list[dict[str, list[str]]] = [
    {
        "apiGroups": [""],
        "resources": ["pods", "configmaps", "services", "events"],
        "verbs": ["get", "list", "watch"],
    },
    {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "verbs": ["create", "update", "patch", "delete"],
    },
]


class ClusterError(RuntimeError):
    """The local control plane could not be built, started, reached or stopped."""


# --------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class Ports:
    """Loopback ports of the components. ``from_base`` packs them into base..base+5."""

    etcd_client: int = 2379
    etcd_peer: int = 2380
    apiserver: int = 6443
    controller_manager: int = 10257
    scheduler: int = 10259
    kwok: int = 10247

    @classmethod
    def from_base(cls, base: int | None) -> Ports:
        if base is None:
            return cls()
        if not 1024 <= base <= 65535 - 6:
            raise ClusterError(f"port base {base} must lie in 1024..65529")
        return cls(base, base + 1, base + 2, base + 3, base + 4, base + 5)


NO_CONTROLLERS = ("endpoints-controller", "endpointslice-controller",
                  "endpointslice-mirroring-controller")
"""kube-controller-manager controllers the local cluster leaves off (see ``_components``)."""


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ClusterError(f"${name}={raw!r} is not an integer") from exc


def default_cache_dir() -> Path:
    return Path(os.environ.get("SLIPSTREAM_CACHE", Path.home() / ".cache" / "slipstream"))


def default_bin_dir(k8s_version: str = DEFAULT_K8S_VERSION) -> Path:
    env = os.environ.get("SLIPSTREAM_BIN_DIR")
    return Path(env) if env else default_cache_dir() / "bin" / f"k8s-{k8s_version}"


def default_state_dir() -> Path:
    env = os.environ.get("SLIPSTREAM_CLUSTER_DIR")
    return Path(env) if env else default_cache_dir() / "cluster"


@dataclass(frozen=True)
class ClusterConfig:
    """Everything that decides what ``up`` starts. Two ``up`` calls reuse one cluster only if
    their configs are equal."""

    state_dir: Path = field(default_factory=default_state_dir)
    bin_dir: Path = field(default_factory=default_bin_dir)
    k8s_version: str = DEFAULT_K8S_VERSION
    nodes: int = 4
    gpus_per_node: int = 8
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    """The nodes' ``nvidia.com/gpu.product`` label (what NVIDIA's GPU feature discovery sets),
    which the operator's placement by ``gpuType`` selects on: ``h100`` by default."""
    node_cpu: str = "64"
    node_memory: str = "512Gi"
    ports: Ports = field(default_factory=Ports)
    restricted_namespace: str = "slipstream-restricted"
    restricted_service_account: str = "restricted"
    pod_network: str = str(POD_NETWORK)
    """The /16 of the pod IPs (a loopback CIDR), or "auto": derived from ``state_dir``."""
    profiling: bool = False
    """Serve Go's ``/debug/pprof`` on the control plane's secure ports (admin credentials),
    to see where kube-apiserver's CPU goes under load; off, as on a production cluster."""

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ClusterError(f"nodes={self.nodes}: must be between 1 and {MAX_NODES}")
        self.pods_network()  # validates
        if self.gpus_per_node < 0:
            raise ClusterError(f"gpus_per_node={self.gpus_per_node}: must be >= 0")

    def pods_network(self) -> ipaddress.IPv4Network:
        """The pod network this config stands for (``pod_network``, "auto" resolved)."""
        if self.pod_network == AUTO_NETWORK:
            return pod_network_for(self.state_dir)
        try:
            net = ipaddress.IPv4Network(self.pod_network)
        except ValueError as exc:
            raise ClusterError(f"pod_network={self.pod_network!r}: {exc}") from exc
        if net.prefixlen != 16 or not net.subnet_of(LOOPBACK_NETWORK):
            raise ClusterError(f"pod_network={net}: must be a /16 inside {LOOPBACK_NETWORK}")
        if net.overlaps(NODE_NETWORK) or net.overlaps(ipaddress.IPv4Network(SERVICE_NETWORK)):
            raise ClusterError(f"pod_network={net}: overlaps the node or service network")
        return net

    @classmethod
    def from_env(cls, **overrides: Any) -> ClusterConfig:
        """Defaults, then ``SLIPSTREAM_CLUSTER_{NODES,GPUS,PORT_BASE,POD_NETWORK,PROFILING}``,
        then ``overrides``."""
        values: dict[str, Any] = {
            "nodes": _env_int("SLIPSTREAM_CLUSTER_NODES", 4),
            "gpus_per_node": _env_int("SLIPSTREAM_CLUSTER_GPUS", 8),
            "ports": Ports.from_base(_env_int("SLIPSTREAM_CLUSTER_PORT_BASE", None)),
            "profiling": os.environ.get("SLIPSTREAM_CLUSTER_PROFILING", "") in ("1", "true"),
        }
        if os.environ.get("SLIPSTREAM_CLUSTER_POD_NETWORK"):
            values["pod_network"] = os.environ["SLIPSTREAM_CLUSTER_POD_NETWORK"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def fingerprint(self) -> dict[str, Any]:
        data = asdict(self)
        data["state_dir"] = str(self.state_dir)
        data["bin_dir"] = str(self.bin_dir)
        data["networks"] = [str(self.pods_network()), str(NODE_NETWORK), SERVICE_NETWORK]
        # The resolved network is in "networks"; the setting itself is left out so that a
        # cluster started before the setting existed is still reused.
        del data["pod_network"]
        return data


# --------------------------------------------------------------------------------------------
# Node address plan


def pod_network_for(state_dir: Path) -> ipaddress.IPv4Network:
    """A loopback /16 for the pods of the cluster in ``state_dir``: 127.N.0.0/16, N from a hash
    of the resolved path (one of :data:`AUTO_OCTETS`). Two state dirs share a network only by a
    hash collision (about 1 in 240)."""
    digest = hashlib.sha256(str(Path(state_dir).expanduser().resolve()).encode()).digest()
    octet = AUTO_OCTETS[int.from_bytes(digest[:4], "big") % len(AUTO_OCTETS)]
    return ipaddress.IPv4Network(f"127.{octet}.0.0/16")


def node_pod_prefix(nodes: int) -> int:
    """Prefix length of each node's pod CIDR so that ``nodes`` of them fit in a /16."""
    prefix = 24
    while (1 << (prefix - POD_NETWORK.prefixlen)) < nodes:
        prefix += 1
    if prefix > 30:
        raise ClusterError(f"{nodes} nodes do not fit in a /16 pod network")
    return prefix


def node_pod_cidr(index: int, nodes: int,
                  network: ipaddress.IPv4Network = POD_NETWORK) -> ipaddress.IPv4Network:
    subnets = network.subnets(new_prefix=node_pod_prefix(nodes))
    for i, net in enumerate(subnets):
        if i == index:
            return net
    raise ClusterError(f"node index {index} out of range for {nodes} nodes")


def node_ip(index: int) -> ipaddress.IPv4Address:
    return NODE_NETWORK.network_address + index + 1


def gpu_node_manifest(index: int, config: ClusterConfig) -> dict[str, Any]:
    """A kwok-managed Node with GPU capacity, a loopback InternalIP and a loopback pod CIDR."""
    name = f"gpu-node-{index}"
    cidr = node_pod_cidr(index, config.nodes, config.pods_network())
    pods = str(min(110, cidr.num_addresses - 2))
    resources = {
        "cpu": config.node_cpu,
        "memory": config.node_memory,
        "pods": pods,
        "nvidia.com/gpu": str(config.gpus_per_node),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {FAKE_NODE_ANNOTATION: "fake"},
            "labels": {
                FAKE_NODE_LABEL: "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": config.gpu_product,
            },
        },
        "spec": {"podCIDR": str(cidr), "podCIDRs": [str(cidr)]},
        "status": {
            # Both types, or kwok's node-initialize stage rewrites `addresses` to null. The
            # apiserver only ever uses InternalIP (--kubelet-preferred-address-types).
            "addresses": [
                {"type": "InternalIP", "address": str(node_ip(index))},
                {"type": "Hostname", "address": name},
            ],
            "capacity": resources,
            "allocatable": dict(resources),
        },
    }


# --------------------------------------------------------------------------------------------
# PKI


@dataclass(frozen=True)
class Pki:
    directory: Path

    def path(self, name: str) -> Path:
        return self.directory / name

    @property
    def ca_cert(self) -> Path:
        return self.path("ca.crt")


def _write_private(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


def write_pki(directory: Path, service_ip: str) -> Pki:
    """CA, one serving cert for 127.0.0.1 (apiserver, KCM, scheduler), the admin client cert
    (O=system:masters) and the service-account signing key pair."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )

    def name(common: str, org: str | None = None) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common)]
        if org:
            attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("slipstream-local-ca")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def issue(
        subject: x509.Name, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]
    ) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + dt.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
            .add_extension(
                x509.KeyUsage(True, False, True, False, False, False, False, False, False), True
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem(key)

    serving_sans: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address(LOOPBACK)),
        x509.IPAddress(ipaddress.ip_address(service_ip)),
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes"),
        x509.DNSName("kubernetes.default"),
        x509.DNSName("kubernetes.default.svc"),
    ]
    serving = issue(name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, serving_sans)
    admin = issue(name("slipstream-admin", "system:masters"), ExtendedKeyUsageOID.CLIENT_AUTH, [])
    sa_key = ec.generate_private_key(ec.SECP256R1())

    (directory / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(directory / "ca.key", key_pem(ca_key))
    (directory / "serving.crt").write_bytes(serving[0])
    _write_private(directory / "serving.key", serving[1])
    (directory / "admin.crt").write_bytes(admin[0])
    _write_private(directory / "admin.key", admin[1])
    _write_private(directory / "sa.key", key_pem(sa_key))
    (directory / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return Pki(directory)


def kubeconfig(
    server: str, ca_file: Path, user: Mapping[str, str], context: str, namespace: str = "default"
) -> dict[str, Any]:
    """A one-context kubeconfig (written as JSON, which every YAML loader reads)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "slipstream",
                "cluster": {"server": server, "certificate-authority": str(ca_file)},
            }
        ],
        "users": [{"name": context, "user": dict(user)}],
        "contexts": [
            {
                "name": context,
                "context": {"cluster": "slipstream", "user": context, "namespace": namespace},
            }
        ],
        "current-context": context,
    }


def write_json(path: Path, data: Any, private: bool = False) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if private:
        tmp.chmod(0o600)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# A minimal REST client (stdlib only; used for bootstrapping, not as a general client)


class ApiError(ClusterError):
    def __init__(self, method: str, url: str, status: int, body: str) -> None:
        super().__init__(f"{method} {url} -> HTTP {status}: {body[:500]}")
        self.status = status


class Rest:
    def __init__(
        self,
        server: str,
        ca_file: Path,
        cert: tuple[Path, Path] | None = None,
        token: str | None = None,
    ) -> None:
        self.server = server.rstrip("/")
        self.context = ssl.create_default_context(cafile=str(ca_file))
        if cert is not None:
            self.context.load_cert_chain(str(cert[0]), str(cert[1]))
        self.token = token

    def request(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> Any:
        url = self.server + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, context=self.context, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise ApiError(method, url, exc.code, exc.read().decode(errors="replace")) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ClusterError(f"{method} {url}: {exc}") from exc
        return json.loads(raw) if raw else None

    def create(self, path: str, body: Any) -> Any:
        """POST, treating 409 AlreadyExists as success (returns None then)."""
        try:
            return self.request("POST", path, body)
        except ApiError as exc:
            if exc.status == 409:
                return None
            raise


# --------------------------------------------------------------------------------------------
# Processes


def http_get(url: str, context: ssl.SSLContext | None, timeout: float = 3.0) -> tuple[int, str]:
    """GET a URL; (status, body), or (0, error text) when nothing answered."""
    try:
        with urllib.request.urlopen(url, context=context, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def wait_for(
    what: str,
    check: Callable[[], str | None],
    timeout: float,
    on_timeout: Callable[[], str] = lambda: "",
    interval: float = 0.5,
) -> None:
    """Poll ``check`` (None means ready, a string says why not) until ready or timeout."""
    deadline = time.monotonic() + timeout
    reason: str | None = "not checked yet"
    while time.monotonic() < deadline:
        reason = check()
        if reason is None:
            return
        time.sleep(interval)
    raise ClusterError(f"{what} not ready after {timeout:.0f}s: {reason}{on_timeout()}")


def pid_alive(pid: int, binary: Path) -> bool:
    """True if ``pid`` runs ``binary`` (guards against a recycled PID)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state != "Z" and cmdline[0].decode(errors="replace") == str(binary)


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n  | ".join(["", *text[-lines:]]) if text else ""


@dataclass(frozen=True)
class Component:
    name: str
    argv: list[str]
    health_url: str
    ports: tuple[int, ...]


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int | None
    running: bool
    healthy: bool
    detail: str


# --------------------------------------------------------------------------------------------
# The cluster


class LocalCluster:
    """The local control plane in one state dir. ``up()`` is idempotent; ``down()`` stops it
    and removes the state dir."""

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig.from_env()
        self.state_dir = self.config.state_dir
        self.bin_dir = self.config.bin_dir
        self.pki = Pki(self.state_dir / "pki")
        self.log_dir = self.state_dir / "logs"
        self.run_dir = self.state_dir / "run"
        self.admin_kubeconfig = self.state_dir / "admin.kubeconfig"
        self.restricted_kubeconfig = self.state_dir / "restricted.kubeconfig"
        self.server = f"https://{LOOPBACK}:{self.config.ports.apiserver}"

    # ---- public API --------------------------------------------------------------------

    @property
    def kubectl(self) -> Path:
        return self.bin_dir / "kubectl"

    @property
    def helm(self) -> Path:
        return self.bin_dir / "helm"

    @property
    def restricted_namespace(self) -> str:
        return self.config.restricted_namespace

    def up(self, build: bool = True, timeout: float = 180.0) -> LocalCluster:
        """Start the cluster (or reuse a healthy one with the same config); returns self."""
        with self._lock():
            self.ensure_binaries(build)
            if self._reusable():
                LOG.info("reusing the healthy cluster in %s", self.state_dir)
                self._bootstrap(timeout)
                return self
            self._stop_all()
            self._fresh_state()
            started = time.monotonic()
            try:
                for component in self._components():
                    self._start(component)
                    self._wait_healthy(component, timeout)
                    LOG.info("%s healthy after %.1fs", component.name, time.monotonic() - started)
                self._bootstrap(timeout)
            except BaseException:
                # Leave nothing half-started running; the logs stay for the post-mortem.
                self._stop_all()
                raise
            write_json(self.state_dir / "cluster.json", self.config.fingerprint())
            LOG.info("cluster up in %.1fs: %s", time.monotonic() - started, self.admin_kubeconfig)
            return self

    def down(self) -> None:
        """Stop every component by its PID and remove the state dir."""
        with self._lock():
            self._stop_all()
            for child in self.state_dir.iterdir():
                if child.name == ".lock":
                    continue
                if child.is_dir():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        LOG.info("cluster in %s is down", self.state_dir)

    def status(self) -> list[ComponentStatus]:
        result = []
        for component in self._components():
            pid = self._read_pid(component.name)
            running = pid is not None and pid_alive(pid, self._binary(component.name))
            healthy, detail = False, "not running"
            if running:
                code, body = http_get(component.health_url, self._health_context())
                healthy = code == 200
                detail = body.strip().splitlines()[0][:120] if body.strip() else f"HTTP {code}"
            result.append(ComponentStatus(component.name, pid, running, healthy, detail))
        return result

    def healthy(self) -> bool:
        return self.admin_kubeconfig.exists() and all(s.healthy for s in self.status())

    def acquire(self, pid: int | None = None) -> None:
        """Record that process ``pid`` (default: this one) uses the cluster; see ``release``."""
        users = self.state_dir / "users"
        users.mkdir(parents=True, exist_ok=True)
        (users / str(pid or os.getpid())).touch()

    def release(self, pid: int | None = None) -> bool:
        """Drop ``pid``'s claim; True if no live process still claims the cluster, so that two
        pytest sessions sharing one state dir do not stop the cluster under each other."""
        users = self.state_dir / "users"
        with self._lock():
            (users / str(pid or os.getpid())).unlink(missing_ok=True)
            live = []
            for claim in users.glob("*") if users.is_dir() else []:
                if claim.name.isdigit() and Path(f"/proc/{claim.name}").exists():
                    live.append(claim.name)
                else:
                    claim.unlink(missing_ok=True)
        return not live

    def admin_rest(self) -> Rest:
        return Rest(
            self.server,
            self.pki.ca_cert,
            cert=(self.pki.path("admin.crt"), self.pki.path("admin.key")),
        )

    def service_account_kubeconfig(
        self, namespace: str, name: str, path: Path, expiration_seconds: int = 7 * 24 * 3600
    ) -> Path:
        """Create ``namespace``/``name`` if missing, request a token for it (TokenRequest) and
        write a kubeconfig using it to ``path``."""
        rest = self.admin_rest()
        rest.create(
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        )
        rest.create(
            f"/api/v1/namespaces/{namespace}/serviceaccounts",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
        )
        answer = rest.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": expiration_seconds},
            },
        )
        token = str(answer["status"]["token"])
        write_json(
            path,
            kubeconfig(
                self.server, self.pki.ca_cert, {"token": token}, f"{namespace}-{name}", namespace
            ),
            private=True,
        )
        return path

    def ensure_binaries(self, build: bool) -> None:
        missing = [b for b in BINARIES if not (self.bin_dir / b).exists()]
        stages = self.bin_dir / "kwok-stages"
        if not stages.is_dir():
            missing.append("kwok-stages/")
        if not missing:
            return
        script = build_script()
        if not build:
            raise ClusterError(
                f"missing in {self.bin_dir}: {', '.join(missing)}; "
                f"run {script} (or `slipstream cluster build`) first"
            )
        run_build(script, self.config)
        still = [b for b in BINARIES if not (self.bin_dir / b).exists()]
        if still:
            raise ClusterError(
                f"{script} finished but {', '.join(still)} are missing in {self.bin_dir}"
            )

    # ---- state -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with (self.state_dir / ".lock").open("w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _reusable(self) -> bool:
        marker = self.state_dir / "cluster.json"
        if not marker.exists():
            return False
        try:
            saved = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return False
        if saved != json.loads(json.dumps(self.config.fingerprint())):
            LOG.info("cluster in %s was started with other settings; restarting", self.state_dir)
            return False
        return self.healthy()

    def _fresh_state(self) -> None:
        for sub in ("pki", "etcd", "logs", "run", "apiserver-certs"):
            shutil.rmtree(self.state_dir / sub, ignore_errors=True)
        for path in (
            self.state_dir / "cluster.json",
            self.admin_kubeconfig,
            self.restricted_kubeconfig,
        ):
            path.unlink(missing_ok=True)
        for port in self._all_ports():
            if not port_free(port):
                raise ClusterError(
                    f"port {LOOPBACK}:{port} is taken by another process; "
                    "stop it or choose another --port-base"
                )
        self.log_dir.mkdir(parents=True)
        self.run_dir.mkdir(parents=True)
        service_ip = str(ipaddress.IPv4Network(SERVICE_NETWORK).network_address + 1)
        write_pki(self.pki.directory, service_ip)
        write_json(
            self.admin_kubeconfig,
            kubeconfig(
                self.server,
                self.pki.ca_cert,
                {
                    "client-certificate": str(self.pki.path("admin.crt")),
                    "client-key": str(self.pki.path("admin.key")),
                },
                "slipstream-admin",
            ),
            private=True,
        )
        self._write_kwok_config()

    def _write_kwok_config(self) -> None:
        stages = self.bin_dir / "kwok-stages"
        # Stages only. A KwokConfiguration document read from a file is not defaulted by kwok
        # v0.8.0 (it then dies: "node leases parallelism must be greater than 0"), so its
        # options go on the command line instead, on top of the built-in defaults.
        docs = []
        for stage in KWOK_STAGES:
            path = stages / stage
            if not path.exists():
                raise ClusterError(f"kwok stage {path} missing; rerun hack/cluster/build.sh kwok")
            docs.append(path.read_text(encoding="utf-8"))
        (self.state_dir / "kwok.yaml").write_text("\n---\n".join(docs), encoding="utf-8")

    def _all_ports(self) -> list[int]:
        return [p for c in self._components() for p in c.ports]

    # ---- components --------------------------------------------------------------------

    def _binary(self, name: str) -> Path:
        return self.bin_dir / name

    def _components(self) -> list[Component]:
        ports, pki, state = self.config.ports, self.pki, self.state_dir
        admin = str(self.admin_kubeconfig)
        profiling = f"--profiling={str(self.config.profiling).lower()}"
        etcd_url = f"http://{LOOPBACK}:{ports.etcd_client}"
        peer_url = f"http://{LOOPBACK}:{ports.etcd_peer}"
        serving = [
            f"--tls-cert-file={pki.path('serving.crt')}",
            f"--tls-private-key-file={pki.path('serving.key')}",
        ]
        delegated = [
            f"--kubeconfig={admin}",
            f"--authentication-kubeconfig={admin}",
            f"--authorization-kubeconfig={admin}",
            f"--bind-address={LOOPBACK}",
            "--leader-elect=false",
            *serving,
        ]
        return [
            Component(
                "etcd",
                [
                    str(self._binary("etcd")),
                    "--name=slipstream",
                    f"--data-dir={state / 'etcd'}",
                    f"--listen-client-urls={etcd_url}",
                    f"--advertise-client-urls={etcd_url}",
                    f"--listen-peer-urls={peer_url}",
                    f"--initial-advertise-peer-urls={peer_url}",
                    f"--initial-cluster=slipstream={peer_url}",
                    "--unsafe-no-fsync=true",
                    "--auto-compaction-retention=1",
                    "--quota-backend-bytes=2147483648",
                    "--log-level=warn",
                ],
                f"{etcd_url}/health",
                (ports.etcd_client, ports.etcd_peer),
            ),
            Component(
                "kube-apiserver",
                [
                    str(self._binary("kube-apiserver")),
                    f"--etcd-servers={etcd_url}",
                    f"--bind-address={LOOPBACK}",
                    f"--secure-port={ports.apiserver}",
                    f"--advertise-address={LOOPBACK}",
                    "--endpoint-reconciler-type=none",
                    *serving,
                    f"--cert-dir={state / 'apiserver-certs'}",
                    f"--client-ca-file={pki.ca_cert}",
                    f"--service-account-issuer={self.server}",
                    f"--service-account-signing-key-file={pki.path('sa.key')}",
                    f"--service-account-key-file={pki.path('sa.pub')}",
                    "--authorization-mode=Node,RBAC",
                    f"--service-cluster-ip-range={SERVICE_NETWORK}",
                    "--allow-privileged=true",
                    "--kubelet-preferred-address-types=InternalIP",
                    profiling,
                ],
                f"{self.server}/readyz",
                (ports.apiserver,),
            ),
            Component(
                "kube-controller-manager",
                [
                    str(self._binary("kube-controller-manager")),
                    *delegated,
                    f"--secure-port={ports.controller_manager}",
                    f"--service-account-private-key-file={pki.path('sa.key')}",
                    f"--root-ca-file={pki.ca_cert}",
                    f"--cluster-signing-cert-file={pki.ca_cert}",
                    f"--cluster-signing-key-file={pki.path('ca.key')}",
                    f"--service-cluster-ip-range={SERVICE_NETWORK}",
                    # Endpoints and EndpointSlices refuse loopback pod IPs, so these
                    # controllers can only fail, retry and post a Warning event, for every
                    # Service, for ever: at 1,000 nodes about 20 writes and 38 events a
                    # second of the API server's time. Nothing here routes a Service anyway.
                    "--controllers=*," + ",".join(f"-{c}" for c in NO_CONTROLLERS),
                    profiling,
                ],
                f"https://{LOOPBACK}:{ports.controller_manager}/healthz",
                (ports.controller_manager,),
            ),
            Component(
                "kube-scheduler",
                [
                    str(self._binary("kube-scheduler")),
                    *delegated,
                    f"--secure-port={ports.scheduler}",
                    profiling,
                ],
                f"https://{LOOPBACK}:{ports.scheduler}/healthz",
                (ports.scheduler,),
            ),
            Component(
                "kwok",
                [
                    str(self._binary("kwok")),
                    f"--kubeconfig={admin}",
                    f"--config={state / 'kwok.yaml'}",
                    "--manage-all-nodes=false",
                    f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}=fake",
                    "--manage-nodes-with-label-selector=",
                    "--manage-single-node=",
                    f"--cidr={self.config.pods_network()}",
                    f"--node-ip={node_ip(0)}",
                    "--node-lease-duration-seconds=40",
                    f"--server-address={LOOPBACK}:{ports.kwok}",
                ],
                f"http://{LOOPBACK}:{ports.kwok}/healthz",
                (ports.kwok,),
            ),
        ]

    def _pid_file(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    def _read_pid(self, name: str) -> int | None:
        try:
            return int(self._pid_file(name).read_text().strip())
        except (OSError, ValueError):
            return None

    def _start(self, component: Component) -> None:
        log_path = self.log_dir / f"{component.name}.log"
        env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "KUBECONFIG"):
            env.pop(var, None)
        LOG.info("starting %s (log: %s)", component.name, log_path)
        pid = spawn_detached(component.argv, log_path, self.state_dir, env)
        self._pid_file(component.name).write_text(f"{pid}\n")
        # Until the child has exec'd, /proc/PID/cmdline still shows the shell that forked it.
        binary = self._binary(component.name)
        deadline = time.monotonic() + 10
        while not pid_alive(pid, binary):
            if not Path(f"/proc/{pid}").exists():
                return  # exited at once: _wait_healthy reports it with the log's tail
            if time.monotonic() > deadline:
                raise ClusterError(f"{component.name} (pid {pid}) did not exec {binary}")
            time.sleep(0.01)

    def _health_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.pki.ca_cert))

    def _wait_healthy(self, component: Component, timeout: float) -> None:
        binary = self._binary(component.name)
        context = self._health_context()
        log_path = self.log_dir / f"{component.name}.log"

        def check() -> str | None:
            pid = self._read_pid(component.name)
            if pid is None or not pid_alive(pid, binary):
                raise ClusterError(
                    f"{component.name} exited during start-up; "
                    f"last lines of {log_path}:{tail(log_path)}"
                )
            code, body = http_get(component.health_url, context)
            return None if code == 200 else f"{component.health_url}: {code} {body[:200]}"

        wait_for(
            component.name, check, timeout, lambda: f"\nlast lines of {log_path}:{tail(log_path)}"
        )

    def _stop_all(self) -> None:
        for name in reversed(COMPONENT_ORDER):
            pid = self._read_pid(name)
            if pid is not None and pid_alive(pid, self._binary(name)):
                stop_process(name, pid, self._binary(name))
            self._pid_file(name).unlink(missing_ok=True)

    # ---- bootstrap: nodes, restricted identity -----------------------------------------

    def _bootstrap(self, timeout: float) -> None:
        rest = self.admin_rest()
        self._create_nodes(rest)
        self._wait_nodes_ready(rest, timeout)
        self._wait_default_service_account(rest, "default", timeout)
        self._create_restricted_identity(rest)

    def _create_nodes(self, rest: Rest) -> None:
        started = time.monotonic()
        manifests = [gpu_node_manifest(i, self.config) for i in range(self.config.nodes)]
        # A few requests in flight: 1,000 sequential POSTs spend most of their time waiting.
        with ThreadPoolExecutor(max_workers=8) as pool:
            for _ in pool.map(lambda m: rest.create("/api/v1/nodes", m), manifests):
                pass
        LOG.info("%d fake GPU nodes created in %.1fs", len(manifests), time.monotonic() - started)

    def _wait_nodes_ready(self, rest: Rest, timeout: float) -> None:
        want = self.config.nodes

        def check() -> str | None:
            nodes = rest.request("GET", f"/api/v1/nodes?labelSelector={FAKE_NODE_LABEL}%3Dkwok")
            ready = sum(1 for n in nodes["items"] if _condition(n, "Ready") == "True")
            return None if ready >= want else f"{ready}/{want} fake nodes Ready"

        kwok_log = self.log_dir / "kwok.log"
        wait_for(
            "fake GPU nodes",
            check,
            timeout + want * 0.1,
            lambda: f"\nlast lines of {kwok_log}:{tail(kwok_log)}",
        )

    def _wait_default_service_account(self, rest: Rest, namespace: str, timeout: float) -> None:
        def check() -> str | None:
            try:
                rest.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default")
            except ApiError as exc:
                return str(exc)
            return None

        wait_for(
            f"serviceaccount {namespace}/default (created by kube-controller-manager)",
            check,
            timeout,
        )

    def _create_restricted_identity(self, rest: Rest) -> None:
        ns, sa = self.config.restricted_namespace, self.config.restricted_service_account
        self.service_account_kubeconfig(ns, sa, self.restricted_kubeconfig)
        rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}"
        rest.create(
            f"{rbac}/roles",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": sa},
                "rules": RESTRICTED_ROLE_RULES,
            },
        )
        rest.create(
            f"{rbac}/rolebindings",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": sa},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
                "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
            },
        )


def _condition(obj: Mapping[str, Any], kind: str) -> str | None:
    for cond in obj.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == kind:
            return str(cond.get("status"))
    return None


def spawn_detached(argv: list[str], log_path: Path, cwd: Path, env: Mapping[str, str]) -> int:
    """Start ``argv`` in the background, detached from this process; return its PID.

    A short-lived ``sh`` forks it and exits, so the component is re-parented to init: it is
    never this process's child (no zombie, no ``Popen`` still-running warning when the cluster
    outlives the Python process that started it, as with ``SLIPSTREAM_KEEP_CLUSTER=1``).
    """
    script = 'log=$1; shift; "$@" </dev/null >>"$log" 2>&1 & echo $!'
    result = subprocess.run(
        ["sh", "-c", script, "sh", str(log_path), *argv],
        cwd=cwd,
        env=dict(env),
        capture_output=True,
        text=True,
        check=False,
        start_new_session=True,
    )
    if result.returncode != 0 or not result.stdout.strip().isdigit():
        raise ClusterError(f"could not start {argv[0]}: {result.stderr.strip() or result.stdout}")
    return int(result.stdout.strip())


def stop_process(name: str, pid: int, binary: Path, grace: float = 15.0) -> None:
    """SIGTERM the component, then SIGKILL after ``grace`` seconds."""
    LOG.info("stopping %s (pid %d)", name, pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not pid_alive(pid, binary):
            return
        time.sleep(0.2)
    LOG.warning("%s (pid %d) ignored SIGTERM for %.0fs; killing", name, pid, grace)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------
# Building


def build_script() -> Path:
    """hack/cluster/build.sh of the source checkout this module lives in."""
    script = Path(__file__).resolve().parents[2] / "hack" / "cluster" / "build.sh"
    if not script.exists():
        raise ClusterError(
            f"{script} not found: the cluster binaries are built from a "
            "source checkout of slipstream"
        )
    return script


def run_build(script: Path, config: ClusterConfig, targets: list[str] | None = None) -> None:
    env = {
        **os.environ,
        "K8S_VERSION": config.k8s_version,
        "SLIPSTREAM_BIN_DIR": str(config.bin_dir),
    }
    LOG.warning(
        "building the control plane binaries into %s (first run only; a cold build "
        "takes tens of minutes on 2 cores)",
        config.bin_dir,
    )
    result = subprocess.run(["bash", str(script), *(targets or [])], env=env, check=False)
    if result.returncode != 0:
        raise ClusterError(f"{script} failed with exit code {result.returncode}")


# --------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start the cluster (build binaries first if needed)")
    up.add_argument("--nodes", type=int, help=f"fake GPU nodes (default 4, max {MAX_NODES})")
    up.add_argument("--gpus-per-node", type=int, help="nvidia.com/gpu per node (default 8)")
    up.add_argument("--no-build", action="store_true", help="fail instead of building")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds per start-up step")
    up.add_argument("--pod-network",
                    help="loopback /16 of the pod IPs, or 'auto': derived from the state dir "
                    "(default $SLIPSTREAM_CLUSTER_POD_NETWORK or 127.1.0.0/16)")
    sub.add_parser("down", help="stop the cluster and remove its state dir")
    sub.add_parser("status", help="health of each component")
    kc = sub.add_parser("kubeconfig", help="print the admin kubeconfig path")
    kc.add_argument(
        "--restricted",
        action="store_true",
        help="print the restricted service account's kubeconfig path instead",
    )
    build = sub.add_parser("build", help="build/fetch the binaries (hack/cluster/build.sh)")
    build.add_argument("targets", nargs="*", help="k8s, etcd, kwok, tools (default: all)")
    for p in sub.choices.values():
        p.add_argument(
            "--state-dir",
            type=Path,
            help="default $SLIPSTREAM_CLUSTER_DIR or ~/.cache/slipstream/cluster",
        )
        p.add_argument(
            "--bin-dir",
            type=Path,
            help="default $SLIPSTREAM_BIN_DIR or ~/.cache/slipstream/bin/k8s-<version>",
        )
        p.add_argument(
            "--port-base",
            type=int,
            help="use ports BASE..BASE+5 instead of 2379/2380/6443/10257/10259/10247",
        )


def _config_from_args(args: argparse.Namespace) -> ClusterConfig:
    overrides: dict[str, Any] = {
        "state_dir": getattr(args, "state_dir", None),
        "bin_dir": getattr(args, "bin_dir", None),
        "nodes": getattr(args, "nodes", None),
        "gpus_per_node": getattr(args, "gpus_per_node", None),
        "pod_network": getattr(args, "pod_network", None),
    }
    if getattr(args, "port_base", None) is not None:
        overrides["ports"] = Ports.from_base(args.port_base)
    return ClusterConfig.from_env(**overrides)


def _print_status(cluster: LocalCluster) -> int:
    statuses = cluster.status()
    for s in statuses:
        state = "healthy" if s.healthy else ("running" if s.running else "stopped")
        pid = str(s.pid) if s.pid is not None else "-"
        print(f"{s.name:<24} {state:<8} pid={pid:<8} {s.detail}")
    if all(s.healthy for s in statuses):
        nodes = cluster.admin_rest().request(
            "GET", f"/api/v1/nodes?labelSelector={FAKE_NODE_LABEL}%3Dkwok"
        )["items"]
        ready = sum(1 for n in nodes if _condition(n, "Ready") == "True")
        print(f"{'fake GPU nodes':<24} {ready}/{len(nodes)} Ready")
        print(f"{'admin kubeconfig':<24} {cluster.admin_kubeconfig}")
        return 0
    return 1


def run(args: argparse.Namespace) -> int:
    try:
        config = _config_from_args(args)
        cluster = LocalCluster(config)
        action = args.cluster_command
        if action == "up":
            started = time.monotonic()
            cluster.up(build=not args.no_build, timeout=args.timeout)
            print(f"cluster up in {time.monotonic() - started:.1f}s")
            print(f"export KUBECONFIG={cluster.admin_kubeconfig}")
            print(
                f"restricted ({config.restricted_namespace}/"
                f"{config.restricted_service_account}): {cluster.restricted_kubeconfig}"
            )
            print(f"kubectl: {cluster.kubectl}   helm: {cluster.helm}")
            return 0
        if action == "down":
            cluster.down()
            return 0
        if action == "status":
            return _print_status(cluster)
        if action == "kubeconfig":
            path = cluster.restricted_kubeconfig if args.restricted else cluster.admin_kubeconfig
            if not path.exists():
                print(f"{path} does not exist: run `slipstream cluster up`", file=sys.stderr)
                return 1
            print(path)
            return 0
        if action == "build":
            run_build(build_script(), config, list(args.targets))
            return 0
        raise ClusterError(f"unknown action {action!r}")
    except ClusterError as exc:
        LOG.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slipstream_testbed.cluster", description=__doc__.splitlines()[0]
    )
    parser.add_argument("-v", "--verbose", action="count", default=1)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
