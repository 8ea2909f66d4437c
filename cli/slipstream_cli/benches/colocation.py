"""``slipstream bench colocation``: the six co-location policies on one trace, HyGen-style.

One invocation, one trace, one model, one set of SLOs: ``online-only``,
``offline-only``, ``naive`` (Sarathi++), ``static-cap`` (HyGen*, its cap
profiled so the SLOs hold on the trace's busiest window), ``budget`` and
``budget-psm`` (HyGen, the budget found by the SLO-aware profiler's test runs).
All run as the sidecar ships them (dispatcher in front of vLLM's priority
scheduler). Beside them, labelled ``mode: in-engine`` in the JSON and
``[in-engine]`` in the table, the ``budget`` policy with the planner's
ITERATION mode inside the engine, its own budgets profiled the same way: what
an engine plugin would add, never a sidecar figure (``--in-engine`` picks
the loads it runs at, ``--in-engine none`` skips it).

The arrival rate is scaled so that online-only serving keeps the GPU busy
about 30 % of the time (factor found by bisection and printed), and the table
is repeated at about 15 % and 50 % busy.

Default: Azure conversation dev trace, a 600 s (virtual) window from its
start after rate scaling, llama-2-7b on a100, arXiv-summarisation backlog,
SLOs ``ttft:p99:+10%`` and ``tbt:p99:+10%``. The window is a benchmark-time
compromise and is printed and recorded in the JSON.

Deliberately left out: asserting the targets (the write-up reports them,
met or not).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from slipstream_cli import plots
from slipstream_cli.commands.sim import (
    PolicyRun,
    RichProgress,
    Scenario,
    add_engine_argument,
    add_scenario_arguments,
    engine_factory_from_args,
    in_engine_factory_from_args,
    load_offline,
    load_trace,
    rows_table,
    run_policy,
    search_doc,
    summary_row,
)
from slipstream_scheduler.budget import parse_slo
from slipstream_scheduler.engine.model import EngineConfig, EngineModel
from slipstream_scheduler.sim.workload import SimRequest, scale_rate, window

ORDER = ("online-only", "offline-only", "naive", "static-cap", "budget", "budget-psm")
DEFAULT_SLOS = ("ttft:p99:+10%", "tbt:p99:+10%")


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The scenario, the 600 s window, ``--json`` and ``--target-busy``: what every bench on
    the default co-location setting takes (``bench colocation``, ``bench tolerance``)."""
    add_scenario_arguments(parser)
    parser.set_defaults(duration_s=600.0, rate_scale=None)
    parser.add_argument("--json", type=Path, required=True, help="write the JSON report here")
    parser.add_argument("--target-busy", type=float, default=0.30, help="online-only busy fraction")
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="step the engine with vLLM's async scheduling, vLLM's default: a step's host "
        "overhead overlaps the GPU's work (EngineConfig.async_scheduling; the engine model "
        "only)",
    )


def load_setting(
    args: argparse.Namespace,
) -> tuple[tuple[SimRequest, ...], tuple[SimRequest, ...], EngineConfig]:
    """The online trace, the offline set and the engine that :func:`add_load_arguments` name."""
    engine = EngineConfig(
        model=args.model,
        gpu=args.gpu,
        long_prefill_token_threshold=args.long_prefill_tokens,
        async_scheduling=args.async_scheduling,
    )
    return load_trace(args.trace), load_offline(args.offline, args.offline_path), engine


def servable(
    full: tuple[SimRequest, ...], engine: EngineConfig
) -> tuple[tuple[SimRequest, ...], int]:
    """The trace's requests whose prompt fits the engine's KV cache, and how many do not:
    vLLM refuses those at the door (the prompt reaches ``max_model_len``, which the KV
    cache bounds), so no scheduler could serve them (Mooncake has prompts of up to 125k
    tokens against about 104k of KV on llama-2-7b / A100). Outputs that would overflow
    the cache stop at its end, as in vLLM."""
    cap = EngineModel(engine).pool.num_blocks * engine.block_size
    kept = tuple(r for r in full if r.prompt_tokens < cap)
    return kept, len(full) - len(kept)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_load_arguments(parser)
    add_engine_argument(parser)
    parser.add_argument(
        "--extra-busy",
        type=float,
        nargs="*",
        default=[0.15, 0.50],
        help="more loads to report (busy fractions); none: only the target",
    )
    parser.add_argument("--policies", nargs="*", default=list(ORDER), help="subset to run")
    parser.add_argument(
        "--curve",
        action="store_true",
        help="profile the planner's latency model with the token-curve feature set as a "
        "candidate, as the shipped profiles are (`slipstream profile latency --curve`); it "
        "prices small mixed steps within a few %% where the hinge sets are off by up to 20 %%. "
        "Every row uses the same model",
    )
    parser.add_argument(
        "--in-engine",
        default="all",
        choices=("all", "default", "none"),
        help="loads that also get an in-engine budget row (planner inside the engine, "
        "its own profiled budgets): all (default), default (the target load only), none",
    )
    parser.add_argument(
        "--plugin-overhead-us",
        type=float,
        nargs=2,
        metavar=("STEP", "PER_SEQ"),
        default=[0.0, 0.0],
        help="host time the engine plugin adds to each in-engine step: microseconds per step "
        "and per scheduled sequence (bench plugin-overhead measures it); default 0 0",
    )
    parser.add_argument(
        "--no-idle-search",
        action="store_true",
        help="budget policies: HyGen's single budget only (no idle budget searched); "
        "the 'before' configuration of docs/benchmarks/colocation.md",
    )


