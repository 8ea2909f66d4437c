"""docs/install.md's step-by-step path, run as written, on the local cluster with real vLLM.

The blocks of the page marked ``<!-- e2e: NAME -->`` are extracted and run with ``bash`` in
this checkout (``charts/slipstream`` is the chart), with ``kubectl`` and ``helm`` of the local
cluster on ``PATH``. Three things are substituted, each a stand-in the page names:

* the namespaces ``slipstream-system`` and ``llm`` get names of this test's own;
* ``/data/jobs`` is a folder of this host: the job storage's claims bind to ``hostPath``
  volumes of that folder, mounted at the same path, so the operator and the pods see one file
  system at one path, as they would on NFS;
* the ``models`` claim binds to a ``hostPath`` volume holding the tiny model (built from a
  seed) as ``Llama-2-7b-hf``: what the page's ``pvc://models/Llama-2-7b-hf`` loads.

The local cluster's nodes are kwok nodes labelled as H100s. The pod runner
(:mod:`slipstream_testbed.podrunner`) runs the chart's operator pod (with its service
account's token: the chart's RBAC) and the service's pod as real ``vllm serve`` (CPU) with
Slipstream's plugin and a real sidecar, each with its volumes and environment as the API
serves them. Checked: the pod loads the model from the claim; a copy of the service asking for
an A100 stays Pending with the scheduler's reason; the chart's NetworkPolicy in the tenant's
namespace selects the pod and admits vLLM's port, the one the Service sends online traffic
to (no CNI enforces it here: the policy is read, not exercised); online requests are served;
the job ends Succeeded with every ``custom_id`` once; ``kubectl get slipstream`` shows the
service's SLO status and the job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.test_chart_install import adopt_crds
from integration.helpers_procs import eventually, http_ok
from slipstream_testbed.cluster import LocalCluster
from slipstream_testbed.podrunner import PodRunner, RunningPod

pytestmark = [pytest.mark.vllm, pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "install.md"
SAMPLE = REPO / "examples" / "data" / "offline-sample.jsonl"
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
JOB_LINES = 24


def page_blocks(page: Path) -> dict[str, str]:
    """The page's fenced blocks marked ``<!-- e2e: NAME -->`` on the line before, by name."""
    text = page.read_text()
    blocks = dict(re.findall(r"<!-- e2e: ([\w-]+) -->\n```[\w]*\n(.*?)\n```", text, re.S))
    assert {"claims", "install", "service", "job", "watch"} <= blocks.keys(), sorted(blocks)
    return blocks


class Page:
    """Runs the page's blocks with this test's substitutions."""

    def __init__(self, cluster: LocalCluster, system: str, tenant: str, jobs: Path) -> None:
        self.blocks = page_blocks(PAGE)
        self.system, self.tenant, self.jobs = system, tenant, jobs
        bins = {Path(str(cluster.kubectl)).parent, Path(str(cluster.helm)).parent}
        self.env = dict(os.environ, KUBECONFIG=str(cluster.admin_kubeconfig),
                        PATH=os.pathsep.join([*map(str, sorted(bins)), os.environ["PATH"]]))

    def text(self, name: str) -> str:
        block = self.blocks[name].replace("slipstream-system", self.system)
        block = re.sub(r"\bllm\b", self.tenant, block)
        return block.replace("/data/jobs", str(self.jobs))

    def run(self, name: str) -> str:
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", self.text(name)], cwd=REPO,
                             env=self.env, capture_output=True, text=True, timeout=900,
                             check=False)
        assert out.returncode == 0, f"block {name!r} failed:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    def kubectl(self, *args: str, check: bool = True) -> str:
        out = subprocess.run(["kubectl", *args], env=self.env, capture_output=True, text=True,
                             timeout=120, check=False)
        assert out.returncode == 0 or not check, f"kubectl {' '.join(args)}: {out.stderr}"
        return out.stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))


