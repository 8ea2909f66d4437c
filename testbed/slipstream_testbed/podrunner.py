"""A "process kubelet" for the local cluster: run Slipstream pods' containers as processes.

The local control plane has no kubelet: kwok marks pods Running and gives them loopback IPs
(127.1.x.y) but runs nothing. :class:`PodRunner` closes the gap for the pods Slipstream cares
about. It polls the API server for

* inference pods (label ``app.kubernetes.io/managed-by=slipstream-operator``, created by the
  operator for an InferenceService): the ``vllm`` container becomes ``slipstream engine``
  (the engine model) on ``<pod IP>:<its --port>``, with the vLLM flags the engine model
  understands, the model profile and GPU type of the InferenceService, and
  ``--served-model-name`` the service's model; the ``sidecar`` container becomes
  ``slipstream sidecar`` with the container's ``SLIPSTREAM_SIDECAR_*`` environment, bound to
  the pod IP, its engine URL pointed at the engine's pod IP, and the engine's limits;
* optionally the chart's operator pods (``app.kubernetes.io/component=operator``,
  ``app.kubernetes.io/name=slipstream``): the container's own arguments and environment run
  as ``slipstream ...`` with a kubeconfig holding a token of the pod's service account, so
  the operator acts with exactly the chart's RBAC.

Volumes and environment are read from the API as a kubelet reads them
(:mod:`.podmaterials`): Secret, ConfigMap, ``emptyDir``, ``hostPath`` and claim volumes become
local folders (a claim's those of its bound ``hostPath`` or ``local`` PersistentVolume), a
value or argument under a mount's ``mountPath`` is rewritten to the folder, and ``env``
entries from Secrets, ConfigMaps and pod fields are resolved. A pod whose references cannot be
resolved (a missing Secret, an unbound claim) is not run, and is tried again at the next sync.
Each process runs in its own session with its log in ``workdir``; a process that exits while
its pod still runs is restarted (at most once per ``restart_backoff_s``); a pod that is gone,
no longer Running or being deleted has its processes stopped (SIGTERM, then SIGKILL).
Only pods whose IP lies in 127.0.0.0/8 are run.

Deliberately left out: probes, resource limits, init containers, other volume kinds, images
(the processes run this checkout's ``slipstream``), and pods of other applications.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kubernetes import client

from slipstream_testbed.podmaterials import MaterialError, PodMaterials
from slipstream_testbed.procgroup import stop_group
from slipstream_testbed.vllm.server import ENGINE_CORE_NICE, renice_engine_core

logger = logging.getLogger(__name__)

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
INFERENCE_SELECTOR = "app.kubernetes.io/managed-by=slipstream-operator"
OPERATOR_SELECTOR = "app.kubernetes.io/name=slipstream,app.kubernetes.io/component=operator"
SERVICE_LABEL = "slipstream.dev/service"
GROUP, VERSION = "slipstream.dev", "v1alpha1"
DEFAULT_ENGINE_PROFILE = "llama-2-7b"
SLIPSTREAM = (sys.executable, "-m", "slipstream_cli.main")
# vLLM flags the engine model takes as they are: flag -> takes a value.
ENGINE_FLAGS: dict[str, bool] = {
    "--scheduling-policy": True,
    "--max-num-seqs": True,
    "--max-num-batched-tokens": True,
    "--block-size": True,
    "--max-model-len": True,
    "--gpu-memory-utilization": True,
    "--long-prefill-token-threshold": True,
    "--enable-prefix-caching": False,
    "--no-enable-prefix-caching": False,
}
# Engine limits the sidecar must know (settings field <- engine flag).
SIDECAR_LIMITS = {"MAX_NUM_SEQS": "--max-num-seqs",
                  "MAX_NUM_BATCHED_TOKENS": "--max-num-batched-tokens",
                  "BLOCK_SIZE": "--block-size",
                  "LONG_PREFILL_TOKEN_THRESHOLD": "--long-prefill-token-threshold"}
ServiceAccountKubeconfig = Callable[[str, str, Path], Path]


class PodRunnerError(Exception):
    """A pod cannot be run as processes (``pod``: namespace/name)."""

    def __init__(self, pod: str, message: str) -> None:
        super().__init__(f"{pod}: {message}")
        self.pod = pod


def engine_profile(model: str, available: Iterable[tuple[str, str]]) -> str:
    """The engine-model profile for a served model name (``meta-llama/Llama-2-7b-hf`` ->
    ``llama-2-7b``); the default profile when none matches."""
    name = model.rsplit("/", 1)[-1].lower()
    names = sorted({m for m, _ in available}, key=len, reverse=True)
    return next((m for m in names if name.startswith(m)), DEFAULT_ENGINE_PROFILE)


def split_flags(args: Sequence[str]) -> dict[str, str | None]:
    """``--flag value`` / ``--flag=value`` / ``--switch`` pairs of a container's args."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "=" in arg:
            flag, _, value = arg.partition("=")
            out[flag] = value
        elif arg.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[arg] = args[i + 1]
            i += 1
        elif arg.startswith("--"):
            out[arg] = None
        i += 1
    return out


