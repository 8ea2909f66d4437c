"""The operator end to end on the real local cluster.

``kubectl apply -f examples/`` (with the data URIs pointed at this test's
folders) creates an InferenceService and an OfflineJob; the operator runs as a
process (``slipstream operator --loopback-only``) and creates the Deployment,
whose pods kwok runs with 127.1.x.y IPs. For each pod the test starts a real
engine model and a real sidecar bound to that pod's IP (ports 8000/9000, the
control token from the operator's Secret). Online load is replayed from the
Azure conversation trace against the pods while the job runs; the test reads
``kubectl get inferenceservices.slipstream.dev,offlinejobs`` until the SLO
and progress columns are live, waits for the job to succeed, checks every
custom_id is in the output exactly once, and has the API server reject
invalid specs with a message naming the field.
"""

from __future__ import annotations

import base64
import csv
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client

from integration.helpers_procs import SLIPSTREAM, Proc, engine_proc
from slipstream_testbed.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("SLIPSTREAM_DATA", REPO.parent / "shared" / "data"))
T = TypeVar("T")


def eventually(what: str, probe: Callable[[], T | None], timeout: float = 90.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.5)


@dataclass
class PodProc(Proc):
    """A process bound to a pod's loopback IP rather than 127.0.0.1."""

    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def kubectl(
    cluster: LocalCluster, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KUBECONFIG=str(cluster.admin_kubeconfig))
    return subprocess.run(
        [str(cluster.kubectl), *args],
        env=env,
        capture_output=True,
        text=True,
        check=check,
        timeout=60,
    )


def prepared_examples(tmp: Path) -> tuple[Path, Path, Path]:
    """examples/*.yaml with the job's URIs pointed at the sample input and a results folder."""
    out = tmp / "examples"
    out.mkdir()
    results = tmp / "results"
    results.mkdir()
    for src in sorted((REPO / "examples").glob("*.yaml")):
        text = src.read_text()
        text = text.replace("file:///var/lib/slipstream/data/", f"file://{REPO}/examples/data/")
        text = text.replace("file:///var/lib/slipstream/results/", f"file://{results}/")
        text = text.replace("suspend: false", "suspend: true")  # resumed once online is live
        (out / src.name).write_text(text)
    return out, REPO / "examples" / "data" / "offline-sample.jsonl", results


