"""``slipstream demo``: the whole system on this machine, end to end, in a few minutes.

Steps, each announced on the console:

1. start the local Kubernetes control plane (``slipstream cluster``: binaries built from Go
   modules the first time, then cached) and helm-install ``charts/slipstream``;
2. run a real Prometheus on loopback with the chart's SLO rules, scraping every sidecar;
3. run the chart's operator pod and every inference pod as local processes
   (:mod:`slipstream_cli.podrunner`: the operator with its service account's token, so the
   chart's RBAC is what it gets; each inference pod as the engine model plus a real sidecar
   on the pod's loopback IP);
4. apply ``examples/inferenceservice.yaml`` (SLOs) and an OfflineJob over
   ``examples/data/offline-sample.jsonl`` (MMLU 5-shot prompts, repeated ``--offline-copies``
   times under new ids);
5. replay the Azure LLM conversation trace (``examples/data/azure_conv_*.csv``) as streaming
   requests against the sidecars for ``--duration`` seconds, printing
   ``kubectl get inferenceservices,offlinejobs`` whenever it changes;
6. summarise (SLO attainment measured by the client and by Prometheus, what the operator
   reports, offline requests done, tokens/s) and write plots and JSON to ``out/demo-<time>/``.

Everything is torn down at the end (processes by process group; the cluster stops unless
``--keep-cluster``). Only shipped files are read, so it works from a fresh clone; a trace under
``$SLIPSTREAM_DATA`` is used only when the shipped slice is missing.

Deliberately left out: real GPUs and vLLM (see docs/install.md), Grafana (the dashboard JSON
is in the chart), and tuning: the numbers are those of a loaded 2-core laptop-class machine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "slipstream"
EXAMPLES = REPO / "examples"
RELEASE = "slipstream"
SYSTEM_NS = "slipstream-system"
DEMO_NS = "slipstream-demo"
SERVICE = "chat"
JOB = "mmlu-sample"


class DemoError(Exception):
    """A demo step failed; the message says what to do."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=180.0,
                        help="seconds of online traffic (default 180)")
    parser.add_argument("--speedup", type=float, default=1.0,
                        help="trace arrivals are replayed this many times faster (default 1)")
    parser.add_argument("--max-output-tokens", type=int, default=128,
                        help="cap on the trace's output lengths (default 128)")
    parser.add_argument("--offline-copies", type=int, default=20,
                        help="the 60-line offline sample repeated this many times (default 20)")
    parser.add_argument("--offline-max-tokens", type=int, default=64,
                        help="max_tokens of each offline request (default 64)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default out/demo-<timestamp>)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="Azure-format trace (default examples/data/azure_conv_*.csv)")
    parser.add_argument("--keep-cluster", action="store_true",
                        help="leave the local cluster running afterwards")


def find_trace(explicit: Path | None) -> Path:
    if explicit is not None:
        if not explicit.is_file():
            raise DemoError(f"--trace {explicit} does not exist")
        return explicit
    shipped = sorted((EXAMPLES / "data").glob("azure_conv_*.csv"))
    if shipped:
        return shipped[0]
    from slipstream_cli.workloads import data_root

    shared = data_root() / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.dev.csv"
    if shared.is_file():
        return shared
    raise DemoError("no online trace: examples/data/azure_conv_*.csv is missing from this "
                    "checkout (and $SLIPSTREAM_DATA has none); pass --trace FILE")


def offline_input(out: Path, copies: int, max_tokens: int) -> tuple[Path, int]:
    """The shipped MMLU batch repeated ``copies`` times with unique custom_ids and
    ``max_tokens`` (the prompts are unchanged)."""
    sample = EXAMPLES / "data" / "offline-sample.jsonl"
    if not sample.is_file():
        raise DemoError(f"{sample} is missing from this checkout")
    lines = [json.loads(line) for line in sample.read_text().splitlines() if line.strip()]
    path = out / "data" / "offline-input.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for copy in range(copies):
            for record in lines:
                body = {**record["body"], "max_tokens": max_tokens}
                f.write(json.dumps({**record, "custom_id": f"{record['custom_id']}-{copy}",
                                    "body": body}) + "\n")
    return path, len(lines) * copies


def manifests(out: Path, input_path: Path, max_tokens: int) -> Path:
    """The example InferenceService and OfflineJob, pointed at the demo's files."""
    docs = []
    for name in ("inferenceservice.yaml", "offlinejob.yaml"):
        src = EXAMPLES / name
        if not src.is_file():
            raise DemoError(f"{src} is missing from this checkout")
        docs.append(yaml.safe_load(src.read_text()))
    service, job = docs
    if service["metadata"]["name"] != SERVICE or job["metadata"]["name"] != JOB:
        raise DemoError("examples/*.yaml changed names; update slipstream_cli.demo")
    job["spec"]["input"]["uri"] = f"file://{input_path}"
    job["spec"].setdefault("requestDefaults", {})["maxTokens"] = max_tokens
    job["spec"]["output"]["uri"] = f"file://{out / 'results' / 'mmlu-sample.jsonl'}"
    (out / "results").mkdir(parents=True, exist_ok=True)
    path = out / "manifests.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


class Kube:
    """kubectl and helm from the cluster's bin dir, with the admin kubeconfig."""

    def __init__(self, kubectl: Path, helm: Path, kubeconfig: Path) -> None:
        self.kubectl_bin, self.helm_bin = kubectl, helm
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

    def _run(self, argv: list[str], timeout: float, check: bool) -> str:
        try:
            result = subprocess.run(argv, env=self.env, capture_output=True, text=True,
                                    timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise DemoError(f"{' '.join(argv[:3])} timed out after {timeout}s") from exc
        if check and result.returncode != 0:
            raise DemoError(f"{' '.join(argv[:4])} failed: {result.stderr.strip()[-1500:]}")
        return result.stdout

    def kubectl(self, *args: str, timeout: float = 60.0, check: bool = True) -> str:
        return self._run([str(self.kubectl_bin), *args], timeout, check)

    def helm(self, *args: str, timeout: float = 180.0) -> str:
        return self._run([str(self.helm_bin), *args], timeout, True)


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float, hint: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(1.0)
    raise DemoError(f"timed out after {timeout_s:.0f}s waiting for {what}; {hint}")


def run(args: argparse.Namespace) -> int:
    console = Console()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = (args.out or REPO / "out" / f"demo-{stamp}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _demo(args, console, out)
    except DemoError as exc:
        console.print(f"[bold red]demo failed:[/] {exc}")
        console.print(f"logs and partial results: {out}")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; cleaned up[/]")
        return 130


def _demo(args: argparse.Namespace, console: Console, out: Path) -> int:
    from kubernetes import config as kube_config

    from slipstream_cli.cluster import ClusterConfig, ClusterError, LocalCluster
    from slipstream_cli.loadgen import LoadConfig, LoadGenerator, load_trace
    from slipstream_cli.podrunner import PodRunner
    from slipstream_cli.prometheus import LocalPrometheus, PrometheusError, chart_rules

    trace = find_trace(args.trace)
    console.rule("[bold]Slipstream demo")
    console.print(f"output folder: {out}")
    cluster = LocalCluster(ClusterConfig.from_env())
    stop = threading.Event()
    runner_thread: threading.Thread | None = None
    runner: PodRunner | None = None
    prometheus: LocalPrometheus | None = None
    started = time.monotonic()
    try:
        with console.status("Starting the local Kubernetes control plane (the first run builds "
                            "it from Go modules: tens of minutes; later runs: seconds)..."):
            try:
                cluster.up(build=True)
            except ClusterError as exc:
                raise DemoError(f"{exc}. Try `make cluster-build`, then "
                                "`slipstream cluster status`") from exc
        console.print(f"[green]✓[/] cluster up ({time.monotonic() - started:.0f}s): "
                      f"KUBECONFIG={cluster.admin_kubeconfig}")
        kube = Kube(cluster.kubectl, cluster.helm, cluster.admin_kubeconfig)

        with console.status("helm install charts/slipstream ..."):
            kube.helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", SYSTEM_NS,
                      "--create-namespace", "--set", "operator.reconcileIntervalSeconds=2",
                      "--set", "operator.windowSeconds=60", "--set", "operator.logLevel=info",
                      "--set", "operator.stallTimeoutSeconds=60")
        console.print("[green]✓[/] helm release 'slipstream' installed in "
                      f"{SYSTEM_NS} (CRDs, operator Deployment, RBAC, dashboard)")
        (out / "helm-status.txt").write_text(kube.helm("status", RELEASE, "-n", SYSTEM_NS))

        with console.status("Starting Prometheus with the chart's SLO rules ..."):
            rules = chart_rules(cluster.helm, CHART, out / "prometheus" / "slipstream.rules.yaml")
            try:
                prometheus = LocalPrometheus(out / "prometheus", rule_files=[rules]).start()
            except PrometheusError as exc:
                raise DemoError(str(exc)) from exc
        console.print(f"[green]✓[/] Prometheus at {prometheus.url} (rules: {rules.name})")

        api = kube_config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(cluster.admin_kubeconfig))
        runner = PodRunner(api, out / "pods",
                           service_account_kubeconfig=cluster.service_account_kubeconfig)
        runner_thread = threading.Thread(target=runner.run, args=(stop,), daemon=True,
                                         name="podrunner")
        runner_thread.start()

        kube.kubectl("create", "namespace", DEMO_NS, check=False)
        max_tokens = max(1, args.offline_max_tokens)
        input_path, total = offline_input(out, max(1, args.offline_copies), max_tokens)
        manifest = manifests(out, input_path, max_tokens)
        applied = kube.kubectl("apply", "-n", DEMO_NS, "-f", str(manifest))
        console.print(f"[green]✓[/] applied InferenceService/{SERVICE} (TTFT p99 2s, TBT p99 "
                      f"150ms) and OfflineJob/{JOB} ({total} MMLU requests)")
        logger.info("%s", applied.strip())

        def sidecars() -> list[str] | None:
            assert runner is not None and prometheus is not None
            _update_targets(prometheus, runner)
            pods = [p for p in runner.snapshot() if p.kind == "inference"]
            urls = []
            for pod in pods:
                try:
                    import urllib.request

                    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                    with opener.open(f"http://{pod.ip}:{pod.http_port}/ready", timeout=2) as r:
                        if r.status == 200:
                            urls.append(f"http://{pod.ip}:{pod.http_port}")
                except OSError:
                    continue
            return urls if len(urls) >= 2 else None

        with console.status("Waiting for the operator to create the pods and for their "
                            "engines and sidecars to come up ..."):
            urls = wait_for("two ready sidecars", sidecars, 180.0,
                            f"see the pod logs under {out / 'pods'}")
        _update_targets(prometheus, runner)
        console.print(f"[green]✓[/] {len(urls)} pods serving: {', '.join(urls)}")

        load_config = LoadConfig(model="llama-2-7b", speedup=args.speedup,
                                 duration_s=args.duration, max_requests=100_000,
                                 max_output_tokens=args.max_output_tokens,
                                 request_timeout_s=120.0, concurrency=128)
        requests = load_trace(trace, load_config)
        generator = LoadGenerator(urls, requests, load_config)
        console.print(f"replaying {len(requests)} requests of {trace.name} over "
                      f"{args.duration:.0f}s (speed-up {args.speedup:g}) ...")
        summary_box: dict[str, Any] = {}

        def drive() -> None:
            summary_box["summary"] = asyncio.run(generator.run())

        load_started = time.time()
        load_thread = threading.Thread(target=drive, daemon=True, name="loadgen")
        load_thread.start()
        snapshots = _watch(console, kube, prometheus=prometheus, runner=runner,
                           load_thread=load_thread, out=out, timeout_s=args.duration + 150.0)
        generator.stop()
        load_thread.join(timeout=180)
        job_status = _job_status(kube)
        if job_status.get("phase") != "Succeeded":
            with console.status("Online replay done; waiting up to 60s more for the job ..."):
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and job_status.get("phase") != "Succeeded":
                    time.sleep(2)
                    job_status = _job_status(kube)
        final = kube.kubectl("get", "-n", DEMO_NS,
                             "inferenceservices.slipstream.dev,offlinejobs", "-o", "wide")
        console.rule("kubectl get -o wide (final)", align="left")
        console.print(final.rstrip(), soft_wrap=True, highlight=False)
        summary = summary_box.get("summary")
        if summary is None:
            raise DemoError("the load generator did not finish")
        _report(console, out, generator=generator, summary=summary,
                prometheus=prometheus, kube=kube, job=job_status,
                wall_s=time.monotonic() - started, snapshots=snapshots)
        _plots(out, generator, prometheus, load_started)
        console.print(f"\n[bold]Results, plots and logs:[/] {out}")
        return 0
    finally:
        stop.set()
        if runner_thread is not None:
            runner_thread.join(timeout=60)
        elif runner is not None:
            runner.stop_all()
        if prometheus is not None:
            prometheus.stop()
        if not args.keep_cluster:
            with console.status("Stopping the local cluster ..."):
                try:
                    cluster.down()
                except (ClusterError, OSError) as exc:
                    console.print(f"[yellow]cluster down: {exc}[/]")


def _update_targets(prometheus: Any, runner: Any) -> None:
    from slipstream_cli.prometheus import ScrapeTarget

    pods = runner.snapshot()
    targets = [
        ScrapeTarget(f"{p.ip}:{p.http_port}", {"namespace": p.namespace, "pod": p.name,
                                               "slipstream_dev_service": p.service})
        for p in pods if p.kind == "inference"
    ]
    # The operator's own /metrics (per-service and per-job gauges): its series carry
    # the objects' namespace and name, so the target adds no labels.
    targets += [ScrapeTarget(f"{p.ip}:{p.http_port}")
                for p in pods if p.kind == "operator" and p.http_port > 0]
    prometheus.set_targets(targets)


def _job_status(kube: Kube) -> dict[str, Any]:
    text = kube.kubectl("get", "-n", DEMO_NS, "offlinejob", JOB, "-o", "json", check=False)
    try:
        status: dict[str, Any] = json.loads(text).get("status") or {}
    except ValueError:
        return {}
    return status


def _watch(console: Console, kube: Kube, *, prometheus: Any, runner: Any,
           load_thread: threading.Thread, out: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Print ``kubectl get`` whenever it changes until the load ends; sample status."""
    last = ""
    snapshots: list[dict[str, Any]] = []
    begin = time.monotonic()
    log = (out / "kubectl-get.log").open("w")
    try:
        while load_thread.is_alive() and time.monotonic() - begin < timeout_s:
            _update_targets(prometheus, runner)
            table = kube.kubectl("get", "-n", DEMO_NS,
                                 "inferenceservices.slipstream.dev,offlinejobs", check=False)
            # Columns that move every second (AGE) would print every time: compare the rest.
            key = "\n".join(" ".join(line.split()[:-1]) for line in table.splitlines())
            elapsed = time.monotonic() - begin
            if key != last and table.strip():
                console.rule(f"kubectl get -n {DEMO_NS} inferenceservices,offlinejobs  "
                             f"(t={elapsed:.0f}s)", align="left")
                console.print(table.rstrip(), soft_wrap=True, highlight=False)
                log.write(f"--- t={elapsed:.1f}s\n{table}\n")
                last = key
            snapshots.append({"t": round(elapsed, 1), "job": _job_status(kube)})
            time.sleep(5.0)
    finally:
        log.close()
    return snapshots


def _report(console: Console, out: Path, *, generator: Any, summary: Any, prometheus: Any,
            kube: Kube, job: dict[str, Any], wall_s: float,
            snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    from slipstream_cli.prometheus import PrometheusQueryError

    client = summary.attainment(generator.results, ttft_s=2.0, tbt_s=0.15)
    window = f"{max(60, int(summary.sent and generator.config.duration_s))}s"
    prom: dict[str, float | None] = {}
    queries = {
        "ttft_attainment": 'sum(increase(slipstream_ttft_seconds_bucket{class="online",le="2.0"}'
                           f'[{window}])) / sum(increase(slipstream_ttft_seconds_count'
                           f'{{class="online"}}[{window}]))',
        "tbt_attainment": 'sum(increase(slipstream_tbt_seconds_bucket{class="online",le="0.15"}'
                          f'[{window}])) / sum(increase(slipstream_tbt_seconds_count'
                          f'{{class="online"}}[{window}]))',
        "ttft_p99_s": 'histogram_quantile(0.99, sum by (le) (increase('
                      f'slipstream_ttft_seconds_bucket{{class="online"}}[{window}])))',
        "offline_tokens": f'sum(increase(slipstream_output_tokens_total{{class="offline"}}'
                          f'[{window}]))',
        "online_tokens": f'sum(increase(slipstream_output_tokens_total{{class="online"}}'
                         f'[{window}]))',
        "preemptions": f"sum(increase(slipstream_preemptions_total[{window}]))",
        # The operator's own gauges (its /metrics), read back through Prometheus.
        "job_completed_operator": f'sum(slipstream_offlinejob_finished_requests'
                                  f'{{namespace="{DEMO_NS}",name="{JOB}",outcome="completed"}})',
        "job_total_operator": f'sum(slipstream_offlinejob_input_requests'
                              f'{{namespace="{DEMO_NS}",name="{JOB}"}})',
    }
    for name, expr in queries.items():
        try:
            prom[name] = prometheus.scalar(expr)
        except PrometheusQueryError as exc:  # reported as missing, not fatal
            logger.warning("prometheus query %s failed: %s", name, exc)
            prom[name] = None
    service = json.loads(kube.kubectl("get", "-n", DEMO_NS, "inferenceservices.slipstream.dev",
                                      SERVICE, "-o", "json", check=False) or "{}")
    status = service.get("status") or {}
    requests = job.get("requests") or {}
    duration = generator.config.duration_s
    offline_tokens, offline_span = _offline_output(out, job)
    report = {
        "wall_s": round(wall_s, 1),
        "online": {"client": asdict(summary), "attainment_client": client,
                   "prometheus": prom, "operator_status": status.get("observed"),
                   "slo_condition": next((c for c in status.get("conditions", [])
                                          if c.get("type") == "SLOMet"), None)},
        "budget": status.get("budget"),
        "offline": {"phase": job.get("phase"), "requests": requests,
                    "tokens_per_second_status": job.get("tokensPerSecond"),
                    "tokens_per_second_prometheus": (prom["offline_tokens"] or 0) / duration,
                    "output_tokens_file": offline_tokens, "span_s": offline_span,
                    "output_uri": job.get("outputUri")},
        "job_snapshots": snapshots,
    }
    (out / "summary.json").write_text(json.dumps(report, indent=2, default=str))

    def fmt(value: float | None, unit: str = "s") -> str:
        if value is None:
            return "-"
        return f"{value * 1000:.0f} ms" if unit == "s" else f"{value:.1%}"

    table = Table(title="Slipstream demo summary", show_lines=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("online requests sent / ok", f"{summary.sent} / {summary.ok}")
    table.add_row("TTFT p50 / p99 (client)",
                  f"{fmt(summary.ttft_p50_s)} / {fmt(summary.ttft_p99_s)}")
    table.add_row("TBT mean / p99 (client)",
                  f"{fmt(summary.tbt_mean_s)} / {fmt(summary.tbt_p99_s)}")
    table.add_row("TTFT ≤ 2s / TBT ≤ 150ms (client)",
                  f"{fmt(client.get('ttft'), '%')} / {fmt(client.get('tbt'), '%')}")
    table.add_row("TTFT ≤ 2s / TBT ≤ 150ms (Prometheus)",
                  f"{fmt(prom.get('ttft_attainment'), '%')} / "
                  f"{fmt(prom.get('tbt_attainment'), '%')}")
    observed = status.get("observed") or {}
    table.add_row("operator status TTFT p99 / TBT p99",
                  f"{observed.get('ttftP99', '-')} / {observed.get('tbtP99', '-')}")
    table.add_row("budget in force", str((status.get("budget") or {}).get("iteration", "-")))
    table.add_row("offline job", f"{job.get('phase', '-')}: {requests.get('completed', 0)} done, "
                  f"{requests.get('failed', 0)} failed of {requests.get('total', 0)}")
    if prom.get("job_total_operator") is not None:
        table.add_row("offline job (operator /metrics via Prometheus)",
                      f"{prom.get('job_completed_operator') or 0:.0f} done of "
                      f"{prom['job_total_operator']:.0f}")
    table.add_row("offline output tokens (output file) / tokens/s while it ran",
                  f"{offline_tokens} / "
                  f"{offline_tokens / offline_span:.1f}" if offline_span else f"{offline_tokens}")
    table.add_row("offline tokens/s (Prometheus, over the replay)",
                  f"{(prom['offline_tokens'] or 0) / duration:.1f}")
    table.add_row("online tokens/s (Prometheus, over the replay)",
                  f"{(prom['online_tokens'] or 0) / duration:.1f}")
    table.add_row("offline preemptions", f"{prom.get('preemptions') or 0:.0f}")
    console.print(table)
    return report


def _offline_output(out: Path, job: dict[str, Any]) -> tuple[int, float]:
    """Output tokens in the job's merged output file, and start-to-completion seconds."""
    path = out / "results" / "mmlu-sample.jsonl"
    tokens = 0
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                usage = json.loads(line)["response"]["body"].get("usage") or {}
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            tokens += int(usage.get("completion_tokens") or 0)
    span = 0.0
    if job.get("startTime") and job.get("completionTime"):
        begin = dt.datetime.fromisoformat(str(job["startTime"]).replace("Z", "+00:00"))
        end = dt.datetime.fromisoformat(str(job["completionTime"]).replace("Z", "+00:00"))
        span = max(0.0, (end - begin).total_seconds())
    return tokens, span


def _plots(out: Path, generator: Any, prometheus: Any, load_started: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from slipstream_cli.plots import latency_cdfs

    ok = [r for r in generator.results if r.ok]
    latency_cdfs({"online (client)": {
        "ttft": np.array([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tbt": np.array([g for r in ok for g in r.gaps_s]),
    }}, out / "latency_cdf.png", "Online latency seen by the client")
    end = time.time()
    start = load_started - 20
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    series = {
        "online tok/s": 'sum(rate(slipstream_output_tokens_total{class="online"}[15s]))',
        "offline tok/s": 'sum(rate(slipstream_output_tokens_total{class="offline"}[15s]))',
    }
    for label, expr in series.items():
        t, v = _range(prometheus, expr, start, end)
        axes[0].plot(t, v, label=label)
    axes[0].set_ylabel("tokens/s")
    axes[0].legend()
    axes[0].grid(alpha=0.3)
    t, v = _range(prometheus, 'histogram_quantile(0.99, sum by (le) (rate('
                  'slipstream_ttft_seconds_bucket{class="online"}[30s])))', start, end)
    axes[1].plot(t, v, label="TTFT p99 (30s window)")
    t, v = _range(prometheus, "max(slipstream_budget_seconds)", start, end)
    axes[1].plot(t, v, label="iteration budget")
    axes[1].axhline(2.0, color="red", linestyle=":", label="TTFT SLO (p99 2s)")
    axes[1].set_ylabel("seconds")
    axes[1].set_xlabel("seconds since the online replay started")
    axes[1].legend()
    axes[1].grid(alpha=0.3)
    fig.suptitle("Online and offline on the same pods (from Prometheus)")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)


def _range(prometheus: Any, expr: str, start: float, end: float) -> tuple[list[float],
                                                                          list[float]]:
    import requests
    from prometheus_api_client import PrometheusConnect

    session = requests.Session()
    session.trust_env = False
    try:
        client = PrometheusConnect(url=prometheus.url, disable_ssl=True, session=session)
        data = client.custom_query_range(
            expr, start_time=dt.datetime.fromtimestamp(start),
            end_time=dt.datetime.fromtimestamp(end), step="5")
    except Exception as exc:  # prometheus-api-client raises bare Exception subclasses
        logger.warning("range query %s failed: %s", expr, exc)
        return [], []
    finally:
        session.close()
    if not data:
        return [], []
    points = [(float(ts) - start - 20, float(v)) for ts, v in data[0]["values"]]
    return [p[0] for p in points], [p[1] for p in points]
