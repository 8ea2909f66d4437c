"""Run ``slipstream operator`` with a larger default thread pool (a bench experiment).

``python -m slipstream_testbed.fleet.opwrap --threads N operator ...`` installs an
event-loop policy whose loops get a ``ThreadPoolExecutor(N)`` as default
executor, then runs the ``slipstream`` CLI with the remaining arguments. The
operator's handlers run every blocking Kubernetes call through
``asyncio.to_thread`` (the default executor, ``min(32, CPUs + 4)`` threads:
6 on a 2-core host), so this shows how much of the fleet-scale cost is that
pool's size rather than CPU. The operator's code is unchanged.

Deliberately left out: any other change to the operator.
"""

from __future__ import annotations

import asyncio
import runpy
import sys
from concurrent.futures import ThreadPoolExecutor


class _WidePolicy(asyncio.DefaultEventLoopPolicy):
    def __init__(self, threads: int) -> None:
        super().__init__()
        self._threads = threads

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        loop = super().new_event_loop()
        loop.set_default_executor(ThreadPoolExecutor(self._threads, thread_name_prefix="kube"))
        return loop


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--threads":
        print("usage: python -m slipstream_testbed.fleet.opwrap --threads N operator ...",
              file=sys.stderr)
        return 2
    asyncio.set_event_loop_policy(_WidePolicy(int(argv[1])))
    sys.argv = ["slipstream", *argv[2:]]
    try:
        runpy.run_module("slipstream_cli.main", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
