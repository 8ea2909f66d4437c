"""The chart's operator container, run as a local process: argv and metrics port."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream_testbed.podrunner import PodRunnerError, operator_command, operator_metrics_port

pytestmark = pytest.mark.unit


def container(*args: str) -> dict[str, object]:
    return {"name": "operator", "args": list(args)}


def test_operator_listens_for_metrics_and_liveness_on_its_pod_ip() -> None:
    argv = operator_command(
        container("operator", "--metrics-port=8080", "--liveness=http://0.0.0.0:8081/healthz"),
        "127.1.0.7", Path("/tmp/kc"))
    at = argv.index("--metrics-address")
    assert argv[at + 1] == "127.1.0.7"
    assert "--loopback-only" in argv
    assert "--liveness=http://127.1.0.7:8081/healthz" in argv
    assert argv[argv.index("--kubeconfig") + 1] == "/tmp/kc"


def test_a_container_that_does_not_run_the_operator_is_refused() -> None:
    with pytest.raises(PodRunnerError, match="operator"):
        operator_command(container("sidecar"), "127.1.0.7", Path("/tmp/kc"))


@pytest.mark.parametrize(("args", "port"), [
    (("operator", "--metrics-port=9090"), 9090),
    (("operator", "--metrics-port=-1"), 0),
    (("operator",), 0),
    (("operator", "--metrics-port=abc"), 0),
])
def test_metrics_port_comes_from_the_chart_args(args: tuple[str, ...], port: int) -> None:
    assert operator_metrics_port(container(*args)) == port
