"""``slipstream bench``: dispatch to one benchmark module.

The benchmarks are listed in :data:`BENCHES`, an explicit table from name to
module; each module exposes ``add_arguments(parser)`` and ``run(args) -> int``
and is imported only when chosen, so ``bench core`` never pays for the
imports of ``bench fleet``. The chosen benchmark parses the rest of the
command line with its own parser (``slipstream bench core --help`` works).

Deliberately left out: running several benchmarks in one call (use the
Makefile), and any benchmark logic.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Protocol, cast

# name -> (module, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "core": ("slipstream_cli.benches.core", "per-call cost of the scheduling core's hot paths"),
    "colocation": ("slipstream_cli.benches.colocation", "online SLOs vs offline throughput"),
    "tolerance": ("slipstream_cli.benches.tolerance", "offline throughput bought by SLO tolerance"),
    "ordering": ("slipstream_cli.benches.ordering", "mean TTLT of online orderings"),
    "prefix": ("slipstream_cli.benches.prefix", "PSM prefix ordering vs FCFS for offline"),
    "sidecar": ("slipstream_cli.benches.sidecar", "the sidecar's proxy overhead and admission"),
    "front-load": ("slipstream_cli.benches.front_load",
                   "vllm bench serve through the sidecar's front against direct, on vllm serve"),
    "fleet": ("slipstream_cli.benches.fleet", "shard placement across a fleet of pods"),
    "lengths": ("slipstream_cli.benches.lengths", "output-length predictor accuracy"),
    "fidelity": ("slipstream_cli.benches.fidelity", "the engine model vs vLLM's own scheduler"),
    "plugin-overhead": ("slipstream_cli.benches.plugin_overhead",
                        "CPU time the vLLM plugin adds per step"),
    "plugin-serve": ("slipstream_cli.benches.plugin_serve",
                     "vllm serve with the plugin against stock, by vllm bench serve"),
    "learning": ("slipstream_cli.benches.learning",
                 "the latency model learned from engine steps: error, fit time, cost"),
    "soak": ("slipstream_cli.benches.soak",
             "online and offline work through real vLLM while its processes are killed"),
}


class _Bench(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _load(name: str) -> _Bench:
    return cast(_Bench, importlib.import_module(BENCHES[name][0]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    listing = "; ".join(f"{name}: {text}" for name, (_, text) in BENCHES.items())
    parser.add_argument("bench", choices=list(BENCHES), metavar="BENCH", help=listing)
    parser.add_argument(
        "bench_args", nargs=argparse.REMAINDER, help="options of the chosen benchmark"
    )


def bench_parser(name: str) -> argparse.ArgumentParser:
    """The chosen benchmark's own parser (its module adds the options)."""
    parser = argparse.ArgumentParser(prog=f"slipstream bench {name}", description=BENCHES[name][1])
    _load(name).add_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    name: str = args.bench
    rest: Sequence[str] = args.bench_args or []
    bench_args = bench_parser(name).parse_args(list(rest))
    bench_args.verbose = getattr(args, "verbose", 0)
    return _load(name).run(bench_args)
