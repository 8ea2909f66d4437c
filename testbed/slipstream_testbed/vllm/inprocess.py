"""vLLM's own v1 scheduler and KV manager, in-process, as an engine the simulator can drive.

:class:`VllmEngine` has the engine model's interface (``add``, ``abort``, ``finish``, ``step``,
``inspect``, ``stats``, ``has_work``; see :class:`slipstream_scheduler.engine.model.EngineModel`)
but every batch is chosen by ``vllm.v1.core.sched.scheduler.Scheduler`` (or a subclass named by
``scheduler_cls``, e.g. Slipstream's plugin) with vLLM's ``KVCacheManager`` and prefix cache.
No model runs: each step "samples" one token for every request whose computed tokens caught up,
and the engine model's GPU timing (:class:`~slipstream_scheduler.engine.gpu.GpuTimingModel`)
gives the step its duration on the caller's clock.

Prompts are token ids. The simulator's requests carry prefix *block keys* instead, so
:class:`TokenSynth` turns each key into a fixed block of token ids (a stable digest of the key
seeds it): requests that share a key chain share those tokens, and vLLM's prefix cache finds
them. A key ``(engine id, j)`` (a continuation's block past the original prompt) is the j-th
block of that earlier request's own tokens, prompt and output, as vLLM would see it again.

The scheduler is built as vLLM's own unit tests build it: a ``VllmConfig`` whose
``ModelConfig`` points at the tiny local model (its config only: nothing is loaded), and a
``KVCacheConfig`` of one full-attention group of ``num_gpu_blocks`` blocks.

With ``async_scheduling=True`` the engine steps as vLLM's engine core does with its batch
queue of two: each ``step()`` schedules the next batch before the last one's output is
delivered (``update_from_output``), so a decoding request has a token in flight (vLLM's output
placeholders) when it is scheduled again, as on a GPU with async scheduling on.

Deliberately left out: a model runner, sampling, detokenisation, structured output, LoRA,
speculative decoding, KV connectors.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream_scheduler.engine.errors import RequestError
from slipstream_scheduler.engine.gpu import GpuTimingModel
from slipstream_scheduler.engine.model import (
    EngineConfig,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestState,
    RequestView,
    StepResult,
)
from slipstream_scheduler.types import BatchItem, EngineLimits, Phase
from slipstream_testbed.vllm.tiny_model import ensure

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# The model folder only lends its config: no position is ever computed, so a context longer
# than the tiny model's max_position_embeddings is harmless here.
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

VOCAB_LOW, VOCAB_HIGH = 8, 1000
"""Synthetic token ids lie in [VOCAB_LOW, VOCAB_HIGH): clear of the tiny model's specials."""
DEFAULT_MAX_MODEL_LEN = 32768


def _seed_of(key: Hashable) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


def _tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids from a 64-bit seed (an LCG: fast, stable across processes)."""
    out = []
    x = seed or 1
    span = VOCAB_HIGH - VOCAB_LOW
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        out.append(VOCAB_LOW + (x >> 33) % span)
    return out


class TokenSynth:
    """Token ids for requests that arrive as prefix block keys (see the module note)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.sequences: dict[str, list[int]] = {}
        """Every request's token ids, prompt then output (for continuations' keys)."""

    def block(self, key: Hashable) -> list[int]:
        bs = self.block_size
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str):
            seq = self.sequences.get(key[0])
            j = key[1]
            if seq is not None and isinstance(j, int) and len(seq) >= (j + 1) * bs:
                return seq[j * bs : (j + 1) * bs]
        return _tokens(_seed_of(("block", key)), bs)

    def prompt(self, request_id: str, prompt_len: int, keys: Sequence[Hashable]) -> list[int]:
        bs = self.block_size
        ids: list[int] = []
        for key in keys[: prompt_len // bs]:
            ids.extend(self.block(key))
        ids.extend(_tokens(_seed_of(("tail", request_id)), prompt_len - len(ids)))
        return ids


def output_token(request_id: str, index: int) -> int:
    """The token a request "samples" at output position ``index`` (deterministic)."""
    return VOCAB_LOW + _seed_of((request_id, index)) % (VOCAB_HIGH - VOCAB_LOW)


def default_model_dir() -> Path:
    """The tiny local model whose config the scheduler's ``ModelConfig`` reads."""
    from_env = os.environ.get("SLIPSTREAM_VLLM_MODEL_DIR")
    if from_env:
        return Path(from_env)
    return ensure()


@dataclass(frozen=True, slots=True)
class VllmSchedulerSpec:
    """The scheduler settings that matter, as vLLM's engine args (see :meth:`of`)."""

    policy: str = "priority"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    scheduler_reserve_full_isl: bool = True
    enable_prefix_caching: bool = True
    num_gpu_blocks: int = 1024
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    scheduler_cls: str | None = None
    async_scheduling: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, config: EngineConfig, num_gpu_blocks: int, **kw: Any) -> VllmSchedulerSpec:
        """The spec for ``config`` over a pool of ``num_gpu_blocks`` (vLLM's null block
        included)."""
        return cls(
            policy=config.policy,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=config.long_prefill_token_threshold_adaptive,
            scheduler_reserve_full_isl=config.scheduler_reserve_full_isl,
            enable_prefix_caching=config.enable_prefix_caching,
            num_gpu_blocks=num_gpu_blocks,
            # No cap configured: the engine model bounds a request by the KV cache alone, and
            # the largest context vLLM starts with is the one the cache holds (its blocks but
            # the null block).
            max_model_len=config.max_model_len or (num_gpu_blocks - 1) * config.block_size,
            **kw,
        )


