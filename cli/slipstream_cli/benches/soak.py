"""``slipstream bench soak``: a long run of online and offline work through real vLLM while
its processes are killed, judged on exactly-once output and on what clients saw.

What runs, all on this machine (as ``slipstream demo --engine vllm``): the local cluster and
``charts/slipstream`` with its operator pod; the ``chat`` InferenceService of ``examples/``
(two pods, each a real ``vllm serve`` on CPU with the tiny model and a real sidecar, run by
:class:`~slipstream_testbed.podrunner.PodRunner`, which restarts a killed process as a kubelet
restarts a container), in ``--mode sidecar`` or ``--mode engine``; OfflineJobs of the shipped
MMLU sample one after another for the whole soak; and the Azure conversation trace's online
arrivals (``--keep`` of them, real gaps and lengths, capped to the tiny model's context)
through the pods' online ports. The latency model is the one the pods measure (learned from
the plugin's steps in engine mode, profiled at start in sidecar mode), as in the demo.

Faults: :func:`~slipstream_testbed.faults.plan_timed_faults` picks from ``--seed`` a fault
about every ``--every`` seconds, in rounds of ``kill -9`` of a pod's vLLM, of a pod's sidecar
and of the operator. Each strike ``SIGKILL`` s the process group and times how long until the
pod serves again (vLLM's ``/health`` and the sidecar's ``/ready``; the operator's
``/metrics``).

Judged (:mod:`slipstream_cli.benches.soak_verdict`): every finished job ``Succeeded`` with
every input ``custom_id`` in its output exactly once, no job left unfinished (the last one
gets ``--job-timeout`` after the load), every struck pod back, and every online failure
explained by a strike (ended while that pod was down, and a clean error or the killed
process's own connection). Exit status 0 when the soak held, 1 when it did not.

Deliberately left out: restarts of kube-apiserver and etcd (``tests/reliability`` strikes
those), GPUs, and any timing goal (the figures are those of a 2-core host).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from slipstream_cli.argtypes import positive, share, whole
from slipstream_cli.benches.soak_verdict import JobCheck, Strike, check_job, judge
from slipstream_cli.demo import http_ok

SCHEMA = "slipstream.bench.soak/v1"
MODES = ("sidecar", "engine")
PROCESS_OF = {"kill-engine": "engine", "kill-sidecar": "sidecar", "kill-operator": "operator"}
PROMPT_WORDS_CAP = 480  # the tiny model's 2,048-token context (slipstream_cli.demo)
TERMINAL = ("Succeeded", "Failed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=MODES, default="engine",
                        help="where Slipstream decides: the sidecar in front of vLLM, or the "
                        "plugin inside it (default engine)")
    parser.add_argument("--duration", type=positive, default=1800.0,
                        help="seconds of online load and faults (default 1800)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the faults' times, kinds and pods (default 0)")
    parser.add_argument("--every", type=positive, default=150.0,
                        help="about one fault per this many seconds (default 150)")
    parser.add_argument("--keep", type=share, default=0.25,
                        help="share of the trace's arrivals sent (default 0.25: the Azure "
                        "trace's rate is for a GPU, not two CPU engines on two cores)")
    parser.add_argument("--max-output-tokens", type=whole(1), default=128,
                        help="cap on the trace's output lengths (default 128)")
    parser.add_argument("--job-copies", type=whole(1), default=20,
                        help="each OfflineJob is the 60-line MMLU sample this many times "
                        "(default 20: 1,200 requests)")
    parser.add_argument("--offline-max-tokens", type=whole(1), default=64,
                        help="max_tokens of each offline request (default 64)")
    parser.add_argument("--grace", type=positive, default=10.0,
                        help="seconds after a pod serves again in which a failure still "
                        "counts as the strike's (default 10)")
    parser.add_argument("--recovery-timeout", type=positive, default=420.0,
                        help="seconds a struck pod gets to serve again (default 420)")
    parser.add_argument("--job-timeout", type=positive, default=900.0,
                        help="seconds the last OfflineJob gets after the load (default 900)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="Azure-format trace (default: $SLIPSTREAM_DATA's 39-minute "
                        "conversation trace, else the shipped 10-minute slice)")
    parser.add_argument("--out", type=Path, default=None,
                        help="logs and results (default out/soak-<mode>-<time>)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the report here too (default: only <out>/soak.json)")
    parser.add_argument("--keep-cluster", action="store_true",
                        help="leave the local cluster running afterwards")


def soak_trace(explicit: Path | None) -> Path:
    """The online trace: ``--trace``, else the shared 39-minute one, else the shipped slice."""
    from slipstream_cli.demo import find_trace
    from slipstream_cli.workloads import data_root

    shared = data_root() / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.dev.csv"
    if explicit is None and shared.is_file():
        return shared
    return find_trace(explicit)


def thin(requests: list[Any], keep: float, seed: int) -> list[Any]:
    """A seeded ``keep`` share of the arrivals, their times unchanged."""
    rng = random.Random(seed)
    return [r for r in requests if rng.random() < keep]


@dataclass
class Soak:
    """The running soak: the runner's pods, the clock, what was struck and finished."""

    runner: Any
    kube: Any
    mode: str
    out: Path
    t0: float = 0.0
    strikes: list[Strike] = field(default_factory=list)
    jobs: list[JobCheck] = field(default_factory=list)
    unfinished: int = 0
    errors: list[str] = field(default_factory=list)  # a thread's failure fails the soak
    stop: threading.Event = field(default_factory=threading.Event)

    def guarded(self, name: str, body: Any, *args: Any, **kwargs: Any) -> threading.Thread:
        """A daemon thread running ``body``; what it raises is kept in :attr:`errors`."""

        def target() -> None:
            try:
                body(*args, **kwargs)
            except Exception as exc:  # reported in the verdict, not lost
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")

        return threading.Thread(target=target, name=name, daemon=True)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def inference_pods(self) -> list[Any]:
        return sorted((p for p in self.runner.snapshot() if p.kind == "inference"),
                      key=lambda p: p.name)

    def serving(self, kind: str, pod: Any) -> bool:
        if kind == "kill-operator":
            proc = next(p for p in pod.processes if p.name == "operator")
            return bool(proc.alive() and (pod.http_port == 0
                                          or http_ok(f"http://{pod.ip}:{pod.http_port}/metrics")))
        sidecar_ready = http_ok(f"http://{pod.ip}:{pod.http_port}/ready")
        if kind == "kill-sidecar":
            return sidecar_ready
        return sidecar_ready and http_ok(f"http://{pod.ip}:{pod.engine_port}/health")

    def strike(self, kind: str, target: int, recovery_timeout_s: float) -> Strike:
        """``kill -9`` one process group; wait until its pod serves again."""
        if kind == "kill-operator":
            pods = [p for p in self.runner.snapshot() if p.kind == "operator"]
        else:
            pods = self.inference_pods()
        if not pods:
            raise RuntimeError(f"{kind}: no pod to strike")
        pod = pods[target % len(pods)]
        proc = next(p for p in pod.processes if p.name == PROCESS_OF[kind])
        popen = proc.popen
        url = "" if kind == "kill-operator" else f"http://{pod.ip}:{pod.online_port}"
        at = self.now()
        if popen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
        deadline = time.monotonic() + recovery_timeout_s
        # The runner restarts the process (a new Popen); then the pod must serve again.
        while time.monotonic() < deadline and not self.stop.is_set():
            if proc.popen is not popen and proc.alive() and self.serving(kind, pod):
                return Strike(kind, url, at, self.now())
            time.sleep(0.5)
        return Strike(kind, url, at, None)


