"""``slipstream operator``: run the kopf operator (one active replica, standalone).

Builds :class:`~slipstream_operator.settings.OperatorSettings` (environment,
then flags), the Kubernetes client (``--kubeconfig``, ``$KUBECONFIG`` or the
in-cluster service account), the gRPC sidecar control and an HTTP session for
scraping sidecars, then runs kopf on an explicit registry with
``standalone=True`` (no peering; ship one replica with ``strategy: Recreate``).

The registry also carries the read-only watch handlers of
:mod:`slipstream_operator.metrics`, whose ``/metrics`` is served on
``--metrics-address:--metrics-port`` (default ``0.0.0.0:8080``, ``127.0.0.1`` with
``--loopback-only``; the port may also come from ``$SLIPSTREAM_OPERATOR_METRICS_PORT``;
``--metrics-port -1`` turns it off).

Deliberately left out: leader election, webhooks, health endpoints beyond
kopf's ``--liveness``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 8080
METRICS_PORT_ENV = "SLIPSTREAM_OPERATOR_METRICS_PORT"


def metrics_port(args: argparse.Namespace) -> int:
    """The /metrics port: the flag, else the environment, else 8080 (-1: none)."""
    flag = getattr(args, "metrics_port", None)
    if flag is not None:
        return int(flag)
    return int(os.environ.get(METRICS_PORT_ENV, DEFAULT_METRICS_PORT))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG/in-cluster)")
    parser.add_argument("-n", "--namespace", action="append", dest="namespaces",
                        help="namespace to watch (repeatable; default: all)")
    parser.add_argument("--loopback-only", action="store_true", default=None,
                        help="test setting: never dial pod IPs outside 127.0.0.0/8")
    parser.add_argument("--interval", type=float, dest="reconcile_interval_s",
                        help="seconds between reconciles of one object (default 5)")
    parser.add_argument("--window", type=float, dest="window_s",
                        help="seconds of the observed-latency window (default 300)")
    parser.add_argument("--prometheus-url",
                        help="Prometheus base URL (default: the sidecars' own counters)")
    parser.add_argument("--profiles-dir", help="extra folder of latency profiles")
    parser.add_argument("--stall-timeout", type=float, dest="stall_timeout_s",
                        help="seconds without progress before a shard moves (default 120)")
    parser.add_argument("--max-shards-per-pod", type=int,
                        help="offline shards one pod runs at once (default 2)")
    parser.add_argument("--storage-root", action="append", dest="storage_roots",
                        help="storage root URI (repeatable); a job of namespace ns may only use "
                        "URIs under <root>/<ns>/ (default: none = no scoping, unsafe for "
                        "multi-tenant clusters)")
    parser.add_argument("--prometheus-timeout", type=float, dest="prometheus_timeout_s",
                        help="overall deadline of one tick's Prometheus queries (default 2)")
    parser.add_argument("--liveness", help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/h")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="port of the operator's Prometheus /metrics (default: "
                        f"${METRICS_PORT_ENV} or {DEFAULT_METRICS_PORT}; 0: any free port; "
                        "-1: off)")
    parser.add_argument("--metrics-address", default=None,
                        help="address /metrics listens on (default 0.0.0.0; 127.0.0.1 with "
                        "--loopback-only)")


def settings_from_args(args: argparse.Namespace) -> Any:
    from slipstream_operator.settings import OperatorSettings

    overrides = {
        key: getattr(args, key, None)
        for key in ("namespaces", "loopback_only", "reconcile_interval_s", "window_s",
                    "prometheus_url", "profiles_dir", "stall_timeout_s", "max_shards_per_pod",
                    "storage_roots", "prometheus_timeout_s")
    }
    return OperatorSettings(**{k: v for k, v in overrides.items() if v is not None})


async def _main(args: argparse.Namespace) -> int:
    import aiohttp
    import kopf
    from kubernetes import config

    from slipstream_operator import metrics
    from slipstream_operator.gctimes import GcTimes, refreeze_forever, tune
    from slipstream_operator.handlers import Handlers, build_registry
    from slipstream_operator.looplag import LoopLag
    from slipstream_operator.sidecar_client import GrpcSidecarControl

    settings = settings_from_args(args)
    kubeconfig = args.kubeconfig or os.environ.get("KUBECONFIG")
    if kubeconfig:
        api = config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    else:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
        from kubernetes import client

        api = client.ApiClient()
    control = GrpcSidecarControl(timeout_s=settings.sidecar_timeout_s)
    # One connection per pod kept open across ticks (the default pool of 100 would make
    # most of a large fleet's fallback /metrics scrapes reconnect every tick).
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=2)
    async with aiohttp.ClientSession(connector=connector) as http:
        handlers = Handlers(settings, api, control, http)
        registry = build_registry(handlers)
        gc_times = GcTimes()
        gc_times.install()
        logger.info("garbage collector thresholds %s", tune(settings.gc_young_threshold))
        refreezing = (asyncio.ensure_future(refreeze_forever(settings.gc_freeze_interval_s))
                      if settings.gc_freeze_interval_s > 0 else None)
        loop_lag = LoopLag()
        probing = asyncio.ensure_future(loop_lag.run())
        operator_metrics = metrics.OperatorMetrics(
            status_stats=handlers.status_stats, status_writes=handlers.status_writes.snapshot,
            gc_times=gc_times.snapshot, loop_lag=loop_lag.snapshot)
        metrics.register(registry, operator_metrics)
        port = metrics_port(args)
        address = getattr(args, "metrics_address", None) or (
            "127.0.0.1" if settings.loopback_only else "0.0.0.0")
        server = metrics.serve(operator_metrics, address, port) if port >= 0 else None
        namespaces = settings.namespaces
        logger.info("slipstream operator starting (namespaces: %s, loopback-only: %s, "
                    "storage roots: %s, job storage claim: %s, s3 credentials: %s)",
                    namespaces or "all", settings.loopback_only,
                    settings.storage_roots or "none (no namespace scoping)",
                    settings.job_storage.pvc.claim_name or "none",
                    settings.job_storage.s3.credentials_secret or "none")
        try:
            await kopf.operator(
                registry=registry,
                standalone=True,
                clusterwide=not namespaces,
                namespaces=namespaces,
                liveness_endpoint=args.liveness,
            )
        finally:
            if server is not None:
                server.close()
            gc_times.uninstall()
            if refreezing is not None:
                refreezing.cancel()
            probing.cancel()
            handlers.close()
            if handlers.feed is not None:
                await handlers.feed.close()
            await control.close()
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "kubeconfig", None):
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's own login reads it
    return asyncio.run(_main(args))
