"""Engine mode end to end: the operator on the local cluster, real ``vllm serve`` with
Slipstream's scheduler plugin in the pod, online traffic straight to vLLM's port.

The InferenceService asks for ``scheduling.enforcement: engine``. The operator renders the
vLLM container with ``--scheduler-cls`` and the engine channel's ``emptyDir``, and the Service
targets vLLM's port. :class:`slipstream_testbed.podrunner.PodRunner` runs the pod as real
``vllm serve`` (CPU, the tiny model, the plugin loaded by vLLM itself) and a real sidecar,
sharing the channel folder as the pod's two containers share the ``emptyDir``. An OfflineJob
of real MMLU prompts runs through the sidecar's shards while online traffic goes to vLLM
directly. At the job's first results the vLLM process is killed with SIGKILL and the pod
runner restarts it; then a burst of 256 concurrent online requests from vLLM's own load
generator (``vllm bench serve``, four times the pod's sequences) must complete with none
failed while the resumed job runs. The job must end with every ``custom_id`` exactly once,
and the plugin must have been the scheduler: it applied the sidecar's control generation, saw
the offline class only with the pod's token, and reported the engine's online TTFT/TBT to
``kubectl get``.

The service serves ``tiny-llama-cpu``, which no shipped profile describes: its budget is
priced by the latency model the pod learned from its own engine's steps, so the service must
reach ``BudgetReady=True`` on a ``learned`` model and the plugin must end on the ``budget``
policy. The operator's bar for a learned model is the sidecar's own sanity bar (50 %
held-out error; 20-25 % is typical on this loaded 2-core host): what is checked here is the
path, not the fit's accuracy (``docs/benchmarks/learning.md``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from integration.helpers_procs import eventually, http_ok
from slipstream_testbed.cluster import LocalCluster
from slipstream_testbed.podrunner import PodRunner, Process, RunningPod
from slipstream_testbed.vllm.bench_serve import BenchServeClient, RandomWorkload
from slipstream_testbed.vllm.server import ENGINE_CORE_NICE, engine_core_threads

pytestmark = [pytest.mark.vllm, pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "data" / "offline-sample.jsonl"
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
MODEL = "tiny-llama-cpu"  # no shipped profile: the learned model prices the budget
BURST = 256  # concurrent online requests while the job runs (the pod runs 64 sequences)
JOB_REQUESTS = 150


@pytest.fixture
def runner(admin_api: client.ApiClient, namespace: str,
           tmp_path: Path) -> Iterator[PodRunner]:
    pods = PodRunner(admin_api, tmp_path / "pods", namespace=namespace, engine="vllm",
                     restart_backoff_s=2.0)
    with pods.running(interval_s=0.5, join_s=90):
        yield pods


def manifests(tmp_path: Path, namespace: str,
              requests: int) -> tuple[Path, Path, Path, set[str]]:
    """The example service in engine mode (one replica, generous SLO) and a job of
    ``requests`` real MMLU prompts: the shipped sample's, repeated (a repeat's ``custom_id``
    gets ``-2``, ``-3``, ...) past its 60 lines."""
    import yaml

    service = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
    service["spec"].update(replicas=1, model=MODEL)
    service["spec"]["scheduling"]["enforcement"] = "engine"
    service["spec"]["slo"] = {"ttft": {"p99": "20s"}, "tbt": {"p99": "2s"}}
    sample = SAMPLE.read_text().splitlines()
    lines = []
    for i in range(requests):
        record = json.loads(sample[i % len(sample)])
        if i >= len(sample):
            record["custom_id"] += f"-{i // len(sample) + 1}"
        record["body"]["model"] = MODEL
        lines.append(json.dumps(record))
    ids = {json.loads(line)["custom_id"] for line in lines}
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    job = yaml.safe_load((REPO / "examples" / "offlinejob.yaml").read_text())
    job["metadata"]["name"] = "mmlu-engine"
    job["spec"]["model"] = MODEL
    job["spec"]["input"]["uri"] = f"file://{tmp_path / 'in.jsonl'}"
    out = tmp_path / "results" / "out.jsonl"
    out.parent.mkdir()
    job["spec"]["output"]["uri"] = f"file://{out}"
    # Enough work (prompts of up to 1,888 tokens, 128 tokens out) to be mid-job at the kill
    # and at the burst after it.
    job["spec"]["requestDefaults"]["maxTokens"] = 128
    job["spec"]["shardSize"] = 8
    service_path, job_path = tmp_path / "service.yaml", tmp_path / "job.yaml"
    service_path.write_text(yaml.safe_dump(service, sort_keys=False))
    job_path.write_text(yaml.safe_dump(job, sort_keys=False))
    return service_path, job_path, out, ids


def online_streams(url: str, count: int, results: list[dict[str, Any]], *, words: int = 0,
                   max_tokens: int = 16, stop: threading.Event | None = None) -> None:
    """``count`` streamed chat requests to vLLM's own port, one after another (until ``stop``
    is set, if given); ``words`` more words of prompt each."""
    for i in range(count):
        if stop is not None and stop.is_set():
            return
        text = f"say something {i} " + "about this " * (words * (i % 4))
        body = json.dumps({"model": MODEL, "stream": True, "max_tokens": max_tokens,
                           "messages": [{"role": "user", "content": text}]})
        req = urllib.request.Request(f"{url}/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with OPENER.open(req, timeout=120) as r:
                events = [ln for ln in r.read().decode().splitlines() if ln.startswith("data:")]
            results.append({"ok": events[-1] == "data: [DONE]", "events": len(events)})
        except OSError as exc:
            results.append({"ok": False, "error": str(exc)})


def engine_core_niced(proc: Process) -> bool | None:
    """True once the engine core's threads all run at :data:`ENGINE_CORE_NICE`."""
    if proc.popen is None:
        return None
    tids = engine_core_threads(proc.popen.pid)
    niced = [os.getpriority(os.PRIO_PROCESS, t) == ENGINE_CORE_NICE for t in tids]
    return True if niced and all(niced) else None


