"""``slipstream bench ordering``: FCFS, SJF-on-mean, TRAIL-like and Gittins at several loads.

Real prompts with real output lengths: every (prompt, generator) answer of
the AlpacaEval model-outputs file (``--prompts`` for another file in the same
format) is one online request whose input length is the prompt's token count
and whose output length is that generator's real answer length (regex token
counter of ``workloads.alpaca_eval``). Requests arrive as a seeded Poisson
stream in a seeded random order. The length predictor is SageSched's
semantic history (hashing embedder, cosine >= 0.8), fed only by requests as
they complete, as in production; it starts empty.

Two regimes. ``--engine model`` (the default) is sidecar mode: the
dispatcher holds online requests in the ordering's order and keeps at most
``--inflight`` in the engine model (a cap below ``max_num_seqs``, or the
ordering could not matter); preemptive orderings (TRAIL-like, Gittins) displace
an in-flight request by abort and resume. ``--engine vllm`` is engine mode:
every request goes straight into vLLM's real scheduler, the plugin orders
vLLM's waiting queue and preempts by the ordering (``ordering_vllm``), and KV
blocks (``--kv-blocks``), not a request cap, bound the batch. ``--long-share``
mixes in arXiv-summarisation requests (long prompts, long-tailed outputs), and
``--arrivals azure`` replays the Azure conversation trace's inter-arrival gaps,
rescaled to the load, instead of a Poisson stream.

Load = arrival rate / capacity, where capacity is the completion rate of a
FCFS run with every request queued at t = 0 in the same regime.

Deliberately left out: offline work (see ``bench colocation``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.table import Table

from slipstream_cli import plots
from slipstream_cli.argtypes import below_one, positive, whole
from slipstream_cli.benches.ordering_vllm import long_prompt_ids, text_token_ids
from slipstream_cli.commands.sim import (
    RichProgress,
    add_engine_argument,
    engine_factory_from_args,
)
from slipstream_cli.workloads import WorkloadError, alpaca_eval, arxiv, azure
from slipstream_scheduler.dispatcher import DispatcherConfig, OrderingQueue
from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.lengths import (
    GlobalDistributionPredictor,
    HashingEmbedder,
    SemanticHistoryPredictor,
)
from slipstream_scheduler.ordering import make_ordering
from slipstream_scheduler.protocols import LengthPredictor
from slipstream_scheduler.sim.simulator import SimConfig, SimResult, simulate
from slipstream_scheduler.sim.workload import SimRequest, Workload
from slipstream_scheduler.types import RequestClass

ORDERINGS = ("fcfs", "sjf", "trail", "trail-r100", "gittins-r200", "gittins-r100", "gittins-np")
FloatArray = npt.NDArray[np.float64]

VARIANTS: dict[str, tuple[str, dict[str, object], dict[str, int]]] = {
    "fcfs": ("fcfs", {}, {}),
    "sjf": ("sjf", {}, {}),
    "trail": ("trail", {"refresh_every_tokens": 200}, {}),
    "trail-r100": ("trail", {"refresh_every_tokens": 100}, {}),
    # Gittins as the core's defaults configure it.
    "gittins": ("gittins", {}, {}),
    # Preemptive Gittins re-ranked every 200 (SageSched's bucket) or 100 output tokens.
    "gittins-r200": ("gittins", {"refresh_every_tokens": 200}, {}),
    "gittins-r100": ("gittins", {"refresh_every_tokens": 100}, {}),
    # What the sidecar ships: Gittins ranks, no displacement of in-flight requests.
    "gittins-np": ("gittins", {"max_preemptions": 0}, {}),
    "trail-np": ("trail", {"max_preemptions": 0}, {}),
    # Before the fix: no global fallback, a request that outlived its sample is
    # ranked on the point O = 2·o (kept to measure what the fallback is worth).
    "gittins-nofb": ("gittins", {"refresh_every_tokens": 200}, {"fallback_samples": 0}),
    "trail-nofb": ("trail", {"refresh_every_tokens": 200}, {"fallback_samples": 0}),
    # With the tail guard (``--max-wait``): past the deadline, deadline order first.
    "gittins-guard": ("gittins", {"refresh_every_tokens": 200}, {}),
    "gittins-np-guard": ("gittins", {"max_preemptions": 0}, {}),
    "sjf-guard": ("sjf", {}, {}),
    "trail-guard": ("trail", {"refresh_every_tokens": 200}, {}),
}
"""Bench name -> (core ordering, params, ``OrderingQueue`` options). ``cost`` is added to the
params of every ordering but FCFS, and ``max_wait_s`` (``--max-wait``) to every ``-guard`` one."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, required=True, help="write the JSON report here")
    parser.add_argument(
        "--prompts", type=Path, help="AlpacaEval-format .jsonl.gz (default: shared)"
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests per run")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.7, 0.8, 0.9])
    parser.add_argument(
        "--inflight",
        type=int,
        default=8,
        help="sidecar mode (--engine model): online requests in the engine (default 8: with "
        "32, requests hardly queue below full load and every ordering gives the same result); "
        "engine mode (--engine vllm) has no cap, KV blocks bound the batch",
    )
    parser.add_argument("--orderings", nargs="+", default=list(ORDERINGS), choices=list(VARIANTS))
    parser.add_argument(
        "--costs",
        nargs="+",
        default=["memory", "output"],
        choices=["memory", "output"],
        help="request cost the size-based orderings rank by: memory = O²/2 + I·O (SageSched), "
        "output = O (decode steps; what an in-flight cap makes scarce). Each cost is run "
        "for every ordering alike.",
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1], help="arrival seeds (default 0 1)"
    )
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="an upper bound, not a deployable setting: every ordering is told each "
        "request's true output length instead of the semantic predictor's sample",
    )
    parser.add_argument(
        "--predictor",
        choices=["semantic", "global"],
        default="semantic",
        help="semantic (default): SageSched's history of similar prompts; global: every "
        "request predicted the distribution of all finished lengths (the baseline the "
        "semantic predictor must beat)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs simulated at once in worker processes (default 1); results are the same "
        "whatever the count (every run is seeded)",
    )
    parser.add_argument(
        "--kv-blocks",
        type=whole(1),
        help="KV cache blocks of the engine (default: what the model and GPU leave); fewer "
        "makes KV memory, not max_num_seqs, bound the batch",
    )
    parser.add_argument(
        "--long-share",
        type=below_one,
        default=0.0,
        help="share of requests that are arXiv summarisations (real prompt and output "
        "lengths, Vidur's Llama-2 counts): long prompts and long-tailed outputs (default 0)",
    )
    parser.add_argument(
        "--generator",
        metavar="NAME",
        help="one generator's answers only (the prompts file's `generator` field): the stream "
        "one model's service sees, the length history fed only by its own earlier answers "
        "(default: every generator's answers, mixed)",
    )
    parser.add_argument(
        "--arrivals",
        choices=["poisson", "azure"],
        default="poisson",
        help="poisson, or azure: the Azure conversation trace's inter-arrival gaps from a "
        "seeded offset, scaled to the load's rate (bursty)",
    )
    parser.add_argument(
        "--max-wait",
        type=positive,
        nargs="+",
        default=None,
        help="the tail guard's deadline for the -guard orderings, seconds: a request that has "
        "waited this long is served in deadline order ahead of the ranked ones; several "
        "values sweep it (each -guard ordering is then labelled NAME@SECONDS)",
    )
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--gpu", default="a100")
    add_engine_argument(parser)
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the request order and the capacity run"
    )


