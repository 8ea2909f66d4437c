"""Shard planning (PSM order, bounded memory) and exactly-once merging of shard logs."""

from __future__ import annotations

import csv
import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from slipstream_operator.errors import OutputError
from slipstream_operator.shards import (
    Plan,
    PlanOptions,
    count_shard,
    merge_outputs,
    plan_input,
    prompt_text,
)
from slipstream_operator.staging import local_path, work_dir_for

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("SLIPSTREAM_DATA", REPO.parent / "shared" / "data"))


def request(cid: str, content: str, model: str = "m") -> str:
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    return json.dumps(
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def mmlu_lines(subjects: int, per_subject: int) -> list[str]:
    """5-shot MMLU prompts (real questions): each subject's prompts share a long prefix."""
    lines = []
    names = sorted(p.name[: -len("_test.csv")] for p in (DATA / "mmlu" / "test").glob("*.csv"))
    for subject in names[:subjects]:
        with open(DATA / "mmlu" / "dev" / f"{subject}_dev.csv", encoding="utf-8") as f:
            shots = list(csv.DictReader(f))
        prefix = "".join(f"{r['question']}\nA. {r['choice0']}\nAnswer: A\n\n" for r in shots)
        with open(DATA / "mmlu" / "test" / f"{subject}_test.csv", encoding="utf-8") as f:
            for i, row in enumerate(csv.DictReader(f)):
                if i == per_subject:
                    break
                lines.append(request(f"{subject}-{i}", prefix + row["question"]))
    return lines


def interleave(lines: list[str], stride: int) -> list[str]:
    return [lines[j] for i in range(stride) for j in range(i, len(lines), stride)]


def write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return f"file://{path}"


def staged(plan: Plan) -> list[dict[str, Any]]:
    return [json.loads(line) for line in local_path(plan.staged_uri).read_text().splitlines()]


@pytest.mark.unit
def test_prompt_text_reads_prompt_and_messages() -> None:
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"messages": [{"role": "user", "content": "hi"}]}) == "user:hi\n"
    assert (
        prompt_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
        == "x"
    )


@pytest.mark.unit
def test_psm_groups_shared_prefixes_into_the_same_shard(tmp_path: Path) -> None:
    lines = mmlu_lines(subjects=4, per_subject=30)
    shuffled = interleave(lines, 7)  # subjects mixed together in the input
    src = write(tmp_path / "in.jsonl", shuffled)
    plan = plan_input(
        src,
        f"file://{tmp_path}/out.jsonl",
        "job",
        PlanOptions(shard_size=30, prefix_chars=512, run_lines=25),
    )
    assert plan.total == plan.valid == 120 and plan.bad == 0
    records = staged(plan)
    assert sorted(r["custom_id"] for r in records) == sorted(
        json.loads(x)["custom_id"] for x in lines
    )
    subjects = [r["custom_id"].rsplit("-", 1)[0] for r in records]
    # Each subject is one contiguous run in the staged file ...
    runs = [s for i, s in enumerate(subjects) if i == 0 or subjects[i - 1] != s]
    assert len(runs) == 4
    # ... and each shard holds exactly one subject.
    for shard in plan.shards:
        assert len(set(subjects[shard.start : shard.end])) == 1
    assert [s.size for s in plan.shards] == [30, 30, 30, 30]
    assert len({s.affinity for s in plan.shards}) == 4


@pytest.mark.unit
def test_shards_cut_at_group_boundaries_and_hard_cap(tmp_path: Path) -> None:
    lines = [request(f"a{i}", "A" * 50 + str(i)) for i in range(25)]
    lines += [request(f"b{i}", "B" * 50 + str(i)) for i in range(3)]
    src = write(tmp_path / "in.jsonl", lines)
    plan = plan_input(
        src, f"file://{tmp_path}/out.jsonl", "j", PlanOptions(shard_size=10, prefix_chars=50)
    )
    sizes = [s.size for s in plan.shards]
    # The A group is hard-cut at 2x; its tail and the small B group share a shard (a shard
    # is cut at a group boundary only once it is full).
    assert sizes == [20, 8]
    assert plan.shards[0].affinity == plan.shards[1].affinity
    assert [s.start for s in plan.shards] == [0, 20]


