"""``bench plugin-serve``'s summary: ratios of medians to stock, stock's own spread, which
ratios it resolves, the idle server's CPU and the greedy answers compared per repeat."""

from __future__ import annotations

from typing import Any

import pytest

from slipstream_cli.benches.front_load import FIGURES
from slipstream_cli.benches.plugin_serve import summarise


def _round(server: str, repeat: int, scale: float, texts: tuple[str, ...] = ("a", "b"),
           failed: int = 0) -> dict[str, Any]:
    figures = {f: 10.0 * scale for f in FIGURES}
    figures.update(failed=failed, completed=2 - failed)
    return {"server": server, "repeat": repeat, "figures": figures, "texts": texts,
            "errors": ("boom",) if failed else (), "idle_cpu_s": 0.1 * (repeat + 1)}


def test_ratio_spread_and_resolution() -> None:
    rounds = [_round("stock", 0, 1.0), _round("plugin", 0, 1.5),
              _round("stock", 1, 1.1), _round("plugin", 1, 1.5),
              _round("stock", 2, 1.2), _round("plugin", 2, 1.5)]
    out = summarise(rounds)
    for f in FIGURES:
        assert out["paths"]["stock"]["median"][f] == pytest.approx(11.0)
        assert out["ratio_plugin"][f] == pytest.approx(15.0 / 11.0)
        assert out["stock_spread"][f] == pytest.approx(1.2)
        assert out["resolved_plugin"][f]  # 1.36x lies outside stock's 1.2x
    assert out["paths"]["plugin"]["idle_cpu_s"] == pytest.approx(0.2)
    assert out["outputs"] == {"identical": True, "differing_per_repeat": [0, 0, 0]}


def test_within_the_spread_is_unresolved_and_answers_are_compared_per_repeat() -> None:
    rounds = [_round("stock", 0, 1.0), _round("plugin", 0, 1.05, ("a", "x"), failed=1),
              _round("stock", 1, 1.1), _round("plugin", 1, 1.05)]
    out = summarise(rounds)
    assert not any(out["resolved_plugin"].values())
    assert out["outputs"] == {"identical": False, "differing_per_repeat": [1, 0]}
    assert out["paths"]["plugin"]["failed"] == 1 and out["paths"]["plugin"]["errors"] == ["boom"]
