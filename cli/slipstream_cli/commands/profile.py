"""``slipstream profile``: build GPU profiles from real measurements, fit latency models.

Subcommands:

* ``gpu``: read Vidur / ML.ENERGY / Splitwise data from ``$SLIPSTREAM_DATA``,
  derive the GPU timing profiles (see ``docs/concepts/engine-model.md``),
  calibrate their free constants, and write ``<model>_<gpu>.json`` into the
  core's ``engine/profiles`` package folder (or ``--out``). ``--check`` prints
  the validation table against the end-to-end measurements instead.
* ``latency``: profile the engine model like HyGen profiles a GPU and fit the
  core's linear latency model (the token-curve set among the candidates unless
  ``--no-curve``); write its JSON (default: the shipped
  ``latency_<model>_<gpu>.json``).
* ``engine``: profile a live engine through its OpenAI API and fit the same model
  (:mod:`slipstream_cli.commands.profile_engine`).

Deliberately left out: the SLO-aware budget search (the simulator's
``profile budget``, another module), and any download.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from slipstream_cli.commands import profile_engine
from slipstream_cli.workloads import data_root
from slipstream_cli.workloads.profiling_data import (
    MlEnergyRow,
    SplitwiseRow,
    VidurOps,
    read_all_reduce,
    read_mlenergy,
    read_splitwise,
    read_vidur_ops,
)
from slipstream_scheduler.engine.gpu import (
    Calibration,
    Curve,
    GpuProfile,
    GpuTimingModel,
    Hardware,
    ModelArch,
    profile_name,
)

logger = logging.getLogger(__name__)

PROFILES_DIR = (
    Path(__file__).resolve().parents[3] / "scheduler/slipstream_scheduler/engine/profiles"
)

ATTRIBUTION = (
    "Vidur per-operator GPU timings and NCCL all-reduce timings: microsoft/vidur @7d47513 "
    "(Agrawal et al., MLSys'24), MIT License",
    "ML.ENERGY leaderboard v2 measurements (end-to-end TPOT vs batch size, used to calibrate "
    "host overheads): ml-energy/leaderboard-v2 @c3af7f3, Apache-2.0",
    "Splitwise perf_model.csv (Llama-2-70B prompt latencies, used to calibrate the prefill "
    "attention efficiency): Mutinifni/splitwise-sim @8f99e7d (Patel et al., ISCA'24), MIT License",
)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    vidur_dir: str
    n_layers: int
    vocab: int
    max_model_len: int


MODELS: dict[str, ModelSpec] = {
    "llama-2-7b": ModelSpec("Llama-2-7b-hf", 32, 32000, 4096),
    "llama-3-8b": ModelSpec("Meta-Llama-3-8B", 32, 128256, 8192),
    "llama-2-70b": ModelSpec("Llama-2-70b-hf", 80, 32000, 4096),
}
SHIPPED_MODELS = ("llama-2-7b", "llama-3-8b")
GPUS = ("a100", "h100")

# Datasheet numbers, dense fp16/bf16 without sparsity (SXM parts, 80 GB).
HARDWARE: dict[str, Hardware] = {
    "a100": Hardware("NVIDIA A100-SXM4-80GB", 2.039e12, 312e12, 80e9),
    "h100": Hardware("NVIDIA H100-SXM5-80GB", 3.35e12, 989e12, 80e9),
}

DECODE_ATTN_EFFICIENCY = 0.7
"""Fraction of HBM bandwidth decode attention reaches (paged KV reads); fixed, not fitted:
ML.ENERGY's TPOT cannot tell it apart from the per-sequence host overhead."""

# ML.ENERGY does not publish prompt lengths; assumed means (ShareGPT chat first
# turns, HumanEval-style code prompts). They only set the prefill share of a step.
PREFILL_EFF_RANGE = (30, 90)
"""Search range of the prefill attention efficiency, in percent of peak FLOPs: what
FlashAttention-2 reaches on A100/H100 (about 35-75 %). Unbounded, the Splitwise fit
drives it to the 10 % floor, charging attention for time the old stack lost elsewhere."""

MLENERGY_PROMPT_TOKENS = {"chat": 200, "code": 150}

SPLITWISE_MAX_STEP_TOKENS = 16384
"""Splitwise rows whose prompt batch exceeds this many tokens are left out: a chunked-prefill
engine never runs such a step (the budget is <= 16k tokens), and Vidur's tables stop at 4k."""

