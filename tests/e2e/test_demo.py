"""``slipstream demo`` end to end: naive co-location, then Slipstream, on the same pods.

Runs the demo as a user does (a subprocess, the shipped data only) on the session's local
cluster (``--keep-cluster``: the fixture owns its lifecycle), with a replay of 60 s in place of
the default 120 (three peaks and valleys of 20 s, as many as the default's), then checks what
it printed and wrote: both runs answered every online request and served offline work, the
naive run got no budget and the Slipstream run got the operator's, each run printed its verdict
per SLO and its offline throughput, and the ``kubectl get`` lines read right (TOK/S not 0 while
PROGRESS climbs, ETA in whole units).

Which verdict each run gets is printed, not asserted: latency on this shared host moves with
its load (naive co-location measured TBT p99 72-92 ms on a quiet 2-core host, against the
65 ms SLO), and performance is shown by runs and benchmarks, not by timed assertions.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream_testbed.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
ETA = re.compile(r"^(\d+h\d+m|\d+m\d+s|\d+s)$")
JOB_LINE = re.compile(r"^offlinejob\.slipstream\.dev/(\S+)\s+(\w+)\s+(\d+)/(\d+)\s+(\S+)\s+(.*)$")


def _job_readings(lines: list[str]) -> list[tuple[str, int, float, str]]:
    """(phase, done, TOK/S, ETA or "") of every printed OfflineJob line, in order."""
    out = []
    for line in lines:
        m = JOB_LINE.match(line.strip())
        if m is None:
            continue
        rest = m.group(6).split()
        eta = rest[0] if len(rest) == 2 else ""  # ETA is empty when unknown; AGE is last
        out.append((m.group(2), int(m.group(3)), float(m.group(5)), eta))
    return out


def test_demo_runs_naive_then_slipstream_and_reports_both(cluster: LocalCluster,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "demo"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream_cli.main", "demo", "--out", str(out),
         "--keep-cluster", "--duration", "60", "--period", "20"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    printed = proc.stdout
    assert proc.returncode == 0, printed[-4000:] + proc.stderr[-4000:]

    summary = json.loads((out / "summary.json").read_text())
    naive, slip = summary["runs"]["naive"], summary["runs"]["slipstream"]
    assert summary["engine"] == "model" and summary["mode"] == "sidecar", summary
    assert naive["budget"] in ("", "none"), naive  # no latency profile: no budget
    assert slip["budget"] not in ("", "none"), slip  # the operator's budget from the SLO
    for name, run in (("naive", naive), ("slipstream", slip)):
        assert set(run["slo_met"]) == {"ttft_p99", "tbt_p99"}, run
        assert run["ok"] > 0 and run["ok"] == run["sent"], run
        assert run["offline_tokens_per_s"] and run["offline_tokens_per_s"] > 0, run
        rate = re.search(rf"^{name}: SLO (met|broken \([a-z0-9_, ]+\)); offline "
                         r"([0-9.]+) tokens/s$", printed, re.MULTILINE)
        assert rate is not None, printed[-3000:]
        assert float(rate.group(2)) == pytest.approx(run["offline_tokens_per_s"], abs=0.06)
    assert re.search(r"TTFT p99 \(SLO 300 ms\)", printed), printed[-3000:]
    assert (out / "timeline.png").stat().st_size > 0

    # The kubectl get lines each run printed: the columns, and rates a person can trust.
    for name, run in (("naive", naive), ("slipstream", slip)):
        lines: list[str] = run["kubectl_get"]
        assert any("OFFLINE-TOK/S" in line for line in lines), lines
        assert any(line.split()[:5] == ["NAME", "PHASE", "PROGRESS", "TOK/S", "ETA"]
                   for line in lines), lines
        readings = [r for r in _job_readings(lines) if r[0] == "Running"]
        assert len(readings) >= 3, lines
        for (_, before, _, _), (_, after, tps, eta) in itertools.pairwise(readings):
            if after > before:
                assert tps > 0, f"{name}: TOK/S 0 while PROGRESS climbed: {lines}"
            assert eta == "" or ETA.match(eta), f"{name}: ETA {eta!r}"
        assert "ms" not in " ".join(r[3] for r in readings)
        # The backlog outlasts the replay: the job is still running when the replay ends.
        assert run["offline_requests_done"] < summary["offline_requests"], run

    assert "Demo timeline" in printed
    for phase in ("cluster", "install", "replay: naive", "replay: slipstream"):
        assert re.search(rf"\[\d+m\d\ds\] {re.escape(phase)}", printed), phase
