"""Simulation tier: ``slipstream bench colocation`` runs only at the load it was asked for.

The rate scale is found by bisection on the online-only busy fraction. Where no scale reaches
the target in the chosen window (Mooncake's first ten requests arrive at once, 113k prompt
tokens between them, so a 60 s window stays busy whatever the rate), the bench stops with a
usage error instead of reporting rows at another load.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from slipstream_cli.benches.colocation import (
    BUSY_TOLERANCE,
    add_arguments,
    find_rate_scale,
    load_setting,
)
from slipstream_cli.main import main
from slipstream_cli.workloads import data_root

pytestmark = pytest.mark.sim


def test_an_unreachable_load_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "c.json"
    trace = data_root() / "mooncake" / "conversation_trace.dev.jsonl"
    code = main(["bench", "colocation", "--trace", str(trace), "--duration-s", "60",
                 "--target-busy", "0.3", "--extra-busy", "--in-engine", "none",
                 "--json", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert "online-only busy 0.30" in err and "--duration-s" in err and "Traceback" not in err
    assert not out.exists()


def test_the_azure_window_reaches_the_load_it_is_asked_for() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--duration-s", "60", "--json", "unused.json"])
    full, _, engine = load_setting(args)
    _, busy = find_rate_scale(full, engine, args.start_s, 60.0, 0.3)
    assert abs(busy - 0.3) <= BUSY_TOLERANCE