@pytest.fixture
def where(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """(release namespace, tenant namespace, job folder). The job folder is the mount path
    too, and the chart refuses one under /tmp: it lives in the user's cache."""
    tag = uuid.uuid4().hex[:6]
    jobs = Path.home() / ".cache" / "slipstream" / "install-e2e" / tag / "jobs"
    jobs.mkdir(parents=True)
    yield f"ss-system-{tag}", f"llm-{tag}", jobs
    shutil.rmtree(jobs.parent, ignore_errors=True)


@pytest.fixture
def runner(cluster: LocalCluster, admin_api: client.ApiClient,
           tmp_path: Path) -> Iterator[PodRunner]:
    pods = PodRunner(admin_api, tmp_path / "pods", engine="vllm", restart_backoff_s=2.0,
                     service_account_kubeconfig=cluster.service_account_kubeconfig)
    with pods.running(interval_s=0.5, join_s=90):
        yield pods


def stand_in_volumes(core: client.CoreV1Api, system: str, tenant: str, jobs: Path,
                     models: Path) -> list[str]:
    """hostPath PersistentVolumes reserved for the page's three claims (what a storage class
    would provision): the weights, and the job folder for both namespaces' ``jobs``."""
    names = []
    for namespace, claim, folder, mode in ((tenant, "models", models, "ReadOnlyMany"),
                                           (tenant, "jobs", jobs, "ReadWriteMany"),
                                           (system, "jobs", jobs, "ReadWriteMany")):
        name = f"{namespace}-{claim}"
        core.create_persistent_volume({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
            "spec": {"capacity": {"storage": "500Gi"}, "accessModes": [mode],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     "claimRef": {"namespace": namespace, "name": claim},
                     "hostPath": {"path": str(folder), "type": "Directory"}}})
        names.append(name)
    return names


def admits(policy: dict[str, Any], pod: dict[str, Any], port: int) -> bool:
    """Whether ``policy`` selects ``pod`` and lets any source reach TCP ``port`` on it."""
    want = policy["spec"].get("podSelector", {}).get("matchLabels", {})
    labels = pod["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in want.items()):
        return False
    return any(not rule.get("from") and any(
        p.get("port") == port and p.get("protocol", "TCP") == "TCP" for p in rule["ports"])
        for rule in policy["spec"].get("ingress") or [])


def job_input(path: Path) -> set[str]:
    """The first ``JOB_LINES`` lines of the shipped MMLU sample, for the page's model."""
    lines = []
    for raw in SAMPLE.read_text().splitlines()[:JOB_LINES]:
        record = json.loads(raw)
        record["body"]["model"] = "llama-2-7b"
        lines.append(json.dumps(record))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return {json.loads(line)["custom_id"] for line in lines}


def chat(url: str, i: int) -> bool:
    body = json.dumps({"model": "llama-2-7b", "max_tokens": 8,
                       "messages": [{"role": "user", "content": f"hello {i}"}]}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with OPENER.open(req, timeout=120) as r:
            return bool(json.loads(r.read())["choices"][0]["message"]["content"] is not None)
    except OSError:
        return False


def test_install_md_step_by_step_on_the_local_cluster(
    cluster: LocalCluster, admin_api: client.ApiClient, runner: PodRunner, tmp_path: Path,
    tiny_model: Path, where: tuple[str, str, Path],
) -> None:
    system, tenant, jobs = where
    page = Page(cluster, system, tenant, jobs)
    core = client.CoreV1Api(admin_api)
    models = tmp_path / "models"
    shutil.copytree(tiny_model, models / "Llama-2-7b-hf")
    volumes = stand_in_volumes(core, system, tenant, jobs, models)
    installed = False
    try:
        page.run("claims")
        adopt_crds(cluster, "slipstream", system)  # CRDs an earlier test applied
        installed = True
        page.run("install")
        page.run("service")

        # The pod runs real vLLM on the weights from the claim, with the plugin.
        def serving() -> RunningPod | None:
            for pod in runner.snapshot():
                if (pod.kind == "inference" and pod.namespace == tenant
                        and http_ok(f"http://{pod.ip}:{pod.http_port}/ready")
                        and http_ok(f"http://{pod.ip}:{pod.engine_port}/health")):
                    return pod
            return None

        pod = eventually("the service's pod serving", serving, 600, 1.0)
        engine = pod.processes[0]
        assert pod.engine_mode and engine.name == "engine"
        assert str(models / "Llama-2-7b-hf") in engine.argv, engine.argv
        operator = eventually("the chart's operator pod running", lambda: next(
            (p for p in runner.snapshot() if p.kind == "operator" and p.namespace == system),
            None), 120, 1.0)
        assert operator.processes[0].alive()

        # Engine mode through the NetworkPolicy: the Service sends online traffic to vLLM's
        # port, and the chart's policy in the tenant's namespace admits it to the pod.
        svc = page.get("-n", tenant, "service", "chat")
        assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["engine"]
        live = page.get("-n", tenant, "pod", pod.name)
        ports = {p["name"]: p["containerPort"] for c in live["spec"]["containers"]
                 for p in c.get("ports") or []}
        policies = page.get("-n", tenant, "networkpolicy")["items"]
        assert any(admits(np, live, ports["engine"]) for np in policies), policies
        url = f"http://{pod.ip}:{pod.engine_port}"
        assert all(chat(url, i) for i in range(8))

        # A copy of the service asking for an A100, which no node has, stays Pending with the
        # scheduler's reason.
        a100 = page.text("service").replace("name: chat\n", "name: chat-a100\n").replace(
            "gpuType: h100", "gpuType: a100")
        a100 = a100.split("kubectl -n")[0]  # the apply, not the wait
        subprocess.run(["bash", "-euo", "pipefail", "-c", a100], env=page.env, cwd=REPO,
                       check=True, capture_output=True, timeout=120)

        def unschedulable() -> str | None:
            events = page.get("-n", tenant, "events",
                              "--field-selector", "reason=FailedScheduling")["items"]
            msgs = [e["message"] for e in events
                    if e["involvedObject"]["name"].startswith("chat-a100-")]
            return msgs[0] if msgs else None

        reason = eventually("FailedScheduling for the A100 copy", unschedulable, 180, 1.0)
        assert "didn't match Pod's node affinity/selector" in reason, reason
        pending = page.get("-n", tenant, "pods", "-l", "slipstream.dev/service=chat-a100")
        assert [p["status"]["phase"] for p in pending["items"]] == ["Pending"]
        page.kubectl("delete", "-n", tenant, "inferenceservices.slipstream.dev", "chat-a100")

        # The job, on the storage the operator and the pod share.
        ids = job_input(jobs / tenant / "first-batch.jsonl")
        page.run("job")

        def finished() -> dict[str, Any] | None:
            status = page.get("-n", tenant, "offlinejobs.slipstream.dev",
                              "first-batch").get("status") or {}
            return status if status.get("phase") in ("Succeeded", "Failed") else None

        traffic = threading.Event()

        def online() -> None:  # online traffic while the job runs, for the SLO status
            i = 0
            while not traffic.is_set():
                chat(url, i)
                i += 1

        talker = threading.Thread(target=online, daemon=True)
        talker.start()
        try:
            status = eventually("the job to finish", finished, 900, 2.0)

            def observed() -> dict[str, Any] | None:
                st = page.get("-n", tenant, "inferenceservices.slipstream.dev",
                              "chat").get("status") or {}
                conds = {c["type"]: c for c in st.get("conditions") or []}
                judged = conds.get("SLOMet", {}).get("reason") not in (None,
                                                                      "InsufficientSamples")
                return st if (st.get("observed") or {}).get("ttftP99") and judged else None

            service = eventually("SLO status on the service", observed, 300, 2.0)
        finally:
            traffic.set()
            talker.join(timeout=150)
        assert status["phase"] == "Succeeded", status
        out = jobs / tenant / "first-batch.out.jsonl"
        got = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
        assert sorted(got) == sorted(ids) and len(got) == len(set(got)), got

        table = page.run("watch")
        rows = {line.split()[0]: line for line in table.splitlines() if line.strip()}
        chat_row = next(v for k, v in rows.items() if k.endswith("/chat"))
        job_row = next(v for k, v in rows.items() if k.endswith("/first-batch"))
        # The columns as kubectl prints them (the values move with the operator's window, so
        # the row is read, not compared with the status read before it).
        header = table.splitlines()[0].split()
        row = dict(zip(header, chat_row.split(), strict=True))
        assert row["SLO"] not in ("<none>", "InsufficientSamples"), table
        assert re.fullmatch(r"[\d.]+(ms|s)", row["TTFT-P99"]), table
        assert service["observed"]["ttftP99"], service
        assert "Succeeded" in job_row, table
        print(f"\n{table}")
    finally:
        if installed:
            page.kubectl("delete", "-n", tenant, "offlinejobs.slipstream.dev", "--all",
                         "--wait=false", check=False)
            page.kubectl("delete", "-n", tenant, "inferenceservices.slipstream.dev", "--all",
                         "--timeout=120s", check=False)
            subprocess.run(["helm", "uninstall", "slipstream", "-n", system], env=page.env,
                           capture_output=True, timeout=300, check=False)
        for name in volumes:
            page.kubectl("delete", "pv", name, "--wait=false", check=False)
        for ns in (tenant, system):
            page.kubectl("delete", "namespace", ns, "--wait=false", check=False)
