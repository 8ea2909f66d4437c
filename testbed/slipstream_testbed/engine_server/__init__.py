"""``slipstream engine``: the engine model served in real time on vLLM's HTTP API.

Usage::

    slipstream engine --model llama-2-7b --gpu a100 --port 8001 \\
        [--host 127.0.0.1] [--seed N] [--scheduling-policy priority|fcfs] \\
        [--max-num-seqs 256] [--max-num-batched-tokens 2048] [--kv-blocks N]

The sidecar, the end-to-end tests and the demo talk to it exactly as they talk
to ``vllm serve``. :func:`serve` starts the same server inside a running event
loop (tests use it with port 0).

Modules: ``protocol`` (request bodies), ``app`` (routes and response shapes),
``driver`` (the real-time step loop), ``metrics`` (``vllm:*`` metrics),
``errors`` (the error tree and vLLM's error JSON).

Deliberately left out: TLS, API keys, multiple engines (data parallel) and
everything ``app.py`` lists as unsupported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Literal

import prometheus_client
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from slipstream_scheduler.engine.gpu import available_profiles
from slipstream_scheduler.engine.model import EngineConfig, EngineModel
from slipstream_scheduler.textgen import TextGenConfig, TokenGenerator, Tokenizer
from slipstream_sidecar.heap import freeze_startup_heap
from slipstream_sidecar.logging_filters import install_payload_filter
from slipstream_testbed.engine_server.app import ServerConfig, build_app
from slipstream_testbed.engine_server.driver import Driver
from slipstream_testbed.engine_server.metrics import EngineMetrics

logger = logging.getLogger(__name__)

__all__ = ["RunningServer", "ServeOptions", "add_arguments", "run", "serve"]


class ServeOptions(BaseModel):
    """Everything ``slipstream engine`` is configured with (one source for CLI and tests)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(default="llama-2-7b", description="engine-model profile; llama-2-7b")
    gpu: str = Field(default="a100", description="GPU profile (a100, h100); a100")
    host: str = Field(default="127.0.0.1", description="listen address; 127.0.0.1")
    port: int = Field(default=8001, ge=0, le=65535, description="listen port, 0 = any; 8001")
    seed: int = Field(default=0, description="default generation seed and step-noise seed; 0")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs", description="vLLM --scheduling-policy; fcfs (vLLM's default)"
    )
    max_num_seqs: int = Field(default=256, ge=1, description="running requests cap; 256")
    max_num_batched_tokens: int = Field(default=2048, ge=1, description="tokens per step; 2048")
    kv_blocks: int | None = Field(
        default=None, ge=1, description="KV blocks; None = sized from GPU memory like vLLM"
    )
    block_size: int = Field(default=16, ge=1, description="tokens per KV block; 16")
    long_prefill_token_threshold: int = Field(
        default=0, ge=0, description="per-request prefill chunk cap (tokens); 0 = none"
    )
    enable_prefix_caching: bool = Field(default=True, description="automatic prefix caching")
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0, description="0.9")
    max_model_len: int | None = Field(
        default=None, ge=2, description="context cap (tokens); None = the model's"
    )
    served_model_names: tuple[str, ...] = Field(
        default=(), description="names clients may use in `model`; () = (model,)"
    )
    mean_output_tokens: float = Field(
        default=128.0, ge=1.0, description="mean output length under geometric EOS; 128"
    )
    noise_cv: float = Field(default=0.01, ge=0.0, le=0.5, description="step-time noise; 0.01")
    max_lag_s: float = Field(
        default=0.25, gt=0.0, description="timeline debt dropped beyond this (seconds); 0.25"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServeOptions()
    shipped = available_profiles()
    models = tuple(sorted({m for m, _ in shipped}))
    gpus = tuple(sorted({g for _, g in shipped}))
    parser.add_argument(
        "--model",
        default=d.model,
        choices=models,
        help=f"engine-model profile: {', '.join(models)} (default {d.model})",
    )
    parser.add_argument(
        "--gpu",
        default=d.gpu,
        choices=gpus,
        help=f"GPU profile: {', '.join(gpus)} (default {d.gpu})",
    )
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--scheduling-policy", choices=("fcfs", "priority"), default=d.scheduling_policy
    )
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV blocks (vLLM's num_gpu_blocks_override); default: sized from GPU memory",
    )
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument(
        "--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument(
        "--mean-output-tokens",
        type=float,
        default=d.mean_output_tokens,
        help="mean generated length when a request does not set ignore_eos",
    )
    parser.add_argument("--noise-cv", type=float, default=d.noise_cv)


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        model=args.model,
        gpu=args.gpu,
        host=args.host,
        port=args.port,
        seed=args.seed,
        scheduling_policy=args.scheduling_policy,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_prefix_caching=args.enable_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        served_model_names=tuple(args.served_model_name or ()),
        mean_output_tokens=args.mean_output_tokens,
        noise_cv=args.noise_cv,
    )


