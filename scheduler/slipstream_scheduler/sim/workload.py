"""Workload values for trace replay: the requests a simulation feeds in.

A workload is two lists of :class:`SimRequest`: online arrivals (from a
production trace) and offline work (from a dataset), plus whether the offline
list is a *backlog that never runs dry* (it is cycled, each lap with fresh
request ids, so the engine always has offline work to pick from).

Also here: pure helpers to build the 16-token prefix-block hashes the engine
model's prefix cache keys on, from token ids or from coarser block hashes
(Mooncake's 512-token ``hash_ids``).

Deliberately left out: opening files and parsing trace formats (the CLI's
``slipstream_cli.workloads`` does that), and any notion of time beyond the
arrival offsets in seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from slipstream_scheduler.types import RequestClass

BLOCK_TOKENS = 16
"""Tokens per KV block (vLLM's default block size); block hashes are per full block."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a replayed workload.

    ``output_tokens`` is the real output length (the engine model stops the
    request there); ``max_tokens`` the limit the client asked for (defaults to
    the real length). ``block_hashes`` has one hash per full 16-token block of
    the prompt (empty: the prompt shares nothing and caches nothing).
    ``vector`` is the prompt embedding for the length predictor, if any;
    ``group`` a free label (e.g. the generator model in AlpacaEval).
    """

    request_id: str
    cls: RequestClass
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...] = ()
    max_tokens: int = 0
    group: str = ""
    vector: npt.NDArray[np.float32] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(
                f"request {self.request_id}: prompt and output must be >= 1 token "
                f"(got {self.prompt_tokens}, {self.output_tokens})"
            )
        if self.max_tokens == 0:
            object.__setattr__(self, "max_tokens", self.output_tokens)


@dataclass(frozen=True, slots=True)
class Workload:
    """Online arrivals (sorted by time) and offline work for one simulation.

    ``offline_backlog``: cycle ``offline`` forever (fresh ids each lap) so
    offline work never runs dry; otherwise each offline request runs once,
    arriving at its ``arrival_s``. ``horizon_s`` ends the replay (None: when
    all finite work is done; required with a backlog).
    """

    online: tuple[SimRequest, ...]
    offline: tuple[SimRequest, ...] = ()
    offline_backlog: bool = False
    horizon_s: float | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.offline_backlog and self.horizon_s is None:
            raise ValueError("a workload with an offline backlog needs horizon_s")
        if self.offline_backlog and not self.offline:
            raise ValueError("an offline backlog needs at least one offline request")

    @property
    def end_of_arrivals_s(self) -> float:
        """Arrival time of the last online request (0 when there is none)."""
        return self.online[-1].arrival_s if self.online else 0.0


def scale_rate(requests: Sequence[SimRequest], factor: float) -> tuple[SimRequest, ...]:
    """Compress (``factor`` > 1) or stretch the arrival times: factor x the rate."""
    if factor <= 0:
        raise ValueError(f"rate scale must be > 0, got {factor}")
    return tuple(replace(r, arrival_s=r.arrival_s / factor) for r in requests)


def window(
    requests: Sequence[SimRequest], start_s: float, duration_s: float
) -> tuple[SimRequest, ...]:
    """The requests arriving in ``[start_s, start_s + duration_s)``, re-based to 0."""
    end = start_s + duration_s
    return tuple(
        replace(r, arrival_s=r.arrival_s - start_s)
        for r in requests
        if start_s <= r.arrival_s < end
    )


def chain_block_hashes(tokens: Sequence[int], block: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """One hash per full ``block`` of ``tokens``, each chained to the previous.

    Equal hashes at the same position mean equal prefixes, as in vLLM's
    prefix cache. Hashing ints and tuples of ints is stable across processes.
    """
    return extend_block_hashes((), tokens, block)


def extend_block_hashes(
    known: tuple[int, ...], tokens: Sequence[int], block: int = BLOCK_TOKENS
) -> tuple[int, ...]:
    """:func:`chain_block_hashes` of ``tokens`` when the first ``len(known)`` blocks are known.

    Lets a caller hash a shared prefix once and extend it per request.
    """
    out = list(known)
    prev = known[-1] if known else 0
    for i in range(len(known) * block, len(tokens) - block + 1, block):
        prev = hash((prev, *tokens[i : i + block]))
        out.append(prev)
    return tuple(out)


def expand_block_hashes(
    coarse: Iterable[int], coarse_tokens: int, prompt_tokens: int, block: int = BLOCK_TOKENS
) -> tuple[int, ...]:
    """Split coarse prefix-block ids (e.g. Mooncake's 512-token ones) into ``block``-token hashes.

    Coarse ids already identify whole prefixes (same id at the same position
    means same prefix), so each fine block hash is a function of its coarse id
    and its offset inside it. Only full fine blocks of the prompt get a hash.
    """
    if coarse_tokens % block:
        raise ValueError(f"coarse block {coarse_tokens} is not a multiple of {block}")
    per = coarse_tokens // block
    n_fine = prompt_tokens // block
    out: list[int] = []
    for cid in coarse:
        for j in range(per):
            if len(out) == n_fine:
                return tuple(out)
            out.append(hash((cid, j, 0x5E1F)))
    return tuple(out)


def unique_block_hashes(
    salt: int, prompt_tokens: int, block: int = BLOCK_TOKENS
) -> tuple[int, ...]:
    """Hashes for a prompt that shares no prefix with any other (keyed by ``salt``)."""
    return tuple(hash((salt, i, 0xB10C)) for i in range(prompt_tokens // block))