def build_workload(
    path: Path | None, n: int, seed: int, *, long_share: float = 0.0,
    generator: str | None = None,
) -> tuple[list[SimRequest], dict[str, list[int]]]:
    """(prompt, generator) answers as requests with real lengths and prompt vectors, and
    ``long_share`` of them arXiv summarisations; with every request's prompt token ids
    (what ``--engine vllm`` sends): its text's, or, for an arXiv prompt, a seeded draw.
    ``generator``: that generator's answers only (one model's service), else all of them."""
    rows = alpaca_eval.load_rows(path)
    if generator is not None:
        names = sorted({r.generator for r in rows})
        rows = [r for r in rows if r.generator == generator]
        if not rows:
            raise WorkloadError(f"--generator {generator}: no answers of it in the prompts "
                                f"file; its generators: {', '.join(names)}")
    count = alpaca_eval.make_token_counter("regex")
    emb = HashingEmbedder()
    rng = random.Random(seed)
    rng.shuffle(rows)
    n_long = round(n * long_share)
    seen: dict[str, tuple[Any, list[int]]] = {}
    out: list[SimRequest] = []
    prompts: dict[str, list[int]] = {}
    for i, row in enumerate(rows[: n - n_long]):
        known = seen.get(row.instruction)
        if known is None:
            known = seen[row.instruction] = (
                emb.embed_one(row.instruction),
                text_token_ids(row.instruction),
            )
        vec, ids = known
        rid = f"ae-{i}"
        prompts[rid] = ids
        out.append(
            SimRequest(
                rid,
                RequestClass.ONLINE,
                0.0,
                len(ids),
                max(count(row.output), 1),
                group=row.generator,
                vector=vec,
            )
        )
    if n_long:
        docs = list(arxiv.load())
        rng.shuffle(docs)
        if len(docs) < n_long:
            raise WorkloadError(f"--long-share needs {n_long} arXiv rows; the file has {len(docs)}")
        for j, d in enumerate(docs[:n_long]):
            rid = f"ax-{j}"
            ids = prompts[rid] = long_prompt_ids(rid, d.prompt_tokens)
            out.append(
                SimRequest(
                    rid,
                    RequestClass.ONLINE,
                    0.0,
                    d.prompt_tokens,
                    d.output_tokens,
                    group="arxiv",
                    vector=emb.embed_ids(ids[:EMBED_TOKENS]),
                )
            )
        rng.shuffle(out)
    return out, prompts


