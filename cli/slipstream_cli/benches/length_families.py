"""Length prediction where prompts recur in families: the Mooncake traces' prefix blocks.

Part of ``slipstream bench lengths``. The Mooncake traces carry no text, only
the hashes of each prompt's 512-token prefix blocks (``hash_ids``) and the
real output length. A request's vector is a signed feature hashing of its
chained prefixes (block 0, blocks 0-1, ...), L2-normalised: two prompts that
share their first ``L`` of ``a`` and ``b`` blocks have cosine ``L/sqrt(a·b)``
(up to hash collisions), so the next turn of a chat is close to the previous
turns (cosine ``sqrt(a/b)``) and two chats that share only the system prompt
are far apart.

The stream is replayed in arrival order. Each request is predicted from the
requests that finished before it arrived (finish = arrival + ``decode_s_per_token``
× output length; the trace has no finish times), then joins the history when it
finishes: the predictor learns online, as the sidecar's does.

Regimes, per request at its arrival:

* ``recurring``: it shares at least ``recurring_blocks`` leading blocks beyond
  those every request shares (the conversation trace's block 0 is one system
  prompt for all 7,851 requests) with a request seen before;
* ``unique``: it does not.

Ordering gain: a non-preemptive single server that serves each regime's
requests alone, in the order of their arrival in the trace but with Poisson
arrivals at ``load`` (service time proportional to the output length), ordered
by the Gittins rank of the predicted output-length sample (``C = O``). The
global-distribution predictor gives every request the same sample, so its
order is FCFS; oracle SJF on the true lengths shows what any order can win.

Deliberately left out: prefill cost, batching and preemption (``bench ordering``
measures those inside the engine model).
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from slipstream_scheduler.gittins import gittins_rank
from slipstream_scheduler.lengths import (
    GlobalDistributionPredictor,
    HistoryParams,
    InputLengthHistoryPredictor,
    SemanticHistoryParams,
    SemanticHistoryPredictor,
    bucket_probability,
    median_bucket_hit,
)
from slipstream_scheduler.protocols import LengthPredictor

Vector = npt.NDArray[np.float32]
FloatArray = npt.NDArray[np.float64]

TRACES = {
    "mooncake-conversation": "mooncake/conversation_trace.dev.jsonl",
    "mooncake-synthetic": "mooncake/synthetic_trace.jsonl",
}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FamilyScore:
    """One predictor over one regime of one trace."""

    trace: str
    regime: str
    predictor: str
    queries: int
    p_bucket: float
    median_hit: float
    mean_ttlt_ratio_vs_global: float
    oracle_ttlt_ratio_vs_global: float


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(
                TraceRequest(
                    float(r["timestamp"]) / 1000.0,
                    int(r["input_length"]),
                    max(1, int(r["output_length"])),
                    tuple(int(h) for h in r["hash_ids"]),
                )
            )
            if limit is not None and len(out) >= limit:
                break
    return out


def prefix_vector(blocks: Sequence[int], dim: int = 384) -> Vector:
    """Signed hashing of the chained prefixes of ``blocks``, L2-normalised."""
    v = np.zeros(dim, dtype=np.float64)
    h = hashlib.blake2b(digest_size=8)
    for b in blocks:
        h.update(int(b).to_bytes(8, "little", signed=False))
        x = int.from_bytes(h.copy().digest(), "little")
        v[(x >> 1) % dim] += 1.0 if x & 1 else -1.0
    norm = float(np.linalg.norm(v))
    return (v / norm if norm > 0 else v).astype(np.float32)


def common_blocks(reqs: Sequence[TraceRequest]) -> int:
    """Leading blocks every request of the trace shares (a global system prompt)."""
    if not reqs:
        return 0
    first = reqs[0].blocks
    n = len(first)
    for r in reqs[1:]:
        k = 0
        while k < min(n, len(r.blocks)) and r.blocks[k] == first[k]:
            k += 1
        n = k
        if n == 0:
            break
    return n


def regimes(reqs: Sequence[TraceRequest], recurring_blocks: int = 1) -> list[str]:
    """``recurring`` or ``unique`` per request (prefix seen before beyond the common blocks)."""
    base = common_blocks(reqs)
    seen: set[tuple[int, ...]] = set()
    out: list[str] = []
    depth = base + recurring_blocks
    for r in reqs:
        key = r.blocks[:depth]
        out.append("recurring" if len(key) == depth and key in seen else "unique")
        for d in range(depth, len(r.blocks) + 1):
            seen.add(r.blocks[:d])
    return out


def replay(
    make: Callable[[], LengthPredictor],
    reqs: Sequence[TraceRequest],
    vectors: Sequence[Vector],
    decode_s_per_token: float,
) -> list[FloatArray]:
    """Each request's predicted sample, from the requests finished before it arrived."""
    pred = make()
    pending: list[tuple[float, int]] = []
    samples: list[FloatArray] = []
    for i, r in enumerate(reqs):
        while pending and pending[0][0] <= r.arrival_s:
            _, j = heapq.heappop(pending)
            q = reqs[j]
            pred.observe(vectors[j], q.input_tokens, q.output_tokens)
        samples.append(np.asarray(pred.predict(vectors[i], r.input_tokens), dtype=np.float64))
        heapq.heappush(pending, (r.arrival_s + decode_s_per_token * r.output_tokens, i))
    return samples