# Which ML.ENERGY model stands for which profile, and whether it is in the fit set.
MLENERGY_MATCH: tuple[tuple[str, str, str, bool], ...] = (
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", "chat", "llama-3-8b", True),
    ("codellama/CodeLlama-7b-hf", "code", "llama-2-7b", False),
    ("mistralai/Mistral-7B-Instruct-v0.3", "chat", "llama-3-8b", False),
)


# ------------------------------------------------------------------ derivation


def _grid(points: Sequence[int]) -> list[int]:
    """Sample points kept in a profile: dense to 512 tokens, every 64 after, 1024 past 8192."""
    keep = [n for n in points if n <= 512 or (n <= 8192 and n % 64 == 0) or n % 1024 == 0]
    return keep if keep[-1] == points[-1] else [*keep, points[-1]]


def _interp(points: Sequence[tuple[int, float]], n: float) -> float:
    return Curve(tuple(float(x) for x, _ in points), tuple(y for _, y in points))(n)


def _round(v: float) -> float:
    return float(f"{v:.5g}")


def _layer_ms(ops: dict[str, Callable[[float], float]], n: float) -> float:
    """One layer's linear ops: norms, QKV, RoPE, O, gated MLP and two residual adds."""
    return sum(ops[op](n) for op in ops if op not in ("emb", "add")) + 2.0 * ops["add"](n)


def _op_functions(vops: VidurOps) -> dict[str, Callable[[float], float]]:
    out: dict[str, Callable[[float], float]] = {}
    for op, pts in vops.ops.items():
        curve = Curve(tuple(float(x) for x, _ in pts), tuple(y for _, y in pts))
        out[op] = curve.__call__
    return out


def _scaled_ops(
    target: VidurOps, ref_from: VidurOps, ref_to: VidurOps
) -> dict[str, Callable[[float], float]]:
    """``target``'s ops scaled per op by ``ref_to / ref_from`` at the same token count.

    Beyond the reference's largest token count the ratio at that count is used.
    """
    out: dict[str, Callable[[float], float]] = {}
    for op, pts in target.ops.items():
        f_pts, t_pts = ref_from.ops[op], ref_to.ops[op]
        top = f_pts[-1][0]

        def fn(
            n: float,
            pts: tuple[tuple[int, float], ...] = pts,
            f_pts: tuple[tuple[int, float], ...] = f_pts,
            t_pts: tuple[tuple[int, float], ...] = t_pts,
            top: int = top,
        ) -> float:
            m = min(n, top)
            return _interp(pts, n) * _interp(t_pts, m) / _interp(f_pts, m)

        out[op] = fn
    return out


