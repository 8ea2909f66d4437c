"""Mooncake (Kimi) traces as online arrivals with real prefix sharing.

JSONL ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``
(Qin et al., "Mooncake", FAST'25; Apache-2.0). ``hash_ids`` identify 512-token
prefix blocks; they are expanded to the engine's 16-token block hashes, so
requests that share a Mooncake block share 32 engine blocks.

Deliberately left out: the tool-agent trace (not in the shared data).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from slipstream_cli.workloads import WorkloadError, data_path
from slipstream_scheduler.sim.workload import SimRequest, expand_block_hashes
from slipstream_scheduler.types import RequestClass

CONVERSATION = "mooncake/conversation_trace.dev.jsonl"
SYNTHETIC = "mooncake/synthetic_trace.jsonl"
MOONCAKE_BLOCK = 512


def parse_lines(lines: Iterable[str], prefix: str = "mc") -> tuple[SimRequest, ...]:
    """Parse JSONL lines into online requests (arrival in seconds)."""
    out: list[SimRequest] = []
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ts, inp, outp = (
                float(rec["timestamp"]),
                int(rec["input_length"]),
                int(rec["output_length"]),
            )
            ids = [int(h) for h in rec["hash_ids"]]
        except (ValueError, KeyError, TypeError) as e:
            raise WorkloadError(f"bad Mooncake line {n + 1}: {e}") from e
        if inp < 1 or outp < 1:
            continue
        out.append(
            SimRequest(
                request_id=f"{prefix}-{n}",
                cls=RequestClass.ONLINE,
                arrival_s=ts / 1000.0,
                prompt_tokens=inp,
                output_tokens=outp,
                block_hashes=expand_block_hashes(ids, MOONCAKE_BLOCK, inp),
            )
        )
    out.sort(key=lambda r: r.arrival_s)
    return tuple(out)


def load(path: Path | str | None = None, prefix: str = "mc") -> tuple[SimRequest, ...]:
    """Load a Mooncake trace (default: the conversation dev trace)."""
    p = Path(path) if path is not None else data_path(CONVERSATION)
    with p.open(encoding="utf-8") as f:
        return parse_lines(f, prefix=prefix)
