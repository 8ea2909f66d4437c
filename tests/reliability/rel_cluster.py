"""Cluster-level pieces of the reliability tests: kubectl, pods with real processes, inputs.

``start_world`` brings up, in a fresh namespace of a local cluster, the operator as a process
(with the admin kubeconfig or any other, e.g. a service account's), the ``chat``
InferenceService of ``examples/``, and for each of its two pods a real engine model and a real
sidecar bound to the pod's loopback IP (ports 8000/9000, the control token from the
operator's Secret). ``mmlu_job_input`` writes an OpenAI Batch input of real 5-shot MMLU
questions.

Deliberately left out: faults (``slipstream_testbed.faults``) and assertions.
"""

from __future__ import annotations

import base64
import csv
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, config

from integration.helpers_procs import MODEL, SLIPSTREAM, Proc, engine_proc
from slipstream_testbed.cluster import LocalCluster

REPO = Path(__file__).resolve().parents[2]
# Prompts longer than this (about 600 tokens) are left out of fault-injection jobs: with the
# operator's budget for the example SLOs (about 54 ms per iteration) the sidecar never admits an
# offline request whose whole prefill is predicted to exceed the budget, so such a job stalls
# with or without faults (docs/reliability.md, test_burst_sim.py).
MAX_PROMPT_CHARS = 2500
T = TypeVar("T")


def port_free(host: str, port: int) -> bool:
    """Nobody listens on ``host:port`` (SO_REUSEADDR: recent connections in TIME_WAIT are fine,
    as they are for the servers, which set it too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def kubectl(cluster: LocalCluster, *args: str, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KUBECONFIG=str(cluster.admin_kubeconfig))
    return subprocess.run([str(cluster.kubectl), *args], env=env, capture_output=True,
                          text=True, check=check, timeout=timeout)


def eventually(what: str, probe: Callable[[], T | None], timeout: float = 120.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = probe()
        except (subprocess.SubprocessError, client.ApiException, OSError):
            value = None  # the API server may be restarting
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.5)


def cleanup_namespace(cluster: LocalCluster, namespace: str) -> None:
    """Delete ``namespace`` even when no operator is left to remove its objects' finalizers."""
    kinds = "offlinejobs.slipstream.dev,inferenceservices.slipstream.dev"
    kubectl(cluster, "delete", "-n", namespace, kinds, "--all", "--wait=false", check=False)
    names = kubectl(cluster, "get", "-n", namespace, kinds, "-o", "name", check=False)
    for obj in names.stdout.split():
        kubectl(cluster, "patch", "-n", namespace, obj, "--type=merge",
                "-p", '{"metadata":{"finalizers":[]}}', check=False)
    kubectl(cluster, "delete", "namespace", namespace, "--wait=false", check=False)


# -- processes ----------------------------------------------------------------------------------


@dataclass
class PodProc(Proc):
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class Launched:
    """A process started without a readiness URL (the operator)."""

    args: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Launched:
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=REPO, start_new_session=True)
        return self

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Pod:
    ip: str
    engine: Proc
    sidecar: PodProc


@dataclass
class World:
    cluster: LocalCluster
    namespace: str
    tmp: Path
    operator: Launched
    pods: list[Pod] = field(default_factory=list)

    def stop(self) -> None:
        for pod in self.pods:
            pod.sidecar.stop()
            pod.engine.stop()
        self.operator.stop()


def start_world(cluster: LocalCluster, namespace: str, tmp: Path,
                operator_kubeconfig: Path | None = None, create_namespace: bool = True,
                operator_args: tuple[str, ...] = ()) -> World:
    if create_namespace:
        kubectl(cluster, "create", "namespace", namespace)
    kubeconfig = operator_kubeconfig or cluster.admin_kubeconfig
    operator = Launched(
        [*SLIPSTREAM, "-v", "operator", "--kubeconfig", str(kubeconfig),
         "-n", namespace, "--loopback-only", "--interval", "1", "--window", "30",
         "--stall-timeout", "20", *operator_args],
        tmp / "operator.log",
    ).start()
    world = World(cluster, namespace, tmp, operator)
    service = REPO / "examples" / "inferenceservice.yaml"
    kubectl(cluster, "apply", "-n", namespace, "-f", str(service))
    api = config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(cluster.admin_kubeconfig)
    )
    core = client.CoreV1Api(api)

    def running() -> list[str] | None:
        pods = core.list_namespaced_pod(namespace, label_selector="slipstream.dev/service=chat")
        ips = sorted(p.status.pod_ip for p in pods.items
                     if p.status and p.status.phase == "Running" and p.status.pod_ip)
        return ips if len(ips) == 2 else None

    def token() -> str | None:
        secret = core.read_namespaced_secret("chat-control-token", namespace)
        raw = (secret.data or {}).get("token")
        return base64.b64decode(raw).decode() if raw else None

    try:
        ips = eventually("two running pods", running)
        (tmp / "token").write_text(eventually("the control token", token))
        api.close()
        for i, ip in enumerate(ips):
            assert ip.startswith(("127.1.118.", "127.1.119.")), f"pod IP {ip}: not our nodes"
            for port in (8000, 9000):
                assert port_free(ip, port), f"{ip}:{port} is taken by another test's process"
            engine = engine_proc(tmp, name=f"engine-{i}", seed=i, mean_output_tokens=16,
                                 max_num_seqs=64).start()
            sidecar = PodProc(
                f"sidecar-{i}",
                [*SLIPSTREAM, "sidecar", "--engine", engine.url, "--host", ip,
                 "--http-port", "8000", "--grpc-port", "9000",
                 "--auth-token-file", str(tmp / "token"), "--state-dir",
                 str(tmp / f"state-{i}"), "--max-num-seqs", "64", "--kv-blocks", "4096",
                 "--online-prompt-tokens", "estimate"],
                tmp / f"sidecar-{i}.log", 8000, host=ip,
            )
            world.pods.append(Pod(ip, engine, sidecar))  # stopped by world.stop() from here on
            sidecar.start()
    except BaseException:
        world.stop()
        raise
    return world


# -- workloads ----------------------------------------------------------------------------------


def mmlu_job_input(shared_data: Path, path: Path, n: int) -> list[str]:
    """``n`` 5-shot MMLU questions, subjects interleaved (each subject shares its prefix)."""
    per_subject: list[list[dict[str, Any]]] = []
    for test in sorted((shared_data / "mmlu" / "test").glob("*_test.csv")):
        subject = test.name[: -len("_test.csv")]
        with open(shared_data / "mmlu" / "dev" / f"{subject}_dev.csv", encoding="utf-8") as f:
            prefix = "".join(f"{r['question']}\nAnswer: {r['answer']}\n\n"
                             for r in csv.DictReader(f))
        with open(test, encoding="utf-8") as f:
            per_subject.append([
                {"custom_id": f"{subject}-{i}", "method": "POST", "url": "/v1/completions",
                 "body": {"model": MODEL, "prompt": prefix + row["question"] + "\nAnswer:",
                          "max_tokens": 2}}
                for i, row in enumerate(csv.DictReader(f))
                if len(prefix) + len(row["question"]) <= MAX_PROMPT_CHARS
            ])
    lines: list[str] = []
    i = 0
    while len(lines) < n:
        added = False
        for rows in per_subject:
            if i < len(rows) and len(lines) < n:
                lines.append(json.dumps(rows[i]))
                added = True
        if not added:
            raise AssertionError(f"MMLU has fewer than {n} test questions")
        i += 1
    path.write_text("".join(line + "\n" for line in lines))
    return [json.loads(line)["custom_id"] for line in lines]


