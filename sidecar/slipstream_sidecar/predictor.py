"""The online length predictor of one sidecar: output-length distributions from similar prompts.

:class:`PromptLengths` is the ``LengthPredictor`` the dispatcher's online queue
keys its ordering with (Gittins by default) and feeds with every finished
online request. Two histories of finished requests (FIFO, ``history`` records):

* **by prompt text** (SageSched): the output lengths of past prompts whose
  embedding has cosine similarity >= 0.8 with this one, topped up with the
  nearest ones (the core's ``SemanticHistoryPredictor``). The embedder is the
  core's dependency-free ``HashingEmbedder`` (setting ``length_predictor=text``,
  the default) or MiniLM (``semantic``, needs the ``[semantic]`` extra; without
  it the sidecar warns and uses ``text``);
* **by input length** (the core's ``InputLengthHistoryPredictor``): for
  requests that carry no embedding. It holds every finished online request,
  so its global distribution is the :meth:`PromptLengths.prior_sample` the
  online queue ranks a request on once it outlives its predicted sample.

What runs where. Embedding a prompt and searching 10,000 records costs
milliseconds (the hashing embedder about 1 µs per character, the search about
0.5 ms), so none of it runs on the event loop: one worker thread owns the
embedder and the text history and does every embed, search and insert, in
submission order (no locks needed, one thread touches that history). The
proxy asks for an embedding and prediction only for a request that will be
*held* (the ordering decides when it runs); a request the dispatcher will
submit at its next decision anyway gets no embedding on its way in (its place
in the order cannot matter) and is keyed by its input length. After a request
finishes, its prompt text is embedded in the background and its output length
added to the text history (:meth:`learn`). The input-length history is
updated on the loop (microseconds). Prompts are embedded from their first
``embed_chars`` characters, which bounds the worker's time holding the GIL per
prompt, and the worker gives the GIL up between items (the process also sets a
1 ms switch interval, ``__main__.py``), so the event loop waits at most about a
millisecond for it. Finished requests are handed to the worker in batches
(``learn_batch`` or every ``learn_delay_s``), not one by one: each hand-over
wakes a thread and moves the GIL. Beyond ``max_backlog`` batches waiting,
learning is dropped (counted).

Prompt text is never logged; it lives only until its embedding is computed.

Deliberately left out: persistence of the histories (a restarted sidecar
learns again), prior lengths from a public data set, batching of embeddings.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from slipstream_scheduler.lengths import (
    HashingEmbedder,
    InputLengthHistoryPredictor,
    InputLengthParams,
    SemanticHistoryParams,
    SemanticHistoryPredictor,
)
from slipstream_scheduler.protocols import Embedder
from slipstream_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
Vector = npt.NDArray[np.float32]

# Predictions handed from the worker to the dispatcher's synchronous ``predict`` call,
# keyed by the identity of the request's vector; bounded in case a request never arrives.
_MAX_READY = 4096


def _nothing() -> None:
    return None


def prompt_text(request: dict[str, Any]) -> str | None:
    """The text a completion or chat request asks about (None: not plain text)."""
    if "messages" in request:
        msgs = request["messages"]
        if not isinstance(msgs, list):
            return None
        parts = []
        for m in msgs:
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, str):
                return None
            parts.append(content)
        return "\n".join(parts)
    prompt = request.get("prompt")
    return prompt if isinstance(prompt, str) else None


def make_embedder(kind: str) -> Embedder | None:
    """The embedder of a ``length_predictor`` setting (None for ``input``)."""
    if kind == "input":
        return None
    if kind == "semantic":
        from slipstream_scheduler.embedders_semantic import MiniLMEmbedder, minilm_model_path

        try:
            if importlib.util.find_spec("sentence_transformers") is None:
                raise ImportError("sentence_transformers")
            minilm_model_path()  # the bundled model files; torch loads on the first embed
        except ImportError:
            log.warning(
                "length_predictor=semantic needs the [semantic] extra; using the hashing "
                "embedder (length_predictor=text)"
            )
            return HashingEmbedder()
        return MiniLMEmbedder()
    return HashingEmbedder()


class PromptLengths:
    """``LengthPredictor`` over prompt-text and input-length histories; see the module doc."""

    def __init__(
        self,
        embedder: Embedder | None,
        *,
        history: int = 10_000,
        embed_chars: int = 1024,
        max_backlog: int = 16,
        learn_batch: int = 64,
        learn_delay_s: float = 0.25,
        metrics: SidecarMetrics | None = None,
    ) -> None:
        self.by_input = InputLengthHistoryPredictor(InputLengthParams(window=history))
        self.by_text: SemanticHistoryPredictor | None = None
        self._embedder = embedder
        self._pool: ThreadPoolExecutor | None = None
        if embedder is not None:
            self.by_text = SemanticHistoryPredictor(
                embedder.dim, SemanticHistoryParams(window=history)
            )
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="slipstream-lengths")
        self._chars = embed_chars
        self._backlog = threading.BoundedSemaphore(max_backlog)
        # Finished requests waiting to be learned: (text or None, vector or None, in, out).
        self._learn: list[tuple[str | None, Vector | None, int, int]] = []
        self._learn_batch = learn_batch
        self._learn_delay_s = learn_delay_s
        self._flush_timer: asyncio.TimerHandle | None = None
        self._ready: dict[int, FloatArray] = {}
        self._metrics = metrics if metrics is not None else SidecarMetrics()
        self._by_text_count = self._metrics.length_predictions.labels("text")
        self._by_input_count = self._metrics.length_predictions.labels("input")

    @property
    def uses_text(self) -> bool:
        return self.by_text is not None

    def close(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- LengthPredictor (the dispatcher calls these on the event loop) ---------------------

    def predict(self, vector: Vector | None, input_tokens: int) -> FloatArray:
        if vector is not None:
            sample = self._ready.pop(id(vector), None)
            if sample is not None:
                self._by_text_count.inc()
                return sample
            # NOTE: not computed by :meth:`embed_and_predict` (cannot search here: the
            # text history belongs to the worker thread); keyed by input length instead.
            log.debug("no text prediction ready for a request; using its input length")
        self._by_input_count.inc()
        return self.by_input.predict(None, input_tokens)

    def prior_sample(self, k: int) -> FloatArray:
        """At most ``k`` quantiles of every finished request's output length (ascending).

        The dispatcher's online queue ranks a request that outlived its
        predicted sample on these (the outliving rule's fallback). Read from the
        input-length history, which holds every finished online request and
        lives on the event loop (the text history belongs to the worker thread).
        """
        return self.by_input.prior_sample(k)

    def observe(self, vector: Vector | None, input_tokens: int, output_tokens: int) -> None:
        self.by_input.observe(None, input_tokens, output_tokens)
        if vector is not None and self.by_text is not None:
            self._queue_learn((None, vector, input_tokens, output_tokens))

    def refresh_gauges(self) -> None:
        hist = self._metrics.length_history
        hist.labels("input").set(len(self.by_input))
        hist.labels("text").set(len(self.by_text) if self.by_text is not None else 0)

    async def settled(self) -> None:
        """Wait until the worker has done everything submitted so far."""
        if self._pool is not None:
            self._flush()
            await asyncio.get_running_loop().run_in_executor(self._pool, _nothing)

    # -- the proxy's side ---------------------------------------------------------------------

    async def embed_and_predict(self, text: str, input_tokens: int) -> Vector | None:
        """Embed ``text`` and predict its lengths on the worker; returns the vector to put
        in the request's ``Incoming`` (its prediction waits for the dispatcher's ``predict``).
        None without a text embedder."""
        if self._pool is None:
            return None
        loop = asyncio.get_running_loop()
        vector, sample = await loop.run_in_executor(
            self._pool, self._embed_predict, text[: self._chars], input_tokens
        )
        if len(self._ready) >= _MAX_READY:
            self._ready.clear()
        self._ready[id(vector)] = sample
        return vector

    def learn(self, text: str, input_tokens: int, output_tokens: int) -> None:
        """A finished request that carried no vector: add it to the text history later."""
        if self._pool is not None:
            self._queue_learn((text[: self._chars], None, input_tokens, output_tokens))

    def _queue_learn(self, item: tuple[str | None, Vector | None, int, int]) -> None:
        # NOTE: batched: one hand-over to the worker per ``learn_batch`` items or
        # ``learn_delay_s``, not one per request. Each hand-over wakes the worker
        # thread and passes the GIL back and forth (docs/benchmarks/sidecar.md).
        self._learn.append(item)
        if len(self._learn) >= self._learn_batch:
            self._flush()
        elif self._flush_timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._flush()
                return
            self._flush_timer = loop.call_later(self._learn_delay_s, self._flush)

    def _flush(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if not self._learn:
            return
        items, self._learn = self._learn, []
        if not self._submit(self._learn_many, items):
            self._metrics.length_dropped.inc(len(items))

    # -- the worker thread --------------------------------------------------------------------

    def _submit(self, fn: Any, *args: Any) -> bool:
        assert self._pool is not None
        if not self._backlog.acquire(blocking=False):
            return False
        self._pool.submit(self._run, fn, *args)
        return True

    def _run(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # a learning failure must not stop the worker
            # NOTE: the type only: an embedder's message or traceback may quote the prompt.
            log.warning("length history update failed (%s)", type(exc).__name__)
        finally:
            self._backlog.release()

    def _embed(self, text: str) -> Vector:
        assert self._embedder is not None
        return np.asarray(self._embedder.embed([text])[0], dtype=np.float32)

    def _embed_predict(self, text: str, input_tokens: int) -> tuple[Vector, FloatArray]:
        assert self.by_text is not None
        vector = self._embed(text)
        return vector, self.by_text.predict(vector, input_tokens).copy()

    def _learn_many(self, items: list[tuple[str | None, Vector | None, int, int]]) -> None:
        assert self.by_text is not None
        for text, given, input_tokens, output_tokens in items:
            vector = given if given is not None else self._embed(text or "")
            self.by_text.observe(vector, input_tokens, output_tokens)
            time.sleep(0)  # let the event loop take the GIL between two prompts
