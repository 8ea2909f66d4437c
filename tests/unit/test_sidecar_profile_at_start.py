"""Profiling the engine at pod start: the setting, the subprocess, readiness meanwhile, the
model reported as ``profiled``, its reuse after a restart, and the operator's side (the
``profileAtStart`` field, the sidecar's env, the CRD)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError

from slipstream_cli.main import build_parser
from slipstream_operator import crdgen
from slipstream_operator.api import InferenceServiceSpec, validate_semantics
from slipstream_operator.modelchoice import LearnedParams, choose_model
from slipstream_operator.reconcile_service import ObjectRef, children
from slipstream_operator.sidecar_client import learned_from_pb
from slipstream_scheduler.latency import (
    LatencyModelError,
    LatencyModelMeta,
    LinearLatencyModel,
    fit,
)
from slipstream_scheduler.learning import Learned
from slipstream_scheduler.types import BatchItem, Phase
from slipstream_sidecar import __main__ as sidecar_cli
from slipstream_sidecar import startprofile
from slipstream_sidecar.app import Sidecar
from slipstream_sidecar.grpc_server import status_pb
from slipstream_sidecar.settings import SidecarSettings
from slipstream_sidecar.startprofile import PROFILE_FILE, REPORT_FILE, ProfiledModel

pytestmark = pytest.mark.unit


def fitted_model(heldout: float | None = 0.042, rows: int = 80) -> LinearLatencyModel:
    """A model fitted on synthetic decode and prefill steps (5 ms + 0.4 ms per decode +
    20 us per prefill token, 2 % noise)."""
    rng = random.Random(7)
    data: list[tuple[tuple[BatchItem, ...], float]] = []
    for i in range(rows):
        if i % 2:
            n = rng.randint(1, 32)
            batch = tuple(BatchItem(Phase.DECODE, 1, rng.randint(16, 512)) for _ in range(n))
            seconds = 0.005 + 0.0004 * n
        else:
            p = rng.randint(16, 2048)
            batch = (BatchItem(Phase.PREFILL, p, 0),)
            seconds = 0.005 + 0.00002 * p
        data.append((batch, seconds * rng.uniform(0.98, 1.02)))
    meta = LatencyModelMeta(model="tiny", source="slipstream profile engine http://x")
    model = fit(data, seed=0, meta=meta).model
    assert model.stats is not None
    return replace(model, stats=replace(model.stats, heldout_mape=heldout))


def write_profile(directory: Path, heldout: float | None = 0.042) -> LinearLatencyModel:
    """A profile as ``slipstream profile engine`` writes it: the held-out error in the fit
    block (none when the command held no rows out)."""
    model = fitted_model(heldout)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / PROFILE_FILE).write_text(model.to_json())
    return model


# ---------------------------------------------------------------------------- the setting


def test_the_setting_is_off_by_default_and_read_from_env_and_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert SidecarSettings().profile_at_start_s == 0
    monkeypatch.setenv("SLIPSTREAM_SIDECAR_PROFILE_AT_START_S", "45")
    assert SidecarSettings().profile_at_start_s == 45
    parser = argparse.ArgumentParser()
    sidecar_cli.add_arguments(parser)
    args = parser.parse_args(["--profile-at-start", "90"])
    assert args.profile_at_start_s == 90.0


@pytest.mark.parametrize("value", [5, -1, 3601])
def test_a_profile_shorter_than_the_commands_minimum_is_refused(value: float) -> None:
    with pytest.raises(ValidationError, match="profile_at_start_s"):
        SidecarSettings(profile_at_start_s=value)


# ---------------------------------------------------------------------------- the command


def test_the_command_line_is_one_the_cli_accepts(tmp_path: Path) -> None:
    argv = startprofile.command("http://127.0.0.1:8001", "tiny", tmp_path / "out.json", 44.2,
                                max_streams=256, max_prompt_tokens=8192)
    assert argv[:3] == [sys.executable, "-m", "slipstream_cli.main"]
    parser, chosen = build_parser(argv[3:])
    assert chosen == "profile"
    args = parser.parse_args(argv[3:])
    assert args.url == "http://127.0.0.1:8001" and args.model == "tiny"
    assert args.budget_s == 45  # whole seconds, rounded up
    assert args.max_streams == 32 and args.max_prompt_tokens == 2048  # the CLI's defaults
    small = startprofile.command("http://e", "m", tmp_path / "o", 10, max_streams=4,
                                 max_prompt_tokens=384)
    assert small[small.index("--max-streams") + 1] == "4"
    assert small[small.index("--max-prompt-tokens") + 1] == "384"


def test_the_heldout_error_travels_in_the_models_fit_block() -> None:
    model = fitted_model(0.0345)
    again = LinearLatencyModel.from_json(model.to_json())
    assert again.stats is not None and again.stats.heldout_mape == pytest.approx(0.0345)
    none = LinearLatencyModel.from_json(fitted_model(None).to_json())
    assert none.stats is not None and none.stats.heldout_mape is None
    doc = json.loads(model.to_json())
    doc["fit"]["heldout_mape"] = -1.0
    with pytest.raises(LatencyModelError, match="heldout_mape"):
        LinearLatencyModel.from_json(json.dumps(doc))


# ---------------------------------------------------------------------------- the file


def test_a_kept_profile_is_loaded_with_its_heldout_error(tmp_path: Path) -> None:
    model = write_profile(tmp_path)
    got = startprofile.load(tmp_path)
    assert got is not None
    assert got.model.to_json() == model.to_json()
    assert got.heldout_mape == pytest.approx(0.042)
    assert got.rows == 80 and got.fitted_at == (tmp_path / PROFILE_FILE).stat().st_mtime
    write_profile(tmp_path, heldout=None)
    unknown = startprofile.load(tmp_path)
    assert unknown is not None and unknown.heldout_mape == math.inf


def test_no_or_a_broken_profile_is_none(tmp_path: Path) -> None:
    assert startprofile.load(tmp_path) is None
    (tmp_path / PROFILE_FILE).write_text('{"kind": "latency-model", "sch')  # cut short
    assert startprofile.load(tmp_path) is None


# ---------------------------------------------------------------------------- status


def test_status_reports_the_profiled_model(tmp_path: Path) -> None:
    model = write_profile(tmp_path)
    sc = Sidecar(SidecarSettings(state_dir=tmp_path, profile_at_start_s=30))
    assert sc.profiled is not None and not sc.profiling  # reused: no profile at start
    msg = status_pb(sc.status()).learned_model
    assert msg.source == "profiled" and msg.revision == 1
    assert msg.fit_steps == msg.seen_steps == 80
    assert msg.heldout_mape == pytest.approx(0.042)
    assert msg.fitted_at == pytest.approx((tmp_path / PROFILE_FILE).stat().st_mtime)
    assert dict(msg.model.coefficients) and msg.model.kind == model.feature_set.value

    # The operator reads it back as a profiled model and, with no profile file, uses it.
    learned = learned_from_pb(msg)
    assert learned.source == "profiled" and learned.model is not None
    batch = [BatchItem(Phase.DECODE, 1, 200)] * 8
    assert learned.model.predict(batch) == pytest.approx(model.predict(batch))
    choice = choose_model(None, "", [("chat-0", learned)],
                          LearnedParams(max_mape=0.10, min_steps=50))
    assert choice.in_force is not None and choice.in_force.source == "profiled"
    assert choice.in_force.status()["source"] == "profiled"


def test_a_learned_model_comes_before_the_profiled_one(tmp_path: Path) -> None:
    write_profile(tmp_path)
    sc = Sidecar(SidecarSettings(state_dir=tmp_path, profile_at_start_s=30))
    learned = Learned(model=fitted_model(40), fit_steps=900, seen_steps=1500,
                      heldout_mape=0.02, revision=3, fitted_at=1.0)
    msg = status_pb(replace(sc.status(), learned=learned)).learned_model
    assert msg.source == "learned" and msg.revision == 3 and msg.fit_steps == 900


def test_without_the_setting_a_kept_file_is_not_reported(tmp_path: Path) -> None:
    write_profile(tmp_path)
    sc = Sidecar(SidecarSettings(state_dir=tmp_path))
    assert sc.profiled is None and not status_pb(sc.status()).HasField("learned_model")


# ---------------------------------------------------------------------------- the subprocess

# Stands in for `slipstream profile engine`: sleeps, copies a model to --out, prints a summary.
FAKE = """
import shutil, sys, time
src, out, pause, status = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
time.sleep(pause)
if status:
    print("slipstream profile engine: error: too few rows to fit", flush=True)
    sys.exit(status)
