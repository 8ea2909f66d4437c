"""PNG plots for ``slipstream sim`` and the benchmarks (matplotlib, Agg backend).

Each function takes already-computed numbers and a path and writes one PNG.
Deliberately left out: interactive backends, styling beyond readability, and
any computation of the metrics themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import numpy.typing as npt

from slipstream_scheduler.sim.metrics import Timeline

FloatArray = npt.NDArray[np.float64]


def _save(fig: Any, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` (folders made) and free it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


save = _save
"""Lay out and write a figure a benchmark drew itself."""


def _cdf(ax: Any, values: FloatArray, label: str) -> None:
    if values.size == 0:
        return
    x = np.sort(values)
    y = np.arange(1, x.size + 1) / x.size
    ax.plot(x, y, label=label, linewidth=1.4)


def latency_cdfs(series: Mapping[str, Mapping[str, FloatArray]], path: Path, title: str) -> Path:
    """CDFs of TTFT and TBT: ``series[label] = {"ttft": samples, "tbt": samples}``, seconds."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, s in series.items():
        _cdf(axes[0], np.asarray(s.get("ttft", []), float), label)
        _cdf(axes[1], np.asarray(s.get("tbt", []), float), label)
    for ax, name in zip(axes, ("TTFT (s)", "TBT (s)"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of samples")
        ax.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def throughput_timeline(timelines: Mapping[str, Timeline], path: Path, title: str) -> Path:
    """Online and offline tokens/s over time per label, against the online arrival rate."""
    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax2 = ax.twinx()
    for label, tl in timelines.items():
        t = np.arange(len(tl.online_tokens_per_s)) * tl.bin_s
        if any(tl.offline_tokens_per_s):
            ax.plot(t, tl.offline_tokens_per_s, label=f"{label}: offline tok/s", linewidth=1.2)
    # The online load is the same for every label that serves it: draw it once.
    ref = next((tl for tl in timelines.values() if any(tl.online_arrivals_per_s)), None)
    if ref is not None:
        t = np.arange(len(ref.online_tokens_per_s)) * ref.bin_s
        ax.plot(t, ref.online_tokens_per_s, label="online tok/s", color="black", linewidth=1.0)
        ax2.fill_between(
            t, ref.online_arrivals_per_s, color="tab:grey", alpha=0.25, label="online req/s"
        )
    ax.set_xlabel("time (s, virtual)")
    ax.set_ylabel("tokens/s")
    ax2.set_ylabel("online arrivals/s")
    ax.grid(alpha=0.3)
    lines, labels = ax.get_legend_handles_labels()
    l2, lb2 = ax2.get_legend_handles_labels()
    ax.legend(lines + l2, labels + lb2, fontsize=8, loc="upper right")
    ax.set_title(title)
    return _save(fig, path)


def grouped_bars(
    groups: Sequence[str],
    series: Mapping[str, Sequence[float]],
    path: Path,
    *,
    ylabel: str,
    title: str,
) -> Path:
    """Bars per group (x) and series (colour), e.g. mean TTLT per load and ordering."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    n = max(len(series), 1)
    width = 0.8 / n
    x = np.arange(len(groups))
    for i, (label, values) in enumerate(series.items()):
        ax.bar(x + (i - (n - 1) / 2) * width, values, width, label=label)
    ax.set_xticks(x, groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(fig, path)


def share_by_tolerance(
    series: Mapping[str, Sequence[tuple[float, float]]],
    path: Path,
    *,
    ceiling: float,
    goal: float,
) -> Path:
    """Offline share of offline-only (y) against the SLO tolerance in percent (x), one line per
    series, with the goal and the idle-time ceiling as horizontal lines."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for label, points in series.items():
        ax.plot(
            [x for x, _ in points],
            [100 * y for _, y in points],
            marker="o",
            label=f"budget ({label})",
        )
    ax.axhline(100 * goal, color="grey", linestyle="--", label=f"goal {goal:.0%}")
    ax.axhline(100 * ceiling, color="grey", linestyle=":", label="idle-time ceiling (1 - busy)")
    ax.set_xlabel("p99 TTFT and TBT tolerance over online-only, %")
    ax.set_ylabel("offline tokens/s, % of offline-only")
    ax.set_title("offline throughput bought by SLO tolerance")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def added_by_repeat(
    panels: Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]],
    path: Path,
    *,
    goal_ms: float,
    control: str,
) -> Path:
    """Added latency per repeat (dots) and over the whole run (bar), one panel per
    concurrency and percentile: ``panels[concurrency][path] = {"p50": [...], "p99": [...],
    "p50_all": [x], "p99_all": [y]}`` in ms. The ``control`` path's per-repeat range is
    shaded across each panel (what the run resolves), and ``goal_ms`` drawn as a line."""
    keys = list(panels)
    fig, axes = plt.subplots(
        2, max(len(keys), 1), figsize=(4.2 * max(len(keys), 1), 6.4), squeeze=False
    )
    for j, conc in enumerate(keys):
        paths = panels[conc]
        names = [n for n in paths if n == control] + [n for n in paths if n != control]
        for i, q in enumerate(("p50", "p99")):
            ax = axes[i][j]
            ctl = paths.get(control, {}).get(q, [])
            if ctl:
                ax.axhspan(min(ctl), max(ctl), color="grey", alpha=0.18, label="control range")
            for k, name in enumerate(names):
                reps = list(paths[name].get(q, []))
                ax.scatter([k] * len(reps), reps, s=14, alpha=0.7)
                whole = paths[name].get(f"{q}_all", [])
                if whole:
                    ax.hlines(whole[0], k - 0.3, k + 0.3, color="black", linewidth=1.6)
            ax.axhline(
                goal_ms,
                color="tab:red",
                linestyle="--",
                linewidth=0.9,
                label=f"goal {goal_ms:g} ms",
            )
            ax.axhline(0.0, color="black", linewidth=0.5)
            ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
            ax.set_ylabel(f"added TTFT {q}, ms")
            streams = "1 stream" if conc == "1" else f"{conc} streams"
            ax.set_title(f"{streams}, {q}", fontsize=10)
            ax.grid(alpha=0.3, axis="y")
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.suptitle("added TTFT against direct: each repeat (dots), the whole run (bar)")
    return _save(fig, path)