def build_profile(
    model: str, gpu: str, tp: int = 1, calibration: Calibration | None = None
) -> GpuProfile:
    """Derive one GPU profile from the shared data (uncalibrated unless given)."""
    spec = MODELS[model]
    derivation = (
        f"Linear ops: Vidur {gpu} {spec.vidur_dir} mlp.csv medians (duplicates averaged), "
        f"TP={tp}, summed per layer (add counted twice) x {spec.n_layers} layers + embedding. "
        "LM head: mlp_up_proj curve x vocab/(2*d_ffn)."
    )
    measured = (data_root() / f"profiling/vidur/compute/{gpu}/meta-llama/{spec.vidur_dir}").is_dir()
    vops = read_vidur_ops(gpu, spec.vidur_dir)[tp] if measured else None
    if vops is not None:
        ops = _op_functions(vops)
    else:
        # H100 profile missing (Llama-3-8B): scale the A100 one by Llama-2-7B's H100/A100 ratio.
        vops = read_vidur_ops("a100", spec.vidur_dir)[tp]
        ops = _scaled_ops(
            vops,
            read_vidur_ops("a100", MODELS["llama-2-7b"].vidur_dir)[tp],
            read_vidur_ops("h100", MODELS["llama-2-7b"].vidur_dir)[tp],
        )
        derivation = (
            f"Linear ops: Vidur a100 {spec.vidur_dir} mlp.csv medians, each op scaled by the "
            "measured H100/A100 ratio of the same op of Llama-2-7B at the same token count "
            "(ratio at 4096 tokens beyond that), TP=1; per layer (add twice) x "
            f"{spec.n_layers} layers + embedding. LM head: mlp_up_proj x vocab/(2*d_ffn)."
        )
    shape = vops.shape
    arch = ModelArch(
        n_layers=spec.n_layers,
        n_heads=shape.n_head,
        n_kv_heads=shape.n_kv_head,
        d_model=shape.n_embd,
        d_ffn=shape.n_expanded_embd,
        vocab=spec.vocab,
        max_model_len=spec.max_model_len,
    )
    xs = _grid([n for n, _ in vops.ops["mlp_up_proj"]])
    fwd = [_round(spec.n_layers * _layer_ms(ops, n) + ops["emb"](n)) for n in xs]
    lm_scale = spec.vocab / (2.0 * arch.d_ffn)
    lm_x = [n for n in xs if n <= 1024]
    lm = [_round(ops["mlp_up_proj"](n) * lm_scale) for n in lm_x]
    ar_curve = None
    if tp > 1:
        pts = read_all_reduce(gpu)[tp]
        ar_curve = Curve(tuple(float(s) for s, _ in pts), tuple(_round(t) for _, t in pts))
        derivation += f" All-reduce: Vidur {gpu}_dgx all_reduce.csv, {tp} GPUs in one node."
    derivation += (
        " Attention: prefill FLOPs 4*n_heads*head_dim per causal (query,key) pair at "
        "prefill_attn_efficiency of peak; decode KV bytes at decode_attn_efficiency of HBM "
        "bandwidth. Host overhead c0 + c1*num_seqs fitted on ML.ENERGY TPOT (Llama-3.1-8B chat)."
    )
    return GpuProfile(
        model=model,
        gpu=gpu,
        tp=tp,
        arch=arch,
        hardware=HARDWARE[gpu],
        forward_linear_ms=Curve(tuple(float(x) for x in xs), tuple(fwd)),
        lm_head_ms=Curve(tuple(float(x) for x in lm_x), tuple(lm)),
        all_reduce_ms=ar_curve,
        calibration=calibration or Calibration(0.0, 0.0, 0.5, DECODE_ATTN_EFFICIENCY),
        derivation=derivation,
        attribution=ATTRIBUTION,
    )


def with_calibration(profile: GpuProfile, cal: Calibration) -> GpuProfile:
    return GpuProfile(
        profile.model,
        profile.gpu,
        profile.tp,
        profile.arch,
        profile.hardware,
        profile.forward_linear_ms,
        profile.lm_head_ms,
        profile.all_reduce_ms,
        cal,
        profile.derivation,
        profile.attribution,
    )


# ------------------------------------------------------------------ end-to-end predictions


def mlenergy_tpot(timing: GpuTimingModel, row: MlEnergyRow) -> float:
    """Steady-state mean step time of a saturated engine holding ``avg_batch`` requests.

    Each step decodes every request once and prefills ``B / O`` new prompts'
    worth of tokens (a request lives O steps); decode context averages
    ``I + O/2``. TPOT is that mean step time.
    """
    b, o = row.avg_batch, row.avg_output_tokens
    i = MLENERGY_PROMPT_TOKENS[row.task]
    new = b / o
    tokens = round(b + new * i)
    pairs = new * i * (i + 1) / 2.0
    kv = round(b * (i + o / 2.0))
    return timing.step_time(tokens, max(1, round(b)), pairs, kv)


def splitwise_prompt_s(timing: GpuTimingModel, row: SplitwiseRow) -> float:
    b, p = row.batch_size, row.prompt_size
    return timing.step_time(b * p, b, b * p * (p + 1) / 2.0, 0)


def splitwise_token_s(timing: GpuTimingModel, row: SplitwiseRow) -> float:
    b = row.batch_size
    kv = b * (row.prompt_size + row.token_size // 2)
    return timing.step_time(b, b, 0.0, kv)


def _fit_overheads(
    profile: GpuProfile, rows: Sequence[MlEnergyRow], eff_p: float
) -> tuple[float, float]:
    """Least squares ``tpot - model(no overhead) = c0 + c1 * B`` with c0, c1 >= 0."""
    base = GpuTimingModel(
        with_calibration(profile, Calibration(0.0, 0.0, eff_p, DECODE_ATTN_EFFICIENCY))
    )
    xs = [r.avg_batch for r in rows]
    ys = [r.tpot_s - mlenergy_tpot(base, r) for r in rows]
    # weighted by 1/tpot so the fit minimises relative error
    w = [1.0 / r.tpot_s**2 for r in rows]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs, strict=True))
    sy = sum(wi * y for wi, y in zip(w, ys, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys, strict=True))
    det = sw * sxx - sx * sx
    c1 = (sw * sxy - sx * sy) / det
    c0 = (sy - c1 * sx) / sw
    if c1 < 0:
        c1, c0 = 0.0, max(0.0, sy / sw)
    if c0 < 0:
        c0, c1 = 0.0, max(0.0, sxy / sxx)
    return c0, c1


