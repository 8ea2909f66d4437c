"""``slipstream bench sidecar``: reading the sidecar's overhead metrics, and the CPU layout."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
from pathlib import Path

import aiohttp
import pytest

from slipstream_cli.benches.sidecar import (
    _GRANTS,
    BrokenAnswerError,
    _baseline_flags,
    _closed_loop,
    _overhead_ms,
    _overhead_summary,
    _pin_layout,
    _ready_loop,
    _stream_one,
)

pytestmark = pytest.mark.unit

_BEFORE = """\
slipstream_requests_admitted_total{class="online"} 10.0
slipstream_requests_admitted_total{class="offline"} 7.0
slipstream_online_grants_at_arrival_total 4.0
"""
_AFTER = _BEFORE.replace("} 10.0", "} 110.0").replace("total 4.0", "total 79.0")


def _grants(text: str) -> dict[str, dict[str, float]]:
    return {"grants": {a or b: float(v) for a, b, v in _GRANTS.findall(text)}}


def test_share_of_grants_decided_on_arrival_is_per_block() -> None:
    acc: dict[str, dict[str, float]] = {}
    _overhead_summary(_grants(_BEFORE), _grants(_AFTER), acc)
    out = _overhead_ms(acc)["grants"]
    assert out["admitted"] == 100.0 and out["at_arrival"] == 75.0  # offline not counted
    assert out["at_arrival_share"] == 0.75


def test_stage_histogram_mean_and_bucket_bounds() -> None:
    series = {"0.001": 60.0, "0.01": 99.0, "0.1": 100.0, "+Inf": 100.0, "sum": 0.2, "count": 100.0}
    row = _overhead_ms({"to_engine": series})["to_engine"]
    assert row["mean_ms"] == pytest.approx(2.0)
    assert row["p50_le_ms"] == pytest.approx(1.0) and row["p99_le_ms"] == pytest.approx(10.0)


def test_pin_gives_each_process_a_cpu_when_there_are_enough() -> None:
    hops = ["sidecar", "sidecar_estimate", "sidecar_baseline"]
    wide = _pin_layout(list(range(8)), hops)
    cores = [c for cpus in wide.values() for c in cpus]
    assert len(cores) == len(set(cores)) == 5
    narrow = _pin_layout([0, 1], hops)
    assert narrow["engine"] == [0] and narrow["client"] == narrow["sidecar_baseline"] == [1]


def test_ready_line_names_the_event_loop(tmp_path: Path) -> None:
    log = tmp_path / "sidecar.log"
    log.write_bytes(b"warming up\nsidecar ready http=8000 grpc=9000 loop=uvloop\n")
    assert _ready_loop(log) == "uvloop"
    log.write_bytes(b"sidecar ready http=8000 grpc=9000\n")  # an older sidecar's line
    assert _ready_loop(log, wait_s=0.1) is None


def test_baseline_path_gets_its_loop_and_extra_arguments() -> None:
    from slipstream_cli.benches.sidecar import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--baseline-event-loop",
            "asyncio",
            "--baseline-arg=--length-predictor",
            "--baseline-arg=input",
        ]
    )
    assert _baseline_flags(args) == ["--event-loop", "asyncio", "--length-predictor", "input"]
    assert _baseline_flags(parser.parse_args([])) == []


def _block(ttft_p50: float, ttft_p99: float) -> dict[str, float]:
    return {
        "ttft_p50_ms": ttft_p50,
        "ttft_p99_ms": ttft_p99,
        "e2e_p50_ms": 100.0,
        "e2e_p99_ms": 200.0,
    }


def test_paths_are_read_against_direct_per_repeat() -> None:
    from slipstream_cli.benches.sidecar import _against_direct

    blocks = {
        "direct": [_block(80.0, 110.0), _block(84.0, 120.0)],
        "direct_control": [_block(82.0, 104.0), _block(83.0, 131.0)],
    }
    summ = {"direct": _block(82.0, 118.0), "direct_control": _block(82.5, 125.0)}
    row = _against_direct(summ, blocks, "direct_control")
    assert row["added_ttft_p99_ms"] == pytest.approx(7.0)
    assert row["ratio_ttft_p50"] == pytest.approx(82.5 / 82.0)
    # Each repeat against its own direct block: the spread the host leaves.
    assert row["added_ttft_p99_ms_per_repeat"] == pytest.approx([-6.0, 11.0])
    assert row["added_ttft_p50_ms_per_repeat"] == pytest.approx([2.0, -1.0])


def test_control_path_is_on_unless_refused() -> None:
    from slipstream_cli.benches.sidecar import DIRECT_PATHS, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).control is True
    assert parser.parse_args(["--no-control"]).control is False
    assert "direct_control" in DIRECT_PATHS  # timed like direct: no sidecar metrics read


def test_output_lengths_default_to_the_fixed_worst_case() -> None:
    from slipstream_cli.benches.sidecar import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.output_lengths, args.output_tokens) == ("fixed", 16)
    assert parser.parse_args(["--output-lengths", "alpaca"]).output_lengths == "alpaca"
    with pytest.raises(SystemExit):
        parser.parse_args(["--output-lengths", "sharegpt"])


def test_plot_shows_every_path_against_the_control(tmp_path: Path) -> None:
    from slipstream_cli import plots
    from slipstream_cli.benches.sidecar import _plot_panels

    row = {
        "added_ttft_p50_ms": 1.5,
        "added_ttft_p99_ms": 9.0,
        "added_ttft_p50_ms_per_repeat": [1.0, 2.0],
        "added_ttft_p99_ms_per_repeat": [4.0, 14.0],
    }
    conc = {
        "64": {
            "paths": {"direct": {}},
            "first_round": {"direct": {"ttft_p50_ms": 80.0}},
            "sidecar": row,
            "direct_control": row | {},
        },
        "1": {"sidecar": row},
    }
    panels = _plot_panels(conc)
    assert list(panels) == ["1", "64"]  # by stream count, not as strings sort
    # not the raw per-path table, nor the first rounds (no per-repeat figures)
    assert set(panels["64"]) == {"sidecar", "direct_control"}
    assert panels["64"]["sidecar"] == {
        "p50": [1.0, 2.0],
        "p99": [4.0, 14.0],
        "p50_all": [1.5],
        "p99_all": [9.0],
    }
    png = plots.added_by_repeat(
        panels, tmp_path / "sidecar.png", goal_ms=1.0, control="direct_control"
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_harness_collector_is_off_only_while_a_block_is_timed() -> None:
    import gc

    from slipstream_cli.benches.sidecar import collector_paused

    assert gc.isenabled()
    gc.disable()
    young = [[] for _ in range(300)]  # tracked allocations the collector has not seen yet
    assert gc.get_count()[0] >= len(young)
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
        assert gc.get_count()[0] < 100  # collected on the way in
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("a block failed")
    assert gc.isenabled()  # back on even when the block raises


async def _cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A path that answers every other request whole and cuts the rest midway."""
    n = 0
    while True:
        try:
            await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return
        length = 2  # the test's bodies are b"{}"
        await reader.readexactly(length)
        n += 1
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n"
        )
        if n % 2:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            continue
        await writer.drain()
        writer.close()  # no terminating chunk
        return


