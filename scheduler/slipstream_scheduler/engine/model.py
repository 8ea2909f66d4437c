"""A vLLM v1 engine in virtual time: scheduling, KV blocks, prefix cache, step times.

The caller owns time: :meth:`EngineModel.step` runs one iteration and says how
long it took (from :mod:`slipstream_scheduler.engine.gpu`, or from a batch-latency
model given as ``timing_model``: :mod:`slipstream_scheduler.engine.steptiming`); the
simulator adds that to its virtual clock, the real-time engine server sleeps for it.

Scheduling follows ``vllm/v1/core/sched/scheduler.py`` (``schedule``):

1. RUNNING requests in admission order, each taking ``min(tokens left,
   long_prefill_token_threshold, token budget)`` (the threshold is off while only one
   request is running or waiting, and floored at ``max_num_batched_tokens // (running +
   waiting)`` with ``long_prefill_token_threshold_adaptive``). If its KV blocks cannot be
   allocated, a victim is preempted by recompute (priority policy: the worst
   ``(priority, arrival)`` running request; FCFS: the last admitted). A victim
   already scheduled this step gives its tokens back. If the victim is the
   request itself, the loop stops (vLLM 0.32); with
   ``priority_walk_past_self_preemption`` (vLLM 0.33, priority policy) it goes on
   to the requests after it.
2. WAITING requests (by ``(priority, arrival)`` or FCFS with preempted requests
   in front) only if nothing was preempted this step, while the token budget
   and ``max_num_seqs`` allow and their blocks fit (no preemption for them;
   with ``scheduler_reserve_full_isl``, vLLM's default, the blocks of the whole
   sequence must fit, not just the first chunk's). A new request's leading full
   blocks whose hashes are cached count as computed (at most ``prompt - 1``
   tokens); a block is hashed when it is allocated, so requests admitted later
   in the same step already hit the blocks scheduled before them.
3. Every request whose computed tokens reach its token count emits one token.

Hot path (NOTE: this is where the code is bent for speed, not semantics): a
request in steady decode ("decoder") is not touched every step. Its generated
count is ``tick - gbase``; the steps at which it needs a new block and at which
it finishes sit in calendars keyed by tick; context sums are kept as running
aggregates. A step walks only the prefilling requests and the calendar entries
due. When the walk cannot be decided in aggregate (KV shortage and preemption,
or a token budget that runs out before the last decoder), the step falls back
to the exact per-request walk, which materialises every decoder and rebuilds
the aggregates afterwards. Both paths give identical results
(``path="reference"`` materialises everything every step; the tests compare
all three).

Deliberately left out: speculative decoding, structured output, multimodal
encoders, LoRA, pipeline parallel and async scheduling, swap-based preemption,
and the ``max_model_len`` rejection at the API (requests are capped instead).
"""

from __future__ import annotations

import enum
import heapq
import logging
import math
import random
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from sortedcontainers import SortedList

from slipstream_scheduler.engine.errors import RequestError
from slipstream_scheduler.engine.gpu import GpuProfile, GpuTimingModel, load_profile
from slipstream_scheduler.engine.kvcache import KvBlockPool
from slipstream_scheduler.engine.steptiming import LatencyStepTiming
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.types import BatchItem, EngineLimits, Phase

logger = logging.getLogger(__name__)

FinishReason = Literal["length", "stop", "abort"]