def engine_command(container: Mapping[str, Any], ip: str, *, model: str, gpu: str,
                   available: Iterable[tuple[str, str]], seed: int) -> tuple[list[str], int]:
    """``slipstream engine`` argv for a ``vllm`` container, and the port it listens on."""
    flags = split_flags([str(a) for a in container.get("args") or []])
    port = int(flags.get("--port") or 8000)
    argv = [*SLIPSTREAM, "engine", "--host", ip, "--port", str(port),
            "--model", engine_profile(model, available), "--gpu", gpu,
            "--served-model-name", model, "--seed", str(seed)]
    dropped = []
    for flag, value in flags.items():
        if flag in ("--port", "--host", "--model", "--served-model-name"):
            continue
        if flag not in ENGINE_FLAGS:
            dropped.append(flag)
            continue
        argv += [flag] if value is None or not ENGINE_FLAGS[flag] else [flag, value]
    if dropped:
        logger.info("engine model ignores vLLM flags %s", ", ".join(sorted(dropped)))
    return argv, port


def vllm_engine_command(container: Mapping[str, Any], ip: str, *, model: str, python: str,
                        model_dir: Path, mounts: Mapping[str, Path] | None = None,
                        env: Mapping[str, str] | None = None,
                        ) -> tuple[list[str], int, dict[str, str]]:
    """Real ``vllm serve`` (on CPU) for a ``vllm`` container: argv, the port it listens on and
    the environment it adds. The model is the container's ``--model`` where that is a model
    folder on a mount (a ``pvc://`` model source, a hostPath), else the tiny model in
    ``model_dir`` (a Hugging Face id: nothing is downloaded here). The container's
    ``--max-num-seqs``, ``--max-num-batched-tokens`` and ``--max-model-len`` (up to the tiny
    model's 2,048 positions; 2,048 when unset) carry over. In engine mode the container's
    ``--scheduler-cls`` and ``--no-async-scheduling`` carry over too. ``env`` is the
    container's resolved environment (its plain ``value`` entries when not given), with paths
    under a mount (``SLIPSTREAM_CHANNEL_DIR``) pointed at the local folders of ``mounts``."""
    from slipstream_testbed.vllm.server import VllmServerOptions, server_env
    from slipstream_testbed.vllm.tiny_model import TinyModelSpec

    tiny_context = TinyModelSpec().max_position_embeddings
    flags = split_flags([str(a) for a in container.get("args") or []])
    port = int(flags.get("--port") or 8000)
    asked = flags.get("--model")
    if asked:
        local = Path(_rewrite_path(asked, mounts or {}))
        if local != Path(asked) and (local / "config.json").is_file():
            model_dir = local  # the container's own model, on a volume this host mounts

    def number(flag: str) -> int | None:
        value = flags.get(flag)
        return int(value) if value and value.isdigit() else None

    # The container's context, as far as the tiny model's positions reach.
    context = min(number("--max-model-len") or tiny_context, tiny_context)
    given = env if env is not None else plain_env(container)
    own_env = {k: _rewrite_path(v, mounts or {}) for k, v in given.items()}
    opts = VllmServerOptions(model_dir=model_dir, host=ip, port=port, served_model_name=model,
                             max_model_len=context, max_num_seqs=number("--max-num-seqs"),
                             max_num_batched_tokens=number("--max-num-batched-tokens"),
                             scheduler_cls=flags.get("--scheduler-cls"),
                             extra_args=tuple(f for f in ("--no-async-scheduling",)
                                              if f in flags),
                             env=own_env)
    added = {k: v for k, v in server_env(opts).items() if os.environ.get(k) != v}
    return [python, "-m", "slipstream_vllm.serve", *opts.argv(port)], port, added


