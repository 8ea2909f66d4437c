"""``slipstream bench plugin-serve``: ``vllm serve`` with Slipstream's plugin against stock.

Two real ``vllm serve`` processes on this CPU, the same tiny model and flags
(:mod:`slipstream_testbed.vllm`, ``--max-num-seqs 256``, ``--dtype float32``): ``stock``, vLLM's
own scheduler, and ``plugin``, started with ``--scheduler-cls
slipstream_vllm.scheduler.SlipstreamScheduler`` and a channel whose control document sets the
``naive`` policy and the shipped online ordering (Gittins by default), with no offline work.
``vllm bench serve``, vLLM's own client (:mod:`slipstream_testbed.vllm.bench_serve`), sends the
same seeded random prompts to each, in rounds whose order follows a Williams design over the
repeats (``bench front-load``'s), the other server idle meanwhile.

Reported per concurrency: each server's TTFT and TPOT (mean and p99) and request and
output-token throughput, as the median over the repeats; the plugin's ratio to stock; stock's
own spread over its repeats (its highest round over its lowest: the host's resolution), and
whether the plugin's ratio lies outside it; failures; the CPU seconds the idle server used
while the other one served (a control that the two do not disturb each other); whether every
greedy answer is the same from both. Timings are printed and written (``--json``), never
asserted.

Deliberately left out: offline work (``bench colocation``), the scheduler's own CPU time
per step (``bench plugin-overhead``), and GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from slipstream_cli.argtypes import whole
from slipstream_cli.benches.front_load import (
    FIGURES,
    engine_version,
    group_cpu_s,
    loadavg,
    round_order,
    run_in_work_dir,
)

SCHEMA = "slipstream.bench.plugin-serve/v1"
PLUGIN = "slipstream_vllm.scheduler.SlipstreamScheduler"
SERVERS = ("stock", "plugin")
BATCHED_TOKENS = 2048


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--concurrency", type=whole(1), nargs="+", default=[64, 256],
                        help="requests in flight per round (default 64 256)")
    parser.add_argument("--max-num-seqs", type=whole(1), default=256,
                        help="vLLM's --max-num-seqs (default 256)")
    parser.add_argument("--ordering", default="gittins",
                        choices=["fcfs", "sjf", "trail", "gittins"],
                        help="the plugin's online ordering (default gittins, the shipped one)")
    parser.add_argument("--input-len", type=whole(1), default=64,
                        help="prompt tokens of every request (default 64)")
    parser.add_argument("--output-len", type=whole(1), default=32,
                        help="output tokens of every request, --ignore-eos (default 32)")
    parser.add_argument("--prompts", type=whole(1), default=512,
                        help="prompts per round (default 512)")
    parser.add_argument("--repeats", type=whole(1), default=4,
                        help="rounds per server and concurrency (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="the dataset's seed (default 0)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep the logs and vLLM's result files here (default: a "
                        "temporary folder, removed)")


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One concurrency's rounds: per server the median figures and each repeat's; the
    plugin's ratio to stock; stock's spread; the idle server's CPU; the greedy answers."""
    paths: dict[str, dict[str, Any]] = {}
    for name in SERVERS:
        mine = [r for r in rounds if r["server"] == name]
        paths[name] = {
            "median": {f: statistics.median(r["figures"][f] for r in mine) for f in FIGURES},
            "per_repeat": {f: [r["figures"][f] for r in mine] for f in FIGURES},
            "failed": sum(int(r["figures"]["failed"]) for r in mine),
            "completed": sum(int(r["figures"]["completed"]) for r in mine),
            "idle_cpu_s": statistics.median(r["idle_cpu_s"] for r in mine),
            "errors": sorted({e for r in mine for e in r["errors"]})[:5],
        }
    per = paths["stock"]["per_repeat"]
    spread = {f: max(per[f]) / min(per[f]) for f in FIGURES}
    ratio = {f: paths["plugin"]["median"][f] / paths["stock"]["median"][f] for f in FIGURES}
    stock_texts = {r["repeat"]: r["texts"] for r in rounds if r["server"] == "stock"}
    differing = [sum(a != b for a, b in zip(r["texts"], stock_texts[r["repeat"]], strict=True))
                 for r in rounds if r["server"] == "plugin"]
    return {
        "paths": paths,
        "ratio_plugin": ratio,
        "stock_spread": spread,
        "resolved_plugin": {f: not 1 / spread[f] <= ratio[f] <= spread[f] for f in FIGURES},
        "outputs": {"identical": not any(differing), "differing_per_repeat": differing},
    }


