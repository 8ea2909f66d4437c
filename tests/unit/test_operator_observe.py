"""Window statistics from the sidecars' Prometheus text: means, P99, rate, restarts."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from slipstream_operator.observe import (
    PodHistory,
    combine,
    parse_sample,
    promql_queries,
    stats_from_prometheus,
)

pytestmark = pytest.mark.unit

BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class FakeSidecar:
    """A real prometheus_client registry with the sidecar's metric names."""

    def __init__(self) -> None:
        r = CollectorRegistry()
        self.ttft = Histogram("slipstream_ttft_seconds", "", ["class"], buckets=BUCKETS,
                              registry=r)
        self.tbt = Histogram("slipstream_tbt_seconds", "", ["class"], buckets=BUCKETS,
                             registry=r)
        self.admitted = Counter("slipstream_requests_admitted_total", "", ["class"], registry=r)
        self.finished = Counter("slipstream_requests_finished_total", "", ["class", "outcome"],
                                registry=r)
        self.tokens = Counter("slipstream_output_tokens_total", "", ["class"], registry=r)
        self.registry = r

    def request(self, ttft: float, gaps: list[float], cls: str = "online") -> None:
        self.admitted.labels(cls).inc()
        self.ttft.labels(cls).observe(ttft)
        for gap in gaps:
            self.tbt.labels(cls).observe(gap)
        self.tokens.labels(cls).inc(len(gaps) + 1)
        self.finished.labels(cls, "ok").inc()

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def test_window_mean_p99_and_rate() -> None:
    side = FakeSidecar()
    history = PodHistory()
    side.request(0.3, [0.03] * 9)  # before the window opens
    history.add(parse_sample(side.text(), 0.0), window_s=60.0)
    for _ in range(99):
        side.request(0.15, [0.015] * 4)
    side.request(3.0, [0.4] * 10)  # one slow request: 10 of 406 gaps, above the 1 %
    side.request(0.2, [0.01], cls="offline")  # other class: ignored
    history.add(parse_sample(side.text(), 50.0), window_s=60.0)
    stats = combine([history], default_prompt_tokens=1000.0, default_output_tokens=200.0)
    obs = stats.observed
    assert obs.samples == 100
    assert obs.ttft_mean_s == pytest.approx((99 * 0.15 + 3.0) / 100)
    assert obs.ttft_p99_s is not None and 0.1 < obs.ttft_p99_s <= 0.2  # 99th of 100 is fast
    assert obs.tbt_mean_s == pytest.approx((396 * 0.015 + 10 * 0.4) / 406)
    assert obs.tbt_p99_s is not None and 0.1 < obs.tbt_p99_s <= 0.5
    assert stats.load.arrival_rate_rps == pytest.approx(100 / 50.0)
    assert stats.load.mean_output_tokens == pytest.approx((99 * 5 + 11) / 100)


def test_pods_are_summed_and_a_restart_counts_from_zero() -> None:
    a, b = FakeSidecar(), FakeSidecar()
    ha, hb = PodHistory(), PodHistory()
    for _ in range(10):
        a.request(0.1, [0.02])
    ha.add(parse_sample(a.text(), 0.0), 60.0)
    hb.add(parse_sample(b.text(), 0.0), 60.0)
    for _ in range(5):
        a.request(0.1, [0.02])
    b_restarted = FakeSidecar()
    for _ in range(3):
        b_restarted.request(1.0, [0.02])
    ha.add(parse_sample(a.text(), 10.0), 60.0)
    hb.add(parse_sample(b_restarted.text(), 10.0), 60.0)
    hb_window = hb.window()
    assert hb_window is not None and hb_window.ttft.count == 3
    stats = combine([ha, hb], 1000.0, 200.0)
    assert stats.observed.samples == 8
    assert stats.observed.ttft_mean_s == pytest.approx((5 * 0.1 + 3 * 1.0) / 8)