@dataclass(slots=True)
class RunningServer:
    """A started engine server: where it listens and how to stop it."""

    host: str
    port: int
    runner: web.AppRunner
    driver: Driver

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        await self.runner.cleanup()


def build_engine(opts: ServeOptions) -> EngineModel:
    config = EngineConfig(
        model=opts.model,
        gpu=opts.gpu,
        policy=opts.scheduling_policy,
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        block_size=opts.block_size,
        long_prefill_token_threshold=opts.long_prefill_token_threshold,
        enable_prefix_caching=opts.enable_prefix_caching,
        num_gpu_blocks=opts.kv_blocks,
        gpu_memory_utilization=opts.gpu_memory_utilization,
        max_model_len=opts.max_model_len,
        noise_cv=opts.noise_cv,
    )
    return EngineModel(config, seed=opts.seed)


async def serve(opts: ServeOptions, engine: EngineModel | None = None) -> RunningServer:
    """Start the server in the running loop (``opts.port == 0`` picks a free port)."""
    engine = engine or build_engine(opts)
    max_model_len = opts.max_model_len or engine.timing.profile.arch.max_model_len
    names = opts.served_model_names or (opts.model,)
    metrics = EngineMetrics(names[0], max_model_len)
    tokenizer = Tokenizer()
    generator = TokenGenerator(tokenizer, TextGenConfig(mean_output_tokens=opts.mean_output_tokens))
    driver = Driver(
        engine,
        tokenizer,
        generator,
        metrics,
        block_size=opts.block_size,
        max_lag_s=opts.max_lag_s,
    )
    cfg = ServerConfig(
        served_model_names=names,
        model_root=opts.model,
        max_model_len=max_model_len,
        policy=opts.scheduling_policy,
        default_seed=opts.seed,
    )
    app = build_app(cfg, driver, tokenizer, metrics)
    install_payload_filter()  # aiohttp would log the bytes of a malformed request (a prompt)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, opts.host, opts.port, backlog=1024)
    await site.start()
    port = opts.port
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    if sockets:
        port = sockets[0].getsockname()[1]
    logger.info(
        "engine model %s on %s serving on http://%s:%d (policy %s, max_model_len %d)",
        opts.model,
        opts.gpu,
        opts.host,
        port,
        opts.scheduling_policy,
        max_model_len,
    )
    return RunningServer(opts.host, port, runner, driver)


async def _serve_forever(opts: ServeOptions) -> None:
    server = await serve(opts)
    freeze_startup_heap()  # as vLLM does once it is warm
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    print(f"slipstream engine listening on {server.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()


def run(args: argparse.Namespace) -> int:
    if (args.model, args.gpu) not in available_profiles():
        pairs = ", ".join(f"{m} on {g}" for m, g in available_profiles())
        print(
            f"slipstream engine: no profile for {args.model} on {args.gpu} (shipped: {pairs})",
            file=sys.stderr,
        )
        return 2
    opts = options_from_args(args)
    # vLLM exposes no ``*_created`` series; this is process-global, so only the CLI sets it.
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    asyncio.run(_serve_forever(opts))
    return 0