def build_vllm_config(spec: VllmSchedulerSpec, model_dir: Path | None = None) -> VllmConfig:
    model = str(model_dir or default_model_dir())
    mc = ModelConfig(
        model=model,
        tokenizer=model,
        dtype="float32",
        seed=0,
        max_model_len=spec.max_model_len,
        skip_tokenizer_init=True,
    )
    sc_kw: dict[str, Any] = {
        "max_num_seqs": spec.max_num_seqs,
        "max_num_batched_tokens": max(spec.max_num_batched_tokens, 1),
        "max_model_len": spec.max_model_len,
        "enable_chunked_prefill": True,
        "policy": spec.policy,
        "long_prefill_token_threshold": spec.long_prefill_token_threshold,
        "long_prefill_token_threshold_adaptive": spec.long_prefill_token_threshold_adaptive,
        "scheduler_reserve_full_isl": spec.scheduler_reserve_full_isl,
        "is_encoder_decoder": False,
    }
    if spec.scheduler_cls is not None:
        sc_kw["scheduler_cls"] = spec.scheduler_cls
    sc = SchedulerConfig(**sc_kw)
    cc = CacheConfig(
        block_size=spec.block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=spec.enable_prefix_caching,
    )
    cc.num_gpu_blocks = spec.num_gpu_blocks
    vc = VllmConfig(
        model_config=mc, scheduler_config=sc, cache_config=cc, device_config=DeviceConfig("cpu")
    )
    # Set after validation: no executor runs here, so vLLM's check of the CPU executor's
    # support for async scheduling does not apply; the scheduler reads the flag.
    vc.scheduler_config.async_scheduling = spec.async_scheduling
    return vc


def build_scheduler(spec: VllmSchedulerSpec, model_dir: Path | None = None) -> Scheduler:
    """vLLM's scheduler (or ``spec.scheduler_cls``) over a pool of ``spec.num_gpu_blocks``."""
    vc = build_vllm_config(spec, model_dir)
    kv = KVCacheConfig(
        num_blocks=spec.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"],
                FullAttentionSpec(
                    block_size=spec.block_size, num_kv_heads=1, head_size=32, dtype=torch.float32
                ),
            )
        ],
    )
    cls: type[Scheduler] = AsyncScheduler if spec.async_scheduling else Scheduler
    if spec.scheduler_cls is not None:
        cls = resolve_obj_by_qualname(spec.scheduler_cls)
    return cls(
        vllm_config=vc,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=spec.block_size,
        log_stats=True,
    )


@dataclass(slots=True)
class _Live:
    request: Request
    limit: int
    reason: FinishReason
    preemptions: int = 0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step as vLLM scheduled it (the fidelity bench compares these)."""

    scheduled: dict[str, int]
    """Tokens scheduled per request."""
    preempted: tuple[str, ...]
    new_hit_tokens: int
    """Prefix-cache hit tokens of the requests that started (or resumed) this step."""
    finished: tuple[str, ...]


class _PoolView:
    """What callers read of the engine model's KV pool (``num_blocks``, ``free``)."""

    def __init__(self, scheduler: Scheduler, num_blocks: int) -> None:
        self._s = scheduler
        self.num_blocks = num_blocks

    @property
    def free(self) -> int:
        return int(self._s.kv_cache_manager.block_pool.get_num_free_blocks())


