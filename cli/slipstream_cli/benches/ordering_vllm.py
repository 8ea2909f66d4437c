"""``bench ordering --engine vllm``: the ordering runs inside vLLM's scheduler, under the plugin.

Every online request goes straight into vLLM (the dispatcher holds nothing back), so vLLM's
waiting queue is where requests wait. Each step the plugin (``SlipstreamScheduler``) keys the
waiting queue with the ordering, admits in that order, and, for a preemptive ordering,
preempts running online requests the best waiting one outranks when KV blocks or slots hold it
out (recompute, as vLLM preempts). When the running requests' own decodes run out of KV
blocks, vLLM's walk preempts the ordering's last (the plugin gives running online requests
their rank as their priority for the walk). The plugin predicts lengths from token ids with
its own semantic history, fed by requests as they finish, as in a pod.

Prompts are real text turned into token ids word by word (the bench's regex tokens, each hashed
into the tiny model's vocabulary), so a prompt that recurs (AlpacaEval's 12 generators answer
each instruction) or shares a template has the token ids the plugin's embedder compares.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from slipstream_cli.workloads import alpaca_eval
from slipstream_scheduler.dispatcher import DispatcherConfig
from slipstream_scheduler.engine.model import EngineConfig

__all__ = ["long_prompt_ids", "plugin_ordering_factory", "text_token_ids"]

VOCAB_LOW, VOCAB_HIGH = 8, 1000
"""The tiny model's vocabulary clear of its specials (``slipstream_testbed.vllm.inprocess``)."""


def text_token_ids(text: str) -> list[int]:
    """Token ids of ``text``: its regex tokens (words and punctuation), each hashed into the
    vocabulary. As many ids as ``alpaca_eval.regex_token_count`` counts (at least one)."""
    span = VOCAB_HIGH - VOCAB_LOW
    ids = [
        VOCAB_LOW
        + int.from_bytes(hashlib.blake2b(w.lower().encode(), digest_size=4).digest(), "little")
        % span
        for w in alpaca_eval.token_words(text)
    ]
    return ids or [VOCAB_LOW]


def long_prompt_ids(request_id: str, n: int) -> list[int]:
    """Token ids for a prompt known only by its length (seeded by the id: none recurs)."""
    rng = random.Random(request_id)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def plugin_ordering_factory(
    ordering: str,
    params: Mapping[str, object],
    prompts: Mapping[str, Sequence[int]],
    *,
    oracle: bool = False,
    global_lengths: bool = False,
) -> Callable[[EngineConfig, int], Any]:
    """``(EngineConfig, seed) -> PluginEngine`` ordering online requests with ``ordering``
    (the control document a sidecar would write: naive policy, no offline budget)."""
    from slipstream_scheduler.enginecontrol import EngineControl
    from slipstream_testbed.vllm.simplugin import PluginEngine

    control = EngineControl(
        generation=1, policy="naive", ordering=ordering, ordering_params=dict(params)
    )
    offline_priority = DispatcherConfig().offline_priority

    def make(config: EngineConfig, seed: int) -> Any:
        return PluginEngine(
            config,
            seed,
            control=control,
            offline_priority=offline_priority,
            prompts=prompts,
            oracle_lengths=oracle,
            global_lengths=global_lengths,
        )

    return make