async def test_a_cut_stream_names_the_path_that_cut_it() -> None:
    server = await asyncio.start_server(_cut, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with aiohttp.ClientSession() as session:
            await _stream_one(session, base + "/v1/completions", b"{}")  # whole
            with pytest.raises(BrokenAnswerError, match=re.escape(base)):
                await _stream_one(session, base + "/v1/completions", b"{}")
            # Without a place to count them, a cut answer ends the run ...
            with pytest.raises(BrokenAnswerError):
                await _closed_loop(base, [b"{}"], 1, 4, session)
            # ... with one, it is counted and left out, and the loop goes on.
            broken: list[str] = []
            got = await _closed_loop(base, [b"{}"], 1, 4, session, broken=broken)
    finally:
        server.close()
        await server.wait_closed()
    assert len(got) == 2 and len(broken) == 2
    assert all(base in b for b in broken)


def test_each_block_has_one_warm_up_round_by_default() -> None:
    from slipstream_cli.benches.sidecar import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).block_warmup == 1
    assert parser.parse_args(["--block-warmup", "0"]).block_warmup == 0


def test_first_rounds_are_read_against_direct_first_rounds() -> None:
    from slipstream_cli.benches.sidecar import Sample, _first_round

    def samples(*ttft_ms: float) -> list[Sample]:
        return [Sample(t / 1e3, t / 1e3 + 0.2) for t in ttft_ms]

    first = {
        "direct": samples(80.0, 90.0, 100.0),
        "sidecar": samples(85.0, 99.0, 140.0),
        "proxy_reference": samples(81.0, 90.0, 103.0),
    }
    row = _first_round(first)
    assert set(row) == {"direct", "sidecar", "proxy_reference"}
    assert row["direct"] == {
        "n": 3.0,
        "ttft_p50_ms": pytest.approx(90.0),
        "ttft_p99_ms": pytest.approx(100.0),
    }
    assert row["sidecar"]["added_ttft_p50_ms"] == pytest.approx(9.0)
    assert row["sidecar"]["added_ttft_p99_ms"] == pytest.approx(40.0)
    assert row["proxy_reference"]["added_ttft_p99_ms"] == pytest.approx(3.0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_block_order_balances_positions_and_predecessors(n: int) -> None:
    from collections import Counter

    from slipstream_cli.benches.sidecar import block_order

    names = [f"p{i}" for i in range(n)]
    rows = [block_order(names, rep) for rep in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(row) == names for row in rows)  # every path once per repeat
    positions = Counter((i, name) for row in rows for i, name in enumerate(row))
    assert len(set(positions.values())) == 1 and len(positions) == n * n
    pairs = Counter(pair for row in rows for pair in itertools.pairwise(row))
    if n > 1:
        # every ordered pair of different paths, each equally often
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1
    assert block_order(names, len(rows)) == rows[0]  # cyclic beyond one design


def test_own_ms_takes_each_own_span_from_the_overhead_histograms() -> None:
    from slipstream_cli.benches.sidecar import _overhead_ms, own_ms

    acc = {
        "to_engine": {"0.0001": 60.0, "0.0005": 99.0, "0.002": 100.0, "+Inf": 100.0,
                      "sum": 0.01, "count": 100.0},
        "relay": {"0.0001": 100.0, "+Inf": 100.0, "sum": 0.002, "count": 100.0},
    }
    over = _overhead_ms(acc)
    assert own_ms(over, 50) == {"to_engine": 0.1, "relay": 0.1}
    assert own_ms(over, 99) == {"to_engine": 0.5, "relay": 0.1}
    assert own_ms({}, 99) is None and own_ms(None, 50) is None
    assert own_ms({"to_engine": over["to_engine"]}, 99) == {"to_engine": 0.5, "relay": None}
