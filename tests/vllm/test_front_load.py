"""A peer's load generator, ``vllm bench serve``, through the sidecar's front and direct.

vLLM's own client (:mod:`slipstream_testbed.vllm.bench_serve`) drives one shared
``vllm serve`` (128 sequences, so 256 concurrent is twice what it runs at once) directly and
through one sidecar in front of it, whose front is built from this checkout. At 64, 128 and 256
concurrent both paths get the same seeded random prompts (32 tokens in, 16 out with
``--ignore-eos``, temperature 0), the order of the two rounds alternating from one concurrency
to the next. Held: no request fails through the front where none fails direct (and never
more than direct); every greedy answer through the front is the direct one's text; the
sidecar counts as ``ok`` every request the client saw complete through the front.

The server runs in float32. The tiny model's next-token distribution is nearly flat, and in
bfloat16 (vLLM's choice for it on CPU) two candidates often tie to the last bit, so which one
wins can change with what else is in the batch: a request sent alone to vLLM, no sidecar
involved, was seen to answer differently from the same request in a batch of 64.

Timings are not asserted here: ``slipstream bench front-load`` records them
(``docs/benchmarks/front-load.md``).
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from integration.helpers_procs import Proc, sidecar_proc
from slipstream_testbed.vllm import DEFAULT_SERVED_NAME, VllmServer
from slipstream_testbed.vllm.bench_serve import (
    BenchServeClient,
    RandomWorkload,
    RoundResult,
    cache_shape,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ENGINE_SEQS = 128
ENGINE_BATCHED_TOKENS = 2048
CONCURRENCY = (64, 128, 256)


@dataclass(frozen=True)
class Pair:
    direct: RoundResult
    front: RoundResult


@dataclass(frozen=True)
class Run:
    pairs: dict[int, Pair]
    finished_ok: float  # the sidecar's online requests finished ok during the rounds


def finished_ok(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    m = re.search(
        r'^slipstream_requests_finished_total\{class="online",outcome="ok"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def vllm(shared_vllm: Any) -> VllmServer:
    srv: VllmServer = shared_vllm(max_num_seqs=ENGINE_SEQS,
                                  max_num_batched_tokens=ENGINE_BATCHED_TOKENS,
                                  extra_args=("--dtype", "float32"))
    return srv


@pytest.fixture(scope="module")
def sidecar(vllm: VllmServer, front_binary: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """A sidecar told the engine's shape as vLLM reports it."""
    block_size, kv_blocks = cache_shape(vllm.url)
    proc = sidecar_proc(
        tmp_path_factory.mktemp("front-load"), vllm.url,
        max_num_seqs=ENGINE_SEQS, kv_blocks=kv_blocks,
        extra=("--model", DEFAULT_SERVED_NAME, "--block-size", str(block_size),
               "--max-num-batched-tokens", str(ENGINE_BATCHED_TOKENS),
               "--front-binary", str(front_binary)),
    ).start(timeout_s=120)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def run(vllm: VllmServer, sidecar: Proc, tiny_model: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("bench-serve")
    workload = RandomWorkload(tiny_model, input_len=32, output_len=16, seed=7)
    before = finished_ok(sidecar.url)
    pairs: dict[int, Pair] = {}
    with BenchServeClient(tmp / "bench-serve.log") as client:
        for i, c in enumerate(CONCURRENCY):
            got: dict[str, RoundResult] = {}
            order = ("direct", "front") if i % 2 == 0 else ("front", "direct")
            for path in order:
                url = vllm.url if path == "direct" else sidecar.url
                out = tmp / f"{path}-{c}.json"
                argv = workload.argv(url, concurrency=c, num_prompts=max(200, 2 * c),
                                     result_file=out, label=path)
                got[path] = client.run(argv, out)
            pairs[c] = Pair(got["direct"], got["front"])
    return Run(pairs, finished_ok(sidecar.url) - before)


@pytest.mark.parametrize("concurrency", CONCURRENCY)
def test_no_request_fails_through_the_front_when_none_fails_direct(
    run: Run, concurrency: int
) -> None:
    """Where vLLM served every request sent directly, the front fails none. Where vLLM itself
    dropped some (its API server resets connections when the host stalls it, whatever is in
    front of it), the front may fail no more than direct did."""
    pair = run.pairs[concurrency]
    total = pair.direct.completed + pair.direct.failed
    assert pair.front.completed + pair.front.failed == total
    if pair.direct.failed:
        print(f"\n{concurrency} concurrent: vLLM failed {pair.direct.failed} of {total} sent "
              f"directly: {pair.direct.errors[:1]}")
    assert pair.front.failed <= pair.direct.failed, (
        f"through the front {pair.front.failed} failed, direct {pair.direct.failed}: "
        f"{pair.front.errors[:5]}")


@pytest.mark.parametrize("concurrency", CONCURRENCY)
def test_greedy_answers_through_the_front_are_the_direct_ones(run: Run, concurrency: int) -> None:
    """Every prompt answered on both paths got the same text (a prompt vLLM failed directly
    has no direct answer to compare)."""
    pair = run.pairs[concurrency]
    direct, front = pair.direct.generated_texts, pair.front.generated_texts
    assert len(direct) == len(front) == max(200, 2 * concurrency)
    both = [i for i in range(len(direct))
            if i not in pair.direct.failed_requests and i not in pair.front.failed_requests]
    assert len(both) >= len(direct) - pair.direct.failed - pair.front.failed
    differ = [i for i in both if direct[i] != front[i]]
    assert not differ, (
        f"{len(differ)} of {len(both)} answers differ, first #{differ[0]}: "
        f"direct {direct[differ[0]]!r}, front {front[differ[0]]!r}")


def test_the_sidecar_finished_every_front_request_ok(run: Run) -> None:
    """The sidecar counts as ``ok`` exactly the requests vLLM's client saw complete through
    the front (its ready check is off by default: no test prompt before a round)."""
    assert run.finished_ok == sum(p.front.completed for p in run.pairs.values())
