"""``slipstream sim``: replay an online trace, with offline work, through the engine model.

Runs the deployment Slipstream ships (the sidecar's dispatcher in front of
vLLM's priority scheduler, see ``docs/concepts/simulator.md``) in virtual
time and reports per-class metrics: a rich table on the terminal, a JSON
document (``--json``; fields in ``docs/concepts/simulator.md``) and PNG plots
(latency CDFs per class, throughput over time against the online load).

``--slo`` takes ``METRIC:STAT:LIMIT`` (``ttft:p99:2s``, ``tbt:mean:60ms``,
``tbt:p99:+10%``: within 10 % of online-only serving on the same trace; may
repeat, all must hold). With SLOs the ``budget`` policies search their budget
(HyGen's profiler) and ``static-cap`` its cap, unless ``--budget`` /
``--static-cap`` fix them.

This module also holds the setup the benchmarks share (:class:`Scenario`,
:func:`run_policy`). Deliberately left out: anything cluster-related.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from slipstream_cli import plots
from slipstream_cli.argtypes import whole
from slipstream_cli.workloads import WorkloadError, arxiv, azure, mmlu, mooncake
from slipstream_scheduler.budget import (
    Observed,
    SearchResult,
    Slo,
    bisect_largest,
    judge,
    parse_slo,
    search_budget,
)
from slipstream_scheduler.dispatcher import DispatcherConfig
from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.sim.simulator import (
    POLICIES,
    EngineFactory,
    InEngineFactory,
    SimConfig,
    SimResult,
    floor_step_s,
    full_step_s,
    online_only_step_s,
    profile_latency_model,
    simulate,
)
from slipstream_scheduler.sim.workload import SimRequest, Workload, scale_rate, window

logger = logging.getLogger(__name__)

SCHEMA = "slipstream.sim/v1"
MODES = ("sidecar", "in-engine")
Mode = Literal["sidecar", "in-engine"]
DEFAULT_LONG_PREFILL = 256
OFFLINE_SETS = ("arxiv", "mmlu", "none")
ENGINES = ("model", "vllm")


# ---------------------------------------------------------------------------- workloads


def load_trace(path: str | None) -> tuple[SimRequest, ...]:
    """Online arrivals: Azure CSV (``.csv``) or Mooncake JSONL (``.jsonl``); default Azure conv."""
    if path is None:
        return azure.load()
    p = Path(path)
    if p.suffix == ".jsonl":
        return mooncake.load(p)
    if p.suffix == ".csv":
        return azure.load(p)
    raise WorkloadError("trace must be an Azure .csv or a Mooncake .jsonl", p)


def load_offline(name: str, path: str | None = None) -> tuple[SimRequest, ...]:
    """Offline work by dataset name: ``arxiv`` (lengths), ``mmlu`` (5-shot prompts), ``none``."""
    if name == "arxiv":
        return arxiv.load(path, limit=4000)
    if name == "mmlu":
        return mmlu.load(path)
    if name == "none":
        return ()
    raise WorkloadError(f"unknown offline dataset {name!r}; choose from {OFFLINE_SETS}")


def peak_window(online: Sequence[SimRequest], length_s: float) -> float:
    """Start of the ``length_s`` window with the most online tokens (prompt + output)."""
    if not online:
        return 0.0
    best, best_start, j, acc = -1.0, 0.0, 0, 0.0
    for i, r in enumerate(online):
        acc += r.prompt_tokens + r.output_tokens
        while online[j].arrival_s < r.arrival_s - length_s:
            acc -= online[j].prompt_tokens + online[j].output_tokens
            j += 1
        if acc > best:
            best, best_start = acc, online[j].arrival_s
        del i
    return best_start


# ---------------------------------------------------------------------------- scenario


@dataclass(slots=True)
class Scenario:
    """One trace, model, offline set and SLOs; policies run against it share everything."""

    online: tuple[SimRequest, ...]
    offline: tuple[SimRequest, ...]
    duration_s: float
    engine: EngineConfig
    slos: tuple[Slo, ...] = ()
    seed: int = 0
    idle_budget_s: float | None = None
    search_idle: bool = False  # budget policies: also profile the idle budget (two-knob search)
    backlog: bool = True
    label: str = ""
    profile_window_s: float = 300.0
    latency_model: LinearLatencyModel | None = None
    baseline: SimResult | None = None
    progress: Callable[[str, float, float], None] | None = None
    cache: dict[tuple[Any, ...], SimResult] = field(default_factory=dict)
    latency_curve: bool = False
    """Profile the planner's latency model with the token-curve feature set as a candidate."""
    engine_name: str = "model"
    """What chooses every batch: ``model`` (the engine model) or ``vllm`` (vLLM's scheduler)."""
    engine_factory: EngineFactory | None = None
    in_engine_factory: InEngineFactory | None = None
    """``mode="in-engine"`` on vLLM: vLLM's scheduler under Slipstream's plugin."""
    in_engine_overhead_s: tuple[float, float] = (0.0, 0.0)
    """``mode="in-engine"``: the host time the plugin adds per step and per scheduled
    sequence (``EngineConfig.scheduler_overhead_s`` and ``..._per_seq_s``)."""

    def engine_for(self, mode: Mode) -> EngineConfig:
        """The engine a run of ``mode`` steps: in-engine runs carry the plugin's overhead."""
        step_s, per_seq_s = self.in_engine_overhead_s
        if mode != "in-engine" or (step_s == 0.0 and per_seq_s == 0.0):
            return self.engine
        return self.engine.model_copy(
            update={"scheduler_overhead_s": step_s, "scheduler_overhead_per_seq_s": per_seq_s}
        )

    def model(self) -> LinearLatencyModel:
        if self.latency_model is None:
            self.latency_model = profile_latency_model(
                self.engine, seed=self.seed, curve=self.latency_curve
            )
        return self.latency_model

    def workload(
        self, online: tuple[SimRequest, ...] | None = None, horizon: float | None = None
    ) -> Workload:
        on = self.online if online is None else online
        h = self.duration_s if horizon is None else horizon
        if self.backlog and self.offline:
            return Workload(on, self.offline, offline_backlog=True, horizon_s=h, name=self.label)
        return Workload(on, self.offline, offline_backlog=False, horizon_s=None, name=self.label)

    def run(
        self,
        policy: str,
        *,
        budget_s: float | None = None,
        static_cap: int = 16,
        online: tuple[SimRequest, ...] | None = None,
        horizon: float | None = None,
        tag: str = "",
        idle_budget_s: float | None = None,
        mode: Mode = "sidecar",
    ) -> SimResult:
        idle = self.idle_budget_s if idle_budget_s is None else idle_budget_s
        key = (policy, budget_s, static_cap, id(online), horizon, idle, mode)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        ttft = tbt = None
        for s in self.slos:
            if s.limit_s is not None and s.metric == "ttft":
                ttft = s.limit_s
            if s.limit_s is not None and s.metric == "tbt":
                tbt = s.limit_s
        cfg = SimConfig(
            engine=self.engine_for(mode),
            policy=policy,
            budget_s=budget_s,
            static_cap=static_cap,
            seed=self.seed,
            ttft_target_s=ttft,
            tbt_target_s=tbt,
            dispatcher=DispatcherConfig(idle_budget_s=idle),
            mode=mode,
        )
        wl = self.workload(online, horizon)
        span = wl.horizon_s or (wl.end_of_arrivals_s or 1.0)
        cb = None
        if self.progress is not None:
            prog = self.progress
            label = f"{policy}{'' if mode == 'sidecar' else ' [' + mode + ']'}{tag}"

            def cb(t: float) -> None:
                prog(label, t, span)

        needs_model = POLICIES[policy].admission == "budget" or mode == "in-engine"
        model = self.model() if needs_model else None
        res = simulate(
            wl,
            cfg,
            latency_model=model,
            progress=cb,
            engine_factory=self.engine_factory,
            in_engine_factory=self.in_engine_factory if mode == "in-engine" else None,
        )
        self.cache[key] = res
        return res

    def baseline_observed(self) -> Observed:
        if self.baseline is None:
            self.baseline = self.run("online-only")
        return self.baseline.observed()


