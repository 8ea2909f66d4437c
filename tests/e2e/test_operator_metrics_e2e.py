"""The operator's /metrics on a real API server: real objects change, the scrape follows.

The operator runs as a process (``slipstream operator --metrics-port P``, watching this test's
namespace) against the local cluster. The example InferenceService and OfflineJob are applied
(the job suspended, its input the 60-line sample); no sidecars run, so the service has no
ready pods and the job never places a shard, which is enough: the operator still plans the
job (60 requests) and writes both statuses. The test scrapes ``http://127.0.0.1:P/metrics``
over loopback and checks that the gauges follow what ``kubectl`` shows as the objects change
(spec.replicas 2 -> 1, the job resumed from Suspended to Pending) and that a deleted job's
series disappear.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from integration.helpers_procs import SLIPSTREAM, free_port, wait_http
from slipstream_testbed.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")
Series = dict[str, dict[frozenset[tuple[str, str]], float]]


def eventually(what: str, probe: Callable[[], T | None], timeout: float = 90.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.5)


def scrape(port: int) -> Series:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return out


def value(series: Series, metric: str, /, **labels: str) -> float | None:
    return series.get(metric, {}).get(frozenset(labels.items()))


def test_operator_metrics_follow_real_objects(cluster: LocalCluster, namespace: str,
                                              tmp_path: Path) -> None:
    env = dict(os.environ, KUBECONFIG=str(cluster.admin_kubeconfig))

    def kubectl(*args: str) -> str:
        return subprocess.run([str(cluster.kubectl), *args], env=env, capture_output=True,
                              text=True, check=True, timeout=60).stdout

    def status(kind: str, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = json.loads(kubectl("get", "-n", namespace, kind, name, "-o",
                                                 "json"))
        return dict(obj.get("status") or {})

    examples = tmp_path / "examples"
    examples.mkdir()
    for src in sorted((REPO / "examples").glob("*.yaml")):
        text = src.read_text()
        text = text.replace("file:///var/lib/slipstream/data/", f"file://{REPO}/examples/data/")
        text = text.replace("file:///var/lib/slipstream/results/", f"file://{tmp_path}/")
        text = text.replace("suspend: false", "suspend: true")
        (examples / src.name).write_text(text)
    lines = len((REPO / "examples" / "data" / "offline-sample.jsonl").read_text().splitlines())

    kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    port = free_port()
    log = (tmp_path / "operator.log").open("wb")
    operator = subprocess.Popen(
        [*SLIPSTREAM, "-v", "operator", "--kubeconfig", str(cluster.admin_kubeconfig),
         "-n", namespace, "--loopback-only", "--interval", "1",
         "--metrics-port", str(port)],  # --loopback-only: /metrics on 127.0.0.1
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        wait_http(f"http://127.0.0.1:{port}/metrics", 60, operator)
        (build,) = scrape(port)["slipstream_operator_build_info"]
        assert dict(build)["version"] == "0.1.0"

        kubectl("apply", "-n", namespace, "-f", str(examples))
        svc = {"namespace": namespace, "name": "chat"}
        job = {"namespace": namespace, "name": "mmlu-sample"}

        def planned() -> Series | None:
            got = scrape(port)
            ok = (value(got, "slipstream_offlinejob_input_requests", **job) == lines
                  and value(got, "slipstream_offlinejob_phase", **job, phase="Suspended") == 1
                  and value(got, "slipstream_inferenceservice_observed_generation", **svc) == 1)
            return got if ok else None

        got = eventually("the job planned and suspended, the service reconciled", planned)
        assert value(got, "slipstream_inferenceservice_spec_replicas", **svc) == 2
        assert value(got, "slipstream_inferenceservice_slo_target_seconds", **svc,
                     metric="ttft", stat="p99") == 2.0
        assert value(got, "slipstream_inferenceservice_slo_target_seconds", **svc,
                     metric="tbt", stat="mean") == pytest.approx(0.06)
        assert value(got, "slipstream_inferenceservice_ready_replicas", **svc) == float(
            status("inferenceservices.slipstream.dev", "chat").get("readyReplicas", 0))
        assert value(got, "slipstream_offlinejob_shards", **job, state="assigned") == 0
        assert value(got, "slipstream_operator_watched_objects", kind="OfflineJob") == 1
        stamp = value(got, "slipstream_offlinejob_status_change_timestamp_seconds", **job)
        assert stamp is not None and abs(stamp - time.time()) < 120

        # Change both objects; the gauges follow.
        kubectl("patch", "-n", namespace, "inferenceservices.slipstream.dev", "chat",
                "--type=merge", "-p", '{"spec": {"replicas": 1}}')
        kubectl("patch", "-n", namespace, "offlinejob", "mmlu-sample", "--type=merge",
                "-p", '{"spec": {"suspend": false}}')

        def changed() -> Series | None:
            got = scrape(port)
            ok = (value(got, "slipstream_inferenceservice_spec_replicas", **svc) == 1
                  and value(got, "slipstream_inferenceservice_observed_generation", **svc) == 2
                  and value(got, "slipstream_offlinejob_phase", **job, phase="Suspended") == 0)
            return got if ok else None

        got = eventually("the gauges to follow the patches", changed)
        phase = str(status("offlinejob", "mmlu-sample")["phase"])
        assert value(got, "slipstream_offlinejob_phase", **job, phase=phase) == 1
        assert value(got, "slipstream_inferenceservice_metadata_generation", **svc) == 2

        # Deleting the job removes its series; the service's stay.
        kubectl("delete", "-n", namespace, "offlinejob", "mmlu-sample", "--wait=true",
                "--timeout=60s")

        def gone() -> Series | None:
            got = scrape(port)
            left = [n for n, series in got.items() if n.startswith("slipstream_offlinejob_")
                    and any(dict(k).get("name") == "mmlu-sample" for k in series)]
            return None if left else got

        got = eventually("the deleted job's series to go", gone)
        assert value(got, "slipstream_operator_watched_objects", kind="OfflineJob") == 0
        assert value(got, "slipstream_inferenceservice_spec_replicas", **svc) == 1
        assert value(got, "slipstream_operator_watch_events_total", kind="OfflineJob",
                     type="DELETED") == 1
    finally:
        operator.terminate()
        try:
            operator.wait(timeout=20)
        except subprocess.TimeoutExpired:
            operator.kill()
        print((tmp_path / "operator.log").read_text()[-3000:])