def _fit_prefill_eff(gpu: str, rows: Sequence[SplitwiseRow], c0: float, c1: float) -> float:
    """Grid search of the prefill attention efficiency on Splitwise 70B prompt latencies."""
    profiles = {tp: build_profile("llama-2-70b", gpu, tp) for tp in sorted({r.tp for r in rows})}
    best, best_err = 0.5, math.inf
    for k in range(PREFILL_EFF_RANGE[0], PREFILL_EFF_RANGE[1] + 1):
        eff = k / 100.0
        cal = Calibration(c0, c1, eff, DECODE_ATTN_EFFICIENCY)
        err = 0.0
        for r in rows:
            t = GpuTimingModel(with_calibration(profiles[r.tp], cal))
            err += abs(splitwise_prompt_s(t, r) * 1e3 / r.prompt_ms - 1.0)
        if err < best_err:
            best, best_err = eff, err
    return best


def _splitwise_rows(gpu: str) -> list[SplitwiseRow]:
    hw = f"{gpu}-80gb"
    return [
        r
        for r in read_splitwise()
        if r.model == "llama2-70b"
        and r.hardware == hw
        and r.batch_size * r.prompt_size <= SPLITWISE_MAX_STEP_TOKENS
    ]


def _mlenergy_rows(model: str, task: str, gpu: str) -> list[MlEnergyRow]:
    return [
        r
        for r in read_mlenergy()
        if r.model == model and r.task == task and r.gpu == gpu and r.tp == 1
    ]


def calibrate(gpu: str) -> Calibration:
    """Fit c0, c1 (ML.ENERGY Llama-3.1-8B chat) and the prefill efficiency (Splitwise)."""
    fit_rows = _mlenergy_rows("meta-llama/Meta-Llama-3.1-8B-Instruct", "chat", gpu)
    sw_rows = _splitwise_rows(gpu)
    base = build_profile("llama-3-8b", gpu)
    eff_p, c0, c1 = 0.5, 0.0, 0.0
    for _ in range(3):  # alternate; converges in two rounds
        c0, c1 = _fit_overheads(base, fit_rows, eff_p)
        eff_p = _fit_prefill_eff(gpu, sw_rows, c0, c1)
    return Calibration(_round(c0), _round(c1), eff_p, DECODE_ATTN_EFFICIENCY)


# ------------------------------------------------------------------ validation


@dataclass(frozen=True, slots=True)
class CheckRow:
    source: str
    gpu: str
    what: str
    role: str  # fit | held-out
    n: int
    mape: float
    max_ape: float
    bias: float  # mean signed relative error


