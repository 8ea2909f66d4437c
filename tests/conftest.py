"""Shared pytest configuration.

Fixtures that start real things (the local cluster) live in ``tests/fixtures``
as plugins; the data directory is the real ``../shared/data`` beside the repo.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The cluster fixtures are a plugin module; listed only once it exists so the
# other tiers run on a checkout without it.
_HAS_CLUSTER_FIXTURES = (Path(__file__).parent / "fixtures" / "cluster.py").exists()
pytest_plugins = ["fixtures.cluster"] if _HAS_CLUSTER_FIXTURES else []

REPO_ROOT = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    """The shared real-data folder (``SLIPSTREAM_DATA`` or ``<repo>/../shared/data``)."""
    return Path(os.environ.get("SLIPSTREAM_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = data_dir()
    if not path.is_dir():
        pytest.fail(
            f"real data folder {path} is missing: set SLIPSTREAM_DATA or check out ../shared"
        )
    return path


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def front_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sidecar's compiled front (``sidecar/front``), built once per session with the
    local go toolchain (standard library only; a cold build cache takes about 25 s)."""
    from slipstream_testbed.gobuild import build_front

    return build_front(tmp_path_factory.mktemp("front"))