class EngineConfig(BaseModel):
    """One engine's static configuration (vLLM's engine args that matter here)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(
        default="llama-2-7b", description="GPU-profile model name; default llama-2-7b"
    )
    gpu: str = Field(default="a100", description="GPU-profile GPU name (a100, h100); default a100")
    policy: Literal["fcfs", "priority"] = Field(
        default="priority",
        description="vLLM --scheduling-policy; default priority (Slipstream runs vLLM with it)",
    )
    max_num_seqs: int = Field(default=256, ge=1, description="running requests cap; default 256")
    max_num_batched_tokens: int = Field(
        default=2048, ge=1, description="tokens per step (token budget); default 2048"
    )
    block_size: int = Field(default=16, ge=1, description="tokens per KV block; default 16")
    long_prefill_token_threshold: int = Field(
        default=0, ge=0, description="per-request chunk cap in tokens; 0 = none (default)"
    )
    long_prefill_token_threshold_adaptive: bool = Field(
        default=False,
        description="vLLM --long-prefill-token-threshold-adaptive: floor the cap at "
        "max_num_batched_tokens // (running + waiting); default false",
    )
    enable_chunked_prefill: bool = Field(default=True, description="default true (vLLM v1)")
    scheduler_reserve_full_isl: bool = Field(
        default=True,
        description="vLLM --scheduler-reserve-full-isl: admit a waiting request only if its "
        "whole sequence fits in the free KV blocks, not just its first chunk; default true",
    )
    enable_prefix_caching: bool = Field(default=True, description="default true (vLLM v1)")
    priority_walk_past_self_preemption: bool = Field(
        default=False,
        description="vLLM >= 0.33 under the priority policy: when the running request being "
        "scheduled is itself the lowest-priority victim, the walk goes on to the requests after "
        "it, which may fit in the blocks it freed; vLLM 0.32 stops the walk there (default)",
    )
    num_gpu_blocks: int | None = Field(
        default=None,
        ge=1,
        description="KV blocks; default None = sized from GPU memory like vLLM",
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="fraction of GPU memory vLLM may use; 0.9"
    )
    max_model_len: int | None = Field(
        default=None, ge=2, description="cap on prompt + output tokens; default None = no cap"
    )
    noise_cv: float = Field(
        default=0.01,
        ge=0.0,
        le=0.5,
        description="log-normal step-time noise (sigma, ~coefficient of variation); 0.01",
    )
    async_scheduling: bool = Field(
        default=False,
        description="vLLM's async scheduling: a step's host work (the GPU profile's per-step "
        "and per-sequence overhead, plus scheduler_overhead_*) overlaps the device's, so a "
        "step takes the longer of the two instead of their sum; default false (the profiles' "
        "calibration)",
    )
    scheduler_overhead_s: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="host time a scheduler plugin adds to every step, seconds; default 0",
    )
    scheduler_overhead_per_seq_s: float = Field(
        default=0.0, ge=0.0, le=0.01,
        description="host time a scheduler plugin adds per scheduled sequence, seconds; "
        "default 0",
    )
    path: Literal["auto", "walk", "reference"] = Field(
        default="auto",
        description="step implementation: auto (aggregate plan, walk when needed; default), "
        "walk (always the per-request walk), reference (materialise everything; test oracle)",
    )

    def limits(self) -> EngineLimits:
        return EngineLimits(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.block_size,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            reserve_full_sequence=self.scheduler_reserve_full_isl,
        )


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request as the engine receives it.

    ``block_hashes``: one chained hash per full ``block_size``-token block of the
    prompt (empty: nothing shared). ``output_len``: stop after this many tokens
    (trace replay, reason ``stop``); None: run to ``max_tokens`` or :meth:`finish`.
    """

    request_id: str
    prompt_len: int
    max_tokens: int
    priority: int = 0
    arrival_s: float = 0.0
    block_hashes: tuple[Hashable, ...] = ()
    output_len: int | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters and gauges, named after vLLM's metrics where one exists."""

    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    preemptions: int
    prompt_tokens: int  # prompt tokens of admitted requests (first admission)
    computed_prefill_tokens: int  # prefill tokens actually computed (recompute included)
    generation_tokens: int
    steps: int
    finished: int

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class RequestState(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    DONE = 2


@dataclass(frozen=True, slots=True)
class RequestView:
    """A read-only look at one request (tests, debugging, the HTTP server's metrics)."""

    state: RequestState
    computed_tokens: int
    generated_tokens: int
    num_blocks: int
    preemptions: int


class StepResult:
    """What one iteration did. ``batch`` is built on first access (it is O(batch))."""

    __slots__ = (
        "_batch",
        "_dec_base",
        "_dec_ctx",
        "_explicit",
        "duration_s",
        "emitted",
        "finished",
        "num_tokens",
        "preempted",
    )

    def __init__(
        self,
        *,
        duration_s: float,
        emitted: tuple[tuple[str, int], ...],
        finished: tuple[tuple[str, FinishReason], ...],
        preempted: tuple[str, ...],
        num_tokens: int,
        explicit: list[BatchItem],
        dec_ctx: tuple[int, ...],
        dec_base: int,
    ) -> None:
        self.duration_s = duration_s
        self.emitted = emitted
        self.finished = finished
        self.preempted = preempted
        self.num_tokens = num_tokens
        self._explicit = explicit
        self._dec_ctx = dec_ctx
        self._dec_base = dec_base
        self._batch: tuple[BatchItem, ...] | None = None

    @property
    def batch(self) -> tuple[BatchItem, ...]:
        """The iteration's work, one item per scheduled request (latency-model input)."""
        if self._batch is None:
            decode, base = Phase.DECODE, self._dec_base
            self._batch = (
                *(BatchItem(decode, 1, base + off) for off in self._dec_ctx),
                *self._explicit,
            )
        return self._batch

    def __repr__(self) -> str:
        return (
            f"StepResult(duration_s={self.duration_s:.6f}, tokens={self.num_tokens}, "
            f"emitted={len(self.emitted)}, finished={self.finished}, preempted={self.preempted})"
        )


class _Req:
    """Mutable engine-side state of one request."""

    __slots__ = (
        "adm",
        "arrival",
        "blocks",
        "computed",
        "dec",
        "first_admit",
        "gbase",
        "generated",
        "hashes",
        "limit",
        "next_block_tick",
        "npreempt",
        "nreg",
        "priority",
        "prompt",
        "reason",
        "rid",
        "sched",
        "sched_step",
        "seq",
        "state",
    )

    def __init__(self, req: EngineRequest, seq: int, limit: int, reason: FinishReason) -> None:
        self.rid = req.request_id
        self.prompt = req.prompt_len
        self.priority = req.priority
        self.arrival = req.arrival_s
        self.hashes = req.block_hashes
        self.limit = limit
        self.reason: FinishReason = reason
        self.seq = seq
        self.adm = -1
        self.state = RequestState.WAITING
        self.computed = 0
        self.generated = 0
        self.blocks: list[Hashable | None] = []
        self.dec = False
        self.gbase = 0
        self.next_block_tick = 0
        self.sched = 0
        self.sched_step = -1
        self.npreempt = 0
        self.nreg = 0
        self.first_admit = True


def _by_adm(r: _Req) -> int:
    return r.adm


class EngineModel:
    """One vLLM v1 engine (see the module docstring). Pure: no clock, seeded noise.

    Steps are timed by the GPU ``profile`` (default: the shipped one of ``config.model``
    on ``config.gpu``), or, with ``timing_model``, by that batch-latency model: then no
    GPU profile is loaded, ``config.noise_cv`` is the model's residual spread and
    ``config.num_gpu_blocks`` must size the KV cache.
    """

    def __init__(
        self,
        config: EngineConfig,
        seed: int = 0,
        *,
        profile: GpuProfile | None = None,
        timing_model: LinearLatencyModel | None = None,
    ) -> None:
        self.config = config
        self.limits = config.limits()
        self._gpu: GpuTimingModel | None = None
        self._latency: LatencyStepTiming | None = None
        if timing_model is None:
            self._gpu = GpuTimingModel(profile or load_profile(config.model, config.gpu))
            blocks = config.num_gpu_blocks or self._gpu.kv_capacity_blocks(
                config.block_size, config.gpu_memory_utilization
            )
        else:
            blocks = _latency_timed_blocks(config, profile)
            self._latency = LatencyStepTiming(timing_model)
        if blocks < 1:
            raise ValueError("the GPU has no room for KV blocks with this model")
        self.pool = KvBlockPool(blocks)
        self._rng = random.Random(seed)
        self._bs = config.block_size
        self._thr = config.long_prefill_token_threshold
        self._prio = config.policy == "priority"
        self._walk_past_self = self._prio and config.priority_walk_past_self_preemption
        self._cache = config.enable_prefix_caching
        self._reqs: dict[str, _Req] = {}
        self._running: list[_Req] = []  # admission order
        self._prefilling: list[_Req] = []  # running, not decoders, admission order
        self._waiting_heap: list[tuple[int, float, int, _Req]] = []
        self._waiting_fifo: deque[_Req] = deque()
        self._n_waiting = 0
        self._seq = 0
        self._adm = 0
        # decoders (see module docstring)
        self._tick = 0
        self._dec: dict[str, _Req] = {}
        self._dec_adm: SortedList = SortedList()
        self._dec_pairs: dict[str, tuple[str, int]] = {}
        self._dec_off: dict[str, int] = {}  # rid -> context - tick  (prompt - 1 - gbase)
        self._dec_off_sum = 0
        self._cal_block: dict[int, list[_Req]] = {}
        self._cal_fin: dict[int, list[_Req]] = {}
        self._pending_finished: list[tuple[str, FinishReason]] = []
        # stats
        self._q_tokens = self._hit_tokens = self._preemptions = 0
        self._prompt_tokens = self._prefill_computed = self._gen_tokens = 0
        self._steps = self._finished = 0
        self.step_log: list[dict[str, int]] | None = None
        """Set to a list to keep every step's tokens scheduled per request (the fidelity
        bench compares them with vLLM's); None (default) costs nothing."""

    # ------------------------------------------------------------------ public API

    @property
    def timing(self) -> GpuTimingModel:
        """The GPU timing model of the profile (ValueError when steps are timed by a
        latency model: there is no GPU profile then)."""
        if self._gpu is None:
            raise ValueError("this engine times its steps with a latency model; no GPU profile")
        return self._gpu

    @property
    def timing_model(self) -> LinearLatencyModel | None:
        """The batch-latency model timing the steps, or None (the GPU profile does)."""
        return None if self._latency is None else self._latency.model

    def add(self, request: EngineRequest) -> None:
        """Queue a request (it joins the waiting queue)."""
        rid = request.request_id
        if rid in self._reqs:
            raise RequestError(rid, "duplicate request id")
        if request.prompt_len < 1 or request.max_tokens < 1:
            raise RequestError(rid, "prompt_len and max_tokens must be >= 1")
        limit = request.max_tokens
        reason: FinishReason = "length"
        if request.output_len is not None:
            if request.output_len < 1:
                raise RequestError(rid, "output_len must be >= 1")
            if request.output_len <= limit:
                limit, reason = request.output_len, "stop"
        cap = self.config.max_model_len
        if cap is not None:
            if request.prompt_len >= cap:
                raise RequestError(rid, f"prompt of {request.prompt_len} >= max_model_len {cap}")
            if cap - request.prompt_len < limit:
                limit, reason = cap - request.prompt_len, "length"
        # NOTE: vLLM refuses to start if max_model_len does not fit in the KV cache; here
        # the cache bounds every request instead, so a lone request can always finish.
        room = self.pool.num_blocks * self._bs
        if request.prompt_len >= room:
            raise RequestError(rid, f"prompt of {request.prompt_len} exceeds the KV cache")
        if room - request.prompt_len < limit:
            limit, reason = room - request.prompt_len, "length"
        full = request.prompt_len // self._bs
        if len(request.block_hashes) > full:
            request = EngineRequest(
                rid,
                request.prompt_len,
                request.max_tokens,
                request.priority,
                request.arrival_s,
                request.block_hashes[:full],
                request.output_len,
            )
        r = _Req(request, self._seq, limit, reason)
        self._seq += 1
        self._reqs[rid] = r
        self._push_waiting(r, front=False)

    def abort(self, request_id: str) -> bool:
        """The client went away: free the request. Reported as ``abort`` by the next step."""
        return self._end_external(request_id, "abort")

    def finish(self, request_id: str) -> bool:
        """The caller's generator hit EOS: free the request. Reported as ``stop`` next step."""
        return self._end_external(request_id, "stop")

    def has_work(self) -> bool:
        return bool(self._running) or self._n_waiting > 0 or bool(self._pending_finished)

    def stats(self) -> EngineStats:
        pool = self.pool
        return EngineStats(
            running=len(self._running),
            waiting=self._n_waiting,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_blocks - pool.free,
            prefix_cache_queries=self._q_tokens,
            prefix_cache_hits=self._hit_tokens,
            preemptions=self._preemptions,
            prompt_tokens=self._prompt_tokens,
            computed_prefill_tokens=self._prefill_computed,
            generation_tokens=self._gen_tokens,
            steps=self._steps,
            finished=self._finished,
        )

    def measure(self, batch: Sequence[BatchItem]) -> float:
        """Seconds to run exactly ``batch`` once on this engine's GPU, noise included.

        What a GPU profiler does with a synthetic batch; touches no request state.
        """
        if not batch:
            return 0.0
        if self._latency is not None:
            return self._noisy(max(0.0, self._latency.model.predict(batch)))
        return self._noisy(self.timing.predict(batch))

    def inspect(self, request_id: str) -> RequestView | None:
        """The request's current state, or None once it is finished and forgotten."""
        r = self._reqs.get(request_id)
        if r is None:
            return None
        self._materialize(r)
        return RequestView(r.state, r.computed, r.generated, len(r.blocks), r.npreempt)

    def step(self, now_s: float = 0.0) -> StepResult:
        """Run one iteration. ``now_s`` is only informational (the caller owns time)."""
        del now_s
        self._steps += 1
        finished = self._pending_finished
        self._pending_finished = []
        self._thr = self._step_threshold()
        path = self.config.path
        if path == "reference":
            return self._step_exact(finished)
        plan = self._plan_fast() if path == "auto" else None
        if plan is None:
            return self._step_walk(finished)
        return self._step_fast(plan, finished)

    def _step_threshold(self) -> int:
        """This step's chunk cap, as vLLM's ``schedule()`` derives it: none when only one
        request is running or waiting (nobody to starve), floored at a fair share of the
        token budget when the adaptive threshold is on."""
        thr = self.config.long_prefill_token_threshold
        if thr <= 0:
            return 0
        eligible = len(self._running) + self._n_waiting
        if eligible <= 1:
            return 0
        if self.config.long_prefill_token_threshold_adaptive:
            thr = max(thr, self.limits.max_num_batched_tokens // eligible)
        return thr

    # ------------------------------------------------------------------ waiting queue

    def _push_waiting(self, r: _Req, front: bool) -> None:
        r.state = RequestState.WAITING
        self._n_waiting += 1
        if self._prio:
            heapq.heappush(self._waiting_heap, (r.priority, r.arrival, r.seq, r))
        elif front:
            self._waiting_fifo.appendleft(r)
        else:
            self._waiting_fifo.append(r)

    def _peek_waiting(self) -> _Req | None:
        if self._prio:
            heap = self._waiting_heap
            while heap and heap[0][3].state is not RequestState.WAITING:
                heapq.heappop(heap)
            return heap[0][3] if heap else None
        fifo = self._waiting_fifo
        while fifo and fifo[0].state is not RequestState.WAITING:
            fifo.popleft()
        return fifo[0] if fifo else None

    def _start(self, r: _Req, hit_keys: list[Hashable], need: int, num_tokens: int) -> None:
        """Move a waiting request into the running batch: reuse its prefix-cache
        hit (``hit_keys``), take ``need`` fresh blocks, count its cache use. The
        caller has taken it off the waiting queue and checked the blocks fit."""
        pool = self.pool
        pool.touch(hit_keys)
        pool.take(need)
        hit = len(hit_keys) * self._bs
        r.blocks = [*hit_keys, *([None] * need)]
        r.nreg = len(hit_keys)
        r.computed = hit
        if self._cache:
            self._q_tokens += num_tokens
            self._hit_tokens += hit
        if r.first_admit:
            self._prompt_tokens += r.prompt
            r.first_admit = False
        r.state = RequestState.RUNNING
        r.adm = self._adm
        self._adm += 1
        self._running.append(r)
        self._prefilling.append(r)

    def _pop_waiting(self) -> None:
        self._n_waiting -= 1
        if self._prio:
            heapq.heappop(self._waiting_heap)
        else:
            self._waiting_fifo.popleft()

    # ------------------------------------------------------------------ blocks

    def _key(self, r: _Req, i: int) -> Hashable:
        return r.hashes[i] if i < len(r.hashes) else (r.rid, i)

    def _register_full(self, r: _Req, upto_tokens: int, synthetic: bool) -> None:
        """Hash the blocks that ``upto_tokens`` computed tokens fill.

        NOTE: vLLM hashes every full block when it is scheduled. Only the
        caller's prompt hashes can be hit by another request, so blocks past
        them (keyed ``(request_id, index)``) are hashed only when the request is
        preempted (``synthetic=True``): its resumption is the only possible hit.
        That is unobservable and saves most of the per-block work.
        """
        if not self._cache:
            return
        blocks = r.blocks
        full = min(upto_tokens // self._bs, len(blocks))
        if not synthetic:
            full = min(full, len(r.hashes))
        if full <= r.nreg:
            return
        pool = self.pool
        for j in range(r.nreg, full):
            if blocks[j] is None:
                key = self._key(r, j)
                if pool.register(key):
                    blocks[j] = key
        r.nreg = full

    def _release(self, r: _Req, preempting: bool = False) -> None:
        if preempting:
            self._register_full(r, r.computed, synthetic=True)
        self.pool.release(r.blocks, r.computed // self._bs if self._cache else 0)
        r.blocks = []
        r.nreg = 0

    # ------------------------------------------------------------------ decoders

    def _make_decoder(self, r: _Req, next_tick: int) -> None:
        """Turn an explicit running request with one pending token into a decoder."""
        r.dec = True
        r.gbase = next_tick - r.generated
        rid = r.rid
        self._dec[rid] = r
        self._dec_adm.add(r.adm)
        self._dec_pairs[rid] = (rid, 1)
        off = r.prompt - 1 - r.gbase
        self._dec_off[rid] = off
        self._dec_off_sum += off
        # Token at context c needs a new block when c == bs * nblocks.
        tick = self._bs * len(r.blocks) - r.prompt + 1 + r.gbase
        r.next_block_tick = tick
        self._cal_block.setdefault(tick, []).append(r)
        self._cal_fin.setdefault(r.limit - 1 + r.gbase, []).append(r)

    def _materialize(self, r: _Req) -> None:
        if r.dec:
            g = self._tick - r.gbase
            r.generated = g
            r.computed = r.prompt + g - 1

    def _drop_decoder(self, r: _Req) -> None:
        """Materialise ``r`` and take it out of the decoder aggregates."""
        self._materialize(r)
        r.dec = False
        rid = r.rid
        del self._dec[rid]
        self._dec_adm.remove(r.adm)
        del self._dec_pairs[rid]
        self._dec_off_sum -= self._dec_off.pop(rid)

    def _devirtualize_all(self) -> None:
        for r in self._dec.values():
            self._materialize(r)
            r.dec = False
        self._dec.clear()
        self._dec_adm.clear()
        self._dec_pairs.clear()
        self._dec_off.clear()
        self._dec_off_sum = 0
        self._cal_block.clear()
        self._cal_fin.clear()

    # ------------------------------------------------------------------ ending requests

    def _end_external(self, rid: str, reason: FinishReason) -> bool:
        r = self._reqs.get(rid)
        if r is None or r.state is RequestState.DONE:
            return False
        if r.state is RequestState.WAITING:
            self._n_waiting -= 1  # lazily removed from the queue
        else:
            self._remove_running(r)
        self._done(r)
        self._pending_finished.append((rid, reason))
        return True

    def _remove_running(self, r: _Req) -> None:
        if r.dec:
            self._drop_decoder(r)
        else:
            self._prefilling.remove(r)
        self._running.remove(r)
        self._release(r)

    def _done(self, r: _Req) -> None:
        r.state = RequestState.DONE
        del self._reqs[r.rid]
        self._finished += 1

    # ------------------------------------------------------------------ admission

    def _admit_waiting(self, budget: int, out: list[tuple[_Req, int]]) -> int:
        """vLLM's WAITING loop; appends ``(request, chunk)`` to ``out``; returns the budget."""
        bs, thr, pool = self._bs, self._thr, self.pool
        max_seqs = self.limits.max_num_seqs
        chunked = self.config.enable_chunked_prefill
        full_isl = self.config.scheduler_reserve_full_isl
        cache = self._cache
        if cache:
            # vLLM hashes a block when it is allocated, so a request admitted later in this
            # step hits the blocks the requests scheduled before it fill in this same step.
            for q, m in out:
                self._register_full(q, q.computed + m, synthetic=False)
        while budget > 0 and len(self._running) < max_seqs:
            r = self._peek_waiting()
            if r is None:
                break
            num_tokens = r.prompt + r.generated
            hit_keys: list[Hashable] = []
            evictable = 0
            if self._cache:
                max_hit = (num_tokens - 1) // bs
                if r.npreempt == 0:
                    # Never computed: only the caller's prompt hashes can be cached.
                    keys = list(r.hashes[:max_hit])
                else:
                    keys = [self._key(r, i) for i in range(max_hit)]
                nhit, evictable = pool.longest_hit(keys)
                hit_keys = keys[:nhit]
            hit = len(hit_keys) * bs
            n = num_tokens - hit
            if 0 < thr < n:
                n = thr
            if not chunked and n > budget:
                break
            n = min(n, budget)
            need = -(-(hit + n) // bs) - len(hit_keys)
            if need > pool.free - evictable:
                break
            if full_isl and -(-num_tokens // bs) - len(hit_keys) > pool.free - evictable:
                break
            self._pop_waiting()
            self._start(r, hit_keys, need, num_tokens)
            out.append((r, n))
            budget -= n
            if cache:
                self._register_full(r, r.computed + n, synthetic=False)
        return budget

    # ------------------------------------------------------------------ fast path

    def _plan_fast(self) -> tuple[list[tuple[_Req, int]], list[_Req], int] | None:
        """Decide the RUNNING walk in aggregate, or None if only the exact walk can."""
        budget = self.limits.max_num_batched_tokens
        thr, bs = self._thr, self._bs
        n_dec = len(self._dec)
        dec_adm = self._dec_adm
        cum = 0
        need_blocks = 0
        chunks: list[tuple[_Req, int]] = []
        for r in self._prefilling:
            if n_dec:
                before = dec_adm.bisect_left(r.adm)
                here = before - cum
                if here > budget:
                    return None
                budget -= here
                cum = before
            if budget == 0:
                if n_dec > cum:
                    return None
                break
            n = r.prompt + r.generated - r.computed
            if 0 < thr < n:
                n = thr
            n = min(n, budget)
            chunks.append((r, n))
            need_blocks += -(-(r.computed + n) // bs) - len(r.blocks)
            budget -= n
        rest = n_dec - cum
        if rest > budget:
            return None
        budget -= rest
        tick = self._tick
        due = [r for r in self._cal_block.pop(tick, ()) if r.dec and r.next_block_tick == tick]
        if need_blocks + len(due) > self.pool.free:
            return None
        return chunks, due, budget

    def _step_fast(
        self,
        plan: tuple[list[tuple[_Req, int]], list[_Req], int],
        finished: list[tuple[str, FinishReason]],
    ) -> StepResult:
        chunks, due, budget = plan
        pool, bs, tick = self.pool, self._bs, self._tick
        for r, n in chunks:
            need = -(-(r.computed + n) // bs) - len(r.blocks)
            if need > 0:
                pool.take(need)
                r.blocks.extend([None] * need)
        cal = self._cal_block
        if due:
            pool.take(len(due))
        for r in due:
            r.blocks.append(None)
            nxt = tick + bs
            r.next_block_tick = nxt
            cal.setdefault(nxt, []).append(r)
        self._admit_waiting(budget, chunks)
        if self.step_log is not None:
            self.step_log.append({**dict.fromkeys(self._dec, 1), **{r.rid: n for r, n in chunks}})
        n_dec = len(self._dec)
        emitted_dec = tuple(self._dec_pairs.values())
        dec_ctx = tuple(self._dec_off.values())
        dec_kv = n_dec * (tick + 1) + self._dec_off_sum
        explicit, emitted_x, pairs, tokens, kv_x, done, new_dec = self._apply_chunks(chunks)
        # Decoders whose last token is this one.
        for r in self._cal_fin.pop(tick, ()):
            if r.dec and r.limit - 1 + r.gbase == tick:
                self._drop_decoder(r)  # materialises generated = limit - 1
                r.generated += 1
                r.computed += 1
                done.append(r)
        if done:
            done.sort(key=_by_adm)
            prefilling = self._prefilling
            for r in done:
                if r in prefilling:
                    prefilling.remove(r)
                self._running.remove(r)
                self._release(r)
                self._done(r)
                finished.append((r.rid, r.reason))
        self._tick = tick + 1
        for r in new_dec:
            self._prefilling.remove(r)
            self._make_decoder(r, tick + 1)
        self._gen_tokens += n_dec + len(emitted_x)
        duration = self._duration(
            tokens + n_dec, n_dec + len(chunks), pairs, dec_kv + kv_x, explicit
        )
        emitted = emitted_dec + tuple(emitted_x) if emitted_x else emitted_dec
        return StepResult(
            duration_s=duration,
            emitted=emitted,
            finished=tuple(finished),
            preempted=(),
            num_tokens=tokens + n_dec,
            explicit=explicit,
            dec_ctx=dec_ctx,
            dec_base=tick,
        )

    def _apply_chunks(
        self, chunks: list[tuple[_Req, int]]
    ) -> tuple[list[BatchItem], list[tuple[str, int]], float, int, int, list[_Req], list[_Req]]:
        """Run the explicit (non-decoder) work of the step.

        Returns the batch items, their emissions, the prefill attention pairs,
        the token count, the decode KV tokens, the requests that finished and
        the ones that turn into decoders. Lists are left to the caller.
        """
        items: list[BatchItem] = []
        emitted: list[tuple[str, int]] = []
        done: list[_Req] = []
        new_dec: list[_Req] = []
        pairs = 0.0
        tokens = kv = 0
        for r, n in chunks:
            ctx = r.computed
            num_tokens = r.prompt + r.generated
            if n == 1 and r.generated >= 1 and num_tokens - ctx == 1:
                items.append(BatchItem(Phase.DECODE, 1, ctx))
                kv += ctx + 1
            else:
                items.append(BatchItem(Phase.PREFILL, n, ctx))
                pairs += n * (ctx + (n + 1) / 2.0)
                self._prefill_computed += n
            tokens += n
            r.computed = ctx + n
            self._register_full(r, r.computed, synthetic=False)
            if r.computed == num_tokens:
                r.generated += 1
                emitted.append((r.rid, 1))
                (done if r.generated >= r.limit else new_dec).append(r)
        return items, emitted, pairs, tokens, kv, done, new_dec

    def _duration(
        self, tokens: int, seqs: int, pairs: float, dec_kv: int, explicit: Sequence[BatchItem]
    ) -> float:
        """The step's time, noise included. ``explicit``: the items walked one by one; the
        other ``seqs - len(explicit)`` sequences are steady decoders (one token each)."""
        c = self.config
        latency = self._latency
        overlap = c.async_scheduling
        extra = (c.scheduler_overhead_s + c.scheduler_overhead_per_seq_s * seqs) if seqs else 0.0
        if latency is not None:  # no device/host split: the whole step is the device's
            device, host = latency.step_time(explicit, seqs, dec_kv), 0.0
        else:
            gpu = self._gpu
            assert gpu is not None
            if not overlap and not extra:
                return self._noisy(gpu.step_time(tokens, seqs, pairs, dec_kv))
            device, host = gpu.step_parts(tokens, seqs, pairs, dec_kv)
        host += extra
        return self._noisy(max(device, host) if overlap else device + host)

    def _noisy(self, base: float) -> float:
        sigma = self.config.noise_cv
        if sigma > 0.0 and base > 0.0:
            base *= math.exp(self._rng.gauss(0.0, sigma) - 0.5 * sigma * sigma)
        return base

    # ------------------------------------------------------------------ exact path

    def _victim(self) -> _Req:
        if self._prio:
            return max(self._running, key=lambda q: (q.priority, q.arrival, q.seq))
        return self._running[-1]

    def _step_exact(self, finished: list[tuple[str, FinishReason]]) -> StepResult:
        self._devirtualize_all()
        self._prefilling = []
        pool, bs, thr = self.pool, self._bs, self._thr
        budget = self.limits.max_num_batched_tokens
        running = self._running
        scheduled: list[tuple[_Req, int]] = []
        preempted: list[str] = []
        for r in running:
            r.sched = 0
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = r.prompt + r.generated - r.computed
            if 0 < thr < n:
                n = thr
            n = min(n, budget)
            if n <= 0:
                i += 1
                continue
            ok = True
            while True:
                need = -(-(r.computed + n) // bs) - len(r.blocks)
                if need <= pool.free:
                    break
                victim = self._victim()
                vi = running.index(victim)
                running.pop(vi)
                if victim.sched:
                    budget += victim.sched
                    victim.sched = 0
                    scheduled = [(q, m) for q, m in scheduled if q is not victim]
                if vi < i:
                    i -= 1
                self._preempt(victim)
                preempted.append(victim.rid)
                if victim is r:
                    ok = False
                    break
            if not ok:
                if self._walk_past_self:
                    continue  # r left ``running``: ``i`` is already the next request
                break
            if need > 0:
                pool.take(need)
                r.blocks.extend([None] * need)
            r.sched = n
            scheduled.append((r, n))
            budget -= n
            i += 1
        self._prefilling = []
        if not preempted:
            self._admit_waiting(budget, scheduled)
        if self.step_log is not None:
            self.step_log.append({r.rid: n for r, n in scheduled})
        items, emitted, pairs, tokens, kv, done, _ = self._apply_chunks(scheduled)
        for r in done:  # already in admission order
            self._running.remove(r)
            self._release(r)
            self._done(r)
            finished.append((r.rid, r.reason))
        self._tick += 1
        # Everyone left with exactly one pending token and some output is a decoder again.
        keep: list[_Req] = []
        for r in self._running:
            if r.generated >= 1 and r.prompt + r.generated - r.computed == 1:
                self._make_decoder(r, self._tick)
            else:
                keep.append(r)
        self._prefilling = keep
        self._gen_tokens += len(emitted)
        duration = self._duration(tokens, len(scheduled), pairs, kv, items)
        return StepResult(
            duration_s=duration,
            emitted=tuple(emitted),
            finished=tuple(finished),
            preempted=tuple(preempted),
            num_tokens=tokens,
            explicit=items,
            dec_ctx=(),
            dec_base=0,
        )

    def _step_walk(self, finished: list[tuple[str, FinishReason]]) -> StepResult:
        """vLLM's RUNNING walk, one request at a time, with decoders kept virtual.

        Used when the aggregate plan cannot decide the step (preemption, or a
        budget that runs out before the last decoder). O(running) per step.
        """
        pool, bs, thr, tick, step = self.pool, self._bs, self._thr, self._tick, self._steps
        self._cal_block.pop(tick, None)  # due-ness is read from next_block_tick below
        budget = self.limits.max_num_batched_tokens
        running = self._running
        scheduled: list[tuple[_Req, int]] = []
        dec_sched: list[_Req] = []
        preempted: list[str] = []
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            if r.dec:
                n = 1
                need = 1 if r.next_block_tick == tick else 0
            else:
                n = r.prompt + r.generated - r.computed
                if 0 < thr < n:
                    n = thr
                n = min(n, budget)
                need = -(-(r.computed + n) // bs) - len(r.blocks)
            ok = True
            while need > pool.free:
                victim = self._victim()
                vi = running.index(victim)
                running.pop(vi)
                if victim.sched_step == step:
                    budget += victim.sched
                    if victim.dec:
                        dec_sched.remove(victim)
                    else:
                        scheduled = [(q, m) for q, m in scheduled if q is not victim]
                if vi < i:
                    i -= 1
                if victim.dec:
                    self._drop_decoder(victim)
                else:
                    self._prefilling.remove(victim)
                self._preempt(victim)
                preempted.append(victim.rid)
                if victim is r:
                    ok = False
                    break
            if not ok:
                if self._walk_past_self:
                    continue  # r left ``running``: ``i`` is already the next request
                break
            if need > 0:
                pool.take(need)
                r.blocks.extend([None] * need)
            r.sched = n
            r.sched_step = step
            if r.dec:
                dec_sched.append(r)
                if need:
                    nxt = tick + bs
                    r.next_block_tick = nxt
                    self._cal_block.setdefault(nxt, []).append(r)
            else:
                scheduled.append((r, n))
            budget -= n
            i += 1
        # Decoders the walk did not reach wait one tick: shift their virtual clocks.
        for r in running:
            if r.dec and r.sched_step != step:
                self._shift_decoder(r)
        if not preempted:
            self._admit_waiting(budget, scheduled)
        if self.step_log is not None:
            self.step_log.append(
                {**{r.rid: 1 for r in dec_sched}, **{r.rid: n for r, n in scheduled}}
            )
        emitted_dec = [(r.rid, 1) for r in dec_sched]
        dec_kv = 0
        dec_ctx: list[int] = []
        for r in dec_sched:
            off = r.prompt - 1 - r.gbase
            dec_ctx.append(off)
            dec_kv += tick + 1 + off
        explicit, emitted_x, pairs, tokens, kv_x, done, new_dec = self._apply_chunks(scheduled)
        for r in self._cal_fin.pop(tick, ()):
            if r.dec and r.limit - 1 + r.gbase == tick:
                self._drop_decoder(r)
                r.generated += 1
                r.computed += 1
                done.append(r)
        if done:
            done.sort(key=_by_adm)
            prefilling = self._prefilling
            for r in done:
                if r in prefilling:
                    prefilling.remove(r)
                self._running.remove(r)
                self._release(r)
                self._done(r)
                finished.append((r.rid, r.reason))
        self._tick = tick + 1
        for r in new_dec:
            self._prefilling.remove(r)
            self._make_decoder(r, tick + 1)
        n_dec = len(dec_sched)
        self._gen_tokens += n_dec + len(emitted_x)
        duration = self._duration(
            tokens + n_dec, n_dec + len(scheduled), pairs, dec_kv + kv_x, explicit
        )
        return StepResult(
            duration_s=duration,
            emitted=(*emitted_dec, *emitted_x),
            finished=tuple(finished),
            preempted=tuple(preempted),
            num_tokens=tokens + n_dec,
            explicit=explicit,
            dec_ctx=tuple(dec_ctx),
            dec_base=tick,
        )

    def _shift_decoder(self, r: _Req) -> None:
        """A decoder skipped this step: everything it waits for moves one tick later."""
        r.gbase += 1
        self._dec_off[r.rid] -= 1
        self._dec_off_sum -= 1
        r.next_block_tick += 1
        self._cal_block.setdefault(r.next_block_tick, []).append(r)
        self._cal_fin.setdefault(r.limit - 1 + r.gbase, []).append(r)

    def _preempt(self, r: _Req) -> None:
        self._release(r, preempting=True)
        r.computed = 0
        r.sched = 0
        r.npreempt += 1
        self._preemptions += 1
        self._push_waiting(r, front=True)


def _latency_timed_blocks(config: EngineConfig, profile: GpuProfile | None) -> int:
    """KV blocks of an engine timed by a latency model: ``config.num_gpu_blocks``."""
    if profile is not None:
        raise ValueError("give a GPU profile or a timing model, not both")
    if config.num_gpu_blocks is None:
        raise ValueError(
            "EngineConfig.num_gpu_blocks is required when a latency model times the steps "
            "(there is no GPU profile to size the KV cache from)"
        )
    return config.num_gpu_blocks
