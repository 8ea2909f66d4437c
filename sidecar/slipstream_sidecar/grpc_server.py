"""The control API (gRPC, ``proto/sidecar.proto``): protobuf in, :class:`Sidecar` calls out.

Every method translates a request into a call on :class:`~slipstream_sidecar.app.Sidecar`
and its answer back into protobuf; errors become gRPC status codes here and
nowhere else. Authentication is the :class:`BearerAuthInterceptor`'s.

Deliberately left out: any state of its own.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from math import inf

import grpc

from slipstream_scheduler.latency import (
    FEATURE_NAMES,
    MAX_CURVE_KNOTS,
    MAX_CURVE_SPAN_TOKENS,
    LinearLatencyModel,
)
from slipstream_scheduler.learning import Learned
from slipstream_scheduler.storage_scope import ScopeError, check_uri
from slipstream_sidecar.app import ConfigUpdate, Sidecar, SidecarStatus, Slo
from slipstream_sidecar.auth import BearerAuthInterceptor, TokenFile
from slipstream_sidecar.metrics import ClassCounters, HistogramSnapshot
from slipstream_sidecar.proto import sidecar_pb2 as pb
from slipstream_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from slipstream_sidecar.shards import ShardProgress, ShardSpec
from slipstream_sidecar.startprofile import ProfiledModel
from slipstream_sidecar.watch import paced_snapshots

log = logging.getLogger(__name__)


def progress_pb(p: ShardProgress) -> pb.ShardProgress:
    return pb.ShardProgress(
        shard_id=p.shard_id,
        state=int(p.state),  # type: ignore[arg-type]
        total=p.total,
        completed=p.completed,
        failed=p.failed,
        in_flight=p.in_flight,
        output_tokens=p.output_tokens,
        preemptions=p.preemptions,
        tokens_per_second=p.tokens_per_second,
        message=p.message,
    )


def status_pb(s: SidecarStatus) -> pb.StatusResponse:
    msg = pb.StatusResponse(
        generation=s.generation,
        online=pb.ClassStatus(
            queued=s.online.queued, in_flight=s.online.in_flight,
            admitted_total=s.online.admitted_total, preempted_total=s.online.preempted_total,
        ),
        offline=pb.ClassStatus(
            queued=s.offline.queued, in_flight=s.offline.in_flight,
            admitted_total=s.offline.admitted_total, preempted_total=s.offline.preempted_total,
        ),
        spare_capacity=s.spare_capacity,
        engine_ready=s.engine_ready,
        draining=s.draining,
        shards=[progress_pb(p) for p in s.shards],
        predicted_step_s=s.predicted_step_s,
        observed_step_s=s.observed_step_s,
        ordering=s.ordering,
        latency_model=latency_spec_pb(s.latency_model),
    )
    if s.kv_cache is not None:
        msg.kv_cache.CopyFrom(
            pb.KvCache(
                num_blocks=s.kv_cache.kv_blocks,
                block_size=s.kv_cache.block_size,
                num_blocks_source=s.kv_cache.kv_blocks_source,
                block_size_source=s.kv_cache.block_size_source,
            )
        )
    if s.budget_s is not None:
        msg.budget_s = s.budget_s
    if s.idle_budget_s is not None:
        msg.idle_budget_s = s.idle_budget_s
    if s.online_counters is not None:
        msg.online_counters.CopyFrom(counters_pb(s.online_counters))
    if s.learned is not None:
        msg.learned_model.CopyFrom(learned_pb(s.learned))
    elif s.profiled is not None:
        msg.learned_model.CopyFrom(profiled_pb(s.profiled))
    elif s.learning is not None and s.learning.seen > 0:
        # Learning, no fit used yet: the steps seen and the last fit's held-out error.
        last = s.learning.last
        err = last.heldout_mape if last is not None and last.heldout_mape is not None else inf
        msg.learned_model.CopyFrom(pb.LearnedModel(source="learned",
                                                   seen_steps=s.learning.seen, heldout_mape=err))
    return msg


def learned_pb(lr: Learned) -> pb.LearnedModel:
    return pb.LearnedModel(
        model=latency_spec_pb(lr.model), source="learned", fit_steps=lr.fit_steps,
        seen_steps=lr.seen_steps, heldout_mape=lr.heldout_mape, revision=lr.revision,
        fitted_at=lr.fitted_at,
    )


def profiled_pb(p: ProfiledModel) -> pb.LearnedModel:
    """The model profiled at start, as a ``LearnedModel`` of source ``profiled`` (its
    steps are the rows it was fitted on; inf held-out error: unknown)."""
    return pb.LearnedModel(
        model=latency_spec_pb(p.model), source="profiled", fit_steps=p.rows,
        seen_steps=p.rows, heldout_mape=p.heldout_mape, revision=1, fitted_at=p.fitted_at,
    )


def histogram_pb(h: HistogramSnapshot) -> pb.Histogram:
    return pb.Histogram(upper_bounds=[le for le, _ in h.buckets],
                        cumulative_counts=[c for _, c in h.buckets], sum=h.total, count=h.count)


def counters_pb(c: ClassCounters) -> pb.ClassCounters:
    return pb.ClassCounters(
        ttft_seconds=histogram_pb(c.ttft), tbt_seconds=histogram_pb(c.tbt),
        admitted=c.admitted, finished_ok=c.finished_ok, output_tokens=c.output_tokens,
    )


def shard_spec(shard: pb.Shard) -> ShardSpec:
    defaults = json.loads(shard.request_defaults_json) if shard.request_defaults_json else {}
    if not isinstance(defaults, dict):
        raise ValueError("request_defaults_json is not a JSON object")
    return ShardSpec(
        shard_id=shard.shard_id,
        job_namespace=shard.job_namespace,
        job_name=shard.job_name,
        model=shard.model,
        input_uri=shard.input_uri,
        line_start=shard.line_start,
        line_end=shard.line_end,
        output_uri=shard.output_uri,
        error_uri=shard.error_uri,
        priority=shard.priority,
        request_defaults=defaults,
    )


def configure_problem(request: pb.ConfigureRequest) -> str | None:
    """Why a ``Configure`` request must be refused (naming the field), or None.

    NaN and infinities parse fine from protobuf but would be applied and persisted; a
    budget or SLO must be finite and positive, a latency coefficient finite and, except the
    intercept ``const`` (a least-squares fit may leave it below zero), non-negative: the
    same rule as ``slipstream_scheduler.latency``, which keeps the model monotone.
    """
    if request.HasField("budget_s") and not (
        math.isfinite(request.budget_s) and request.budget_s > 0
    ):
        return f"budget_s must be finite and positive, got {request.budget_s!r}"
    if request.HasField("idle_budget_s") and not (
        request.idle_budget_s >= 0 and not math.isnan(request.idle_budget_s)
    ):
        return f"idle_budget_s must be 0, positive or +inf, got {request.idle_budget_s!r}"
    if request.HasField("max_wait_s") and not (
        math.isfinite(request.max_wait_s) and request.max_wait_s >= 0
    ):
        return f"max_wait_s must be 0 (no guard) or finite and positive, got {request.max_wait_s!r}"
    for name in ("ttft_p99_s", "ttft_mean_s", "tbt_p99_s", "tbt_mean_s"):
        value = _opt(request.slo, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            return f"slo.{name} must be finite and positive, got {value!r}"
    for key, value in sorted(request.latency_model.coefficients.items()):
        if not math.isfinite(value):
            return f"latency_model.coefficients[{key!r}] must be finite, got {value!r}"
        if key != "const" and value < 0:
            return f"latency_model.coefficients[{key!r}] must be non-negative, got {value!r}"
    return curve_problem(request.latency_model)


def curve_problem(spec: pb.LatencyModelSpec) -> str | None:
    """Why the spec's token curve is unusable (naming the field), or None.

    The curve is the ``context+chunk+curve`` set's ``phi`` at every ``curve_step_tokens``
    tokens: bounded in length (a call must not make the sidecar allocate without limit),
    finite, starting at 0 and non-decreasing (the model must stay monotone in the batch).
    Whether the kind wants a curve at all is the model's own check (``latency.py``).
    """
    curve, step = spec.token_curve, spec.curve_step_tokens
    if not curve:
        if step:
            return f"latency_model.curve_step_tokens is {step} but token_curve is empty"
        return None
    if step <= 0:
        return "latency_model.curve_step_tokens must be positive with a token_curve"
    if not 2 <= len(curve) <= MAX_CURVE_KNOTS:
        return (
            f"latency_model.token_curve must hold 2 to {MAX_CURVE_KNOTS} values, "
            f"got {len(curve)}"
        )
    if (len(curve) - 1) * step > MAX_CURVE_SPAN_TOKENS:
        return (
            f"latency_model.token_curve spans {(len(curve) - 1) * step} tokens, more than "
            f"{MAX_CURVE_SPAN_TOKENS}"
        )
    previous = 0.0
    for i, value in enumerate(curve):
        if not math.isfinite(value) or value < 0:
            return f"latency_model.token_curve[{i}] must be finite and non-negative, got {value!r}"
        if i == 0 and value != 0.0:
            return f"latency_model.token_curve[0] must be 0, got {value!r}"
        if value < previous:
            return (
                f"latency_model.token_curve must be non-decreasing: [{i}] = {value!r} < "
                f"[{i - 1}] = {previous!r}"
            )
        previous = value
    return None


def latency_spec_pb(model: LinearLatencyModel | None) -> pb.LatencyModelSpec:
    """The spec that rebuilds ``model`` (``brain.latency_model_from_spec``); empty for None."""
    if model is None:
        return pb.LatencyModelSpec()
    return pb.LatencyModelSpec(
        kind=model.feature_set.value,
        coefficients={
            n: c for n, c in zip(FEATURE_NAMES, model.coefficients, strict=True) if c != 0.0
        },
        knee_tokens=model.knee_tokens,
        token_curve=model.token_curve,
        curve_step_tokens=model.curve_step_tokens,
    )


def _opt(msg: pb.Slo, name: str) -> float | None:
    return getattr(msg, name) if msg.HasField(name) else None  # type: ignore[arg-type]


class SidecarServicer(pb_grpc.SidecarServicer):
    """Implements ``slipstream.sidecar.v1alpha1.Sidecar``."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    async def Configure(  # noqa: N802
        self, request: pb.ConfigureRequest, context: grpc.aio.ServicerContext
    ) -> pb.ConfigureResponse:
        problem = configure_problem(request)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        update = ConfigUpdate(
            generation=request.generation,
            budget_s=request.budget_s if request.HasField("budget_s") else None,
            slo=Slo(
                ttft_p99_s=_opt(request.slo, "ttft_p99_s"),
                ttft_mean_s=_opt(request.slo, "ttft_mean_s"),
                tbt_p99_s=_opt(request.slo, "tbt_p99_s"),
                tbt_mean_s=_opt(request.slo, "tbt_mean_s"),
            ),
            ordering=request.ordering,
            latency_kind=request.latency_model.kind,
            latency_coefficients=dict(request.latency_model.coefficients),
            latency_knee_tokens=request.latency_model.knee_tokens,
            latency_token_curve=tuple(request.latency_model.token_curve),
            latency_curve_step_tokens=request.latency_model.curve_step_tokens,
            idle_budget_s=request.idle_budget_s if request.HasField("idle_budget_s") else None,
            max_wait_s=request.max_wait_s if request.HasField("max_wait_s") else None,
        )
        try:
            generation, applied = self.sidecar.configure(update)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.ConfigureResponse(generation=generation, applied=applied)

    async def AssignShard(  # noqa: N802
        self, request: pb.AssignShardRequest, context: grpc.aio.ServicerContext
    ) -> pb.AssignShardResponse:
        shard = request.shard
        if not shard.shard_id or not shard.input_uri or not shard.output_uri:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "shard_id, input_uri and output_uri are required"
            )
        try:
            spec = shard_spec(shard)
        except (ValueError, RecursionError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not spec.error_uri:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "error_uri is required")
        roots = self.sidecar.settings.storage_roots
        try:
            for field_name in ("input_uri", "output_uri", "error_uri"):
                check_uri(
                    getattr(spec, field_name), namespace=spec.job_namespace, roots=roots,
                    field=field_name,
                )
        except ScopeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        accepted, progress = self.sidecar.assign(spec)
        return pb.AssignShardResponse(accepted=accepted, progress=progress_pb(progress))

    async def RevokeShard(  # noqa: N802
        self, request: pb.RevokeShardRequest, context: grpc.aio.ServicerContext
    ) -> pb.RevokeShardResponse:
        revoked, progress = await self.sidecar.revoke(request.shard_id)
        resp = pb.RevokeShardResponse(revoked=revoked)
        if progress is not None:
            resp.progress.CopyFrom(progress_pb(progress))
        return resp

    async def Status(  # noqa: N802
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusResponse:
        return status_pb(self.sidecar.status())

    async def WatchStatus(  # noqa: N802
        self, request: pb.WatchStatusRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StatusResponse]:
        interval = request.interval_s or self.sidecar.settings.status_interval_s
        async for msg in paced_snapshots(lambda: status_pb(self.sidecar.status()),
                                         interval_s=interval,
                                         min_interval_s=request.min_interval_s):
            yield msg

    async def Drain(  # noqa: N802
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainResponse:
        drained, left = await self.sidecar.drain(max(request.timeout_s, 0.0))
        return pb.DrainResponse(drained=drained, online_in_flight=left)


async def serve_grpc(sidecar: Sidecar, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the control server; returns it and the bound port."""
    server = grpc.aio.server(
        interceptors=[BearerAuthInterceptor(TokenFile(sidecar.settings.auth_token_file))]
    )
    pb_grpc.add_SidecarServicer_to_server(SidecarServicer(sidecar), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    if sidecar.settings.auth_token_file is None:
        log.warning("no --auth-token-file: every control call will be refused")
    return server, bound
