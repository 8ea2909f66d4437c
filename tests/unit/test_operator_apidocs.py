"""The generated API reference is current and covers every spec field."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream_operator import apidocs
from slipstream_operator.api import InferenceServiceSpec, OfflineJobSpec
from slipstream_operator.settings import OperatorSettings

pytestmark = pytest.mark.unit


def test_committed_reference_matches_the_models() -> None:
    path = Path(__file__).resolve().parents[2] / "docs" / "reference" / "api.md"
    assert path.read_text() == apidocs.render(), (
        "docs/reference/api.md is stale: run python -m slipstream_operator.apidocs"
    )


def test_every_top_level_spec_field_and_rule_is_documented() -> None:
    text = apidocs.render()
    for model in (InferenceServiceSpec, OfflineJobSpec):
        for name, field in model.model_fields.items():
            assert f"| `{field.alias or name}`" in text, name
    assert "duration(self.p99) >= duration(self.mean)" in text
    assert "inferenceservices.slipstream.dev" in text


def test_every_operator_setting_is_documented_with_its_variable_and_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text = apidocs.render()
    for name in OperatorSettings.model_fields:
        assert f"| `SLIPSTREAM_OPERATOR_{name.upper()}" in text, name
    assert '| `SLIPSTREAM_OPERATOR_SIDECAR_IMAGE` | str | "ghcr.io/slipstream-dev/' in text
    assert "| `SLIPSTREAM_OPERATOR_PROMETHEUS_URL` | str \\| None | unset |" in text
    # What the page says a group knob is called is what the settings read.
    assert "`SLIPSTREAM_OPERATOR_BUDGET__DECREASE_FACTOR=0.5`" in text
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_BUDGET__DECREASE_FACTOR", "0.5")
    assert OperatorSettings().budget.decrease_factor == 0.5


def test_check_mode(tmp_path: Path) -> None:
    out = tmp_path / "api.md"
    assert apidocs.main(["--out", str(out), "--check"]) == 1
    assert apidocs.main(["--out", str(out)]) == 0
    assert apidocs.main(["--out", str(out), "--check"]) == 0