EMBED_TOKENS = 512
"""Leading token ids a prompt without text is embedded by (as the plugin embeds prompts)."""


def azure_gaps() -> FloatArray:
    """Inter-arrival gaps (s) of the Azure conversation trace (the shared dev file)."""
    t = np.array([r.arrival_s for r in azure.load()], dtype=np.float64)
    return np.diff(np.sort(t))


def arrival_times(
    n: int, rate: float, seed: int, gaps: FloatArray | None = None
) -> FloatArray:
    """``n`` arrival times at ``rate`` per second: Poisson, or the trace's ``gaps`` taken in
    order from a seeded offset (wrapping) and scaled so that their mean is ``1 / rate``."""
    rng = np.random.default_rng(seed)
    if gaps is None or gaps.size == 0:
        return np.cumsum(rng.exponential(1.0 / rate, size=n))
    start = int(rng.integers(gaps.size))
    take = np.take(gaps, np.arange(start, start + n), mode="wrap")
    return np.cumsum(take * (1.0 / rate) / take.mean())


def _with_arrivals(
    reqs: list[SimRequest], rate: float, seed: int, gaps: FloatArray | None = None
) -> tuple[SimRequest, ...]:
    t = arrival_times(len(reqs), rate, seed, gaps)
    return tuple(
        SimRequest(
            r.request_id,
            r.cls,
            float(ti),
            r.prompt_tokens,
            r.output_tokens,
            group=r.group,
            vector=r.vector,
        )
        for r, ti in zip(reqs, t, strict=True)
    )


class OracleLengths:
    """A ``LengthPredictor`` that knows the answer: the request's vector holds its true length.

    Only for ``--oracle`` runs, which show how much mean TTLT a perfect
    prediction could save under each ordering (the headroom a predictor works in).
    """

    def predict(self, vector: npt.NDArray[np.float32] | None, input_tokens: int) -> FloatArray:
        if vector is None:
            raise ValueError("oracle runs give every request its true length as its vector")
        return np.array([float(vector[0])], dtype=np.float64)

    def observe(
        self, vector: npt.NDArray[np.float32] | None, input_tokens: int, output_tokens: int
    ) -> None:
        return None


def oracle_requests(reqs: list[SimRequest]) -> list[SimRequest]:
    """The same requests with their true output length as their vector."""
    return [
        SimRequest(
            r.request_id,
            r.cls,
            r.arrival_s,
            r.prompt_tokens,
            r.output_tokens,
            group=r.group,
            vector=np.array([float(r.output_tokens)], dtype=np.float32),
        )
        for r in reqs
    ]


def _spec(name: str, cost: str, max_wait_s: float | None = None) -> tuple[str, dict[str, object]]:
    """A bench ordering's core name and parameters (``cost`` for all but FCFS, the tail
    guard's ``max_wait_s`` for the ``-guard`` variants)."""
    base, params, _ = VARIANTS[name]
    if base == "fcfs":
        return base, dict(params)
    if name.endswith("-guard"):
        if max_wait_s is None:
            raise ValueError(f"{name} needs --max-wait")
        return base, {**params, "cost": cost, "max_wait_s": max_wait_s}
    return base, {**params, "cost": cost}