def _timing_options_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--async-scheduling`` and ``--plugin-overhead-us``, if anything."""
    step_us, per_seq_us = args.plugin_overhead_us
    if not (0.0 <= step_us <= 1e6 and 0.0 <= per_seq_us <= 1e4):
        return "--plugin-overhead-us takes STEP in 0..1e6 and PER_SEQ in 0..1e4 microseconds"
    if args.engine != "model" and (args.async_scheduling or step_us or per_seq_us):
        return ("--async-scheduling and --plugin-overhead-us time the engine model's steps; "
                "with --engine vllm the plugin itself runs")
    return None


def _online(
    full: tuple[SimRequest, ...], factor: float, start: float, dur: float
) -> tuple[SimRequest, ...]:
    return window(scale_rate(full, factor), start, dur)


BUSY_TOLERANCE = 0.05
"""How far the online-only busy fraction may land from the one asked for."""


def find_rate_scale(
    full: tuple[SimRequest, ...],
    engine: EngineConfig,
    start: float,
    dur: float,
    target: float,
    *,
    on: dict[str, Any] | None = None,
) -> tuple[float, float]:
    """Rate factor whose online-only run is busy ``target`` of the time (bisection in log space).

    ``on``: the engine that runs it (:class:`Scenario`'s ``engine_name``/``engine_factory``).
    """
    on = on or {}
    lo, hi = math.log(0.002), math.log(4.0)
    best = (1.0, math.nan)
    for _ in range(10):
        mid = 0.5 * (lo + hi)
        f = math.exp(mid)
        scn = Scenario(_online(full, f, start, dur), (), dur, engine, **on)
        busy = scn.run("online-only").metrics.busy_fraction
        best = (f, busy)
        if abs(busy - target) < 0.01:
            break
        if busy < target:
            lo = mid
        else:
            hi = mid
    return best


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 140))
    t_start = time.perf_counter()
    step_us, per_seq_us = args.plugin_overhead_us
    problem = _timing_options_problem(args)
    if problem:
        print(f"slipstream bench colocation: error: {problem}", file=sys.stderr)
        return 2
    full, offline, engine = load_setting(args)
    full, refused = servable(full, engine)
    if refused:
        console.print(
            f"{refused} online request(s) of the trace are left out: their prompts exceed the "
            f"engine's KV cache, so vLLM would refuse them"
        )
    on: dict[str, Any] = {
        "engine_name": args.engine,
        "engine_factory": engine_factory_from_args(
            args, "slipstream bench colocation", ["bench", "colocation"]
        ),
        "in_engine_factory": in_engine_factory_from_args(args),
        "in_engine_overhead_s": (step_us * 1e-6, per_seq_us * 1e-6),
    }
    slos = tuple(parse_slo(s) for s in (args.slo or DEFAULT_SLOS))
    dur = float(args.duration_s)
    loads: list[tuple[float | None, float, float]] = []  # (target busy, factor, busy)
    targets = [args.target_busy, *(args.extra_busy or [])]
    for i, target in enumerate(targets):
        if i == 0 and args.rate_scale is not None:
            scn0 = Scenario(
                _online(full, args.rate_scale, args.start_s, dur), (), dur, engine, **on
            )
            busy = scn0.run("online-only").metrics.busy_fraction
            loads.append((None, args.rate_scale, busy))
        else:
            f, busy = find_rate_scale(full, engine, args.start_s, dur, target, on=on)
            if abs(busy - target) > BUSY_TOLERANCE:
                print(
                    f"slipstream bench colocation: error: no rate scale gives online-only busy "
                    f"{target:.2f} in this window (closest: rate scale {f:.4f}, busy "
                    f"{busy:.3f}); the requests at the window's start decide it whatever the "
                    f"rate. Try a longer --duration-s or another --start-s.",
                    file=sys.stderr,
                )
                return 2
            loads.append((target, f, busy))
        console.print(
            f"load {i}: target busy {target:.2f} -> rate scale {loads[-1][1]:.4f}, "
            f"online-only busy {loads[-1][2]:.3f}"
        )
    results: list[dict[str, Any]] = []
    cdf_series: dict[str, dict[str, Any]] = {}
    timelines: dict[str, Any] = {}
    for li, (target, factor, busy) in enumerate(loads):
        scn = Scenario(
            _online(full, factor, args.start_s, dur),
            offline,
            dur,
            engine,
            slos=slos,
            seed=args.seed,
            idle_budget_s=args.idle_budget,
            search_idle=not args.no_idle_search,
            label=args.trace or "azure-conv-dev",
            latency_curve=args.curve,
            **on,
        )
        rows: list[dict[str, Any]] = []
        searches: dict[str, Any] = {}
        with RichProgress(console) as bar:
            scn.progress = bar
            for pol in [p for p in ORDER if p in args.policies]:
                # Each budget policy profiles its own knobs: PSM changes which
                # requests run together, so budget's knobs need not hold for it
                # (reusing them broke an SLO at 15 % and 50 % busy before).
                pr = run_policy(scn, pol)
                rows.append(summary_row(pr, scn))
                if pr.search is not None:
                    searches[pol] = search_doc(pr.search)
                if pr.idle_search is not None:
                    searches[f"{pol}:idle"] = search_doc(pr.idle_search)
                _keep_plots(li, pol, pr, cdf_series, timelines)
            if "budget" in args.policies and (
                args.in_engine == "all" or (args.in_engine == "default" and li == 0)
            ):
                # What an engine plugin would add: the same policy with the planner
                # inside the engine, its own two budgets profiled the same way.
                pr = run_policy(scn, "budget", mode="in-engine")
                rows.append(summary_row(pr, scn))
                if pr.search is not None:
                    searches["budget[in-engine]"] = search_doc(pr.search)
                if pr.idle_search is not None:
                    searches["budget[in-engine]:idle"] = search_doc(pr.idle_search)
                _keep_plots(li, "budget [in-engine]", pr, cdf_series, timelines)
                if "static-cap" in args.policies:
                    # HyGen* inside the engine: a fixed offline token count per step.
                    pr = run_policy(scn, "static-cap", mode="in-engine")
                    rows.append(summary_row(pr, scn))
                    if pr.search is not None:
                        searches["static-cap[in-engine]"] = search_doc(pr.search)
        console.print(
            rows_table(
                rows,
                f"co-location, rate scale {factor:.4f} (online-only busy {busy:.2f}), "
                f"window {dur:.0f} s, SLOs {', '.join(map(str, slos))}",
            )
        )
        verdict = _targets(rows)
        for line in verdict["lines"]:
            console.print(line)
        results.append(
            {
                "target_busy": target,
                "rate_scale": factor,
                "online_only_busy_fraction": busy,
                "rows": rows,
                "searches": searches,
                "targets": verdict["values"],
            }
        )
    doc = {
        "schema": "slipstream.bench.colocation/v1",
        "trace": args.trace or "azure_llm_2023/AzureLLMInferenceTrace_conv.dev.csv",
        "window": {
            "start_s": args.start_s,
            "duration_s": dur,
            "note": "virtual seconds after rate scaling",
        },
        "model": args.model,
        "gpu": args.gpu,
        "long_prefill_tokens": args.long_prefill_tokens,
        "latency_curve": args.curve,
        "online_refused": refused,
        "idle_budget_s": args.idle_budget,
        "idle_search": not args.no_idle_search,
        "engine": args.engine,
        "async_scheduling": args.async_scheduling,
        "plugin_overhead_us": {"step": step_us, "per_seq": per_seq_us},
        "in_engine": args.in_engine,
        "row_modes": {
            "sidecar": "what the sidecar achieves (dispatcher in front of vLLM's scheduler)",
            "in-engine": "the planner inside the engine: what an engine plugin would add; "
            "never a sidecar figure",
        },
        "offline": args.offline,
        "slos": [str(s) for s in slos],
        "rate_scale": loads[0][1],
        "online_only_busy_fraction": loads[0][2],
        "rows": results[0]["rows"],
        "loads": results,
        "wall_s": time.perf_counter() - t_start,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    stem = args.json.with_suffix("")
    plots.latency_cdfs(cdf_series, Path(f"{stem}-latency.png"), "online latency CDFs per policy")
    plots.throughput_timeline(timelines, Path(f"{stem}-throughput.png"), "throughput over time")
    plots.grouped_bars(
        [f"busy {r['online_only_busy_fraction']:.2f}" for r in results],
        {
            **{
                pol: [
                    next(
                        (
                            x["offline_tokens_per_s"]
                            for x in r["rows"]
                            if x["policy"] == pol and x["mode"] == "sidecar"
                        ),
                        0.0,
                    )
                    for r in results
                ]
                for pol in ORDER
                if pol in args.policies and pol != "online-only"
            },
            **(
                {
                    "budget [in-engine]": [
                        next(
                            (
                                x["offline_tokens_per_s"]
                                for x in r["rows"]
                                if x["mode"] in ("in-engine", "plugin") and x["policy"] == "budget"
                            ),
                            0.0,
                        )
                        for r in results
                    ]
                }
                if args.in_engine != "none" and "budget" in args.policies
                else {}
            ),
        },
        Path(f"{stem}-offline.png"),
        ylabel="offline tokens/s",
        title="offline throughput per policy and load",
    )
    console.print(f"wrote {args.json} and PNGs beside it ({time.perf_counter() - t_start:.0f} s)")
    return 0


def _keep_plots(
    li: int,
    label: str,
    pr: PolicyRun,
    cdf_series: dict[str, dict[str, Any]],
    timelines: dict[str, Any],
) -> None:
    """Latency CDFs and throughput timelines are plotted for the target load only."""
    if li != 0:
        return
    s = pr.result.metrics.samples
    if label != "offline-only":
        cdf_series[label] = {"ttft": s["online_ttft"], "tbt": s["online_tbt"]}
    if label in ("naive", "static-cap", "budget", "budget-psm", "offline-only"):
        timelines[label] = pr.result.metrics.timeline
    if label == "budget [in-engine]":
        timelines[label] = pr.result.metrics.timeline


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["policy"]: r for r in rows if r.get("mode", "sidecar") == "sidecar"}
    inside = [r for r in rows if r.get("mode") in ("in-engine", "plugin")]
    ie = next((r for r in inside if r["policy"] == "budget"), None)
    ics = next((r for r in inside if r["policy"] == "static-cap"), None)
    vals: dict[str, Any] = {}
    lines: list[str] = []
    b, n, c, o = by.get("budget"), by.get("naive"), by.get("static-cap"), by.get("offline-only")
    if b and n:
        vals["budget_meets_slo"] = b["slo_met"]
        vals["naive_breaks_slo"] = n["slo_met"] is False
        lines.append(
            f"budget meets every SLO: {b['slo_met']}; naive breaks them: {n['slo_met'] is False}"
        )
    if b and c:
        ratio = (
            b["offline_tokens_per_s"] / c["offline_tokens_per_s"]
            if c["offline_tokens_per_s"]
            else math.inf
        )
        vals["budget_over_static_cap"] = None if math.isinf(ratio) else ratio
        lines.append(f"budget offline / static-cap offline: {ratio:.2f}x (target >= 2x)")
    if b and o and o["offline_tokens_per_s"]:
        frac = b["offline_tokens_per_s"] / o["offline_tokens_per_s"]
        vals["budget_over_offline_only"] = frac
        lines.append(f"budget offline / offline-only: {frac:.1%} (target >= 85%)")
    if ie and o and o["offline_tokens_per_s"]:
        frac = ie["offline_tokens_per_s"] / o["offline_tokens_per_s"]
        vals["in_engine_meets_slo"] = ie["slo_met"]
        vals["in_engine_over_offline_only"] = frac
        lines.append(
            f"in-engine budget (what a plugin would add, not the sidecar): SLOs met "
            f"{ie['slo_met']}, offline / offline-only {frac:.1%}"
        )
    if ics and o and o["offline_tokens_per_s"]:
        frac = ics["offline_tokens_per_s"] / o["offline_tokens_per_s"]
        vals["in_engine_static_cap_over_offline_only"] = frac
        lines.append(
            f"in-engine static cap ({ics['static_cap']} offline tokens per step): SLOs met "
            f"{ics['slo_met']}, offline / offline-only {frac:.1%}"
        )
    return {"values": vals, "lines": lines}
