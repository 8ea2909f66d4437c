"""Value types shared by every part of the scheduling core.

These are the nouns the planner, the orderings, the engine model, the
simulator and the sidecar exchange. They are frozen, slotted dataclasses with
no behaviour beyond small derived properties: the policies live elsewhere.

Deliberately left out: anything that knows about HTTP, gRPC, Kubernetes or a
wall clock. Times are plain floats in seconds on whatever clock the caller
injects (virtual time in the simulator, monotonic time in the sidecar).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestClass(enum.IntEnum):
    """Service class of a request. Ordered: lower values are served first."""

    ONLINE = 0
    OFFLINE = 1


class Phase(enum.IntEnum):
    """What a request does in one engine iteration."""

    PREFILL = 0
    DECODE = 1


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One request's share of one engine iteration: the latency model's input.

    ``tokens`` are the tokens processed this step (a prefill chunk, or 1 for a
    decode); ``context`` the tokens already in the KV cache before the step.
    """

    phase: Phase
    tokens: int
    context: int


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request the engine holds (scheduled at least once, not finished).

    ``prompt_tokens`` counts the whole prompt the engine was sent (for a resumed
    offline request: the original prompt plus the tokens produced before the
    preemption). ``computed_tokens`` is how much of it has KV computed;
    prefill is done when it equals ``prompt_tokens``. ``generated_tokens`` counts
    output tokens produced by this engine submission.
    """

    request_id: str
    cls: RequestClass
    prompt_tokens: int
    computed_tokens: int
    generated_tokens: int
    max_tokens: int
    arrival_s: float
    priority: int = 0

    @property
    def in_prefill(self) -> bool:
        return self.computed_tokens < self.prompt_tokens

    @property
    def context_tokens(self) -> int:
        """Tokens in the KV cache (prompt computed so far plus generated)."""
        return self.computed_tokens + self.generated_tokens


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """A request waiting to be admitted.

    ``cached_tokens`` is the expected prefix-cache hit for its prompt (tokens
    that need no prefill compute). ``already_generated`` is non-zero for a
    preempted offline request that resumes as a continuation: those tokens are
    part of ``prompt_tokens`` now and count against ``max_tokens`` of the
    original request.
    """

    request_id: str
    cls: RequestClass
    prompt_tokens: int
    max_tokens: int
    arrival_s: float
    cached_tokens: int = 0
    already_generated: int = 0


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """The engine's static batching limits (vLLM's scheduler config)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    long_prefill_token_threshold: int = 0  # 0: no per-request chunk cap
    # vLLM's scheduler_reserve_full_isl (its default): a waiting request is admitted only
    # if its whole sequence, less its cached blocks, fits in the free KV blocks.
    reserve_full_sequence: bool = True


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the planner may look at for one decision.

    Queues are already in their policy order (the ordering for online, PSM or
    FCFS for offline); the planner never reorders them, it only decides how
    far down each queue to go.
    """

    now_s: float
    running: tuple[RunningRequest, ...]
    online_queue: tuple[QueuedRequest, ...]
    offline_queue: tuple[QueuedRequest, ...]
    free_kv_blocks: int
    limits: EngineLimits
    budget_s: float | None = None  # per-iteration latency budget; None: unbounded


@dataclass(frozen=True, slots=True)
class Admission:
    """A request given ``tokens`` tokens of work in the planned step.

    For a queued request this is its first prefill chunk; for a running one
    its chunk (prefill) or 1 (decode).
    """

    request_id: str
    tokens: int


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The planner's decision for one step (engine) or one admission round (sidecar)."""

    scheduled: tuple[Admission, ...]  # running requests that get work this step
    admitted: tuple[Admission, ...]  # queued requests admitted, online before offline
    preempted: tuple[str, ...]  # running offline requests to preempt (they keep their output)
    predicted_step_s: float
    budget_s: float | None
