"""Real ``vllm serve`` on this CPU, as a process the tests, the demo and the benches control.

:class:`VllmServer` starts ``python -m slipstream_vllm.serve`` (vLLM's own CLI, see that module)
with the tiny model of :mod:`.tiny_model`, in the real-vLLM environment, on a loopback address;
waits for ``/health``; and can ``kill -9`` and restart it on the same address (a pod's vLLM
container crashing and coming back). The process runs in its own session, its log in a file.

Which interpreter: ``SLIPSTREAM_VLLM_PYTHON`` if set; else this one if it can import vllm; else
``.venv-vllm/bin/python`` at the repository root (``make vllm-env``). :func:`vllm_python` says
which, or raises :class:`VllmUnavailableError` with what to run.

Deliberately left out: GPUs, multi-process engines (``--data-parallel-size``), model downloads.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_SERVED_NAME = "slipstream/tiny-llama"


class VllmUnavailableError(RuntimeError):
    """Real vLLM is not installed where the testbed looks for it."""


class VllmStartError(RuntimeError):
    """``vllm serve`` exited or did not answer ``/health`` in time (``log``: its last lines)."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(f"{message}\n--- vllm serve log (last lines) ---\n{log}")
        self.log = log


def vllm_python() -> str:
    """The interpreter that runs real vLLM (see the module note)."""
    env = os.environ.get("SLIPSTREAM_VLLM_PYTHON")
    if env:
        return env
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if venv.exists():
        return str(venv)
    raise VllmUnavailableError(
        "real vLLM is not installed: run `make vllm-env` (builds .venv-vllm), "
        "or set SLIPSTREAM_VLLM_PYTHON to a Python that can import vllm"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


ENGINE_CORE_NICE = 19
"""The niceness the engine core's threads are given once the server is up (None: left as
started). On CPU, vLLM runs the model in a worker process pinned to one core and reserves the
other for its API server; the engine core, between the two, waits for each step's result by
spinning (``sched_yield``) and takes most of that reserved core. On a 2-core host the API
server, a sidecar and the test's own client then get a third of a core each, and a request
can sit unread in the API server for tens of seconds. On a GPU host the engine core waits on
a GPU, not on the cores that serve HTTP; at the lowest priority its spin takes only what
nothing else wants, and its real work (scheduling, output) runs while the worker waits."""


def group_threads(pgid: int, comm_prefix: str = "") -> list[int]:
    """The thread ids of the processes in process group ``pgid`` whose name (``comm``) starts
    with ``comm_prefix``."""
    tids: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            if comm_prefix and not (stat.parent / "comm").read_text().startswith(comm_prefix):
                continue
            tids += [int(t.name) for t in (stat.parent / "task").iterdir()]
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    return tids


def engine_core_threads(pgid: int) -> list[int]:
    """The thread ids of the engine core (``VLLM::EngineCore``) in process group ``pgid``:
    a ``vllm serve`` started in its own session."""
    return group_threads(pgid, "VLLM::EngineCor")


def renice_engine_core(pgid: int, nice: int) -> int:
    """Give every engine-core thread in process group ``pgid`` the niceness ``nice`` (see
    :data:`ENGINE_CORE_NICE`); how many threads were found."""
    tids = engine_core_threads(pgid)
    for tid in tids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    return len(tids)


@dataclass(frozen=True, slots=True)
class VllmServerOptions:
    """What ``vllm serve`` is started with. ``extra_args`` go last, as they are."""

    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, chosen once and kept across restarts
    served_model_name: str = DEFAULT_SERVED_NAME
    scheduling_policy: str = "priority"
    max_model_len: int = 512
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB: vLLM parses an int)
    scheduler_cls: str | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    engine_core_nice: int | None = ENGINE_CORE_NICE

    def argv(self, port: int) -> list[str]:
        args = [
            str(self.model_dir),
            "--host", self.host,
            "--port", str(port),
            "--served-model-name", self.served_model_name,
            "--scheduling-policy", self.scheduling_policy,
            "--max-model-len", str(self.max_model_len),
            "--enforce-eager",
            "--disable-uvicorn-access-log",
        ]
        for flag, value in (
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--block-size", self.block_size),
            ("--scheduler-cls", self.scheduler_cls),
        ):
            if value is not None:
                args += [flag, str(value)]
        return [*args, *self.extra_args]


def server_env(opts: VllmServerOptions) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE=str(opts.kv_cache_gib),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(opts.env)
    return env


class VllmServer:
    """One ``vllm serve`` process (see the module note). Use as a context manager or
    ``start()`` / ``stop()``."""

    def __init__(self, opts: VllmServerOptions, *, python: str | None = None) -> None:
        self.opts = opts
        self.python = python or vllm_python()
        self.port = opts.port or free_port(opts.host)
        self.log_path = opts.log_path or Path(
            os.environ.get("TMPDIR", "/tmp"), f"slipstream-vllm-{opts.host}-{self.port}.log"
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{self.opts.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("vllm serve is not running")
        return self.proc.pid

    def command(self) -> list[str]:
        return [self.python, "-m", "slipstream_vllm.serve", *self.opts.argv(self.port)]

    def start(self, timeout_s: float = 300.0) -> VllmServer:
        """Start the process and wait until ``/health`` answers 200."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(self.opts),
                cwd=str(self.log_path.parent),
                start_new_session=True,
            )
        finally:
            log.close()
        self.starts += 1
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise VllmStartError(f"vllm serve exited with {self.proc.returncode}", self.tail())
            if self.healthy():
                if self.opts.engine_core_nice is not None:
                    self.renice_engine_core(self.opts.engine_core_nice)
                return
            time.sleep(0.5)
        raise VllmStartError(f"vllm serve did not answer /health within {timeout_s:.0f} s",
                             self.tail())

    def engine_core_threads(self) -> list[int]:
        """The thread ids of this server's engine core (``VLLM::EngineCore``, in the server's
        process group)."""
        return [] if self.proc is None else engine_core_threads(self.proc.pid)

    def renice_engine_core(self, nice: int) -> None:
        """Give every engine-core thread ``nice`` (see :data:`ENGINE_CORE_NICE`)."""
        if self.proc is not None:
            renice_engine_core(self.proc.pid, nice)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """``kill -9`` the whole process group (the API server and its engine core)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        if self.proc is None or self.proc.poll() is not None:
            self._reap_group()
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self._reap_group()

    def _reap_group(self) -> None:
        # The engine core is a child process: make sure none of the group outlives the server.
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def restart(self, timeout_s: float = 300.0) -> None:
        """Kill -9 (if running) and start again on the same address."""
        self.kill()
        self.start(timeout_s)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@contextlib.contextmanager
def running(opts: VllmServerOptions, timeout_s: float = 300.0) -> Iterator[VllmServer]:
    srv = VllmServer(opts)
    try:
        yield srv.start(timeout_s)
    finally:
        srv.stop()

