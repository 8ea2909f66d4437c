"""Profiling the engine at start (setting ``profile_at_start_s``): run, keep, reload.

The sidecar runs ``slipstream profile engine`` (``slipstream_cli.commands.profile_engine``)
against its engine as a subprocess, so its event loop never waits on the profile or the fit,
under a hard limit of the budget plus :data:`GRACE_S`. The command writes the model to a
temporary name, with its held-out error in the document's fit block; the sidecar keeps the
summary the command printed (:data:`REPORT_FILE`) and renames the model to
:data:`PROFILE_FILE`, so that file exists only for a profile that finished. A sidecar that
finds it at start reuses it (:func:`load`) instead of profiling again.

Deliberately left out: putting the model in force (the operator does that through
``Configure``, as with a learned model) and refitting (one profile per state directory:
delete the file to profile again).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from slipstream_scheduler.latency import LatencyModelError, LinearLatencyModel

log = logging.getLogger(__name__)

PROFILE_FILE = "profiled-latency.json"
"""The fitted model in the state directory (``LinearLatencyModel`` JSON)."""
REPORT_FILE = "profiled-latency.report.json"
"""Beside it: the summary the command printed (for people; the error is in the model)."""
GRACE_S = 60.0
"""The subprocess is killed this long after its budget (start-up, the fit, the write)."""
MAX_STREAMS = 32
MAX_PROMPT_TOKENS = 2048
"""The command's defaults for ``--max-streams`` and ``--max-prompt-tokens``; the sidecar
passes them capped by the engine's ``max_num_seqs`` and ``max_num_batched_tokens``."""
MIN_BUDGET_S = 10
"""The command's smallest ``--budget-s``."""

@dataclass(frozen=True, slots=True)
class ProfiledModel:
    """A model ``slipstream profile engine`` fitted on this pod's engine at start."""

    model: LinearLatencyModel
    heldout_mape: float  # fraction, on the rows the fit did not see; inf: unknown
    fitted_at: float  # unix seconds (the file's modification time)

    @property
    def rows(self) -> int:
        """Rows the model was fitted on (0 when the file does not say)."""
        return self.model.stats.rows if self.model.stats is not None else 0


def load(directory: Path) -> ProfiledModel | None:
    """The profile kept in ``directory``; None when there is none or it is unreadable
    (logged)."""
    path = directory / PROFILE_FILE
    try:
        text = path.read_text()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read the profile %s: %s", path, exc)
        return None
    try:
        model = LinearLatencyModel.from_json(text)
    except (LatencyModelError, ValueError) as exc:
        log.warning("ignoring the unreadable profile %s: %s", path, exc)
        return None
    stats = model.stats
    heldout = stats.heldout_mape if stats is not None else None
    return ProfiledModel(model, math.inf if heldout is None else heldout, mtime)


def command(
    engine: str, model: str, out: Path, budget_s: float, *, max_streams: int,
    max_prompt_tokens: int,
) -> list[str]:
    """The ``slipstream profile engine`` command line, run with this Python."""
    return [
        sys.executable, "-m", "slipstream_cli.main", "profile", "engine",
        "--url", engine, "--model", model, "--out", str(out),
        "--budget-s", str(max(MIN_BUDGET_S, math.ceil(budget_s))),
        "--max-streams", str(max(1, min(MAX_STREAMS, max_streams))),
        "--max-prompt-tokens", str(max(16, min(MAX_PROMPT_TOKENS, max_prompt_tokens))),
    ]


async def run_command(argv: list[str], timeout_s: float) -> tuple[int | None, list[str]]:
    """Run ``argv``, logging each line it prints; (exit status or None when it was killed
    at ``timeout_s``, the lines). Cancelling this kills the process."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    lines: list[str] = []

    async def pump() -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            lines.append(line)
            log.info("profile engine: %s", line)

    reader = asyncio.ensure_future(pump())
    try:
        await asyncio.wait_for(asyncio.gather(reader, proc.wait()), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return None, lines
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise
    return proc.returncode, lines


def _write_report(directory: Path, lines: list[str]) -> None:
    doc = {"summary": lines}
    tmp = directory / (REPORT_FILE + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, directory / REPORT_FILE)


async def profile(
    engine: str, model: str, directory: Path, budget_s: float, *, max_streams: int,
    max_prompt_tokens: int,
) -> ProfiledModel | None:
    """Profile ``engine`` serving ``model`` into ``directory``; the model, or None when the
    command failed or ran out of time (logged either way)."""
    partial = directory / (PROFILE_FILE + ".partial")
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()
    argv = command(engine, model, partial, budget_s, max_streams=max_streams,
                   max_prompt_tokens=max_prompt_tokens)
    log.info("profiling the engine (%s, %s) for %.0f s before reporting ready",
             engine, model, budget_s)
    began = time.monotonic()
    status, lines = await run_command(argv, budget_s + GRACE_S)
    took = time.monotonic() - began
    if status != 0 or not partial.is_file():
        why = (f"was killed after {took:.0f} s (limit {budget_s + GRACE_S:.0f} s)"
               if status is None else f"failed (exit status {status}) after {took:.0f} s")
        log.error("profile at start %s; no profiled model, readiness follows the engine: %s",
                  why, " | ".join(lines[-3:]) or "no output")
        return None
    _write_report(directory, lines)
    os.replace(partial, directory / PROFILE_FILE)
    found = load(directory)
    if found is not None:
        error = f"{found.heldout_mape:.2%}" if math.isfinite(found.heldout_mape) else "unknown"
        log.info("profile at start done in %.0f s: %d rows, held-out MAPE %s; reported as "
                 "the profiled model (%s)", took, found.rows, error, directory / PROFILE_FILE)
    return found
