"""The plugin's step records: each step's composition and measured time, for learning.

On vLLM's scheduling thread, :meth:`StepRecorder.compose_step` sums one scheduler output
into the seven counts of a :class:`~slipstream_scheduler.learning.StepRecord` and
:meth:`StepRecorder.record` appends the counts with the step's measured time to a bounded
deque: no allocation beyond one tuple, no I/O. A step that decodes the very batch the step
before it decoded (the steady state of a decoding batch) is counted from that step's counts
without visiting a request; any other step takes one pass over the scheduled requests,
integer adds only (:meth:`StepRecorder.compose`).

The plugin's channel thread calls :meth:`StepRecorder.flush`, which drains the deque and
writes the records as one JSON-lines segment ``steps/<unix ms>-<seq>.jsonl`` in the
channel directory (temporary file, then rename, so a reader never sees half a segment),
keeping the newest :data:`~slipstream_scheduler.enginecontrol.STEP_SEGMENTS_KEPT`. The
sidecar reads the segments it has not read yet (``slipstream_sidecar.enginechannel``). If
the sidecar falls behind, the oldest records are lost, never memory.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slipstream_scheduler.enginecontrol import (
    STEP_RECORDS_BUFFERED,
    STEP_SEGMENT_RECORDS,
    STEP_SEGMENTS_KEPT,
    STEPS_DIR,
)
from slipstream_scheduler.learning import StepRecord

logger = logging.getLogger(__name__)

Counts = tuple[int, int, int, int, int, int, int]
"""(num_prefill_requests, sum_prefill_tokens, sum_prefill_kv_tokens, sum_prefill_chunk_kv,
num_decode_requests, sum_decode_tokens, sum_decode_kv_tokens)."""


class StepRecorder:
    """A bounded buffer of step records between vLLM's scheduling thread and the channel
    thread (``deque.append`` and ``popleft`` are atomic, so no lock is taken)."""

    def __init__(self, capacity: int = STEP_RECORDS_BUFFERED) -> None:
        self._buf: deque[tuple[float, float, Counts]] = deque(maxlen=capacity)
        self._seq = 0
        self.recorded = 0
        self.written = 0
        self._last: Counts = (0, 0, 0, 0, 0, 0, 0)
        self._last_ids: list[str] = []

    def compose_step(
        self, scheduled: Mapping[str, int], total_tokens: int, preempted: bool,
        requests: Mapping[str, Any],
    ) -> Counts:
        """This step's counts (:meth:`compose`), called once per ``schedule()`` with its
        scheduler output's ``num_scheduled_tokens``, ``total_num_scheduled_tokens`` and
        whether it preempted a request.

        When every scheduled request gets one token (``total_tokens`` is their number), the
        step before was all decodes of the same requests in the same order, and nothing was
        preempted, each of them has exactly one more token of context than then (a request's
        context only shrinks when it is preempted): this step is those decodes with the last
        step's decode context plus one per request, and no request is visited."""
        n = len(scheduled)
        last = self._last
        ids = list(scheduled)
        if (n and total_tokens == n and not preempted and last[0] == 0 and last[4] == n
                and ids == self._last_ids):
            counts: Counts = (0, 0, 0, 0, n, n, last[6] + n)
        else:
            counts = self.compose(scheduled, requests)
        self._last, self._last_ids = counts, ids
        return counts

    @staticmethod
    def compose(scheduled: Mapping[str, int], requests: Mapping[str, Any]) -> Counts:
        """One step's counts, after vLLM's ``schedule()`` has advanced each scheduled
        request's ``num_computed_tokens`` by its tokens: a request is a decode when it got
        one token past its prompt, else a prefill chunk against the context before it."""
        n_p = s_p = p_kv = p_c = n_d = d_kv = 0
        for rid, n in scheduled.items():
            req = requests.get(rid)
            if req is None:
                continue
            ctx = req.num_computed_tokens - n
            if n == 1 and ctx >= req.num_prompt_tokens:
                n_d += 1
                d_kv += ctx
            else:
                n_p += 1
                s_p += n
                p_kv += ctx
                p_c += n * ctx
        return n_p, s_p, p_kv, p_c, n_d, n_d, d_kv

    def record(self, wall_time: float, counts: Counts) -> None:
        if wall_time > 0 and (counts[0] or counts[4]):
            self._buf.append((time.time(), wall_time, counts))
            self.recorded += 1

    def drain(self) -> list[StepRecord]:
        out: list[StepRecord] = []
        buf = self._buf
        while buf:
            at, wall, c = buf.popleft()
            out.append(StepRecord(wall_time=wall, num_prefill_requests=c[0],
                                  sum_prefill_tokens=c[1], sum_prefill_kv_tokens=c[2],
                                  sum_prefill_chunk_kv=c[3], num_decode_requests=c[4],
                                  sum_decode_tokens=c[5], sum_decode_kv_tokens=c[6], at=at))
        return out

    def pending(self) -> int:
        return len(self._buf)

    def flush(self, channel_dir: Path) -> int:
        """Write what is buffered as segments (the channel thread); returns records written."""
        recs = self.drain()
        if not recs:
            return 0
        folder = channel_dir / STEPS_DIR
        folder.mkdir(exist_ok=True)
        for i in range(0, len(recs), STEP_SEGMENT_RECORDS):
            chunk = recs[i:i + STEP_SEGMENT_RECORDS]
            self._seq += 1
            name = f"{int(time.time() * 1000):014d}-{os.getpid()}-{self._seq:08d}.jsonl"
            tmp = folder / f".{name}.tmp"
            tmp.write_text("".join(r.to_json() + "\n" for r in chunk))
            os.replace(tmp, folder / name)
            self.written += len(chunk)
        _prune(folder)
        return len(recs)


def _prune(folder: Path) -> None:
    names = sorted(p.name for p in folder.iterdir() if p.suffix == ".jsonl")
    for name in names[:-STEP_SEGMENTS_KEPT]:
        (folder / name).unlink(missing_ok=True)
