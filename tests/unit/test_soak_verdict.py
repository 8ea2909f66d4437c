"""The soak's judgement: outcome classes, which strike explains a failure, exactly-once jobs,
and the verdict (``slipstream_cli.benches.soak_verdict``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream_cli.benches.soak import thin
from slipstream_cli.benches.soak_verdict import Strike, check_job, judge, outcome
from slipstream_cli.loadgen import RequestResult, TraceRequest

pytestmark = pytest.mark.unit

A, B = "http://127.1.0.2:8001", "http://127.1.3.1:8001"


def result(index: int, *, target: str = A, ended: float = 50.0, ok: bool = True,
           done: bool = True, status: int = 200, error: str = "") -> RequestResult:
    return RequestResult(index=index, target=target, scheduled_s=ended - 1, sent_s=ended - 1,
                         ok=ok, status=status, ttft_s=0.1 if ok or status == 200 else None,
                         gaps_s=(), output_tokens=3 if status == 200 else 0, error=error,
                         ended_s=ended, done=done)


REFUSED = result(1, ok=False, done=False, status=0,
                 error="ClientConnectorError: Cannot connect to host 127.1.0.2:8001 "
                       "[Connect call failed ('127.1.0.2', 8001)]")
CUT = result(2, ok=False, done=False, error="ClientPayloadError: Response payload is not "
             "completed")
SHORT = result(3, ok=True, done=False)  # a 200 stream that ended without [DONE]
STREAM_ERROR = result(4, ok=False, done=False,
                      error='data: {"error": {"message": "engine gone"}}')
HTTP_503 = result(5, ok=False, done=False, status=503, error='{"error": {"message": "x"}}')
TIMEOUT = result(6, ok=False, done=False, error="TimeoutError: ")


def test_each_failure_has_its_class() -> None:
    assert outcome(result(0)) == "ok"
    assert [outcome(r) for r in (REFUSED, CUT, SHORT, STREAM_ERROR, HTTP_503, TIMEOUT)] == [
        "refused", "cut", "cut", "stream_error", "http_503", "timeout"]


@pytest.mark.parametrize(("mode", "kind", "cut_explained"), [
    ("engine", "kill-engine", True), ("engine", "kill-sidecar", False),
    ("sidecar", "kill-sidecar", True), ("sidecar", "kill-engine", False),
])
def test_a_cut_is_explained_only_by_the_process_holding_the_socket(
        mode: str, kind: str, cut_explained: bool) -> None:
    strikes = [Strike(kind, A, 40.0, 55.0)]
    verdict = judge([result(0), CUT, STREAM_ERROR], strikes, [], mode=mode, grace_s=5.0,
                    end_s=600.0)
    unexplained = [u["outcome"] for u in verdict["online"]["unexplained"]]
    assert unexplained == ([] if cut_explained else ["cut"])
    assert verdict["online"]["failures_explained_by"] == {kind: 2 if cut_explained else 1}
    assert verdict["held"] is cut_explained


def test_a_failure_outside_the_window_or_on_another_pod_is_unexplained() -> None:
    strikes = [Strike("kill-engine", A, 40.0, 45.0), Strike("kill-operator", "", 48.0, 50.0)]
    late = result(7, ok=False, done=False, status=503, ended=60.0)  # 45 + 10 grace < 60
    other_pod = result(8, target=B, ok=False, done=False, status=503, ended=42.0)
    in_window = result(9, ok=False, done=False, status=503, ended=54.0)
    verdict = judge([late, other_pod, in_window], strikes, [], mode="engine", grace_s=10.0,
                    end_s=600.0)
    assert [u["index"] for u in verdict["online"]["unexplained"]] == [7, 8]
    assert verdict["online"]["outcomes"] == {"http_503": 3}
    assert not verdict["held"]


def test_a_pod_that_never_came_back_fails_the_soak_and_its_window_runs_to_the_end() -> None:
    strikes = [Strike("kill-engine", A, 40.0, None)]
    verdict = judge([result(1, ok=False, done=False, status=503, ended=500.0)], strikes, [],
                    mode="engine", grace_s=5.0, end_s=600.0)
    assert verdict["online"]["unexplained"] == []
    assert not verdict["held"] and verdict["strikes"][0]["down_s"] is None


def test_jobs_are_checked_for_exactly_once() -> None:
    ids = [f"q{i}" for i in range(5)]
    good = check_job("soak-000", "Succeeded", ids, list(reversed(ids)))
    assert good.held and (good.lost, good.duplicated) == (0, 0)
    bad = check_job("soak-001", "Succeeded", ids, ["q0", "q1", "q1", "q2", "q3"])
    assert (bad.lost, bad.duplicated, bad.held) == (1, 1, False)
    failed = check_job("soak-002", "Failed", ids, ids)
    assert not failed.held
    verdict = judge([result(0)], [], [good], mode="sidecar", grace_s=5.0, end_s=10.0)
    assert verdict["held"] and verdict["offline"] == {
        "jobs_finished": 1, "jobs_unfinished": 0, "requests": 5, "lost": 0, "duplicated": 0}
    assert not judge([result(0)], [], [good, bad], mode="sidecar", grace_s=5.0,
                     end_s=10.0)["held"]
    assert not judge([result(0)], [], [good], mode="sidecar", grace_s=5.0, end_s=10.0,
                     unfinished_jobs=1)["held"]


def test_thinning_keeps_a_seeded_share_with_the_times_unchanged() -> None:
    requests = [TraceRequest(0.1 * i, 10, 10) for i in range(2000)]
    kept = thin(requests, 0.25, seed=3)
    assert kept == thin(requests, 0.25, seed=3) != thin(requests, 0.25, seed=4)
    assert 400 <= len(kept) <= 600
    assert set(kept) <= set(requests)


def test_a_soak_thread_that_dies_leaves_its_error_for_the_verdict(tmp_path: Path) -> None:
    from slipstream_cli.benches.soak import Soak

    soak = Soak(runner=None, kube=None, mode="engine", out=tmp_path)

    def broken(n: int, *, why: str) -> None:
        raise RuntimeError(f"{why} {n}")

    thread = soak.guarded("jobs", broken, 3, why="kubectl timed out")
    thread.start()
    thread.join(timeout=10)
    assert soak.errors == ["jobs: RuntimeError: kubectl timed out 3"]
