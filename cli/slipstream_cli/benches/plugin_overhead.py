"""``slipstream bench plugin-overhead``: the CPU time Slipstream's plugin adds to vLLM's step.

vLLM's real v1 scheduler is stepped in-process
(:class:`slipstream_testbed.vllm.inprocess.VllmEngine`) with N requests running (16, 64 and
256 by default; KV blocks enough for the whole run), once as
stock vLLM (``AsyncScheduler``) and once per plugin configuration (``SlipstreamScheduler``
with the ``naive`` policy and FCFS ordering: the plugin's machinery alone; with Gittins
ordering over predicted lengths: the shipped online ordering; with the ``budget`` policy and a
latency model; and the last with every other request offline, so that every step is planned).
Two workloads: ``steady``, every request decoding a long output (the batch never changes);
``churn``, answers of 64 to 192 tokens, each finished request replaced by a new one before
the next step (at 256 running, about two arrivals a step: a busy service's batch). Each
step's ``schedule()`` and ``update_from_output()``, and the ``add_request()`` calls of the
arrivals before it, are timed with the calling thread's CPU clock (``time.thread_time_ns``),
which other processes on the host do not inflate. Rounds alternate stock and plugin; each row
runs in a forked process of its own. The report gives, per workload, N and configuration, the
median CPU time per step of each, the plugin's added microseconds (the median over steps of
the plugin's step less the stock step of the same index: the same arrivals and finishes), the
ratio of the medians, measured in the same run, and the share of the plugin's steps that were
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
                        help="requests running at once (default 16 64 256)")
    parser.add_argument("--steps", type=int, default=200,
                        help="timed steps per round (default 200)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds, stock and plugin alternating (default 3)")
    parser.add_argument("--config", choices=list(CONFIGS), nargs="+", default=list(CONFIGS),
                        help="plugin configurations (default: all)")
    parser.add_argument("--workload", choices=list(WORKLOADS), nargs="+",
                        default=list(WORKLOADS),
                        help="steady: long outputs, the batch never changes; churn: short "
                             "answers, each replaced as it finishes (default: both)")
    parser.add_argument("--json", type=Path, help="write the JSON report here")


WORKLOADS = ("steady", "churn")


def _output_len(i: int, workload: str) -> int:
    """Request ``i``'s answer: endless under ``steady``; 64 to 192 tokens under ``churn``."""
    return 100_000 if workload == "steady" else 64 + (i * 37) % 129


def _prompt_len(i: int) -> int:
    """Request ``i``'s prompt: 128 to 224 tokens, in steps of 16."""
    return 128 + (i % 7) * 16


PROMPT_MAX = max(_prompt_len(i) for i in range(7))
OUTPUT_MAX = max(_output_len(i, "churn") for i in range(129))
WARMUP_STEPS = 20


class _Workload:
    """The requests one engine is given: ``n`` at the start, and under ``churn`` a new one for
    each that finishes (``mixed``: every other one offline, with the pod's token)."""

    def __init__(self, eng: Any, workload: str, token: str, mixed: bool) -> None:
        self.eng, self.workload, self.token, self.mixed = eng, workload, token, mixed
        self.added = 0
        self.left_waiting = 0
        """The most requests still waiting after a step (0 in the steady state measured)."""

    def add(self) -> None:
        from slipstream_scheduler.enginecontrol import OFFLINE_TOKEN_ARG

        i, eng = self.added, self.eng
        extra = {OFFLINE_TOKEN_ARG: self.token} if self.mixed and i % 2 else None
        eng.add_tokens(f"r{i}", eng.synth.prompt(f"r{i}", _prompt_len(i), ()),
                       _output_len(i, self.workload), extra_args=extra)
        self.added += 1

    def step(self) -> None:
        """One engine step, then a new request for each that finished."""
        result = self.eng.step()
        self.left_waiting = max(self.left_waiting, len(self.eng.scheduler.waiting))
        for _ in result.finished:
            self.add()


