"""In-engine mode: HyGen's per-iteration budget applied inside the engine model's scheduler.

This is what an engine plugin (a vLLM ``--scheduler-cls`` running the
planner's per-iteration logic, or HyGen inside Sarathi-Serve) would add over
the sidecar: every iteration, after the online work and the decodes are in,
each offline prefill chunk is cut to the time the latency model says is left
under the budget (HyGen's ``get_max_prefill``,
:meth:`~slipstream_scheduler.latency.LinearLatencyModel.max_prefill_tokens`);
an offline chunk that does not fit is skipped this iteration.

It is reported beside the sidecar numbers and is **never** what the sidecar
achieves. Approximations (NOTE: where this bends HyGen's ITERATION planner):

* decodes always run (offline ones too); HyGen may drop an offline decode for
  one iteration. The engine model's fast decode path has no per-request skip;
* only the engine model's fast scheduling walk is capped; iterations that fall
  back to its exact walk (KV shortage, preemption, a token budget that runs out
  before the last decoder) run uncapped. :attr:`BudgetedEngine.uncapped_steps`
  counts them so a report can say how often;
* a waiting offline request admitted by vLLM's loop computes at least one
  token in its first iteration (the engine has already allocated its blocks);
* which requests enter the engine is still decided by the dispatcher (a
  static offline in-flight window, see :mod:`slipstream_scheduler.sim.simulator`).

Deliberately left out: everything else of the engine (inherited unchanged).
"""

from __future__ import annotations

from typing import Any

from slipstream_scheduler.engine.model import EngineConfig, EngineModel
from slipstream_scheduler.latency import BatchFeatures, LinearLatencyModel


class BudgetedEngine(EngineModel):
    """The engine model with HyGen's per-iteration offline chunk sizing."""

    def __init__(
        self,
        config: EngineConfig,
        seed: int = 0,
        *,
        latency_model: LinearLatencyModel,
        budget_s: float,
        offline_priority: int,
    ) -> None:
        super().__init__(config, seed)
        self.latency_model = latency_model
        self.budget_s = budget_s
        self.offline_priority = offline_priority
        self.uncapped_steps = 0
        self.capped_tokens = 0
        self._f: BatchFeatures | None = None

    def _fit(self, f: BatchFeatures, n: int, context: int) -> int:
        return self.latency_model.max_prefill_tokens(f, context, self.budget_s, n)

    def _plan_fast(self) -> Any:
        plan = super()._plan_fast()
        if plan is None:
            self._f = None
            self.uncapped_steps += 1
            return None
        chunks, due, budget = plan
        f = BatchFeatures()
        n_dec = len(self._dec)
        if n_dec:
            f.n_d = f.s_d_tok = f.tokens = n_dec
            f.s_d_ctx = n_dec * self._tick + self._dec_off_sum
        offp = self.offline_priority
        for r, n in chunks:
            if r.priority < offp:
                f.add_prefill(n, r.computed)
        kept = []
        for r, n in chunks:
            if r.priority < offp:
                kept.append((r, n))
                continue
            x = self._fit(f, n, r.computed)
            if x > 0:
                f.add_prefill(x, r.computed)
                kept.append((r, x))
            budget += n - x
            self.capped_tokens += n - x
        self._f = f
        return kept, due, budget

    def _admit_waiting(self, budget: int, out: list[Any]) -> int:
        f = self._f
        if f is None:
            return super()._admit_waiting(budget, out)
        start = len(out)
        left = super()._admit_waiting(budget, out)
        offp = self.offline_priority
        for r, n in out[start:]:
            if r.priority < offp:
                f.add_prefill(n, r.computed)
        for i in range(start, len(out)):
            r, n = out[i]
            if r.priority < offp:
                continue
            x = max(self._fit(f, n, r.computed), 1)
            f.add_prefill(x, r.computed)
            out[i] = (r, x)
            left += n - x
            self.capped_tokens += n - x
        return left
