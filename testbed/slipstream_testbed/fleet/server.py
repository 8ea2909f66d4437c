"""The stand-in as a process: ``python -m slipstream_testbed.fleet.server --kubeconfig K``.

Starts a :class:`~slipstream_testbed.fleet.standin.Standin`, a
:class:`~slipstream_testbed.fleet.podwatch.PodWatcher` on the given cluster, and a
small control API on ``127.0.0.1:<control port>`` for the benchmark:
``POST /bump`` (one more online request on every fake pod; answers the bump
number and the wall-clock time it took effect) and ``GET /totals`` (fake pods,
shards held, calls per method). Prints ``READY <control port>`` once serving.

Deliberately left out: authentication of the control API (loopback only, a
benchmark tool) and daemonising (the caller owns the process).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Sequence

from aiohttp import web
from kubernetes import config

from slipstream_testbed.fleet.podwatch import PodWatcher
from slipstream_testbed.fleet.standin import Standin, StandinConfig, raise_fd_limit

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", required=True, help="kubeconfig that may read pods")
    parser.add_argument("--control-port", type=int, default=0,
                        help="loopback port of the control API (default: any free)")
    parser.add_argument("--lines-per-second", type=float, default=2.0,
                        help="progress of a running fake shard (lines/s, default 2)")
    parser.add_argument("--no-status-counters", dest="status_counters", action="store_false",
                        help="answer Status without online_counters, as sidecars before "
                        "them did (the operator then scrapes /metrics)")
    parser.add_argument("--finish-shards", action="store_true",
                        help="report shards succeeded once their lines are done")
    parser.add_argument("-n", "--namespace", action="append", dest="namespaces", default=[],
                        help="serve only pods of this namespace (repeatable; default: all)")
    parser.add_argument("--fd-limit", type=int, default=20000,
                        help="RLIMIT_NOFILE soft limit to ask for (default 20000)")


def control_app(standin: Standin) -> web.Application:
    async def bump(request: web.Request) -> web.Response:
        number = standin.bump()
        return web.json_response({"bump": number, "at": time.time(), "pods": len(standin.pods)})

    async def totals(request: web.Request) -> web.Response:
        return web.json_response(standin.totals())

    app = web.Application()
    app.router.add_post("/bump", bump)
    app.router.add_get("/totals", totals)
    return app


async def serve(args: argparse.Namespace) -> int:
    limit = raise_fd_limit(args.fd_limit)
    logger.info("descriptor limit %d", limit)
    standin = Standin(StandinConfig(lines_per_second=args.lines_per_second,
                                    finish_shards=args.finish_shards,
                                    status_counters=args.status_counters))
    await standin.start()
    runner = web.AppRunner(control_app(standin), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.control_port)
    await site.start()
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    port = sockets[0].getsockname()[1] if sockets else args.control_port
    api = config.new_client_from_config(config_file=args.kubeconfig)  # type: ignore[no-untyped-call]
    watcher = PodWatcher(api, standin, asyncio.get_running_loop(), frozenset(args.namespaces))
    watcher.start()
    print(f"READY {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    watcher.stop()
    await runner.cleanup()
    await standin.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slipstream_testbed.fleet.server",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    parser.add_argument("-v", "--verbose", action="count", default=0)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