def _engine(
    n: int, channel: Path | None, control: dict[str, Any] | None, timed_steps: int,
    *, mixed: bool = False, workload: str = "steady",
) -> _Workload:
    """vLLM's scheduler with ``n`` requests running (``mixed``: every other one offline, with
    the pod's token; stock vLLM gets the same requests), and KV blocks enough for each to run
    every step of the run (prefill and warm-up included): the regime cannot drift into KV
    pressure, preemptions and a waiting queue halfway through."""
    from slipstream_scheduler.enginecontrol import OFFLINE_TOKEN_FILE
    from slipstream_testbed.vllm.inprocess import VllmEngine

    bs = EngineConfig().block_size
    churn = workload == "churn"
    lives = OUTPUT_MAX if churn else 2 * WARMUP_STEPS + timed_steps
    tokens = PROMPT_MAX + lives + n  # n: prefill steps, generously
    cfg = EngineConfig(
        max_num_seqs=max(n, 16),
        # Room for a step's decodes and, under churn, its arrivals' prompts.
        max_num_batched_tokens=max(2 * n, 512) + (n if churn else 0),
        # Under churn a request's blocks are freed when it finishes and its successor's
        # taken when it arrives: room for two generations of every request at once.
        num_gpu_blocks=(2 if churn else 1) * n * -(-tokens // bs) + 64,
        noise_cv=0.0,
    )
    token = "bench-offline-token"
    if channel is not None and control is not None:
        (channel / OFFLINE_TOKEN_FILE).write_text(token)
        _write_control(channel, control, cfg)
        os.environ["SLIPSTREAM_CHANNEL_DIR"] = str(channel)
    eng = VllmEngine(cfg, scheduler_cls=PLUGIN if channel is not None else STOCK)
    os.environ.pop("SLIPSTREAM_CHANNEL_DIR", None)
    work = _Workload(eng, workload, token, mixed)
    for _ in range(n):
        work.add()
    if churn:  # until the first n are all in (some finish meanwhile, and are replaced)
        while any(int(r.request_id[1:]) < n for r in eng.scheduler.waiting):
            work.step()
    else:
        while eng.stats().running < n or any(  # until every request decodes
            r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running
        ):
            eng.step()
    work.left_waiting = 0
    return work


def _regime(work: _Workload) -> tuple[int, int]:
    """(preemptions so far, the most requests left waiting after a step): both 0 in the
    steady workload; under churn, no preemption."""
    return int(work.eng.stats().preemptions), work.left_waiting


def _write_control(channel: Path, control: dict[str, Any], cfg: EngineConfig) -> None:
    from slipstream_scheduler.enginecontrol import EngineControl
    from slipstream_scheduler.sim.simulator import profile_latency_model
    from slipstream_vllm.scheduler import write_control

    doc = dict(control)
    if doc["policy"] == "budget":
        doc["latency_model"] = profile_latency_model(cfg, samples=200).to_dict()
    write_control(channel, EngineControl(generation=1, **doc))


def _timed_steps(work: _Workload, steps: int) -> list[int]:
    """CPU nanoseconds of each step's schedule() plus update_from_output(), and the
    add_request() calls of the arrivals before it."""
    sched = work.eng.scheduler
    schedule, update, add = sched.schedule, sched.update_from_output, sched.add_request
    spent: list[int] = []
    adding = [0]

    def timed_add(*a: Any, **k: Any) -> Any:
        t = time.thread_time_ns()
        out = add(*a, **k)
        adding[0] += time.thread_time_ns() - t
        return out

    def timed_schedule(*a: Any, **k: Any) -> Any:
        t = time.thread_time_ns()
        out = schedule(*a, **k)
        spent.append(time.thread_time_ns() - t + adding[0])
        adding[0] = 0
        return out

    def timed_update(*a: Any, **k: Any) -> Any:
        t = time.thread_time_ns()
        out = update(*a, **k)
        spent[-1] += time.thread_time_ns() - t
        return out

    sched.schedule, sched.update_from_output = timed_schedule, timed_update
    sched.add_request = timed_add
    try:
        for _ in range(steps):
            work.step()
    finally:
        del sched.schedule, sched.update_from_output, sched.add_request
    return spent


def _measure_apart(
    n: int, config: str, steps: int, rounds: int, workload: str
) -> dict[str, Any]:
    """:func:`measure` in a process of its own, forked for this row: engines built for one
    row (and the garbage they leave) cannot slow the rows after it."""
    with multiprocessing.get_context("fork").Pool(1) as pool:
        row: dict[str, Any] = pool.apply(measure, (n, config, steps, rounds, workload))
    return row


def measure(
    n: int, config: str, steps: int, rounds: int, workload: str = "steady"
) -> dict[str, Any]:
    stock: list[int] = []
    plugin: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        channel = Path(tmp)
        mixed = config in MIXED
        engines = (
            _engine(n, None, None, steps * rounds, mixed=mixed, workload=workload),
            _engine(n, channel, CONFIGS[config], steps * rounds, mixed=mixed,
                    workload=workload),
        )
        for work in engines:
            _timed_steps(work, WARMUP_STEPS)
        arrivals = engines[1].added
        for _ in range(rounds):
            stock += _timed_steps(engines[0], steps)
            plugin += _timed_steps(engines[1], steps)
        arrivals = engines[1].added - arrivals
        regimes = [_regime(e) for e in engines]
        sched = engines[1].eng.scheduler
        online_only = sched.online_only_steps / max(sched.steps, 1)
        sched.shutdown()
    # Under churn an arrival may wait a step or two for tokens; never for KV (a preemption).
    drifted = (lambda r: r[0] > 0) if workload == "churn" else any
    if drifted(regimes[0]) or drifted(regimes[1]):
        raise RuntimeError(f"the steady state drifted: (preemptions, left waiting) stock "
                           f"{regimes[0]}, plugin {regimes[1]}")
    s_med, p_med = statistics.median(stock), statistics.median(plugin)
    # Step i of one engine against step i of the other: the same arrivals and finishes (the
    # same schedule, where the plugin's steps are vLLM's walk), so a step with three arrivals
    # is not set against one with none.
    added = statistics.median(p - s for s, p in zip(stock, plugin, strict=True))
    return {
        "running": n,
        "config": config,
        "workload": workload,
        "arrivals_per_step": arrivals / len(plugin),
        "most_left_waiting": max(regimes[0][1], regimes[1][1]),
        "steps": len(stock),
        "stock_median_us": s_med / 1e3,
        "plugin_median_us": p_med / 1e3,
        "added_median_us": added / 1e3,
        "median_difference_us": (p_med - s_med) / 1e3,
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

    for workload in args.workload:
        for n in args.running:
            for config in args.config:
                with console.status(f"plugin overhead: {workload}, {n} running, {config}"):
                    rows.append(_measure_apart(n, config, args.steps, args.rounds, workload))
    table = Table(title=f"CPU time per step, vLLM {version} in-process (median, µs)")
    for col in ("workload", "running", "plugin config", "arrivals/step", "online-only",
                "stock", "plugin", "added", "ratio"):
        table.add_column(col, justify="left" if col in ("workload", "plugin config") else "right")
    for r in rows:
        table.add_row(r["workload"], str(r["running"]), r["config"],
                      f"{r['arrivals_per_step']:.2f}", f"{r['online_only_share']:.0%}",
                      f"{r['stock_median_us']:.0f}", f"{r['plugin_median_us']:.0f}",
                      f"{r['added_median_us']:+.0f}", f"{r['ratio']:.2f}x")
    console.print(table)
    if args.json:
        doc = {"schema": SCHEMA, "vllm_version": version, "steps_per_round": args.steps,
               "rounds": args.rounds, "rows": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0
