"""``slipstream bench core``: per-call cost of the scheduling core's hot paths.

Every number is the median over ``--rounds`` rounds of the mean cost of a
call within a round (``time.perf_counter_ns`` around ``--inner`` calls, after
a warm-up), in microseconds. Inputs come from the real data in
``$SLIPSTREAM_DATA`` (default ``<repo>/../shared/data``):

* the latency model is fitted on rows from the engine model's GPU timing
  model when a shipped GPU profile is available (otherwise on rows from a
  documented stand-in, and the output says so), with batches drawn from the
  Azure conversation trace's prompt lengths;
* ``predict_us``: one prediction from the incremental ``BatchFeatures``
  accumulator (the planner's path); baselines: ``predict(batch)`` re-summing a
  256-decode batch, and a numpy feature-vector dot product; as extras, the
  same prediction and the chunk solver of the opt-in token-curve model;
* ``length_predict_us``: ``SemanticHistoryPredictor.predict`` with its full
  10,000-record history filled from Alpaca prompts and their real answer
  lengths (cycled: the dev file holds 4,000), embedding excluded, timed while
  ``--load-procs`` Python busy-loop processes (default 3) run beside it, started
  ``--load-settle-s`` (default 60) before it so that the 1-minute load average
  reaches the 2-4 the target names on an otherwise idle 2-core host; as
  extras the same call on the quiet host (``length_predict_quiet_us``), its
  CPU time and the median single call under that load (and the quiet
  median), the full-vector scan (``search_dim=None``) on the same history,
  loaded and quiet, the load average before and during, and the
  input-length-only predictor;
  ``embed_us``: ``HashingEmbedder`` on one Alpaca prompt;
* ``gittins_us``: ``gittins_rank`` over the predicted cost sample;
* ``trie_insert_us``/``trie_pop_us``: ``PsmQueue.push``/``pop`` with MMLU
  5-shot prompts (long shared prefixes);
* ``plan_us``: one ``budget`` plan in ITERATION mode at 1,000 queued and 256
  running requests from the Azure trace (also ADMISSION mode and ``naive``);
* as extras, ``arrive_us_N_prefilling`` / ``decide_us_N_prefilling``: the
  dispatcher's ``arrive`` and ``decide`` for one online arrival granted at once
  (the sidecar's ``register``) with N requests awaiting their first token, and
  their same-run baselines without lazy keys and without cached prefill views.

Timings are printed and written (``--json``), never asserted. Deliberately
left out: end-to-end scheduling quality (``bench colocation`` and friends).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from slipstream_cli.argtypes import nonnegative, whole
from slipstream_cli.workloads import data_root
from slipstream_scheduler.admission import build_planner
from slipstream_scheduler.latency import (
    FEATURE_NAMES,
    BatchFeatures,
    FeatureSet,
    LatencyModelMeta,
    LinearLatencyModel,
    fit,
)
from slipstream_scheduler.planner import PlannerMode
from slipstream_scheduler.types import (
    BatchItem,
    EngineLimits,
    Phase,
    QueuedRequest,
    RequestClass,
    RunningRequest,
    Snapshot,
)

logger = logging.getLogger(__name__)

PLAN_TARGET_US = 200.0
LENGTH_TARGET_US = 500.0
BUSY_LOOP = "while True:\n    pass\n"
"""What each concurrent-load process runs: one Python busy loop (no I/O, little memory)."""
PREDICT_TARGET_US = 5.0

AZURE_CONV = "azure_llm_2023/AzureLLMInferenceTrace_conv.dev.csv"
ALPACA = "prompts/alpaca_5000.dev.json"
MMLU = "mmlu"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (median taken)")
    parser.add_argument("--inner", type=int, default=200, help="calls per timed round")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampled inputs")
    parser.add_argument(
        "--data", type=Path, default=None, help="shared data folder (default $SLIPSTREAM_DATA)"
    )
    parser.add_argument(
        "--load-procs",
        type=whole(0),
        default=3,
        help="busy-loop processes run beside the loaded length-prediction timing (default 3)",
    )
    parser.add_argument(
        "--load-settle-s",
        type=nonnegative,
        default=60.0,
        help="seconds the busy loops run before that timing starts, so that the 1-minute "
        "load average reflects them (default 60)",
    )


# ----------------------------------------------------------------------------- timing


def time_us(fn: Callable[[], object], *, rounds: int, inner: int, warmup: int = 50) -> float:
    """Median over rounds of the mean per-call cost, microseconds."""
    for _ in range(warmup):
        fn()
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        per_call.append((time.perf_counter_ns() - t0) / inner / 1e3)
    return statistics.median(per_call)


def time_each_us(fns: Sequence[Callable[[], object]], *, rounds: int) -> float:
    """Median over rounds of the mean cost of calling each of ``fns`` once."""
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for fn in fns:
            fn()
        per_call.append((time.perf_counter_ns() - t0) / len(fns) / 1e3)
    return statistics.median(per_call)


def time_each_cpu_us(fns: Sequence[Callable[[], object]], *, rounds: int) -> float:
    """As ``time_each_us`` but in this thread's CPU time (excludes waits for a core)."""
    per_call = []
    for _ in range(rounds):
        t0 = time.thread_time_ns()
        for fn in fns:
            fn()
        per_call.append((time.thread_time_ns() - t0) / len(fns) / 1e3)
    return statistics.median(per_call)