def run(args: argparse.Namespace) -> int:
    parser = argparse.ArgumentParser(prog="slipstream bench plugin-serve")
    add_arguments(parser)
    return run_in_work_dir(parser, args, _run, "slipstream-plugin-serve-")


def _run(args: argparse.Namespace, work: Path) -> int:
    from rich.console import Console

    from slipstream_scheduler.enginecontrol import CONTROL_FILE, EngineControl
    from slipstream_testbed.vllm import VllmServer, VllmServerOptions, ensure
    from slipstream_testbed.vllm.bench_serve import BenchServeClient, RandomWorkload

    console = Console(width=max(Console().width, 120))
    model = ensure()
    channel = work / "channel"
    channel.mkdir(exist_ok=True)
    (channel / CONTROL_FILE).write_text(
        EngineControl(generation=1, policy="naive", ordering=args.ordering).encode())
    common: dict[str, Any] = {
        "model_dir": model, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": BATCHED_TOKENS, "extra_args": ("--dtype", "float32"),
    }
    options = {
        "stock": VllmServerOptions(**common, log_path=work / "stock.log"),
        "plugin": VllmServerOptions(**common, scheduler_cls=PLUGIN,
                                    env={"SLIPSTREAM_CHANNEL_DIR": str(channel)},
                                    log_path=work / "plugin.log"),
    }
    workload = RandomWorkload(model, input_len=args.input_len, output_len=args.output_len,
                              seed=args.seed)
    results: dict[str, Any] = {}
    started, load_start = time.monotonic(), loadavg()
    with contextlib.ExitStack() as stack:
        with console.status("starting both vllm serve and the client"):
            servers = {name: stack.enter_context(VllmServer(o)) for name, o in options.items()}
            client = stack.enter_context(BenchServeClient(work / "bench-serve.log"))
        version = engine_version(servers["stock"].url)

        def one(name: str, c: int, rep: int) -> dict[str, Any]:
            out = work / f"{name}-{c}-{rep}.json"
            argv = workload.argv(servers[name].url, concurrency=c, num_prompts=args.prompts,
                                 result_file=out, label=name)
            idle = servers["plugin" if name == "stock" else "stock"].pid
            before = group_cpu_s(idle)
            res = client.run(argv, out)
            return {"server": name, "repeat": rep, "figures": res.figures(),
                    "texts": res.generated_texts, "errors": res.errors,
                    "idle_cpu_s": group_cpu_s(idle) - before}

        for name in SERVERS:  # untimed: imports, connections, first compilations
            with console.status(f"warm-up round, {name}"):
                one(name, args.concurrency[0], -1)
        for c in args.concurrency:
            rounds = []
            for rep in range(args.repeats):
                for name in round_order(SERVERS, rep):
                    with console.status(f"{c} concurrent, repeat {rep + 1}, {name}"):
                        rounds.append(one(name, c, rep))
            results[str(c)] = summarise(rounds)
    doc = {
        "schema": SCHEMA,
        "setup": {
            "vllm_version": version, "cpus": os.cpu_count(), "max_num_seqs": args.max_num_seqs,
            "dtype": "float32", "max_num_batched_tokens": BATCHED_TOKENS,
            "ordering": args.ordering, "input_len": args.input_len,
            "output_len": args.output_len, "prompts": args.prompts, "repeats": args.repeats,
            "seed": args.seed, "wall_s": time.monotonic() - started,
            "loadavg_start": load_start, "loadavg_end": loadavg(),
        },
        "concurrency": results,
    }
    _print(console, results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def _print(console: Any, results: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="vllm serve with the plugin against stock (ratio of medians)")
    for col in ("concurrent", "row", "TTFT mean", "TTFT p99", "TPOT mean", "TPOT p99",
                "req/s", "tok/s"):
        table.add_column(col, justify="left" if col == "row" else "right")
    for c, row in results.items():
        s = row["paths"]["stock"]["median"]
        table.add_row(c, "stock (ms, /s)", *(f"{s[f]:.1f}" for f in FIGURES))
        table.add_row(c, "plugin / stock", *(f"{row['ratio_plugin'][f]:.3f}x" for f in FIGURES))
        table.add_row(c, "stock spread", *(f"{v:.3f}x" for v in row["stock_spread"].values()))
        failed = {n: p["failed"] for n, p in row["paths"].items()}
        console.print(f"{c} concurrent: failed {failed}; greedy outputs "
                      f"{'identical' if row['outputs']['identical'] else 'DIFFER'}; idle "
                      f"server's CPU per round (s): "
                      f"{ {n: round(p['idle_cpu_s'], 2) for n, p in row['paths'].items()} }")
    console.print(table)
