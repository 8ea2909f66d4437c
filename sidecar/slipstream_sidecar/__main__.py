"""``slipstream sidecar``: run the in-pod sidecar (OpenAI HTTP proxy + control gRPC).

The OpenAI HTTP port is served by the compiled front (``slipstream-front``,
``front.py``), which this process starts and feeds; without the executable the
sidecar refuses to start (exit status 2, one line naming ``make front``).
Flags override ``SLIPSTREAM_SIDECAR_*`` environment variables (``settings.py``).
The process serves until SIGTERM or SIGINT, then stops admitting, closes its
streams (offline progress is durable) and exits 0.

Deliberately left out: daemonisation and log shipping (the container runtime's job).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import io
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, cast

from pydantic import ValidationError

log = logging.getLogger(__name__)

_SWITCH_INTERVAL_S = 0.001

# flag -> (settings field, type, help)
_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--engine": ("engine", str, "engine base URL (default http://127.0.0.1:8001)"),
    "--host": ("host", str, "address to bind (default 127.0.0.1)"),
    "--http-port": ("http_port", int, "OpenAI HTTP port (default 8000; 0: any)"),
    "--grpc-port": ("grpc_port", int, "control gRPC port (default 9000; 0: any)"),
    "--auth-token-file": ("auth_token_file", Path, "bearer token file of the control API"),
    "--state-dir": ("state_dir", Path, "directory for durable state (shards, configuration)"),
    "--model": ("model", str, "served model name (default: the engine's first)"),
    "--max-num-seqs": ("max_num_seqs", int, "the engine's --max-num-seqs"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, "the engine's token cap"),
    "--block-size": (
        "block_size",
        int,
        "the engine's KV block size (default: the engine's /metrics, else 16)",
    ),
    "--long-prefill-token-threshold": (
        "long_prefill_token_threshold", int, "the engine's per-request prefill chunk cap"),
    "--kv-blocks": (
        "kv_blocks",
        int,
        "KV blocks the engine has (default: the engine's /metrics, else 8192)",
    ),
    "--ordering": ("ordering", str, "initial online ordering: {choices} (default gittins)"),
    "--max-wait": (
        "max_wait_s", float, "initial tail guard of the ordering: a request that has waited "
        "this many seconds is served in deadline order (default 30; 0: none)"),
    "--budget-s": ("budget_s", float, "initial per-iteration latency budget, seconds"),
    "--latency-model": ("latency_model_file", Path, "latency model JSON (slipstream profile)"),
    "--offline-priority": ("offline_priority", int, "vLLM priority of offline requests"),
    "--online-prompt-tokens": (
        "online_prompt_tokens", str, "tokenize (default: the engine's /tokenize) | estimate"),
    "--length-predictor": ("length_predictor", str, "text (default) | semantic | input"),
    "--sync-prefill-limit": (
        "sync_prefill_limit", int, "grant online arrivals at once while at most this many "
        "granted requests await their first token (default 16; 0: never)"),
    "--front-binary": (
        "front_binary", Path, "the slipstream-front executable that serves the HTTP port "
        "(default: beside this Python, else on PATH)"),
    "--event-loop": ("event_loop", str, "auto (uvloop when installed) | uvloop | asyncio"),
    "--engine-channel": (
        "engine_channel", Path, "engine mode: directory shared with vLLM's scheduler plugin"),
    "--profile-at-start": (
        "profile_at_start_s", float, "profile the engine for this many seconds at start "
        "(slipstream profile engine) before /ready turns 200; 0: off (default)"),
}


# flag -> the values it accepts (anything else is a usage error, exit 2)
_CHOICES: dict[str, tuple[str, ...]] = {
    "--online-prompt-tokens": ("tokenize", "estimate"),
    "--length-predictor": ("text", "semantic", "input"),
    "--event-loop": ("auto", "uvloop", "asyncio"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from slipstream_scheduler.ordering import ORDERINGS

    choices = {**_CHOICES, "--ordering": tuple(ORDERINGS)}
    for flag, (dest, typ, help_text) in _FLAGS.items():
        allowed = choices.get(flag)
        parser.add_argument(
            flag,
            dest=dest,
            type=typ,
            default=None,
            choices=allowed,
            metavar=None if allowed is None else "{" + ",".join(allowed) + "}",
            help=help_text.format(choices=", ".join(allowed or ())),
        )


def run(args: argparse.Namespace) -> int:
    from slipstream_sidecar.settings import SidecarSettings

    overrides = {dest: getattr(args, dest) for dest, _, _ in _FLAGS.values()}
    try:
        settings = SidecarSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        print(f"slipstream sidecar: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    # SIGUSR1 writes every thread's Python stack to stderr and the sidecar runs on: what a
    # stalled sidecar is doing, read without stopping it. (No dumps when the process's
    # stderr is not a file: faulthandler writes to a file descriptor.)
    if sys.__stderr__ is not None:
        with contextlib.suppress(ValueError, io.UnsupportedOperation):
            faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    # NOTE: helper threads (gRPC, the length predictor's worker) run Python too; the event
    # loop waits for the GIL at most this long (default 5 ms, a whole TTFT budget's worth).
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    try:
        run_loop = event_loop_runner(settings.event_loop)
    except ImportError:
        print("slipstream sidecar: --event-loop uvloop, but uvloop is not installed "
              "(pip install 'slipstream[sidecar]')", file=sys.stderr)
        return 2
    # Outside the except block, so no server traceback chains a ModuleNotFoundError for uvloop.
    return int(run_loop(_serve(settings)))


def event_loop_runner(choice: str) -> Callable[[Coroutine[Any, Any, int]], int]:
    """The ``run`` function of the chosen event loop (``event_loop`` setting).

    ``auto`` takes uvloop when it imports and the standard library's loop otherwise;
    ``uvloop`` raises ImportError when it is missing rather than silently running slower.
    """
    if choice == "asyncio":
        return asyncio.run
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        if choice == "uvloop":
            raise
        return asyncio.run
    return cast("Callable[[Coroutine[Any, Any, int]], int]", uvloop.run)


async def _serve(settings: Any) -> int:
    from slipstream_sidecar.app import Sidecar
    from slipstream_sidecar.front import FrontMissingError, find_binary, start_front
    from slipstream_sidecar.grpc_server import serve_grpc
    from slipstream_sidecar.heap import freeze_startup_heap

    try:
        binary = find_binary(settings.front_binary)
    except FrontMissingError as exc:
        print(f"slipstream sidecar: {exc}", file=sys.stderr)
        return 2
    sidecar = Sidecar(settings)
    await sidecar.start()
    # The control port first: once the HTTP port answers, the whole sidecar does.
    grpc_server, grpc_port = await serve_grpc(sidecar, settings.host, settings.grpc_port)
    front = await start_front(
        sidecar.proxy,
        sidecar.proxy.app(),
        engine=settings.engine,
        host=settings.host,
        port=settings.http_port,
        binary=binary,
        engine_connections=settings.engine_connections,
    )
    freeze_startup_heap()
    loop = asyncio.get_running_loop()
    loop_name = type(loop).__module__.split(".")[0]
    log.info(
        "sidecar serving: http %s:%d grpc %s:%d engine %s loop %s",
        settings.host, front.port, settings.host, grpc_port, settings.engine, loop_name,
    )
    # "ready" only when /ready says so; else "serving" (/ready turns 200 once the engine is).
    ready = sidecar.proxy_state.engine_ready
    why = ("profiling the engine: /ready answers 503 until the profile ends"
           if sidecar.profiling else "engine not ready: /ready answers 503 until it is")
    print(
        f"sidecar {'ready' if ready else 'serving'} http={front.port} grpc={grpc_port} "
        f"loop={loop_name} engine={settings.engine}" + ("" if ready else f" ({why})"),
        flush=True,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    stopped = loop.create_task(stop.wait())
    front_gone = loop.create_task(front.wait_closed())
    await asyncio.wait((stopped, front_gone), return_when=asyncio.FIRST_COMPLETED)
    status = 0
    if front_gone.done():
        log.error("the compiled front exited; the sidecar stops")
        status = 1
    stopped.cancel()
    front_gone.cancel()
    sidecar.proxy_state.draining = True
    await grpc_server.stop(grace=1.0)
    await front.stop()
    await sidecar.stop()
    return status
