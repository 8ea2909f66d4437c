"""Faults during a 10,000-request OfflineJob under online load, on a real local cluster.

Each run (its seed fixes everything random) uses a fresh namespace of a
private local cluster (its own state dir and ports, so restarting its
kube-apiserver and etcd disturbs nobody else's tests): the operator as a
process, an InferenceService of two pods whose engine model and sidecar run on
the pods' loopback IPs, an OfflineJob of 5-shot MMLU questions (real, from the
shared data, prompts up to ~600 tokens; 2 output tokens each; 10,000 by
default), and online load replayed from the Azure
conversation trace (real arrival gaps at two thirds of the rate, real lengths
capped). At seeded random points of the job's progress
(``slipstream_testbed.faults.plan_faults``) it injects, once each: ``kill -9`` of
one pod's sidecar (restarted on the same state dir, as a container restart
would), of one pod's engine (restarted), of the operator (restarted), and a
``kill -9`` + restart of kube-apiserver and of etcd.

What must hold in every run: the job reaches ``Succeeded``; every input
``custom_id`` is in the output exactly once and the error file is empty; every
line of both files parses; the job's status counts agree; every online request
either completed (a full SSE stream ending ``[DONE]``) or failed visibly (an
HTTP error with a JSON ``error.message``, a refused or reset connection, or a
stream cut off by a dropped connection) and none hung past its timeout.

Knobs: ``SLIPSTREAM_RELIABILITY_RUNS`` (seeded runs, default 1: one run takes
about two minutes on a 2-core host; ``docs/reliability.md`` records more),
``SLIPSTREAM_RELIABILITY_REQUESTS`` (job size, default 10,000),
``SLIPSTREAM_RELIABILITY_SEED`` (first seed, default 1). A run fails early,
with each sidecar's status, if the job makes no progress for 180 s.

Deliberately left out: faults of kube-controller-manager, kube-scheduler and
kwok (they only matter for pods that are created or moved, which this
InferenceService does not do during the job) and node loss (the operator's e2e
covers a pod that dies for good).
"""

from __future__ import annotations

import csv
import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rel_cluster import World, cleanup_namespace, kubectl, mmlu_job_input, start_world

from integration.helpers_procs import MODEL
from slipstream_testbed.cluster import LocalCluster
from slipstream_testbed.faults import ControlPlane, Fault, FaultPlan, plan_faults

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
RUNS = int(os.environ.get("SLIPSTREAM_RELIABILITY_RUNS", "1"))
REQUESTS = int(os.environ.get("SLIPSTREAM_RELIABILITY_REQUESTS", "10000"))
FIRST_SEED = int(os.environ.get("SLIPSTREAM_RELIABILITY_SEED", "1"))


# -- workloads ---------------------------------------------------------------------------------


def azure_trace(shared_data: Path, rows: int, slow_down: float) -> list[tuple[float, int, int]]:
    path = shared_data / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.dev.csv"
    out: list[tuple[float, int, int]] = []
    with open(path, encoding="utf-8") as f:
        start: float | None = None
        for row in csv.DictReader(f):
            hh, mm, ss = row["TIMESTAMP"].split(" ")[1].split(":")
            t = int(hh) * 3600 + int(mm) * 60 + float(ss)
            start = t if start is None else start
            out.append(((t - start) * slow_down, int(row["ContextTokens"]),
                        int(row["GeneratedTokens"])))
            if len(out) == rows:
                break
    return out


ONLINE_TIMEOUT_S = 120.0


