"""Draining a deleted InferenceService's pods of offline work before they go.

When an InferenceService is deleted its Deployment is garbage-collected and
its pods stop; offline shards running there would only be noticed as lost once
they stall. The operator's deletion handler (guarded by its finalizer) calls
:func:`drain_service` first:

1. every running pod of the service gets the sidecar's ``Drain`` call with a
   zero online wait: the sidecar stops accepting shards, revokes (and forgets)
   every shard it runs and reports ``draining``, so the OfflineJob reconciler
   sees the shards gone and the pod not ready, and places the shards on other
   pods of matching services at its next tick (lines already written stay in
   the shard's output and are not run twice);
2. the pods' Status is polled until none reports a pending or running shard,
   or ``timeout_s`` passes (a bounded wait: an unreachable pod does not hold
   the deletion; its shards move when their stall timeout fires).

Deliberately left out: waiting for online requests in flight (the pods'
termination grace period covers them) and deleting anything (the
ownerReferences do that).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kubernetes import client

from slipstream_operator import kube
from slipstream_operator.errors import SidecarError
from slipstream_operator.sidecar_client import (
    ACTIVE_STATES,
    GrpcSidecarControl,
    PodAddress,
    SidecarStatus,
)

logger = logging.getLogger(__name__)



class DrainControl(Protocol):
    """The two sidecar calls a drain makes. Raise :class:`SidecarError` on failure."""

    async def status(self, address: PodAddress) -> SidecarStatus: ...

    async def drain(self, address: PodAddress, timeout_s: float) -> bool:
        """Returns whether no online request is in flight any more."""
        ...


@dataclass(frozen=True, slots=True)
class DrainReport:
    """What a drain achieved, for the deletion event and the log."""

    pods: int
    shards_before: int  # pending or running shards on the pods when the drain began
    unreachable: tuple[str, ...] = ()
    still_active: tuple[str, ...] = ()  # pods still reporting active shards at the deadline

    @property
    def complete(self) -> bool:
        return not self.unreachable and not self.still_active

    def summary(self) -> str:
        text = f"drained {self.pods} pods of {self.shards_before} offline shards"
        if self.unreachable:
            text += f"; unreachable: {', '.join(self.unreachable)}"
        if self.still_active:
            text += f"; still running shards at the deadline: {', '.join(self.still_active)}"
        return text


def _active(status: SidecarStatus) -> int:
    return sum(1 for s in status.shards if s.state in ACTIVE_STATES)


async def drain_pods(
    control: DrainControl,
    addresses: Sequence[PodAddress],
    *,
    timeout_s: float,
    poll_s: float = 0.25,
) -> DrainReport:
    """Drain every pod at once, then wait (at most ``timeout_s``) until no shard is active."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s

    async def first(address: PodAddress) -> tuple[int, bool]:
        try:
            before = _active(await control.status(address))
            await control.drain(address, 0.0)
        except SidecarError as exc:
            logger.warning("drain of pod %s failed: %s", address.pod, exc)
            return 0, False
        return before, True

    results = await asyncio.gather(*(first(a) for a in addresses))
    shards_before = sum(n for n, _ in results)
    unreachable = tuple(a.pod for a, (_, ok) in zip(addresses, results, strict=True) if not ok)
    waiting = [a for a, (_, ok) in zip(addresses, results, strict=True) if ok]
    while waiting:
        statuses = await asyncio.gather(
            *(control.status(a) for a in waiting), return_exceptions=True
        )
        waiting = [
            a
            for a, st in zip(waiting, statuses, strict=True)
            if isinstance(st, SidecarStatus) and _active(st) > 0
        ]
        if not waiting or loop.time() + poll_s > deadline:
            break
        await asyncio.sleep(poll_s)
    return DrainReport(
        pods=len(addresses),
        shards_before=shards_before,
        unreachable=unreachable,
        still_active=tuple(a.pod for a in waiting),
    )


async def drain_service(
    api: client.ApiClient,
    control: DrainControl,
    *,
    namespace: str,
    name: str,
    grpc_port: int,
    token_secret: str,
    token_key: str,
    selector: str,
    timeout_s: float,
    loopback_only: bool = False,
) -> DrainReport:
    """List the service's running pods, read its control token and :func:`drain_pods` them."""
    pods = await asyncio.to_thread(kube.list_pods, api, namespace, selector)
    token = await asyncio.to_thread(kube.read_secret_value, api, namespace, token_secret, token_key)
    if token is None:
        logger.warning("InferenceService %s/%s has no control token; not draining", namespace, name)
        return DrainReport(
            pods=0, shards_before=0, unreachable=tuple(p.name for p in pods if p.running)
        )
    addresses = [
        PodAddress(p.name, p.ip, grpc_port, token)
        for p in pods
        if p.running and kube.dialable(p.ip, loopback_only)
    ]
    return await drain_pods(control, addresses, timeout_s=timeout_s)


class GrpcDrainControl:
    """:class:`DrainControl` over grpc.aio.

    Status goes through ``status_control`` when given, else through an own uncached
    :class:`GrpcSidecarControl` (a cached Status would hide the drain's effect).
    """

    def __init__(self, timeout_s: float = 5.0, status_control: StatusSource | None = None) -> None:
        self._status = status_control or GrpcSidecarControl(timeout_s)
        self._owns_status = status_control is None
        self._timeout_s = timeout_s
        self._channels: dict[str, object] = {}

    async def status(self, address: PodAddress) -> SidecarStatus:
        return await self._status.status(address)

    async def drain(self, address: PodAddress, timeout_s: float) -> bool:
        import grpc

        from slipstream_sidecar.proto import sidecar_pb2 as pb
        from slipstream_sidecar.proto import sidecar_pb2_grpc

        channel = self._channels.get(address.target)
        if channel is None:
            channel = grpc.aio.insecure_channel(address.target)
            self._channels[address.target] = channel
        stub = sidecar_pb2_grpc.SidecarStub(channel)
        metadata = (("authorization", f"Bearer {address.token}"),)
        deadline = self._timeout_s + timeout_s
        try:
            reply = await asyncio.wait_for(
                stub.Drain(
                    pb.DrainRequest(timeout_s=timeout_s), metadata=metadata, timeout=deadline
                ),
                deadline + 1.0,
            )
        except grpc.aio.AioRpcError as exc:
            raise SidecarError(
                f"Drain failed: {exc.code().name}: {exc.details()}",
                pod=address.pod,
                address=address.target,
            ) from exc
        except (grpc.RpcError, TimeoutError, OSError) as exc:
            raise SidecarError(
                f"Drain failed: {exc!r}", pod=address.pod, address=address.target
            ) from exc
        return bool(reply.drained)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()  # type: ignore[attr-defined]
        self._channels.clear()
        if self._owns_status and isinstance(self._status, GrpcSidecarControl):
            await self._status.close()


class StatusSource(Protocol):
    """Anything with the sidecar client's ``status`` (e.g. the handlers' control)."""

    async def status(self, address: PodAddress) -> SidecarStatus: ...
