"""Status carries the online latency histograms and counters that /metrics exports.

The sidecar builds them from its own metric families, the operator turns them into the same
:class:`~slipstream_operator.observe.Sample` that a scrape of ``/metrics`` gives, a reply it
has already seen is not counted twice in a pod's history, and a malformed histogram sends the
operator back to scraping. The fleet stand-in is checked over real loopback gRPC.
"""

from __future__ import annotations

import itertools

import pytest

from slipstream_operator.observe import PodHistory, Sample, parse_sample
from slipstream_operator.sidecar_client import GrpcSidecarControl, PodAddress, _online_sample
from slipstream_sidecar.grpc_server import counters_pb
from slipstream_sidecar.metrics import SidecarMetrics
from slipstream_testbed.fleet.standin import Standin, StandinConfig, render_metrics

pytestmark = pytest.mark.unit

_ports = itertools.count(46000 + (id(object()) % 400) * 8, 2)


def _busy_metrics() -> SidecarMetrics:
    m = SidecarMetrics()
    for v in (0.004, 0.03, 0.3, 0.31, 2.5, 90.0):  # the last past every bound: +Inf only
        m.ttft.labels("online").observe(v)
    for v in (0.002, 0.02, 0.02, 0.2):
        m.tbt.labels("online").observe(v)
    m.ttft.labels("offline").observe(7.0)  # another class: never counted as online
    m.admitted.labels("online").inc(9)
    m.admitted.labels("offline").inc(4)
    m.finished.labels("online", "ok").inc(6)
    m.finished.labels("online", "error").inc(2)
    m.output_tokens.labels("online").inc(321)
    m.output_tokens.labels("offline").inc(1000)
    return m


def test_the_sidecars_counters_equal_its_metrics_as_the_operator_reads_them() -> None:
    m = _busy_metrics()
    scraped = parse_sample(m.render().decode(), 12.5)
    from_status = _online_sample(counters_pb(m.counters("online")), 12.5)
    assert from_status == scraped
    assert scraped.ttft.count == 6 and scraped.admitted == 9 and scraped.finished == 6
    assert scraped.ttft.buckets[-1] == (float("inf"), 6.0)
    empty = _online_sample(counters_pb(SidecarMetrics().counters("online")), 0.0)
    assert empty == parse_sample(SidecarMetrics().render().decode(), 0.0)
    assert empty is not None and empty.ttft.count == 0 and empty.admitted == 0


def test_a_malformed_histogram_is_refused() -> None:
    msg = counters_pb(_busy_metrics().counters("online"))
    del msg.tbt_seconds.cumulative_counts[-1]
    assert _online_sample(msg, 0.0) is None


def _sample(at_s: float, admitted: float) -> Sample:
    m = SidecarMetrics()
    m.admitted.labels("online").inc(admitted)
    return parse_sample(m.render().decode(), at_s)


def test_a_reply_seen_twice_is_one_sample() -> None:
    history = PodHistory()
    history.add(_sample(10.0, 1), window_s=60.0)
    history.add(_sample(15.0, 3), window_s=60.0)
    history.add(_sample(15.0, 3), window_s=60.0)  # the cached reply, read by a second tick
    history.add(_sample(14.0, 2), window_s=60.0)  # older than the last: never appended
    assert [s.at_s for s in history.samples] == [10.0, 15.0]
    window = history.window()
    assert window is not None and window.admitted == 2 and history.span_s() == 5.0


@pytest.mark.parametrize("counters", [True, False])
async def test_the_standin_sends_counters_unless_it_plays_an_older_sidecar(
    counters: bool,
) -> None:
    grpc_port = next(_ports)
    standin = Standin(StandinConfig(http_port=grpc_port + 1, grpc_port=grpc_port,
                                    status_counters=counters))
    await standin.start()
    control = GrpcSidecarControl(timeout_s=5.0)
    try:
        pod = await standin.add_pod("pod-0", "127.1.252.10", "tok")
        for _ in range(3):
            standin.bump()
        status = await control.status(PodAddress("pod-0", "127.1.252.10", grpc_port, "tok"))
    finally:
        await control.close()
        await standin.stop()
    if not counters:
        assert status.online_sample is None
        return
    assert status.online_sample is not None
    scraped = parse_sample(render_metrics(pod), status.online_sample.at_s)
    assert status.online_sample == scraped and scraped.admitted == 3