def _run(  # noqa: PLR0917
    online: tuple[SimRequest, ...],
    spec: tuple[str, dict[str, object]],
    engine: EngineConfig,
    cap: int,
    seed: int,
    bar: RichProgress | None,
    label: str,
    oracle: bool = False,
    queue_options: dict[str, int] | None = None,
    engine_name: str = "model",
    prompts: dict[str, list[int]] | None = None,
    global_lengths: bool = False,
) -> SimResult:
    predictor: LengthPredictor = (
        OracleLengths()
        if oracle
        else GlobalDistributionPredictor()
        if global_lengths
        else SemanticHistoryPredictor(HashingEmbedder().dim)
    )
    span = online[-1].arrival_s if online else 1.0
    factory = None
    if engine_name == "vllm":
        # Engine mode: vLLM's waiting queue is the queue; the plugin orders it.
        from slipstream_cli.benches.ordering_vllm import plugin_ordering_factory

        factory = plugin_ordering_factory(
            *spec, prompts or {}, oracle=oracle, global_lengths=global_lengths
        )
        queue = OrderingQueue(make_ordering("fcfs"), predictor)
        dispatcher = DispatcherConfig(online_passthrough=True, admit_offline=False)
    else:
        queue = OrderingQueue(make_ordering(*spec), predictor, **(queue_options or {}))
        dispatcher = DispatcherConfig(max_online_inflight=cap, admit_offline=False)
    cfg = SimConfig(engine=engine, policy="online-only", seed=seed, dispatcher=dispatcher)
    return simulate(
        Workload(online=online),
        cfg,
        length_predictor=predictor,
        online_queue=queue,
        engine_factory=factory,
        progress=None if bar is None else (lambda t: bar(label, min(t, span), span)),
    )


@dataclass(frozen=True, slots=True)
class _Task:
    """One simulation of the bench: a picklable description for a worker process."""

    online: tuple[SimRequest, ...]
    name: str
    cost: str
    seed: int
    load: float
    rate: float
    engine: EngineConfig
    cap: int
    oracle: bool = False
    engine_name: str = "model"
    prompts: dict[str, list[int]] | None = None
    regime: str = "slot-cap"
    global_lengths: bool = False
    max_wait_s: float | None = None
    label_wait: bool = False  # a sweep of deadlines: the row's ordering is NAME@SECONDS


def _run_task(task: _Task, bar: RichProgress | None = None) -> dict[str, Any]:
    """Simulate one (ordering, cost, load, seed) and return its row."""
    tw = time.perf_counter()
    label = f"{task.name} ({task.cost}) load {task.load} seed {task.seed}"
    res = _run(
        task.online,
        _spec(task.name, task.cost, task.max_wait_s),
        task.engine,
        task.cap,
        task.seed,
        bar,
        label,
        oracle=task.oracle,
        queue_options=VARIANTS[task.name][2],
        engine_name=task.engine_name,
        prompts=task.prompts,
        global_lengths=task.global_lengths,
    )
    on = res.metrics.online
    st = res.engine
    return {
        "ordering": f"{task.name}@{task.max_wait_s:g}" if task.label_wait else task.name,
        "engine": task.engine_name,
        "regime": task.regime,
        "cost": "-" if task.name == "fcfs" else task.cost,
        "max_wait_s_guard": task.max_wait_s if task.name.endswith("-guard") else None,
        "seed": task.seed,
        "load": task.load,
        "arrival_rate_per_s": task.rate,
        "mean_ttlt_s": on.ttlt.mean,
        "p99_ttlt_s": on.ttlt.p99,
        "ttft_p99_s": on.ttft.p99,
        "ttft_mean_s": on.ttft.mean,
        "max_wait_s": on.ttft.max,
        "finished": on.finished,
        "reorders": res.dispatcher.reorders,
        "preemptions": on.preemptions,
        "displacements": (
            int(res.in_engine.get("online_displacements") or 0)
            if task.engine_name == "vllm"
            else res.dispatcher.reorders
        ),
        "displaced_tokens": int(res.in_engine.get("online_displaced_tokens") or 0),
        "prompt_tokens": st.prompt_tokens,
        "prefill_computed_tokens": st.computed_prefill_tokens,
        "prefix_hit_tokens": st.prefix_cache_hits,
        "wall_s": time.perf_counter() - tw,
    }


