"""A real Prometheus scraping real sidecars agrees with the operator's InferenceService status.

On the local cluster: the CRDs, the operator as a process (watching this test's namespace,
with a window longer than the test so it covers the whole replay), and the example
InferenceService, whose two pods :class:`slipstream_testbed.podrunner.PodRunner` runs as engine
model + sidecar processes on their loopback IPs. Debian's Prometheus scrapes both sidecars
(file_sd with the pods' IPs, labels namespace / pod / slipstream_dev_service) and loads the
chart's SLO rules. After a replay of the Azure conversation trace, the operator's
``status.observed`` (TTFT/TBT P99 and mean, sample count) matches what Prometheus answers to
the operator's own PromQL (``observe.promql_queries``), and the chart's recording rule gives
the same TTFT attainment as the raw histogram. The same Prometheus scrapes the operator's own
``/metrics`` (``--metrics-port``, a target without labels, as ``honorLabels`` would keep
them): its InferenceService gauges agree with the status Prometheus is compared against.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from kubernetes import client

from slipstream_cli.loadgen import LoadConfig, LoadGenerator, load_trace
from slipstream_operator.observe import promql_queries
from slipstream_testbed.cluster import LocalCluster
from slipstream_testbed.podrunner import PodRunner
from slipstream_testbed.prometheus import LocalPrometheus, ScrapeTarget, chart_rules, free_port

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("SLIPSTREAM_DATA", REPO.parent / "shared" / "data"))
TRACE = DATA / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.dev.csv"
T = TypeVar("T")


def eventually(what: str, probe: Callable[[], T | None], timeout: float = 120.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.5)


def seconds(text: str) -> float:
    """A status duration (``144ms``, ``1.2s``, ``1m3s``) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
    parts = re.findall(r"([0-9.]+)(ms|us|µs|h|m|s)", text)
    assert parts, text
    return sum(float(v) * units[u] for v, u in parts)


@pytest.fixture
def runner(admin_api: client.ApiClient, namespace: str,
           tmp_path: Path) -> Iterator[PodRunner]:
    pods = PodRunner(admin_api, tmp_path / "pods", namespace=namespace)
    with pods.running(interval_s=0.5, join_s=60):
        yield pods


