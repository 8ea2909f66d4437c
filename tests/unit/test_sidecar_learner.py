"""Step records from the plugin's recorder to the sidecar's learned model, on real files.

The plugin's :class:`StepRecorder` writes segments into a channel folder as it does inside
vLLM; the sidecar's :class:`EngineLearner` reads them, fits and validates, and the model
reaches the gRPC status message and ``/metrics``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.enginecontrol import STEP_SEGMENTS_KEPT, STEPS_DIR
from slipstream_scheduler.learning import LearnParams, StepRecord
from slipstream_scheduler.profiler import engine_run_rows
from slipstream_sidecar.grpc_server import learned_pb
from slipstream_sidecar.learner import EngineLearner, LearnerCollector, SegmentReader
from slipstream_vllm.steps import StepRecorder


@dataclass
class Req:
    """What the recorder reads of a vLLM request after ``schedule()`` advanced it."""

    num_computed_tokens: int
    num_prompt_tokens: int


def test_compose_tells_decodes_from_prefill_chunks() -> None:
    requests = {
        "d": Req(num_computed_tokens=101, num_prompt_tokens=60),  # a decode at context 100
        "p": Req(num_computed_tokens=256, num_prompt_tokens=1000),  # a first chunk of 256
        "c": Req(num_computed_tokens=600, num_prompt_tokens=1000),  # a chunk of 200 after 400
        "t": Req(num_computed_tokens=50, num_prompt_tokens=50),  # a prompt's last token
    }
    scheduled = {"d": 1, "p": 256, "c": 200, "t": 1, "gone": 3}
    counts = StepRecorder.compose(scheduled, requests)
    assert counts == (3, 457, 0 + 400 + 49, 200 * 400 + 49, 1, 1, 100)


def test_a_step_that_decodes_the_last_steps_batch_is_counted_from_it() -> None:
    """compose_step carries the last step's counts only for the same decoding batch, in the
    same order, with nothing preempted; any other step is a pass over its requests."""
    requests = {rid: Req(num_computed_tokens=100 + 10 * i, num_prompt_tokens=50)
                for i, rid in enumerate("abcd")}
    rec = StepRecorder()

    def step(scheduled: dict[str, int], preempted: bool = False) -> tuple[int, ...]:
        for rid, n in scheduled.items():  # schedule() advances each scheduled request
            requests[rid].num_computed_tokens += n
        got = rec.compose_step(scheduled, sum(scheduled.values()), preempted, requests)
        assert got == StepRecorder.compose(scheduled, requests), scheduled
        return got

    assert step({"a": 1, "b": 1}) == (0, 0, 0, 0, 2, 2, 100 + 110)
    assert step({"a": 1, "b": 1}) == (0, 0, 0, 0, 2, 2, 101 + 111)
    step({"a": 1, "c": 1})  # the same size, another request: counted from the requests
    step({"c": 1, "a": 1})  # the same requests in another order: counted from them too
    step({"c": 1, "a": 1})
    requests["a"].num_computed_tokens = 0  # preempted (recompute) and back in one token
    step({"c": 1, "a": 1}, preempted=True)
    requests["d"].num_computed_tokens = 49  # the last token of d's prompt
    step({"c": 1, "d": 1})
    step({"c": 1, "d": 1})


def _flush_engine_steps(channel: Path, n: int) -> None:
    rec = StepRecorder()
    for batch, t in engine_run_rows(EngineConfig(), 5, n, 4096):
        r = StepRecord.of(batch, t)
        rec.record(t, (r.num_prefill_requests, r.sum_prefill_tokens, r.sum_prefill_kv_tokens,
                       r.sum_prefill_chunk_kv, r.num_decode_requests, r.sum_decode_tokens,
                       r.sum_decode_kv_tokens))
        if rec.pending() >= 700:
            rec.flush(channel)
    rec.flush(channel)
    assert rec.recorded == rec.written == n


def test_the_sidecar_learns_from_the_plugins_segments(tmp_path: Path) -> None:
    channel = tmp_path / "channel"
    channel.mkdir()
    _flush_engine_steps(channel, 2000)
    segments = sorted((channel / STEPS_DIR).glob("*.jsonl"))
    assert 2 <= len(segments) <= STEP_SEGMENTS_KEPT
    assert not list((channel / STEPS_DIR).glob(".*"))  # no temporary left behind
    # A torn or foreign line costs itself only.
    with segments[-1].open("a") as f:
        f.write('{"v": 1, "wall_time": -1}\n')
    learner = EngineLearner(channel, params=LearnParams(min_steps=200, holdout=200))

    async def run() -> None:
        out = await learner.step()
        assert out is not None and out.accepted and out.reason == "first"
        assert await learner.step() is None  # nothing new: no second read, no refit

    asyncio.run(run())
    snap = learner.snapshot()
    assert snap.seen == 2000 and learner.reader.bad_lines == 1
    assert learner.learned is not None and learner.learned.heldout_mape < 0.05
    msg = learned_pb(learner.learned)
    assert msg.source == "learned" and msg.revision == 1 and msg.seen_steps == 2000
    assert msg.model.kind == learner.learned.model.feature_set.value
    assert msg.model.coefficients["const"] > 0
    reg = CollectorRegistry()
    reg.register(LearnerCollector(learner))
    text = generate_latest(reg).decode()
    assert "slipstream_learned_steps_seen 2000.0" in text
    assert 'slipstream_learned_reservoir_steps{regime="mixed"}' in text
    assert "slipstream_learned_revision 1.0" in text


def test_the_plugin_keeps_a_bounded_folder_and_the_reader_follows(tmp_path: Path) -> None:
    rec = StepRecorder()
    reader = SegmentReader(tmp_path)
    seen = 0
    for i in range(STEP_SEGMENTS_KEPT + 10):
        rec.record(0.01, (0, 0, 0, 0, 4, 4, 400 + i))
        rec.flush(tmp_path)
        if i % 7 == 0:
            seen += len(reader.read_new())
    seen += len(reader.read_new())
    names = list((tmp_path / STEPS_DIR).glob("*.jsonl"))
    assert len(names) == STEP_SEGMENTS_KEPT
    # Read every 7 segments, the reader lost none; and it forgets names the plugin pruned.
    assert seen == STEP_SEGMENTS_KEPT + 10
    assert len(reader._read) == STEP_SEGMENTS_KEPT


def test_the_recorder_drops_the_oldest_when_nobody_flushes() -> None:
    rec = StepRecorder(capacity=100)
    for i in range(250):
        rec.record(0.01, (0, 0, 0, 0, 1, 1, i))
    rec.record(0.0, (0, 0, 0, 0, 1, 1, 0))  # not timed: not a row
    rec.record(0.01, (0, 0, 0, 0, 0, 0, 0))  # empty: not a row
    out = rec.drain()
    assert len(out) == 100 and out[0].sum_decode_kv_tokens == 150
    assert rec.recorded == 250


@pytest.mark.parametrize("bad", ["[]", '{"v": 2, "wall_time": 1}', "not json"])
def test_the_reader_skips_bad_segments_lines(tmp_path: Path, bad: str) -> None:
    (tmp_path / STEPS_DIR).mkdir()
    good = StepRecord(0.02, num_decode_requests=2, sum_decode_tokens=2, sum_decode_kv_tokens=9)
    (tmp_path / STEPS_DIR / "00000000000001-1-00000001.jsonl").write_text(
        bad + "\n" + good.to_json() + "\n")
    reader = SegmentReader(tmp_path)
    assert reader.read_new() == [good] and reader.bad_lines == 1


def test_while_no_fit_is_used_the_status_says_how_learning_goes(tmp_path: Path) -> None:
    import random

    from slipstream_sidecar.app import ClassStatus, SidecarStatus
    from slipstream_sidecar.grpc_server import status_pb

    rng = random.Random(0)
    rec = StepRecorder()
    for _ in range(600):  # times unrelated to the batches: no fit passes
        n = rng.randint(1, 64)
        rec.record(rng.uniform(0.001, 1.0), (0, 0, 0, 0, n, n, n * rng.randint(1, 2000)))
    rec.flush(tmp_path)
    learner = EngineLearner(tmp_path, params=LearnParams(min_steps=100, holdout=100))
    out = asyncio.run(learner.step())
    assert out is not None and not out.accepted and learner.learned is None
    idle = ClassStatus(0, 0, 0, 0)
    status = SidecarStatus(generation=1, online=idle, offline=idle, budget_s=None,
                           spare_capacity=1.0, engine_ready=True, draining=False, shards=(),
                           predicted_step_s=0.0, observed_step_s=0.0, ordering="fcfs",
                           learning=learner.snapshot())
    msg = status_pb(status).learned_model
    assert msg.seen_steps == 600 and not msg.model.coefficients and msg.revision == 0
    assert msg.heldout_mape == out.heldout_mape and msg.heldout_mape > 0.25
    text = generate_latest(_registry(learner)).decode()
    assert "slipstream_learned_last_fit_heldout_mape" in text
    assert "slipstream_learned_revision" not in text


def _registry(learner: EngineLearner) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(LearnerCollector(learner))
    return reg
