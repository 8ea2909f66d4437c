"""The engine's KV cache as the sidecar counts it: blocks, block size, and where each came from.

vLLM publishes its KV cache on ``/metrics`` as the info gauge ``vllm:cache_config_info``:
value 1, one series per engine, its ``CacheConfig`` fields as labels, among them
``num_gpu_blocks`` (the blocks it allocated at start) and ``block_size`` (tokens per block).
The sidecar reads it when the engine answers ``/health`` (at start, and again after every
loss of the engine, so that a restarted engine is seen as it is now) and admits with it,
unless the ``kv_blocks`` / ``block_size`` settings are given: a value given wins. An
engine that does not publish the family (a vLLM older than its v1 metrics, the engine model
of ``slipstream engine``) leaves the old defaults in force, 8,192 blocks of 16 tokens.

Where the block size in force is not the engine's (a ``block_size`` setting that differs,
or a change the sidecar could not make with requests held), the engine's blocks are
converted to blocks of the size in force: its KV in tokens, divided down.

The text is parsed with ``prometheus_client``'s parser (quoting, escapes and the format's
corners are its business). Deliberately left out: the fetch (``app.py``) and every other
``CacheConfig`` label (cache dtype, prefix caching, swap space).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

CACHE_CONFIG_INFO = "vllm:cache_config_info"
DEFAULT_KV_BLOCKS = 8192
"""KV blocks assumed where neither a setting nor the engine says (the old default)."""
DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block assumed where neither a setting nor the engine says (vLLM's GPU default)."""

Source = Literal["engine", "setting", "default"]


@dataclass(frozen=True, slots=True)
class EngineKv:
    """What the engine publishes: ``num_gpu_blocks`` KV blocks of ``block_size`` tokens."""

    num_gpu_blocks: int
    block_size: int


@dataclass(frozen=True, slots=True)
class KvCache:
    """The KV cache the sidecar admits with, and where each number came from."""

    kv_blocks: int  # blocks of block_size tokens
    block_size: int  # tokens per block
    kv_blocks_source: Source
    block_size_source: Source


def _positive_int(value: str | None) -> int | None:
    """A label's value as a positive integer (vLLM writes ``None`` before it sized its cache)."""
    if value is None or not value.isdigit():
        return None
    number = int(value)
    return number if number >= 1 else None


def parse_cache_config(text: str) -> EngineKv | None:
    """``num_gpu_blocks`` and ``block_size`` of ``vllm:cache_config_info`` in the engine's
    ``/metrics`` text; None when the family is absent, malformed, or names no positive
    whole number of both.

    A data-parallel vLLM writes one series per engine, each with the same ``CacheConfig``
    (its front end sums the engines' blocks into it): the smallest KV in tokens is taken,
    which is then that one value.
    """
    found: list[EngineKv] = []
    try:
        for family in text_string_to_metric_families(text):
            if family.name != CACHE_CONFIG_INFO:
                continue
            for sample in family.samples:
                blocks = _positive_int(sample.labels.get("num_gpu_blocks"))
                size = _positive_int(sample.labels.get("block_size"))
                if blocks is not None and size is not None:
                    found.append(EngineKv(blocks, size))
    except ValueError as exc:  # the parser's word for a malformed exposition
        log.warning(
            "the engine's /metrics does not parse (%s); its KV cache is not read", str(exc)[:200]
        )
        return None
    if not found:
        return None
    return min(found, key=lambda kv: (kv.num_gpu_blocks * kv.block_size, kv.block_size))


def resolve(kv_blocks: int | None, block_size: int | None, engine: EngineKv | None) -> KvCache:
    """The KV cache to admit with: for each of the two numbers the setting when given
    (``kv_blocks``, ``block_size``; None: not given), else the engine's, else the default.

    The engine's blocks are counted in the block size in force: when that is not the
    engine's, they are converted (the engine's KV in tokens, floor-divided; at least 1).
    """
    size_source: Source
    if block_size is not None:
        size, size_source = block_size, "setting"
    elif engine is not None:
        size, size_source = engine.block_size, "engine"
    else:
        size, size_source = DEFAULT_BLOCK_SIZE, "default"
    blocks_source: Source
    if kv_blocks is not None:
        blocks, blocks_source = kv_blocks, "setting"
    elif engine is not None:
        blocks = max(1, engine.num_gpu_blocks * engine.block_size // size)
        blocks_source = "engine"
    else:
        blocks, blocks_source = DEFAULT_KV_BLOCKS, "default"
    return KvCache(blocks, size, blocks_source, size_source)
