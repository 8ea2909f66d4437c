"""The Mooncake prefix-family scoring of ``bench lengths`` and ``bench core``'s load."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slipstream_cli.benches.core import busy_load
from slipstream_cli.benches.length_families import (
    TraceRequest,
    common_blocks,
    evaluate_trace,
    prefix_vector,
    queue_mean_ttlt,
    regimes,
    replay,
)
from slipstream_scheduler.lengths import GlobalDistributionPredictor, SemanticHistoryPredictor

pytestmark = pytest.mark.unit


def test_prefix_vector_cosine_is_the_shared_leading_blocks() -> None:
    a = prefix_vector([0, 1, 2, 3])
    b = prefix_vector([0, 1, 2, 3, 4, 5, 6, 7, 8])  # the next turn of the same chat
    c = prefix_vector([0, 9, 10, 11])  # another chat under the same system prompt
    d = prefix_vector([1, 2, 3, 0])  # same blocks, another order: another prefix
    assert float(np.linalg.norm(a)) == pytest.approx(1.0, abs=1e-6)
    assert float(a @ b) == pytest.approx(4 / math.sqrt(4 * 9), abs=1e-5)
    assert float(a @ c) == pytest.approx(1 / 4, abs=1e-5)
    assert abs(float(a @ d)) < 0.3


def _req(t: float, out: int, *blocks: int) -> TraceRequest:
    return TraceRequest(t, 512 * len(blocks), out, blocks)


def test_regimes_skip_the_blocks_every_request_shares() -> None:
    reqs = [_req(0, 10, 0, 1, 2), _req(1, 10, 0, 3), _req(2, 10, 0, 1, 2, 4), _req(3, 10, 0, 5)]
    assert common_blocks(reqs) == 1
    assert regimes(reqs) == ["unique", "unique", "recurring", "unique"]


def test_replay_predicts_from_requests_finished_before_the_arrival() -> None:
    reqs = [_req(0.0, 100, 1, 2), _req(0.5, 900, 1, 2, 3), _req(10.0, 50, 7)]
    vectors = [prefix_vector(r.blocks) for r in reqs]
    samples = replay(GlobalDistributionPredictor, reqs, vectors, 0.01)
    # Request 1 arrives at 0.5 s; request 0 finished at 1.0 s: not yet observed.
    assert samples[1].tolist() == [256.0]  # the default prior
    assert sorted(samples[2].tolist()) == [100.0, 900.0]


def test_queue_orders_by_rank_and_sjf_beats_fcfs() -> None:
    lengths = [500, 5, 400, 3, 300, 2, 200, 1] * 20
    fcfs = queue_mean_ttlt(lengths, [0.0] * len(lengths), 0.95, seed=0)
    sjf = queue_mean_ttlt(lengths, [float(x) for x in lengths], 0.95, seed=0)
    assert sjf < fcfs
    assert queue_mean_ttlt(lengths, [0.0] * len(lengths), 0.95, seed=0) == fcfs


def test_families_of_a_recurring_chat_are_learned() -> None:
    """Chats with a fixed answer length per chat: the prefix rule learns them, global cannot."""
    rng = np.random.default_rng(0)
    reqs = []
    t = 0.0
    for turn in range(6):
        for chat in range(20):
            t += 1.0
            blocks = (0, 1000 + chat, *range(10_000 * chat, 10_000 * chat + turn + 1))
            reqs.append(_req(t, int(100 + 80 * chat + rng.integers(0, 10)), *blocks))
    rows = evaluate_trace(
        "toy",
        reqs,
        predictors={
            "global": lambda dim: GlobalDistributionPredictor(),
            "semantic": SemanticHistoryPredictor,
        },
        decode_s_per_token=0.0,
        seeds=2,
    )
    by = {(r.regime, r.predictor): r for r in rows}
    assert by["recurring", "semantic"].p_bucket > 2 * by["recurring", "global"].p_bucket
    assert by["recurring", "semantic"].mean_ttlt_ratio_vs_global < 1.0
    assert by["recurring", "global"].mean_ttlt_ratio_vs_global == 1.0


def test_busy_load_starts_and_stops_its_processes() -> None:
    with busy_load(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.returncode is not None for p in procs)
