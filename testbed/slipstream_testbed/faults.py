"""Fault injection for reliability runs: seeded fault schedules and control-plane restarts.

Two things live here:

* :func:`plan_faults` turns a seed into a :class:`FaultPlan`: which faults
  strike (``kill -9`` of a sidecar, of an engine, of the operator; a restart
  of kube-apiserver or etcd) and at what point of a job's progress (a
  fraction of its requests done), so that a failing run can be replayed
  exactly from its seed.
* :class:`ControlPlane` kills (SIGKILL, no grace) and restarts one component
  of a :class:`~slipstream_testbed.cluster.LocalCluster` by the PID file the
  cluster keeps, then waits until the component answers its health check
  again. It only ever signals PIDs the cluster itself recorded and that still
  run the component's binary.

* :func:`plan_timed_faults` does the same for a soak: ``kill -9`` of an engine, a sidecar
  or the operator at seeded times of a long run (``slipstream bench soak``).

Deliberately left out: killing the sidecar, engine and operator processes
(tests and the soak own those processes and kill them directly), and any
assertion about what a fault did (the tests and the soak judge that).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Literal

from slipstream_testbed.cluster import (
    COMPONENT_ORDER,
    ClusterError,
    Component,
    LocalCluster,
    pid_alive,
)

LOG = logging.getLogger(__name__)

FaultKind = Literal[
    "kill-sidecar", "kill-engine", "kill-operator", "restart-apiserver", "restart-etcd"
]
ALL_FAULTS: tuple[FaultKind, ...] = (
    "kill-sidecar", "kill-engine", "kill-operator", "restart-apiserver", "restart-etcd"
)


class FaultError(ClusterError):
    """A fault could not be injected or the component did not come back (``component``)."""

    def __init__(self, component: str, message: str) -> None:
        super().__init__(f"{component}: {message}")
        self.component = component


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: what, when (fraction of the job's requests done) and where (pod index)."""

    kind: FaultKind
    at_progress: float
    target: int = 0
    down_s: float = 1.0


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """The faults of one seeded run, in the order they strike."""

    seed: int
    faults: tuple[Fault, ...]

    def describe(self) -> str:
        return ", ".join(
            f"{f.kind}@{f.at_progress:.0%}" + (f"[pod {f.target}]" if "sidecar" in f.kind
                                                or "engine" in f.kind else "")
            for f in self.faults
        )


def plan_faults(
    seed: int,
    kinds: tuple[FaultKind, ...] = ALL_FAULTS,
    *,
    pods: int = 2,
    first: float = 0.08,
    last: float = 0.85,
    max_down_s: float = 3.0,
) -> FaultPlan:
    """Every kind in ``kinds`` once, at seeded random points in ``[first, last]`` of progress.

    The points are sorted and spaced at least 3 % apart so each fault is observed on its own;
    each fault gets a seeded target pod and a downtime between 0.2 s and ``max_down_s``.
    """
    if not 0.0 <= first < last <= 1.0:
        raise ValueError(f"progress window [{first}, {last}] is empty")
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    points: list[float] = []
    while len(points) < len(order):
        p = rng.uniform(first, last)
        if all(abs(p - q) >= 0.03 for q in points):
            points.append(p)
    points.sort()
    faults = tuple(
        Fault(kind, round(p, 4), rng.randrange(pods), round(rng.uniform(0.2, max_down_s), 2))
        for kind, p in zip(order, points, strict=True)
    )
    return FaultPlan(seed, faults)


POD_KILLS: tuple[FaultKind, ...] = ("kill-engine", "kill-sidecar", "kill-operator")
"""The faults of a soak: ``kill -9`` of a pod's process, which its pod runner restarts."""


@dataclass(frozen=True, slots=True)
class TimedFault:
    """One fault of a soak: what, when (seconds after the load starts) and which pod."""

    kind: FaultKind
    at_s: float
    target: int = 0


def plan_timed_faults(
    seed: int,
    duration_s: float,
    every_s: float,
    kinds: tuple[FaultKind, ...] = POD_KILLS,
    *,
    pods: int = 2,
) -> tuple[TimedFault, ...]:
    """A fault about every ``every_s`` seconds in ``(every_s / 2, duration_s - every_s / 2)``.

    Each fault strikes at a seeded point of its own slot (the slot's middle half, so two
    faults are at least ``every_s / 2`` apart and each is seen on its own); the kinds come
    in seeded rounds that hold every kind once, so a soak strikes each as often as the
    others, and each fault names a seeded pod.
    """
    if every_s <= 0 or duration_s < every_s:
        raise ValueError(f"no fault fits: duration {duration_s:g}s, one every {every_s:g}s")
    if not kinds or pods < 1:
        raise ValueError("a plan needs at least one kind of fault and one pod")
    rng = random.Random(seed)
    slots = int(duration_s // every_s)
    order: list[FaultKind] = []
    while len(order) < slots:
        round_ = list(kinds)
        rng.shuffle(round_)
        order.extend(round_)
    return tuple(
        TimedFault(kind, round(every_s * (i + rng.uniform(0.25, 0.75)), 1), rng.randrange(pods))
        for i, kind in enumerate(order[:slots])
    )


COMPONENT_OF: dict[FaultKind, str] = {
    "restart-apiserver": "kube-apiserver",
    "restart-etcd": "etcd",
}


class ControlPlane:
    """Kill and restart the components of one local cluster by their recorded PIDs.

    NOTE: uses :class:`LocalCluster`'s component table, PID files and health wait (its
    underscore methods); a public ``kill``/``start`` on the cluster would replace them.
    """

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster

    def _component(self, name: str) -> Component:
        if name not in COMPONENT_ORDER:
            raise FaultError(name, f"not a component of the local cluster ({COMPONENT_ORDER})")
        for comp in self.cluster._components():
            if comp.name == name:
                return comp
        raise FaultError(name, "no such component")  # pragma: no cover - table is static

    def kill(self, name: str) -> int:
        """SIGKILL the component; returns the PID it had. Waits until the PID is gone."""
        self._component(name)
        binary = self.cluster._binary(name)
        pid = self.cluster._read_pid(name)
        if pid is None or not pid_alive(pid, binary):
            raise FaultError(name, "is not running")
        LOG.warning("fault: kill -9 %s (pid %d)", name, pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(pid, binary):
            if time.monotonic() > deadline:
                raise FaultError(name, f"pid {pid} survived SIGKILL for 10 s")
            time.sleep(0.02)
        return pid

    def start(self, name: str, timeout_s: float = 120.0) -> int:
        """Start the component again with its original arguments; wait until it is healthy."""
        comp = self._component(name)
        self.cluster._start(comp)
        self.cluster._wait_healthy(comp, timeout_s)
        pid = self.cluster._read_pid(name)
        if pid is None:
            raise FaultError(name, "started without a PID file")
        LOG.warning("fault: %s is back (pid %d)", name, pid)
        return pid

    def restart(self, name: str, down_s: float = 1.0, timeout_s: float = 120.0) -> float:
        """kill -9, stay down ``down_s``, start; returns the seconds until healthy again."""
        t0 = time.monotonic()
        self.kill(name)
        time.sleep(down_s)
        self.start(name, timeout_s)
        return time.monotonic() - t0