shutil.copy(src, out)
print("  features=base k-fold MAPE 3.10%, held-out MAPE 4.20%, p95 APE 9.00%", flush=True)
"""


class FakeProfiler:
    """Replaces ``startprofile.command``; records what the sidecar asked for."""

    def __init__(self, source: Path, pause_s: float = 0.0, status: int = 0) -> None:
        self.source, self.pause_s, self.status = source, pause_s, status
        self.calls: list[dict[str, Any]] = []

    def __call__(self, engine: str, model: str, out: Path, budget_s: float, *,
                 max_streams: int, max_prompt_tokens: int) -> list[str]:
        self.calls.append({"engine": engine, "model": model, "out": out, "budget_s": budget_s,
                           "max_streams": max_streams, "max_prompt_tokens": max_prompt_tokens})
        return [sys.executable, "-c", FAKE, str(self.source), str(out), str(self.pause_s),
                str(self.status)]


@pytest.fixture
def model_source(tmp_path: Path) -> Path:
    path = tmp_path / "fitted.json"
    path.write_text(fitted_model().to_json())
    return path


async def test_a_profile_that_succeeds_is_kept_with_its_report(
    tmp_path: Path, model_source: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeProfiler(model_source)
    monkeypatch.setattr(startprofile, "command", fake)
    state = tmp_path / "state"
    state.mkdir()
    got = await startprofile.profile("http://e", "tiny", state, 10, max_streams=4,
                                     max_prompt_tokens=384)
    assert got is not None and got.heldout_mape == pytest.approx(0.042)
    assert (state / PROFILE_FILE).is_file() and not (state / (PROFILE_FILE + ".partial")).exists()
    report = json.loads((state / REPORT_FILE).read_text())
    assert "held-out MAPE" in report["summary"][0]
    assert fake.calls[0]["out"] == state / (PROFILE_FILE + ".partial")


async def test_a_profile_that_fails_or_runs_over_leaves_nothing(
    tmp_path: Path, model_source: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(startprofile, "command", FakeProfiler(model_source, status=1))
    assert await startprofile.profile("http://e", "m", tmp_path, 10, max_streams=1,
                                      max_prompt_tokens=16) is None
    assert not (tmp_path / PROFILE_FILE).exists()

    monkeypatch.setattr(startprofile, "command", FakeProfiler(model_source, pause_s=30))
    monkeypatch.setattr(startprofile, "GRACE_S", 0.0)
    loop = asyncio.get_running_loop()
    began = loop.time()
    assert await startprofile.profile("http://e", "m", tmp_path, 0.5, max_streams=1,
                                      max_prompt_tokens=16) is None
    assert loop.time() - began < 20  # killed at the limit, not waited for
    assert not (tmp_path / PROFILE_FILE).exists()


# ---------------------------------------------------------------------------- readiness


@pytest.fixture
async def fake_engine() -> AsyncIterator[str]:
    """An engine that is healthy and serves the model ``tiny``."""

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


async def _ready_status(client: TestClient[Any, Any]) -> int:
    resp = await client.get("/ready")
    await resp.read()
    return resp.status


async def _wait_ready(client: TestClient[Any, Any], timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while await _ready_status(client) != 200:
        assert loop.time() < deadline, "/ready never answered 200"
        await asyncio.sleep(0.05)


async def test_ready_waits_for_the_profile_and_a_restart_reuses_it(
    tmp_path: Path, model_source: Path, fake_engine: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeProfiler(model_source, pause_s=1.5)
    monkeypatch.setattr(startprofile, "command", fake)
    state = tmp_path / "state"
    settings = SidecarSettings(engine=fake_engine, state_dir=state, profile_at_start_s=10,
                               ready_poll_s=0.05, max_num_seqs=4, max_num_batched_tokens=384)
    sc = Sidecar(settings)
    await sc.start()
    client = TestClient(TestServer(sc.proxy.app()))
    await client.start_server()
    try:
        assert await _ready_status(client) == 503  # profiling: the engine is healthy
        assert sc.profiling and not sc.status().engine_ready
        await _wait_ready(client)
        assert sc.status().engine_ready and not sc.profiling
    finally:
        await client.close()
        await sc.stop()
    assert fake.calls == [{"engine": fake_engine, "model": "tiny",
                           "out": state / (PROFILE_FILE + ".partial"), "budget_s": 10.0,
                           "max_streams": 4, "max_prompt_tokens": 384}]
    assert (state / PROFILE_FILE).is_file()
    msg = status_pb(sc.status()).learned_model
    assert msg.source == "profiled" and dict(msg.model.coefficients)

    again = Sidecar(settings)  # a restart: the file is reused, nothing is profiled
    await again.start()
    client = TestClient(TestServer(again.proxy.app()))
    await client.start_server()
    try:
        assert await _ready_status(client) == 200
    finally:
        await client.close()
        await again.stop()
    assert len(fake.calls) == 1
    assert isinstance(again.profiled, ProfiledModel)
    assert status_pb(again.status()).learned_model.source == "profiled"


async def test_a_failed_profile_does_not_keep_the_pod_unready(
    tmp_path: Path, model_source: Path, fake_engine: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(startprofile, "command", FakeProfiler(model_source, status=2))
    sc = Sidecar(SidecarSettings(engine=fake_engine, state_dir=tmp_path, model="tiny",
                                 profile_at_start_s=10, ready_poll_s=0.05))
    await sc.start()
    client = TestClient(TestServer(sc.proxy.app()))
    await client.start_server()
    try:
        await _wait_ready(client)
    finally:
        await client.close()
        await sc.stop()
    assert sc.profiled is None and not (tmp_path / PROFILE_FILE).exists()
    assert not status_pb(sc.status()).HasField("learned_model")


# ---------------------------------------------------------------------------- the operator

REF = ObjectRef("chat", "team-a", "uid-1", 1)


def service(**scheduling: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({
        "model": "llama-2-7b", "engine": {"image": "vllm/vllm-openai:v0.11.1"},
        "slo": {"ttft": {"p99": "2s"}}, "scheduling": scheduling,
    })


def sidecar_of(spec: InferenceServiceSpec) -> dict[str, Any]:
    objs = {c["kind"]: c for c in children(REF, spec, "token", None)}
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "sidecar")


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_profile_at_start_reaches_the_sidecars_env() -> None:
    on = service(profileAtStart="1m30s")
    assert on.scheduling.profile_at_start_s() == 90.0 and validate_semantics(on) == []
    container = sidecar_of(on)
    assert _env(container)["SLIPSTREAM_SIDECAR_PROFILE_AT_START_S"] == "90"
    assert float(_env(container)["SLIPSTREAM_SIDECAR_PROFILE_AT_START_S"]) >= 10
    # Only readiness is probed: a pod that profiles is kept out of the Service, never
    # restarted for it.
    assert "readinessProbe" in container
    assert "livenessProbe" not in container and "startupProbe" not in container
    for off in (service(), service(profileAtStart="0s")):
        assert "SLIPSTREAM_SIDECAR_PROFILE_AT_START_S" not in _env(sidecar_of(off))


@pytest.mark.parametrize("value", ["5s", "2h", "500ms"])
def test_profile_at_start_out_of_range_is_a_problem(value: str) -> None:
    assert any("profileAtStart" in p for p in validate_semantics(service(profileAtStart=value)))


def test_the_crd_has_the_field_and_its_rule() -> None:
    doc = yaml.safe_load(crdgen.render("InferenceService"))
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    scheduling = spec["properties"]["scheduling"]
    assert scheduling["properties"]["profileAtStart"]["type"] == "string"
    rules = [r for r in scheduling["x-kubernetes-validations"]
             if "profileAtStart" in r["rule"]]
    assert rules and rules[0]["fieldPath"] == ".profileAtStart"
    assert "duration('10s')" in rules[0]["rule"] and "duration('1h')" in rules[0]["rule"]
