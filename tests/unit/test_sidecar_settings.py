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
