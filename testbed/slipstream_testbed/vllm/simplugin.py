"""The plugin in the simulator: vLLM's scheduler with ``SlipstreamScheduler``, stepped in-process.

:class:`PluginEngine` is :class:`~slipstream_testbed.vllm.inprocess.VllmEngine` built with
``scheduler_cls`` = the plugin, configured the way the sidecar configures it in a pod (an
:class:`~slipstream_scheduler.enginecontrol.EngineControl`, applied directly rather than through
the channel directory), and with the simulator's offline requests (priority at or below
``offline_priority``) carrying the pod's token, as the sidecar's requests do. So
``bench colocation --engine vllm`` measures the plugin's own code choosing every batch of
vLLM's real scheduler, with the engine model's GPU timing giving each step its duration.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.request import Request

from slipstream_scheduler.engine.model import EngineConfig, StepResult
from slipstream_scheduler.enginecontrol import OFFLINE_TOKEN_ARG, EngineControl
from slipstream_scheduler.lengths import GlobalDistributionPredictor
from slipstream_testbed.vllm.inprocess import VllmEngine

__all__ = ["PLUGIN_CLS", "PluginEngine", "plugin_in_engine_factory"]

PLUGIN_CLS = "slipstream_vllm.scheduler.SlipstreamScheduler"


class PluginEngine(VllmEngine):
    """vLLM's scheduler under the plugin, with the simulator's classes mapped to the pod's."""

    def __init__(
        self,
        config: EngineConfig,
        seed: int = 0,
        *,
        control: EngineControl,
        offline_priority: int,
        num_gpu_blocks: int | None = None,
        model_dir: Path | None = None,
        prompts: Mapping[str, Sequence[int]] | None = None,
        oracle_lengths: bool = False,
        global_lengths: bool = False,
    ) -> None:
        super().__init__(
            config,
            seed,
            num_gpu_blocks=num_gpu_blocks,
            scheduler_cls=PLUGIN_CLS,
            model_dir=model_dir,
            prompts=prompts,
        )
        self.offline_priority = offline_priority
        self._token = secrets.token_hex(16)
        sched: Any = self.scheduler
        sched.set_offline_token(self._token)
        if not sched.apply(control):
            raise ValueError(f"the plugin refused control generation {control.generation}")
        self.plugin: Any = sched
        # Requests arrive on the simulator's clock: the tail guard's deadlines follow it.
        self._now_s = 0.0
        sched.clock = lambda: self._now_s
        self.oracle_lengths = oracle_lengths
        """An upper bound for the ordering bench, not a deployable setting: every online
        request's predicted output length is its true one."""
        if global_lengths:
            # The baseline a semantic predictor must beat: every request is predicted the
            # same distribution, every finished request's length.
            self.plugin._predictor = GlobalDistributionPredictor()

    def add_tokens(
        self, request_id: str, prompt_token_ids: list[int], output_len: int, **kw: Any
    ) -> Request:
        req = super().add_tokens(request_id, prompt_token_ids, output_len, **kw)
        meta = self.plugin._meta.get(request_id) if self.oracle_lengths else None
        if meta is not None:
            meta.lengths = np.array([float(output_len)], dtype=np.float64)
        return req

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
        if priority >= self.offline_priority:
            extra_args = {**(extra_args or {}), OFFLINE_TOKEN_ARG: self._token}
        return super().make_request(
            request_id,
            prompt_token_ids,
            max_tokens,
            priority=priority,
            arrival_s=arrival_s,
            extra_args=extra_args,
        )

    def step(self, now_s: float = 0.0) -> StepResult:
        self._now_s = now_s
        return super().step(now_s)

    def in_engine_counters(self) -> dict[str, float | None]:
        """The simulator's in-engine counters (``SimResult.in_engine``), from the plugin."""
        p = self.plugin
        return {
            "plans": p.steps,
            "fallback_steps": p.fallback_steps,
            "offline_deferred_chunks": p.offline_deferred_chunks,
            "offline_preemptions": p.offline_preemptions,
            "online_preemptions": p.online_preemptions,
            "online_displacements": p.online_displacements,
            "online_displaced_tokens": p.online_displaced_tokens,
            "max_offline_step_over_budget_s": p.max_offline_over_budget_s,
        }


def plugin_in_engine_factory(ordering: str = "fcfs") -> Callable[..., PluginEngine]:
    """``(EngineConfig, seed, InEngineSpec) -> PluginEngine`` for the simulator's in-engine
    mode: the spec becomes the control document the sidecar would write."""

    def make(config: EngineConfig, seed: int, spec: Any) -> PluginEngine:
        control = EngineControl(
            generation=1,
            policy=spec.policy,
            policy_params=dict(spec.params),
            budget_s=spec.budget_s,
            idle_budget_s=spec.idle_budget_s or None,  # 0: the budget always applies
            latency_model=spec.latency_model.to_dict(),
            ordering=ordering,
        )
        return PluginEngine(config, seed, control=control, offline_priority=spec.offline_priority)

    return make
