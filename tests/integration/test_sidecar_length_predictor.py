"""A real sidecar orders held online requests by predictions from similar past prompts.

Engine and sidecar run as processes on loopback; the sidecar's engine limit is
two sequences, so a burst of streams is partly held. Held requests are keyed by
the text history (embedded off the event loop); every finished request feeds
it; the prompts never reach the log.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers_procs import MODEL, engine_proc, sidecar_proc

pytestmark = pytest.mark.integration

SECRET = "zanzibar-quokka"


def _post(url: str, prompt: str) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()
        return int(resp.status)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


def test_held_requests_are_keyed_by_similar_prompts_and_history_grows(tmp_path: Path) -> None:
    eng = engine_proc(tmp_path, max_num_seqs=2).start()
    sc = sidecar_proc(tmp_path, eng.url, max_num_seqs=2).start()
    try:
        prompts = [f"Tell me about {SECRET} number {i}, please." for i in range(12)]
        with ThreadPoolExecutor(12) as pool:
            assert set(pool.map(lambda p: _post(sc.url, p), prompts)) == {200}
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(sc.url + "/metrics", timeout=10) as resp:
                text = resp.read().decode()
            records = _metric(text, 'slipstream_length_history_records{history="text"}')
            if records >= 12 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert records == 12, "every finished request joined the text history"
        assert _metric(text, 'slipstream_length_history_records{history="input"}') == 12
        by_text = _metric(text, 'slipstream_length_predictions_total{source="text"}')
        by_input = _metric(text, 'slipstream_length_predictions_total{source="input"}')
        # A request granted while alone in the queue is never ranked, so it is not
        # predicted (lazy keys); the held ones are, once each.
        assert by_text + by_input <= 12
        assert by_text >= 1, "held requests were keyed by the text history"
    finally:
        sc.stop()
        eng.stop()
    assert SECRET not in sc.log_tail(1_000_000)
