"""``slipstream bench learning``: how well, how fast and at what cost a pod learns its latency
model from its own engine's steps.

Two sources of steps:

* ``engine-model``: the engine model with a GPU's timing (llama-2-7b on an A100 and an H100
  by default), a mixed online/offline run (``profiler.engine_run_rows``); the held-out test
  steps come from a run with another seed.
* ``vllm``: real ``vllm serve`` on this CPU with the tiny model and Slipstream's plugin,
  driven by concurrent requests of mixed prompt and output lengths; the plugin's own step
  records (``steps/`` in the channel, read as they come) are the rows, and every fifth
  block of 200 consecutive steps is held out as the test steps. Runs on this host spread
  widely (docs/benchmarks/learning.md gives the range), so the source is run
  ``--vllm-runs`` times (3 by default), each a fresh server, and the report gives every
  run and their medians and ranges (``vllm_spread``).

For each source, the learner (``slipstream_scheduler.learning.StepLearner``, the sidecar's)
is fed the training steps in order; after 100, 1,000 and 10,000 steps (those the source has)
it fits on its reservoir, and the report gives the fit's MAPE on the test steps and the fit's
wall time. The baseline, measured on the same test steps, is what the operator does without
learning: the shipped llama-2-7b A100 profile, rescaled by calibration's one factor (the
median of measured over predicted step time over the first 100 steps). The recording cost
is the plugin's per-step work on vLLM's scheduling thread (``StepRecorder.compose_step`` and
``record``) timed over N scheduled requests (16, 64, 256) with objects carrying the two
attributes it reads: the same decoding batch every step, and a batch that changes every step.

Deliberately left out: the plugin's cost inside a real step (see ``bench plugin-overhead``).
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.enginecontrol import CONTROL_FILE, EngineControl
from slipstream_scheduler.latency import LinearLatencyModel, fit_matrix
from slipstream_scheduler.learning import (
    LearnParams,
    StepLearner,
    StepRecord,
    mape,
    matrix,
    predictions,
    read_records,
    without_stragglers,
)
from slipstream_scheduler.profiler import engine_run_rows
from slipstream_sidecar.learner import SegmentReader

SCHEMA = "slipstream.bench.learning/v1"
PROFILES = Path(__file__).resolve().parents[3] / "scheduler/slipstream_scheduler/engine/profiles"
CHECKPOINTS = (100, 1000, 10000)
PLUGIN = "slipstream_vllm.scheduler.SlipstreamScheduler"
VLLM_SOURCE = "vllm serve (CPU, tiny model)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", choices=["engine-model", "vllm"], nargs="+",
                        default=["engine-model", "vllm"], help="where steps come from")
    parser.add_argument("--gpus", nargs="+", default=["a100", "h100"],
                        help="engine-model GPUs (default a100 h100)")
    parser.add_argument("--vllm-requests", type=int, default=5000,
                        help="requests sent to vllm serve (default 5000)")
    parser.add_argument("--vllm-runs", type=int, default=3,
                        help="separate vllm serve runs (default 3: this host's runs spread "
                             "widely; the report gives each and their medians)")
    parser.add_argument("--running", type=int, nargs="+", default=[16, 64, 256],
                        help="scheduled requests per step for the recording cost")
    parser.add_argument("--steps-out", type=Path,
                        help="also write the vLLM run's step records (JSON lines) here")
    parser.add_argument("--steps-in", type=Path,
                        help="read the vLLM step records from this file instead of running vLLM")
    parser.add_argument("--json", type=Path, help="write the JSON report here")
    parser.add_argument("--plot", type=Path, help="write the learning curves (PNG) here")


def calibrated_baseline(train: list[StepRecord], test: list[StepRecord],
                        gpu: str = "a100") -> dict[str, float]:
    """The shipped llama-2-7b profile times calibration's one factor (the operator's
    ``calibration.scaled``: every coefficient times the median measured/predicted ratio),
    taken over the first 100 steps."""
    shipped = LinearLatencyModel.from_json(
        (PROFILES / f"latency_llama-2-7b_{gpu}.json").read_text())
    first = train[:100]
    ratio = statistics.median(
        r.wall_time / p for r, p in zip(first, predictions(shipped, first), strict=True))
    rescaled = replace(shipped, coefficients=tuple(c * ratio for c in shipped.coefficients),
                       stats=None)
    clean = without_stragglers(test)
    return {"scale": ratio, "mape": mape(rescaled, clean), "mape_unscaled": mape(shipped, clean),
            "mape_all": mape(rescaled, test)}


def learning_curve(train: list[StepRecord], test: list[StepRecord]) -> list[dict[str, Any]]:
    learner = StepLearner(LearnParams())
    out = []
    marks = [c for c in CHECKPOINTS if c <= len(train)]
    for i, rec in enumerate(train, 1):
        learner.add(rec)
        if i not in marks:
            continue
        # Everything seen so far (the reservoir and the held-out window) is what a fit at
        # this point can use; the test steps are separate.
        rows = without_stragglers([*learner.reservoir, *learner.held_out])
        t0 = time.perf_counter()
        model = fit_matrix(*matrix(rows)).model
        fit_s = time.perf_counter() - t0
        out.append({"steps": i, "rows": len(rows), "fit_s": fit_s,
                    "feature_set": model.feature_set.value,
                    "mape": mape(model, without_stragglers(test)), "mape_all": mape(model, test)})
    return out


def noise_floor(train: list[StepRecord], test: list[StepRecord]) -> dict[str, float]:
    """The control: how far a test step's time is from the median time of the training
    steps of exactly its composition (any model of the composition can do no better on
    those steps), over the test steps whose composition the training steps hold at least
    three times."""
    by: dict[tuple[int, ...], list[float]] = {}
    for r in without_stragglers(train):
        by.setdefault(_composition(r), []).append(r.wall_time)
    apes = [abs(r.wall_time - statistics.median(by[k])) / r.wall_time
            for r in without_stragglers(test) if len(by.get(k := _composition(r), ())) >= 3]
    return {"mape": statistics.fmean(apes) if apes else float("nan"), "steps": len(apes)}


def _composition(r: StepRecord) -> tuple[int, ...]:
    return (r.num_prefill_requests, r.sum_prefill_tokens, r.sum_prefill_chunk_kv,
            r.num_decode_requests, r.sum_decode_kv_tokens // 64)


def engine_model_source(gpu: str) -> dict[str, Any]:
    cfg = EngineConfig(gpu=gpu)
    train = [StepRecord.of(b, t) for b, t in engine_run_rows(cfg, 11, 10000, 4096)]
    test = [StepRecord.of(b, t) for b, t in engine_run_rows(cfg, 12, 2000, 4096)]
    return {"source": f"engine-model llama-2-7b/{gpu}", "train_steps": len(train),
            "test_steps": len(test), "curve": learning_curve(train, test),
            "baseline": calibrated_baseline(train, test, gpu),
            "noise_floor": noise_floor(train, test)}


def _post(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.read()


def vllm_source(requests: int, steps_out: Path | None = None,
                steps_in: Path | None = None) -> dict[str, Any]:
    lines = (steps_in.read_text().splitlines() if steps_in is not None
             else vllm_steps(requests))
    if steps_out is not None:
        steps_out.write_text("".join(line + "\n" for line in lines))
    recs, errors = read_records(lines)
    if errors:
        raise RuntimeError(f"bad step records: {errors[:3]}")
    train, test = split_blocks(recs)
    stamps = [r.at for r in recs if r.at > 0]
    traffic_s = max(stamps) - min(stamps) if len(stamps) > 1 else 0.0
    return {"source": VLLM_SOURCE, "train_steps": len(train),
            "test_steps": len(test), "traffic_s": traffic_s,
            "curve": learning_curve(train, test),
            "baseline": calibrated_baseline(train, test),
            "noise_floor": noise_floor(train, test)}


def split_blocks(recs: list[StepRecord], block: int = 200,
                 every: int = 5) -> tuple[list[StepRecord], list[StepRecord]]:
    """Every ``every``-th block of ``block`` consecutive steps is held out (the test steps),
    the rest, in order, is training: the test spans the whole run, as the traffic's phases
    do, and no test step sits right beside the training step it nearly repeats."""
    train: list[StepRecord] = []
    test: list[StepRecord] = []
    for i in range(0, len(recs), block):
        (test if (i // block) % every == every - 1 else train).extend(recs[i:i + block])
    return train, test


def vllm_steps(requests: int) -> list[str]:
    """The plugin's step records of one run of real ``vllm serve``."""
    from slipstream_testbed.vllm import DEFAULT_SERVED_NAME, VllmServer, VllmServerOptions
    from slipstream_testbed.vllm.tiny_model import ensure

    with tempfile.TemporaryDirectory(prefix="slipstream-learning-") as tmp:
        channel = Path(tmp)
        (channel / CONTROL_FILE).write_text(EngineControl(generation=1, policy="naive").encode())
        srv = VllmServer(VllmServerOptions(
            model_dir=ensure(), scheduler_cls=PLUGIN, max_num_batched_tokens=256,
            env={"SLIPSTREAM_CHANNEL_DIR": str(channel)}, log_path=channel / "vllm.log"))
        srv.start()
        try:
            rng = random.Random(7)
            salt = secrets.randbelow(500)
            bodies = []
            for i in range(requests):
                n = rng.choice((8, 32, 60, 120, 200, 300))
                prompt = [2 + (salt + i) % 1000] + [rng.randrange(2, 1000) for _ in range(n - 1)]
                bodies.append({"model": DEFAULT_SERVED_NAME, "prompt": prompt,
                               "max_tokens": rng.choice((4, 16, 48, 120)),
                               "temperature": 0, "ignore_eos": True})
            # The plugin keeps only its newest segments: read them as they come, as the
            # sidecar does.
            reader = SegmentReader(channel)
            records: list[StepRecord] = []
            with ThreadPoolExecutor(16) as pool:
                pending = [pool.submit(_post, srv.url + "/v1/completions", b) for b in bodies]
                while not all(f.done() for f in pending):
                    records.extend(reader.read_new())
                    time.sleep(0.5)
                for f in pending:
                    f.result()
            time.sleep(1.0)  # the channel thread's last flush
            records.extend(reader.read_new())
        finally:
            srv.stop()
        return [r.to_json() for r in records]