@dataclass(frozen=True, slots=True)
class PolicyRun:
    """One policy's result on a scenario, with how its knob was chosen."""

    policy: str
    result: SimResult
    budget_s: float | None
    static_cap: int | None
    search: SearchResult | None
    wall_s: float
    idle_budget_s: float | None = None
    idle_search: SearchResult | None = None
    mode: Mode = "sidecar"

    def checks(self, scenario: Scenario) -> list[dict[str, Any]]:
        base = (
            scenario.baseline_observed()
            if any(s.tolerance is not None for s in scenario.slos)
            else None
        )
        return [
            {"slo": c.slo, "limit_s": c.limit_s, "observed_s": _num(c.observed_s), "met": c.met}
            for c in judge(scenario.slos, self.result.observed(), base)
        ]

    def slo_met(self, scenario: Scenario) -> bool | None:
        if not scenario.slos or not POLICIES[self.policy].serves_online:
            return None
        return all(c["met"] for c in self.checks(scenario))


def _num(x: float) -> float | None:
    return None if x is None or math.isnan(x) else float(x)


def search_static_cap(scn: Scenario, hi: int | None = None, mode: Mode = "sidecar") -> SearchResult:
    """The largest static cap meeting every SLO on the trace's busiest window.

    Sidecar: offline requests in flight, 0..64. In-engine (the plugin): offline tokens
    per step, 0..the token cap, a granularity where a cap can be non-zero under a tight
    TBT SLO (one offline request in flight is already a whole prefill chunk per step).
    """
    if hi is None:
        hi = scn.engine.max_num_batched_tokens if mode == "in-engine" else 64
    length = min(scn.profile_window_s, scn.duration_s)
    start = peak_window(scn.online, length)
    peak = window(scn.online, start, length)
    base_peak = scn.run("online-only", online=peak, horizon=length, tag=" (peak)").observed()
    unit = " tokens/step" if mode == "in-engine" else ""
    return bisect_largest(
        lambda c: scn.run(
            "static-cap",
            static_cap=int(c),
            online=peak,
            horizon=length,
            tag=f" cap={int(c)}{unit}",
            mode=mode,
        ).observed(),
        scn.slos,
        0,
        hi,
        baseline=base_peak,
        iterations=12 if mode == "in-engine" else 8,
        integer=True,
    )


