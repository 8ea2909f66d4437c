"""``slipstream bench plugin-overhead``: the CPU time Slipstream's plugin adds to vLLM's step.

vLLM's real v1 scheduler is stepped in-process
(:class:`slipstream_testbed.vllm.inprocess.VllmEngine`) with N requests decoding (16, 64 and
256 by default: every one running, long outputs, KV blocks enough for the whole run), once as
stock vLLM (``AsyncScheduler``) and once per plugin configuration (``SlipstreamScheduler``
with the ``naive`` policy and FCFS ordering: the plugin's machinery alone; with Gittins
ordering over predicted lengths: the shipped online ordering; with the ``budget`` policy and a
latency model; and the last with every other request offline, so that every step is planned).
Each step's ``schedule()`` and ``update_from_output()`` are timed with the calling thread's
CPU clock (``time.thread_time_ns``), which other processes on the host do not inflate. Rounds
alternate stock and plugin; each row runs in a forked process of its own. The report gives, per
N and configuration, the median CPU time per step of each, the plugin's added microseconds,
the ratio to stock, measured in the same run, and the share of the plugin's steps that were
online-only (vLLM's walk without a plan).

Deliberately left out: the GPU (no model runs; the step's own time is not part of this) and
``vllm serve`` throughput (``bench plugin-serve``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from slipstream_cli.benches.fidelity import installed_vllm
from slipstream_cli.benches.fidelity_vllm import require_vllm, slipstream_argv
from slipstream_scheduler.engine.model import EngineConfig

SCHEMA = "slipstream.bench.plugin-overhead/v1"
PLUGIN = "slipstream_vllm.scheduler.SlipstreamScheduler"
STOCK = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
CONFIGS: dict[str, dict[str, Any]] = {
    "naive-fcfs": {"policy": "naive", "ordering": "fcfs"},
    "naive-gittins": {"policy": "naive", "ordering": "gittins"},
    "budget-gittins": {"policy": "budget", "ordering": "gittins", "budget_s": 1.0},
    "budget-gittins-mixed": {"policy": "budget", "ordering": "gittins", "budget_s": 1.0},
}
MIXED = frozenset({"budget-gittins-mixed"})
"""Configurations where every other running request is offline (the pod's token): the
plugin plans every step. In the others every request is online and nothing waits, so the
plugin's steps are vLLM's walk without a plan (``_online_only``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--running", type=int, nargs="+", default=[16, 64, 256],
                        help="requests decoding at once (default 16 64 256)")
    parser.add_argument("--steps", type=int, default=200,
                        help="timed steps per round (default 200)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds, stock and plugin alternating (default 3)")
    parser.add_argument("--config", choices=list(CONFIGS), nargs="+", default=list(CONFIGS),
                        help="plugin configurations (default: all)")
    parser.add_argument("--json", type=Path, help="write the JSON report here")


def _prompt_len(i: int) -> int:
    """Request ``i``'s prompt: 128 to 224 tokens, in steps of 16."""
    return 128 + (i % 7) * 16


PROMPT_MAX = max(_prompt_len(i) for i in range(7))
WARMUP_STEPS = 20


def _engine(
    n: int, channel: Path | None, control: dict[str, Any] | None, timed_steps: int,
    *, mixed: bool = False,
) -> Any:
    """vLLM's scheduler with ``n`` requests decoding (``mixed``: every other one offline, with
    the pod's token; stock vLLM gets the same requests), and KV blocks enough for each to
    decode every step of the run (prefill and warm-up included): the regime cannot drift into
    KV pressure, preemptions and a waiting queue halfway through."""
    from slipstream_scheduler.enginecontrol import OFFLINE_TOKEN_ARG, OFFLINE_TOKEN_FILE
    from slipstream_testbed.vllm.inprocess import VllmEngine

    bs = EngineConfig().block_size
    tokens = PROMPT_MAX + 2 * WARMUP_STEPS + timed_steps + n  # n: prefill steps, generously
    cfg = EngineConfig(max_num_seqs=max(n, 16), max_num_batched_tokens=max(2 * n, 512),
                       num_gpu_blocks=n * -(-tokens // bs) + 64, noise_cv=0.0)
    token = "bench-offline-token"
    if channel is not None and control is not None:
        (channel / OFFLINE_TOKEN_FILE).write_text(token)
        _write_control(channel, control, cfg)
        os.environ["SLIPSTREAM_CHANNEL_DIR"] = str(channel)
    eng = VllmEngine(cfg, scheduler_cls=PLUGIN if channel is not None else STOCK)
    os.environ.pop("SLIPSTREAM_CHANNEL_DIR", None)
    for i in range(n):
        extra = {OFFLINE_TOKEN_ARG: token} if mixed and i % 2 else None
        eng.add_tokens(f"r{i}", eng.synth.prompt(f"r{i}", _prompt_len(i), ()), 100_000,
                       extra_args=extra)
    while eng.stats().running < n or any(  # until every request decodes
        r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running
    ):
        eng.step()
    return eng


def _regime(eng: Any) -> tuple[int, int]:
    """(preemptions so far, requests waiting now): both 0 in the steady state measured."""
    st = eng.stats()
    return int(st.preemptions), int(st.waiting)


def _write_control(channel: Path, control: dict[str, Any], cfg: EngineConfig) -> None:
    from slipstream_scheduler.enginecontrol import EngineControl
    from slipstream_scheduler.sim.simulator import profile_latency_model
    from slipstream_vllm.scheduler import write_control

    doc = dict(control)
    if doc["policy"] == "budget":
        doc["latency_model"] = profile_latency_model(cfg, samples=200).to_dict()
    write_control(channel, EngineControl(generation=1, **doc))


def _timed_steps(eng: Any, steps: int) -> list[int]:
    """CPU nanoseconds of each step's schedule() plus update_from_output()."""
    sched = eng.scheduler
    schedule, update = sched.schedule, sched.update_from_output
    spent: list[int] = []

    def timed_schedule(*a: Any, **k: Any) -> Any:
        t = time.thread_time_ns()
        out = schedule(*a, **k)
        spent.append(time.thread_time_ns() - t)
        return out

    def timed_update(*a: Any, **k: Any) -> Any:
        t = time.thread_time_ns()
        out = update(*a, **k)
        spent[-1] += time.thread_time_ns() - t
        return out

    sched.schedule, sched.update_from_output = timed_schedule, timed_update
    try:
        for _ in range(steps):
            eng.step()
    finally:
        del sched.schedule, sched.update_from_output
    return spent


def _measure_apart(n: int, config: str, steps: int, rounds: int) -> dict[str, Any]:
    """:func:`measure` in a process of its own, forked for this row: engines built for one
    row (and the garbage they leave) cannot slow the rows after it."""
    with multiprocessing.get_context("fork").Pool(1) as pool:
        row: dict[str, Any] = pool.apply(measure, (n, config, steps, rounds))
    return row


def measure(n: int, config: str, steps: int, rounds: int) -> dict[str, Any]:
    stock: list[int] = []
    plugin: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        channel = Path(tmp)
        mixed = config in MIXED
        engines = (_engine(n, None, None, steps * rounds, mixed=mixed),
                   _engine(n, channel, CONFIGS[config], steps * rounds, mixed=mixed))
        for eng in engines:
            _timed_steps(eng, WARMUP_STEPS)
        for _ in range(rounds):
            stock += _timed_steps(engines[0], steps)
            plugin += _timed_steps(engines[1], steps)
        regimes = [_regime(e) for e in engines]
        sched = engines[1].scheduler
        online_only = sched.online_only_steps / max(sched.steps, 1)
        sched.shutdown()
    if any(regimes[0]) or any(regimes[1]):
        raise RuntimeError(f"the steady state drifted: (preemptions, waiting) stock "
                           f"{regimes[0]}, plugin {regimes[1]}")
    s_med, p_med = statistics.median(stock), statistics.median(plugin)
    return {
        "running": n,
        "config": config,
        "steps": len(stock),
        "stock_median_us": s_med / 1e3,
        "plugin_median_us": p_med / 1e3,
        "added_median_us": (p_med - s_med) / 1e3,
        "ratio": p_med / s_med,
        "online_only_share": online_only,
        "stock_p90_us": statistics.quantiles(stock, n=10)[-1] / 1e3,
        "plugin_p90_us": statistics.quantiles(plugin, n=10)[-1] / 1e3,
    }


def run(args: argparse.Namespace) -> int:
    parser = argparse.ArgumentParser(prog="slipstream bench plugin-overhead")
    add_arguments(parser)
    if args.steps < 10 or args.rounds < 1 or min(args.running) < 1:
        parser.error("--steps must be >= 10, --rounds >= 1 and --running >= 1")
    require_vllm(parser, slipstream_argv(["bench", "plugin-overhead"]))
    version = ".".join(map(str, installed_vllm()))

    console = Console(width=max(Console().width, 110))
    rows = []
    import slipstream_testbed.vllm.inprocess  # noqa: F401 - imported once, before the forks

    for n in args.running:
        for config in args.config:
            with console.status(f"plugin overhead: {n} running, {config}"):
                rows.append(_measure_apart(n, config, args.steps, args.rounds))
    table = Table(title=f"CPU time per step, vLLM {version} in-process (median, µs)")
    for col in ("running", "plugin config", "stock", "plugin", "added", "ratio"):
        table.add_column(col, justify="left" if col == "plugin config" else "right")
    for r in rows:
        table.add_row(str(r["running"]), r["config"], f"{r['stock_median_us']:.0f}",
                      f"{r['plugin_median_us']:.0f}", f"{r['added_median_us']:+.0f}",
                      f"{r['ratio']:.2f}x")
    console.print(table)
    if args.json:
        doc = {"schema": SCHEMA, "vllm_version": version, "steps_per_round": args.steps,
               "rounds": args.rounds, "rows": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0