def _errors(pairs: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    rel = [(p - m) / m for p, m in pairs]
    return (
        sum(abs(e) for e in rel) / len(rel),
        max(abs(e) for e in rel),
        sum(rel) / len(rel),
    )


def check_rows(cals: dict[str, Calibration]) -> list[CheckRow]:
    out: list[CheckRow] = []
    for gpu in GPUS:
        cal = cals[gpu]
        for ml_model, task, prof, fitted in MLENERGY_MATCH:
            rows = _mlenergy_rows(ml_model, task, gpu)
            if not rows:
                continue
            t = GpuTimingModel(build_profile(prof, gpu, calibration=cal))
            mape, mx, bias = _errors([(mlenergy_tpot(t, r), r.tpot_s) for r in rows])
            out.append(
                CheckRow(
                    "ML.ENERGY TPOT",
                    gpu,
                    f"{ml_model.split('/')[1]} ({task}) vs {prof}, BS "
                    f"{min(r.max_batch for r in rows)}-{max(r.max_batch for r in rows)}",
                    "fit (c0,c1)" if fitted else "held-out",
                    len(rows),
                    mape,
                    mx,
                    bias,
                )
            )
        sw = _splitwise_rows(gpu)
        for tp in sorted({r.tp for r in sw}):
            t = GpuTimingModel(build_profile("llama-2-70b", gpu, tp, calibration=cal))
            tp_rows = [r for r in sw if r.tp == tp]
            for what, role in (("prompt", "fit (prefill eff)"), ("token", "held-out")):
                if what == "prompt":
                    pairs = [(splitwise_prompt_s(t, r) * 1e3, r.prompt_ms) for r in tp_rows]
                else:
                    pairs = [(splitwise_token_s(t, r) * 1e3, r.token_ms) for r in tp_rows]
                mape, mx, bias = _errors(pairs)
                out.append(
                    CheckRow(
                        "Splitwise",
                        gpu,
                        f"llama2-70b TP{tp} {what} latency (70B Vidur profile + all-reduce)",
                        role,
                        len(tp_rows),
                        mape,
                        mx,
                        bias,
                    )
                )
    return out


def format_check(rows: Sequence[CheckRow], cals: dict[str, Calibration]) -> str:
    lines = [
        "| source | gpu | comparison | role | n | MAPE | max APE | bias |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.source} | {r.gpu} | {r.what} | {r.role} | {r.n} | {r.mape:.1%} | "
            f"{r.max_ape:.1%} | {r.bias:+.1%} |"
        )
    lines.append("")
    for gpu, c in cals.items():
        lines.append(
            f"{gpu}: step_overhead={c.step_overhead_s * 1e3:.3f} ms, per_seq_overhead="
            f"{c.per_seq_overhead_s * 1e3:.4f} ms, "
            f"prefill_attn_eff={c.prefill_attn_efficiency:.2f}, "
            f"decode_attn_eff={c.decode_attn_efficiency:.2f}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ commands


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="profile_command", metavar="WHAT", required=True)
    g = sub.add_parser("gpu", help="derive GPU timing profiles from ../shared/data")
    g.add_argument("--out", type=Path, default=PROFILES_DIR, help="folder for the JSON files")
    g.add_argument("--check", action="store_true", help="print the validation table only")
    lat = sub.add_parser("latency", help="fit the latency model on engine-model profiling runs")
    lat.add_argument("--model", default="llama-2-7b", help="profile model (default llama-2-7b)")
    lat.add_argument("--gpu", default="a100", help="profile GPU (default a100)")
    lat.add_argument("--seed", type=int, default=0, help="profiling seed (default 0)")
    lat.add_argument(
        "--json",
        type=Path,
        default=None,
        help="output file (default: the shipped latency_<model>_<gpu>.json)",
    )
    lat.add_argument("--all", action="store_true", help="all shipped (model, gpu) pairs")
    lat.add_argument(
        "--curve",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also try the token-curve feature set (schema 3, what the shipped profiles use: "
        "held-out MAPE <= 1.5 %% on each); --no-curve fits the hinge sets only (schema 2, "
        "for operators and sidecars that predate the curve). Default: --curve",
    )
    profile_engine.add_arguments(
        sub.add_parser("engine", help="profile a live engine through its OpenAI API and fit")
    )


def _run_gpu(args: argparse.Namespace) -> int:
    cals = {gpu: calibrate(gpu) for gpu in GPUS}
    if args.check:
        print(format_check(check_rows(cals), cals))
        return 0
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for model in SHIPPED_MODELS:
        for gpu in GPUS:
            prof = build_profile(model, gpu, calibration=cals[gpu])
            path = out / profile_name(model, gpu)
            path.write_text(json.dumps(prof.to_dict(), indent=1) + "\n")
            print(f"wrote {path}")
    return 0


def _run_latency(args: argparse.Namespace) -> int:
    from slipstream_scheduler.engine.model import EngineConfig
    from slipstream_scheduler.profiler import fit_latency_model

    pairs = [(m, g) for m in SHIPPED_MODELS for g in GPUS] if args.all else [(args.model, args.gpu)]
    for model, gpu in pairs:
        lat_model, report = fit_latency_model(
            EngineConfig(model=model, gpu=gpu), args.seed, curve=args.curve
        )
        if args.json and not args.all:
            path: Path = args.json
        else:
            path = PROFILES_DIR / f"latency_{model}_{gpu}.json"
        path.write_text(lat_model.to_json())
        print(f"{model}/{gpu}: {report.summary()} -> {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.profile_command == "gpu":
        return _run_gpu(args)
    if args.profile_command == "engine":
        return profile_engine.run(args)
    return _run_latency(args)