def plain_env(container: Mapping[str, Any]) -> dict[str, str]:
    """A container's environment entries that carry a plain ``value``."""
    return {str(e["name"]): str(e.get("value", "")) for e in container.get("env") or []
            if "value" in e}


def sidecar_environment(container: Mapping[str, Any], ip: str, engine_port: int,
                        engine_flags: Mapping[str, str | None],
                        mounts: Mapping[str, Path], *,
                        env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The sidecar container's environment for a process on ``ip``: ``env`` (its resolved
    environment; its plain ``value`` entries when not given) with paths under a mount
    rewritten, the engine's address and limits."""
    given = env if env is not None else plain_env(container)
    env = {k: _rewrite_path(v, mounts) for k, v in given.items()}
    engine = urlsplit(env.get("SLIPSTREAM_SIDECAR_ENGINE", f"http://127.0.0.1:{engine_port}"))
    env["SLIPSTREAM_SIDECAR_ENGINE"] = urlunsplit(
        (engine.scheme or "http", f"{ip}:{engine.port or engine_port}", "", "", ""))
    env["SLIPSTREAM_SIDECAR_HOST"] = ip
    for field_name, flag in SIDECAR_LIMITS.items():
        value = engine_flags.get(flag)
        if value is not None:
            env.setdefault(f"SLIPSTREAM_SIDECAR_{field_name}", value)
    return env


def sidecar_args(container: Mapping[str, Any], mounts: Mapping[str, Path]) -> list[str]:
    """The sidecar container's arguments after ``sidecar`` (``--engine-channel DIR`` in engine
    mode), with paths under a mount rewritten to its local folder."""
    args = [str(a) for a in container.get("args") or []]
    if args[:1] == ["sidecar"]:
        args = args[1:]
    return [_rewrite_path(a, mounts) for a in args]


def _rewrite_path(value: str, mounts: Mapping[str, Path]) -> str:
    for mount_path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return str(local) + value[len(mount_path.rstrip("/")):]
    return value


def operator_command(container: Mapping[str, Any], ip: str, kubeconfig: Path) -> list[str]:
    """``slipstream ...`` argv for the chart's operator container, run on ``ip``."""
    args = [str(a) for a in container.get("args") or []]
    out: list[str] = []
    for arg in args:
        if arg.startswith("--liveness="):
            url = urlsplit(arg.partition("=")[2])
            out.append("--liveness=" + urlunsplit(
                (url.scheme, f"{ip}:{url.port}", url.path, "", "")))
        else:
            out.append(arg)
    if "operator" not in out:
        raise PodRunnerError("operator", f"container args {args} do not run the operator")
    at = out.index("operator") + 1
    # --loopback-only would put /metrics on 127.0.0.1; the pod's own IP is where a
    # cluster's Prometheus finds it, and it is loopback here.
    out[at:at] = ["--kubeconfig", str(kubeconfig), "--loopback-only", "--metrics-address", ip]
    return [*SLIPSTREAM, *out]


