"""``slipstream bench lengths``: output-length predictor accuracy on real AlpacaEval answers.

Splits the AlpacaEval *prompts* (not rows) into history and held-out sets
(seeded), fills each predictor's history with the history prompts' answers and,
on every held-out answer, scores the predicted distribution by

* ``p_bucket``: the probability mass it gives the true 100-token bucket, and
* ``median_hit``: whether its median falls in the true bucket,

for the global-distribution baseline, the input-length-only history
(SageSched's semantic-unaware ablation) and the semantic history per embedder
(hashing always; MiniLM when the ``semantic`` extra is installed). Two scopes:
``per-model`` (one history per generator, as one vLLM pod serves one model:
the deployment case) and ``pooled`` (one history over all 12 generators).

It also times ``predict`` with a full 10,000-record history (embedding
excluded) and the embedders on their own. Timings are wall-clock and only
printed and recorded, never asserted.

Deliberately left out: scheduling (this measures prediction only).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from slipstream_cli.argtypes import whole
from slipstream_cli.workloads.alpaca_eval import AlpacaEvalRow, load_rows, make_token_counter
from slipstream_scheduler.lengths import (
    GlobalDistributionPredictor,
    HashingEmbedder,
    HistoryParams,
    InputLengthHistoryPredictor,
    InputLengthParams,
    SemanticHistoryParams,
    SemanticHistoryPredictor,
    bucket_probability,
    median_bucket_hit,
)
from slipstream_scheduler.protocols import Embedder, LengthPredictor

logger = logging.getLogger(__name__)

Vector = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class Row:
    """A held-out or history row with its token counts and prompt vector index."""

    prompt: int
    generator: str
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Score:
    """Accuracy of one predictor over one scope."""

    scope: str
    predictor: str
    embedder: str
    queries: int
    p_bucket: float
    median_hit: float
    mean_sample_size: float
    matched_fraction: float | None  # queries with >= min_matches real matches (semantic only)
    p_bucket_by_generator: dict[str, float] | None = None  # per-model: P(true bucket) per history


@dataclass(frozen=True, slots=True)
class Timing:
    """Per-call cost, microseconds."""

    what: str
    embedder: str
    history: int
    calls: int
    median_us: float
    p99_us: float
    cpu_mean_us: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    parser.add_argument("--markdown", type=Path, default=None, help="write a Markdown table here")
    parser.add_argument("--seed", type=int, default=0, help="prompt split seed (default 0)")
    parser.add_argument(
        "--holdout", type=float, default=0.3, help="fraction of prompts held out (default 0.3)"
    )
    parser.add_argument(
        "--tokenizer", choices=["regex", "wordpiece"], default="regex", help="token counter"
    )
    parser.add_argument(
        "--embedders",
        default="auto",
        help="comma list of hashing,minilm; auto = hashing plus minilm if installed",
    )
    parser.add_argument(
        "--threshold", type=float, default=0.8, help="cosine similarity threshold (default 0.8)"
    )
    parser.add_argument(
        "--sweep",
        default="0.5,0.6,0.7,0.8,0.9",
        help="thresholds for the sensitivity table (per-model scope); empty to skip",
    )
    parser.add_argument("--min-matches", type=int, default=8, help="top up below this")
    parser.add_argument(
        "--top-up",
        choices=["prior", "nearest"],
        default="nearest",
        help="top-up rule for the sweep and timings (the main table shows both)",
    )
    parser.add_argument(
        "--timing-calls", type=int, default=300, help="predict calls timed at 10k history"
    )
    parser.add_argument(
        "--families",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also score the Mooncake traces' prefix families, recurring against unique "
        "(default on)",
    )
    parser.add_argument(
        "--families-limit",
        type=whole(1),
        default=None,
        help="first N requests of each Mooncake trace (default all)",
    )


def _embedders(spec: str) -> dict[str, Embedder]:
    names = ["hashing", "minilm"] if spec == "auto" else [s for s in spec.split(",") if s]
    out: dict[str, Embedder] = {}
    for name in names:
        if name == "hashing":
            out[name] = HashingEmbedder()
        elif name == "minilm":
            try:
                from slipstream_scheduler.embedders_semantic import MiniLMEmbedder

                emb = MiniLMEmbedder()
                emb.embed(["warm up"])
                out[name] = emb
            except ImportError as exc:
                if spec != "auto":
                    raise
                logger.warning("minilm skipped: semantic extra not installed (%s)", exc)
        else:
            raise ValueError(f"unknown embedder {name!r}")
    return out


def split_prompts(prompt_ids: Sequence[int], holdout: float, seed: int) -> set[int]:
    """The held-out prompt ids: a seeded random ``holdout`` fraction of the prompts."""
    ids = np.array(sorted(set(prompt_ids)))
    rng = np.random.default_rng(seed)
    k = round(len(ids) * holdout)
    return {int(i) for i in rng.permutation(ids)[:k]}


def _make(kind: str, dim: int, params: SemanticHistoryParams) -> LengthPredictor:
    common = params.model_dump(include=set(HistoryParams.model_fields))
    if kind == "global":
        return GlobalDistributionPredictor(HistoryParams(**common))
    if kind == "input_length":
        return InputLengthHistoryPredictor(InputLengthParams(**common))
    return SemanticHistoryPredictor(dim, params)


def evaluate(
    kind: str,
    history: Sequence[Row],
    heldout: Sequence[Row],
    vectors: Vector | None,
    params: SemanticHistoryParams,
    *,
    scope: str,
    embedder: str,
) -> Score:
    """Score one predictor kind over one scope (per-model: one history per generator)."""
    groups = sorted({r.generator for r in heldout}) if scope == "per-model" else ["*"]
    dim = 0 if vectors is None else vectors.shape[1]
    pb: list[float] = []
    hits: list[bool] = []
    sizes: list[int] = []
    matched = 0
    by_group: dict[str, float] = {}
    for g in groups:
        first = len(pb)
        pred = _make(kind, dim, params)
        for r in history:
            if g in ("*", r.generator):
                vec = None if vectors is None or kind != "semantic" else vectors[r.prompt]
                pred.observe(vec, r.input_tokens, r.output_tokens)
        for r in heldout:
            if g not in ("*", r.generator):
                continue
            vec = None if vectors is None or kind != "semantic" else vectors[r.prompt]
            sample = pred.predict(vec, r.input_tokens)
            pb.append(bucket_probability(sample, r.output_tokens))
            hits.append(median_bucket_hit(sample, r.output_tokens))
            sizes.append(int(sample.shape[0]))
            if isinstance(pred, SemanticHistoryPredictor) and vec is not None:
                matched += int(pred.matches(vec).shape[0] >= params.min_matches)
        if len(pb) > first:
            by_group[g] = float(np.mean(pb[first:]))
    return Score(
        scope=scope,
        predictor=kind if kind != "semantic" else _semantic_label(params),
        embedder=embedder,
        queries=len(pb),
        p_bucket=float(np.mean(pb)),
        median_hit=float(np.mean(hits)),
        mean_sample_size=float(np.mean(sizes)),
        matched_fraction=matched / len(pb) if kind == "semantic" else None,
        p_bucket_by_generator=by_group if scope == "per-model" else None,
    )


def _semantic_label(params: SemanticHistoryParams) -> str:
    scan = "" if params.search_dim is not None else ", full scan"
    return f"semantic ({params.top_up} top-up{scan})"


def _time_calls(fn: Callable[[int], object], calls: int) -> tuple[float, float, float]:
    """(median wall µs, p99 wall µs, mean CPU µs): CPU time excludes waits on a busy host."""
    samples = np.empty(calls)
    c0 = time.process_time()
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        samples[i] = time.perf_counter() - t0
    cpu = (time.process_time() - c0) / calls
    return float(np.median(samples) * 1e6), float(np.percentile(samples, 99) * 1e6), cpu * 1e6


def time_predict_10k(
    rows: Sequence[Row], vectors: Vector, params: SemanticHistoryParams, calls: int, name: str
) -> Timing:
    """Mean/p99 µs of ``predict`` with a full 10,000-record history (vectors precomputed)."""
    pred = SemanticHistoryPredictor(vectors.shape[1], params.model_copy(update={"window": 10_000}))
    for i in range(10_000):
        r = rows[i % len(rows)]
        pred.observe(vectors[r.prompt], r.input_tokens, r.output_tokens)
    med, p99, cpu = _time_calls(
        lambda i: pred.predict(vectors[rows[i % len(rows)].prompt], 100), calls
    )
    what = "predict " + _semantic_label(params).removeprefix("semantic ")
    return Timing(what, name, len(pred), calls, med, p99, cpu)


def time_embed(embedder: Embedder, texts: Sequence[str], name: str) -> Timing:
    n = min(len(texts), 200)
    med, p99, cpu = _time_calls(lambda i: embedder.embed([texts[i]]), n)
    return Timing("embed (1 prompt)", name, 0, n, med, p99, cpu)


def run_bench(args: argparse.Namespace) -> dict[str, object]:
    raw: list[AlpacaEvalRow] = load_rows()
    count = make_token_counter(args.tokenizer)
    prompt_ids = sorted({r.index for r in raw})
    pos = {p: i for i, p in enumerate(prompt_ids)}
    texts = [""] * len(prompt_ids)
    for r in raw:
        texts[pos[r.index]] = r.instruction
    input_tokens = [count(t) for t in texts]
    rows = [
        Row(pos[r.index], r.generator, input_tokens[pos[r.index]], count(r.output)) for r in raw
    ]
    held = split_prompts(prompt_ids, args.holdout, args.seed)
    heldout = [r for r in rows if prompt_ids[r.prompt] in held]
    history = [r for r in rows if prompt_ids[r.prompt] not in held]
    params = SemanticHistoryParams(
        similarity_threshold=args.threshold, min_matches=args.min_matches, top_up=args.top_up
    )
    scores: list[Score] = []
    sweep: list[Score] = []
    timings: list[Timing] = []
    embedders = _embedders(args.embedders)
    vectors = {name: emb.embed(texts) for name, emb in embedders.items()}
    for scope in ("per-model", "pooled"):
        for kind in ("global", "input_length"):
            scores.append(evaluate(kind, history, heldout, None, params, scope=scope, embedder="-"))
        for name in embedders:
            vecs = vectors[name]
            # The last variant is the full-vector scan: the same run's check of the compact one.
            for update in (
                {"top_up": "prior"},
                {"top_up": "nearest"},
                {"top_up": "nearest", "search_dim": None},
            ):
                p = params.model_copy(update=update)
                scores.append(
                    evaluate("semantic", history, heldout, vecs, p, scope=scope, embedder=name)
                )
    thresholds = [float(t) for t in args.sweep.split(",") if t.strip()]
    for name, emb in embedders.items():
        vecs = vectors[name]
        for t in thresholds:
            p = params.model_copy(update={"similarity_threshold": t})
            sweep.append(
                evaluate("semantic", history, heldout, vecs, p, scope="per-model", embedder=name)
            )
        timings.append(time_embed(emb, texts, name))
        for update in (
            {"top_up": "prior"},
            {"top_up": "nearest"},
            {"top_up": "nearest", "search_dim": None},
        ):
            p = params.model_copy(update=update)
            timings.append(time_predict_10k(history, vecs, p, args.timing_calls, name))
    families: list[dict[str, object]] = []
    if args.families:
        from slipstream_cli.benches.length_families import run_families
        from slipstream_cli.workloads import data_root

        families = run_families(data_root(), args.families_limit)
    return {
        "data": "alpaca_eval_model_outputs.dev.jsonl.gz (12 generators, dev prompts)",
        "tokenizer": args.tokenizer,
        "seed": args.seed,
        "holdout_fraction": args.holdout,
        "prompts": {"history": len(prompt_ids) - len(held), "heldout": len(held)},
        "rows": {"history": len(history), "heldout": len(heldout)},
        "params": params.model_dump(),
        "scores": [asdict(s) for s in scores],
        "threshold_sweep": [asdict(s) | {"threshold": t} for s, t in _with_thr(sweep, thresholds)],
        "timings": [asdict(t) for t in timings],
        "families": families,
    }


def _with_thr(sweep: list[Score], thresholds: list[float]) -> list[tuple[Score, float]]:
    n = len(thresholds)
    return [(s, thresholds[i % n]) for i, s in enumerate(sweep)] if n else []


def render_markdown(res: dict[str, object]) -> str:
    lines = [
        "| scope | predictor | embedder | queries | P(true bucket) | median-bucket hit "
        "| mean sample size | ≥ min_matches real matches |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in res["scores"]:  # type: ignore[attr-defined]
        mf = "–" if s["matched_fraction"] is None else f"{s['matched_fraction']:.1%}"
        lines.append(
            f"| {s['scope']} | {s['predictor']} | {s['embedder']} | {s['queries']} "
            f"| {s['p_bucket']:.3f} | {s['median_hit']:.3f} | {s['mean_sample_size']:.1f} | {mf} |"
        )
    lines += [
        "",
        "| embedder | threshold | P(true bucket) | median-bucket hit | matched |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in res["threshold_sweep"]:  # type: ignore[attr-defined]
        lines.append(
            f"| {s['embedder']} | {s['threshold']:.2f} | {s['p_bucket']:.3f} "
            f"| {s['median_hit']:.3f} | {s['matched_fraction']:.1%} |"
        )
    lines += [
        "",
        "| what | embedder | history | calls | median wall µs | p99 wall µs | mean CPU µs |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for t in res["timings"]:  # type: ignore[attr-defined]
        lines.append(
            f"| {t['what']} | {t['embedder']} | {t['history']} | {t['calls']} "
            f"| {t['median_us']:.1f} | {t['p99_us']:.1f} | {t['cpu_mean_us']:.1f} |"
        )
    families = res.get("families") or []
    if families:
        lines += [
            "",
            "| trace | regime | predictor | queries | P(true bucket) | median-bucket hit "
            "| mean TTLT / global | oracle / global |",
            "|---|---|---|---:|---:|---:|---:|---:|",
        ]
        for f in families:  # type: ignore[attr-defined]
            lines.append(
                f"| {f['trace']} | {f['regime']} | {f['predictor']} | {f['queries']} "
                f"| {f['p_bucket']:.3f} | {f['median_hit']:.3f} "
                f"| {f['mean_ttlt_ratio_vs_global']:.3f} | {f['oracle_ttlt_ratio_vs_global']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    res = run_bench(args)
    table = render_markdown(res)
    print(table)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table)
    return 0
