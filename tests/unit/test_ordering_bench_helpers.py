"""The ordering bench's workload pieces: arrivals, the saturated rate, the mixed requests."""

from __future__ import annotations

import numpy as np
import pytest

from slipstream_cli.benches import ordering
from slipstream_cli.benches.ordering_vllm import VOCAB_HIGH, VOCAB_LOW, text_token_ids
from slipstream_cli.workloads import WorkloadError, alpaca_eval

pytestmark = pytest.mark.unit


def test_trace_gaps_keep_their_shape_and_take_the_rate() -> None:
    gaps = np.array([0.1, 0.1, 2.0, 0.1, 0.7])
    t = ordering.arrival_times(10, rate=4.0, seed=3, gaps=gaps)
    got = np.diff(np.concatenate([[0.0], t]))
    # Ten consecutive gaps of the trace from some offset (wrapping), scaled by one factor.
    windows = [np.take(gaps, np.arange(s, s + 10), mode="wrap") for s in range(gaps.size)]
    assert any(np.allclose(got, w * (0.25 / w.mean())) for w in windows)
    assert got.mean() == pytest.approx(0.25)
    # Seeded: the same seed, the same stream; another seed, another offset.
    assert np.array_equal(t, ordering.arrival_times(10, rate=4.0, seed=3, gaps=gaps))
    assert not np.array_equal(t, ordering.arrival_times(10, rate=4.0, seed=4, gaps=gaps))


def test_poisson_arrivals_have_the_rate() -> None:
    t = ordering.arrival_times(20_000, rate=2.0, seed=0)
    assert np.all(np.diff(t) >= 0)
    assert t[-1] / t.size == pytest.approx(0.5, rel=0.03)


def test_text_token_ids_count_as_the_bench_counts_and_recur_with_the_text() -> None:
    text = "Summarise the following paragraph, briefly: it's 3 lines."
    ids = text_token_ids(text)
    assert len(ids) == alpaca_eval.regex_token_count(text)
    assert all(VOCAB_LOW <= i < VOCAB_HIGH for i in ids)
    assert ids == text_token_ids(text)
    assert ids[:2] != text_token_ids("Translate the following paragraph")[:2]
    assert text_token_ids("") == [VOCAB_LOW]


def test_long_share_mixes_in_arxiv_requests_with_token_ids() -> None:
    try:
        reqs, prompts = ordering.build_workload(None, 50, 0, long_share=0.2)
    except (alpaca_eval.DataMissingError, FileNotFoundError) as exc:
        pytest.skip(f"shared data not available: {exc}")
    longs = [r for r in reqs if r.group == "arxiv"]
    assert len(reqs) == 50 and len(longs) == 10
    assert all(r.vector is not None for r in reqs)
    assert np.mean([r.prompt_tokens for r in longs]) > 10 * np.mean(
        [r.prompt_tokens for r in reqs if r.group != "arxiv"]
    )
    assert all(len(prompts[r.request_id]) == r.prompt_tokens for r in reqs)


def test_one_generators_stream_holds_only_its_answers() -> None:
    try:
        rows = alpaca_eval.load_rows(None)
    except (alpaca_eval.DataMissingError, FileNotFoundError) as exc:
        pytest.skip(f"shared data not available: {exc}")
    name = sorted({r.generator for r in rows})[0]
    reqs, _ = ordering.build_workload(None, 10_000, 0, generator=name)
    mine = sum(r.generator == name for r in rows)
    # Every answer of that generator once (as many as it has: fewer than asked), no other's.
    assert {r.group for r in reqs} == {name} and len(reqs) == mine < len(rows)
    mixed, _ = ordering.build_workload(None, 100, 0, generator=name, long_share=0.2)
    assert sorted({r.group for r in mixed}) == sorted({name, "arxiv"}) and len(mixed) == 100
    with pytest.raises(WorkloadError, match="--generator nobody: no answers"):
        ordering.build_workload(None, 50, 0, generator="nobody")
