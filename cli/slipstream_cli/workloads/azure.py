"""Azure LLM inference trace 2023 (conversation and code services) as online arrivals.

CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` (Patel et al., "Splitwise",
ISCA 2024; CC-BY 4.0). Arrival times are re-based so the first row arrives at
0 s. The trace has no prompt text, so each request gets prefix-block hashes
that share nothing with any other request.

Deliberately left out: the week-long 2024 traces (not in the shared data).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from slipstream_cli.workloads import WorkloadError, data_path, stable_salt
from slipstream_scheduler.sim.workload import SimRequest, unique_block_hashes
from slipstream_scheduler.types import RequestClass

CONV = "azure_llm_2023/AzureLLMInferenceTrace_conv.dev.csv"
CODE = "azure_llm_2023/AzureLLMInferenceTrace_code.dev.csv"
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def _seconds(stamp: str) -> float:
    # "2023-11-16 18:15:46.6805900": 7 fractional digits; split them off so the
    # sub-second part keeps full precision.
    whole, _, frac = stamp.partition(".")
    base = datetime.fromisoformat(whole).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def parse_lines(
    lines: Iterable[str], prefix: str = "az", cls: RequestClass = RequestClass.ONLINE
) -> tuple[SimRequest, ...]:
    """Parse the CSV lines (header first) into requests, arrivals re-based to 0 s.

    Rows with zero context or zero generated tokens are skipped (the engine
    cannot serve them); the trace has a handful.
    """
    it = iter(lines)
    header = next(it, "").strip()
    if header != HEADER:
        raise WorkloadError(f"unexpected Azure trace header {header!r}")
    out: list[SimRequest] = []
    t0: float | None = None
    for n, line in enumerate(it):
        row = line.strip()
        if not row:
            continue
        stamp, ctx, gen = row.split(",")
        t = _seconds(stamp)
        if t0 is None:
            t0 = t
        prompt, output = int(ctx), int(gen)
        if prompt < 1 or output < 1:
            continue
        out.append(
            SimRequest(
                request_id=f"{prefix}-{n}",
                cls=cls,
                arrival_s=t - t0,
                prompt_tokens=prompt,
                output_tokens=output,
                block_hashes=unique_block_hashes(stable_salt(prefix, n), prompt),
            )
        )
    return tuple(out)


def load(path: Path | str | None = None, prefix: str = "az") -> tuple[SimRequest, ...]:
    """Load an Azure trace (default: the conversation dev trace) as online requests."""
    p = Path(path) if path is not None else data_path(CONV)
    with p.open(encoding="utf-8") as f:
        return parse_lines(f, prefix=prefix)
