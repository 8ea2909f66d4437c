"""The plugin's start-up check: every vLLM internal it touches, checked when vLLM loads it.

vLLM's scheduler interface is not public; the plugin reads and rearranges vLLM's queues and
calls a few private methods. A renamed attribute or a changed signature would otherwise fail at
the first step that touches it, possibly hours into serving, or, for the prefix-cache lookup,
silently assume no hits. :func:`check` lists every difference between what the plugin needs
(:data:`SCHEDULER_ATTRS`, :data:`SIGNATURES`, :data:`REQUEST_FIELDS`, :data:`OUTPUT_FIELDS`)
and the vLLM it runs in; the plugin refuses to start with one message naming the vLLM version
and each difference (:class:`IncompatibleVllmError`). A version outside
:data:`TESTED_VERSIONS` whose internals all match starts with a warning.

Leaves out: behaviour. A method with the same name and parameters that does something else is
caught only by the ``vllm`` test tier run against that version (docs/plugin.md).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

__all__ = [
    "OUTPUT_FIELDS",
    "REQUEST_FIELDS",
    "SCHEDULER_ATTRS",
    "SIGNATURES",
    "TESTED_VERSIONS",
    "IncompatibleVllmError",
    "check",
    "tested",
]

TESTED_VERSIONS = ("0.32", "0.33")
"""vLLM releases (major.minor) the ``vllm`` test tier runs the plugin against."""

SCHEDULER_ATTRS = (
    "running",
    "waiting",
    "kv_holding_waiting",
    "requests",
    "policy",
    "block_size",
    "max_num_running_reqs",
    "max_num_scheduled_tokens",
    "scheduler_reserve_full_isl",
    "scheduler_config.max_num_batched_tokens",
    "scheduler_config.long_prefill_token_threshold",
    "cache_config.enable_prefix_caching",
    "kv_cache_manager.block_pool.get_num_free_blocks",
    "kv_cache_manager.coordinator.find_longest_cache_hit",
    "vllm_config.additional_config",
)
"""Attribute paths read on the scheduler instance once vLLM's ``__init__`` has run."""

SIGNATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("schedule", ("throttle_prefills",)),
    ("update_from_output", ("scheduler_output", "model_runner_output")),
    ("add_request", ("request",)),
    ("finish_requests", ("request_ids", "finished_status")),
    ("_preempt_request", ("request", "timestamp")),
    ("kv_cache_manager.coordinator.find_longest_cache_hit",
     ("block_hashes", "max_cache_hit_length")),
    ("waiting.add_request", ("request",)),
)
"""Methods the plugin calls or overrides: the leading parameters (after ``self``) it passes,
by position, in this order. Further parameters with defaults are allowed."""

REQUEST_FIELDS = (
    "request_id",
    "prompt_token_ids",
    "sampling_params",
    "priority",
    "arrival_time",
    "status",
    "num_computed_tokens",
    "block_hashes",
    "max_tokens",
    "num_tokens",
    "num_prompt_tokens",
    "num_output_tokens",
    "is_finished",
)
"""What the plugin reads of vLLM's ``Request``: set in its ``__init__`` or defined on it."""


OUTPUT_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vllm.v1.core.sched.output.SchedulerOutput", (
        "num_scheduled_tokens", "total_num_scheduled_tokens", "preempted_req_ids",
        "finished_req_ids", "free_encoder_mm_hashes",
    )),
    ("vllm.v1.engine.EngineCoreOutput", ("request_id", "new_token_ids", "finish_reason")),
)
"""Fields the plugin reads of what a step produces: the scheduler output vLLM's walk builds
and the engine-core outputs its ``update_from_output`` returns (a dataclass and a msgspec
struct; their declared fields are compared)."""


class IncompatibleVllmError(RuntimeError):
    """The vLLM this plugin was loaded into differs from what it needs."""

    def __init__(self, version: str, problems: list[str]) -> None:
        self.version = version
        self.problems = problems
        super().__init__(
            f"Slipstream's scheduler plugin cannot run in vLLM {version or '(unknown version)'}"
            f" (tested: {', '.join(TESTED_VERSIONS)}): " + "; ".join(problems)
        )


def tested(version: str) -> bool:
    return any(version == v or version.startswith(v + ".") for v in TESTED_VERSIONS)


def _resolve(root: Any, path: str) -> tuple[bool, Any]:
    obj = root
    for part in path.split("."):
        if not hasattr(obj, part):
            return False, None
        obj = getattr(obj, part)
    return True, obj


def _leading_params(fn: Callable[..., Any]) -> list[str] | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if params and params[0].name == "self":
        params = params[1:]
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _signature_problem(scheduler: Any, path: str, expected: tuple[str, ...]) -> str | None:
    # Methods the plugin overrides are checked on vLLM's class, the one it calls with super().
    base = next((c for c in type(scheduler).__mro__ if c.__module__.startswith("vllm.")), None)
    owner, name = (base, path) if base is not None and "." not in path else (scheduler, path)
    found, fn = _resolve(owner, name)
    if not found:
        return f"{path}() is missing"
    names = _leading_params(fn)
    if names is None:
        return None  # a builtin or C method: nothing to compare
    if names[: len(expected)] != list(expected):
        return f"{path}() takes ({', '.join(names)}), the plugin passes ({', '.join(expected)})"
    return None


def _request_problems(request_cls: type) -> list[str]:
    try:
        source = inspect.getsource(request_cls)
    except (OSError, TypeError):
        return []  # no source to read (a compiled build): the attributes are not checked
    return [
        f"Request.{name} is missing"
        for name in REQUEST_FIELDS
        if not hasattr(request_cls, name) and not re.search(rf"self\.{name}\s*[:=]", source)
    ]


def _declared_fields(cls: type) -> set[str] | None:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    names = getattr(cls, "__struct_fields__", None)  # a msgspec struct
    return set(names) if names is not None else None


def output_problems(classes: dict[str, type] | None = None) -> list[str]:
    """Every field of :data:`OUTPUT_FIELDS` the given classes (by dotted name; default:
    imported from this vLLM) do not declare."""
    problems = []
    for path, names in OUTPUT_FIELDS:
        module, _, name = path.rpartition(".")
        cls = (classes or {}).get(path) or getattr(importlib.import_module(module), name, None)
        if cls is None:
            problems.append(f"{path} is missing")
            continue
        declared = _declared_fields(cls)
        if declared is None:
            continue  # neither a dataclass nor a struct: nothing to compare
        problems += [f"{name}.{field} is missing" for field in names if field not in declared]
    return problems


def check(scheduler: Any, request_cls: type) -> list[str]:
    """Every difference between what the plugin needs and this scheduler; empty when none."""
    problems = [
        f"scheduler.{path} is missing"
        for path in SCHEDULER_ATTRS
        if not _resolve(scheduler, path)[0]
    ]
    for path, expected in SIGNATURES:
        problem = _signature_problem(scheduler, path, expected)
        if problem is not None:
            problems.append(problem)
    problems += _request_problems(request_cls)
    problems += output_problems()
    return problems