def _faults(soak: Soak, plan: tuple[Any, ...], recovery_timeout_s: float,
            console: Console) -> None:
    for fault in plan:
        if soak.stop.wait(max(0.0, fault.at_s - soak.now())):
            return
        struck = soak.strike(fault.kind, fault.target, recovery_timeout_s)
        soak.strikes.append(struck)
        down = ("not back" if struck.recovered_s is None
                else f"back in {struck.recovered_s - struck.at_s:.1f}s")
        console.print(f"[{struck.at_s:7.1f}s] {fault.kind} {struck.target or 'operator'}: "
                      f"{down}", highlight=False)


def _read_ids(path: Path) -> list[str]:
    if not path.is_file():
        return []
    ids = []
    for line in path.read_text().splitlines():
        if line.strip():
            ids.append(str(json.loads(line).get("custom_id")))
    return ids


def _jobs(soak: Soak, template: dict[str, Any], input_path: Path, *,
          load_done: threading.Event, job_timeout_s: float, console: Console) -> None:
    """OfflineJobs one after another while the load runs; the last one gets the timeout."""
    from slipstream_cli.demo import DEMO_NS, job_status

    input_ids = _read_ids(input_path)
    k = 0
    while not load_done.is_set() and not soak.stop.is_set():
        name = f"soak-{k:03d}"
        output = soak.out / "results" / f"{name}.jsonl"
        doc = json.loads(json.dumps(template))
        doc["metadata"]["name"] = name
        doc["spec"]["output"]["uri"] = f"file://{output}"
        path = soak.out / f"job-{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        soak.kube.kubectl("apply", "-n", DEMO_NS, "-f", str(path))
        deadline: float | None = None
        phase = ""
        while not soak.stop.is_set():
            phase = str(job_status(soak.kube, name).get("phase") or "")
            if phase in TERMINAL:
                break
            if load_done.is_set() and deadline is None:
                deadline = time.monotonic() + job_timeout_s
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(3.0)
        if phase not in TERMINAL:
            soak.unfinished += 1
            console.print(f"[yellow]![/] OfflineJob/{name} unfinished ({phase or 'no phase'})")
            return
        check = check_job(name, phase, input_ids, _read_ids(output))
        soak.jobs.append(check)
        console.print(f"[{soak.now():7.1f}s] OfflineJob/{name} {phase}: {check.outputs} of "
                      f"{check.inputs} results, lost {check.lost}, duplicated "
                      f"{check.duplicated}", highlight=False)
        k += 1


