"""The soak's judgement: what each online request saw, and whether the run held.

Pure functions over what ``slipstream bench soak`` recorded (no I/O): the faults it struck
(:class:`Strike`: when, what, which pod, when that pod served again), the online requests
(:class:`~slipstream_cli.loadgen.RequestResult`) and each OfflineJob's input and output
``custom_id`` s.

An online request's *outcome* is one of:

* ``ok``: a 200 stream with tokens that ended with ``data: [DONE]`` and no error event;
* ``http_<code>``: an HTTP error status (the body says why: a clean refusal);
* ``stream_error``: a 200 stream that ended with an error event (clean: the client is told);
* ``refused``: the connection was refused (nothing was accepted: clean, as a Service with
  no ready endpoint);
* ``cut``: a 200 stream that broke off (reset, or ended without ``[DONE]``), or a connection
  that dropped before its status;
* ``timeout``: no end within the client's timeout.

The run holds when no ``custom_id`` of a finished job is lost or duplicated, no job failed or
was left unfinished, and every online failure is *explained*: it ended while a struck pod was
down (from the strike until that pod served again, plus a grace), on that pod, and it is clean
or it is a ``cut`` of a connection to the very process that was killed (the sidecar in sidecar
mode, vLLM in engine mode: a socket whose process dies cannot be closed cleanly). A strike of
the operator explains no online failure: online traffic never crosses it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from slipstream_cli.loadgen import RequestResult

CLEAN = ("refused", "stream_error")
"""Outcomes (besides ``http_<code>``) that tell the client plainly that the request failed."""


@dataclass(frozen=True, slots=True)
class Strike:
    """One fault as struck: ``kind`` (kill-engine, kill-sidecar, kill-operator), the pod's
    online URL (empty for the operator), seconds after the load began, and when the pod
    served again (None: it did not within the soak's wait)."""

    kind: str
    target: str
    at_s: float
    recovered_s: float | None


@dataclass(frozen=True, slots=True)
class JobCheck:
    """One OfflineJob's end: its phase and its output against its input."""

    name: str
    phase: str
    inputs: int
    outputs: int
    lost: int
    duplicated: int

    @property
    def held(self) -> bool:
        return self.phase == "Succeeded" and self.lost == 0 and self.duplicated == 0


def outcome(result: RequestResult) -> str:
    """The outcome class of one online request (see the module docstring)."""
    if result.ok and result.done:
        return "ok"
    if result.status not in (0, 200):
        return f"http_{result.status}"
    error = result.error
    if result.status == 200 and error.startswith("data:"):
        return "stream_error"
    if "TimeoutError" in error or "ServerTimeoutError" in error:
        return "timeout"
    if result.status == 0 and ("ClientConnectorError" in error or "Connection refused" in error
                               or "ConnectionRefusedError" in error):
        return "refused"
    return "cut"


def check_job(name: str, phase: str, input_ids: Sequence[str],
              output_ids: Sequence[str]) -> JobCheck:
    """Every input ``custom_id`` in the output exactly once?"""
    seen = Counter(output_ids)
    wanted = set(input_ids)
    lost = sum(1 for cid in wanted if cid not in seen)
    duplicated = sum(n - 1 for n in seen.values() if n > 1)
    return JobCheck(name, phase, len(input_ids), len(output_ids), lost, duplicated)


def socket_holder(mode: str) -> str:
    """The fault that kills the process holding an online client's connection."""
    return "kill-engine" if mode == "engine" else "kill-sidecar"


def explaining_strike(result: RequestResult, kind: str, strikes: Iterable[Strike], *,
                      mode: str, grace_s: float, end_s: float) -> Strike | None:
    """The strike that explains a failed request, if one does: same pod, ended in its window,
    and clean or a cut of the killed process's own connection."""
    for strike in strikes:
        if strike.kind == "kill-operator" or strike.target != result.target:
            continue
        until = (strike.recovered_s if strike.recovered_s is not None else end_s) + grace_s
        if not strike.at_s <= result.ended_s <= until:
            continue
        if kind.startswith("http_") or kind in CLEAN:
            return strike
        if kind == "cut" and strike.kind == socket_holder(mode):
            return strike
    return None


def judge(results: Sequence[RequestResult], strikes: Sequence[Strike],
          jobs: Sequence[JobCheck], *, mode: str, grace_s: float, end_s: float,
          unfinished_jobs: int = 0) -> dict[str, Any]:
    """The soak's verdict: online outcomes, the unexplained failures, the jobs' checks."""
    outcomes: Counter[str] = Counter()
    explained: Counter[str] = Counter()
    unexplained: list[dict[str, Any]] = []
    for result in results:
        kind = outcome(result)
        outcomes[kind] += 1
        if kind == "ok":
            continue
        strike = explaining_strike(result, kind, strikes, mode=mode, grace_s=grace_s,
                                   end_s=end_s)
        if strike is not None:
            explained[strike.kind] += 1
        else:
            unexplained.append({"index": result.index, "target": result.target,
                                "outcome": kind, "sent_s": round(result.sent_s, 2),
                                "ended_s": round(result.ended_s, 2),
                                "error": result.error[:200]})
    downs = [s.recovered_s - s.at_s for s in strikes if s.recovered_s is not None]
    held = (not unexplained and all(j.held for j in jobs) and unfinished_jobs == 0
            and all(s.recovered_s is not None for s in strikes))
    return {
        "held": held,
        "online": {"sent": len(results), "outcomes": dict(sorted(outcomes.items())),
                   "failures_explained_by": dict(sorted(explained.items())),
                   "unexplained": unexplained},
        "jobs": [{"name": j.name, "phase": j.phase, "inputs": j.inputs, "outputs": j.outputs,
                  "lost": j.lost, "duplicated": j.duplicated} for j in jobs],
        "offline": {"jobs_finished": len(jobs), "jobs_unfinished": unfinished_jobs,
                    "requests": sum(j.inputs for j in jobs),
                    "lost": sum(j.lost for j in jobs),
                    "duplicated": sum(j.duplicated for j in jobs)},
        "strikes": [{"kind": s.kind, "target": s.target, "at_s": round(s.at_s, 1),
                     "down_s": None if s.recovered_s is None
                     else round(s.recovered_s - s.at_s, 1)} for s in strikes],
        "down_s_max": round(max(downs), 1) if downs else None,
    }