def test_old_samples_leave_the_window() -> None:
    side = FakeSidecar()
    history = PodHistory()
    for t in range(0, 200, 10):
        side.request(0.1, [0.02])
        history.add(parse_sample(side.text(), float(t)), window_s=60.0)
    assert 50.0 <= history.span_s() <= 70.0
    win = history.window()
    assert win is not None and 5 <= win.ttft.count <= 7


def test_prometheus_results_become_the_same_statistics() -> None:
    values = {"ttft_p99_s": 1.2, "ttft_mean_s": 0.4, "tbt_p99_s": float("nan"),
              "tbt_mean_s": None, "samples": 57.0, "arrival_rate_rps": 1.9}
    stats = stats_from_prometheus(values, 300.0, 1000.0, 200.0)
    assert stats.observed.samples == 57
    assert stats.observed.ttft_p99_s == 1.2 and stats.observed.tbt_p99_s is None
    assert stats.load.arrival_rate_rps == 1.9 and stats.span_s == 300.0


def test_promql_selects_the_service_and_online_class() -> None:
    queries = promql_queries("team-a", "chat", "5m")
    assert set(queries) == {"ttft_p99_s", "ttft_mean_s", "tbt_p99_s", "tbt_mean_s", "samples",
                            "arrival_rate_rps"}
    assert 'slipstream_dev_service="chat"' in queries["ttft_p99_s"]
    assert 'class="online"' in queries["tbt_mean_s"] and "[5m]" in queries["tbt_mean_s"]
    assert queries["ttft_p99_s"].startswith("histogram_quantile(0.99")


def test_the_fast_reader_agrees_with_prometheus_client_and_falls_back_on_odd_text() -> None:
    from slipstream_operator.observe import _client_samples, _fast_samples, _UnparsedError
    from slipstream_testbed.fleet.standin import FakePod, render_metrics

    side = FakeSidecar()
    side.request(0.3, [0.02, 0.04])
    side.request(1.7, [0.5], cls="offline")
    pod = FakePod("p", "127.0.0.1", "t")
    pod.online_requests = 3
    odd_label = 'slipstream_requests_admitted_total{note="a \\"b\\" \\\\ c",class="online"} 4.0\n'
    for text in (side.text(), render_metrics(pod), odd_label):
        assert _fast_samples(text) == _client_samples(text)
        for cls in ("online", "offline"):
            assert parse_sample(text, 1.0, cls) == _reference(text, cls)
    # A line neither reader can read is an error, as it was with prometheus_client alone.
    broken = 'slipstream_requests_admitted_total{class="online" 3.0\n'
    with pytest.raises(_UnparsedError):
        _fast_samples(broken)
    with pytest.raises(ValueError):
        parse_sample(broken, 1.0)


def _reference(text: str, cls: str) -> object:
    """The pre-regex implementation, kept here as the oracle."""
    from prometheus_client.parser import text_string_to_metric_families

    from slipstream_operator.observe import Histogram, Sample

    names = ("slipstream_ttft_seconds", "slipstream_tbt_seconds")
    hist: dict[str, dict[str, float]] = {n: {} for n in names}
    sums = dict.fromkeys(names, 0.0)
    counts = dict.fromkeys(names, 0.0)
    admitted = finished = tokens = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("class") != cls:
                continue
            if family.name in hist:
                if s.name.endswith("_bucket"):
                    hist[family.name][s.labels["le"]] = s.value
                elif s.name.endswith("_sum"):
                    sums[family.name] = s.value
                elif s.name.endswith("_count"):
                    counts[family.name] = s.value
            elif s.name == "slipstream_requests_admitted_total":
                admitted += s.value
            elif s.name == "slipstream_requests_finished_total" and s.labels.get("outcome") == "ok":
                finished += s.value
            elif s.name == "slipstream_output_tokens_total":
                tokens += s.value

    def build(name: str) -> Histogram:
        return Histogram(buckets=tuple(sorted((float(le), c) for le, c in hist[name].items())),
                 total=sums[name], count=counts[name])

    return Sample(1.0, build(names[0]), build(names[1]), admitted, finished, tokens)
