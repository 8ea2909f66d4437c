"""The Containerfile builds an image the chart can run.

No container runtime is assumed on the test host, so the test checks what the
build depends on: a wheel built (offline, no dependencies) from exactly the
paths the Containerfile copies holds every package and data file the operator
and the sidecar load, and the image's entry point, user and extras match what
the chart and the operator expect of it.
"""

from __future__ import annotations

import email.parser
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "Containerfile"


def instructions(path: Path = CONTAINERFILE) -> list[tuple[str, str]]:
    """(instruction, arguments) of each line of a recipe, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def build_copies() -> list[str]:
    """Sources of the build stage's COPY lines (relative to the build context)."""
    sources: list[str] = []
    for op, rest in instructions():
        if op == "COPY" and not rest.startswith("--from"):
            sources += rest.split()[:-1]
    return sources


def test_the_copied_paths_build_a_wheel_with_everything_the_image_runs(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    sources = build_copies()
    assert {"pyproject.toml", "scheduler", "sidecar", "operator", "testbed", "cli"} <= set(sources)
    for src in sources:
        path = REPO / src
        assert path.exists(), f"Containerfile copies {src}, which is not in the repository"
        if path.is_dir():
            shutil.copytree(path, context / src, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            (context / src).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, context / src)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--wheel-dir", str(wheels), str(context)],
        check=True, cwd=tmp_path, timeout=600,
    )
    (wheel,) = wheels.glob("slipstream-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
        entry = zf.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    # What the operator and the sidecar load at run time, beyond the code itself.
    profiles = REPO / "scheduler/slipstream_scheduler/engine/profiles"
    for f in profiles.glob("*.json"):
        assert f"slipstream_scheduler/engine/profiles/{f.name}" in names
    for pkg in ("slipstream_scheduler", "slipstream_sidecar", "slipstream_operator",
                "slipstream_testbed", "slipstream_cli"):
        assert f"{pkg}/__init__.py" in names
        assert f"{pkg}/py.typed" in names
    assert "slipstream_sidecar/proto/sidecar_pb2.py" in names
    assert "slipstream_sidecar/proto/sidecar_pb2_grpc.py" in names
    # The extras the image installs exist, and the entry point is the command.
    extras = set(meta.get_all("Provides-Extra") or [])
    install = next(rest for op, rest in instructions()
                   if op == "RUN" and "--find-links" in rest and "slipstream[" in rest)
    found = re.search(r"slipstream\[([a-z0-9,]+)\]", install)
    assert found is not None, install
    wanted = set(found.group(1).split(","))
    assert wanted <= extras, (wanted, extras)
    assert "semantic" not in wanted  # torch stays out of the image
    # Every package comes from the lock, hash-checked, and nothing else is fetched.
    assert "locks/image.txt" in sources
    download = next(rest for op, rest in instructions() if op == "RUN" and "pip download" in rest)
    assert "--require-hashes" in download and "-r locks/image.txt" in download
    assert "--no-index" in install
    assert re.search(r"^slipstream\s*=\s*slipstream_cli\.main:main$", entry, re.M), entry


def test_entry_point_and_user_match_the_chart_and_the_operator() -> None:
    ops = dict(instructions())
    assert json.loads(ops["ENTRYPOINT"]) == ["slipstream"]
    user = ops["USER"].split(":")[0]
    deployment = (REPO / "charts/slipstream/templates/deployment.yaml").read_text()
    assert f"runAsUser: {user}" in deployment
    # The chart runs `slipstream operator ...`; the operator gives each vLLM pod a
    # sidecar container with args ["sidecar"]. Both subcommands exist.
    exe = Path(sys.executable).with_name("slipstream")
    for sub in ("operator", "sidecar"):
        out = subprocess.run([str(exe), sub, "--help"], capture_output=True, text=True,
                             timeout=120, check=False)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "usage" in out.stdout.lower()


def test_the_image_carries_the_compiled_front_on_path() -> None:
    # Built from the front's own sources in a Go stage (nothing downloaded), copied to a
    # directory on PATH, where every sidecar finds it (front.find_binary).
    stages = [rest for op, rest in instructions() if op == "FROM"]
    assert any(rest.startswith("golang:") and rest.endswith(" AS front") for rest in stages)
    copies = [rest for op, rest in instructions() if op == "COPY"]
    assert "sidecar/front ./" in copies
    assert "--from=front /out/slipstream-front /usr/local/bin/slipstream-front" in copies
    build = next(rest for op, rest in instructions() if op == "RUN" and "go build" in rest)
    assert "GOPROXY=off" in build and "GOTOOLCHAIN=local" in build
    assert "-o /out/slipstream-front" in build
