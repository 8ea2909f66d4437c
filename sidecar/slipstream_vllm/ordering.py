"""Classification and the order of the waiting queues.

Classes. A request is offline only if ``vllm_xargs`` carries the pod's token under
``slipstream_offline`` (the sidecar puts it there; see
:mod:`slipstream_scheduler.enginecontrol`). Everything else is online, whatever it claims; a
forged tag is counted and ignored. Priorities are clamped to the class (in
``_Slipstream.add_request``): offline requests run at
:data:`~slipstream_vllm.scheduler.OFFLINE_PRIORITY` or below, online requests never below it,
so a client-supplied ``priority`` never lifts a request above its class (vLLM's own
preemption, which picks the largest ``(priority, arrival)``, therefore always takes offline
work first).

Order. The online waiting queue is sorted by the configured ordering (Gittins over predicted
output-length distributions by default in Slipstream's charts; past the tail guard's
deadline, in deadline order ahead of the ranked ones, ``slipstream_scheduler.tailguard``); the
offline waiting queue in PSM order over token-id blocks.

The predictor. The scheduler sees token ids, not text, so the online length predictor embeds
the prompt's token ids: the core's ``HashingEmbedder.embed_ids`` (signed hashing of id
unigrams and bigrams, first :data:`~slipstream_vllm.scheduler.EMBED_TOKENS` ids, in one
vectorised pass), which makes prompts that share a template or system prompt neighbours. It
is fed by every request that finishes in the engine.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

import numpy as np
from vllm.v1.request import Request

from slipstream_scheduler.enginecontrol import OFFLINE_TOKEN_ARG
from slipstream_scheduler.ordering import RequestView
from slipstream_scheduler.tailguard import unguarded_rank
from slipstream_scheduler.types import RequestClass
from slipstream_vllm.state import _OFFLINE, _ONLINE, _Meta, _State

# The plugin logs under one name, whichever of its modules speaks.
logger = logging.getLogger("slipstream_vllm.scheduler")

PSM_ORDER_TTL_S = 0.5
"""How long an unchanged PSM queue's order is reused (the fairness rule ages in minutes)."""

_NO_LENGTHS = np.zeros(0, dtype=np.float64)


