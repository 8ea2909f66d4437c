"""Process settings of the sidecar, read once in ``__main__`` and passed down.

Environment variables use the prefix ``SLIPSTREAM_SIDECAR_`` (for example
``SLIPSTREAM_SIDECAR_ENGINE_URL``); command-line flags override them. The
engine's batching limits must match the flags vLLM was started with: the
sidecar cannot read them from vLLM's HTTP API. Its KV cache (blocks and block
size) is read from vLLM's ``/metrics`` unless set here (``kvcache.py``).

Deliberately left out: scheduling policy parameters that the operator sets at
run time (budget, SLOs, ordering, latency-model coefficients arrive through the
gRPC ``Configure`` call).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from slipstream_scheduler.tailguard import DEFAULT_MAX_WAIT_S


class SidecarSettings(BaseSettings):
    """Everything the sidecar process needs to start."""

    model_config = SettingsConfigDict(env_prefix="SLIPSTREAM_SIDECAR_", extra="forbid", frozen=True)

    engine: str = Field(
        default="http://127.0.0.1:8001", description="Base URL of the vLLM engine (loopback)."
    )
    host: str = Field(default="127.0.0.1", description="Address both servers bind to.")
    http_port: int = Field(default=8000, ge=0, le=65535, description="OpenAI HTTP port; 0: any.")
    grpc_port: int = Field(default=9000, ge=0, le=65535, description="Control gRPC port; 0: any.")
    auth_token_file: Path | None = Field(
        default=None,
        description="File holding the control API's bearer token (a mounted Secret). "
        "Without it every gRPC call is refused.",
    )
    state_dir: Path | None = Field(
        default=None,
        description="Directory for durable state (configuration in force, assigned shards); "
        "a restarted sidecar resumes its shards from here. None: nothing survives a restart.",
    )
    model: str | None = Field(
        default=None, description="Served model name; None: the engine's first /v1/models entry."
    )
    max_num_seqs: int = Field(default=256, ge=1, description="vLLM --max-num-seqs (requests).")
    max_num_batched_tokens: int = Field(
        default=2048, ge=1, description="vLLM --max-num-batched-tokens (tokens per iteration)."
    )
    block_size: int | None = Field(
        default=None,
        ge=1,
        description="vLLM KV block size (tokens). None: read from the engine's /metrics "
        "(vllm:cache_config_info) when it answers /health, at start and after every loss of "
        "the engine; 16 where the engine does not publish it. A value given wins.",
    )
    long_prefill_token_threshold: int = Field(
        default=0,
        ge=0,
        description="vLLM --long-prefill-token-threshold (tokens of one request's prefill per "
        "iteration); 0: no per-request cap, as vLLM's default with one partial prefill.",
    )
    kv_blocks: int | None = Field(
        default=None,
        ge=1,
        description="KV blocks of block_size tokens the engine has (blocks). None: read from "
        "the engine's /metrics (vllm:cache_config_info num_gpu_blocks, in the engine's block "
        "size) like block_size; 8192 where the engine does not publish it. A value given wins.",
    )
    ordering: str = Field(default="gittins", description="Initial online ordering policy name.")
    max_wait_s: float = Field(
        default=DEFAULT_MAX_WAIT_S,
        ge=0,
        allow_inf_nan=False,
        description="Initial tail guard of the ordering (seconds): a request that has waited "
        "this long is served in deadline order ahead of the ranked ones; 0: none. The "
        "operator's Configure sets it from the service (spec.scheduling.maxWait, else the SLO).",
    )
    idle_budget_s: float | None = Field(
        default=None,
        gt=0,
        description="Step limit in seconds for offline work while no online request is held or "
        "in flight (the simulator's profiled idle budget); None: the budget applies always.",
    )
    offline_priority: int = Field(
        default=100, description="vLLM priority of offline requests (online requests get 0)."
    )
    latency_model_file: Path | None = Field(
        default=None,
        description="Initial batch-latency model (JSON written by `slipstream profile`); "
        "None: none until Configure sends coefficients (offline then runs without a budget).",
    )
    budget_s: float | None = Field(
        default=None, gt=0, description="Initial per-iteration latency budget (s); None: none."
    )
    length_predictor: Literal["text", "semantic", "input"] = Field(
        default="text",
        description="Online output-length predictor (the ordering's input): 'text' predicts "
        "from the lengths of past similar prompts with the dependency-free hashing embedder; "
        "'semantic' the same with MiniLM embeddings (needs the [semantic] extra; without it "
        "'text' is used, with a warning); 'input' from past requests of similar input length.",
    )
    length_history: int = Field(
        default=10_000, ge=1, description="Finished online requests the predictor keeps."
    )
    length_embed_chars: int = Field(
        default=1024,
        ge=1,
        description="Characters of a prompt (from its start) the predictor embeds (chars).",
    )
    online_prompt_tokens: Literal["tokenize", "estimate"] = Field(
        default="tokenize",
        description="How online prompt lengths are measured: the engine's /tokenize (exact, one "
        "extra loopback round trip) or bytes/4 (no round trip).",
    )
    engine_connections: int = Field(
        default=1024, ge=1, description="Size of the connection pool to the engine (connections)."
    )
    engine_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="Total timeout of one engine request (s): offline requests, /tokenize, "
        "/v1/models. An online request lasts as long as its client keeps it open.",
    )
    ready_poll_s: float = Field(
        default=1.0, gt=0, description="How often /ready re-checks the engine's /health (s)."
    )
    engine_health_timeout_s: float = Field(
        default=2.0, gt=0, description="How long one check of the engine's /health waits (s)."
    )
    engine_silent_checks: int = Field(
        default=3,
        ge=1,
        description="How many /health checks in a row the engine may leave unanswered before "
        "a ready engine turns not ready; a refused connection or an error status turns it not "
        "ready at once.",
    )
    tick_s: float = Field(
        default=0.005, gt=0, description="Period of the dispatcher's time-driven decide (s)."
    )
    sync_prefill_limit: int = Field(
        default=16,
        ge=0,
        description="An online arrival that fits is granted inside its own registration (no "
        "wait for the event loop's next turn) only while at most this many granted requests "
        "await their first token (requests); each such decision costs the core O(requests in "
        "prefill). 0: every grant waits for the coalesced decision. Default 16.",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        default="auto",
        description="The event loop: 'uvloop' (libuv; less CPU per proxied request, the "
        "[sidecar] extra installs it on Linux), 'asyncio' (the standard library's), or "
        "'auto': uvloop when it is installed, else asyncio.",
    )
    front_binary: Path | None = Field(
        default=None,
        description="The slipstream-front executable, which serves the OpenAI HTTP port "
        "(default: beside this Python, else on PATH; `make front` builds it into .venv/bin).",
    )
    status_interval_s: float = Field(
        default=1.0, gt=0, description="Default WatchStatus period (s)."
    )
    shard_window: int = Field(
        default=256,
        ge=1,
        description="Offline requests of one shard registered with the dispatcher at once.",
    )
    storage_roots: list[str] = Field(
        default_factory=list,
        description="Storage roots of the namespace rule (slipstream_scheduler.storage_scope), "
        "e.g. ['file:///var/lib/slipstream', 's3://batch']: a shard of namespace ns may use "
        "only URIs under <root>/<ns>/. Env SLIPSTREAM_SIDECAR_STORAGE_ROOTS as a JSON list. "
        "Empty: no scoping (single tenant); the operator's Deployment sets it.",
    )
    engine_channel: Path | None = Field(
        default=None,
        description="Engine mode: the directory shared with vLLM's Slipstream scheduler "
        "plugin (control.json, status.json, offline.token; docs/plugin.md). Every Configure is "
        "written there, offline requests carry the pod's token, and the plugin's report is "
        "served in /metrics. None: sidecar mode (the sidecar enforces the budget itself).",
    )
    learn_latency: bool = Field(
        default=True,
        description="Engine mode: learn the latency model from the plugin's step records "
        "(steps/ in the channel) and report it to the operator (docs/operations.md, "
        "\"Where the latency model comes from\").",
    )
    learn_max_mape: float = Field(
        default=0.5, gt=0, lt=1,
        description="Engine mode: a fit whose error on recent held-out steps (mean absolute "
        "percentage error, a fraction) exceeds this is not used. The operator applies its own, "
        "usually stricter, bar (learned_max_mape) before a learned model prices a budget.",
    )
    offline_max_retries: int = Field(
        default=3, ge=0, description="Engine failures tolerated per offline line before an error."
    )
    profile_at_start_s: float = Field(
        default=0.0,
        ge=0,
        le=3600,
        description="Profile the engine at start for this long (s; 0: off, else at least 10): "
        "once the engine answers /health, `slipstream profile engine` runs against it as a "
        "subprocess (hard limit: this plus 60 s) and /ready answers 503 until it ends, "
        "successfully or not. The fitted model is reported in Status as learned_model with "
        "source 'profiled' (a model learned from the engine's steps, in engine mode, is "
        "reported first). It is written to <state_dir>/profiled-latency.json, and a restarted "
        "sidecar that finds that file reuses it instead of profiling again; without a state "
        "directory the profile lives in a temporary folder and every start profiles again.",
    )

    @field_validator("profile_at_start_s")
    @classmethod
    def _profile_at_least_10_s(cls, value: float) -> float:
        if 0 < value < 10:
            raise ValueError("profile_at_start_s must be 0 (off) or at least 10 seconds")
        return value
