"""Benchmark: the operator's budget searches judged on a real trace they never saw.

For each load (the Azure LLM 2023 conversation dev trace, arrival rate scaled,
one window) and each SLO set this

1. takes the load statistics the operator would see over that window (arrival
   rate, mean prompt and output tokens);
2. computes the operator's two budgets for them, exactly as the operator does:
   ``AnalyticSearch`` (closed form) and ``SimulatedSearch`` (HyGen's profiler on
   a seeded Poisson sample, default settings), both with the shipped latency
   profile of Llama-2-7B on an A100;
3. replays the *real* window (its real arrival times and lengths) with a
   saturating offline backlog (MMLU 5-shot prompts, or arXiv-summarisation
   lengths with ~3.1k-token prompts), under the sidecar's budget policy, once
   per budget, plus online-only as the baseline;
4. reports whether each budget met the SLOs on the real replay and the offline
   work it let through: prompt + output tokens of finished offline requests per
   second (MMLU answers are one token, so output tokens alone say little), and
   the ratio simulated / analytic.

Usage (not collected by pytest; needs the shared data)::

    .venv/bin/python tests/benchmarks/bench_budget_search.py \\
        --json docs/benchmarks/budget-search.json

Results and reading: ``docs/benchmarks/budget-search.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from slipstream_cli.commands.sim import load_offline, load_trace
from slipstream_operator.budgets import AnalyticSearch, LoadStats, SearchResult, SLOTargets
from slipstream_operator.profiles import find_profile
from slipstream_operator.simsearch import SimSearchParams, SimulatedSearch
from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.sim.simulator import SimConfig, SimResult, simulate
from slipstream_scheduler.sim.workload import SimRequest, Workload, scale_rate, window

# Rate factors of the Azure conv dev trace: ~15 %, ~30 %, ~50 % busy online-only on
# llama-2-7b/A100 (docs/benchmarks/colocation.md), and a heavier one.
FACTORS = (0.0389, 0.0556, 0.0748, 0.15)
SLO_SETS: dict[str, SLOTargets] = {
    # The example service's SLOs (examples/inferenceservice.yaml).
    "example": SLOTargets(ttft_mean_s=0.6, ttft_p99_s=2.0, tbt_mean_s=0.06, tbt_p99_s=0.15),
    # Tight TBT: offline work must keep steps short next to online decodes.
    "tight-tbt": SLOTargets(ttft_p99_s=2.0, tbt_mean_s=0.035, tbt_p99_s=0.1),
}


def load_of(online: tuple[SimRequest, ...], duration_s: float) -> LoadStats:
    n = max(1, len(online))
    return LoadStats(
        arrival_rate_rps=len(online) / duration_s,
        mean_prompt_tokens=sum(r.prompt_tokens for r in online) / n,
        mean_output_tokens=sum(r.output_tokens for r in online) / n,
    )


def met(targets: SLOTargets, result: SimResult) -> tuple[bool, dict[str, float]]:
    observed = result.observed()
    rows = {m: observed[f"{m.replace('-', '_')}_s"] for m, _ in targets.items()}
    ok = all(rows[m] <= t for m, t in targets.items())
    return ok, rows


def replay(online: tuple[SimRequest, ...], offline: tuple[SimRequest, ...], duration_s: float,
           engine: EngineConfig, policy: str, budget_s: float | None, model: Any) -> SimResult:
    wl = Workload(online, offline, offline_backlog=policy != "online-only" and bool(offline),
                  horizon_s=duration_s)
    config = SimConfig(engine=engine, policy=policy, budget_s=budget_s, seed=0)
    return simulate(wl, config, latency_model=model if policy == "budget" else None)


def describe(found: SearchResult) -> dict[str, Any]:
    return {"budget_s": found.budget_s, "floor_s": found.floor_s, "ceiling_s": found.ceiling_s,
            "source": found.source, "feasible": found.feasible, "trials": len(found.trials),
            "summary": found.summary()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--start-s", type=float, default=0.0)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--offline", nargs="+", default=["mmlu", "arxiv"],
                        help="offline backlogs: mmlu (5-shot prompts), arxiv (long prompts)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    full = load_trace(None)
    backlogs = {name: load_offline(name) for name in args.offline}
    engine = EngineConfig(model="llama-2-7b", gpu="a100")
    profile = find_profile("llama-2-7b", "a100")
    assert profile is not None
    model = profile.model
    rows: list[dict[str, Any]] = []
    for (offline_name, offline), factor in itertools.product(backlogs.items(), FACTORS):
        online = window(scale_rate(full, factor), args.start_s, args.duration_s)
        load = load_of(online, args.duration_s)
        base = replay(online, (), args.duration_s, engine, "online-only", None, model)
        for name, targets in SLO_SETS.items():
            t_search = time.perf_counter()
            simulated = SimulatedSearch(model, engine, SimSearchParams())(targets, load)
            search_wall = time.perf_counter() - t_search
            analytic = AnalyticSearch(model, engine.limits())(targets, load)
            base_ok, base_obs = met(targets, base)
            row: dict[str, Any] = {
                "offline": offline_name, "rate_factor": factor, "slos": name, "load": asdict(load),
                "online_only": {"met": base_ok, "observed": base_obs,
                                "busy": base.metrics.busy_fraction},
                "simulated_search_wall_s": round(search_wall, 2),
            }
            for label, found in (("analytic", analytic), ("simulated", simulated)):
                res = replay(online, offline, args.duration_s, engine, "budget", found.budget_s,
                             model)
                ok, obs = met(targets, res)
                off = res.metrics.offline
                work = (off.prompt_tokens_done + off.output_tokens) / args.duration_s
                row[label] = {**describe(found), "met": ok, "observed": obs,
                              "offline_output_tok_s": off.tokens_per_s,
                              "offline_requests_done": off.finished,
                              "offline_work_tok_s": work}
            a, s = row["analytic"]["offline_work_tok_s"], row["simulated"]["offline_work_tok_s"]
            row["offline_ratio_simulated_over_analytic"] = (s / a) if a > 0 else (
                math.inf if s > 0 else 1.0)
            rows.append(row)
            print(f"{offline_name:5} x{factor:<7} {name:9} rate {load.arrival_rate_rps:.2f} rps "
                  f"busy {base.metrics.busy_fraction:.2f} online-only met={base_ok} | "
                  f"analytic {analytic.budget_s * 1000:6.1f} ms met={row['analytic']['met']} "
                  f"{a:6.0f} tok/s | simulated {simulated.budget_s * 1000:6.1f} ms "
                  f"met={row['simulated']['met']} {s:6.0f} tok/s "
                  f"(feasible={simulated.feasible}, {len(simulated.trials)} trials, "
                  f"{search_wall:.1f} s)", flush=True)
    report = {
        "benchmark": "budget-search",
        "trace": "azure_llm_2023/AzureLLMInferenceTrace_conv.dev.csv",
        "window": {"start_s": args.start_s, "duration_s": args.duration_s},
        "offline": {"mmlu": "MMLU 5-shot prompts, backlog",
                    "arxiv": "arXiv-summarisation lengths (Vidur), backlog"},
        "engine": engine.model_dump(),
        "profile": profile.name,
        "search_params": SimSearchParams().model_dump(),
        "rows": rows,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {args.json} in {report['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