def run(args: argparse.Namespace) -> int:
    import datetime as dt

    from slipstream_cli.demo import REPO, DemoError

    console = Console()
    if args.duration < args.every:
        print(f"slipstream bench soak: error: --duration {args.duration:g} leaves no room for "
              f"a fault every {args.every:g}s (--every)", file=sys.stderr)
        return 2
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = (args.out or REPO / "out" / f"soak-{args.mode}-{stamp}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        report = _soak(args, console, out)
    except (DemoError, RuntimeError) as exc:
        console.print(f"[bold red]soak failed to run:[/] {exc}")
        console.print(f"logs: {out}")
        return 2
    text = json.dumps(report, indent=2)
    (out / "soak.json").write_text(text + "\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    _print(console, report)
    console.print(f"report: {out / 'soak.json'}")
    return 0 if report["verdict"]["held"] else 1


def _soak(args: argparse.Namespace, console: Console, out: Path) -> dict[str, Any]:
    from kubernetes import config as kube_config

    from slipstream_cli import demo
    from slipstream_testbed.cluster import ClusterConfig, LocalCluster
    from slipstream_testbed.faults import plan_timed_faults
    from slipstream_testbed.podrunner import PodRunner
    from slipstream_testbed.vllm.server import VllmUnavailableError, vllm_python

    try:
        vllm_python()
    except VllmUnavailableError as exc:
        raise demo.DemoError(str(exc)) from exc
    trace = soak_trace(args.trace)
    plan = plan_timed_faults(args.seed, args.duration, args.every)
    cluster = LocalCluster(ClusterConfig.from_env())
    console.rule(f"[bold]Soak: {args.duration:.0f}s, {args.mode} mode, {len(plan)} faults "
                 f"(seed {args.seed})")
    console.print(f"output folder: {out}")
    try:
        cluster.up(build=True)
        kube = demo.Kube(cluster.kubectl, cluster.helm, cluster.admin_kubeconfig)
        demo.install_chart(kube)
        api = kube_config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(cluster.admin_kubeconfig))
        runner = PodRunner(api, out / "pods",
                           service_account_kubeconfig=cluster.service_account_kubeconfig,
                           engine="vllm")
        with runner.running():
            return _with_pods(args, console, out, kube=kube, runner=runner, trace=trace,
                              plan=plan)
    finally:
        if not args.keep_cluster:
            cluster.down()


def _with_pods(args: argparse.Namespace, console: Console, out: Path, *, kube: Any,
               runner: Any, trace: Path, plan: tuple[Any, ...]) -> dict[str, Any]:
    from slipstream_cli import demo
    from slipstream_cli.demo_compare import Slo
    from slipstream_cli.loadgen import LoadConfig, LoadGenerator, load_trace

    ns = demo.DEMO_NS
    kube.kubectl("create", "namespace", ns, check=False)
    kube.kubectl("create", "secret", "generic", demo.HF_TOKEN_SECRET, "-n", ns,
                 "--from-literal=HF_TOKEN=hf_local_demo", check=False)
    kube.kubectl("delete", "offlinejobs.slipstream.dev", "--all", "-n", ns, "--wait=true",
                 check=False)
    input_path, total = demo.offline_input(out, demo.VLLM_MODEL, args.job_copies,
                                           args.offline_max_tokens)
    # The SLO prices the budget; the soak judges delivery, not latency, so it is loose.
    slo = Slo(ttft_p99_s=2.0, tbt_p99_s=0.2)
    manifest = demo.manifests(out, "slipstream", input_path, args.offline_max_tokens, slo,
                              mode=args.mode, engine="vllm")
    service, job = yaml.safe_load_all(manifest.read_text())
    service_path = out / "service.yaml"
    service_path.write_text(yaml.safe_dump(service, sort_keys=False))
    kube.kubectl("apply", "-n", ns, "-f", str(service_path))
    urls = demo.wait_for("two serving pods", lambda: demo.ready_urls(runner, 2),
                         demo.startup_s("slipstream", "vllm", args.mode),
                         f"see the pod logs under {out / 'pods'}")
    console.print(f"pods serving: {', '.join(urls)}")
    load_config = LoadConfig(model=demo.VLLM_MODEL, duration_s=args.duration,
                                  max_requests=1_000_000,
                                  max_output_tokens=args.max_output_tokens,
                                  max_prompt_tokens=PROMPT_WORDS_CAP, request_timeout_s=120.0,
                                  concurrency=256, seed=args.seed)
    requests = thin(load_trace(trace, load_config), args.keep, args.seed)
    soak = Soak(runner, kube, args.mode, out, t0=time.monotonic())
    load_done = threading.Event()
    generator = LoadGenerator(urls, requests, load_config)
    threads = [
        soak.guarded("jobs", _jobs, soak, job, input_path, load_done=load_done,
                     job_timeout_s=args.job_timeout, console=console),
        soak.guarded("faults", _faults, soak, plan, args.recovery_timeout, console),
    ]
    # Offline work first: in engine mode the pods learn their latency model from its steps.
    threads[0].start()
    demo.await_learned_model(console, kube, args.mode, out)
    soak.t0 = time.monotonic()  # the clock of the load generator's results and the faults
    threads[1].start()
    console.print(f"load: {len(requests)} requests of {trace.name} over {args.duration:.0f}s; "
                  f"faults at {', '.join(f'{f.at_s:.0f}s {f.kind}' for f in plan)}",
                  highlight=False)
    try:
        summary = asyncio.run(generator.run())
    except BaseException:  # interrupted: the threads stop now, not after their waits
        soak.stop.set()
        raise
    finally:
        end_s = soak.now()
        load_done.set()
        threads[1].join(timeout=args.recovery_timeout + 30)
        threads[0].join(timeout=args.job_timeout + 60)
        soak.stop.set()
    verdict = judge(generator.results, soak.strikes, soak.jobs, mode=args.mode,
                    grace_s=args.grace, end_s=end_s, unfinished_jobs=soak.unfinished)
    if len(soak.strikes) < len(plan) or soak.errors:
        verdict["held"] = False
    verdict["errors"] = soak.errors
    verdict["planned_faults"] = len(plan)
    status = json.loads(kube.kubectl("get", "-n", ns, "inferenceservices.slipstream.dev",
                                     demo.SERVICE, "-o", "json", check=False) or "{}")
    return {
        "schema": SCHEMA,
        "config": {"mode": args.mode, "duration_s": args.duration, "seed": args.seed,
                   "every_s": args.every, "keep": args.keep, "trace": trace.name,
                   "max_output_tokens": args.max_output_tokens,
                   "job_requests": total, "offline_max_tokens": args.offline_max_tokens,
                   "grace_s": args.grace, "engine": demo.ENGINE_NAMES["vllm"]},
        "verdict": verdict,
        "online_summary": {"sent": summary.sent, "ok": summary.ok, "failed": summary.failed,
                           "ttft_p99_s": summary.ttft_p99_s, "tbt_p99_s": summary.tbt_p99_s},
        "latency_model": demo.describe_model(
            (status.get("status") or {}).get("latencyModel") or {}),
        "restarts": {f"{p.name}/{proc.name}": proc.restarts for p in runner.snapshot()
                     for proc in p.processes},
        "loadavg": list(os.getloadavg()),
    }


def _print(console: Console, report: dict[str, Any]) -> None:
    verdict = report["verdict"]
    online = verdict["online"]
    table = Table(title=f"Soak ({report['config']['mode']} mode, "
                        f"{report['config']['duration_s']:.0f}s, seed {report['config']['seed']})")
    table.add_column("")
    table.add_column("value", justify="right")
    offline = verdict["offline"]
    table.add_row("faults struck", str(len(verdict["strikes"])))
    table.add_row("longest time to serve again", f"{verdict['down_s_max']} s")
    table.add_row("online requests", str(online["sent"]))
    for kind, n in online["outcomes"].items():
        table.add_row(f"  {kind}", str(n))
    for kind, n in online["failures_explained_by"].items():
        table.add_row(f"  failures during {kind}", str(n))
    table.add_row("  unexplained failures", str(len(online["unexplained"])))
    table.add_row("OfflineJobs finished / unfinished",
                  f"{offline['jobs_finished']} / {offline['jobs_unfinished']}")
    table.add_row("offline requests checked", str(offline["requests"]))
    table.add_row("custom_ids lost / duplicated", f"{offline['lost']} / {offline['duplicated']}")
    table.add_row("latency model in force", str(report["latency_model"]))
    table.add_row("held", "yes" if verdict["held"] else "NO")
    console.print(table)
