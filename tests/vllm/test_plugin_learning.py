"""The latency model learned inside real ``vllm serve``: the plugin records every step it
schedules, and the sidecar's learner reads and fits them.

Prompts are token ids drawn per request, so the prefix cache serves none of them, and each
step's record must account for exactly the tokens the clients were served: every prompt
token once in a prefill chunk, every output token after the first once in a decode.
"""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from slipstream_scheduler.enginecontrol import CONTROL_FILE, STEPS_DIR, EngineControl
from slipstream_scheduler.learning import LearnParams, Regime, read_records
from slipstream_sidecar.learner import EngineLearner
from slipstream_testbed.vllm import DEFAULT_SERVED_NAME, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PLUGIN = "slipstream_vllm.scheduler.SlipstreamScheduler"


def _complete(srv: VllmServer, prompt: list[int], n: int) -> dict[str, Any]:
    body = {"model": DEFAULT_SERVED_NAME, "prompt": prompt, "max_tokens": n,
            "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(srv.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def test_the_plugin_records_steps_and_the_sidecar_learns_them(
    vllm_server_factory: Any, tmp_path: Path
) -> None:
    channel = tmp_path / "channel"
    channel.mkdir()
    (channel / CONTROL_FILE).write_text(EngineControl(generation=1, policy="naive").encode())
    srv: VllmServer = vllm_server_factory(
        scheduler_cls=PLUGIN, max_num_batched_tokens=256,
        env={"SLIPSTREAM_CHANNEL_DIR": str(channel)},
    )
    rng = random.Random(7)
    jobs = []
    for i in range(96):  # mixed sizes: prefill-only, decode-only and mixed steps
        prompt = [1 + i] + [rng.randrange(2, 1000) for _ in range(rng.choice((8, 60, 200)) - 1)]
        jobs.append((prompt, rng.choice((16, 48, 120))))
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda j: _complete(srv, *j), jobs))
    prompt_tokens = sum(o["usage"]["prompt_tokens"] for o in outs)
    decode_tokens = sum(o["usage"]["completion_tokens"] - 1 for o in outs)

    learner = EngineLearner(channel, params=LearnParams(min_steps=100, holdout=100))

    async def collect() -> None:
        for _ in range(50):  # the channel thread flushes every 0.2 s
            await learner.step()
            recs, _ = read_records(
                line for p in sorted((channel / STEPS_DIR).glob("*.jsonl"))
                for line in p.read_text().splitlines())
            if sum(r.sum_decode_tokens for r in recs) >= decode_tokens:
                break
            await asyncio.sleep(0.2)
        await learner.step()  # whatever was written since its last read

    asyncio.run(collect())
    recs, errors = read_records(
        line for p in sorted((channel / STEPS_DIR).glob("*.jsonl"))
        for line in p.read_text().splitlines())
    assert not errors
    assert sum(r.sum_prefill_tokens for r in recs) == prompt_tokens
    assert sum(r.sum_decode_tokens for r in recs) == decode_tokens
    assert sum(r.num_decode_requests for r in recs) == decode_tokens
    assert {r.regime for r in recs} == set(Regime)
    assert all(r.wall_time > 0 for r in recs)
    snap = learner.snapshot()
    assert snap.seen == len(recs) and snap.fits >= 1 and snap.last is not None
    # The fit ran on real steps and was judged on held-out ones: its error is a number
    # (how small it gets on this host is the learning benchmark's business).
    assert snap.last.heldout_mape is not None and snap.last.heldout_mape >= 0
    print(f"steps={len(recs)} regimes={snap.regimes} outcome={snap.last}")