def operator_metrics_port(container: Mapping[str, Any]) -> int:
    """The ``--metrics-port`` the chart gives the operator container (0 when it has none)."""
    for arg in container.get("args") or []:
        name, sep, value = str(arg).partition("=")
        if name == "--metrics-port" and sep and value.lstrip("-").isdigit():
            return max(int(value), 0)
    return 0


@dataclass
class Process:
    """One container run as a process group."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    engine_core_nice: int | None = None  # a vllm serve's engine core runs at this niceness

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                          env=self.env, start_new_session=True)
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        proc, self.popen = self.popen, None
        stop_group(proc, grace_s)


@dataclass
class RunningPod:
    """The processes of one pod."""

    namespace: str
    name: str
    uid: str
    ip: str
    kind: str  # "inference" | "operator"
    processes: list[Process] = field(default_factory=list)
    http_port: int = 0  # the sidecar's HTTP port (its /metrics; online traffic in sidecar mode)
    service: str = ""
    engine_port: int = 0
    engine_mode: bool = False  # online traffic goes straight to the engine (the plugin decides)

    @property
    def online_port(self) -> int:
        """Where the pod's Service sends online traffic: vLLM's port in engine mode."""
        return self.engine_port if self.engine_mode else self.http_port

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


Pod = dict[str, Any]  # a pod as the API serves it (JSON field names)


def _is_runnable(pod: Pod) -> bool:
    status = pod.get("status") or {}
    ip = str(status.get("podIP") or "")
    deleting = (pod.get("metadata") or {}).get("deletionTimestamp") is not None
    if status.get("phase") != "Running" or deleting or not ip:
        return False
    try:
        return ipaddress.ip_address(ip) in LOOPBACK
    except ValueError:
        return False


class PodRunner:
    """Keeps one set of processes per Running Slipstream pod; call :meth:`sync` or :meth:`run`."""

    def __init__(
        self,
        api: client.ApiClient,
        workdir: Path,
        *,
        namespace: str | None = None,
        service_account_kubeconfig: ServiceAccountKubeconfig | None = None,
        restart_backoff_s: float = 5.0,
        base_env: Mapping[str, str] | None = None,
        engine: str = "model",
    ) -> None:
        if engine not in ("model", "vllm"):
            raise ValueError(f"engine must be model or vllm, not {engine!r}")
        self.engine = engine  # model: the engine model; vllm: real vllm serve (CPU, tiny model)
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.workdir = workdir
        self.namespace = namespace
        self.sa_kubeconfig = service_account_kubeconfig
        self.restart_backoff_s = restart_backoff_s
        self.base_env = dict(base_env if base_env is not None else os.environ)
        self.pods: dict[str, RunningPod] = {}
        self._lock = threading.Lock()
        from slipstream_scheduler.engine.gpu import available_profiles

        self._profiles = available_profiles()

    # ------------------------------------------------------------------ lifecycle

    def run(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """Sync every ``interval_s`` until ``stop`` is set, then stop every process."""
        try:
            while not stop.is_set():
                try:
                    self.sync()
                except client.ApiException as exc:
                    logger.warning("pod runner: API error %s; retrying", exc.status)
                except PodRunnerError as exc:
                    logger.warning("pod runner: %s", exc)
                stop.wait(interval_s)
        finally:
            self.stop_all()

    @contextlib.contextmanager
    def running(self, interval_s: float = 1.0, join_s: float = 90.0) -> Iterator[PodRunner]:
        """:meth:`run` in a daemon thread for the ``with`` block; on leaving it, the thread is
        told to stop (which stops every process) and waited for up to ``join_s``."""
        stop = threading.Event()
        thread = threading.Thread(target=self.run, args=(stop, interval_s), daemon=True,
                                  name="podrunner")
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join(timeout=join_s)

    def stop_all(self) -> None:
        with self._lock:
            for pod in list(self.pods.values()):
                self._stop_pod(pod)
            self.pods.clear()

    def sync(self) -> None:
        """One pass: start processes for new Running pods, stop those of vanished pods."""
        wanted: dict[str, Pod] = {}
        selectors = [INFERENCE_SELECTOR]
        if self.sa_kubeconfig is not None:
            selectors.append(OPERATOR_SELECTOR)
        for selector in selectors:
            for pod in self._list(selector):
                if _is_runnable(pod):
                    wanted[str(pod["metadata"]["uid"])] = pod
        with self._lock:
            for uid in set(self.pods) - set(wanted):
                self._stop_pod(self.pods.pop(uid))
            for uid, pod in wanted.items():
                running = self.pods.get(uid)
                if running is None:
                    try:
                        self.pods[uid] = self._start_pod(pod)
                    except (PodRunnerError, client.ApiException) as exc:
                        logger.warning("cannot run pod %s/%s yet: %s",
                                       pod["metadata"]["namespace"], pod["metadata"]["name"], exc)
                    continue
                for proc in running.processes:
                    if not proc.alive() and (
                        time.monotonic() - proc.started_at >= self.restart_backoff_s
                    ):
                        proc.restarts += 1
                        logger.warning("%s of %s exited; restart %d (log %s)", proc.name,
                                       running.key, proc.restarts, proc.log_path)
                        proc.start()
                    elif proc.engine_core_nice is not None and proc.popen is not None:
                        # Each pass: the engine core's threads appear while vLLM starts, and
                        # again after a restart.
                        renice_engine_core(proc.popen.pid, proc.engine_core_nice)

    def snapshot(self) -> list[RunningPod]:
        with self._lock:
            return list(self.pods.values())

    # ------------------------------------------------------------------ internals

    def _list(self, selector: str) -> list[Pod]:
        if self.namespace:
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector)
        else:
            pods = self.core.list_pod_for_all_namespaces(label_selector=selector)
        data: dict[str, Any] = self.api.sanitize_for_serialization(pods)  # type: ignore[no-untyped-call]
        return list(data.get("items") or [])

    def _stop_pod(self, pod: RunningPod) -> None:
        logger.info("stopping the processes of pod %s", pod.key)
        for proc in reversed(pod.processes):
            proc.stop()

    def _pod_dir(self, pod: Pod) -> Path:
        meta = pod["metadata"]
        return self.workdir / f"{meta['namespace']}_{meta['name']}"

    def _materials(self, pod: Pod) -> PodMaterials:
        return PodMaterials(self.core, pod, self._pod_dir(pod))

    def _start_pod(self, pod: Pod) -> RunningPod:
        meta = pod["metadata"]
        labels = meta.get("labels") or {}
        kind = "inference" if SERVICE_LABEL in labels else "operator"
        running = RunningPod(meta["namespace"], meta["name"], meta["uid"],
                             pod["status"]["podIP"], kind)
        containers = {c["name"]: c for c in pod["spec"]["containers"]}
        folder = self._pod_dir(pod)
        try:
            if kind == "inference":
                running.service = labels[SERVICE_LABEL]
                running.processes = self._inference(pod, containers, folder, running)
            else:
                running.processes = self._operator(pod, containers, folder, running)
        except MaterialError as exc:  # the kubelet would leave the container waiting too
            raise PodRunnerError(running.key, str(exc)) from exc
        for proc in running.processes:
            proc.start()
        logger.info("pod %s (%s) runs as %d processes on %s", running.key, kind,
                    len(running.processes), running.ip)
        return running

    def _inference(self, pod: Pod, containers: Mapping[str, Any], folder: Path,
                   running: RunningPod) -> list[Process]:
        key = running.key
        if "vllm" not in containers or "sidecar" not in containers:
            raise PodRunnerError(key, "expected containers vllm and sidecar")
        service: Any = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, running.namespace, "inferenceservices", running.service)
        spec = (service.get("spec") if isinstance(service, dict) else None) or {}
        engine_spec = spec.get("engine") or {}
        model = str(spec.get("model", DEFAULT_ENGINE_PROFILE))
        gpu = str(engine_spec.get("gpuType") or "a100").lower()
        if gpu not in {g for _, g in self._profiles}:
            gpu = "a100"
        seed = int(re.sub(r"\D", "", running.ip.replace(".", "")) or 0) % 100_000
        engine_env = dict(self.base_env)
        engine_mode = "--scheduler-cls" in split_flags(
            [str(a) for a in containers["vllm"].get("args") or []])
        if engine_mode and self.engine != "vllm":
            raise PodRunnerError(key, "engine mode (scheduling.enforcement: engine) runs "
                                      "Slipstream's plugin inside vLLM: start the pod runner "
                                      "with engine='vllm'")
        materials = self._materials(pod)
        vllm_mounts = materials.volumes(containers["vllm"])
        vllm_env = materials.environment(containers["vllm"])
        if self.engine == "vllm":
            from slipstream_testbed.vllm import ensure
            from slipstream_testbed.vllm.server import vllm_python

            engine_argv, engine_port, extra = vllm_engine_command(
                containers["vllm"], running.ip, model=model, python=vllm_python(),
                model_dir=ensure(), mounts=vllm_mounts, env=vllm_env)
            engine_env.update(extra)
        else:
            engine_argv, engine_port = engine_command(containers["vllm"], running.ip,
                                                      model=model, gpu=gpu,
                                                      available=self._profiles, seed=seed)
        engine_flags = split_flags([str(a) for a in containers["vllm"].get("args") or []])
        sidecar = containers["sidecar"]
        mounts = materials.volumes(sidecar)
        env = sidecar_environment(sidecar, running.ip, engine_port, engine_flags, mounts,
                                  env=materials.environment(sidecar))
        env.setdefault("SLIPSTREAM_SIDECAR_STATE_DIR", str(folder / "state"))
        running.http_port = int(env.get("SLIPSTREAM_SIDECAR_HTTP_PORT", "8000"))
        running.engine_port = engine_port
        running.engine_mode = engine_mode
        sidecar_env = {k: v for k, v in self.base_env.items()
                       if not k.startswith("SLIPSTREAM_SIDECAR_")}
        sidecar_env.update(env)
        return [
            Process("engine", engine_argv, engine_env, folder / "engine.log",
                    engine_core_nice=ENGINE_CORE_NICE if self.engine == "vllm" else None),
            Process("sidecar", [*SLIPSTREAM, "sidecar", *sidecar_args(sidecar, mounts)],
                    sidecar_env, folder / "sidecar.log"),
        ]

    def _operator(self, pod: Pod, containers: Mapping[str, Any], folder: Path,
                  running: RunningPod) -> list[Process]:
        assert self.sa_kubeconfig is not None
        meta = pod["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        if len(containers) != 1:
            raise PodRunnerError(key, "expected one operator container")
        (container,) = containers.values()
        account = str(pod["spec"].get("serviceAccountName") or "default")
        folder.mkdir(parents=True, exist_ok=True)
        kubeconfig = self.sa_kubeconfig(meta["namespace"], account,
                                        folder / "serviceaccount.kubeconfig")
        argv = operator_command(container, str(pod["status"]["podIP"]), kubeconfig)
        running.http_port = operator_metrics_port(container)
        env = {k: v for k, v in self.base_env.items()
               if not k.startswith("SLIPSTREAM_OPERATOR_") and k != "KUBECONFIG"}
        materials = self._materials(pod)
        materials.volumes(container)  # its Secrets, ConfigMaps and claims, as the kubelet
        env.update(materials.environment(container))
        return [Process("operator", argv, env, folder / "operator.log")]