def test_operator_status_agrees_with_prometheus(
    cluster: LocalCluster, namespace: str, runner: PodRunner, tmp_path: Path,
) -> None:
    env = dict(os.environ, KUBECONFIG=str(cluster.admin_kubeconfig))

    def kubectl(*args: str) -> str:
        return subprocess.run([str(cluster.kubectl), *args], env=env, capture_output=True,
                              text=True, check=True, timeout=60).stdout

    kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    operator_log = (tmp_path / "operator.log").open("wb")
    metrics_port = free_port()
    operator = subprocess.Popen(
        [sys.executable, "-m", "slipstream_cli.main", "-v", "operator", "--kubeconfig",
         str(cluster.admin_kubeconfig), "-n", namespace, "--loopback-only", "--interval", "1",
         "--window", "900", "--metrics-address", "127.0.0.1", "--metrics-port",
         str(metrics_port)],
        stdout=operator_log, stderr=subprocess.STDOUT, start_new_session=True)
    operator_log.close()
    rules = chart_rules(cluster.helm, REPO / "charts" / "slipstream", tmp_path / "rules.yaml")
    prometheus = LocalPrometheus(tmp_path / "prometheus", scrape_interval_s=1.0,
                                 rule_files=[rules])
    try:
        prometheus.start()
        # The example's hfTokenSecret, as its header says to create first (the pod runner, as
        # a kubelet, resolves the vLLM container's HF_TOKEN from it).
        kubectl("create", "secret", "generic", "hf-token", "-n", namespace,
                "--from-literal=HF_TOKEN=hf_local_test")
        kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "inferenceservice.yaml"))

        def two_pods() -> list[str] | None:
            pods = [p for p in runner.snapshot() if p.kind == "inference"]
            if len(pods) < 2:
                return None
            prometheus.set_targets([*(ScrapeTarget(f"{p.ip}:{p.http_port}", {
                "namespace": p.namespace, "pod": p.name, "slipstream_dev_service": p.service})
                for p in pods), ScrapeTarget(f"127.0.0.1:{metrics_port}")])
            return [f"http://{p.ip}:{p.http_port}" for p in pods]

        urls = eventually("two inference pods running as processes", two_pods)
        eventually("Prometheus scraping both sidecars and the operator",
                   lambda: True if prometheus.targets_up() == 3 else None, timeout=90)

        def operator_sees_pods() -> dict[str, object] | None:
            status = json.loads(kubectl("get", "-n", namespace,
                                        "inferenceservices.slipstream.dev", "chat",
                                        "-o", "json")).get("status") or {}
            return status if status.get("readyReplicas") == 2 else None

        eventually("the operator to see two ready pods", operator_sees_pods, timeout=120)
        time.sleep(3)  # both sides hold a sample from before the first request

        config = LoadConfig(model="llama-2-7b", speedup=2.0, duration_s=40.0,
                            max_output_tokens=48, max_prompt_tokens=1500)
        generator = LoadGenerator(urls, load_trace(TRACE, config), config)
        began = time.monotonic()
        summary = asyncio.run(generator.run())
        assert summary.ok >= 40, summary
        time.sleep(6)  # a few more scrapes by both after the last request

        status = json.loads(kubectl("get", "-n", namespace, "inferenceservices.slipstream.dev",
                                    "chat", "-o", "json"))["status"]
        observed = status["observed"]
        window = f"{int(time.monotonic() - began) + 30}s"
        queries = promql_queries(namespace, "chat", window)
        prom = {name: prometheus.scalar(expr) for name, expr in queries.items()}
        print(json.dumps({"status": observed, "prometheus": prom,
                          "client": {"ok": summary.ok, "ttft_p99_s": summary.ttft_p99_s}},
                         indent=1))
        assert observed["source"] == "sidecar"
        assert observed["samples"] == summary.ok
        assert prom["samples"] == pytest.approx(summary.ok, rel=0.15)  # increase() extrapolates
        for key in ("ttft_p99_s", "ttft_mean_s", "tbt_p99_s", "tbt_mean_s"):
            camel = key[:-2].replace("_mean", "Mean").replace("_p99", "P99")
            ours, theirs = seconds(observed[camel]), prom[key]
            assert theirs is not None, key
            assert ours == pytest.approx(theirs, rel=0.1, abs=0.002), (key, ours, theirs)

        # The chart's recording rule and the raw histogram agree on TTFT attainment.
        sel = f'namespace="{namespace}",slipstream_dev_service="chat",class="online"'
        raw = prometheus.scalar(
            f'1 - sum(rate(slipstream_ttft_seconds_bucket{{{sel},le="2.0"}}[5m])) / '
            f"sum(rate(slipstream_ttft_seconds_count{{{sel}}}[5m]))")
        recorded = eventually("the recording rule", lambda: prometheus.scalar(
            f'slipstream:slo_violation_ratio:rate5m{{namespace="{namespace}",metric="ttft"}}'),
            timeout=30)
        assert raw is not None
        assert recorded == pytest.approx(raw, abs=0.02)

        # The operator's own metrics, through Prometheus, say what the status says.
        obj = f'namespace="{namespace}",name="chat"'
        assert eventually("the operator's ready-replica gauge in Prometheus", lambda: (
            prometheus.scalar(f"slipstream_inferenceservice_ready_replicas{{{obj}}}")),
            timeout=30) == status["readyReplicas"] == 2

        def same_samples() -> bool | None:
            now = json.loads(kubectl("get", "-n", namespace, "inferenceservices.slipstream.dev",
                                     "chat", "-o", "json"))["status"]
            scraped = prometheus.scalar(f"slipstream_inferenceservice_observed_samples{{{obj}}}")
            return True if scraped == now["observed"]["samples"] else None

        eventually("the operator's sample count in Prometheus to match the status",
                   same_samples, timeout=30)
        p99 = prometheus.scalar(f'slipstream_inferenceservice_observed_latency_seconds{{{obj},'
                                'metric="ttft",stat="p99"}')
        assert p99 == pytest.approx(seconds(observed["ttftP99"]), rel=0.05, abs=0.002)
        slo_met = next(c["status"] for c in status["conditions"] if c["type"] == "SLOMet")
        scraped_met = prometheus.scalar(f"slipstream_inferenceservice_slo_met{{{obj}}}")
        assert scraped_met == {"True": 1.0, "False": 0.0}.get(slo_met), (slo_met, scraped_met)
    finally:
        prometheus.stop()
        operator.terminate()
        try:
            operator.wait(timeout=20)
        except subprocess.TimeoutExpired:
            operator.kill()