@dataclass(frozen=True, slots=True)
class _Batch:
    """A scheduled batch on its way through the pipelined engine."""

    out: SchedulerOutput
    samples: list[str]
    """Requests that sample a token in this batch (their prompt is computed)."""
    items: list[BatchItem]
    preempted: tuple[str, ...]
    hit: int


def _empty_step() -> StepResult:
    return StepResult(duration_s=0.0, emitted=(), finished=(), preempted=(), num_tokens=0,
                      explicit=[], dec_ctx=(), dec_base=0)


class VllmEngine:
    """vLLM's scheduler stepped in-process, with the engine model's interface and timing."""

    def __init__(
        self,
        config: EngineConfig,
        seed: int = 0,
        *,
        num_gpu_blocks: int | None = None,
        scheduler_cls: str | None = None,
        model_dir: Path | None = None,
        prompts: Mapping[str, Sequence[int]] | None = None,
        async_scheduling: bool = False,
    ) -> None:
        from slipstream_scheduler.engine.model import EngineModel

        self.config = config
        # The engine model sizes the pool exactly as it would serve this config.
        sized = EngineModel(config, seed=seed)
        self.timing: GpuTimingModel = sized.timing
        self._noisy = sized._noisy
        blocks = num_gpu_blocks or sized.pool.num_blocks
        self.limits: EngineLimits = config.limits()
        # The engine model's blocks are all the requests'; vLLM's pool keeps one more, its
        # null block, which is never allocated: vLLM gets ``blocks + 1`` so both share as many.
        self.spec = VllmSchedulerSpec.of(
            config, blocks + 1, scheduler_cls=scheduler_cls, async_scheduling=async_scheduling
        )
        self.scheduler = build_scheduler(self.spec, model_dir)
        self.pool = _PoolView(self.scheduler, blocks)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(config.block_size, sha256)
        self.synth = TokenSynth(config.block_size)
        self.prompts: Mapping[str, Sequence[int]] = prompts or {}
        """Real token ids by request id (used when at least the prompt's length); every other
        prompt is synthesised from its block keys."""
        self._live: dict[str, _Live] = {}
        self._pending_finished: list[tuple[str, FinishReason]] = []
        self._steps = self._finished = self._preemptions = 0
        self._gen_tokens = self._prompt_tokens = self._prefill_computed = 0
        self._q_tokens = self._hit_tokens = 0
        self.records: list[StepRecord] | None = None
        """Set to a list to keep every step's :class:`StepRecord` (the fidelity bench)."""
        self._in_flight: list[_Batch] = []
        """Scheduled batches whose output is not delivered yet, oldest first (async)."""

    # ------------------------------------------------------------------ requests

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        priority: int = 0,
        arrival_s: float = 0.0,
        extra_args: dict[str, Any] | None = None,
    ) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
        return Request(
            request_id,
            prompt_token_ids,
            params,
            None,
            arrival_time=arrival_s,
            priority=priority,
            block_hasher=self._hasher,
        )

    def add(self, request: EngineRequest) -> None:
        rid = request.request_id
        if rid in self._live:
            raise RequestError(rid, "duplicate request id")
        if request.prompt_len < 1 or request.max_tokens < 1:
            raise RequestError(rid, "prompt_len and max_tokens must be >= 1")
        limit = request.max_tokens
        reason: FinishReason = "length"
        if request.output_len is not None and request.output_len <= limit:
            limit, reason = request.output_len, "stop"
        cap = self.spec.max_model_len
        if request.prompt_len >= cap:
            raise RequestError(rid, f"prompt of {request.prompt_len} >= max_model_len {cap}")
        limit = min(limit, cap - request.prompt_len)
        real = self.prompts.get(rid) if self.prompts else None
        ids = (
            list(real[: request.prompt_len])
            if real is not None and len(real) >= request.prompt_len
            else self.synth.prompt(rid, request.prompt_len, request.block_hashes)
        )
        self.add_tokens(
            rid, ids, limit, priority=request.priority, arrival_s=request.arrival_s, reason=reason
        )

    def add_tokens(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_len: int,
        *,
        priority: int = 0,
        arrival_s: float = 0.0,
        reason: FinishReason = "stop",
        extra_args: dict[str, Any] | None = None,
    ) -> Request:
        """Queue a request given as token ids; it finishes after ``output_len`` tokens."""
        req = self.make_request(
            request_id,
            prompt_token_ids,
            output_len,
            priority=priority,
            arrival_s=arrival_s,
            extra_args=extra_args,
        )
        self.synth.sequences[request_id] = list(prompt_token_ids)
        self._live[request_id] = _Live(req, output_len, reason)
        self._prompt_tokens += len(prompt_token_ids)
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> bool:
        return self._end(request_id, "abort")

    def finish(self, request_id: str) -> bool:
        return self._end(request_id, "stop")

    def _end(self, request_id: str, reason: FinishReason) -> bool:
        if self._live.pop(request_id, None) is None:
            return False
        status = (
            RequestStatus.FINISHED_ABORTED if reason == "abort" else RequestStatus.FINISHED_STOPPED
        )
        self.scheduler.finish_requests(request_id, status)
        self._pending_finished.append((request_id, reason))
        return True

    def has_work(self) -> bool:
        return bool(self._live) or bool(self._pending_finished) or bool(self._in_flight)

    def inspect(self, request_id: str) -> RequestView | None:
        lv = self._live.get(request_id)
        if lv is None:
            return None
        r = lv.request
        running = r.status == RequestStatus.RUNNING
        computed = min(r.num_computed_tokens, r.num_prompt_tokens)
        blocks = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        return RequestView(
            RequestState.RUNNING if running else RequestState.WAITING,
            computed,
            r.num_output_tokens,
            len(blocks[0]) if blocks else 0,
            lv.preemptions,
        )

    def stats(self) -> EngineStats:
        s = self.scheduler
        running, waiting = s.get_request_counts()
        free = self.pool.free
        return EngineStats(
            running=running,
            waiting=waiting,
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_used=self.pool.num_blocks - free,
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
        return self._noisy(self.timing.predict(batch)) if batch else 0.0

    # ------------------------------------------------------------------ the step

    def step(self, now_s: float = 0.0) -> StepResult:
        """One ``schedule()`` and ``update_from_output()``, timed by the GPU model; with async
        scheduling, the next ``schedule()`` before the last batch's ``update_from_output()``."""
        if self.spec.async_scheduling:
            return self._step_pipelined()
        return self._step_sync()

    def _step_pipelined(self) -> StepResult:
        """vLLM's ``step_with_batch_queue`` with a queue of two: schedule a batch while the
        queue has room and there is work; deliver the oldest batch's output when the queue is
        full or nothing new was scheduled. A step that delivers nothing lasts no time."""
        s = self.scheduler
        if s.has_requests():
            batch = self._schedule_batch()
            self._in_flight.append(batch)
            if len(self._in_flight) < 2 and batch.out.total_num_scheduled_tokens > 0:
                return _empty_step()
        if not self._in_flight:
            return _empty_step()
        return self._deliver(self._in_flight.pop(0))

    def _schedule_batch(self) -> _Batch:
        s = self.scheduler
        before = {rid: lv.request.num_computed_tokens for rid, lv in self._live.items()}
        out = s.schedule()
        self._steps += 1
        items: list[BatchItem] = []
        samples: list[str] = []
        for rid, n in out.num_scheduled_tokens.items():
            req = s.requests.get(rid)
            if req is None or rid not in self._live:
                continue
            items.append(self._batch_item(req, n))
            if req.num_computed_tokens >= req.num_tokens:  # the prompt is done: it samples
                samples.append(rid)
        preempted = tuple(sorted(out.preempted_req_ids or ()))
        for rid in preempted:
            lv = self._live.get(rid)
            if lv is not None:
                lv.preemptions += 1
                self._preemptions += 1
        hit = sum(nr.num_computed_tokens for nr in out.scheduled_new_reqs)
        cached = out.scheduled_cached_reqs
        for rid, n_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            if rid in cached.resumed_req_ids:
                hit += max(0, n_computed - before.get(rid, 0))
        self._hit_tokens += hit
        self._q_tokens += sum(len(nr.prompt_token_ids or ()) for nr in out.scheduled_new_reqs)
        return _Batch(out, samples, items, preempted, hit)

    def _batch_item(self, req: Request, n: int) -> BatchItem:
        """What ``n`` tokens just scheduled for ``req`` are for the GPU timing (a prefill's
        tokens are counted as computed prefill)."""
        ctx = req.num_computed_tokens - n
        if n == 1 and ctx >= req.num_prompt_tokens:
            return BatchItem(Phase.DECODE, n, ctx)
        self._prefill_computed += n
        return BatchItem(Phase.PREFILL, n, ctx)

    def _deliver(self, batch: _Batch) -> StepResult:
        """``update_from_output`` of one batch: a token for each request that sampled, as vLLM
        takes it (a preempted request's token in flight is dropped by vLLM, not counted)."""
        s = self.scheduler
        finished: list[tuple[str, FinishReason]] = self._pending_finished
        self._pending_finished = []
        ids = list(batch.out.num_scheduled_tokens)
        sampling = set(batch.samples)
        sampled = [
            [output_token(rid, s.requests[rid].num_output_tokens)]
            if rid in sampling and rid in s.requests else []
            for rid in ids
        ]
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        engine_outputs = s.update_from_output(batch.out, mro)
        emitted: list[tuple[str, int]] = []
        done: list[str] = []
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.new_token_ids:
                    emitted.append((o.request_id, len(o.new_token_ids)))
                    self._gen_tokens += len(o.new_token_ids)
                    seq = self.synth.sequences.get(o.request_id)
                    if seq is not None:
                        seq.extend(o.new_token_ids)
                if o.finish_reason is None:
                    continue
                lv = self._live.pop(o.request_id, None)
                if lv is not None:
                    finished.append((o.request_id, lv.reason))
                    done.append(o.request_id)
        self._finished += len(done)
        if self.records is not None:
            self.records.append(StepRecord(
                dict(batch.out.num_scheduled_tokens), batch.preempted, batch.hit, tuple(done)
            ))
        return StepResult(
            duration_s=self.measure(batch.items),
            emitted=tuple(emitted),
            finished=tuple(finished),
            preempted=batch.preempted,
            num_tokens=batch.out.total_num_scheduled_tokens,
            explicit=batch.items,
            dec_ctx=(),
            dec_base=0,
        )

    def _step_sync(self) -> StepResult:
        s = self.scheduler
        finished: list[tuple[str, FinishReason]] = self._pending_finished
        self._pending_finished = []
        before = {rid: lv.request.num_computed_tokens for rid, lv in self._live.items()}
        out = s.schedule()
        scheduled = dict(out.num_scheduled_tokens)
        self._steps += 1
        hit = 0
        for nr in out.scheduled_new_reqs:
            hit += nr.num_computed_tokens
            self._q_tokens += len(nr.prompt_token_ids or ())
        cached = out.scheduled_cached_reqs
        for rid, n_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            if rid in cached.resumed_req_ids:
                hit += max(0, n_computed - before.get(rid, 0))
        self._hit_tokens += hit
        preempted = tuple(sorted(out.preempted_req_ids or ()))
        for rid in preempted:
            lv = self._live.get(rid)
            if lv is not None:
                lv.preemptions += 1
                self._preemptions += 1
        items: list[BatchItem] = []
        sampled: list[list[int]] = []
        ids = list(scheduled)
        emitted: list[tuple[str, int]] = []
        new_tokens: list[tuple[str, int]] = []
        for rid in ids:
            n = scheduled[rid]
            lv = self._live.get(rid)
            req = s.requests.get(rid)
            if lv is None or req is None:
                sampled.append([])
                continue
            items.append(self._batch_item(req, n))
            if req.num_computed_tokens >= req.num_tokens:
                tok = output_token(rid, req.num_output_tokens)
                sampled.append([tok])
                emitted.append((rid, 1))
                new_tokens.append((rid, tok))
            else:
                sampled.append([])
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        engine_outputs = s.update_from_output(out, mro)
        done: list[str] = []
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.finish_reason is None:
                    continue
                lv = self._live.pop(o.request_id, None)
                if lv is None:
                    continue
                finished.append((o.request_id, lv.reason))
                done.append(o.request_id)
        for rid, tok in new_tokens:
            seq = self.synth.sequences.get(rid)
            if seq is not None:
                seq.append(tok)
        self._gen_tokens += len(new_tokens)
        self._finished += len(done)
        if self.records is not None:
            self.records.append(StepRecord(scheduled, preempted, hit, tuple(done)))
        duration = self.measure(items)
        return StepResult(
            duration_s=duration,
            emitted=tuple(emitted),
            finished=tuple(finished),
            preempted=preempted,
            num_tokens=sum(scheduled.values()),
            explicit=items,
            dec_ctx=(),
            dec_base=0,
        )
