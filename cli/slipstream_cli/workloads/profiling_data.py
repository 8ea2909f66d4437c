"""Readers for the GPU profiling measurements in ``profiling/`` of the shared data.

* Vidur per-operator timings (``vidur/compute/<gpu>/meta-llama/<model>/mlp.csv``,
  MIT): median milliseconds per layer per op, averaged over duplicate rows.
* Vidur NCCL all-reduce timings (``vidur/network/<gpu>_dgx/all_reduce.csv``).
* ML.ENERGY leaderboard v2 (Apache-2.0): steady-state vLLM TPOT vs batch size.
* Splitwise ``perf_model.csv`` (MIT): prompt and token latencies of Llama-2-70B.

Deliberately left out: any interpretation (the profile builder in
``slipstream_cli.commands.profile`` derives the model from these rows), and
power/energy columns.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from slipstream_cli.workloads import WorkloadError, data_path

VIDUR_OPS = (
    "emb",
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
"""Vidur's MLP-file operators, in the order a layer runs them (``add`` runs twice)."""

MLENERGY = "profiling/mlenergy_leaderboard_v2_llm_text_generation.jsonl"
SPLITWISE = "profiling/splitwise/perf_model.csv"


@dataclass(frozen=True, slots=True)
class VidurShape:
    """The model columns of a Vidur ``mlp.csv``."""

    n_head: int
    n_kv_head: int
    n_embd: int
    n_expanded_embd: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class VidurOps:
    """Per-op curves of one (GPU, model, TP): ``ops[op]`` is ``((num_tokens, ms), ...)``."""

    shape: VidurShape
    tp: int
    ops: dict[str, tuple[tuple[int, float], ...]]


@dataclass(frozen=True, slots=True)
class MlEnergyRow:
    task: str  # chat | code
    model: str
    gpu: str  # a100 | h100
    tp: int
    tpot_s: float
    avg_batch: float
    max_batch: int
    avg_output_tokens: float


@dataclass(frozen=True, slots=True)
class SplitwiseRow:
    """Mean over the repeats of one configuration."""

    model: str
    hardware: str
    tp: int
    prompt_size: int
    batch_size: int
    token_size: int
    prompt_ms: float
    token_ms: float
    repeats: int


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


@lru_cache(maxsize=32)
def read_vidur_ops(gpu: str, model_dir: str) -> dict[int, VidurOps]:
    """Vidur per-op medians for every TP degree of one GPU and model."""
    path = data_path(f"profiling/vidur/compute/{gpu}/meta-llama/{model_dir}/mlp.csv")
    rows = _read_csv(path)
    if not rows:
        raise WorkloadError("empty file", path)
    first = rows[0]
    try:
        shape = VidurShape(
            int(first["n_head"]),
            int(first["n_kv_head"]),
            int(first["n_embd"]),
            int(first["n_expanded_embd"]),
            int(first["vocab_size"]),
        )
        acc: dict[int, dict[str, dict[int, list[float]]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(list))
        )
        for row in rows:
            tp = int(row["num_tensor_parallel_workers"])
            n = int(row["num_tokens"])
            for op in VIDUR_OPS:
                cell = row[f"time_stats.{op}.median"]
                if cell:
                    acc[tp][op][n].append(float(cell))
    except (KeyError, ValueError) as exc:
        raise WorkloadError(f"unexpected Vidur columns: {exc}", path) from exc
    out: dict[int, VidurOps] = {}
    for tp, ops in acc.items():
        out[tp] = VidurOps(
            shape,
            tp,
            {
                op: tuple((n, sum(v) / len(v)) for n, v in sorted(points.items()))
                for op, points in ops.items()
            },
        )
    return out


@lru_cache(maxsize=32)
def read_all_reduce(gpu: str) -> dict[int, tuple[tuple[int, float], ...]]:
    """Intra-node all-reduce: ``tp -> ((bytes, ms), ...)``, medians averaged over ranks."""
    path = data_path(f"profiling/vidur/network/{gpu}_dgx/all_reduce.csv")
    acc: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    try:
        for row in _read_csv(path):
            workers = int(row["num_workers"])
            if int(row["devices_per_node"]) != workers:
                continue  # multi-node rows: not how a TP group is placed
            acc[workers][int(row["size"])].append(float(row["time_stats.all_reduce.median"]))
    except (KeyError, ValueError) as exc:
        raise WorkloadError(f"unexpected all_reduce columns: {exc}", path) from exc
    return {
        tp: tuple((size, sum(v) / len(v)) for size, v in sorted(points.items()))
        for tp, points in acc.items()
    }


@lru_cache(maxsize=32)
def read_mlenergy() -> tuple[MlEnergyRow, ...]:
    """All ML.ENERGY measurement rows (the per-task ``models.json`` lines are skipped)."""
    path = data_path(MLENERGY)
    out: list[MlEnergyRow] = []
    with path.open() as fh:
        for line in fh:
            doc = json.loads(line)
            if "Model" not in doc:
                continue
            task = str(doc["source_path"]).split("/")[2]
            gpu_name = str(doc["GPU"])
            gpu = "h100" if "H100" in gpu_name else "a100" if "A100" in gpu_name else gpu_name
            out.append(
                MlEnergyRow(
                    task=task,
                    model=str(doc["Model"]),
                    gpu=gpu,
                    tp=int(doc["TP"]),
                    tpot_s=float(doc["Avg TPOT (s)"]),
                    avg_batch=float(doc["Avg BS (reqs)"]),
                    max_batch=int(doc["Max BS (reqs)"]),
                    avg_output_tokens=float(doc["Avg Output Tokens"]),
                )
            )
    return tuple(out)


@lru_cache(maxsize=32)
def read_splitwise() -> tuple[SplitwiseRow, ...]:
    """Splitwise measurements, averaged over the repeats of each configuration."""
    path = data_path(SPLITWISE)
    acc: dict[tuple[str, str, int, int, int, int], list[tuple[float, float]]] = defaultdict(list)
    try:
        for row in _read_csv(path):
            key = (
                row["model"],
                row["hardware"],
                int(row["tensor_parallel"]),
                int(row["prompt_size"]),
                int(row["batch_size"]),
                int(row["token_size"]),
            )
            acc[key].append((float(row["prompt_time"]), float(row["token_time"])))
    except (KeyError, ValueError) as exc:
        raise WorkloadError(f"unexpected Splitwise columns: {exc}", path) from exc
    return tuple(
        SplitwiseRow(
            *key,
            prompt_ms=sum(p for p, _ in v) / len(v),
            token_ms=sum(t for _, t in v) / len(v),
            repeats=len(v),
        )
        for key, v in sorted(acc.items())
    )
