"""The endpoint picker's view of a pod: the ``vllm:`` series on the sidecar's ``/metrics``.

A real engine model (vLLM's HTTP API and ``vllm:`` metrics) behind a real sidecar, both one
sequence at a time, so that the sidecar holds every online request after the first. The
sidecar's ``/metrics`` must parse as one well-formed exposition, carry the engine's running
and KV-usage series with the engine's labels, vLLM's LoRA info series, and a waiting count
that is the engine's own plus the online requests the sidecar holds: it rises while they
are held and falls back once they are served. ``tests/vllm/test_epp_metrics_contract.py``
checks the names, types and labels against live vLLM.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator

import pytest
from helpers_procs import MODEL, Proc, engine_proc, eventually, sidecar_proc
from prometheus_client.parser import text_string_to_metric_families

from slipstream_sidecar.metrics import EPP_FAMILIES

pytestmark = pytest.mark.integration
def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def families(text: str) -> dict[str, tuple[str, list[tuple[dict[str, str], float]]]]:
    """name -> (type, [(labels, value)]); raises on a malformed exposition."""
    out: dict[str, tuple[str, list[tuple[dict[str, str], float]]]] = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in out, f"family {fam.name} appears twice"
        out[fam.name] = (fam.type, [(dict(s.labels), s.value) for s in fam.samples])
    return out


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    d = tmp_path_factory.mktemp("epp")
    eng = engine_proc(d, max_num_seqs=1, mean_output_tokens=100_000).start()
    sc = sidecar_proc(d, eng.url, max_num_seqs=1).start()
    yield eng, sc
    sc.stop()
    eng.stop()


def send(url: str, done: list[int]) -> None:
    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 150,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.read()
        done.append(resp.status)


def test_series_are_well_formed_and_match_the_engine(pod: tuple[Proc, Proc]) -> None:
    eng, sc = pod
    ours = families(scrape(sc.url))
    engine = families(scrape(eng.url))
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"):
        kind, samples = ours[name]
        assert kind == engine[name][0] == "gauge"
        assert [labels for labels, _ in samples] == [labels for labels, _ in engine[name][1]]
        assert {k for labels, _ in samples for k in labels} == {"model_name", "engine"}
    kind, samples = ours["vllm:lora_requests_info"]
    assert kind == "gauge" and len(samples) == 1
    labels, stamp = samples[0]
    assert labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert stamp > 1.6e9  # a Unix time, as vLLM's set_to_current_time
    served = {n for n in ours if n.startswith("vllm:")}
    assert served <= set(EPP_FAMILIES)
    assert {n for n in ours if not n.startswith("vllm:")} and all(
        n.startswith("slipstream_") for n in ours if not n.startswith("vllm:"))


def test_waiting_counts_the_requests_the_sidecar_holds(pod: tuple[Proc, Proc]) -> None:
    eng, sc = pod
    done: list[int] = []
    threads = [threading.Thread(target=send, args=(sc.url, done)) for _ in range(4)]
    for t in threads:
        t.start()

    def held_view() -> tuple[float, float, float] | None:
        fams = families(scrape(sc.url))
        waiting = sum(v for _, v in fams["vllm:num_requests_waiting"][1])
        running = sum(v for _, v in fams["vllm:num_requests_running"][1])
        queued = next(v for labels, v in fams["slipstream_queued_requests"][1]
                      if labels["class"] == "online")
        return (waiting, running, queued) if queued >= 3 else None

    waiting, running, queued = eventually("three online requests held", held_view)
    # The engine runs one and queues none (the sidecar sends it one at a time): the picker
    # sees the three the sidecar holds as waiting.
    engine = families(scrape(eng.url))
    assert sum(v for _, v in engine["vllm:num_requests_waiting"][1]) == 0
    assert waiting >= queued >= 3
    assert running <= 1
    for t in threads:
        t.join(timeout=300)
    assert done == [200, 200, 200, 200]
    fams = families(scrape(sc.url))
    assert sum(v for _, v in fams["vllm:num_requests_waiting"][1]) == 0