class OrderingMixin(_State):
    """Each request's class, and the online and offline waiting queues in order (module note)."""

    # ------------------------------------------------------------------ requests

    def _classify(self, request: Request) -> RequestClass:
        args = request.sampling_params.extra_args if request.sampling_params else None
        if not args or OFFLINE_TOKEN_ARG not in args:
            return _ONLINE
        tag = args.pop(OFFLINE_TOKEN_ARG)
        if self._token is None:
            self._read_token()
        if isinstance(tag, str) and self._token and hmac.compare_digest(tag, self._token):
            return _OFFLINE
        self.forged_offline_tags += 1
        logger.warning(
            "slipstream: request %s carried an offline tag without the pod's token; "
            "served as online",
            request.request_id,
        )
        return _ONLINE

    def _class_of(self, request: Request) -> RequestClass:
        meta = self._meta.get(request.request_id)
        return meta.cls if meta is not None else _ONLINE

    def _waiting_requests(self) -> list[Request]:
        return [*self.kv_holding_waiting, *self.waiting]

    # ------------------------------------------------------------------ ordering

    def _online_view(self, req: Request, meta: _Meta) -> RequestView:
        """What the ordering sees of an online request now (its predicted lengths are drawn
        once, on first sight, for an ordering that reads them; the outliving fallback is the
        global distribution)."""
        lengths, fallback = meta.lengths, _NO_LENGTHS
        if lengths is None and self.ordering.needs_lengths:
            lengths = meta.lengths = self._predict(meta, req.num_prompt_tokens)
        if lengths is None:
            lengths = _NO_LENGTHS
        else:
            fallback = self._global_fallback()
        return RequestView(
            req.request_id,
            req.arrival_time,
            req.num_prompt_tokens,
            lengths,
            req.num_output_tokens,
            fallback,
            meta.keyed_at,
            int(getattr(req, "num_preemptions", 0)),
        )

    def _predict(self, meta: _Meta, prompt_tokens: int) -> Any:
        """The request's predicted output lengths, sorted; the global distribution when it has
        no embedding or the predictor faults (counted under ``predictor``)."""
        if meta.vector is not None:
            try:
                lengths = self._predictor.predict(meta.vector, prompt_tokens)
                return np.sort(np.asarray(lengths, dtype=np.float64))
            except Exception as exc:
                self._guard.record("predictor", exc)
        return self._global_fallback()

    def _global_fallback(self) -> Any:
        """The global length distribution, sorted (the core's ``GlobalFallback`` rule)."""
        return self._fallback.lengths

    def _online_key(self, req: Request, meta: _Meta) -> float:
        """The request's ordering key, recomputed only when the ordering asks (a new request,
        or one that crossed its re-ranking bucket of output tokens)."""
        generated = req.num_output_tokens
        if meta.keyed_at >= 0 and (generated == meta.keyed_at or not self.ordering.refresh_needed(
            RequestView(req.request_id, req.arrival_time, req.num_prompt_tokens, _NO_LENGTHS,
                        generated, _NO_LENGTHS, meta.keyed_at)
        )):
            return meta.key
        meta.key = self.ordering.key(self._online_view(req, meta))
        meta.keyed_at = generated
        return meta.key

    def _rank(self, req: Request, meta: _Meta, now: float) -> tuple[int, float, float]:
        """The request's place in the online order: the ordering's key, and past the tail
        guard's deadline, deadline order ahead of every key (``tailguard.py``)."""
        key = self._online_key(req, meta)
        guard = self.ordering.guard
        if guard is None:
            return unguarded_rank(key, req.arrival_time)
        return guard.rank(key, req.arrival_time, now)

    def _overdue(self, req: Request, now: float) -> bool:
        guard = self.ordering.guard
        return guard is not None and guard.overdue(req.arrival_time, now)

    def _ordered_queues(self, waiting: list[Request]) -> tuple[list[Request], list[Request]]:
        online: list[tuple[tuple[int, float, float], Request]] = []
        offline: list[Request] = []
        now = self.clock()
        for req in waiting:
            meta = self._meta.get(req.request_id)
            if meta is None or meta.cls is _ONLINE:
                if meta is None:
                    meta = self._meta[req.request_id] = _Meta(_ONLINE, request=req)
                online.append((self._rank(req, meta, now), req))
            else:
                offline.append(req)
        online.sort(key=lambda t: t[0])
        if self.offline_order == "psm" and offline:
            try:
                offline = self._psm_queue(offline)
            except Exception as exc:  # NOTE: PSM at fault: offline work in vLLM's order
                self._guard.record("psm", exc)
                offline.sort(key=lambda r: (r.priority, r.arrival_time))
        else:
            offline.sort(key=lambda r: (r.priority, r.arrival_time))
        return [t[1] for t in online], offline

    def _psm_queue(self, offline: list[Request]) -> list[Request]:
        by_id = {r.request_id: r for r in offline}
        for r in offline:  # a preempted offline request comes back into the trie
            if r.request_id not in self._psm:
                self._psm.push(r.request_id, r.prompt_token_ids or [], time.monotonic())
        order = self._psm_order(min(self.planner.rules.queue_window, len(self._psm)))
        picked = [by_id[rid] for rid in order if rid in by_id]
        in_order = set(order)
        rest = sorted(
            (r for r in offline if r.request_id not in in_order),
            key=lambda r: (r.priority, r.arrival_time),
        )
        return picked + rest

    def _psm_order(self, n: int) -> tuple[str, ...]:
        """The PSM queue's next ``n`` picks, reused while the queue is unchanged and for at
        most ``PSM_ORDER_TTL_S`` (the fairness rule ages waiting requests in seconds): a walk
        of the trie costs O(picks x prompt blocks), too much for every step of a long queue."""
        now = time.monotonic()
        key = (id(self._psm), self._psm.version, n)
        cached = self._psm_cache
        if cached is not None and cached[0] == key and now - cached[1] < PSM_ORDER_TTL_S:
            return cached[2]
        order = self._psm.peek_order(n, now)
        self._psm_cache = (key, now, order)
        return order
