"""Compare JSON bodies and SSE streams by *shape* against recorded vLLM fixtures.

Used by the engine server's contract test and the sidecar's. A shape is the
set of keys, the nesting and the JSON type of every value; values themselves
(ids, text, token counts, timestamps) are not compared.

Rules (``shape_diff``):

* objects must have exactly the fixture's keys;
* a list is compared element-wise against the fixture list's first element;
  an empty fixture list requires an empty list (``"choices": []`` in the
  usage chunk);
* ``int`` where the fixture has ``float`` is fine (JSON has one number type),
  ``bool`` is never a number;
* ``null`` matches only ``null``, except under the keys in ``nullable`` (vLLM
  ``Optional`` fields whose presence of a value depends on the request or the
  outcome, e.g. ``stop_reason``), where ``null`` and any value match.

``parse_sse`` checks vLLM's framing (``data: <payload>\\n\\n`` events, last
one ``data: [DONE]``); ``stream_kinds`` classifies chunks so streams of
different lengths can be compared chunk kind by chunk kind.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "vllm"

# vLLM Optional fields whose null-ness depends on the request or the outcome.
NULLABLE: frozenset[str] = frozenset(
    {"stop_reason", "param", "token_ids", "prompt_token_ids", "token_strs", "finish_reason"}
)

FINISH_REASONS = frozenset({"stop", "length", "abort", "tool_calls"})


def load_fixture(name: str) -> dict[str, Any]:
    """One recorded vLLM exchange from ``tests/contract/vllm/<name>.json``."""
    path = Path(os.environ.get("SLIPSTREAM_VLLM_FIXTURES", FIXTURES)) / f"{name}.json"
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, list):
        return "list"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def shape_diff(
    expected: Any,
    actual: Any,
    *,
    nullable: Iterable[str] = NULLABLE,
    path: str = "$",
) -> list[str]:
    """Every place where ``actual`` differs in shape from ``expected`` (empty: same)."""
    nullable = frozenset(nullable)
    out: list[str] = []
    _diff(expected, actual, nullable, path, None, out)
    return out


def _diff(
    exp: Any, act: Any, nullable: frozenset[str], path: str, key: str | None, out: list[str]
) -> None:
    ek, ak = _kind(exp), _kind(act)
    if key in nullable and "null" in (ek, ak):
        return
    if ek != ak:
        if not (ek == "float" and ak == "int"):
            out.append(f"{path}: expected {ek}, got {ak}")
        return
    if ek == "object":
        missing = sorted(set(exp) - set(act))
        extra = sorted(set(act) - set(exp))
        if missing:
            out.append(f"{path}: missing keys {missing}")
        if extra:
            out.append(f"{path}: unexpected keys {extra}")
        for k in exp:
            if k in act:
                _diff(exp[k], act[k], nullable, f"{path}.{k}", k, out)
    elif ek == "list":
        if not exp:
            if act:
                out.append(f"{path}: expected an empty list, got {len(act)} items")
            return
        for i, item in enumerate(act):
            _diff(exp[0], item, nullable, f"{path}[{i}]", key, out)


def assert_same_shape(expected: Any, actual: Any, *, nullable: Iterable[str] = NULLABLE) -> None:
    diffs = shape_diff(expected, actual, nullable=nullable)
    assert not diffs, "shape differs from vLLM:\n  " + "\n  ".join(diffs)


def parse_sse(raw: bytes | str) -> list[str]:
    """The payloads of a vLLM SSE body, checking the framing; the last is ``[DONE]``."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    assert text.endswith("\n\n"), "SSE body must end with a blank line"
    events = text[:-2].split("\n\n")
    payloads = []
    for event in events:
        assert event.startswith("data: "), f"not a data event: {event[:60]!r}"
        assert "\n" not in event, f"multi-line event: {event[:60]!r}"
        payloads.append(event[len("data: ") :])
    assert payloads and payloads[-1] == "[DONE]", "stream must end with data: [DONE]"
    assert "[DONE]" not in payloads[:-1], "[DONE] before the end"
    return payloads


def chunk_kind(chunk: dict[str, Any]) -> str:
    """``usage`` (no choices), ``role`` (chat's first chunk), ``final`` or ``token``."""
    choices = chunk.get("choices", [])
    if not choices:
        return "usage"
    choice = choices[0]
    if "role" in choice.get("delta", {}):
        return "role"
    if choice.get("finish_reason") is not None:
        return "final"
    return "token"


def stream_kinds(chunks: Sequence[dict[str, Any]]) -> str:
    """A compact pattern of a stream: one letter per chunk (r, t, f, u)."""
    letters = {"role": "r", "token": "t", "final": "f", "usage": "u"}
    return "".join(letters[chunk_kind(c)] for c in chunks)


def assert_stream_matches(
    fixture_sse: Sequence[Any],
    actual: Sequence[dict[str, Any]],
    *,
    nullable: Iterable[str] = NULLABLE,
) -> None:
    """Each actual chunk has the shape of the fixture's chunk of the same kind."""
    expected = [c for c in fixture_sse if c != "[DONE]"]
    by_kind: dict[str, dict[str, Any]] = {}
    for chunk in expected:
        by_kind.setdefault(chunk_kind(chunk), chunk)
    exp_pattern = stream_kinds(expected)
    act_pattern = stream_kinds(actual)
    # Same kinds in the same order; token chunks may repeat any number of times.
    assert act_pattern.replace("t", "") == exp_pattern.replace("t", ""), (
        f"stream pattern {act_pattern!r} does not match vLLM's {exp_pattern!r}"
    )
    assert re.fullmatch(r"r?t*fu?", act_pattern), f"stream pattern {act_pattern!r}"
    for i, chunk in enumerate(actual):
        kind = chunk_kind(chunk)
        diffs = shape_diff(by_kind[kind], chunk, nullable=nullable, path=f"chunk[{i}]")
        assert not diffs, f"{kind} chunk differs from vLLM:\n  " + "\n  ".join(diffs)
        for choice in chunk.get("choices", []):
            fr = choice.get("finish_reason")
            assert fr is None or fr in FINISH_REASONS, f"finish_reason {fr!r}"
