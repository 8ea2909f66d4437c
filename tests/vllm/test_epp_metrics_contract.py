"""Contract: the sidecar's ``vllm:`` series are live vLLM's, as an endpoint picker reads them.

A real ``slipstream sidecar`` process in front of real ``vllm serve`` (CPU, the tiny model).
For each family an endpoint picker scores pods by (``EPP_FAMILIES``) that vLLM serves, the
sidecar's ``/metrics`` has the same name, type, help text and label names, and the same label
values (running, KV usage and the cache config are vLLM's own series). vLLM serves
``vllm:lora_requests_info`` only with ``--enable-lora``: a second live server with LoRA on is
the reference for the series the sidecar serves when the engine has none.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from integration.helpers_procs import Proc, sidecar_proc
from slipstream_sidecar.metrics import EPP_FAMILIES
from slipstream_testbed.vllm import DEFAULT_SERVED_NAME, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

Family = tuple[str, str, list[dict[str, str]]]  # (type, help, label sets)
LORA = "vllm:lora_requests_info"


def scrape(url: str) -> dict[str, Family]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, Family] = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in out, f"{fam.name} appears twice"
        out[fam.name] = (fam.type, fam.documentation, [dict(s.labels) for s in fam.samples])
    return out


def complete(url: str) -> None:
    body = json.dumps({"model": DEFAULT_SERVED_NAME, "prompt": "hello there", "max_tokens": 4,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200


def sidecar_for(vllm: VllmServer, tmp: Path) -> Proc:
    return sidecar_proc(tmp, vllm.url, extra=("--model", DEFAULT_SERVED_NAME)).start()


@pytest.fixture
def sidecar_factory(tmp_path: Path) -> Iterator[Callable[[VllmServer], Proc]]:
    started: list[Proc] = []

    def make(vllm: VllmServer) -> Proc:
        folder = tmp_path / f"sidecar-{len(started)}"
        folder.mkdir()
        proc = sidecar_for(vllm, folder)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()


def test_the_pickers_series_are_vllms(vllm_server: VllmServer,
                                      sidecar_factory: Callable[[VllmServer], Proc]) -> None:
    sidecar = sidecar_factory(vllm_server)
    complete(sidecar.url)
    theirs = scrape(vllm_server.url)
    ours = scrape(sidecar.url)
    assert {n for n in ours if n.startswith("vllm:")} == set(EPP_FAMILIES)
    served = [n for n in EPP_FAMILIES if n in theirs]
    # Everything but LoRA is served by vLLM without --enable-lora.
    assert served == [n for n in EPP_FAMILIES if n != LORA]
    for name in served:
        their_type, their_help, their_labels = theirs[name]
        our_type, our_help, our_labels = ours[name]
        assert (our_type, our_help) == (their_type, their_help), name
        assert our_type == "gauge", name
        assert our_labels == their_labels, name  # same label names and values, same order
    assert {k for labels in ours["vllm:num_requests_waiting"][2] for k in labels} == {
        "model_name", "engine"}
    assert "block_size" in ours["vllm:cache_config_info"][2][0]


@pytest.fixture(scope="module")
def lora_vllm(shared_vllm: Any) -> VllmServer:
    srv: VllmServer = shared_vllm(
        extra_args=("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"))
    return srv


def test_the_lora_series_without_lora_has_vllms_shape(
    vllm_server: VllmServer, lora_vllm: VllmServer,
    sidecar_factory: Callable[[VllmServer], Proc],
) -> None:
    complete(lora_vllm.url)  # vLLM sets the LoRA series on its first stats after a step

    def lora_family() -> Family | None:
        return scrape(lora_vllm.url).get(LORA)

    deadline = time.monotonic() + 120
    reference = lora_family()
    while reference is None and time.monotonic() < deadline:
        time.sleep(1.0)
        reference = lora_family()
    assert reference is not None, "vLLM with --enable-lora serves no vllm:lora_requests_info"
    # Through a sidecar in front of the LoRA-enabled vLLM: vLLM's own series, passed on.
    through = scrape(sidecar_factory(lora_vllm).url)[LORA]
    assert through[:2] == reference[:2]
    assert [sorted(s) for s in through[2]] == [sorted(s) for s in reference[2]]
    # In front of vLLM without LoRA: the same type, help and label names, no adapters.
    ours = scrape(sidecar_factory(vllm_server).url)[LORA]
    assert ours[:2] == reference[:2]
    assert [sorted(s) for s in ours[2]] == [sorted(s) for s in reference[2][:1]]
    assert ours[2] == [{"max_lora": "0", "running_lora_adapters": "",
                        "waiting_lora_adapters": ""}]
