"""Bad offline input through a real sidecar and engine: every line ends as exactly one record.

The corpus mixes real prompts (Stanford Alpaca, shared data) with every kind of
bad line a user sends: not JSON, not UTF-8, truncated, blank, a JSON array, a
1 MiB line of garbage, a 1 MiB prompt past the model's context, a wrong model,
a wrong or missing URL, a missing, empty or non-string ``custom_id``, a GET,
a body that is not an object, ``n = 2``, ``logprobs``, a negative or textual
``max_tokens``, and duplicate ``custom_id``\\ s.

The rule for lines (checked here, documented in ``docs/reliability.md``):
each input line of a shard ends as exactly one record, in the output file
(success) or the error file (an error whose message names the line number and
the offending field); the shard itself succeeds. For a ``custom_id`` used by
two lines the first line is served and each later one is an error record
``duplicate_custom_id`` naming the line it repeats (OpenAI requires unique
ids; serving both would put one id twice in the output).

Also here: an input that disappears while its shard runs, and one that is
missing when a restarted sidecar resumes the shard.

Deliberately left out: invalid CR specs and cross-shard duplicates (the
operator's; ``test_cluster_security.py``, ``docs/reliability.md``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rel_helpers import RelStack, assign, records, start_rel_stack, wait_done

from integration.helpers_procs import MODEL
from slipstream_sidecar.proto import sidecar_pb2 as pb

pytestmark = pytest.mark.integration


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[RelStack]:
    s = start_rel_stack(tmp_path, sidecar_seqs=8)
    yield s
    s.stop()


def alpaca(shared_data: Path, n: int, skip: int = 0) -> list[str]:
    rows = json.loads((shared_data / "prompts" / "alpaca_5000.dev.json").read_text())
    return [r["instruction"] + ("\n\n" + r["input"] if r["input"] else "")
            for r in rows[skip : skip + n]]


def line(custom_id: Any, body: Any, url: Any = "/v1/completions", method: Any = "POST",
         drop: tuple[str, ...] = ()) -> bytes:
    doc = {"custom_id": custom_id, "method": method, "url": url, "body": body}
    for key in drop:
        doc.pop(key)
    return json.dumps(doc).encode()


def ok_body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 6}


def corpus(prompts: list[str]) -> tuple[list[bytes], dict[int, tuple[str, str]], set[str]]:
    """(lines, line_no -> (error code, text the message must hold), ids that must succeed)."""
    p = iter(prompts)
    bad: list[tuple[bytes, str, str]] = [
        (b"{this is not json", "invalid_json", "not JSON"),
        (b'{"custom_id": "trunc", "method": "POST", "url": "/v1/comp', "invalid_json",
         "not JSON"),
        (b"\xff\xfe\x00garbage\x80", "invalid_json", "not JSON"),
        (b"   ", "invalid_json", "not JSON"),
        (b"[1, 2, 3]", "invalid_json", "not a JSON object"),
        (b"#" * (1 << 20), "invalid_json", "not JSON"),
        (line("huge", {"model": MODEL, "prompt": "word " * 210_000, "max_tokens": 4}),
         "context_length_exceeded", "context"),
        (line("wrong-model", {"model": "gpt-4o", "prompt": next(p)}), "model_not_found",
         "gpt-4o"),
        (line("wrong-url", ok_body(next(p)), url="/v1/embeddings"), "invalid_url", "url"),
        (line("no-url", ok_body(next(p)), drop=("url",)), "invalid_url", "url"),
        (line(None, ok_body(next(p)), drop=("custom_id",)), "invalid_request", "custom_id"),
        (line("", ok_body(next(p))), "invalid_request", "custom_id"),
        (line(12345, ok_body(next(p))), "invalid_request", "custom_id"),
        (line("get", ok_body(next(p)), method="GET"), "invalid_request", "method"),
        (line("body-list", [1, 2]), "invalid_request", "body"),
        (line("n2", {**ok_body(next(p)), "n": 2}), "invalid_request", "n must be 1"),
        (line("logprobs", {**ok_body(next(p)), "logprobs": 3}), "unsupported_parameter",
         "logprobs"),
        (line("neg-max", {**ok_body(next(p)), "max_tokens": -1}), "invalid_request",
         "max_tokens"),
        (line("text-max", {**ok_body(next(p)), "max_tokens": "ten"}), "invalid_request",
         "max_tokens"),
        (line("prompt-list", {**ok_body(next(p)), "prompt": [1, 2, 3]}), "invalid_request",
         "prompt"),
        (line("chat-empty", {"model": MODEL, "messages": []}, url="/v1/chat/completions"),
         "invalid_request", "messages"),
    ]
    lines: list[bytes] = []
    expect_err: dict[int, tuple[str, str]] = {}
    expect_ok: set[str] = set()
    for i, (raw, code, text) in enumerate(bad):
        lines.append(line(f"good-{i}", ok_body(next(p))))
        expect_ok.add(f"good-{i}")
        expect_err[len(lines)] = (code, text)
        lines.append(raw)
    # Duplicates: the first "dup" is served, the two later ones are errors naming its line.
    first = len(lines)
    lines.append(line("dup", ok_body(next(p))))
    expect_ok.add("dup")
    for _ in range(2):
        lines.append(line(f"between-{len(lines)}", ok_body(next(p))))
        expect_ok.add(f"between-{len(lines) - 1}")
        expect_err[len(lines)] = ("duplicate_custom_id", f"line {first}")
        lines.append(line("dup", ok_body(next(p))))
    return lines, expect_err, expect_ok


def line_of(record: dict[str, Any]) -> int:
    return int(str(record["id"]).rsplit("_L", 1)[1])


def test_bad_corpus_every_line_once_errors_name_line_and_field(
    stack: RelStack, shared_data: Path
) -> None:
    lines, expect_err, expect_ok = corpus(alpaca(shared_data, 60))
    (stack.tmp / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assign(stack, "bad", len(lines), stack.tmp)
    progress = wait_done(stack, "bad")
    assert progress.state == pb.SHARD_STATE_SUCCEEDED, progress.message
    out = records(stack.tmp / "out.jsonl")
    err = records(stack.tmp / "err.jsonl")
    # Every line exactly once, in exactly one of the two files.
    seen = sorted([line_of(r) for r in out] + [line_of(r) for r in err])
    assert seen == list(range(len(lines))), "a line is missing or written twice"
    assert {r["custom_id"] for r in out} == expect_ok
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in out)
    by_line = {line_of(r): r for r in err}
    for n, (code, text) in sorted(expect_err.items()):
        if code == "duplicate_custom_id":
            continue  # checked below
        r = by_line.get(n)
        assert r is not None, f"line {n} ({code}) has no error record"
        assert r["response"] is None
        assert r["error"]["code"] == code, (n, r["error"])
        assert f"line {n}" in r["error"]["message"] and text in r["error"]["message"], r["error"]
    assert progress.completed == len(out) and progress.failed == len(err)


def test_duplicate_custom_id_is_an_error_naming_the_first_line(
    stack: RelStack, shared_data: Path
) -> None:
    lines, expect_err, _ = corpus(alpaca(shared_data, 60))
    (stack.tmp / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assign(stack, "dups", len(lines), stack.tmp)
    assert wait_done(stack, "dups").state == pb.SHARD_STATE_SUCCEEDED
    out = records(stack.tmp / "out.jsonl")
    ids = [r["custom_id"] for r in out]
    assert ids.count("dup") == 1, f"'dup' is in the output {ids.count('dup')} times"
    by_line = {line_of(r): r for r in records(stack.tmp / "err.jsonl")}
    for n, (code, text) in expect_err.items():
        if code == "duplicate_custom_id":
            assert by_line[n]["error"]["code"] == code and text in by_line[n]["error"]["message"]


def _many(shared_data: Path, n: int, max_tokens: int) -> bytes:
    prompts = alpaca(shared_data, n, skip=200)
    return b"".join(
        line(f"r{i}", {"model": MODEL, "prompt": p, "max_tokens": max_tokens}) + b"\n"
        for i, p in enumerate(prompts)
    )


def _wait_some(path: Path, k: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = len(records(path))
        if done >= k:
            return done
        time.sleep(0.05)
    raise AssertionError(f"fewer than {k} records in {path} after {timeout_s}s")


def test_input_deleted_while_the_shard_runs(stack: RelStack, shared_data: Path) -> None:
    """The shard read its lines when it started: deleting the input does not lose them."""
    n = 40
    (stack.tmp / "in.jsonl").write_bytes(_many(shared_data, n, 24))
    assign(stack, "gone", n, stack.tmp)
    done = _wait_some(stack.tmp / "out.jsonl", 3)
    assert done < n
    (stack.tmp / "in.jsonl").unlink()
    progress = wait_done(stack, "gone")
    assert progress.state == pb.SHARD_STATE_SUCCEEDED
    ids = [r["custom_id"] for r in records(stack.tmp / "out.jsonl")]
    assert sorted(ids) == sorted(f"r{i}" for i in range(n))


def test_input_missing_when_a_restarted_sidecar_resumes(stack: RelStack, shared_data: Path) -> None:
    """kill -9, input gone, restart: the shard fails naming the URI; what was written stays."""
    n = 40
    (stack.tmp / "in.jsonl").write_bytes(_many(shared_data, n, 24))
    assign(stack, "vanish", n, stack.tmp)
    _wait_some(stack.tmp / "out.jsonl", 3)
    stack.sidecar.kill()
    raw = (stack.tmp / "out.jsonl").read_bytes()
    before = [json.loads(x) for x in raw[: raw.rfind(b"\n") + 1].splitlines()]  # complete lines
    (stack.tmp / "in.jsonl").unlink()
    stack.sidecar.start()
    progress = wait_done(stack, "vanish")
    assert progress.state == pb.SHARD_STATE_FAILED
    assert "in.jsonl" in progress.message and "No such file" in progress.message, progress.message
    after = records(stack.tmp / "out.jsonl")
    assert after[: len(before)] == before
    ids = [r["custom_id"] for r in after]
    assert len(ids) == len(set(ids))
    assert stack.healthy()
