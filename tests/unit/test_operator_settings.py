"""Operator process wiring: settings, loopback-only dialling, profile lookup, kopf settings."""

from __future__ import annotations

import argparse
from pathlib import Path

import kopf
import pytest

from slipstream_operator.__main__ import add_arguments, settings_from_args
from slipstream_operator.handlers import FINALIZER, configure_kopf
from slipstream_operator.kube import dialable
from slipstream_operator.profiles import find_profile, slugs
from slipstream_operator.settings import OperatorSettings

pytestmark = pytest.mark.unit


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_RECONCILE_INTERVAL_S", "7")
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_BUDGET__DECREASE_FACTOR", "0.5")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["-n", "a", "-n", "b", "--loopback-only", "--window", "30"])
    settings = settings_from_args(args)
    assert settings.namespaces == ["a", "b"] and settings.loopback_only
    assert settings.window_s == 30.0 and settings.reconcile_interval_s == 7.0
    assert settings.budget.decrease_factor == 0.5
    assert OperatorSettings().loopback_only is False


@pytest.mark.parametrize(
    ("ip", "loopback_only", "ok"),
    [("127.1.0.1", True, True), ("192.0.2.5", True, False), ("192.0.2.5", False, True),
     ("not-an-ip", False, False)],
)
def test_loopback_only_never_dials_other_addresses(ip: str, loopback_only: bool, ok: bool) -> None:
    # A predicate only: nothing is dialled (192.0.2.0/24 is the RFC 5737 documentation range).
    assert dialable(ip, loopback_only) is ok


def test_profile_slugs_and_lookup(tmp_path: Path) -> None:
    assert slugs("meta-llama/Llama-2-7b-hf") == ["llama-2-7b-hf", "meta-llama--llama-2-7b-hf",
                                                  "llama-2-7b"]
    shipped = find_profile("meta-llama/Llama-2-7b-hf", "H100")
    assert shipped is not None and shipped.name == "shipped:latency_llama-2-7b_h100.json"
    assert find_profile("no-such-model", "h100") is None
    (tmp_path / "latency_llama-2-7b_h100.json").write_text(shipped.model.to_json())
    user = find_profile("llama-2-7b", "h100", tmp_path)
    assert user is not None and user.name.startswith("user:")
    (tmp_path / "latency_broken_h100.json").write_text("{not json")
    assert find_profile("broken", "h100", tmp_path) is None


def test_kopf_uses_our_finalizer_and_annotation_prefix() -> None:
    settings = kopf.OperatorSettings()
    configure_kopf(settings)
    assert settings.persistence.finalizer == FINALIZER == "slipstream.dev/finalizer"
    progress = settings.persistence.progress_storage
    assert isinstance(progress, kopf.AnnotationsProgressStorage)
    assert progress.prefix == "slipstream.dev"


def test_storage_roots_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from_args(parser.parse_args([])).storage_roots == []
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_STORAGE_ROOTS", '["s3://batch"]')
    assert settings_from_args(parser.parse_args([])).storage_roots == ["s3://batch"]
    args = parser.parse_args(["--storage-root", "file:///a", "--storage-root", "s3://b",
                              "--prometheus-timeout", "1.5"])
    settings = settings_from_args(args)
    assert settings.storage_roots == ["file:///a", "s3://b"]
    assert settings.prometheus_timeout_s == 1.5


@pytest.mark.parametrize("clusterwide", [True, False])
def test_kopf_scanning_is_off_only_in_namespaced_mode(clusterwide: bool) -> None:
    settings = kopf.OperatorSettings()
    configure_kopf(settings, clusterwide=clusterwide)
    assert settings.scanning.disabled is (not clusterwide)


def test_preempt_after_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from_args(parser.parse_args([])).preempt_after_s == 30.0
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_PREEMPT_AFTER_S", "5")
    assert settings_from_args(parser.parse_args([])).preempt_after_s == 5.0
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_PREEMPT_AFTER_S", "-1")
    with pytest.raises(ValueError, match="preempt_after_s"):
        settings_from_args(parser.parse_args([]))
