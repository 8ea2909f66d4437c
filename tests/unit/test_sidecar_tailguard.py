"""The ordering's tail guard through ``Configure``: from the service's setting or its SLO, into
the sidecar's online queue and the control document the plugin inside vLLM reads."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from slipstream_scheduler.dispatcher import OrderingQueue
from slipstream_scheduler.tailguard import DEFAULT_MAX_WAIT_S, MEAN_TARGET_FACTOR, TailGuard
from slipstream_sidecar.app import ConfigUpdate, Sidecar, Slo
from slipstream_sidecar.enginechannel import EngineChannel
from slipstream_sidecar.grpc_server import configure_problem
from slipstream_sidecar.proto import sidecar_pb2 as pb
from slipstream_sidecar.settings import SidecarSettings

pytestmark = pytest.mark.unit


def _guard(sc: Sidecar) -> TailGuard | None:
    queue = sc.dispatcher.online_queue
    assert isinstance(queue, OrderingQueue)
    return queue.ordering.guard


async def test_the_guard_follows_the_setting_then_the_slo_then_the_default(
    tmp_path: Path,
) -> None:
    sc = Sidecar(SidecarSettings(state_dir=tmp_path))
    assert _guard(sc) == TailGuard(DEFAULT_MAX_WAIT_S)  # before any Configure
    sc.configure(ConfigUpdate(generation=1, budget_s=0.05, slo=Slo(ttft_p99_s=2.0)))
    assert _guard(sc) == TailGuard(2.0)
    sc.configure(ConfigUpdate(generation=2, budget_s=0.05, slo=Slo(ttft_mean_s=0.5)))
    assert _guard(sc) == TailGuard(MEAN_TARGET_FACTOR * 0.5)
    sc.configure(ConfigUpdate(generation=3, budget_s=0.05, slo=Slo(ttft_p99_s=2.0),
                              max_wait_s=45.0))
    assert _guard(sc) == TailGuard(45.0)
    sc.configure(ConfigUpdate(generation=4, budget_s=0.05, max_wait_s=0.0))  # 0: none
    assert _guard(sc) is None
    restarted = Sidecar(SidecarSettings(state_dir=tmp_path))
    assert restarted.generation == 4 and _guard(restarted) is None
    fcfs = Sidecar(SidecarSettings(state_dir=tmp_path / "fcfs", ordering="fcfs"))
    assert _guard(fcfs) is None  # arrival order needs no guard


async def test_engine_mode_hands_the_guard_to_the_plugin(tmp_path: Path) -> None:
    channel = tmp_path / "channel"
    channel.mkdir()
    sc = Sidecar(SidecarSettings(state_dir=tmp_path / "state", engine_channel=channel))
    sc.configure(ConfigUpdate(generation=1, budget_s=0.05, slo=Slo(ttft_p99_s=3.0)))
    doc = EngineChannel(channel).read_control()
    assert doc is not None and doc.ordering == "gittins"
    assert doc.ordering_params == {"cost": "memory", "max_wait_s": 3.0}
    sc.configure(ConfigUpdate(generation=2, budget_s=0.05, max_wait_s=0.0))
    doc = EngineChannel(channel).read_control()
    assert doc is not None and "max_wait_s" not in doc.ordering_params


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_configure_refuses_a_bad_max_wait(bad: float) -> None:
    problem = configure_problem(pb.ConfigureRequest(generation=1, max_wait_s=bad))
    assert problem is not None and "max_wait_s" in problem
    assert configure_problem(pb.ConfigureRequest(generation=1, max_wait_s=0.0)) is None