@dataclass
class _Req:
    num_computed_tokens: int
    num_prompt_tokens: int


def recording_cost(running: int, steps: int = 20000) -> dict[str, float]:
    """The recorder's time per step (``compose_step`` and ``record``) over ``running``
    scheduled decodes, each advanced a token between steps as vLLM's ``schedule()`` does
    (outside the timing): the same batch every step (the steady state, carried from the last
    step's counts), and a batch that changes every step (one request swapped: a pass over
    every request)."""
    from slipstream_vllm.steps import StepRecorder

    requests = {f"r{i}": _Req(100 + i + 1, 50) for i in range(running + 1)}
    ids = list(requests)
    batches = {  # the report's key: the batches a step cycles through
        "us_per_step": [dict.fromkeys(ids[:running], 1)],
        "us_per_step_changing": [dict.fromkeys(ids[:running], 1), dict.fromkeys(ids[1:], 1)],
    }
    out: dict[str, float] = {"running": running}
    for key, cycle in batches.items():
        rec = StepRecorder()
        samples = []
        for _ in range(5):
            spent = 0
            for step in range(steps // 5):
                scheduled = cycle[step % len(cycle)]
                for rid in scheduled:
                    requests[rid].num_computed_tokens += 1
                t0 = time.perf_counter_ns()
                rec.record(0.01, rec.compose_step(scheduled, running, False, requests))
                spent += time.perf_counter_ns() - t0
            samples.append(spent / (steps // 5) / 1000)
            rec.drain()
        out[key] = statistics.median(samples)
    return out


def spread(sources: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Across several runs of one source: per checkpoint, the median and range of the
    learned model's MAPE and of its ratio to the run's noise floor; the same for the
    calibrated baseline and the noise floor. None with fewer than two runs."""
    if len(sources) < 2:
        return None

    def stats(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    checkpoints = sorted({p["steps"] for src in sources for p in src["curve"]})
    curve = []
    for steps in checkpoints:
        pts = [(p, src) for src in sources for p in src["curve"] if p["steps"] == steps]
        curve.append({
            "steps": steps, "runs": len(pts),
            "mape": stats([p["mape"] for p, _ in pts]),
            "over_noise_floor": stats([p["mape"] / src["noise_floor"]["mape"] for p, src in pts]),
        })
    return {"runs": len(sources), "curve": curve,
            "baseline_mape": stats([src["baseline"]["mape"] for src in sources]),
            "noise_floor_mape": stats([src["noise_floor"]["mape"] for src in sources])}


def run(args: argparse.Namespace) -> int:
    parser = argparse.ArgumentParser(prog="slipstream bench learning")
    add_arguments(parser)
    if args.vllm_runs < 1:
        parser.error("--vllm-runs must be >= 1")
    if args.vllm_runs > 1 and (args.steps_in is not None or args.steps_out is not None):
        parser.error("--steps-in and --steps-out take one vLLM run: add --vllm-runs 1")
    sources: list[dict[str, Any]] = []
    vllm_runs: list[dict[str, Any]] = []
    for name in args.source:
        if name == "engine-model":
            sources.extend(engine_model_source(g) for g in args.gpus)
            continue
        for k in range(args.vllm_runs):
            src = vllm_source(args.vllm_requests, args.steps_out, args.steps_in)
            if args.vllm_runs > 1:
                src["source"] = f"{VLLM_SOURCE}, run {k + 1}"
            vllm_runs.append(src)
        sources.extend(vllm_runs)
    cost = [recording_cost(n) for n in args.running]
    report = {"schema": SCHEMA, "sources": sources, "recording": cost,
              "vllm_spread": spread(vllm_runs)}
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot_curves(args.plot, sources)
    return 0


def plot_curves(path: Path, sources: list[dict[str, Any]]) -> None:
    """Held-out MAPE against steps seen, per source, with the calibrated shipped profile and
    the noise floor as horizontal lines."""
    import matplotlib.pyplot as plt

    from slipstream_cli.plots import save

    fig, axes = plt.subplots(1, len(sources), figsize=(4.2 * len(sources), 3.4), squeeze=False)
    for ax, src in zip(axes[0], sources, strict=True):
        steps = [p["steps"] for p in src["curve"]]
        ax.plot(steps, [100 * p["mape"] for p in src["curve"]], "o-", label="learned")
        ax.axhline(100 * src["baseline"]["mape"], color="tab:red", ls="--",
                   label="shipped x calibration")
        ax.axhline(100 * src["noise_floor"]["mape"], color="gray", ls=":", label="noise floor")
        ax.set_xscale("log")
        ax.set_xlabel("steps seen")
        ax.set_ylabel("held-out MAPE (%)")
        ax.set_title(src["source"], fontsize=9)
        ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    save(fig, path)


def _print(report: dict[str, Any]) -> None:
    console = Console(width=160)
    table = Table(title="held-out MAPE of the learned model vs steps seen (stragglers out; "
                  "with them in brackets)")
    for col in ("source", "steps", "rows", "features", "fit ms", "learned MAPE",
                "shipped x scale MAPE", "learned / shipped", "noise floor"):
        table.add_column(col)
    for src in report["sources"]:
        base, floor = src["baseline"], src["noise_floor"]
        for pt in src["curve"]:
            table.add_row(src["source"], str(pt["steps"]), str(pt["rows"]), pt["feature_set"],
                          f"{1000 * pt['fit_s']:.0f}",
                          f"{pt['mape']:.2%} ({pt['mape_all']:.2%})",
                          f"{base['mape']:.2%} (x{base['scale']:.3g})",
                          f"{pt['mape'] / base['mape']:.2f}",
                          f"{floor['mape']:.2%} (n={floor['steps']})")
    console.print(table)
    sp = report.get("vllm_spread")
    if sp:
        for c in sp["curve"]:
            m, r = c["mape"], c["over_noise_floor"]
            console.print(f"vLLM, {sp['runs']} runs, {c['steps']} steps ({c['runs']} runs): "
                          f"learned MAPE median {m['median']:.2%} ({m['min']:.2%}-{m['max']:.2%}),"
                          f" {r['median']:.2f}x the noise floor ({r['min']:.2f}-{r['max']:.2f}x)")
        b, f = sp["baseline_mape"], sp["noise_floor_mape"]
        console.print(f"vLLM: shipped x calibration median {b['median']:.2%} "
                      f"({b['min']:.2%}-{b['max']:.2%}); noise floor median {f['median']:.2%} "
                      f"({f['min']:.2%}-{f['max']:.2%})")
    for c in report["recording"]:
        console.print(f"recording: {c['running']} scheduled requests: "
                      f"{c['us_per_step']:.1f} us per step, the same batch; "
                      f"{c['us_per_step_changing']:.1f} us, a changing batch")
