"""Real vLLM for the commands that drive its scheduler in-process (``bench fidelity``,
``sim --engine vllm``): find an interpreter that imports it, and the engine factory.

vLLM lives in its own environment (``make vllm-env`` builds ``.venv-vllm``). A command run
from an interpreter without it re-executes itself under the one
:func:`slipstream_testbed.vllm.server.vllm_python` names; with none, it is a usage error.

Nothing here imports vllm at module level: :func:`vllm_engine_factory` imports
:mod:`slipstream_testbed.vllm.inprocess` (the testbed's in-process vLLM harness) when called.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from slipstream_scheduler.engine.model import EngineConfig

REEXEC_ENV = "SLIPSTREAM_VLLM_REEXEC"


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm(parser: argparse.ArgumentParser, command: Sequence[str]) -> None:
    """Return if vllm imports here; else re-exec ``slipstream COMMAND...`` under the
    real-vLLM interpreter, or fail with a usage error (exit 2) naming what to install.

    ``command`` is the full ``slipstream`` argument list (e.g. ``["sim", "--engine",
    "vllm"]``); it is only used when re-executing.
    """
    if vllm_importable():
        return
    from slipstream_testbed.vllm.server import VllmUnavailableError, vllm_python

    try:
        python = vllm_python()
    except VllmUnavailableError as err:
        parser.error(str(err))
    # Not realpath: a virtual environment's python links to the same binary as another's.
    if os.path.abspath(python) == os.path.abspath(sys.executable) or os.environ.get(REEXEC_ENV):
        parser.error(
            f"vllm does not import in {python}: run `make vllm-env`, or set "
            "SLIPSTREAM_VLLM_PYTHON to a Python that can import vllm"
        )
    env = {**os.environ, REEXEC_ENV: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(python, [python, "-m", "slipstream_cli.main", *command], env)


def slipstream_argv(prefix: Sequence[str]) -> list[str]:
    """This process's ``slipstream`` arguments when started as ``slipstream PREFIX...``;
    otherwise ``prefix`` alone (re-executing then runs the command with its defaults)."""
    argv = sys.argv[1:]
    for i in range(len(argv)):
        if argv[i : i + len(prefix)] == list(prefix):
            return argv[i:]
    return list(prefix)


def vllm_engine_factory() -> Callable[[EngineConfig, int], Any]:
    """``(EngineConfig, seed) -> VllmEngine``: vLLM's scheduler choosing every batch."""
    from slipstream_testbed.vllm.inprocess import VllmEngine

    def make(config: EngineConfig, seed: int) -> Any:
        return VllmEngine(config, seed)

    return make
