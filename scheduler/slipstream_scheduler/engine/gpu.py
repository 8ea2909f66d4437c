"""GPU timing model: how long one vLLM iteration takes on a real GPU.

This is the engine model's ground truth for step durations. It is built from
measurements, not fitted to the latency model it is later used to profile:

* **Linear operators** (QKV/O projections, gated MLP, norms, RoPE, residual
  adds, embedding): Vidur's per-operator GPU timings (MIT), summed per layer
  and sampled over the number of tokens in the batch. Interpolated piecewise
  linearly; past the last sample, proportional to it (throughput-bound).
* **LM head**: the logits GEMM over the sequences that sample a token. Vidur
  has no LM-head table, so it is the measured gated up-projection curve scaled
  by the weight ratio ``vocab / (2 * d_ffn)`` (same GEMM shape family).
* **Attention** (Vidur's ``attention.csv`` is not available): prefill as
  compute-bound FLOPs, ``4 * n_heads * head_dim`` per (query, key) pair per
  layer, with ``sum_i c_i * (ctx_i + (c_i + 1) / 2)`` pairs for a chunk of
  ``c_i`` tokens after ``ctx_i`` cached ones (causal), at
  ``prefill_attn_efficiency`` of peak FLOPs; decode as memory-bound KV reads,
  ``2 * n_kv_heads * head_dim * dtype_bytes`` per cached token per layer, at
  ``decode_attn_efficiency`` of HBM bandwidth.
* **Tensor parallelism**: two all-reduces per layer of ``tokens * d_model``
  fp16 elements, timed from Vidur's measured NCCL curves; attention work is
  divided by TP (heads are split).
* **Host overhead**: a fixed per-step cost plus a per-sequence cost
  (scheduling, input preparation, sampling, detokenisation), calibrated on
  ML.ENERGY's end-to-end vLLM measurements.

Profiles are JSON documents shipped as package data in
``slipstream_scheduler/engine/profiles/`` and written by
``slipstream profile gpu`` (which reads ``../shared/data``). Loading them is the
one place the core reads anything: :func:`load_profile` reads the package's own
immutable data through :mod:`importlib.resources`, never a user path.

Deliberately left out: measurement noise (the engine model draws it from its own
seeded generator), pipeline parallelism, speculative decoding, CUDA-graph
padding, quantised weights, and power/clock throttling.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from slipstream_scheduler.engine.errors import ProfileFormatError, ProfileNotFoundError
from slipstream_scheduler.types import BatchItem, Phase

PROFILE_KIND = "slipstream.gpu-profile"
PROFILE_SCHEMA_VERSION = 1
_PROFILE_PACKAGE = "slipstream_scheduler.engine.profiles"


@dataclass(frozen=True, slots=True)
class Curve:
    """A sampled, piecewise-linear function ``y(x)``; ``x`` strictly increasing."""

    x: tuple[float, ...]
    y: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y) or len(self.x) < 2:
            raise ProfileFormatError("a curve needs >= 2 points and equal-length x and y")
        if any(b <= a for a, b in zip(self.x, self.x[1:], strict=False)):
            raise ProfileFormatError("curve x values must be strictly increasing")

    def __call__(self, v: float) -> float:
        xs, ys = self.x, self.y
        if v <= xs[0]:
            return ys[0] if v > 0 else 0.0
        i = bisect_right(xs, v)
        if i >= len(xs):
            # Past the table: proportional to the last point (throughput-bound regime).
            return ys[-1] * v / xs[-1]
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (v - x0) / (x1 - x0)

    def to_dict(self) -> dict[str, list[float]]:
        return {"x": list(self.x), "y": list(self.y)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], name: str) -> Curve:
        try:
            return cls(tuple(float(v) for v in doc["x"]), tuple(float(v) for v in doc["y"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileFormatError(f"curve {name!r} is malformed: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ModelArch:
    """The transformer shape that attention, KV size and collectives depend on."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_ffn: int
    vocab: int
    max_model_len: int
    dtype_bytes: int = 2

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token over all layers (whole model, before TP)."""
        return 2 * self.n_kv_heads * self.head_dim * self.dtype_bytes * self.n_layers

    @property
    def weight_bytes(self) -> int:
        """Approximate parameter bytes: attention, gated MLP, embeddings and LM head."""
        d, kv = self.d_model, self.n_kv_heads * self.head_dim
        per_layer = d * d * 2 + 2 * d * kv + 3 * d * self.d_ffn
        return (self.n_layers * per_layer + 2 * self.vocab * d) * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class Hardware:
    """Datasheet numbers of one GPU (dense fp16/bf16)."""

    name: str
    hbm_bytes_per_s: float
    peak_flops: float
    memory_bytes: float


@dataclass(frozen=True, slots=True)
class Calibration:
    """The timing model's free constants; fitted by ``slipstream profile gpu``."""

    step_overhead_s: float
    per_seq_overhead_s: float
    prefill_attn_efficiency: float
    decode_attn_efficiency: float


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """Everything the timing model needs for one (model, GPU, TP)."""

    model: str
    gpu: str
    tp: int
    arch: ModelArch
    hardware: Hardware
    forward_linear_ms: Curve  # all layers' linear ops + embedding, vs tokens in the step
    lm_head_ms: Curve  # vs sequences sampling a token
    all_reduce_ms: Curve | None  # one all-reduce vs bytes; None when tp == 1
    calibration: Calibration
    derivation: str = ""
    attribution: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        a, h, c = self.arch, self.hardware, self.calibration
        return {
            "kind": PROFILE_KIND,
            "schema_version": PROFILE_SCHEMA_VERSION,
            "model": self.model,
            "gpu": self.gpu,
            "tp": self.tp,
            "arch": {
                "n_layers": a.n_layers,
                "n_heads": a.n_heads,
                "n_kv_heads": a.n_kv_heads,
                "d_model": a.d_model,
                "d_ffn": a.d_ffn,
                "vocab": a.vocab,
                "max_model_len": a.max_model_len,
                "dtype_bytes": a.dtype_bytes,
            },
            "hardware": {
                "name": h.name,
                "hbm_bytes_per_s": h.hbm_bytes_per_s,
                "peak_flops": h.peak_flops,
                "memory_bytes": h.memory_bytes,
            },
            "calibration": {
                "step_overhead_s": c.step_overhead_s,
                "per_seq_overhead_s": c.per_seq_overhead_s,
                "prefill_attn_efficiency": c.prefill_attn_efficiency,
                "decode_attn_efficiency": c.decode_attn_efficiency,
            },
            "curves": {
                "forward_linear_ms": self.forward_linear_ms.to_dict(),
                "lm_head_ms": self.lm_head_ms.to_dict(),
                **(
                    {"all_reduce_ms": self.all_reduce_ms.to_dict()}
                    if self.all_reduce_ms is not None
                    else {}
                ),
            },
            "derivation": self.derivation,
            "attribution": list(self.attribution),
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> GpuProfile:
        if doc.get("kind") != PROFILE_KIND:
            raise ProfileFormatError(f"not a GPU profile: kind is {doc.get('kind')!r}")
        if doc.get("schema_version") != PROFILE_SCHEMA_VERSION:
            raise ProfileFormatError(
                f"GPU profile schema {doc.get('schema_version')!r} is not "
                f"{PROFILE_SCHEMA_VERSION}: regenerate it with `slipstream profile gpu`"
            )
        try:
            curves = doc["curves"]
            ar = curves.get("all_reduce_ms")
            return cls(
                model=str(doc["model"]),
                gpu=str(doc["gpu"]),
                tp=int(doc["tp"]),
                arch=ModelArch(**{k: int(v) for k, v in doc["arch"].items()}),
                hardware=Hardware(
                    name=str(doc["hardware"]["name"]),
                    hbm_bytes_per_s=float(doc["hardware"]["hbm_bytes_per_s"]),
                    peak_flops=float(doc["hardware"]["peak_flops"]),
                    memory_bytes=float(doc["hardware"]["memory_bytes"]),
                ),
                forward_linear_ms=Curve.from_dict(curves["forward_linear_ms"], "forward"),
                lm_head_ms=Curve.from_dict(curves["lm_head_ms"], "lm_head"),
                all_reduce_ms=None if ar is None else Curve.from_dict(ar, "all_reduce"),
                calibration=Calibration(**{k: float(v) for k, v in doc["calibration"].items()}),
                derivation=str(doc.get("derivation", "")),
                attribution=tuple(str(s) for s in doc.get("attribution", ())),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProfileFormatError(f"GPU profile is malformed: {exc}") from exc


def profile_name(model: str, gpu: str) -> str:
    """File name of a shipped profile, e.g. ``llama-2-7b_a100.json``."""
    return f"{model}_{gpu}.json"


def available_profiles() -> tuple[tuple[str, str], ...]:
    """The (model, gpu) pairs shipped with the package."""
    out = []
    for entry in resources.files(_PROFILE_PACKAGE).iterdir():
        name = entry.name
        if name.endswith(".json") and not name.startswith("latency_"):
            model, _, gpu = name[: -len(".json")].rpartition("_")
            out.append((model, gpu))
    return tuple(sorted(out))


def read_packaged_json(name: str) -> dict[str, Any]:
    """Read one JSON file shipped in ``slipstream_scheduler/engine/profiles``.

    The only file access in the core: the package's own immutable data, read
    through :mod:`importlib.resources` (works from a wheel or a zip too).
    """
    try:
        text = resources.files(_PROFILE_PACKAGE).joinpath(name).read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ProfileNotFoundError(name) from exc
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ProfileFormatError(f"{name}: top level must be an object")
    return doc


def load_profile(model: str, gpu: str) -> GpuProfile:
    """The shipped profile for ``model`` on ``gpu`` (e.g. ``"llama-2-7b"``, ``"h100"``)."""
    return GpuProfile.from_dict(read_packaged_json(profile_name(model, gpu)))


class GpuTimingModel:
    """Seconds per iteration from the batch's aggregate shape. Deterministic.

    :meth:`step_time` is the hot path (the engine model keeps the aggregates
    incrementally). :meth:`predict` takes a plain batch, so the model also
    satisfies the ``LatencyModel`` protocol.
    """

    __slots__ = (
        "_ar",
        "_ar_bytes_per_token",
        "_ar_per_step",
        "_c0",
        "_c1",
        "_dec_s_per_token",
        "_fwd",
        "_lm",
        "_pre_s_per_pair",
        "profile",
    )

    def __init__(self, profile: GpuProfile) -> None:
        self.profile = profile
        a, h, c, tp = profile.arch, profile.hardware, profile.calibration, profile.tp
        if c.prefill_attn_efficiency <= 0 or c.decode_attn_efficiency <= 0:
            raise ProfileFormatError("attention efficiencies must be > 0")
        self._fwd = profile.forward_linear_ms
        self._lm = profile.lm_head_ms
        self._ar = profile.all_reduce_ms if tp > 1 else None
        self._ar_per_step = 2 * a.n_layers
        self._ar_bytes_per_token = a.d_model * a.dtype_bytes
        flops_per_pair = 4.0 * a.n_heads * a.head_dim * a.n_layers / tp
        self._pre_s_per_pair = flops_per_pair / (h.peak_flops * c.prefill_attn_efficiency)
        self._dec_s_per_token = (a.kv_bytes_per_token / tp) / (
            h.hbm_bytes_per_s * c.decode_attn_efficiency
        )
        self._c0 = c.step_overhead_s
        self._c1 = c.per_seq_overhead_s

    def step_time(
        self, num_tokens: int, num_seqs: int, prefill_pairs: float, decode_kv_tokens: int
    ) -> float:
        """Seconds for a step of ``num_tokens`` tokens over ``num_seqs`` sequences.

        ``prefill_pairs`` is ``sum c*(ctx + (c+1)/2)`` over prefill chunks and
        ``decode_kv_tokens`` is ``sum (ctx + 1)`` over decodes. An empty step is 0.
        """
        if num_seqs <= 0:
            return 0.0
        ms = self._fwd(num_tokens) + self._lm(num_seqs)
        if self._ar is not None:
            ms += self._ar_per_step * self._ar(num_tokens * self._ar_bytes_per_token)
        return (
            ms * 1e-3
            + prefill_pairs * self._pre_s_per_pair
            + decode_kv_tokens * self._dec_s_per_token
            + self._c0
            + self._c1 * num_seqs
        )

    def step_parts(
        self, num_tokens: int, num_seqs: int, prefill_pairs: float, decode_kv_tokens: int
    ) -> tuple[float, float]:
        """:meth:`step_time` in its two parts, ``(device, host)`` seconds: the GPU's work
        (linear layers, LM head, all-reduces, attention) and the host overhead (the
        per-step and per-sequence terms), which vLLM's async scheduling overlaps with the
        device's work of the step before. An empty step is ``(0, 0)``."""
        if num_seqs <= 0:
            return 0.0, 0.0
        ms = self._fwd(num_tokens) + self._lm(num_seqs)
        if self._ar is not None:
            ms += self._ar_per_step * self._ar(num_tokens * self._ar_bytes_per_token)
        device = (
            ms * 1e-3
            + prefill_pairs * self._pre_s_per_pair
            + decode_kv_tokens * self._dec_s_per_token
        )
        return device, self._c0 + self._c1 * num_seqs

    def predict(self, batch: Sequence[BatchItem]) -> float:
        """Seconds for one iteration over ``batch`` (the ``LatencyModel`` protocol)."""
        tokens = kv = 0
        pairs = 0.0
        for item in batch:
            tokens += item.tokens
            if item.phase is Phase.DECODE:
                kv += item.context + item.tokens
            else:
                c = item.tokens
                pairs += c * (item.context + (c + 1) / 2.0)
        return self.step_time(tokens, len(batch), pairs, kv)

    def kv_capacity_blocks(self, block_size: int, gpu_memory_utilization: float) -> int:
        """KV blocks that fit beside the weights, as vLLM sizes its cache.

        ``memory * utilization - weights/TP - activation reserve``, where the
        reserve (peak activation of a profiling run) is taken as 5 % of memory.
        """
        p = self.profile
        free = (
            p.hardware.memory_bytes * gpu_memory_utilization
            - p.arch.weight_bytes / p.tp
            - 0.05 * p.hardware.memory_bytes
        )
        per_block = p.arch.kv_bytes_per_token / p.tp * block_size
        return max(0, math.floor(free / per_block))