def test_engine_mode_job_exactly_once_through_a_vllm_kill(
    cluster: LocalCluster, namespace: str, runner: PodRunner, tmp_path: Path, tiny_model: Path,
) -> None:
    env = dict(os.environ, KUBECONFIG=str(cluster.admin_kubeconfig))

    def kubectl(*args: str) -> str:
        return subprocess.run([str(cluster.kubectl), *args], env=env, capture_output=True,
                              text=True, check=True, timeout=60).stdout

    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    operator_log = (tmp_path / "operator.log").open("wb")
    operator = subprocess.Popen(
        [sys.executable, "-m", "slipstream_cli.main", "-v", "operator", "--kubeconfig",
         str(cluster.admin_kubeconfig), "-n", namespace, "--loopback-only", "--interval", "1",
         "--window", "600"],
        stdout=operator_log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "SLIPSTREAM_OPERATOR_LEARNED_MAX_MAPE": "0.5"})
    operator_log.close()
    try:
        service_path, job_path, out, ids = manifests(tmp_path, namespace, requests=JOB_REQUESTS)
        # The example's hfTokenSecret (the pod runner resolves HF_TOKEN from it, as a kubelet).
        kubectl("create", "secret", "generic", "hf-token", "-n", namespace,
                "--from-literal=HF_TOKEN=hf_local_test")
        kubectl("apply", "-n", namespace, "-f", str(service_path))

        def serving() -> RunningPod | None:
            for pod in runner.snapshot():
                if (pod.kind == "inference" and http_ok(f"http://{pod.ip}:{pod.http_port}/ready")
                        and http_ok(f"http://{pod.ip}:{pod.engine_port}/health")):
                    return pod
            return None

        pod = eventually("vllm serve with the plugin and its sidecar serving", serving, 600, 1.0)
        assert pod.engine_mode and pod.online_port == pod.engine_port
        svc = json.loads(kubectl("get", "-n", namespace, "service", "chat", "-o", "json"))
        assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["engine"], (
            "in engine mode the Service sends online traffic to vLLM's port")
        assert pod.processes[0].name == "engine"
        # The engine core's spin yields the cores that serve HTTP (ENGINE_CORE_NICE).
        eventually("the engine core at the lowest priority",
                   lambda: engine_core_niced(pod.processes[0]), 30, 0.5)

        def plugin_configured() -> bool | None:
            with OPENER.open(f"http://{pod.ip}:{pod.http_port}/metrics", timeout=5) as r:
                text = r.read().decode()
            lines = [ln for ln in text.splitlines()
                     if ln.startswith("slipstream_engine_generation ")]
            return True if lines and float(lines[0].split()[1]) >= 1 else None

        # No profile for the model: the pod learns one from its engine's steps while online
        # traffic of varied sizes runs, and the operator prices the budget with it. The job
        # comes after, so it runs under that budget.
        learning_stop = threading.Event()
        learning: list[dict[str, Any]] = []
        url = f"http://{pod.ip}:{pod.online_port}"
        traffic = [threading.Thread(target=online_streams, args=(url, 10_000, learning),
                                    kwargs={"words": 4 * k, "max_tokens": 24 + 8 * k,
                                            "stop": learning_stop}, daemon=True)
                   for k in range(6)]
        for t in traffic:
            t.start()

        def learned_in_force() -> dict[str, Any] | None:
            st = json.loads(kubectl("get", "-n", namespace, "inferenceservices.slipstream.dev",
                                    "chat", "-o", "json")).get("status") or {}
            ready = {c["type"]: c for c in st.get("conditions", [])}.get("BudgetReady", {})
            lm = st.get("latencyModel") or {}
            return st if lm.get("source") == "learned" and ready.get("status") == "True" else None

        def budget_policy() -> bool | None:
            with OPENER.open(f"http://{pod.ip}:{pod.http_port}/metrics", timeout=5) as r:
                text = r.read().decode()
            return True if any(ln.startswith("slipstream_engine_info{") and 'policy="budget"'
                               in ln for ln in text.splitlines()) else None

        try:
            service = eventually("BudgetReady on the learned latency model", learned_in_force,
                                 300, 1.0)
            # The plugin takes the pushed document at its next steps.
            eventually("the plugin on the budget policy", budget_policy, 60, 1.0)
        finally:
            learning_stop.set()
            for t in traffic:
                t.join(timeout=150)
        assert learning and all(r["ok"] for r in learning), learning[-3:]
        lm = service["latencyModel"]
        assert lm["steps"] >= 200 and 0 <= lm["heldoutMAPE"] <= 0.5 and lm["revision"] >= 1
        assert service["budget"]["profile"].startswith("learned:")
        print(f"learned latency model in force: {lm} after {len(learning)} online requests")

        def progress() -> int:
            status = json.loads(kubectl("get", "-n", namespace, "offlinejobs.slipstream.dev",
                                        "mmlu-engine", "-o", "json")).get("status") or {}
            return int((status.get("requests") or {}).get("completed") or 0)

        # vLLM's load generator, warmed up (it imports vLLM) before the job starts, so that its
        # burst below is not delayed by vLLM's import.
        workload = RandomWorkload(tiny_model, served_model_name=MODEL, input_len=32,
                                  output_len=16, seed=7)
        bench = BenchServeClient(tmp_path / "bench-serve.log").start()
        try:
            warm = bench.run(workload.argv(url, concurrency=1, num_prompts=1,
                                           result_file=tmp_path / "warm.json", label="warm"),
                             tmp_path / "warm.json")
            assert warm.completed == 1, warm.errors
            eventually("the plugin running the sidecar's control document", plugin_configured,
                       120, 1.0)
            kubectl("apply", "-n", namespace, "-f", str(job_path))

            # kill -9 of vLLM at the job's first results, with its other shards in flight: the
            # pod runner restarts it, the shards resume. Killing at the first results, not at
            # a time, keeps most of the job ahead of the kill on a host of any speed.
            eventually("offline results before the kill",
                       lambda: True if progress() > 0 else None, 300, 0.2)
            proc = pod.processes[0]
            before_kill = progress()
            assert proc.popen is not None and before_kill < len(ids)
            os.killpg(proc.popen.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            eventually("vLLM back after SIGKILL",
                       lambda: True if proc.restarts >= 1 and http_ok(
                           f"http://{pod.ip}:{pod.engine_port}/health") else None, 600, 1.0)
            eventually("the restarted engine core at the lowest priority",
                       lambda: engine_core_niced(proc), 30, 0.5)

            # A burst of 256 concurrent online requests straight to the restarted vLLM, from
            # vLLM's own load generator, while the resumed job runs: none fails.
            before_burst = progress()
            assert before_burst < len(ids), "the job finished before the burst"
            burst = bench.run(workload.argv(url, concurrency=BURST, num_prompts=2 * BURST,
                                            result_file=tmp_path / "burst.json", label="burst"),
                              tmp_path / "burst.json")
        finally:
            bench.close()
        assert (burst.completed, burst.failed) == (2 * BURST, 0), burst.errors[:5]
        print(f"killed at {before_kill}/{len(ids)}; burst of {BURST} concurrent from "
              f"{before_burst}/{len(ids)}: {burst.completed} completed in "
              f"{burst.duration_s:.1f} s, TTFT p99 {burst.p99_ttft_ms:.0f} ms; the job at "
              f"{progress()}/{len(ids)} after it")
        after: list[dict[str, Any]] = []
        online_streams(url, 6, after)
        assert all(r["ok"] for r in after), after

        def done() -> dict[str, Any] | None:
            status = json.loads(kubectl("get", "-n", namespace, "offlinejobs.slipstream.dev",
                                        "mmlu-engine", "-o", "json")).get("status") or {}
            return status if status.get("phase") in ("Succeeded", "Failed") else None

        status = eventually("the job to finish", done, 600, 1.0)
        assert status["phase"] == "Succeeded", status
        # Exactly once: every input custom_id in the output or the error file, once.
        out_ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
        errors = out.with_name("out.errors.jsonl")
        err_ids = ([json.loads(line)["custom_id"] for line in errors.read_text().splitlines()]
                   if errors.exists() else [])
        assert sorted(out_ids + err_ids) == sorted(ids)
        assert len(out_ids) >= len(ids) - 2, errors.read_text()[:2000]
        assert status["requests"] == {"total": len(ids), "completed": len(out_ids),
                                      "failed": len(err_ids)}
        print(f"job finished {time.monotonic() - killed_at:.0f}s after the kill")

        # The plugin was vLLM's scheduler, and its report reaches kubectl get.
        with OPENER.open(f"http://{pod.ip}:{pod.http_port}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        info = [ln for ln in metrics.splitlines() if ln.startswith("slipstream_engine_info{")]
        assert info, "the sidecar serves the plugin's report"
        assert "slipstream_engine_forged_offline_tags 0.0" in metrics.splitlines()
        assert any('policy="budget"' in ln for ln in info), info  # the job ran budgeted
        eventually("observed TTFT in the service status", lambda: (
            json.loads(kubectl("get", "-n", namespace, "inferenceservices.slipstream.dev",
                               "chat", "-o", "json")).get("status", {}).get("observed", {})
            .get("ttftP99") or None), 120, 1.0)
        service = json.loads(kubectl("get", "-n", namespace, "inferenceservices.slipstream.dev",
                                     "chat", "-o", "json"))["status"]
        slo_met = {c["type"]: c for c in service["conditions"]}["SLOMet"]
        assert slo_met["status"] != "False", slo_met  # the generous SLO is kept (or unknown)
        print(kubectl("get", "-n", namespace, "inferenceservices.slipstream.dev,offlinejobs"))
    finally:
        os.killpg(operator.pid, signal.SIGTERM)
        operator.wait(timeout=30)