def search_policy_budget(
    scn: Scenario, policy: str, *, idle_budget_s: float | None = None, mode: Mode = "sidecar"
) -> SearchResult:
    """HyGen's profiler: the largest per-iteration budget meeting every SLO on the scenario.

    ``idle_budget_s`` (when given) is held fixed for every trial, and the range
    starts at the cheapest step (:func:`floor_step_s`, no offline work next to
    online work) rather than at a small decode step, which may already exceed a
    tight TBT limit when offline decodes fill it.
    """
    model = scn.model()
    lo = online_only_step_s(scn.engine, model)
    if idle_budget_s is not None:
        lo = floor_step_s(scn.engine, model)
    return _bisect_knob(
        scn,
        lo,
        lambda b: scn.run(
            policy,
            budget_s=b,
            idle_budget_s=idle_budget_s,
            tag=f" budget={b * 1000:.1f}ms",
            mode=mode,
        ).observed(),
    )


def search_idle_budget(scn: Scenario, policy: str, mode: Mode = "sidecar") -> SearchResult:
    """The largest idle budget meeting every SLO, the online budget held at its safe end.

    First knob of the two-knob search (``docs/benchmarks/colocation.md``): the
    online budget is fixed at the cheapest step (:func:`floor_step_s`: no
    offline work shares a step with online work) and the idle budget, which
    bounds the step an arriving online request may find in progress, is
    bisected between a small decode step and a full token-cap prefill step.
    The TTFT SLO usually governs it.
    """
    model = scn.model()
    floor = floor_step_s(scn.engine, model)
    return _bisect_knob(
        scn,
        online_only_step_s(scn.engine, model),
        lambda b: scn.run(
            policy, budget_s=floor, idle_budget_s=b, tag=f" idle={b * 1000:.1f}ms", mode=mode
        ).observed(),
    )


