"""The real-time driver: steps the engine model on a wall-clock timeline.

One asyncio task owns the :class:`~slipstream_scheduler.engine.EngineModel`.
While the engine has work it runs a step, adds the step's modelled
``duration_s`` to a *target timeline*, sleeps until the target, then publishes
the step's tokens: it draws each token (or end-of-sequence) from
:mod:`slipstream_scheduler.textgen`, detects stop strings, tells the engine
about EOS/stop finishes, and wakes each affected request's handler once. The
handlers (``app.py``) then write all of a step's chunks for their stream in a
single write.

Timing rules:

* Steps are scheduled against the target timeline, not "now + duration", so
  per-step overhead does not accumulate into drift. If the host is late the
  driver does not sleep; if it falls more than ``max_lag_s`` behind, it drops
  the debt (resynchronises) rather than bursting tokens to catch up.
* After an idle period the timeline restarts at the first new request.
* Requests that arrive during a step join the next one, as in vLLM.
* Aborts (client disconnects) and finishes are applied immediately: the event
  loop runs them between two synchronous ``step`` calls, so the engine frees
  the request before its next step.

Deliberately left out: HTTP (``app.py``), request validation and response
formatting; per-token threads or tasks (there is exactly one loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from slipstream_scheduler.engine.model import (
    EngineModel,
    EngineRequest,
    RequestState,
    StepResult,
)
from slipstream_scheduler.textgen import EOS_ID, TokenGenerator, Tokenizer, block_hashes
from slipstream_testbed.engine_server.metrics import EngineMetrics, FinishedRequestStats

logger = logging.getLogger(__name__)

__all__ = ["Delta", "Driver", "DriverStats", "GenerationParams", "Stream"]


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """What decides a request's output, resolved from the HTTP body."""

    max_tokens: int
    seed: int
    min_tokens: int = 0
    ignore_eos: bool = False
    priority: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False


