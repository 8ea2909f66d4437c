"""Latency-model profiler: time profiling batches on the engine model, fit HyGen's model.

HyGen profiles a GPU by running synthetic batches that sweep request counts,
sequence lengths and prefill/decode mixes, timing each, and fitting a linear
model (``slipstream_scheduler.latency``). Here the "GPU" is the engine model's
timing model with its measurement noise (:meth:`EngineModel.measure`). Two row
sources:

* **sweep** (:func:`profiling_batches`): decode-only, prefill-only and mixed
  batches, counts and lengths drawn log-uniformly, within the engine's token
  budget and ``max_num_seqs``;
* **engine run** (:func:`engine_run_rows`): batches the engine model itself
  forms while serving a synthetic open workload (continuous batching, chunked
  prefill, prefix hits), with their simulated step times.

The fit uses the rows of both sources except a held-out share; the report
gives MAPE on the held-out rows of each source (HyGen reports 1.07-1.78 %).
The held-out rows play no part in choosing the feature set or the hinge's
knee, so they measure the chosen model without selection bias.

``curve=True`` also offers the fit the token-curve set (``context+chunk+curve``:
a fitted monotone staircase of the linear layers' cost in tokens instead of
the one hinge), which reaches HyGen's 1.5 % on every shipped profile
(``docs/concepts/engine-model.md``) and is what the shipped profiles use
(``slipstream profile latency`` passes it unless ``--no-curve``). It is off
by default here only because it costs seconds more to fit (tests and
callers that fit small row sets keep the fast hinge sets).

Deliberately left out: the SLO-aware budget search (the simulator's job) and
any file I/O (the CLI writes the model's JSON).
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

from slipstream_scheduler.engine.model import EngineConfig, EngineModel, EngineRequest
from slipstream_scheduler.latency import (
    DEFAULT_FEATURE_SETS,
    FeatureSet,
    LatencyModelMeta,
    LinearLatencyModel,
    fit,
)
from slipstream_scheduler.types import BatchItem, EngineLimits, Phase

logger = logging.getLogger(__name__)

Batch = tuple[BatchItem, ...]


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    if hi <= lo:
        return lo
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


def _decodes(rng: random.Random, n: int, max_context: int) -> list[BatchItem]:
    typical = _log_uniform(rng, 16, max_context)
    out = []
    for _ in range(n):
        ctx = int(typical * rng.uniform(0.5, 1.5))
        out.append(BatchItem(Phase.DECODE, 1, max(1, min(max_context - 1, ctx))))
    return out


def _prefills(rng: random.Random, tokens: int, k: int, max_context: int) -> list[BatchItem]:
    k = max(1, min(k, tokens))
    cuts = sorted(rng.sample(range(1, tokens), k - 1)) if k > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, tokens], strict=True)]
    out = []
    for size in sizes:
        room = max(0, max_context - size)
        ctx = 0 if rng.random() < 0.5 or room == 0 else rng.randint(0, room)
        out.append(BatchItem(Phase.PREFILL, size, ctx))
    return out


def profiling_batches(
    seed: int, limits: EngineLimits, n: int = 4000, max_context: int = 4096
) -> list[Batch]:
    """``n`` synthetic batches sweeping counts, lengths and prefill/decode mixes.

    A third each: decode-only (1..max_num_seqs decodes around a log-uniform
    typical context), prefill-only (1-4 chunks sharing a log-uniform token
    count, half of them after a cached or computed prefix), and mixed (decodes
    plus prefill chunks filling part of the remaining token budget).
    """
    rng = random.Random(seed)
    budget, seqs = limits.max_num_batched_tokens, limits.max_num_seqs
    out: list[Batch] = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            items = _decodes(rng, _log_uniform(rng, 1, min(seqs, budget)), max_context)
        elif kind == 1:
            tokens = _log_uniform(rng, 16, budget)
            items = _prefills(rng, tokens, rng.randint(1, min(4, seqs)), max_context)
        else:
            nd = _log_uniform(rng, 1, min(seqs - 1, budget - 1))
            items = _decodes(rng, nd, max_context)
            left = budget - nd
            tokens = rng.randint(1, left)
            items += _prefills(rng, tokens, rng.randint(1, min(2, seqs - nd)), max_context)
        out.append(tuple(items))
    return out


def engine_run_rows(
    config: EngineConfig, seed: int, n: int = 1500, max_context: int = 4096
) -> list[tuple[Batch, float]]:
    """``(batch, seconds)`` of ``n`` steps of the engine model serving a synthetic load.

    Requests arrive whenever fewer than 32 wait; prompts and outputs are
    log-uniform; a third share one of 8 system-prompt prefixes (prefix hits).
    """
    rng = random.Random(seed)
    engine = EngineModel(config, seed=seed + 1)
    bs = config.block_size
    rows: list[tuple[Batch, float]] = []
    k = 0
    while len(rows) < n:
        while engine.stats().waiting < 32:
            prompt = _log_uniform(rng, 8, max_context // 2)
            hashes: tuple[int, ...] = ()
            if rng.random() < 1 / 3:
                shared = rng.randrange(8)
                hashes = tuple(shared * 100_000 + j for j in range(prompt // bs))
            engine.add(
                EngineRequest(
                    f"p{k}",
                    prompt,
                    max_tokens=max(1, min(max_context - prompt, _log_uniform(rng, 1, 1024))),
                    priority=rng.randrange(2),
                    arrival_s=float(k),
                    block_hashes=hashes,
                )
            )
            k += 1
        res = engine.step()
        if res.num_tokens:
            rows.append((res.batch, res.duration_s))
    return rows


@dataclass(frozen=True, slots=True)
class ProfileReport:
    """How well the fitted model predicts held-out profiling rows."""

    model: str
    gpu: str
    noise_cv: float
    rows_train: int
    rows_test_sweep: int
    rows_test_engine: int
    feature_set: str
    kfold_mape: float  # on the training rows (fraction)
    test_mape_sweep: float  # held-out sweep batches (fraction)
    test_mape_engine: float  # held-out engine-run batches (fraction)
    test_p95_ape: float  # 95th percentile absolute percentage error, all held-out rows
    knee_tokens: int = 0  # the hinge's knee (tokens per step); 0 without a hinge
    curve_step_tokens: int = 0  # the token curve's knot spacing; 0 without a curve

    def summary(self) -> str:
        knee = f" knee={self.knee_tokens}" if self.knee_tokens else ""
        if self.curve_step_tokens:
            knee += f" curve_step={self.curve_step_tokens}"
        return (
            f"features={self.feature_set}{knee} train={self.rows_train} "
            f"kfold MAPE={self.kfold_mape:.2%} held-out MAPE sweep={self.test_mape_sweep:.2%} "
            f"(n={self.rows_test_sweep}) engine-run={self.test_mape_engine:.2%} "
            f"(n={self.rows_test_engine}) p95 APE={self.test_p95_ape:.2%} "
            f"noise_cv={self.noise_cv:.3f}"
        )


def _ape(model: LinearLatencyModel, rows: list[tuple[Batch, float]]) -> list[float]:
    return [abs(model.predict(b) - t) / t for b, t in rows]


def fit_latency_model(
    engine_config: EngineConfig,
    seed: int,
    *,
    n_batches: int = 4000,
    n_engine_steps: int = 1500,
    holdout: float = 0.2,
    curve: bool = False,
) -> tuple[LinearLatencyModel, ProfileReport]:
    """Profile ``engine_config``'s GPU on the engine model and fit the latency model.

    ``curve`` adds the token-curve feature set to the candidates (slower to fit:
    seconds to a minute per profile on one core).
    """
    engine = EngineModel(engine_config, seed=seed)
    max_context = engine.timing.profile.arch.max_model_len
    if engine_config.max_model_len is not None:
        max_context = min(max_context, engine_config.max_model_len)
    sweep = [
        (b, engine.measure(b))
        for b in profiling_batches(seed, engine.limits, n_batches, max_context)
    ]
    run = engine_run_rows(engine_config, seed, n_engine_steps, max_context)
    rng = random.Random(seed)
    rng.shuffle(sweep)
    rng.shuffle(run)
    cut_s = int(len(sweep) * (1 - holdout))
    cut_r = int(len(run) * (1 - holdout))
    train = sweep[:cut_s] + run[:cut_r]
    test_s, test_r = sweep[cut_s:], run[cut_r:]
    meta = LatencyModelMeta(
        model=engine_config.model,
        gpu=engine_config.gpu,
        engine={
            "max_num_batched_tokens": engine_config.max_num_batched_tokens,
            "max_num_seqs": engine_config.max_num_seqs,
            "block_size": engine_config.block_size,
            "tensor_parallel_size": engine.timing.profile.tp,
        },
        source=f"slipstream profile latency (engine model, seed {seed})",
    )
    sets = [*DEFAULT_FEATURE_SETS, FeatureSet.CONTEXT_CHUNK_CURVE] if curve else None
    result = fit(train, seed=seed, meta=meta, feature_sets=sets)
    model = result.model
    ape_s, ape_r = _ape(model, test_s), _ape(model, test_r)
    all_ape = sorted(ape_s + ape_r)
    report = ProfileReport(
        model=engine_config.model,
        gpu=engine_config.gpu,
        noise_cv=engine_config.noise_cv,
        rows_train=len(train),
        rows_test_sweep=len(test_s),
        rows_test_engine=len(test_r),
        feature_set=result.chosen.value,
        kfold_mape=result.kfold[model.feature_set],
        test_mape_sweep=sum(ape_s) / len(ape_s),
        test_mape_engine=sum(ape_r) / len(ape_r),
        test_p95_ape=all_ape[int(0.95 * (len(all_ape) - 1))],
        knee_tokens=model.knee_tokens,
        curve_step_tokens=model.curve_step_tokens,
    )
    logger.info(
        "latency profile %s/%s: %s", engine_config.model, engine_config.gpu, report.summary()
    )
    return model, report