def _bisect_knob(scn: Scenario, lo: float, run: Callable[[float], Observed]) -> SearchResult:
    """One knob bisected from ``lo`` up to a full token-cap step against the SLOs (relative
    SLOs against the scenario's online-only baseline)."""
    base = scn.baseline_observed() if any(s.tolerance is not None for s in scn.slos) else None
    return search_budget(
        run, scn.slos, lo, full_step_s(scn.engine, scn.model()), baseline=base, iterations=7
    )


def run_policy(
    scn: Scenario,
    policy: str,
    *,
    budget_s: float | None = None,
    static_cap: int | None = None,
    idle_budget_s: float | None = None,
    mode: Mode = "sidecar",
) -> PolicyRun:
    """Run one policy, searching its knob(s) against the SLOs when not given.

    With ``scn.search_idle`` a budget policy's idle budget is searched first
    (:func:`search_idle_budget`), then its online budget with that idle budget
    (:func:`search_policy_budget`); ``idle_budget_s`` given skips the first.
    ``mode="in-engine"`` (budget and static-cap policies) runs and searches the planner's
    ITERATION mode inside the engine (:mod:`slipstream_scheduler.sim.inengine`):
    what an engine plugin would add, never a sidecar figure.
    """
    t0 = time.perf_counter()
    search: SearchResult | None = None
    idle_search: SearchResult | None = None
    spec = POLICIES[policy]
    if mode != "sidecar" and spec.admission not in ("budget", "static-cap"):
        raise WorkloadError(f"--mode {mode} needs a budget or static-cap policy, not {policy}")
    idle = idle_budget_s if idle_budget_s is not None else scn.idle_budget_s
    if spec.admission == "budget" and scn.search_idle and idle is None:
        if not scn.slos:
            raise WorkloadError("the idle budget search needs at least one --slo")
        idle_search = search_idle_budget(scn, policy, mode)
        idle = idle_search.value  # None: no idle budget meets the SLOs; HyGen's rule only
    if spec.admission == "budget" and budget_s is None:
        if not scn.slos:
            raise WorkloadError("a budget policy needs --budget or at least one --slo")
        search = search_policy_budget(scn, policy, idle_budget_s=idle, mode=mode)
        budget_s = search.value if search.value is not None else search.lo
    if policy == "static-cap" and static_cap is None:
        if not scn.slos:
            raise WorkloadError("static-cap needs --static-cap or at least one --slo")
        search = search_static_cap(scn, mode=mode)
        static_cap = int(search.value) if search.value is not None else 0
    is_budget = spec.admission == "budget"
    res = scn.run(
        policy,
        budget_s=budget_s,
        static_cap=static_cap if static_cap is not None else 16,
        idle_budget_s=idle if is_budget else None,
        mode=mode,
    )
    return PolicyRun(
        policy,
        res,
        budget_s if is_budget else None,
        static_cap if policy == "static-cap" else None,
        search,
        time.perf_counter() - t0,
        idle if is_budget else None,
        idle_search,
        mode,
    )


# ---------------------------------------------------------------------------- reporting