@dataclass(frozen=True, slots=True)
class Delta:
    """What a request produced since its handler last looked."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(slots=True)
class DriverStats:
    """Counters of the real-time loop (for benchmarks and debugging)."""

    steps: int = 0
    late_steps: int = 0  # steps published after their target time
    resyncs: int = 0  # times the timeline was reset because the host fell too far behind
    max_lag_s: float = 0.0
    total_lag_s: float = 0.0
    modelled_s: float = 0.0  # sum of the engine model's step durations


class Stream:
    """One request in flight: the driver fills it, one HTTP handler drains it."""

    __slots__ = (
        "_held",
        "_new_ids",
        "_pending",
        "_ready",
        "arrival_s",
        "completion_tokens",
        "context",
        "engine_id",
        "finish_reason",
        "first_token_s",
        "last_token_s",
        "params",
        "prompt_len",
        "request_id",
        "scheduled_s",
        "stop_reason",
    )

    def __init__(
        self,
        request_id: str,
        engine_id: str,
        prompt_ids: Sequence[int],
        params: GenerationParams,
        arrival_s: float,
    ) -> None:
        self.request_id = request_id
        self.engine_id = engine_id
        self.params = params
        self.prompt_len = len(prompt_ids)
        self.context: list[int] = list(prompt_ids)
        self.arrival_s = arrival_s
        self.scheduled_s: float | None = None  # start of the first step that scheduled it
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._pending: list[str] = []
        self._new_ids: list[int] = []
        self._held = ""
        self._ready = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def next_delta(self) -> Delta | None:
        """Wait for new output; ``None`` once the final delta was taken."""
        if self.finished and not self._ready.is_set():
            return None
        await self._ready.wait()
        self._ready.clear()
        delta = Delta(
            text="".join(self._pending),
            token_ids=tuple(self._new_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self._pending.clear()
        self._new_ids.clear()
        return delta

    # -- driver side ------------------------------------------------------------------------

    def _push_text(self, piece: str) -> str | None:
        """Add output text, holding back what could still become a stop string.

        Returns the stop string that matched, if any (the text is then cut).
        """
        stops = self.params.stop
        if not stops:
            self._pending.append(piece)
            return None
        buf = self._held + piece
        best: tuple[int, str] | None = None
        for s in stops:
            idx = buf.find(s)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            self._pending.append(
                buf[: idx + len(s)] if self.params.include_stop_str_in_output else buf[:idx]
            )
            self._held = ""
            return s
        keep = max(len(s) for s in stops) - 1
        cut = max(0, len(buf) - keep)
        self._pending.append(buf[:cut])
        self._held = buf[cut:]
        return None

    def _finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        if self.finished:
            return
        if self._held and reason != "abort":
            self._pending.append(self._held)
        self._held = ""
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self._ready.set()


@dataclass(slots=True)
class _Clock:
    t0: float
    target: float
    stats: DriverStats = field(default_factory=DriverStats)


class Driver:
    """Owns the engine model and the streams; see the module docstring."""

    def __init__(
        self,
        engine: EngineModel,
        tokenizer: Tokenizer,
        generator: TokenGenerator,
        metrics: EngineMetrics,
        *,
        block_size: int = 16,
        max_lag_s: float = 0.25,
    ) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._gen = generator
        self._metrics = metrics
        self._block_size = block_size
        self._max_lag_s = max_lag_s
        self._streams: dict[str, Stream] = {}
        self._unscheduled: dict[str, Stream] = {}
        self._last_duration = 0.0
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._clock: _Clock | None = None
        self._last_stats = engine.stats()
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._clock = _Clock(t0=now, target=now)
        self._task = loop.create_task(self._run(), name="engine-driver")

    async def stop(self) -> None:
        self._closed = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for stream in list(self._streams.values()):
            stream._finish("abort")
        self._streams.clear()

    @property
    def stats(self) -> DriverStats:
        assert self._clock is not None
        return self._clock.stats

    @property
    def num_live(self) -> int:
        return len(self._streams)

    def now_s(self) -> float:
        """Seconds on the engine's clock (monotonic, zero at start)."""
        assert self._clock is not None
        return asyncio.get_running_loop().time() - self._clock.t0

    # -- requests ---------------------------------------------------------------------------

    def submit(
        self, request_id: str, prompt_ids: Sequence[int], params: GenerationParams
    ) -> Stream:
        """Queue a request in the engine; its output arrives on the returned stream."""
        if self._closed:
            raise RuntimeError("driver is stopped")
        engine_id = f"{request_id}#{next(self._ids)}"
        arrival = self.now_s()
        stream = Stream(request_id, engine_id, prompt_ids, params, arrival)
        self._engine.add(
            EngineRequest(
                request_id=engine_id,
                prompt_len=len(prompt_ids),
                max_tokens=params.max_tokens,
                priority=params.priority,
                arrival_s=arrival,
                block_hashes=block_hashes(prompt_ids, self._block_size),
            )
        )
        self._streams[engine_id] = stream
        self._unscheduled[engine_id] = stream
        self._wake.set()
        return stream

    def abort(self, stream: Stream) -> None:
        """The client went away: free the request in the engine before its next step."""
        if self._streams.pop(stream.engine_id, None) is None:
            return
        self._engine.abort(stream.engine_id)
        stream._finish("abort")
        self._record_finished(stream)
        logger.debug("aborted %s after %d tokens", stream.request_id, stream.completion_tokens)

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        clock = self._clock
        assert clock is not None
        while not self._closed:
            if not self._engine.has_work():
                self._publish_queue_sizes()
                self._wake.clear()
                await self._wake.wait()
                clock.target = loop.time()  # a new busy period starts now
                continue
            now = loop.time()
            lag = now - clock.target
            if lag > self._max_lag_s:
                clock.stats.resyncs += 1
                clock.target = now
            result = self._engine.step(now - clock.t0)
            clock.target += result.duration_s
            clock.stats.modelled_s += result.duration_s
            delay = clock.target - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                clock.stats.late_steps += 1
                clock.stats.max_lag_s = max(clock.stats.max_lag_s, -delay)
                clock.stats.total_lag_s -= delay
                await asyncio.sleep(0)  # let handlers run between back-to-back steps
            clock.stats.steps += 1
            self._last_duration = result.duration_s
            self._publish(result, loop.time() - clock.t0)

    def _publish(self, result: StepResult, t: float) -> None:
        self._note_scheduled(t)
        streams = self._streams
        gen = self._gen
        piece = self._tokenizer.piece
        generated = 0
        engine_done = {rid: reason for rid, reason in result.finished}
        for rid, n in result.emitted:
            stream = streams.get(rid)
            if stream is None or stream.finished:
                continue
            params = stream.params
            ctx = stream.context
            for _ in range(n):
                generated += 1
                stream.completion_tokens += 1
                if stream.first_token_s is None:
                    stream.first_token_s = t
                    self._metrics.first_token(t - stream.arrival_s, stream.prompt_len)
                else:
                    assert stream.last_token_s is not None
                    self._metrics.inter_token(t - stream.last_token_s)
                stream.last_token_s = t
                eos_allowed = not params.ignore_eos and stream.completion_tokens > params.min_tokens
                if eos_allowed and gen.is_eos(params.seed, ctx):
                    stream._new_ids.append(EOS_ID)
                    self._end(stream, "stop", None, engine_done)
                    break
                token = gen.next_token(params.seed, ctx)
                ctx.append(token)
                stream._new_ids.append(token)
                stop = stream._push_text(piece(token))
                if stop is not None:
                    self._end(stream, "stop", stop, engine_done)
                    break
                if token in params.stop_token_ids and stream.completion_tokens > params.min_tokens:
                    self._end(stream, "stop", token, engine_done)
                    break
            if not stream.finished:
                stream._ready.set()
        for rid, reason in result.finished:
            stream = streams.pop(rid, None)
            if stream is None:
                continue
            stream._finish(reason)
            self._record_finished(stream)
        if generated:
            self._metrics.generated(generated)
        self._publish_step_metrics(result)

    def _end(
        self,
        stream: Stream,
        reason: str,
        stop_reason: str | int | None,
        engine_done: Mapping[str, str],
    ) -> None:
        """Finish a request on EOS / stop string / stop token (vLLM: length wins)."""
        if stream.engine_id in engine_done:
            reason = engine_done[stream.engine_id]
            stop_reason = None if reason == "length" else stop_reason
        else:
            self._engine.finish(stream.engine_id)
        self._streams.pop(stream.engine_id, None)
        stream._finish(reason, stop_reason)
        self._record_finished(stream)

    def _record_finished(self, stream: Stream) -> None:
        self._unscheduled.pop(stream.engine_id, None)
        now = self.now_s()
        first = stream.first_token_s
        sched = stream.scheduled_s
        queue_s = (sched if sched is not None else now) - stream.arrival_s
        prefill_s = 0.0
        decode_s = 0.0
        if first is not None:
            prefill_s = max(0.0, first - (sched if sched is not None else stream.arrival_s))
            decode_s = (stream.last_token_s or first) - first
        reason = stream.finish_reason or "abort"
        self._metrics.finished(
            FinishedRequestStats(
                finish_reason=reason if reason in ("stop", "length", "abort") else "abort",
                e2e_s=now - stream.arrival_s,
                queue_s=queue_s,
                prefill_s=prefill_s,
                decode_s=decode_s,
                prompt_tokens=stream.prompt_len,
                generation_tokens=stream.completion_tokens,
                max_tokens=stream.params.max_tokens,
            )
        )

    def _note_scheduled(self, t: float) -> None:
        """Record when waiting requests were first scheduled (for the queue-time metric)."""
        if not self._unscheduled:
            return
        inspect = self._engine.inspect
        started = [
            s
            for s in self._unscheduled.values()
            if (view := inspect(s.engine_id)) is None or view.state is not RequestState.WAITING
        ]
        for s in started:
            s.scheduled_s = t - self._last_duration
            del self._unscheduled[s.engine_id]

    def _publish_step_metrics(self, result: StepResult) -> None:
        stats = self._engine.stats()
        last = self._last_stats
        self._last_stats = stats
        self._metrics.record_step(
            running=stats.running,
            waiting=stats.waiting,
            kv_usage=stats.kv_usage,
            prefix_queries=stats.prefix_cache_queries - last.prefix_cache_queries,
            prefix_hits=stats.prefix_cache_hits - last.prefix_cache_hits,
            preemptions=stats.preemptions - last.preemptions,
            step_tokens=result.num_tokens,
        )

    def _publish_queue_sizes(self) -> None:
        stats = self._engine.stats()
        self._metrics.record_queue_sizes(stats.running, stats.waiting)
