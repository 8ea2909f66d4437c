"""OpenAI Batch line parsing, record shapes and the durable append-only log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream_sidecar.batch_io import (
    DurableLog,
    error_record,
    local_path,
    parse_line,
    success_record,
)
from slipstream_sidecar.errors import BatchLineError

pytestmark = pytest.mark.unit

MODEL = "llama-2-7b"


def _line(**over: object) -> bytes:
    doc: dict[str, object] = {
        "custom_id": "r1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": "Hello", "max_tokens": 8},
    }
    doc.update(over)
    return json.dumps(doc).encode()


def test_valid_line_merges_defaults_and_strips_client_priority() -> None:
    raw = _line(body={"model": MODEL, "prompt": "Hi", "priority": -5, "stream": True})
    req = parse_line(raw, 7, model=MODEL, defaults={"max_tokens": 16, "seed": 3})
    assert req.line_no == 7 and req.custom_id == "r1"
    assert req.body == {"model": MODEL, "prompt": "Hi", "max_tokens": 16, "seed": 3}


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"[1, 2]", "invalid_json"),
        (_line(custom_id=None), "invalid_request"),
        (_line(url="/v1/embeddings"), "invalid_url"),
        (_line(method="GET"), "invalid_request"),
        (_line(body={"model": "other", "prompt": "x"}), "model_not_found"),
        (_line(body={"model": MODEL, "prompt": ["a", "b"]}), "invalid_request"),
        (_line(body={"model": MODEL, "prompt": "a", "n": 2}), "invalid_request"),
        (_line(body={"model": MODEL, "prompt": "a", "logprobs": 2}), "unsupported_parameter"),
        (_line(url="/v1/chat/completions", body={"model": MODEL, "messages": []}),
         "invalid_request"),
    ],
)
def test_bad_lines_name_their_line(raw: bytes, code: str) -> None:
    with pytest.raises(BatchLineError) as info:
        parse_line(raw, 41, model=MODEL)
    assert info.value.code == code
    assert info.value.line_no == 41
    assert "line 41" in str(info.value)


def test_records_have_the_openai_batch_shape() -> None:
    req = parse_line(_line(), 3, model=MODEL)
    ok = json.loads(success_record("s1", req, "cmpl-1", {"x": 1}))
    assert ok == {
        "id": "batch_req_s1_L3",
        "custom_id": "r1",
        "response": {"status_code": 200, "request_id": "cmpl-1", "body": {"x": 1}},
        "error": None,
    }
    err = json.loads(error_record("s1", 4, None, "invalid_json", "line 4: bad"))
    assert err["response"] is None and err["error"] == {"code": "invalid_json",
                                                        "message": "line 4: bad"}


def test_log_truncates_a_torn_tail_and_indexes_complete_records(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    req = parse_line(_line(), 0, model=MODEL)
    whole = success_record("s", req, "a", {})
    torn = error_record("s", 1, "r2", "x", "y")[:-7]  # a crash in the middle of a write
    path.write_bytes(whole + torn)
    log = DurableLog(path)
    index = log.open()
    assert index.lines == {0} and index.custom_ids == {"r1"}
    assert index.truncated_bytes == len(torn)
    log.append(error_record("s", 1, "r2", "x", "y"))
    log.close()
    lines = path.read_bytes().splitlines()
    assert [json.loads(raw)["custom_id"] for raw in lines] == ["r1", "r2"]
    again = DurableLog(path)
    assert again.open().lines == {0, 1}
    again.close()


def test_log_refuses_partial_or_multi_line_records(tmp_path: Path) -> None:
    log = DurableLog(tmp_path / "o.jsonl")
    log.open()
    with pytest.raises(ValueError):
        log.append(b'{"a":1}')
    with pytest.raises(ValueError):
        log.append(b'{"a":1}\n{"b":2}\n')
    log.close()


def test_local_path() -> None:
    assert local_path("file:///tmp/x.jsonl") == Path("/tmp/x.jsonl")
    assert local_path("/tmp/y") == Path("/tmp/y")
    assert local_path("s3://bucket/key") is None
