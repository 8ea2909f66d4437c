"""A real Prometheus on loopback for the demo and the end-to-end tests.

:class:`LocalPrometheus` writes a configuration with one scrape job whose targets come from a
``file_sd_configs`` JSON file (numeric loopback ``IP:port`` addresses with their labels:
``namespace``, ``pod``, ``slipstream_dev_service``, the labels a PodMonitor gives the same
series), optionally loads rule files (the chart's SLO rules, :func:`chart_rules`), and runs
Debian's ``/usr/bin/prometheus`` with ``--web.listen-address=127.0.0.1:PORT`` and its TSDB
in a folder of the caller's. :meth:`LocalPrometheus.set_targets` rewrites the targets file
atomically (Prometheus re-reads it within ``refresh_s``); :meth:`LocalPrometheus.query`
runs PromQL through prometheus-api-client.

Deliberately left out: remote storage, authentication, Alertmanager, service discovery other
than the file (no DNS, no Kubernetes SD: pods are addressed by their loopback IPs), and
installing Prometheus (``make system-deps`` does that with apt-get).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from slipstream_testbed.procgroup import stop_group

logger = logging.getLogger(__name__)

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
DEFAULT_BINARY = "/usr/bin/prometheus"
JOB = "slipstream-sidecars"


class PrometheusError(Exception):
    """Prometheus could not be found, started, configured or queried.

    PrometheusError
    ├── PrometheusMissingError   no binary (``binary``)
    └── PrometheusQueryError     a query failed (``query``)
    """


class PrometheusMissingError(PrometheusError):
    def __init__(self, binary: str) -> None:
        super().__init__(
            f"{binary} not found: install Prometheus with `make system-deps` "
            "(Debian package prometheus) or pass its path"
        )
        self.binary = binary


class PrometheusQueryError(PrometheusError):
    def __init__(self, query: str, cause: Exception) -> None:
        super().__init__(f"query {query!r} failed: {cause}")
        self.query = query


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """One ``IP:port`` to scrape (numeric, loopback) and the labels its series get."""

    address: str
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        host, _, port = self.address.rpartition(":")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError as exc:
            raise PrometheusError(f"{self.address}: targets are numeric IP:port") from exc
        if ip not in LOOPBACK or not port.isdigit():
            raise PrometheusError(f"{self.address}: only 127.0.0.0/8 targets are scraped")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def find_binary(binary: str | None = None) -> str:
    """The Prometheus binary: ``binary``, else /usr/bin/prometheus, else ``prometheus`` on PATH."""
    for candidate in (binary, DEFAULT_BINARY, shutil.which("prometheus")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise PrometheusMissingError(binary or DEFAULT_BINARY)


def chart_rules(helm: Path, chart: Path, out: Path, *sets: str) -> Path:
    """Render the chart's PrometheusRule and write its groups as a plain rules file."""
    args = [str(helm), "template", "slipstream", str(chart),
            "--show-only", "templates/monitoring.yaml",
            "--set", "metrics.prometheusRule.enabled=true",
            "--set", "metrics.prometheusRule.force=true"]
    for s in sets:
        args += ["--set", s]
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise PrometheusError(f"helm template of the rules failed: {result.stderr.strip()}")
    rule = next((d for d in yaml.safe_load_all(result.stdout)
                 if d and d.get("kind") == "PrometheusRule"), None)
    if rule is None:
        raise PrometheusError("the chart rendered no PrometheusRule")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    return out


class LocalPrometheus:
    """One Prometheus process on 127.0.0.1 with file-based targets; a context manager."""

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        scrape_interval_s: float = 2.0,
        refresh_s: float = 1.0,
        rule_files: Iterable[Path] = (),
        binary: str | None = None,
    ) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.scrape_interval_s = scrape_interval_s
        self.refresh_s = refresh_s
        self.rule_files = [Path(p) for p in rule_files]
        self.binary = find_binary(binary)
        self.targets_file = workdir / "targets.json"
        self.config_file = workdir / "prometheus.yml"
        self.log_file = workdir / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval,
                       "scrape_timeout": interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [{
                "job_name": JOB,
                "metrics_path": "/metrics",
                "file_sd_configs": [{"files": [str(self.targets_file)],
                                     "refresh_interval": f"{int(self.refresh_s * 1000)}ms"}],
            }],
        }

    def set_targets(self, targets: Iterable[ScrapeTarget]) -> None:
        """Replace the scrape targets (atomic rename; Prometheus picks it up by itself)."""
        groups = [{"targets": [t.address], "labels": dict(t.labels)} for t in targets]
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups, indent=1))
        tmp.replace(self.targets_file)

    def start(self, timeout_s: float = 60.0) -> LocalPrometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.targets_file.exists():
            self.set_targets([])
        self.config_file.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        args = [
            self.binary,
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={self.workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1d",
            "--log.level=warn",
        ]
        with self.log_file.open("ab") as log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=self.workdir, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise PrometheusError(
                    f"prometheus exited with {self._proc.returncode}:\n{self.log_tail()}")
            if self._get("/-/ready") == 200:
                logger.info("prometheus ready at %s", self.url)
                return self
            time.sleep(0.2)
        self.stop()
        raise PrometheusError(f"prometheus not ready after {timeout_s}s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        stop_group(proc, grace_s)

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _get(self, path: str) -> int:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(self.url + path, timeout=2.0) as response:
                return int(response.status)
        except (urllib.error.URLError, OSError):
            return 0

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query: the result vector (``metric`` labels and ``value`` [t, "v"])."""
        import requests
        from prometheus_api_client import PrometheusConnect

        session = requests.Session()
        session.trust_env = False  # loopback: never through a proxy from the environment
        try:
            client = PrometheusConnect(url=self.url, disable_ssl=True, session=session)
            result: list[dict[str, Any]] = client.custom_query(expr)
        except Exception as exc:  # prometheus-api-client raises bare Exception subclasses
            raise PrometheusQueryError(expr, exc) from exc
        finally:
            session.close()
        return result

    def scalar(self, expr: str) -> float | None:
        """The single value of ``expr`` (None when empty or NaN)."""
        result = self.query(expr)
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if math.isnan(value) else value

    def targets_up(self) -> int:
        """How many targets answered their last scrape."""
        return len([r for r in self.query(f'up{{job="{JOB}"}} == 1')])