def queue_mean_ttlt(
    lengths: Sequence[int], ranks: Sequence[float], load: float, seed: int
) -> float:
    """Mean time in system of a non-preemptive single server (service = length), Poisson arrivals.

    The next job is the waiting one of lowest rank, ties to the earliest arrival.
    """
    n = len(lengths)
    if n == 0:
        return 0.0
    rng = np.random.default_rng(seed)
    mean_service = float(np.mean(lengths))
    arrivals = np.cumsum(rng.exponential(mean_service / load, n))
    waiting: list[tuple[float, int]] = []
    t = 0.0
    i = 0
    total = 0.0
    done = 0
    while done < n:
        if not waiting:
            t = max(t, float(arrivals[i]))
        while i < n and arrivals[i] <= t:
            heapq.heappush(waiting, (ranks[i], i))
            i += 1
        _, j = heapq.heappop(waiting)
        t += lengths[j]
        total += t - float(arrivals[j])
        done += 1
    return total / n


PREDICTORS: dict[str, Callable[[int], LengthPredictor]] = {
    "global": lambda dim: GlobalDistributionPredictor(HistoryParams()),
    "input_length": lambda dim: InputLengthHistoryPredictor(),
    "semantic (prior top-up)": lambda dim: SemanticHistoryPredictor(
        dim, SemanticHistoryParams(top_up="prior")
    ),
    "semantic (nearest top-up)": SemanticHistoryPredictor,
}


def evaluate_trace(
    name: str,
    reqs: Sequence[TraceRequest],
    *,
    predictors: dict[str, Callable[[int], LengthPredictor]] | None = None,
    decode_s_per_token: float = 0.03,
    load: float = 0.9,
    seeds: int = 4,
    dim: int = 384,
) -> list[FamilyScore]:
    predictors = predictors if predictors is not None else PREDICTORS
    vectors = [prefix_vector(r.blocks, dim) for r in reqs]
    regime = regimes(reqs)
    all_samples = {
        k: replay(lambda m=m: m(dim), reqs, vectors, decode_s_per_token)  # type: ignore[misc]
        for k, m in predictors.items()
    }
    out: list[FamilyScore] = []
    for reg in ("recurring", "unique", "all"):
        idx = [i for i, g in enumerate(regime) if reg in ("all", g)]
        if not idx:
            continue
        lengths = [reqs[i].output_tokens for i in idx]
        ttlt: dict[str, float] = {}
        for k, samples in all_samples.items():
            ranks = [gittins_rank(samples[i]) or 0.0 for i in idx]
            ttlt[k] = float(
                np.mean([queue_mean_ttlt(lengths, ranks, load, s) for s in range(seeds)])
            )
        oracle = float(
            np.mean(
                [
                    queue_mean_ttlt(lengths, [float(x) for x in lengths], load, s)
                    for s in range(seeds)
                ]
            )
        )
        for k, samples in all_samples.items():
            out.append(
                FamilyScore(
                    trace=name,
                    regime=reg,
                    predictor=k,
                    queries=len(idx),
                    p_bucket=float(
                        np.mean(
                            [bucket_probability(samples[i], reqs[i].output_tokens) for i in idx]
                        )
                    ),
                    median_hit=float(
                        np.mean([median_bucket_hit(samples[i], reqs[i].output_tokens) for i in idx])
                    ),
                    mean_ttlt_ratio_vs_global=ttlt[k] / ttlt["global"],
                    oracle_ttlt_ratio_vs_global=oracle / ttlt["global"],
                )
            )
    return out


def run_families(root: Path, limit: int | None = None) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name, rel in TRACES.items():
        path = root / rel
        if not path.exists():
            continue
        rows += [asdict(s) for s in evaluate_trace(name, load_trace(path, limit))]
    return rows
