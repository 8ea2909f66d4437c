"""arXiv-summarisation token counts (Vidur, MIT) as offline batch work.

CSV ``num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio`` with
Llama-2 tokenizer counts: long prompts, short outputs, a stand-in for a
nightly summarisation job. No text, so no prefix sharing: each request gets
its own block hashes (which still lets a preempted request's continuation hit
its own cached prefix).

Deliberately left out: timestamps (the dataset has none; offline work is
queued at t = 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from slipstream_cli.workloads import WorkloadError, data_path, stable_salt
from slipstream_scheduler.sim.workload import SimRequest, unique_block_hashes
from slipstream_scheduler.types import RequestClass

LENGTHS = "lengths/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"
HEADER = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio"


def parse_lines(
    lines: Iterable[str], prefix: str = "ax", limit: int | None = None, max_prompt: int = 0
) -> tuple[SimRequest, ...]:
    """Parse the CSV lines into offline requests queued at t = 0.

    ``max_prompt`` > 0 drops rows whose prompt plus output exceeds it (the
    model's context window).
    """
    it = iter(lines)
    header = next(it, "").strip()
    if header != HEADER:
        raise WorkloadError(f"unexpected arXiv lengths header {header!r}")
    out: list[SimRequest] = []
    for n, line in enumerate(it):
        if limit is not None and len(out) >= limit:
            break
        row = line.strip()
        if not row:
            continue
        p, d = row.split(",")[:2]
        prompt, output = int(p), int(d)
        if prompt < 1 or output < 1 or (max_prompt and prompt + output > max_prompt):
            continue
        out.append(
            SimRequest(
                request_id=f"{prefix}-{n}",
                cls=RequestClass.OFFLINE,
                arrival_s=0.0,
                prompt_tokens=prompt,
                output_tokens=output,
                block_hashes=unique_block_hashes(stable_salt(prefix, n), prompt),
            )
        )
    return tuple(out)


def load(
    path: Path | str | None = None, limit: int | None = None, max_prompt: int = 4096
) -> tuple[SimRequest, ...]:
    """Load the arXiv lengths (default: the shared Vidur CSV), fitting a 4k context."""
    p = Path(path) if path is not None else data_path(LENGTHS)
    with p.open(encoding="utf-8") as f:
        return parse_lines(f, limit=limit, max_prompt=max_prompt)
