"""``slipstream bench prefix``: FCFS against PSM ordering of offline work on MMLU.

MMLU test questions as 5-shot prompts (all questions of a subject share the
header and five exemplars), queued at t = 0 in a seeded mixed order, served
offline-only by the engine model with prefix caching. The only difference
between the rows is the order the dispatcher submits them in: FCFS (file
order) or PSM (prefix trie DFS, HyGen). Reported per order: offline
throughput as tokens of finished requests (prompt + output) per second of
makespan, output tokens/s, requests/s and the engine's prefix-cache hit rate.
Run at the GPU's full KV capacity and, since the shared prefixes of 57
subjects fit into an 80 GB A100's cache, also with a smaller KV pool
(``--small-kv-blocks``), where ordering decides what stays cached.

Deliberately left out: online traffic (see ``bench colocation``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from slipstream_cli import plots
from slipstream_cli.commands.sim import RichProgress
from slipstream_cli.workloads import mmlu
from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.sim.simulator import SimConfig, simulate
from slipstream_scheduler.sim.workload import Workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, required=True, help="write the JSON report here")
    parser.add_argument(
        "--mmlu", type=Path, help="MMLU folder with dev/ and test/ (default: shared)"
    )
    parser.add_argument("--per-subject", type=int, default=None, help="questions per subject")
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--gpu", default="a100")
    parser.add_argument(
        "--small-kv-blocks",
        type=int,
        default=1500,
        help="KV blocks of the constrained run; 0: skip",
    )
    parser.add_argument("--seed", type=int, default=0)


def _tick(bar: RichProgress, label: str) -> Callable[[float], None]:
    def cb(t: float) -> None:
        bar(label, t, t + 1.0)

    return cb


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 120))
    t0 = time.perf_counter()
    reqs = mmlu.load(args.mmlu, per_subject=args.per_subject, seed=args.seed)
    wl = Workload(online=(), offline=reqs, offline_backlog=False, name="mmlu-5shot")
    console.print(
        f"MMLU: {len(reqs)} prompts, mean {sum(r.prompt_tokens for r in reqs) / len(reqs):.0f} "
        "proxy tokens"
    )
    rows: list[dict[str, Any]] = []
    kv_settings: list[int | None] = [None]
    if args.small_kv_blocks:
        kv_settings.append(args.small_kv_blocks)
    with RichProgress(console) as bar:
        for kv in kv_settings:
            engine = EngineConfig(model=args.model, gpu=args.gpu, num_gpu_blocks=kv)
            for order in ("fcfs", "psm"):
                cfg = SimConfig(
                    engine=engine, policy="offline-only", offline_order=order, seed=args.seed
                )
                label = f"{order} kv={kv or 'gpu'}"
                tw = time.perf_counter()
                res = simulate(wl, cfg, progress=_tick(bar, label))
                m = res.metrics
                off = m.offline
                done_tokens = off.prompt_tokens_done + off.output_tokens
                rows.append(
                    {
                        "order": order,
                        "kv_blocks": res.engine.kv_blocks_total,
                        "offline_tokens_per_s": done_tokens / m.duration_s,
                        "offline_output_tokens_per_s": off.tokens_per_s,
                        "requests_per_s": off.finished / m.duration_s,
                        "prefix_hit_rate": m.prefix_hit_rate,
                        "makespan_s": m.duration_s,
                        "finished": off.finished,
                        "engine_preemptions": m.engine_preemptions,
                        "wall_s": time.perf_counter() - tw,
                    }
                )
    table = Table(title="offline order on MMLU 5-shot (offline-only)")
    for col in ("order", "KV blocks", "tokens/s", "req/s", "prefix hit", "makespan s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["order"],
            str(r["kv_blocks"]),
            f"{r['offline_tokens_per_s']:.0f}",
            f"{r['requests_per_s']:.2f}",
            f"{r['prefix_hit_rate']:.3f}",
            f"{r['makespan_s']:.0f}",
        )
    console.print(table)
    for kv in sorted({r["kv_blocks"] for r in rows}):
        f = next(r for r in rows if r["kv_blocks"] == kv and r["order"] == "fcfs")
        p = next(r for r in rows if r["kv_blocks"] == kv and r["order"] == "psm")
        console.print(
            f"KV {kv} blocks: PSM / FCFS throughput "
            f"{p['offline_tokens_per_s'] / f['offline_tokens_per_s']:.2f}x, "
            f"hit rate {f['prefix_hit_rate']:.3f} -> {p['prefix_hit_rate']:.3f}"
        )
    doc = {
        "schema": "slipstream.bench.prefix/v1",
        "dataset": "mmlu 5-shot (test questions, seeded mixed order)",
        "requests": len(reqs),
        "model": args.model,
        "gpu": args.gpu,
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    kvs = sorted({r["kv_blocks"] for r in rows}, reverse=True)
    plots.grouped_bars(
        [f"{kv} KV blocks" for kv in kvs],
        {
            o: [
                next(
                    r["offline_tokens_per_s"]
                    for r in rows
                    if r["kv_blocks"] == kv and r["order"] == o
                )
                for kv in kvs
            ]
            for o in ("fcfs", "psm")
        },
        args.json.with_suffix(".png"),
        ylabel="offline tokens/s (prompt + output)",
        title="PSM vs FCFS on MMLU 5-shot",
    )
    console.print(f"wrote {args.json}")
    return 0