def azure_slice(rows: int) -> list[tuple[float, int, int]]:
    """(offset s, prompt tokens, output tokens) of the first rows of the Azure conv trace."""
    path = DATA / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.dev.csv"
    out: list[tuple[float, int, int]] = []
    with open(path, encoding="utf-8") as f:
        reader = csv.DictReader(f)
        start: float | None = None
        for row in reader:
            stamp = row["TIMESTAMP"]
            hh, mm, ss = stamp.split(" ")[1].split(":")
            t = int(hh) * 3600 + int(mm) * 60 + float(ss)
            start = t if start is None else start
            out.append((t - start, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            if len(out) == rows:
                break
    return out


def replay(
    urls: list[str], trace: list[tuple[float, int, int]], stop: threading.Event, results: list[int]
) -> None:
    """Send the trace's requests (real arrival gaps, real lengths, capped) round-robin."""

    def send(i: int, prompt_tokens: int, output_tokens: int) -> None:
        body = json.dumps(
            {
                "model": "llama-2-7b",
                "prompt": " ".join("hello" for _ in range(min(prompt_tokens, 1500))),
                "max_tokens": max(1, min(output_tokens, 48)),
                "stream": True,
            }
        ).encode()
        request = urllib.request.Request(
            f"{urls[i % len(urls)]}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                response.read()
                results.append(response.status)
        except (urllib.error.URLError, OSError):
            results.append(0)

    begin = time.monotonic()
    with ThreadPoolExecutor(max_workers=32) as pool:
        for i, (offset, prompt, output) in enumerate(trace):
            delay = offset - (time.monotonic() - begin)
            if delay > 0 and stop.wait(delay):
                break
            pool.submit(send, i, prompt, output)


def start_operator(cluster: LocalCluster, namespace: str, tmp_path: Path, stall_s: int,
                   env: dict[str, str] | None = None) -> Proc:
    """``slipstream operator`` as a process, watching ``namespace`` only (not waited for), with
    ``env`` added to this process's environment."""
    operator = Proc(
        "operator",
        [
            *SLIPSTREAM,
            "-v",
            "operator",
            "--kubeconfig",
            str(cluster.admin_kubeconfig),
            "-n",
            namespace,
            "--loopback-only",
            "--interval",
            "1",
            "--window",
            "30",
            "--stall-timeout",
            str(stall_s),
        ],
        tmp_path / "operator.log",
        0,
    )
    log = operator.log_path.open("ab")
    operator.popen = subprocess.Popen(
        operator.args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    log.close()
    return operator


def start_pods(
    admin_api: client.ApiClient, namespace: str, tmp_path: Path, procs: list[Proc]
) -> list[tuple[str, Proc, Proc]]:
    """For each pod of the ``chat`` service: an engine model and a sidecar on the pod's IP."""
    core = client.CoreV1Api(admin_api)

    def running_pods() -> list[str] | None:
        pods = core.list_namespaced_pod(namespace, label_selector="slipstream.dev/service=chat")
        ips = [
            p.status.pod_ip
            for p in pods.items
            if p.status is not None and p.status.phase == "Running" and p.status.pod_ip
        ]
        return sorted(ips) if len(ips) == 2 else None

    pod_ips = eventually("two running pods of the Deployment", running_pods)

    def token() -> str | None:
        try:
            secret = core.read_namespaced_secret("chat-control-token", namespace)
        except client.ApiException:
            return None
        raw = (secret.data or {}).get("token")
        return base64.b64decode(raw).decode() if raw else None

    token_file = tmp_path / "token"
    token_file.write_text(eventually("the control-token Secret", token))
    started: list[tuple[str, Proc, Proc]] = []
    for i, ip in enumerate(pod_ips):
        assert ip.startswith("127."), ip
        engine = engine_proc(tmp_path, name=f"engine-{i}", seed=i, mean_output_tokens=16)
        procs.append(engine.start())
        sidecar = PodProc(
            f"sidecar-{i}",
            [
                *SLIPSTREAM,
                "sidecar",
                "--engine",
                engine.url,
                "--host",
                ip,
                "--http-port",
                "8000",
                "--grpc-port",
                "9000",
                "--auth-token-file",
                str(token_file),
                "--state-dir",
                str(tmp_path / f"state-{i}"),
                "--max-num-seqs",
                "64",
                "--kv-blocks",
                "4096",
            ],
            tmp_path / f"sidecar-{i}.log",
            8000,
            host=ip,
        )
        procs.append(sidecar.start())
        started.append((ip, engine, sidecar))
    return started


def test_operator_end_to_end(
    cluster: LocalCluster,
    admin_api: client.ApiClient,
    namespace: str,
    tmp_path: Path,
    procs: list[Proc],
) -> None:
    kubectl(cluster, "apply", "-f", str(REPO / "crds"))
    examples, input_path, results = prepared_examples(tmp_path)
    operator = start_operator(cluster, namespace, tmp_path, stall_s=30)
    procs.append(operator)

    applied = kubectl(cluster, "apply", "-n", namespace, "-f", str(examples))
    assert "inferenceservice.slipstream.dev/chat created" in applied.stdout
    assert "offlinejob.slipstream.dev/mmlu-sample created" in applied.stdout
    pods = start_pods(admin_api, namespace, tmp_path, procs)
    urls = [sidecar.url for _, _, sidecar in pods]

    stop = threading.Event()
    statuses: list[int] = []
    load = threading.Thread(
        target=replay, args=(urls, azure_slice(600), stop, statuses), daemon=True
    )
    load.start()
    try:
        # The job was applied suspended: it is planned but waits. Online SLO columns go live.
        def slo_live() -> str | None:
            svc = json.loads(
                kubectl(
                    cluster,
                    "get",
                    "-n",
                    namespace,
                    "inferenceservices.slipstream.dev",
                    "chat",
                    "-o",
                    "json",
                ).stdout
            ).get("status", {})
            observed = svc.get("observed", {})
            conds = {c["type"]: c for c in svc.get("conditions", [])}
            live = (
                "ttftP99" in observed
                and "tbtP99" in observed
                and conds.get("SLOMet", {}).get("status") in ("True", "False")
                and conds.get("Ready", {}).get("status") == "True"
                and "iteration" in svc.get("budget", {})
            )
            out = kubectl(
                cluster, "get", "-n", namespace, "inferenceservices.slipstream.dev,offlinejobs"
            ).stdout
            return out if live and "Suspended" in out and "InsufficientSamples" not in out else None

        try:
            table = eventually("live SLO columns", slo_live, timeout=180.0)
        except AssertionError:
            with urllib.request.urlopen(f"{urls[0]}/metrics", timeout=5) as response:
                metrics = response.read().decode()
            print("\n".join(x for x in metrics.splitlines() if "online" in x and "_count" in x))
            print(
                kubectl(
                    cluster,
                    "get",
                    "-n",
                    namespace,
                    "inferenceservices.slipstream.dev",
                    "chat",
                    "-o",
                    "yaml",
                ).stdout
            )
            raise
        print(table)
        header = table.splitlines()[0].split()
        assert header[:8] == [
            "NAME",
            "READY",
            "TTFT-P99",
            "TBT-P99",
            "SLO",
            "BUDGET",
            "OFFLINE-TOK/S",
            "AGE",
        ]
        svc_line = next(line for line in table.splitlines() if "/chat " in line).split()
        assert svc_line[1] == "True" and svc_line[2].endswith("s") and svc_line[3].endswith("s")
        assert svc_line[5].endswith("ms")  # the budget in force

        # Resume the job while the online load keeps coming.
        kubectl(
            cluster,
            "patch",
            "-n",
            namespace,
            "offlinejob",
            "mmlu-sample",
            "--type=merge",
            "-p",
            '{"spec": {"suspend": false}}',
        )
        seen: list[str] = []

        def succeeded() -> dict[str, Any] | None:
            out = kubectl(cluster, "get", "-n", namespace, "offlinejobs").stdout
            seen.append(out)
            job = json.loads(
                kubectl(
                    cluster, "get", "-n", namespace, "offlinejob", "mmlu-sample", "-o", "json"
                ).stdout
            )
            status = job.get("status", {})
            assert status.get("phase") != "Failed", status
            return status if status.get("phase") == "Succeeded" else None

        status = eventually("the job to succeed", succeeded, timeout=300.0)
        svc = json.loads(
            kubectl(
                cluster,
                "get",
                "-n",
                namespace,
                "inferenceservices.slipstream.dev",
                "chat",
                "-o",
                "json",
            ).stdout
        )
    finally:
        stop.set()
        load.join(timeout=130)
    print(*seen, sep="\n")
    print(
        kubectl(
            cluster,
            "get",
            "-n",
            namespace,
            "inferenceservices.slipstream.dev,offlinejobs",
            "-o",
            "wide",
        ).stdout
    )
    assert any(" Running " in out for out in seen) or len(seen) <= 2

    # Exactly once: every input custom_id is in the output or the error file, once.
    wanted = [json.loads(line)["custom_id"] for line in input_path.read_text().splitlines()]
    out_ids = [
        json.loads(line)["custom_id"]
        for line in (results / "mmlu-sample.jsonl").read_text().splitlines()
    ]
    err_file = results / "mmlu-sample.errors.jsonl"
    err_ids = [json.loads(line)["custom_id"] for line in err_file.read_text().splitlines()]
    assert sorted(out_ids + err_ids) == sorted(wanted)
    assert status["requests"] == {"total": 60, "completed": len(out_ids), "failed": len(err_ids)}
    assert len(out_ids) >= 55, err_file.read_text()[:2000]
    assert status["progress"] == "60/60"

    conds = {c["type"]: c for c in svc["status"]["conditions"]}
    assert conds["Ready"]["status"] == "True"
    assert conds["SLOMet"]["reason"] in (
        "WithinTarget",
        "TTFTP99Exceeded",
        "TTFTMeanExceeded",
        "TBTP99Exceeded",
        "TBTMeanExceeded",
    )
    assert svc["status"]["observed"]["samples"] > 0
    assert sum(1 for s in statuses if s == 200) > 0

    # Every pod took the operator's configuration, latency model included (the shipped
    # profile for llama-2-7b on h100 is a token-curve model, which a pod refuses
    # without its knots: a refusal would leave it with no model and no budget).
    import grpc

    from slipstream_sidecar.proto import sidecar_pb2, sidecar_pb2_grpc

    control_token = (tmp_path / "token").read_text()
    for ip, _, _ in pods:
        with grpc.insecure_channel(f"{ip}:9000") as channel:
            reply = sidecar_pb2_grpc.SidecarStub(channel).Status(
                sidecar_pb2.StatusRequest(),
                metadata=(("authorization", f"Bearer {control_token}"),),
                timeout=5,
            )
        assert reply.generation > 0, ip
        assert reply.latency_model.kind, ip
        if "curve" in reply.latency_model.kind:
            assert len(reply.latency_model.token_curve) > 1, ip
            assert reply.latency_model.curve_step_tokens > 0, ip
    operator_log = operator.log_path.read_text(errors="replace")
    assert "INVALID_ARGUMENT" not in operator_log, operator.log_tail()

    # Invalid specs never reach the operator: the API server names the field.
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: slipstream.dev/v1alpha1\nkind: InferenceService\n"
        "metadata: {name: bad}\n"
        "spec: {model: m, engine: {image: x}, slo: {tbt: {mean: 200ms, p99: 150ms}}}\n"
    )
    rejected = kubectl(cluster, "apply", "-n", namespace, "-f", str(bad), check=False)
    assert rejected.returncode != 0
    assert "spec.slo.tbt.p99" in rejected.stderr and "at least the mean" in rejected.stderr
    bad.write_text(
        "apiVersion: slipstream.dev/v1alpha1\nkind: OfflineJob\nmetadata: {name: bad}\n"
        "spec: {model: m, input: {uri: 'file:///a.jsonl'}, output: {uri: 'file:///a.jsonl'}}\n"
    )
    rejected = kubectl(cluster, "apply", "-n", namespace, "-f", str(bad), check=False)
    assert rejected.returncode != 0 and "spec.output.uri" in rejected.stderr
    assert operator.popen is not None and operator.popen.poll() is None, operator.log_tail()


def mmlu_batch(path: Path, subjects: int, per_subject: int, max_tokens: int) -> list[str]:
    """An OpenAI Batch input of 5-shot MMLU prompts (real questions), subjects interleaved."""
    names = sorted(p.name[: -len("_test.csv")] for p in (DATA / "mmlu" / "test").glob("*.csv"))
    rows: list[list[dict[str, Any]]] = []
    for subject in names[:subjects]:
        with open(DATA / "mmlu" / "dev" / f"{subject}_dev.csv", encoding="utf-8") as f:
            prefix = "".join(
                f"{r['question']}\nAnswer: {r['answer']}\n\n" for r in csv.DictReader(f)
            )
        with open(DATA / "mmlu" / "test" / f"{subject}_test.csv", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows.append(
                [
                    {
                        "custom_id": f"{subject}-{i}",
                        "method": "POST",
                        "url": "/v1/completions",
                        "body": {
                            "model": "llama-2-7b",
                            "prompt": prefix + row["question"],
                            "max_tokens": max_tokens,
                        },
                    }
                    for i, row in zip(range(per_subject), reader, strict=False)
                ]
            )
    lines = [json.dumps(r[i]) for i in range(per_subject) for r in rows if i < len(r)]
    path.write_text("".join(line + "\n" for line in lines))
    return [json.loads(line)["custom_id"] for line in lines]


def test_a_job_survives_a_pod_that_dies(
    cluster: LocalCluster,
    admin_api: client.ApiClient,
    namespace: str,
    tmp_path: Path,
    procs: list[Proc],
) -> None:
    """Kill one pod's sidecar and engine mid-job: its shards move and finish exactly once."""
    kubectl(cluster, "apply", "-f", str(REPO / "crds"))
    examples, _, _ = prepared_examples(tmp_path)
    procs.append(start_operator(cluster, namespace, tmp_path, stall_s=15))
    kubectl(cluster, "apply", "-n", namespace, "-f", str(examples / "inferenceservice.yaml"))
    pods = start_pods(admin_api, namespace, tmp_path, procs)

    wanted = mmlu_batch(tmp_path / "big.jsonl", subjects=8, per_subject=40, max_tokens=24)
    job = {
        "apiVersion": "slipstream.dev/v1alpha1",
        "kind": "OfflineJob",
        "metadata": {"name": "survivor"},
        "spec": {
            "model": "llama-2-7b",
            "input": {"uri": f"file://{tmp_path}/big.jsonl"},
            "output": {"uri": f"file://{tmp_path}/out/survivor.jsonl"},
            "serviceSelector": {"matchLabels": {"slipstream.dev/pool": "shared"}},
            "shardSize": 20,
        },
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    kubectl(cluster, "apply", "-n", namespace, "-f", str(tmp_path / "job.json"))

    def status() -> dict[str, Any]:
        doc = json.loads(
            kubectl(cluster, "get", "-n", namespace, "offlinejob", "survivor", "-o", "json").stdout
        )
        result: dict[str, Any] = doc.get("status", {})
        return result

    # Wait until the victim pod's sidecar itself reports a shard in progress, then kill it.
    victim_ip, victim_engine, victim_sidecar = pods[1]
    control_token = (tmp_path / "token").read_text()

    def victim_busy() -> str | None:
        import grpc

        from slipstream_sidecar.proto import sidecar_pb2, sidecar_pb2_grpc

        with grpc.insecure_channel(f"{victim_ip}:9000") as channel:
            stub = sidecar_pb2_grpc.SidecarStub(channel)
            try:
                reply = stub.Status(
                    sidecar_pb2.StatusRequest(),
                    metadata=(("authorization", f"Bearer {control_token}"),),
                    timeout=5,
                )
            except grpc.RpcError:
                return None
        running = [
            s.shard_id
            for s in reply.shards
            if s.state == sidecar_pb2.SHARD_STATE_RUNNING and s.completed + s.failed < s.total
        ]
        return running[0] if running else None

    busy_shard = eventually("a shard running on the victim pod", victim_busy, timeout=120.0)
    victim_sidecar.kill()  # SIGKILL: no drain, no flush beyond what was fsynced
    victim_engine.kill()

    def finished() -> dict[str, Any] | None:
        st = status()
        assert st.get("phase") != "Failed", st
        return st if st.get("phase") == "Succeeded" else None

    final = eventually("the job to succeed on the surviving pod", finished, timeout=300.0)
    out_path = tmp_path / "out" / "survivor.jsonl"
    out = [json.loads(x)["custom_id"] for x in out_path.read_text().splitlines()]
    errors_path = tmp_path / "out" / "survivor.errors.jsonl"
    errs = [json.loads(x)["custom_id"] for x in errors_path.read_text().splitlines()]
    assert sorted(out + errs) == sorted(wanted)  # every request exactly once
    assert (
        final["requests"]["total"]
        == len(wanted)
        == final["requests"]["completed"] + final["requests"]["failed"]
    )
    assert final["shards"]["reassigned"] >= 1
    events = kubectl(
        cluster,
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        "involvedObject.name=survivor",
    ).stdout
    assert "ShardMoved" in events and busy_shard in events, events