def online_request(url: str, prompt_tokens: int, output_tokens: int) -> str:
    """One streaming completion; returns its outcome class (see the module docstring)."""
    body = json.dumps({"model": MODEL, "prompt": "hello " * min(prompt_tokens, 512),
                       "max_tokens": max(1, min(output_tokens, 16)), "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=ONLINE_TIMEOUT_S) as resp:
            data = resp.read()
    except urllib.error.HTTPError as err:
        payload = err.read()
        err.close()
        try:
            message = json.loads(payload)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return f"http_{err.code}_unclear"
        return f"http_{err.code}" if message else f"http_{err.code}_unclear"
    except TimeoutError:
        return "hung"
    except urllib.error.URLError as err:
        if isinstance(err.reason, TimeoutError):
            return "hung"
        if isinstance(err.reason, ConnectionRefusedError):
            return "refused"
        return "connection_error"
    except (http.client.IncompleteRead, ConnectionError, http.client.HTTPException):
        return "stream_cut"
    if data.endswith(b"data: [DONE]\n\n"):
        return "ok"
    # A stream that ended cleanly without [DONE] and without an error event: the client
    # cannot tell it from a short answer.
    return "stream_error" if b'"error"' in data else "ended_without_done_unclear"


def replay(urls: list[str], trace: list[tuple[float, int, int]], stop: threading.Event,
           outcomes: Counter[str]) -> None:
    lock = threading.Lock()

    def send(i: int, p: int, o: int) -> None:
        result = online_request(urls[i % len(urls)], p, o)
        with lock:
            outcomes[result] += 1

    begin = time.monotonic()
    with ThreadPoolExecutor(max_workers=32) as pool:
        for i, (offset, p, o) in enumerate(trace):
            delay = offset - (time.monotonic() - begin)
            if delay > 0 and stop.wait(delay):
                break
            if stop.is_set():
                break
            pool.submit(send, i, p, o)


# -- one run ------------------------------------------------------------------------------------


def job_status(world: World, name: str) -> dict[str, Any] | None:
    out = kubectl(world.cluster, "get", "-n", world.namespace, "offlinejob", name, "-o", "json",
                  check=False, timeout=20)
    if out.returncode != 0:
        return None
    status: dict[str, Any] = json.loads(out.stdout).get("status", {})
    return status


STALL_S = 180.0


def sidecar_status(world: World) -> list[str]:
    """One line per pod: engine readiness, budget, offline queue and shards (for a stall)."""
    import grpc

    from slipstream_sidecar.proto import sidecar_pb2 as pb

    token = (world.tmp / "token").read_text().strip()
    out = []
    for pod in world.pods:
        try:
            with grpc.insecure_channel(f"{pod.ip}:9000") as ch:
                stub = ch.unary_unary(
                    "/slipstream.sidecar.v1alpha1.Sidecar/Status",
                    request_serializer=pb.StatusRequest.SerializeToString,
                    response_deserializer=pb.StatusResponse.FromString)
                st = stub(pb.StatusRequest(), metadata=(("authorization", f"Bearer {token}"),),
                          timeout=5)
        except grpc.RpcError as exc:
            out.append(f"{pod.ip}: {exc.code()}")
            continue
        shards = [(s.shard_id[-5:], s.state, s.completed, s.total) for s in st.shards]
        out.append(f"{pod.ip}: ready={st.engine_ready} budget={st.budget_s:.3f} "
                   f"offline queued={st.offline.queued} in_flight={st.offline.in_flight} "
                   f"shards={shards}")
    return out


def inject(world: World, fault: Fault, plane: ControlPlane) -> str:
    pod = world.pods[fault.target]
    if fault.kind == "kill-sidecar":
        pod.sidecar.kill()
        time.sleep(fault.down_s)
        pod.sidecar.start()
    elif fault.kind == "kill-engine":
        pod.engine.kill()
        time.sleep(fault.down_s)
        pod.engine.start()
    elif fault.kind == "kill-operator":
        world.operator.kill()
        time.sleep(fault.down_s)
        world.operator.start()
    elif fault.kind == "restart-apiserver":
        return f"{plane.restart('kube-apiserver', fault.down_s):.1f}s to healthy"
    elif fault.kind == "restart-etcd":
        return f"{plane.restart('etcd', fault.down_s):.1f}s to healthy"
    return f"down {fault.down_s:.1f}s"


@dataclass
class RunReport:
    seed: int
    plan: FaultPlan
    seconds: float
    injected: list[str]
    outcomes: Counter[str]
    status: dict[str, Any]


def one_run(cluster: LocalCluster, seed: int, tmp: Path, shared_data: Path) -> RunReport:
    namespace = f"rel-faults-{seed}-{os.getpid() % 10000}"
    plan = plan_faults(seed, pods=2)
    wanted = mmlu_job_input(shared_data, tmp / "in.jsonl", REQUESTS)
    world = start_world(cluster, namespace, tmp)
    plane = ControlPlane(cluster)
    stop = threading.Event()
    outcomes: Counter[str] = Counter()
    injected: list[str] = []
    t0 = time.monotonic()
    try:
        job = {
            "apiVersion": "slipstream.dev/v1alpha1", "kind": "OfflineJob",
            "metadata": {"name": "faulty"},
            "spec": {"model": MODEL, "input": {"uri": f"file://{tmp}/in.jsonl"},
                     "output": {"uri": f"file://{tmp}/out/faulty.jsonl"},
                     "serviceSelector": {"matchLabels": {"slipstream.dev/pool": "shared"}},
                     "shardSize": max(REQUESTS // 16, 50)},
        }
        (tmp / "job.json").write_text(json.dumps(job))
        kubectl(cluster, "apply", "-n", namespace, "-f", str(tmp / "job.json"))
        load = threading.Thread(
            target=replay,
            args=([p.sidecar.url for p in world.pods], azure_trace(shared_data, 4000, 1.5), stop,
                  outcomes),
            daemon=True,
        )
        load.start()
        pending = list(plan.faults)
        final: dict[str, Any] | None = None
        last_done, last_change = -1, time.monotonic()
        journal = tmp / "faults.log"
        while True:
            st = job_status(world, "faulty") or {}
            assert st.get("phase") != "Failed", st
            if st.get("phase") == "Succeeded":
                final = st
                break
            req = st.get("requests") or {}
            total = req.get("total") or REQUESTS
            done = (req.get("completed") or 0) + (req.get("failed") or 0)
            if done != last_done:
                last_done, last_change = done, time.monotonic()
            assert time.monotonic() - last_change < STALL_S, (
                f"no progress for {STALL_S:.0f}s at {done}/{total}; faults so far: {injected}; "
                f"sidecars: {sidecar_status(world)}")
            while pending and done / total >= pending[0].at_progress:
                fault = pending.pop(0)
                what = inject(world, fault, plane)
                injected.append(f"{fault.kind}@{done}/{total} ({what})")
                with journal.open("a") as f:
                    f.write(injected[-1] + "\n")
            time.sleep(1.0)
        assert not pending, f"faults never injected: {pending}"
    finally:
        stop.set()
        world.stop()
        cleanup_namespace(cluster, namespace)
    seconds = time.monotonic() - t0
    out_path, err_path = tmp / "out" / "faulty.jsonl", tmp / "out" / "faulty.errors.jsonl"
    out = [json.loads(x) for x in out_path.read_bytes().splitlines()]  # every line parses
    errs = ([json.loads(x) for x in err_path.read_bytes().splitlines()]
            if err_path.exists() else [])
    out_ids = [r["custom_id"] for r in out]
    err_ids = [r["custom_id"] for r in errs]
    assert sorted(out_ids + err_ids) == sorted(wanted), "a custom_id is missing or duplicated"
    assert not errs, f"{len(errs)} requests failed: {errs[:3]}"
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in out)
    assert final["requests"] == {"total": REQUESTS, "completed": REQUESTS, "failed": 0}
    return RunReport(seed, plan, seconds, injected, outcomes, final)


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + RUNS))
def test_job_survives_seeded_faults_under_online_load(
    private_cluster: LocalCluster, seed: int, tmp_path: Path, shared_data: Path
) -> None:
    report = one_run(private_cluster, seed, tmp_path, shared_data)
    online = report.outcomes
    print(f"\nseed {seed}: {REQUESTS} requests in {report.seconds:.0f}s; faults "
          f"{report.plan.describe()}")
    print("  injected: " + "; ".join(report.injected))
    print(f"  online outcomes: {dict(online)}")
    assert online["ok"] > 0
    assert online["hung"] == 0, "an online request hung past its timeout"
    unclear = {k: v for k, v in online.items() if k.endswith("_unclear")}
    assert not unclear, f"online errors without a message: {unclear}"