@pytest.mark.unit
def test_bad_lines_become_error_records_and_are_counted(tmp_path: Path) -> None:
    lines = [
        request("ok1", "x"),
        "{not json",
        "[1, 2]",
        json.dumps({"custom_id": "nobody"}),
        "",
        json.dumps({"body": {}}),
        request("ok2", "y"),
    ]
    src = write(tmp_path / "in.jsonl", lines)
    plan = plan_input(src, f"file://{tmp_path}/out.jsonl", "j", PlanOptions())
    assert (plan.total, plan.valid, plan.bad) == (7, 2, 5)
    errors = [json.loads(x) for x in Path(plan.plan_errors_path).read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["line-2", "line-3", "nobody", "line-5", "line-6"]
    assert all(e["response"] is None and e["error"]["code"] for e in errors)


@pytest.mark.unit
def test_planning_is_idempotent_for_the_same_input(tmp_path: Path) -> None:
    src = write(tmp_path / "in.jsonl", [request(f"r{i}", str(i)) for i in range(10)])
    out = f"file://{tmp_path}/out.jsonl"
    first = plan_input(src, out, "j", PlanOptions(shard_size=3))
    manifest = work_dir_for(out) / "plan.json"
    mtime = manifest.stat().st_mtime_ns
    assert plan_input(src, out, "j", PlanOptions(shard_size=3)) == first
    assert manifest.stat().st_mtime_ns == mtime
    assert Plan.from_json(manifest.read_text()) == first


def _result(cid: str) -> str:
    return json.dumps(
        {
            "id": f"x-{cid}",
            "custom_id": cid,
            "response": {"status_code": 200, "body": {}},
            "error": None,
        }
    )


def _error(cid: str) -> str:
    return json.dumps(
        {
            "id": f"x-{cid}",
            "custom_id": cid,
            "response": None,
            "error": {"code": "engine", "message": "boom"},
        }
    )


@pytest.mark.unit
def test_merge_is_exactly_once_across_a_moved_shard(tmp_path: Path) -> None:
    lines = [request(f"r{i}", f"{i % 2} prompt {i}") for i in range(8)] + ["garbage"]
    src = write(tmp_path / "in.jsonl", lines)
    out = f"file://{tmp_path}/out.jsonl"
    plan = plan_input(src, out, "j", PlanOptions(shard_size=4, prefix_chars=6))
    ids = [r["custom_id"] for r in staged(plan)]
    first, second = plan.shards
    # Shard 0 ran on pod A, which wrote two results and a torn line, then died; pod B
    # re-ran it and (being careless) rewrote one of them. Shard 1 had one failure.
    log0 = local_path(plan.shard_output_uri(first.shard_id))
    log0.write_text(_result(ids[0]) + "\n" + _result(ids[1]) + "\n" + '{"custom_id": "r')
    with open(log0, "a") as f:
        f.write("\n" + _result(ids[1]) + "\n" + _result(ids[2]) + "\n" + _result(ids[3]) + "\n")
    log1 = local_path(plan.shard_output_uri(second.shard_id))
    log1.write_text("".join(_result(c) + "\n" for c in ids[4:7]))
    local_path(plan.shard_error_uri(second.shard_id)).write_text(_error(ids[7]) + "\n")
    assert count_shard(plan, first).completed == 4
    assert count_shard(plan, second).completed == 3 and count_shard(plan, second).failed == 1
    result = merge_outputs(plan, out, f"file://{tmp_path}/out.errors.jsonl")
    assert (result.completed, result.failed, result.total) == (7, 2, 9)
    merged = [json.loads(x)["custom_id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    errs = [
        json.loads(x)["custom_id"] for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()
    ]
    assert sorted(merged + errs) == sorted([f"r{i}" for i in range(8)] + ["line-9"])
    assert len(merged) == len(set(merged))


@pytest.mark.unit
def test_merge_refuses_when_a_request_has_no_record(tmp_path: Path) -> None:
    src = write(tmp_path / "in.jsonl", [request(f"r{i}", "p") for i in range(3)])
    out = f"file://{tmp_path}/out.jsonl"
    plan = plan_input(src, out, "j", PlanOptions())
    local_path(plan.shard_output_uri(plan.shards[0].shard_id)).write_text(_result("r0") + "\n")
    with pytest.raises(OutputError, match="1 records for 3"):
        merge_outputs(plan, out, f"file://{tmp_path}/e.jsonl")
    assert not (tmp_path / "out.jsonl").exists()  # nothing half-written in place


@pytest.mark.unit
def test_memory_does_not_grow_with_input_size(tmp_path: Path) -> None:
    def peak(n: int, name: str) -> int:
        src = write(
            tmp_path / f"{name}.jsonl",
            [request(f"r{i}", f"subject {i % 13} q {i}") for i in range(n)],
        )
        tracemalloc.start()
        plan_input(
            src,
            f"file://{tmp_path}/{name}.out.jsonl",
            name,
            PlanOptions(shard_size=100, run_lines=1000, merge_fan_in=8),
        )
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(2_000, "small"), peak(16_000, "large")
    assert large < 1.5 * small + 256 * 1024  # 8x the input, about the same peak


@pytest.mark.sim
def test_a_million_requests_plan_in_bounded_memory(tmp_path: Path) -> None:
    n = 1_000_000
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                f'{{"custom_id":"r{i}","method":"POST","url":"/v1/completions",'
                f'"body":{{"model":"m","prompt":"subject {i % 57} question {i}"}}}}\n'
            )
    size = path.stat().st_size
    tracemalloc.start()
    plan = plan_input(f"file://{path}", f"file://{tmp_path}/out.jsonl", "big", PlanOptions())
    _, top = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert plan.total == plan.valid == n
    assert sum(s.size for s in plan.shards) == n
    assert top < 32 * 1024 * 1024 < size // 2, (top, size)  # far below the input's size