def summary_row(run: PolicyRun, scn: Scenario) -> dict[str, Any]:
    """The flat per-policy row of the JSON documents (field names documented in the docs)."""
    m = run.result.metrics
    on, off = m.online, m.offline
    return {
        "policy": run.policy,
        "engine": scn.engine_name,
        # The planner inside vLLM's own scheduler is Slipstream's plugin.
        "mode": "plugin" if run.mode == "in-engine" and scn.engine_name == "vllm" else run.mode,
        "slo_met": run.slo_met(scn),
        "ttft_p99_s": _num(on.ttft.p99),
        "tbt_p99_s": _num(on.tbt.p99),
        "ttft_mean_s": _num(on.ttft.mean),
        "tbt_mean_s": _num(on.tbt.mean),
        "ttft_p50_s": _num(on.ttft.p50),
        "tbt_p50_s": _num(on.tbt.p50),
        "ttlt_mean_s": _num(on.ttlt.mean),
        "online_tokens_per_s": on.tokens_per_s,
        "offline_tokens_per_s": off.tokens_per_s,
        "offline_prompt_tokens_done": off.prompt_tokens_done,
        "busy_fraction": m.busy_fraction,
        "prefix_hit_rate": m.prefix_hit_rate,
        "preemptions_engine": m.engine_preemptions,
        "preemptions_dispatcher": m.dispatcher_preemptions,
        "offline_finished": off.finished,
        "preemptions_per_offline_finished": (
            m.dispatcher_preemptions / off.finished if off.finished else None
        ),
        "max_request_preemptions": m.max_request_preemptions,
        "discarded_kv_tokens": m.discarded_kv_tokens,
        "prefill_tokens_computed": m.prefill_tokens_computed,
        "budget_s": run.budget_s,
        "idle_budget_s": run.idle_budget_s,
        "static_cap": run.static_cap,
        "in_engine": dict(run.result.in_engine) if run.mode == "in-engine" else None,
        "wall_s": run.wall_s,
    }


