"""When ``WatchStatus`` sends a snapshot: on a heartbeat, and on a change the operator acts on.

A snapshot's *change signature* is the part of ``StatusResponse`` an InferenceService's status
shows and its tick acts on: the generation and budgets in force, readiness, draining, and the
online class's counters (a new request finished means new latency samples). Shards, progress
counts, rates, step times and the spare-capacity estimate are left out: they move all the time
on a pod running offline work, the heartbeat carries them, and OfflineJob ticks read them at
their own pace (the operator drops a pod's reply whenever it assigns or revokes a shard there,
so the next look asks the pod).

:func:`paced_snapshots` is the stream's pacing, shared by the sidecar's servicer and the fleet
stand-in: the first snapshot at once, then one whenever the signature differs from the last
one sent (never two closer than ``min_interval_s``; the first change after a quiet spell goes
out at once), and one every ``interval_s`` whatever happens. The operator uses the same
signature to tell a change from a heartbeat (``slipstream_operator.statusfeed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Hashable

from slipstream_sidecar.proto import sidecar_pb2 as pb

POLL_S = 0.25
"""How often a stream with no change event looks for a change (the sidecar's own servicer)."""


def change_signature(msg: pb.StatusResponse) -> tuple[Hashable, ...]:
    """What the operator acts on in one snapshot (see the module docstring)."""
    counters = msg.online_counters
    return (
        msg.generation,
        msg.budget_s if msg.HasField("budget_s") else None,
        msg.idle_budget_s if msg.HasField("idle_budget_s") else None,
        msg.engine_ready,
        msg.draining,
        msg.online.admitted_total,
        (counters.admitted, counters.finished_ok, counters.ttft_seconds.count,
         counters.tbt_seconds.count) if msg.HasField("online_counters") else None,
        msg.learned_model.revision if msg.HasField("learned_model") else None,
    )


async def paced_snapshots(
    snapshot: Callable[[], pb.StatusResponse],
    *,
    interval_s: float,
    min_interval_s: float = 0.0,
    changed: asyncio.Event | None = None,
    poll_s: float = POLL_S,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[pb.StatusResponse]:
    """Snapshots for one ``WatchStatus`` stream, until the caller stops iterating.

    ``changed`` (optional) is set by the owner whenever something in the signature may have
    moved; without it the stream takes a snapshot every ``poll_s`` to look. With
    ``min_interval_s`` 0 the stream sends every ``interval_s`` only (the pacing of sidecars
    that predate the field).
    """
    interval_s = max(interval_s, 0.01)
    msg = snapshot()
    yield msg
    last_sent, last_sig = clock(), change_signature(msg)
    while True:
        heartbeat_at = last_sent + interval_s
        wait = max(heartbeat_at - clock(), 0.0)
        if min_interval_s <= 0:
            await asyncio.sleep(wait)
        elif changed is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=wait)
            changed.clear()
        else:
            await asyncio.sleep(min(poll_s, wait))
        msg = snapshot()
        now = clock()
        if now < heartbeat_at:
            if min_interval_s <= 0 or change_signature(msg) == last_sig:
                continue
            hold = last_sent + min_interval_s - now
            if hold > 0:  # a change too soon after the last snapshot waits its turn
                await asyncio.sleep(hold)
                msg = snapshot()
                now = clock()
        yield msg
        last_sent, last_sig = now, change_signature(msg)
