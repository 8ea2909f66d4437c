"""``vllm serve --scheduler-cls slipstream_vllm.scheduler.SlipstreamScheduler`` on CPU.

The plugin loads in vLLM's engine core process, reads its control document from the channel
directory, serves online and offline requests (offline proven by the pod's token in
``vllm_xargs``), ignores a hostile client's forged tag, and reports through ``status.json``.
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from slipstream_scheduler.enginecontrol import (
    CONTROL_FILE,
    OFFLINE_TOKEN_ARG,
    OFFLINE_TOKEN_FILE,
    STATUS_FILE,
    EngineControl,
    decode_report,
)
from slipstream_testbed.vllm import DEFAULT_SERVED_NAME, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PLUGIN = "slipstream_vllm.scheduler.SlipstreamScheduler"


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def _complete(
    srv: VllmServer, n: int, xargs: dict[str, Any] | None = None, priority: int | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": DEFAULT_SERVED_NAME,
        "prompt": "a batch job summary",
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
    }
    if xargs:
        body["vllm_xargs"] = xargs
    if priority is not None:
        body["priority"] = priority
    return _post(srv.url + "/v1/completions", body)


def _report(channel: Path, until: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    rep = None
    while time.monotonic() < deadline:
        try:
            rep = decode_report((channel / STATUS_FILE).read_text())
        except (FileNotFoundError, ValueError):
            rep = None
        if rep is not None and until(rep):
            return rep
        time.sleep(0.2)
    raise AssertionError(f"status.json never satisfied the condition; last: {rep}")


def test_the_plugin_serves_both_classes_inside_vllm_serve(
    vllm_server_factory: Any, tmp_path: Path
) -> None:
    channel = tmp_path / "channel"
    channel.mkdir()
    token = secrets.token_hex(16)
    (channel / OFFLINE_TOKEN_FILE).write_text(token)
    (channel / CONTROL_FILE).write_text(
        EngineControl(generation=3, policy="naive", ordering="gittins").encode()
    )
    srv: VllmServer = vllm_server_factory(
        scheduler_cls=PLUGIN,  # on vLLM's AsyncScheduler: async scheduling stays on
        env={"SLIPSTREAM_CHANNEL_DIR": str(channel)},
    )
    with ThreadPoolExecutor(8) as pool:
        offline = [pool.submit(_complete, srv, 24, {OFFLINE_TOKEN_ARG: token}) for _ in range(4)]
        online = [pool.submit(_complete, srv, 16) for _ in range(3)]
        forged = pool.submit(_complete, srv, 8, {OFFLINE_TOKEN_ARG: "guess"}, -100)
        outs = [f.result() for f in offline + online + [forged]]
    assert all(o["usage"]["completion_tokens"] > 0 for o in outs)
    rep = _report(
        channel,
        lambda r: r.offline_tokens >= 4 * 24 and r.online_tokens >= 3 * 16 + 8,
    )
    assert rep.generation == 3 and rep.policy == "naive" and rep.ordering == "gittins"
    # vLLM's CPU platform turns async scheduling off (vllm/platforms/cpu.py): here the plugin on
    # vLLM's AsyncScheduler is stepped synchronously; tests/vllm/test_plugin_async.py steps it
    # as a GPU engine core does, a step in flight.
    assert not rep.async_scheduling
    assert rep.forged_offline_tags == 1
    assert rep.offline_tokens == 4 * 24 and rep.online_tokens == 3 * 16 + 8
    assert rep.online.samples == 4 and rep.online.ttft_mean_s is not None
    assert rep.vllm_version
    # A newer control document reaches the running engine; rewriting an older one does not.
    # vLLM calls into the plugin only when it has work: the document is read at the first
    # step past the poll interval, so the next request finds it.
    (channel / CONTROL_FILE).write_text(EngineControl(generation=4, policy="naive").encode())
    time.sleep(0.5)
    _complete(srv, 4)
    _report(channel, lambda r: r.generation == 4)
    (channel / CONTROL_FILE).write_text(
        EngineControl(generation=2, policy="naive", ordering="gittins").encode()
    )
    time.sleep(0.5)
    _complete(srv, 4)
    rep = _report(channel, lambda r: r.online_tokens >= 3 * 16 + 8 + 8)
    assert rep.generation == 4 and rep.ordering == "fcfs"


@pytest.mark.parametrize("faults", ["psm,predictor", "planner"])
def test_faults_in_the_plugin_never_stop_vllm_serve(
    vllm_server_factory: Any, tmp_path: Path, faults: str
) -> None:
    """Parts of the plugin raise on every call inside a real engine: every online and offline
    request still completes with its tokens, and the faults show in status.json (the planner
    faulting every step trips the pod onto vLLM's own policy)."""
    import os

    channel = tmp_path / "channel"
    channel.mkdir()
    token = secrets.token_hex(16)
    (channel / OFFLINE_TOKEN_FILE).write_text(token)
    (channel / CONTROL_FILE).write_text(
        EngineControl(generation=1, policy="naive", ordering="gittins").encode()
    )
    here = str(Path(__file__).parent)
    srv: VllmServer = vllm_server_factory(
        scheduler_cls="faulty_plugin.FaultyScheduler",
        env={"SLIPSTREAM_CHANNEL_DIR": str(channel), "SLIPSTREAM_TEST_FAULTS": faults,
             "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))},
    )
    with ThreadPoolExecutor(12) as pool:
        offline = [pool.submit(_complete, srv, 20, {OFFLINE_TOKEN_ARG: token}) for _ in range(6)]
        online = [pool.submit(_complete, srv, 12) for _ in range(6)]
        outs = [f.result() for f in offline + online]
    assert [o["usage"]["completion_tokens"] for o in outs] == [20] * 6 + [12] * 6
    # status.json is written by the plugin's channel thread after the steps it reports: wait
    # until it has counted every token the clients received, then check what it says.
    def counted(r: Any) -> bool:
        return bool(r.offline_tokens >= 6 * 20 and r.online_tokens >= 6 * 12)

    if faults == "planner":
        rep = _report(channel, lambda r: counted(r) and r.failsafe)
        assert rep.faults == {"planner": 5} and rep.fault_steps == 5
    else:
        rep = _report(channel, counted)
        assert rep.faults.get("psm", 0) > 0 and rep.faults.get("predictor", 0) > 0
        assert not rep.failsafe or "faults within" in rep.failsafe
    assert rep.offline_tokens == 6 * 20 and rep.online_tokens == 6 * 12
