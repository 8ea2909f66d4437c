"""A missing or unreachable Prometheus does not stop offline work or invent latency.

The operator runs with ``--prometheus-url`` pointing at a loopback port where
nothing listens (refused at once) or at a listener that accepts connections and
never answers (every query runs into its timeout). With online load and an
OfflineJob of real MMLU questions on a real two-pod InferenceService, the job
still reaches ``Succeeded`` with every ``custom_id`` once, the ``SLOMet``
condition says it has no samples rather than reporting numbers it does not
have, and the operator logs why. The service's ``Ready`` (polled during the
job) must turn True as it does without Prometheus (the ``none`` baseline): the
operator bounds the queries with one short deadline and falls back to the sidecars.

Deliberately left out: a Prometheus that answers with wrong data (the
observability owner's tests).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from rel_cluster import (
    cleanup_namespace,
    eventually,
    kubectl,
    mmlu_job_input,
    port_free,
    start_world,
)
from test_faults_e2e import azure_trace, replay

from integration.helpers_procs import MODEL, free_port
from slipstream_testbed.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A listener that accepts connections and never answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
                held.append(conn)
            except TimeoutError:
                continue
            except OSError:
                return

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    t.join(2)
    for c in held:
        c.close()
    sock.close()


@pytest.mark.parametrize("kind", ["none", "refused", "black-hole"])
def test_offline_job_and_status_without_prometheus(
    private_cluster: LocalCluster, tmp_path: Path, shared_data: Path, kind: str,
    request: pytest.FixtureRequest,
) -> None:
    args: tuple[str, ...] = ()
    if kind == "refused":
        port = free_port()
        assert port_free("127.0.0.1", port)
        url = f"http://127.0.0.1:{port}"
        args = ("--prometheus-url", url)
    elif kind == "black-hole":
        args = ("--prometheus-url", request.getfixturevalue("black_hole"))
    ns = f"rel-prom-{kind}-{os.getpid() % 10000}"
    world = start_world(private_cluster, ns, tmp_path, operator_args=args)
    stop = threading.Event()
    outcomes: Counter[str] = Counter()
    try:
        wanted = mmlu_job_input(shared_data, tmp_path / "in.jsonl", 300)
        job = {"apiVersion": "slipstream.dev/v1alpha1", "kind": "OfflineJob",
               "metadata": {"name": "noprom"},
               "spec": {"model": MODEL, "input": {"uri": f"file://{tmp_path}/in.jsonl"},
                        "output": {"uri": f"file://{tmp_path}/out/noprom.jsonl"},
                        "shardSize": 50}}
        (tmp_path / "job.json").write_text(json.dumps(job))
        kubectl(private_cluster, "apply", "-n", ns, "-f", str(tmp_path / "job.json"))
        load = threading.Thread(target=replay, daemon=True, args=(
            [p.sidecar.url for p in world.pods], azure_trace(shared_data, 600, 1.5), stop,
            outcomes))
        load.start()

        ready_seen: list[str] = []

        def done() -> dict[str, object] | None:
            svc_now = json.loads(kubectl(private_cluster, "get", "-n", ns,
                                         "inferenceservices.slipstream.dev", "chat", "-o",
                                         "json").stdout).get("status", {})
            for c in svc_now.get("conditions", []):
                if c["type"] == "Ready":
                    ready_seen.append(c["status"])
            st = json.loads(kubectl(private_cluster, "get", "-n", ns, "offlinejob", "noprom",
                                    "-o", "json").stdout).get("status", {})
            assert st.get("phase") != "Failed", st
            # The status must stay live without Prometheus: wait for the service's Ready to be
            # written True too, not only for the job (a 300-line job can finish within the
            # first two service ticks, each of which waits out the black hole's timeout).
            if st.get("phase") == "Succeeded" and "True" in ready_seen:
                return st
            return None

        eventually("the job to succeed and the service to report Ready without Prometheus",
                   done, timeout=300)
        time.sleep(2)
        svc = json.loads(kubectl(private_cluster, "get", "-n", ns,
                                 "inferenceservices.slipstream.dev", "chat", "-o",
                                 "json").stdout)["status"]
    finally:
        stop.set()
        world.stop()
        cleanup_namespace(private_cluster, ns)
    out = [json.loads(x)["custom_id"]
           for x in (tmp_path / "out" / "noprom.jsonl").read_text().splitlines()]
    assert sorted(out) == sorted(wanted)
    conds = {c["type"]: c for c in svc.get("conditions", [])}
    print(f"\n{kind}: SLOMet {conds.get('SLOMet')}; observed {svc.get('observed')}; "
          f"online {dict(outcomes)}")
    print(f"Ready during the job: {Counter(ready_seen)}; at the end: {conds['Ready']}")
    assert outcomes["ok"] > 0
    if kind == "none":  # the baseline: sidecar scraping
        assert "True" in ready_seen, conds["Ready"]
        return
    # Prometheus down: the operator says why and falls back to the sidecars' /metrics,
    # so readiness and SLO status stay live instead of going stale.
    log = world.operator.log_path.read_text()
    assert "Prometheus unavailable" in log and "using the sidecars' /metrics" in log
    assert svc.get("observed", {}).get("source") != "prometheus", svc.get("observed")
    assert "True" in ready_seen, f"Ready never True while Prometheus was {kind}"
