"""``slipstream bench tolerance``: offline throughput bought by each SLO tolerance.

``bench colocation`` answers "how much offline work fits under these SLOs"; this bench asks
the platform team's next question: how much latency must online traffic give up for the
offline work to reach a given share of a dedicated GPU. On one trace, model and load (the
same defaults as ``bench colocation``: Azure conversation dev trace, llama-2-7b on a100,
arXiv backlog, 600 s window, rate scaled to about 30 % online-only busy), it runs
``online-only`` and ``offline-only`` once, then for each tolerance T profiles and runs the
sidecar's ``budget`` policy under ``ttft:p99:+T%`` and ``tbt:p99:+T%`` (both relative to
the same online-only run). Each row gives the limits, what was observed, the two budgets the
profiler chose and the offline throughput as a share of offline-only; ``crossing_pct`` is
the smallest tolerance whose row reaches ``--goal`` (85 %, the issue's target) with its
SLOs met. ``--in-engine`` adds the planner-inside-the-engine row per tolerance, labelled
``mode: in-engine`` (what an engine plugin would add; never a sidecar figure).

Every tolerance shares one simulation cache: a trial with the same budgets runs once, so a
sweep costs little more than its distinct trials.

Deliberately left out: tolerances per metric (both SLOs move together; ``bench colocation
--slo`` sets them apart) and asserting the goal (the write-up reports it, met or not).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from slipstream_cli import plots
from slipstream_cli.benches.colocation import (
    _online,
    add_load_arguments,
    find_rate_scale,
    load_setting,
)
from slipstream_cli.commands.sim import (
    RichProgress,
    Scenario,
    run_policy,
    summary_row,
)
from slipstream_scheduler.budget import parse_slo
from slipstream_scheduler.sim.simulator import SimResult

DEFAULT_TOLERANCES = (10, 25, 50, 100, 150, 200)


def _tolerances(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--tolerances: comma-separated whole percentages, not {text!r}"
        ) from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"--tolerances: positive percentages, not {text!r}")
    return sorted(set(values))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_load_arguments(parser)
    parser.add_argument(
        "--tolerances",
        type=_tolerances,
        default=list(DEFAULT_TOLERANCES),
        help="p99 TTFT and TBT tolerances over online-only, percent, comma-separated "
        f"(default {','.join(map(str, DEFAULT_TOLERANCES))})",
    )
    parser.add_argument(
        "--goal", type=float, default=0.85, help="share of offline-only to reach (default 0.85)"
    )
    parser.add_argument(
        "--in-engine",
        action="store_true",
        help="also run the planner inside the engine per tolerance (what an engine plugin "
        "would add; labelled, never a sidecar figure)",
    )


def _row(tolerance: int, scn: Scenario, mode: str, offline_only: float) -> dict[str, Any]:
    pr = run_policy(scn, "budget", mode="in-engine" if mode == "in-engine" else "sidecar")
    row = summary_row(pr, scn)
    limits = {c["slo"]: c["limit_s"] for c in pr.checks(scn)}
    return {
        "tolerance_pct": tolerance,
        "mode": row["mode"],
        "slo_met": row["slo_met"],
        "ttft_p99_limit_s": limits.get(f"ttft:p99:+{tolerance}%"),
        "tbt_p99_limit_s": limits.get(f"tbt:p99:+{tolerance}%"),
        "ttft_p99_s": row["ttft_p99_s"],
        "tbt_p99_s": row["tbt_p99_s"],
        "tbt_mean_s": row["tbt_mean_s"],
        "budget_s": row["budget_s"],
        "idle_budget_s": row["idle_budget_s"],
        "offline_tokens_per_s": row["offline_tokens_per_s"],
        "offline_share": (row["offline_tokens_per_s"] / offline_only if offline_only else None),
        "preemptions_per_offline_finished": row["preemptions_per_offline_finished"],
    }


def crossing(rows: list[dict[str, Any]], goal: float, mode: str = "sidecar") -> int | None:
    """The smallest tolerance whose ``mode`` row meets its SLOs at ``goal`` or more."""
    hits = [
        r["tolerance_pct"]
        for r in rows
        if r["mode"] == mode and r["slo_met"] and (r["offline_share"] or 0.0) >= goal
    ]
    return min(hits) if hits else None


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 120))
    t_start = time.perf_counter()
    full, offline, engine = load_setting(args)
    dur = float(args.duration_s)
    if args.rate_scale is not None:
        factor = float(args.rate_scale)
        probe = Scenario(_online(full, factor, args.start_s, dur), (), dur, engine)
        busy = probe.run("online-only").metrics.busy_fraction
    else:
        factor, busy = find_rate_scale(full, engine, args.start_s, dur, args.target_busy)
    console.print(f"rate scale {factor:.4f}, online-only busy {busy:.3f}")
    online = _online(full, factor, args.start_s, dur)
    cache: dict[tuple[Any, ...], SimResult] = {}
    base = Scenario(online, offline, dur, engine, seed=args.seed, search_idle=True,
                    label=args.trace or "azure-conv-dev", cache=cache)
    online_only = base.run("online-only")
    off_only = base.run("offline-only").metrics.offline.tokens_per_s
    rows: list[dict[str, Any]] = []
    modes = ["sidecar", "in-engine"] if args.in_engine else ["sidecar"]
    with RichProgress(console) as bar:
        for tol in args.tolerances:
            slos = (parse_slo(f"ttft:p99:+{tol}%"), parse_slo(f"tbt:p99:+{tol}%"))
            scn = Scenario(online, offline, dur, engine, slos=slos, seed=args.seed,
                           idle_budget_s=args.idle_budget, search_idle=True,
                           label=base.label, latency_model=base.model(),
                           baseline=online_only, cache=cache, progress=bar)
            rows.extend(_row(tol, scn, mode, off_only) for mode in modes)
    table = Table(title=f"offline share by SLO tolerance (rate scale {factor:.4f}, "
                        f"online-only busy {busy:.2f}, window {dur:.0f} s, "
                        f"offline-only {off_only:.0f} tok/s)")
    for col in ("tolerance", "mode", "SLO", "TTFT p99 ms (limit)", "TBT p99 ms (limit)",
                "budget ms", "idle budget ms", "offline tok/s", "share"):
        table.add_column(col, justify="left" if col in ("mode", "SLO") else "right")
    for r in rows:
        table.add_row(
            f"+{r['tolerance_pct']}%", r["mode"], "met" if r["slo_met"] else "BROKEN",
            f"{_ms(r['ttft_p99_s'])} ({_ms(r['ttft_p99_limit_s'])})",
            f"{_ms(r['tbt_p99_s'])} ({_ms(r['tbt_p99_limit_s'])})",
            _ms(r["budget_s"]), _ms(r["idle_budget_s"]),
            f"{r['offline_tokens_per_s']:.0f}", f"{(r['offline_share'] or 0.0):.1%}")
    console.print(table)
    ceiling = (1.0 - busy)
    cross = {m: crossing(rows, args.goal, m) for m in modes}
    console.print(
        f"idle-time ceiling (1 - busy): {ceiling:.1%}; smallest tolerance reaching "
        f"{args.goal:.0%} of offline-only: sidecar "
        + (f"+{cross['sidecar']}%" if cross["sidecar"] is not None else "none of those run")
        + (f", in-engine +{cross['in-engine']}%" if cross.get("in-engine") else "")
    )
    doc = {
        "schema": "slipstream.bench.tolerance/v1",
        "trace": args.trace or "azure_llm_2023/AzureLLMInferenceTrace_conv.dev.csv",
        "window": {"start_s": args.start_s, "duration_s": dur,
                   "note": "virtual seconds after rate scaling"},
        "model": args.model,
        "gpu": args.gpu,
        "offline": args.offline,
        "rate_scale": factor,
        "online_only_busy_fraction": busy,
        "online_only": {"ttft_p99_s": online_only.metrics.online.ttft.p99,
                        "tbt_p99_s": online_only.metrics.online.tbt.p99},
        "offline_only_tokens_per_s": off_only,
        "idle_time_ceiling": ceiling,
        "goal": args.goal,
        "crossing_pct": cross["sidecar"],
        "crossing_pct_in_engine": cross.get("in-engine"),
        "rows": rows,
        "wall_s": time.perf_counter() - t_start,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    plots.share_by_tolerance(
        {m: [(r["tolerance_pct"], r["offline_share"] or 0.0) for r in rows if r["mode"] == m]
         for m in modes},
        args.json.with_suffix(".png"), ceiling=ceiling, goal=args.goal)
    console.print(f"wrote {args.json} and {args.json.with_suffix('.png').name} "
                  f"({time.perf_counter() - t_start:.0f} s)")
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"
