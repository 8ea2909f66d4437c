"""Workload loaders: real shared data parsed into SimRequests, and the pure hashing helpers."""

from __future__ import annotations

import itertools

import pytest

from slipstream_cli.workloads import WorkloadError, arxiv, azure, mmlu, mooncake
from slipstream_cli.workloads.tokenize import count_tokens, tokenize
from slipstream_scheduler.sim.workload import (
    SimRequest,
    Workload,
    chain_block_hashes,
    expand_block_hashes,
    scale_rate,
    unique_block_hashes,
    window,
)
from slipstream_scheduler.types import RequestClass

pytestmark = pytest.mark.unit


def test_azure_parse_rebases_and_skips_empty_rows() -> None:
    lines = [
        "TIMESTAMP,ContextTokens,GeneratedTokens",
        "2023-11-16 18:15:46.6805900,374,44",
        "2023-11-16 18:15:50.9951690,396,0",
        "2023-11-16 18:15:51.2224670,879,55",
    ]
    reqs = azure.parse_lines(lines)
    assert [r.prompt_tokens for r in reqs] == [374, 879]
    assert reqs[0].arrival_s == 0.0
    assert reqs[1].arrival_s == pytest.approx(4.541877, abs=1e-6)
    assert all(r.cls is RequestClass.ONLINE for r in reqs)
    assert len(reqs[1].block_hashes) == 879 // 16
    assert not set(reqs[0].block_hashes) & set(reqs[1].block_hashes)


def test_azure_rejects_other_header() -> None:
    with pytest.raises(WorkloadError):
        azure.parse_lines(["a,b,c", "1,2,3"])


def test_azure_conv_dev_trace_is_whole() -> None:
    reqs = azure.load()
    assert 13_900 <= len(reqs) <= 13_927
    assert 2340 < reqs[-1].arrival_s < 2400
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))


def test_mooncake_expands_512_token_blocks() -> None:
    line = '{"timestamp": 1500, "input_length": 1040, "output_length": 7, "hash_ids": [0, 9, 4]}'
    other = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 5]}'
    a, b = mooncake.parse_lines([line, other])
    assert (a.arrival_s, b.arrival_s) == (0.0, 1.5)  # sorted by time
    assert len(b.block_hashes) == 1040 // 16
    # the shared first 512-token block means 32 shared 16-token blocks, then they differ
    assert a.block_hashes[:32] == b.block_hashes[:32]
    assert a.block_hashes[32] != b.block_hashes[32]


def test_arxiv_lengths_are_offline_and_fit_context() -> None:
    reqs = arxiv.load(limit=500)
    assert len(reqs) == 500
    assert all(r.cls is RequestClass.OFFLINE and r.arrival_s == 0.0 for r in reqs)
    assert all(r.prompt_tokens + r.output_tokens <= 4096 for r in reqs)


def test_tokenizer_is_deterministic_and_concatenates_at_whitespace() -> None:
    a, b = "The following are questions.\n\n", "What is 2+2?\nAnswer:"
    assert tokenize(a + b) == tokenize(a) + tokenize(b)
    assert tokenize(a) == tokenize(a)
    assert 5 <= count_tokens("the quick brown fox jumps over") <= 9


def test_mmlu_prompts_share_the_subject_prefix() -> None:
    reqs = mmlu.load(subjects=["anatomy", "virology"], per_subject=20, seed=1)
    assert len(reqs) == 40
    by_subject: dict[str, list[SimRequest]] = {}
    for r in reqs:
        by_subject.setdefault(r.group, []).append(r)
    assert set(by_subject) == {"anatomy", "virology"}
    ana, vir = by_subject["anatomy"], by_subject["virology"]
    # five exemplars: hundreds of shared tokens within a subject
    shared = 0
    while ana[0].block_hashes[shared] == ana[1].block_hashes[shared]:
        shared += 1
    assert shared * 16 >= 200
    assert ana[0].block_hashes[shared - 1] != vir[0].block_hashes[shared - 1]
    # the file order is mixed (seeded), not grouped by subject
    assert len({r.group for r in reqs[:10]}) == 2


def test_hash_helpers() -> None:
    toks = list(range(40))
    h = chain_block_hashes(toks)
    assert len(h) == 2
    assert chain_block_hashes([*toks[:16], 99, *toks[17:]])[1] != h[1]
    assert expand_block_hashes([7], 512, 100) == expand_block_hashes([7, 8], 512, 100)
    assert len(unique_block_hashes(3, 33)) == 2


def test_scale_and_window() -> None:
    reqs = tuple(SimRequest(f"r{i}", RequestClass.ONLINE, float(i), 10, 5) for i in range(10))
    assert [r.arrival_s for r in scale_rate(reqs, 2.0)][:3] == [0.0, 0.5, 1.0]
    w = window(reqs, 3.0, 4.0)
    assert [r.request_id for r in w] == ["r3", "r4", "r5", "r6"]
    assert w[0].arrival_s == 0.0
    with pytest.raises(ValueError):
        Workload(online=reqs, offline=(), offline_backlog=True, horizon_s=10.0)
