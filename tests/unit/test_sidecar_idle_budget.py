"""The idle budget through ``Configure``: applied to the live dispatcher, kept, cleared, durable."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from slipstream_sidecar.app import ConfigUpdate, Sidecar
from slipstream_sidecar.grpc_server import configure_problem, status_pb
from slipstream_sidecar.proto import sidecar_pb2 as pb
from slipstream_sidecar.settings import SidecarSettings

pytestmark = pytest.mark.unit


def _sidecar(state: Path, idle: float | None = None) -> Sidecar:
    return Sidecar(SidecarSettings(state_dir=state, idle_budget_s=idle))


async def test_configure_sets_keeps_and_clears_the_idle_budget(tmp_path: Path) -> None:
    sc = _sidecar(tmp_path, idle=0.3)
    assert sc.dispatcher.config.idle_budget_s == pytest.approx(0.3)
    sc.configure(ConfigUpdate(generation=1, budget_s=0.05, idle_budget_s=0.2))
    assert sc.dispatcher.config.idle_budget_s == pytest.approx(0.2)
    assert status_pb(sc.status()).idle_budget_s == pytest.approx(0.2)
    sc.configure(ConfigUpdate(generation=2, budget_s=0.04))  # absent: kept
    assert sc.dispatcher.config.idle_budget_s == pytest.approx(0.2)
    assert sc.dispatcher.budget_s == pytest.approx(0.04)
    sc.configure(ConfigUpdate(generation=3, budget_s=0.04, idle_budget_s=math.inf))
    assert math.isinf(sc.dispatcher.config.idle_budget_s or 0.0)
    sc.configure(ConfigUpdate(generation=4, budget_s=0.04, idle_budget_s=0.0))  # 0: none
    assert sc.dispatcher.config.idle_budget_s is None
    assert not status_pb(sc.status()).HasField("idle_budget_s")


async def test_the_configured_idle_budget_survives_a_restart(tmp_path: Path) -> None:
    sc = _sidecar(tmp_path, idle=0.3)
    sc.configure(ConfigUpdate(generation=1, budget_s=0.05, idle_budget_s=0.25))
    sc.configure(ConfigUpdate(generation=2, budget_s=0.05))  # keeps 0.25
    restarted = _sidecar(tmp_path, idle=0.3)
    assert restarted.generation == 2
    assert restarted.dispatcher.config.idle_budget_s == pytest.approx(0.25)
    untouched = _sidecar(tmp_path / "other", idle=0.3)
    untouched.configure(ConfigUpdate(generation=1, budget_s=0.05))
    assert _sidecar(tmp_path / "other", idle=0.3).dispatcher.config.idle_budget_s == 0.3


@pytest.mark.parametrize("bad", [-0.1, math.nan, -math.inf])
def test_configure_refuses_a_negative_or_nan_idle_budget(bad: float) -> None:
    problem = configure_problem(pb.ConfigureRequest(generation=1, idle_budget_s=bad))
    assert problem is not None and "idle_budget_s" in problem


@pytest.mark.parametrize("good", [0.0, 0.2, math.inf])
def test_configure_accepts_zero_positive_and_infinite_idle_budgets(good: float) -> None:
    assert configure_problem(pb.ConfigureRequest(generation=1, idle_budget_s=good)) is None