def time_each_median_call_us(fns: Sequence[Callable[[], object]], *, rounds: int) -> float:
    """Median over every single call of ``fns`` (``rounds`` passes), microseconds.

    Unlike the per-round mean, a call that loses its core to another process
    only moves the median if most calls do.
    """
    per_call = []
    for _ in range(rounds):
        for fn in fns:
            t0 = time.perf_counter_ns()
            fn()
            per_call.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(per_call)


@contextmanager
def busy_load(procs: int, settle_s: float = 0.5) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``procs`` concurrent Python busy-loop processes for the duration of the block, started
    ``settle_s`` seconds before it (at least long enough to reach the loop)."""
    started = [
        subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL)
        for _ in range(procs)
    ]
    try:
        time.sleep(max(settle_s, 0.5) if procs else 0.0)
        yield started
    finally:
        for p in started:
            p.terminate()
        for p in started:
            p.wait()


# ----------------------------------------------------------------------------- dispatcher


def dispatch_costs(
    model: LinearLatencyModel,
    lengths: Sequence[tuple[int, int]],
    *,
    prefilling: int,
    ordering: str = "gittins",
    lazy_keys: bool = True,
    rebuild_views: bool = False,
    rounds: int,
    inner: int,
) -> tuple[float, float]:
    """(``arrive``, ``decide``) µs of one online arrival granted at once, as the sidecar's
    ``register`` does, with ``prefilling`` granted requests awaiting their first token.

    The dispatcher is the sidecar's: the budget planner in ADMISSION mode, the
    online queue in the ordering without displacement, its length predictor the
    input-length history filled from the Azure trace. Each arrival is granted
    by the ``decide`` and then taken out (``failed``, not timed), so every
    sample sees the same state. Baselines for the same run: ``lazy_keys=False``
    keys the lone arrival on push (the queue before lazy keys),
    ``rebuild_views=True`` rebuilds every prefilling request's planner view per
    ``decide`` (the dispatcher before it cached them).
    """
    from slipstream_scheduler.dispatcher import (
        Dispatcher,
        DispatcherConfig,
        Incoming,
        OrderingQueue,
    )
    from slipstream_scheduler.lengths import InputLengthHistoryPredictor
    from slipstream_scheduler.ordering import make_ordering

    predictor = InputLengthHistoryPredictor()
    for p, o in lengths[:10_000]:
        predictor.observe(None, p, o)
    params: dict[str, object] = {} if ordering == "fcfs" else {"max_preemptions": 0}
    queue = OrderingQueue(make_ordering(ordering, params), predictor)
    queue.lazy_keys = lazy_keys
    d = Dispatcher(
        DispatcherConfig(),
        build_planner("budget", latency_model=model, mode=PlannerMode.ADMISSION),
        online_queue=queue,
        length_predictor=predictor,
        limits=EngineLimits(max_num_seqs=prefilling + 8),
        budget_s=1.0,
    )
    on = RequestClass.ONLINE
    for k in range(prefilling):
        p, o = lengths[k % len(lengths)]
        d.arrive(Incoming(f"p{k}", on, p, o, 0.0), 0.0)
    while d.decide(0.0):
        pass
    serial = iter(range(1 << 62))
    arrive_ns: list[int] = []
    decide_ns: list[int] = []

    def one() -> None:
        k = next(serial)
        p, o = lengths[k % len(lengths)]
        rid = f"a{k}"
        if rebuild_views:
            d._pf_stamp = (-1, -1, -1)  # stale: the next plan rebuilds every view
        t0 = time.perf_counter_ns()
        d.arrive(Incoming(rid, on, p, o, 1.0), 1.0)
        t1 = time.perf_counter_ns()
        dec = d.decide(1.0)
        t2 = time.perf_counter_ns()
        if len(dec.submit) != 1:
            raise RuntimeError("the bench arrival was not granted at once")
        d.failed(rid, 1.0)
        d.decide(1.0)  # the exit is planned too (nothing to admit: no plan)
        arrive_ns.append(t1 - t0)
        decide_ns.append(t2 - t1)

    for _ in range(50):
        one()
    arrive_ns.clear()
    decide_ns.clear()
    arrive_us, decide_us = [], []
    for _ in range(rounds):
        for _ in range(inner):
            one()
        arrive_us.append(sum(arrive_ns) / len(arrive_ns) / 1e3)
        decide_us.append(sum(decide_ns) / len(decide_ns) / 1e3)
        arrive_ns.clear()
        decide_ns.clear()
    return statistics.median(arrive_us), statistics.median(decide_us)


# ----------------------------------------------------------------------------- data


def azure_lengths(root: Path) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of the Azure conversation dev trace."""
    out = []
    with (root / AZURE_CONV).open(encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            prompt, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            if prompt > 0 and output > 0:
                out.append((prompt, output))
    return out


def alpaca_prompts(root: Path) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of the Alpaca dev subset."""
    rows = json.loads((root / ALPACA).read_text(encoding="utf-8"))
    out = []
    for r in rows:
        prompt = r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")
        out.append((prompt, r["output"]))
    return out


def mmlu_prompts(root: Path, subjects: int, per_subject: int) -> list[str]:
    """MMLU 5-shot prompts for the first ``subjects`` subjects (sorted by name)."""
    from slipstream_cli.workloads.mmlu import five_shot_prompt

    test_dir, dev_dir = root / MMLU / "test", root / MMLU / "dev"
    names = sorted(p.name[: -len("_test.csv")] for p in test_dir.glob("*_test.csv"))[:subjects]
    prompts: list[str] = []
    for subject in names:
        with (dev_dir / f"{subject}_dev.csv").open(encoding="utf-8", newline="") as f:
            dev = list(csv.reader(f))[1:]
        with (test_dir / f"{subject}_test.csv").open(encoding="utf-8", newline="") as f:
            test = list(csv.reader(f))[1:]
        prompts.extend(five_shot_prompt(subject, dev, row) for row in test[:per_subject])
    return prompts


# ----------------------------------------------------------------------------- latency


@dataclass(frozen=True, slots=True)
class FittedModel:
    model: LinearLatencyModel
    source: str
    kfold: dict[str, float]
    curve: LinearLatencyModel | None = None  # the token-curve set fitted on the same rows


def _random_batch(
    rng: np.random.Generator, lengths: Sequence[tuple[int, int]], cap: int
) -> list[BatchItem]:
    """A plausible engine batch: decodes at real context lengths, prefill chunks of real prompts."""
    n_dec = int(rng.integers(0, 257))
    batch = []
    for _ in range(n_dec):
        prompt, output = lengths[int(rng.integers(len(lengths)))]
        batch.append(BatchItem(Phase.DECODE, 1, prompt + int(rng.integers(0, output + 1))))
    left = cap - n_dec
    for _ in range(int(rng.integers(0, 4))):
        if left <= 0:
            break
        prompt, _ = lengths[int(rng.integers(len(lengths)))]
        done = int(rng.integers(0, prompt)) if rng.random() < 0.3 else 0
        chunk = min(prompt - done, left)
        batch.append(BatchItem(Phase.PREFILL, chunk, done))
        left -= chunk
    return batch or [BatchItem(Phase.DECODE, 1, lengths[0][0])]


def _stand_in_seconds(batch: Sequence[BatchItem]) -> float:
    """Stand-in iteration time when no GPU profile ships: a 7B-on-H100 roofline.

    4.7 ms to stream 14 GB of weights, 35 µs of linear layers per token, 1.3 ns
    per prefill attention pair and 0.17 µs per decode KV token (512 KiB/token
    at 3 TB/s). Only there to have *a* fitted model to time.
    """
    tokens = sum(i.tokens for i in batch)
    pairs = sum(
        i.tokens * (i.context + (i.tokens + 1) / 2) for i in batch if i.phase is Phase.PREFILL
    )
    kv = sum(i.context + 1 for i in batch if i.phase is Phase.DECODE)
    return 4.7e-3 + 3.5e-5 * tokens + 1.3e-9 * pairs + 1.75e-7 * kv


def fitted_model(lengths: Sequence[tuple[int, int]], seed: int, rows: int = 3000) -> FittedModel:
    rng = np.random.default_rng(seed)
    batches = [_random_batch(rng, lengths, 2048) for _ in range(rows)]
    timing: Callable[[Sequence[BatchItem]], float] = _stand_in_seconds
    source = "stand-in roofline (no GPU profile shipped)"
    meta = LatencyModelMeta(model="stand-in", gpu="stand-in", source=source)
    try:
        from slipstream_scheduler.engine.gpu import (
            GpuTimingModel,
            available_profiles,
            load_profile,
        )

        profiles = available_profiles()
        if profiles:
            model_name, gpu = next(
                (p for p in profiles if p == ("llama-2-7b", "h100")), profiles[0]
            )
            gt = GpuTimingModel(load_profile(model_name, gpu))
            timing = gt.predict
            source = f"engine GPU timing model {model_name} on {gpu}"
            meta = LatencyModelMeta(
                model=model_name,
                gpu=gpu,
                engine={"max_num_batched_tokens": 2048},
                source=source,
            )
    except ImportError:  # the engine model is another package's work in progress
        logger.warning("engine GPU timing model not importable; using the stand-in")
    rows_fit = [(b, timing(b)) for b in batches]
    result = fit(rows_fit, meta=meta, seed=seed)
    # The token-curve model (opt-in, slower to fit): on part of the rows, two folds,
    # only to time its prediction and its chunk solver.
    curve = fit(
        rows_fit[:1500], feature_sets=[FeatureSet.CONTEXT_CHUNK_CURVE], folds=2, seed=seed
    ).model
    return FittedModel(
        result.model,
        source,
        {k.value: v for k, v in result.kfold.items()},
        curve if curve.feature_set.has_curve else None,
    )


# ----------------------------------------------------------------------------- snapshot


def bench_snapshot(
    lengths: Sequence[tuple[int, int]], seed: int, *, running: int = 256, queued: int = 1000
) -> Snapshot:
    """256 running (mostly decoding, some prefilling) and 1,000 queued, from the Azure trace."""
    rng = np.random.default_rng(seed)

    def pick() -> tuple[int, int]:
        return lengths[int(rng.integers(len(lengths)))]

    run = []
    for i in range(running):
        prompt, output = pick()
        cls = RequestClass.ONLINE if i % 3 == 0 else RequestClass.OFFLINE
        if i % 32 == 5:
            computed, generated = int(rng.integers(0, prompt)), 0
        else:
            computed, generated = prompt, int(rng.integers(1, output + 1))
        run.append(
            RunningRequest(f"r{i}", cls, prompt, computed, generated, output, float(i), int(cls))
        )
    online = []
    offline = []
    for i in range(queued):
        prompt, output = pick()
        if i % 10 == 0:
            online.append(
                QueuedRequest(f"q-on-{i}", RequestClass.ONLINE, prompt, output, 1000.0 + i)
            )
        else:
            offline.append(
                QueuedRequest(f"q-off-{i}", RequestClass.OFFLINE, prompt, output, 1000.0 + i)
            )
    return Snapshot(
        now_s=2000.0,
        running=tuple(run),
        online_queue=tuple(online),
        offline_queue=tuple(offline),
        free_kv_blocks=12_000,
        limits=EngineLimits(max_num_seqs=512, max_num_batched_tokens=2048),
        budget_s=None,
    )


# ----------------------------------------------------------------------------- run


def _bisect_max_prefill(
    model: LinearLatencyModel, f: BatchFeatures, context: int, budget: float, limit: int
) -> int:
    """Baseline for ``max_prefill_tokens``: integer bisection on the model."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.predict_with_prefill(f, mid, context) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def measure(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.data) if args.data is not None else data_root()
    rounds, inner, seed = args.rounds, args.inner, args.seed
    notes: list[str] = []
    results: dict[str, Any] = {}
    extra: dict[str, float] = {}
    ratios: dict[str, float] = {}

    lengths = azure_lengths(root)
    fm = fitted_model(lengths, seed)
    model = fm.model

    # -- latency prediction
    rng = np.random.default_rng(seed + 1)
    batch = [BatchItem(Phase.DECODE, 1, p + o // 2) for p, o in (lengths[i] for i in range(256))]
    batch.append(BatchItem(Phase.PREFILL, 512, 0))
    f = BatchFeatures.of(batch)
    results["predict_us"] = time_us(lambda: model.predict_features(f), rounds=rounds, inner=inner)
    extra["predict_batch_257_us"] = time_us(
        lambda: model.predict(batch), rounds=rounds, inner=max(1, inner // 10)
    )
    w = np.asarray(model.coefficients)

    def numpy_predict() -> float:
        x: npt.NDArray[np.float64] = np.asarray(f.row())
        return float(x @ w)

    extra["predict_numpy_us"] = time_us(numpy_predict, rounds=rounds, inner=inner)
    ratios["predict_batch_vs_accumulator"] = extra["predict_batch_257_us"] / results["predict_us"]
    ratios["predict_numpy_vs_accumulator"] = extra["predict_numpy_us"] / results["predict_us"]
    budget = model.predict_features(f) * 1.5
    extra["max_prefill_us"] = time_us(
        lambda: model.max_prefill_tokens(f, 300, budget, 2048), rounds=rounds, inner=inner
    )
    extra["max_prefill_bisect_us"] = time_us(
        lambda: _bisect_max_prefill(model, f, 300, budget, 2048), rounds=rounds, inner=inner
    )
    ratios["max_prefill_bisect_vs_closed_form"] = (
        extra["max_prefill_bisect_us"] / extra["max_prefill_us"]
    )
    if fm.curve is not None:
        cm = fm.curve
        extra["predict_curve_us"] = time_us(
            lambda: cm.predict_features(f), rounds=rounds, inner=inner
        )
        curve_budget = cm.predict_features(f) * 1.5
        extra["max_prefill_curve_us"] = time_us(
            lambda: cm.max_prefill_tokens(f, 300, curve_budget, 2048), rounds=rounds, inner=inner
        )
        ratios["predict_curve_vs_hinge"] = extra["predict_curve_us"] / results["predict_us"]

    # -- plan
    snap = bench_snapshot(lengths, seed)
    full = model.predict(
        [BatchItem(Phase.DECODE, 1, r.context_tokens) for r in snap.running if not r.in_prefill]
    )
    snap_b = Snapshot(
        snap.now_s,
        snap.running,
        snap.online_queue,
        snap.offline_queue,
        snap.free_kv_blocks,
        snap.limits,
        budget_s=full * 1.6,
    )
    plan_inner = max(1, inner // 10)
    budget_planner = build_planner("budget", latency_model=model)
    plan = budget_planner.plan(snap_b)
    results["plan_us"] = time_us(
        lambda: budget_planner.plan(snap_b), rounds=rounds, inner=plan_inner
    )
    naive = build_planner("naive", latency_model=model)
    extra["plan_naive_us"] = time_us(lambda: naive.plan(snap_b), rounds=rounds, inner=plan_inner)
    admission = build_planner("budget", latency_model=model, mode=PlannerMode.ADMISSION)
    extra["plan_admission_us"] = time_us(
        lambda: admission.plan(snap_b), rounds=rounds, inner=plan_inner
    )
    extra["plan_admission_admitted"] = float(len(admission.plan(snap_b).admitted))
    ratios["plan_budget_vs_naive"] = results["plan_us"] / extra["plan_naive_us"]
    ratios["plan_vs_target_200us"] = results["plan_us"] / PLAN_TARGET_US
    ratios["plan_admission_vs_target_200us"] = extra["plan_admission_us"] / PLAN_TARGET_US
    ratios["predict_vs_target_5us"] = results["predict_us"] / PREDICT_TARGET_US
    extra["plan_scheduled"] = float(len(plan.scheduled))
    extra["plan_admitted"] = float(len(plan.admitted))
    extra["plan_predicted_over_budget"] = plan.predicted_step_s / (snap_b.budget_s or 1.0)

    # -- one online arrival granted at once (the sidecar's register), N in prefill
    for n in (0, 16, 64):
        cost = partial(dispatch_costs, model, lengths, prefilling=n, rounds=rounds, inner=inner)
        arrive, decide = cost()
        extra[f"arrive_us_{n}_prefilling"], extra[f"decide_us_{n}_prefilling"] = arrive, decide
        eager, _ = cost(lazy_keys=False)
        _, rebuild = cost(rebuild_views=True)
        extra[f"arrive_eager_keys_us_{n}_prefilling"] = eager
        extra[f"decide_rebuilt_views_us_{n}_prefilling"] = rebuild
        ratios[f"arrive_lazy_vs_eager_keys_{n}_prefilling"] = arrive / eager
        ratios[f"decide_cached_vs_rebuilt_views_{n}_prefilling"] = decide / rebuild
    extra["arrive_fcfs_us_0_prefilling"], _ = dispatch_costs(
        model, lengths, prefilling=0, ordering="fcfs", rounds=rounds, inner=inner
    )

    # -- length prediction, embedding, Gittins (another engineer's modules)
    pairs = alpaca_prompts(root)
    try:
        from slipstream_cli.workloads.tokenize import count_tokens
        from slipstream_scheduler.lengths import (
            HashingEmbedder,
            InputLengthHistoryPredictor,
            SemanticHistoryPredictor,
        )

        embedder = HashingEmbedder()
        order = rng.permutation(len(pairs))
        held = [pairs[i] for i in order[:200]]
        history = [pairs[i] for i in order[200:]]
        vectors = embedder.embed([p for p, _ in history])
        predictor = SemanticHistoryPredictor(embedder.dim)
        by_input = InputLengthHistoryPredictor()
        # The size: a full 10,000-record window. The dev file has fewer
        # prompts, so the history cycles through them (as `bench lengths` does);
        # repeats cost the search exactly what distinct prompts would.
        window = predictor.params.window
        counted = [(count_tokens(p), max(1, count_tokens(a))) for p, a in history]
        for j in range(window):
            i = j % len(history)
            predictor.observe(vectors[i], *counted[i])
            by_input.observe(None, *counted[i])
        held_vectors = embedder.embed([p for p, _ in held])
        held_inputs = [count_tokens(p) for p, _ in held]
        results["embed_us"] = time_each_us(
            [partial(embedder.embed, [p]) for p, _ in held], rounds=rounds
        )
        # The full-vector scan in the same run: the predictor as it was before the
        # compact search (``search_dim=None``), on the same history and queries.
        full_scan = SemanticHistoryPredictor(
            embedder.dim, predictor.params.model_copy(update={"search_dim": None})
        )
        for j in range(window):
            i = j % len(history)
            full_scan.observe(vectors[i], *counted[i])
        calls = {
            "compact": [
                partial(predictor.predict, v, n)
                for v, n in zip(held_vectors, held_inputs, strict=True)
            ],
            "full": [
                partial(full_scan.predict, v, n)
                for v, n in zip(held_vectors, held_inputs, strict=True)
            ],
        }
        quiet = {k: time_each_us(fns, rounds=rounds) for k, fns in calls.items()}
        extra["length_load_avg_1m_before"] = os.getloadavg()[0]
        with busy_load(args.load_procs, args.load_settle_s):
            extra["length_load_avg_1m_start"] = os.getloadavg()[0]
            loaded = {k: time_each_us(fns, rounds=rounds) for k, fns in calls.items()}
            loaded_cpu = time_each_cpu_us(calls["compact"], rounds=rounds)
            loaded_median = time_each_median_call_us(calls["compact"], rounds=rounds)
            extra["length_load_avg_1m_during"] = os.getloadavg()[0]
        extra["length_load_procs"] = float(args.load_procs)
        extra["length_load_settle_s"] = float(args.load_settle_s)
        results["length_predict_us"] = loaded["compact"]
        extra["length_predict_quiet_us"] = quiet["compact"]
        extra["length_predict_cpu_us"] = loaded_cpu
        extra["length_predict_median_call_us"] = loaded_median
        extra["length_predict_median_call_quiet_us"] = time_each_median_call_us(
            calls["compact"], rounds=rounds
        )
        extra["length_predict_full_scan_us"] = loaded["full"]
        extra["length_predict_full_scan_quiet_us"] = quiet["full"]
        extra["length_search_dim"] = float(predictor.params.search_dim or embedder.dim)
        ratios["length_predict_vs_target_500us"] = loaded["compact"] / LENGTH_TARGET_US
        ratios["length_predict_compact_vs_full_scan"] = loaded["compact"] / loaded["full"]
        ratios["length_predict_compact_vs_full_scan_quiet"] = quiet["compact"] / quiet["full"]
        ratios["length_predict_loaded_vs_quiet"] = loaded["compact"] / quiet["compact"]
        extra["length_predict_input_only_us"] = time_each_us(
            [partial(by_input.predict, None, n) for n in held_inputs], rounds=rounds
        )
        extra["length_history_records"] = float(len(predictor))
        samples = [predictor.predict(v, n) for v, n in zip(held_vectors, held_inputs, strict=True)]
        extra["length_sample_size_median"] = float(np.median([len(s) for s in samples]))
        try:
            from slipstream_scheduler.gittins import gittins_rank, request_cost

            costs = [request_cost(n, s) for n, s in zip(held_inputs, samples, strict=True)]
            results["gittins_us"] = time_each_us(
                [partial(gittins_rank, c) for c in costs], rounds=rounds
            )
            # Baseline: the mean cost (what SJF-on-mean orders by).
            extra["mean_cost_us"] = time_each_us(
                [partial(np.mean, c) for c in costs], rounds=rounds
            )
            ratios["gittins_vs_mean_cost"] = results["gittins_us"] / extra["mean_cost_us"]
        except ImportError as exc:
            notes.append(f"gittins not measured: {exc}")
    except ImportError as exc:
        notes.append(f"length predictor/embedder not measured: {exc}")

    # -- PSM trie
    try:
        from slipstream_cli.workloads.tokenize import tokenize
        from slipstream_scheduler.psm import PsmQueue

        prompts = mmlu_prompts(root, subjects=20, per_subject=50)
        token_ids = [tokenize(p) for p in prompts]
        extra["trie_prompt_tokens_mean"] = float(np.mean([len(t) for t in token_ids]))
        inserts: list[float] = []
        pops: list[float] = []
        for _ in range(rounds):
            q = PsmQueue()
            t0 = time.perf_counter_ns()
            for i, ids in enumerate(token_ids):
                q.push(f"m{i}", ids, float(i))
            inserts.append((time.perf_counter_ns() - t0) / len(token_ids) / 1e3)
            t0 = time.perf_counter_ns()
            for _ in range(len(token_ids)):
                q.pop(1e9)
            pops.append((time.perf_counter_ns() - t0) / len(token_ids) / 1e3)
        results["trie_insert_us"] = statistics.median(inserts)
        results["trie_pop_us"] = statistics.median(pops)
        extra["trie_requests"] = float(len(token_ids))
    except ImportError as exc:
        notes.append(f"PSM trie not measured: {exc}")

    return {
        **results,
        "extra": extra,
        "ratios": ratios,
        "latency_model": {
            "source": fm.source,
            "feature_set": model.feature_set.value,
            "kfold_mape": fm.kfold,
            "coefficients": dict(zip(FEATURE_NAMES, model.coefficients, strict=True)),
        },
        "config": {"rounds": rounds, "inner": inner, "seed": seed},
        "notes": notes,
    }


KEYS = (
    "predict_us",
    "length_predict_us",
    "embed_us",
    "gittins_us",
    "trie_insert_us",
    "trie_pop_us",
    "plan_us",
)


def render(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="slipstream bench core: per-call cost (median, µs)")
    table.add_column("measure")
    table.add_column("µs/call", justify="right")
    for key in KEYS:
        value = out.get(key)
        table.add_row(key, "not measured" if value is None else f"{value:.2f}")
    for key, value in out["extra"].items():
        table.add_row(f"  {key}", f"{value:.2f}")
    console.print(table)
    ratios = Table(title="ratios (same run)")
    ratios.add_column("ratio")
    ratios.add_column("value", justify="right")
    for key, value in out["ratios"].items():
        ratios.add_row(key, f"{value:.2f}")
    console.print(ratios)
    lm = out["latency_model"]
    console.print(
        f"latency model: {lm['source']}; chosen feature set {lm['feature_set']}; k-fold MAPE "
        + ", ".join(f"{k} {v * 100:.2f} %" for k, v in lm["kfold_mape"].items())
    )
    for note in out["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")


def run(args: argparse.Namespace) -> int:
    out = measure(args)
    render(out)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return 0
