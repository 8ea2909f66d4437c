"""Entry point of the ``slipstream`` command.

The subcommands are listed in one explicit table. Each one is a module with
``add_arguments(parser)`` and ``run(args) -> int``; it is imported only when
chosen, so ``slipstream sim`` never pays for kopf or grpc imports.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Protocol, cast

from slipstream_cli.workloads import WorkloadError


class _Command(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("slipstream_cli.commands.sim", "replay a trace through the engine model"),
    "bench": ("slipstream_cli.commands.bench", "run a benchmark (core, colocation, ordering, ...)"),
    "profile": ("slipstream_cli.commands.profile", "fit a latency model and search an SLO budget"),
    "engine": ("slipstream_testbed.engine_server", "serve the engine model on vLLM's HTTP API"),
    "sidecar": ("slipstream_sidecar.__main__", "run the in-pod sidecar (HTTP proxy + gRPC)"),
    "operator": ("slipstream_operator.__main__", "run the kopf operator"),
    "cluster": ("slipstream_testbed.cluster", "a local Kubernetes control plane (tests, demo)"),
    "demo": ("slipstream_cli.demo", "the end-to-end local demo"),
}


def _load(name: str) -> _Command:
    module_name, _ = COMMANDS[name]
    return cast(_Command, importlib.import_module(module_name))


def build_parser(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, str | None]:
    parser = argparse.ArgumentParser(prog="slipstream", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen subcommand's module is imported; the others get a help line.
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            _load(name).add_arguments(p)
    return parser, chosen


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser, chosen = build_parser(args_list)
    args = parser.parse_args(args_list)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if chosen is None or args.command is None:
        parser.print_help()
        return 2
    try:
        return _load(chosen).run(args)
    except WorkloadError as exc:  # a dataset missing or malformed: the path, no traceback
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
