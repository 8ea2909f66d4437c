"""Step timing by a batch-latency model instead of a GPU profile.

:class:`~slipstream_scheduler.engine.model.EngineModel` times its steps with
:class:`~slipstream_scheduler.engine.gpu.GpuTimingModel` by default, which needs a
shipped (model, GPU) profile. Given a
:class:`~slipstream_scheduler.latency.LinearLatencyModel` instead (a profile fitted
elsewhere, or one a pod learned from its own engine), each step takes what that model
predicts for the step's batch; the engine's seeded noise (``EngineConfig.noise_cv``)
stands for the model's residual spread. This is how the simulator runs a service whose
model has no GPU profile.

The step loop hands over what it already has: the explicit items (prefill chunks and
decodes walked one by one) plus aggregates that cover the steady decoders it never
materialises (sequence count, decode KV tokens). The decoders' features are
rebuilt from those aggregates, so a step costs O(explicit items), not O(batch), and the
prediction equals ``model.predict(StepResult.batch)`` exactly (same integer sums).

Deliberately left out: KV sizing (a latency model knows no memory; the caller gives
``EngineConfig.num_gpu_blocks``) and negative predictions (a model with a negative
intercept may predict below zero for a tiny step; the step then takes no time).
"""

from __future__ import annotations

from collections.abc import Sequence

from slipstream_scheduler.latency import BatchFeatures, LinearLatencyModel
from slipstream_scheduler.types import BatchItem


class LatencyStepTiming:
    """Times engine steps with ``model`` (seconds per iteration, before noise)."""

    __slots__ = ("model",)

    def __init__(self, model: LinearLatencyModel) -> None:
        self.model = model

    def step_time(self, explicit: Sequence[BatchItem], seqs: int, decode_kv_tokens: int) -> float:
        """Seconds for a step: ``explicit`` items plus ``seqs - len(explicit)`` decoders.

        ``seqs`` and ``decode_kv_tokens`` (``sum(context + 1)`` over every decode) cover
        the whole step, as :meth:`GpuTimingModel.step_time` takes them.
        Every decoder that is not in ``explicit`` decodes one token. An empty step is 0.
        """
        if seqs <= 0:
            return 0.0
        f = BatchFeatures.of(explicit)
        n_dec = seqs - len(explicit)
        if n_dec:
            # Explicit decodes carry 1 token each: their KV tokens are s_d_ctx + n_d.
            f.s_d_ctx += decode_kv_tokens - f.s_d_ctx - f.n_d - n_dec
            f.n_d += n_dec
            f.s_d_tok += n_dec
            f.tokens += n_dec
        seconds = self.model.predict_features(f)
        return seconds if seconds > 0.0 else 0.0