def saturated_rate(sat: SimResult) -> float:
    """Completions per second between the 10th and the 90th percentile finish of a run with
    every request queued at t = 0: the engine's rate while work waits, without the drain at
    the end (hundreds in flight in engine mode make that tail long: the last requests finish
    alone, and counting them would put the load's 1.0 far below saturation)."""
    done = np.sort(sat.metrics.samples.get("online_ttlt", np.zeros(0)))
    if done.size < 10:
        return sat.metrics.online.finished / sat.metrics.duration_s
    lo, hi = np.percentile(done, [10.0, 90.0])
    inside = np.count_nonzero((done > lo) & (done <= hi))
    return float(inside / (hi - lo)) if hi > lo else float(done.size / done[-1])


def _label(row: dict[str, Any]) -> str:
    return row["ordering"] if row["cost"] == "-" else f"{row['ordering']} ({row['cost']})"


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean over seeds of each (load, ordering, cost): the figures the verdict compares."""
    keys = sorted({(r["load"], r["ordering"], r["cost"]) for r in rows})
    out = []
    for load, ordering, cost in keys:
        group = [r for r in rows if (r["load"], r["ordering"], r["cost"]) == (load, ordering, cost)]
        out.append(
            {
                "load": load,
                "ordering": ordering,
                "cost": cost,
                "seeds": len(group),
                **{
                    k: float(np.mean([r[k] for r in group]))
                    for k in (
                        "mean_ttlt_s",
                        "p99_ttlt_s",
                        "ttft_p99_s",
                        "ttft_mean_s",
                        "max_wait_s",
                        "reorders",
                        "preemptions",
                        "displacements",
                    )
                    if all(k in r for r in group)
                },
            }
        )
    return out


def verdicts(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each Gittins variant and cost against the best non-Gittins ordering (any cost) per load."""
    out = []
    for load in sorted({r["load"] for r in summary}):
        at = [r for r in summary if r["load"] == load]
        others = [r for r in at if not r["ordering"].startswith("gittins")]
        if not others:
            continue
        best = min(others, key=lambda r: r["mean_ttlt_s"])
        fcfs = next((r for r in at if r["ordering"] == "fcfs"), None)
        for r in at:
            if r["ordering"].startswith("gittins"):
                out.append(
                    {
                        "load": load,
                        "ordering": r["ordering"],
                        "cost": r["cost"],
                        "best_other": _label(best),
                        "gittins_vs_best_other_mean_ttlt": 1.0
                        - r["mean_ttlt_s"] / best["mean_ttlt_s"],
                        "ttft_p99_over_fcfs": (
                            r["ttft_p99_s"] / fcfs["ttft_p99_s"] if fcfs is not None else None
                        ),
                    }
                )
    return out


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 120))
    t0 = time.perf_counter()
    engine = EngineConfig(model=args.model, gpu=args.gpu, num_gpu_blocks=args.kv_blocks)
    engine_factory_from_args(args, "slipstream bench ordering", ["bench", "ordering"])
    seeds = args.seeds
    guarded = [n for n in args.orderings if n.endswith("-guard")]
    if guarded and args.max_wait is None:
        parser = argparse.ArgumentParser(prog="slipstream bench ordering")
        add_arguments(parser)
        parser.error(f"{', '.join(guarded)} need --max-wait SECONDS")
    reqs, token_ids = build_workload(
        args.prompts, args.requests, args.seed, long_share=args.long_share,
        generator=args.generator,
    )
    prompts = token_ids if args.engine == "vllm" else None
    if args.oracle:
        reqs = oracle_requests(reqs)
    gaps = azure_gaps() if args.arrivals == "azure" else None
    regime = "in-engine" if args.engine == "vllm" else f"{args.inflight} in flight"
    rows: list[dict[str, Any]] = []
    with RichProgress(console) as bar:
        sat = _run(
            tuple(reqs),
            _spec("fcfs", "memory"),
            engine,
            args.inflight,
            args.seed,
            bar,
            "capacity (fcfs, all at t=0)",
            oracle=args.oracle,
            engine_name=args.engine,
            prompts=prompts,
        )
        capacity = saturated_rate(sat) if args.engine == "vllm" else (
            sat.metrics.online.finished / sat.metrics.duration_s
        )
        console.print(f"capacity ({regime}): {capacity:.2f} req/s")
        tasks: list[_Task] = []
        for seed, load, cost in itertools.product(seeds, args.loads, args.costs):
            online = _with_arrivals(reqs, load * capacity, seed, gaps)
            for name in args.orderings:
                if name == "fcfs" and cost != args.costs[0]:
                    continue  # FCFS ignores the cost: one run per load and seed
                rate = load * capacity
                waits = args.max_wait if name.endswith("-guard") else [None]
                for wait in waits:
                    tasks.append(
                        _Task(
                            online,
                            name,
                            cost,
                            seed,
                            load,
                            rate,
                            engine,
                            args.inflight,
                            args.oracle,
                            args.engine,
                            prompts,
                            regime,
                            args.predictor == "global",
                            wait,
                            len(waits) > 1,
                        )
                    )
        if args.jobs <= 1:
            rows = [_run_task(t, bar) for t in tasks]
        else:
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
                for row in pool.map(_run_task, tasks):
                    console.print(
                        f"done: {row['ordering']} ({row['cost']}) load {row['load']} "
                        f"seed {row['seed']}: mean TTLT {row['mean_ttlt_s']:.2f} s "
                        f"in {row['wall_s']:.0f} s"
                    )
                    rows.append(row)
    table = Table(title=f"online ordering, {regime}, {args.arrivals} arrivals")
    for col in (
        "load",
        "ordering",
        "cost",
        "seed",
        "mean TTLT s",
        "p99 TTLT s",
        "p99 TTFT s",
        "max wait s",
        "preemptions",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['load']:.2f}",
            r["ordering"],
            r["cost"],
            str(r["seed"]),
            f"{r['mean_ttlt_s']:.2f}",
            f"{r['p99_ttlt_s']:.2f}",
            f"{r['ttft_p99_s']:.2f}",
            f"{r['max_wait_s']:.2f}",
            str(r["preemptions"]),
        )
    console.print(table)
    summary = summarise(rows)
    verdict = verdicts(summary)
    for v in verdict:
        console.print(
            f"load {v['load']}: {v['ordering']} ({v['cost']}) mean TTLT vs the best other "
            f"({v['best_other']}): {v['gittins_vs_best_other_mean_ttlt']:+.1%} (positive: lower)"
        )
    doc = {
        "schema": "slipstream.bench.ordering/v1",
        "prompts": str(args.prompts or alpaca_eval.ALPACA_EVAL_FILE),
        "requests": len(reqs),
        "inflight_cap": args.inflight if args.engine == "model" else None,
        "capacity_req_per_s": capacity,
        "engine": args.engine,
        "regime": regime,
        "kv_blocks": sat.engine.kv_blocks_total,
        "max_num_seqs": engine.limits().max_num_seqs,
        "long_share": args.long_share,
        "generator": args.generator,
        "arrivals": args.arrivals,
        "model": args.model,
        "gpu": args.gpu,
        "seeds": seeds,
        "predictor": (
            "oracle (true lengths)"
            if args.oracle
            else "global distribution"
            if args.predictor == "global"
            else "semantic history (hashing)"
        ),
        "costs": args.costs,
        "rows": rows,
        "summary": summary,
        "gittins_vs_best_other": verdict,
        "wall_s": time.perf_counter() - t0,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    groups = [f"load {x}" for x in args.loads]
    stem = args.json.with_suffix("")
    labels = sorted({_label(r) for r in summary}, key=lambda k: (k.split(" ")[0], k))
    plots.grouped_bars(
        groups,
        {k: [r["mean_ttlt_s"] for r in summary if _label(r) == k] for k in labels},
        Path(f"{stem}-ttlt.png"),
        ylabel="mean TTLT (s)",
        title="mean time to last token per ordering and load (mean over seeds)",
    )
    plots.grouped_bars(
        groups,
        {k: [r["ttft_p99_s"] for r in summary if _label(r) == k] for k in labels},
        Path(f"{stem}-ttft.png"),
        ylabel="p99 TTFT (s)",
        title="p99 time to first token per ordering and load (mean over seeds)",
    )
    console.print(f"wrote {args.json}")
    return 0
