"""``slipstream profile engine``: token timestamps to latency-model rows, and its usage errors.

The streams here are synthetic: an engine whose steps end at known times, each stream getting
a token at the end of every step from the one that prefilled it on.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from slipstream_cli.commands.profile_engine import (
    FIRST_ID,
    REGIMES,
    Collector,
    Endpoint,
    EngineError,
    PromptMaker,
    StreamTrace,
    TaggedRow,
    api_overhead,
    chunk_tokens,
    decode_rows,
    decode_start,
    fit_profile,
    holdout_split,
    make_plan,
    mixed_rows,
    prefill_rows,
    span_time,
)
from slipstream_cli.main import main
from slipstream_operator.modelchoice import profile_source
from slipstream_scheduler.latency import FitError, LatencyModelMeta
from slipstream_scheduler.types import BatchItem, Phase

pytestmark = pytest.mark.unit


def _ends(durations: list[float], t0: float = 100.0) -> list[float]:
    out, t = [], t0
    for d in durations:
        t += d
        out.append(t)
    return out


def _trace(prompt: int, ends: list[float], first_step: int, tokens: int) -> StreamTrace:
    """A stream prefilled in step ``first_step``: one token at the end of it and each later step."""
    tr = StreamTrace(prompt, sent=ends[0] - 1.0)
    for t in ends[first_step : first_step + tokens]:
        tr.add(t, 1)
    return tr


def test_a_stream_in_prefill_keeps_its_steps_out_of_the_decode_rows() -> None:
    # steps 0 and 1 prefill streams a and b (slow steps); from step 1 on both decode
    durations = [0.050, 0.050] + [0.010] * 12 + [0.020] * 8
    ends = _ends(durations)
    a = _trace(100, ends, 0, 20)  # tokens at steps 0..19
    b = _trace(300, ends, 1, 20)  # tokens at steps 1..20
    assert decode_start([a, b]) == ([1, 0], 18)
    rows = decode_rows([a, b], window=4)
    # all-decode steps: 2..19 (a finishes at step 19) = 18 steps -> 4 windows of 4; the
    # first three at 10 ms, the last (steps 14..17) at 20 ms
    assert len(rows) == 4
    for batch, seconds in rows:
        assert [i.phase for i in batch] == [Phase.DECODE, Phase.DECODE]
        assert seconds in (pytest.approx(0.010), pytest.approx(0.020))
    first_batch, first_s = rows[0]
    assert first_s == pytest.approx(0.010)  # the 50 ms prefill steps are not in any row
    # steps 2..5 make a's tokens 2..5 and b's 1..4: mean contexts 102.5 and 301.5, rounded up
    assert [i.context for i in first_batch] == [103, 302]
    assert rows[-1][1] == pytest.approx(0.020)


def test_steps_after_the_first_stream_finishes_are_left_out() -> None:
    ends = _ends([0.01] * 10 + [0.5] * 10)  # a slow tail: only b decodes there
    a = _trace(10, ends, 0, 10)
    b = _trace(10, ends, 0, 20)
    rows = decode_rows([a, b], window=1)
    assert len(rows) == 9 and all(s == pytest.approx(0.01) for _, s in rows)


def test_a_stream_without_tokens_gives_no_rows() -> None:
    a = _trace(10, _ends([0.01] * 5), 0, 5)
    assert decode_rows([a, StreamTrace(10)]) == []
    assert decode_start([]) == ([], 0)
    assert mixed_rows([a, StreamTrace(10)], [(16, a.times[2])]) == []


def _burst(tr: StreamTrace, first: int, last: int) -> None:
    """Tokens ``first..last`` held back and sent together, 10 us apart, when ``last`` came."""
    for k in range(first, last + 1):
        tr.times[k] = tr.times[last] - 1e-5 * (last - k)


def test_late_tokens_inside_a_window_do_not_matter_but_at_its_ends_they_drop_it() -> None:
    ends = _ends([0.01] * 20)
    a, b, c = (_trace(10, ends, 0, 20) for _ in range(3))
    for tr in (a, b, c):
        _burst(tr, 2, 5)  # inside the window of steps 1..8 (tokens 0..8)
        _burst(tr, 14, 16)  # token 16 ends a window; the last of its burst, it is on time
    rows = decode_rows([a, b, c], window=8)
    assert [s for _, s in rows] == [pytest.approx(0.01), pytest.approx(0.01)]
    d = _trace(10, ends, 0, 20)
    for tr in (a, b):
        _burst(tr, 8, 10)  # token 8 ends the first window and starts the second: held back
    rows = decode_rows([a, b, d], window=8)
    assert rows == []  # only d (one of three) has the window's ends on time


def test_a_burst_is_a_gap_under_the_floor() -> None:
    ends = _ends([0.01] * 6)
    traces = [_trace(10, ends, 0, 6) for _ in range(2)]
    for tr in traces:
        _burst(tr, 2, 3)  # token 2 came with 3
    assert math.isnan(span_time(traces, [2, 2], 1))  # 2 -> 3 starts on a late token
    assert math.isnan(span_time(traces, [1, 1], 1))  # 1 -> 2 ends on one
    assert span_time(traces, [1, 1], 1, floor_s=0.0) == pytest.approx(0.02 - 1e-5)  # unseen
    assert span_time(traces, [1, 1], 2) == pytest.approx(0.01)  # 1 -> 3: the burst is inside
    assert span_time(traces, [3, 3], 2) == pytest.approx(0.01)


def test_the_median_gap_stands_for_the_step() -> None:
    ends = _ends([0.01] * 6)
    traces = [_trace(10, ends, 0, 6) for _ in range(3)]
    traces[0].times[3] += 0.004  # one stream's delivery lagged
    assert span_time(traces, [2, 2, 2], 1) == pytest.approx(0.01)


def test_a_prefill_sent_during_decode_is_a_mixed_row() -> None:
    durations = [0.03] + [0.01] * 5 + [0.04] + [0.01] * 5
    ends = _ends(durations)
    traces = [_trace(50, ends, 0, 12), _trace(70, ends, 0, 12)]
    injected = [(256, ends[6] + 0.0005)]  # its first token came with step 6's tokens
    rows = mixed_rows(traces, injected)
    assert len(rows) == 1
    batch, seconds = rows[0]
    assert seconds == pytest.approx(0.04)
    assert batch[-1] == BatchItem(Phase.PREFILL, 256, 0)
    assert [i.context for i in batch[:-1]] == [50 + 5, 70 + 5]


def test_a_prefill_outside_the_all_decode_window_is_not_attributed() -> None:
    ends = _ends([0.01] * 10)
    a, b = _trace(10, ends, 0, 10), _trace(10, ends, 3, 7)
    assert decode_start([a, b]) == ([3, 0], 6)
    early = (64, ends[2])  # b was still waiting for its prefill
    late = (64, ends[-1] + 0.5)  # everything had finished
    assert mixed_rows([a, b], [early, late]) == []
    assert len(mixed_rows([a, b], [(64, ends[5])])) == 1
    _burst(a, 4, 5)
    _burst(b, 1, 2)  # the gap into the prefill's step starts on late tokens
    assert mixed_rows([a, b], [(64, ends[5])]) == []


def test_prefill_rows_subtract_the_overhead_and_drop_what_it_swallows() -> None:
    rows = prefill_rows([(16, 0.010), (512, 0.050), (32, 0.002)], overhead_s=0.004)
    assert rows == [((BatchItem(Phase.PREFILL, 16, 0),), pytest.approx(0.006)),
                    ((BatchItem(Phase.PREFILL, 512, 0),), pytest.approx(0.046))]


def test_prefill_rows_are_timed_with_the_overhead_of_every_probe() -> None:
    """Probes slowed by a burst of load at the start would swallow every prefill; later,
    quiet probes lower the overhead, and the prefills are timed once collection ends."""
    col = Collector(Endpoint("http://127.0.0.1:1", "m"), None,  # type: ignore[arg-type]
                    PromptMaker(random.Random(0), 100), random.Random(0))

    def probe(ttft: float) -> StreamTrace:
        tr = StreamTrace(16, sent=10.0)
        for t in _ends([ttft] + [0.010] * 4, t0=10.0):
            tr.add(t, 1)
        return tr

    col.probes = [probe(0.200) for _ in range(5)]  # a burst: 190 ms of overhead
    col.prefill_ttfts = [(1, 64, 0.030), (2, 512, 0.080)]
    col.settle_prefills()
    assert col.overhead_s == pytest.approx(0.190)
    assert [r for r in col.rows if r.regime == "prefill"] == []
    col.probes += [probe(0.014) for _ in range(5)]  # the next round's probes: quiet
    col.settle_prefills()
    assert col.overhead_s == pytest.approx(0.004)
    rows = [r for r in col.rows if r.regime == "prefill"]
    assert [(r.group, r.batch, r.seconds) for r in rows] == [
        (1, (BatchItem(Phase.PREFILL, 64, 0),), pytest.approx(0.026)),
        (2, (BatchItem(Phase.PREFILL, 512, 0),), pytest.approx(0.076)),
    ]


def test_api_overhead_is_the_smallest_ttft_minus_a_decode_step() -> None:
    probes = []
    for lag in (0.003, 0.004, 0.005):
        tr = StreamTrace(1, sent=10.0)
        for t in _ends([0.010 + lag] + [0.010] * 4, t0=10.0):
            tr.add(t, 1)
        probes.append(tr)
    assert api_overhead(probes) == pytest.approx(0.003)
    assert api_overhead([StreamTrace(1)]) == 0.0


def test_chunk_tokens_reads_continuous_usage_and_falls_back_to_one_per_chunk() -> None:
    def line(doc: object) -> bytes:
        return b"data: " + json.dumps(doc).encode()

    assert chunk_tokens(line({"choices": [{"text": "a"}], "usage": {"completion_tokens": 3}}),
                        1) == 2
    assert chunk_tokens(line({"choices": [], "usage": {"completion_tokens": 3}}), 3) == 0
    assert chunk_tokens(line({"choices": [{"text": ""}]}), 0) == 1
    assert chunk_tokens(b"data: [DONE]", 0) == 0
    assert chunk_tokens(b": keep-alive", 0) == 0
    assert chunk_tokens(b"data: {not json", 0) == 0
    with pytest.raises(EngineError, match="out of vocabulary"):  # vLLM's error inside a 200
        chunk_tokens(line({"error": {"message": "Token id 4000 is out of vocabulary"}}), 0)


def test_prompts_have_their_length_ids_in_range_and_distinct_first_blocks() -> None:
    make = PromptMaker(random.Random(0), 200)
    prompts = [make(n) for n in (1, 2, 3, 16, 700) * 40]
    assert [len(p) for p in prompts[:5]] == [1, 2, 3, 16, 700]
    assert all(FIRST_ID <= t <= 200 for p in prompts for t in p)
    heads = [tuple(p[:3]) for p in prompts if len(p) >= 3]
    assert len(set(heads)) == len(heads)
    wrap = PromptMaker(random.Random(0), 200, start=191**3 - 1)  # the counter wraps around
    assert wrap(3) == [200, 200, 200] and wrap(3) == [FIRST_ID] * 3


def test_the_plan_respects_the_streams_and_the_model_length() -> None:
    plan = make_plan(24, 2048, 512)
    assert plan.streams == (1, 2, 4, 8, 16, 24)
    assert plan.mixed_streams == (1, 4, 16, 24)
    assert max(plan.prefill_prompts) == 511 and min(plan.prefill_prompts) == 16
    assert plan.decode_prompt_max == 512 - 64 - 1
    assert make_plan(1, 16, None).prefill_prompts == (16,)


def _rows(n_sets: int) -> list[TaggedRow]:
    """Rows from a linear GPU: 2 ms + 40 us per decode-context kilotoken + 20 us per prefill
    token."""
    rng, rows = random.Random(1), []
    for g in range(n_sets):
        n = rng.choice([1, 2, 4, 8, 16])
        for k in range(5):
            batch = tuple(BatchItem(Phase.DECODE, 1, 100 + 50 * g + k) for _ in range(n))
            rows.append(TaggedRow("decode", g, batch, 0.002 + 4e-8 * sum(i.context for i in batch)
                                  + 1e-4 * n))
        p = rng.randint(16, 1024)
        rows.append(TaggedRow("prefill", 1000 + g, (BatchItem(Phase.PREFILL, p, 0),),
                              0.002 + 2e-5 * p))
    return rows


def test_whole_groups_are_held_out_per_regime() -> None:
    rows = _rows(30)
    train, test = holdout_split(rows, 0.2, random.Random(0))
    assert len(train) + len(test) == len(rows)
    for regime in ("decode", "prefill"):
        held = [r for r in test if r.regime == regime]
        total = sum(r.regime == regime for r in rows)
        assert 0.2 * total <= len(held) < 0.2 * total + 5
    assert not {r.group for r in train} & {r.group for r in test}


def test_fit_profile_reports_per_regime_and_refuses_too_few_rows() -> None:
    model, report = fit_profile(_rows(30), holdout=0.2, seed=0, meta=LatencyModelMeta(
        model="m", gpu="g", source="slipstream profile engine http://127.0.0.1:1"))
    assert set(report.rows) == set(REGIMES) and report.rows["mixed"] == (0, 0)
    assert report.heldout_mape < 0.01 and report.regime_mape["prefill"] < 0.01
    assert profile_source("user:latency_m_g.json", model) == "profiled"  # what the operator shows
    assert any("held-out MAPE" in line for line in report.lines())
    with pytest.raises(FitError, match="too few rows"):
        fit_profile(_rows(30)[:15], holdout=0.2, seed=0, meta=LatencyModelMeta())
    only_decode = [r for r in _rows(30) if r.regime == "decode"]
    with pytest.raises(FitError, match="prefill"):
        fit_profile(only_decode, holdout=0.2, seed=0, meta=LatencyModelMeta())


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--url", "ftp://127.0.0.1:1", "not an http(s) URL"),
    ("--url", "http://127.0.0.1:99999", "bad port"),
    ("--budget-s", "5", "at least 10"),
    ("--max-streams", "0", "at least 1"),
    ("--max-prompt-tokens", "8", "at least 16"),
    ("--holdout", "1.5", "(0, 1]"),
    ("--seed", "x", "not a whole number"),
])
def test_bad_values_are_usage_errors(
    flag: str, value: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = {"--url": "http://127.0.0.1:1", "--model": "m", "--out": str(tmp_path / "o.json")}
    argv[flag] = value
    with pytest.raises(SystemExit) as exc:
        main(["profile", "engine", *(x for kv in argv.items() for x in kv)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and says in err and "Traceback" not in err


def test_an_unreachable_engine_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "latency_m_cpu.json"
    code = main(["profile", "engine", "--url", f"http://127.0.0.1:{port}", "--model", "m",
                 "--out", str(out)])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err.strip()
    assert err.startswith("slipstream profile engine: error: cannot reach")
    assert "\n" not in err and "Traceback" not in err
    assert main(["profile", "engine", "--url", f"http://127.0.0.1:{port}", "--model", "m",
                 "--out", str(tmp_path / "no" / "o.json")]) == 2
