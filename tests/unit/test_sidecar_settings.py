"""Sidecar settings: environment prefix, flag overrides, refusal of nonsense."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from slipstream_sidecar import __main__ as cli
from slipstream_sidecar.settings import SidecarSettings

pytestmark = pytest.mark.unit


def test_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPSTREAM_SIDECAR_ENGINE", "http://127.0.0.1:9999")
    monkeypatch.setenv("SLIPSTREAM_SIDECAR_HTTP_PORT", "8100")
    s = SidecarSettings()
    assert s.engine == "http://127.0.0.1:9999" and s.http_port == 8100
    assert SidecarSettings(http_port=8200).http_port == 8200


def test_unknown_or_invalid_values_are_refused() -> None:
    with pytest.raises(ValidationError):
        SidecarSettings(no_such_field=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        SidecarSettings(online_prompt_tokens="guess")  # type: ignore[arg-type]


def test_cli_reports_invalid_settings(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--http-port", "70000"])
    assert cli.run(args) == 2
    assert "http_port" in capsys.readouterr().err


def test_event_loop_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    uvloop = pytest.importorskip("uvloop")
    assert SidecarSettings().event_loop == "auto"
    assert cli.event_loop_runner("asyncio") is asyncio.run
    assert cli.event_loop_runner("auto") is uvloop.run
    assert cli.event_loop_runner("uvloop") is uvloop.run
    # Without uvloop: 'auto' falls back to the standard loop, 'uvloop' refuses to start.
    monkeypatch.setitem(__import__("sys").modules, "uvloop", None)
    assert cli.event_loop_runner("auto") is asyncio.run
    with pytest.raises(ImportError):
        cli.event_loop_runner("uvloop")
    with pytest.raises(ValidationError):
        SidecarSettings(event_loop="trio")  # type: ignore[arg-type]


def test_cli_refuses_uvloop_when_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "uvloop", None)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--event-loop", "uvloop"])) == 2
    assert "uvloop is not installed" in capsys.readouterr().err