def search_doc(search: SearchResult | None) -> dict[str, Any] | None:
    if search is None:
        return None
    return {
        "value": search.value,
        "lo": search.lo,
        "hi": search.hi,
        "trials": [
            {
                "value": t.value,
                "met": t.met,
                "observed": {k: _num(v) for k, v in t.observed.items()},
                "checks": [
                    {
                        "slo": c.slo,
                        "limit_s": c.limit_s,
                        "observed_s": _num(c.observed_s),
                        "met": c.met,
                    }
                    for c in t.checks
                ],
            }
            for t in search.trials
        ],
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def rows_table(rows: Sequence[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in (
        "policy",
        "SLO",
        "TTFT p99 ms",
        "TTFT mean ms",
        "TBT p99 ms",
        "TBT mean ms",
        "online tok/s",
        "offline tok/s",
        "aborts/offline req",
        "busy",
        "knob",
    ):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        knob = (
            f"budget {r['budget_s'] * 1000:.1f} ms"
            + (f", idle {r['idle_budget_s'] * 1000:.0f} ms" if r.get("idle_budget_s") else "")
            if r.get("budget_s")
            else (
                (
                    f"{r['static_cap']} tok/step"
                    if r.get("mode") in ("in-engine", "plugin")
                    else f"cap {r['static_cap']}"
                )
                if r.get("static_cap") is not None
                else ""
            )
        )
        met = r["slo_met"]
        t.add_row(
            # rich markup: "\\[" prints a literal bracket
            r["policy"] + ("" if r.get("mode", "sidecar") == "sidecar" else f" \\[{r['mode']}]"),
            "-" if met is None else ("[green]met[/]" if met else "[red]broken[/]"),
            _ms(r["ttft_p99_s"]),
            _ms(r["ttft_mean_s"]),
            _ms(r["tbt_p99_s"]),
            _ms(r["tbt_mean_s"]),
            f"{r['online_tokens_per_s']:.0f}",
            f"{r['offline_tokens_per_s']:.0f}",
            "-"
            if r.get("preemptions_per_offline_finished") is None
            else f"{r['preemptions_per_offline_finished']:.2f}",
            f"{r['busy_fraction']:.2f}",
            knob,
        )
    return t


class RichProgress:
    """A rich progress bar, one task per simulation label."""

    def __init__(self, console: Console) -> None:
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>5.1f}% of virtual time"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> RichProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)

    def __call__(self, label: str, t: float, span: float) -> None:
        task = self._tasks.get(label)
        if task is None:
            task = self._tasks[label] = self.bar.add_task(label, total=span)
        self.bar.update(task, completed=min(t, span))


# ---------------------------------------------------------------------------- CLI


def add_scenario_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", help="Azure .csv or Mooncake .jsonl (default: Azure conv dev)")
    parser.add_argument(
        "--offline", default="arxiv", help=f"offline dataset: {', '.join(OFFLINE_SETS)}"
    )
    parser.add_argument(
        "--offline-path", help="file/folder of the offline dataset (default: shared)"
    )
    parser.add_argument(
        "--no-backlog", action="store_true", help="offline set runs once (no cycling)"
    )
    parser.add_argument("--model", default="llama-2-7b", help="engine GPU profile model")
    parser.add_argument("--gpu", default="a100", help="engine GPU profile GPU")
    parser.add_argument(
        "--long-prefill-tokens",
        type=int,
        default=DEFAULT_LONG_PREFILL,
        help="vLLM --long-prefill-token-threshold of the engine (0: none); default 256",
    )
    parser.add_argument(
        "--slo", action="append", default=[], help="e.g. ttft:p99:2s, tbt:p99:+10%%"
    )
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    parser.add_argument(
        "--start-s", type=float, default=0.0, help="window start in the scaled trace"
    )
    parser.add_argument("--duration-s", type=float, help="window length, s (default: whole trace)")
    parser.add_argument(
        "--idle-budget",
        type=float,
        help="budget while no online request is in flight, s ('inf': unbounded); "
        "default: the budget always applies (HyGen)",
    )
    parser.add_argument("--seed", type=int, default=0)


def add_engine_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        default="model",
        choices=ENGINES,
        help="what chooses every batch: model (the engine model; default, faster) or vllm "
        "(vLLM's own v1 scheduler and KV manager in-process; needs `make vllm-env`); the "
        "engine model's GPU timing gives every step its duration either way",
    )


def engine_factory_from_args(
    args: argparse.Namespace, prog: str, command: Sequence[str]
) -> EngineFactory | None:
    """None for ``--engine model``; vLLM's scheduler for ``--engine vllm`` (re-executing
    ``slipstream COMMAND...`` under the real-vLLM interpreter, or a usage error, when vllm
    does not import here)."""
    if getattr(args, "engine", "model") != "vllm":
        return None
    from slipstream_cli.benches.fidelity_vllm import (
        require_vllm,
        slipstream_argv,
        vllm_engine_factory,
    )

    require_vllm(argparse.ArgumentParser(prog=prog), slipstream_argv(command))
    return cast(EngineFactory, vllm_engine_factory())


def in_engine_factory_from_args(args: argparse.Namespace) -> InEngineFactory | None:
    """vLLM's scheduler under Slipstream's plugin for ``--engine vllm`` (call after
    :func:`engine_factory_from_args`, which made sure vllm imports); None otherwise."""
    if getattr(args, "engine", "model") != "vllm":
        return None
    from slipstream_testbed.vllm.simplugin import plugin_in_engine_factory

    return cast(InEngineFactory, plugin_in_engine_factory())


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    online = load_trace(args.trace)
    if args.rate_scale != 1.0:
        online = scale_rate(online, args.rate_scale)
    end = online[-1].arrival_s if online else 0.0
    duration = args.duration_s if args.duration_s is not None else end - args.start_s
    online = window(online, args.start_s, duration)
    offline = load_offline(args.offline, args.offline_path)
    engine = EngineConfig(
        model=args.model, gpu=args.gpu, long_prefill_token_threshold=args.long_prefill_tokens
    )
    return Scenario(
        online=online,
        offline=offline,
        duration_s=duration,
        engine=engine,
        slos=tuple(parse_slo(s) for s in args.slo),
        seed=args.seed,
        idle_budget_s=args.idle_budget,
        backlog=not args.no_backlog,
        label=args.trace or "azure-conv-dev",
        engine_name=getattr(args, "engine", "model"),
        engine_factory=engine_factory_from_args(args, "slipstream sim", ["sim"]),
        in_engine_factory=in_engine_factory_from_args(args),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_scenario_arguments(parser)
    add_engine_argument(parser)
    parser.add_argument("--policy", default="budget", choices=sorted(POLICIES))
    parser.add_argument(
        "--mode",
        default="sidecar",
        choices=MODES,
        help="sidecar (default): what Slipstream ships, the dispatcher in front of vLLM. "
        "in-engine: the planner picks every iteration's batch inside the engine (budget "
        "and static-cap only; never a sidecar figure): with --engine vllm that is Slipstream's "
        "vLLM plugin inside vLLM's scheduler, with --engine model the engine model's stand-in",
    )
    parser.add_argument("--budget", type=float, help="per-iteration budget, s (budget policies)")
    parser.add_argument(
        "--static-cap",
        type=whole(0),
        help="static-cap: offline requests in flight at most (--mode in-engine: offline "
        "tokens per step at most)",
    )
    parser.add_argument("--json", type=Path, help="write the JSON report here")
    parser.add_argument("--plots", type=Path, help="folder for PNGs (default: beside --json)")


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 130))
    scn = scenario_from_args(args)
    t0 = time.perf_counter()
    with RichProgress(console) as bar:
        scn.progress = bar
        pr = run_policy(
            scn,
            args.policy,
            budget_s=args.budget,
            static_cap=args.static_cap,
            mode=cast(Mode, args.mode),
        )
    wall = time.perf_counter() - t0
    row = summary_row(pr, scn)
    console.print(
        rows_table(
            [row],
            f"slipstream sim: {scn.label}, {args.policy}, mode {args.mode}, engine {args.engine}",
        )
    )
    m = pr.result.metrics
    console.print(
        f"virtual {m.duration_s:.0f} s, {m.steps} steps, wall {wall:.1f} s; "
        f"online requests {m.online.requests}, offline finished {m.offline.finished}; "
        f"prefix hit rate {m.prefix_hit_rate:.3f}; offline aborts {m.dispatcher_preemptions} "
        f"(most for one request {m.max_request_preemptions}), KV tokens dropped by them "
        f"{m.discarded_kv_tokens}"
    )
    doc = {
        "schema": SCHEMA,
        "trace": scn.label,
        "policy": args.policy,
        "mode": args.mode,
        "engine": args.engine,
        "model": args.model,
        "gpu": args.gpu,
        "long_prefill_tokens": args.long_prefill_tokens,
        "rate_scale": args.rate_scale,
        "window": {"start_s": args.start_s, "duration_s": scn.duration_s},
        "offline": args.offline,
        "slos": [str(s) for s in scn.slos],
        "slo_checks": pr.checks(scn) if scn.slos else [],
        "summary": row,
        "metrics": m.to_dict(),
        "dispatcher": {
            "submitted": pr.result.dispatcher.submitted,
            "resumed": pr.result.dispatcher.resumed,
            "preemptions": pr.result.dispatcher.preemptions,
            "plans": pr.result.dispatcher.plans,
        },
        "search": search_doc(pr.search),
        "wall_s": wall,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    plot_dir = args.plots or (args.json.parent if args.json else None)
    if plot_dir is not None:
        stem = args.json.stem if args.json else f"sim-{args.policy}"
        s = m.samples
        plots.latency_cdfs(
            {
                "online": {"ttft": s["online_ttft"], "tbt": s["online_tbt"]},
                "offline": {"ttft": s["offline_ttft"], "tbt": s["offline_tbt"]},
            },
            plot_dir / f"{stem}-latency.png",
            f"{args.policy}: latency CDFs per class",
        )
        plots.throughput_timeline(
            {args.policy: m.timeline}, plot_dir / f"{stem}-throughput.png", "throughput over time"
        )
        console.print(f"wrote plots to {plot_dir}")
    return 0
