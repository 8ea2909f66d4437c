"""Building the project's small Go programs with the local toolchain.

``sidecar/front`` (the sidecar's compiled front, ``slipstream-front``) and
``hack/refproxy`` (the bench's reference hop) use Go's standard library only,
so a build needs no module download: it runs with ``GOPROXY=off`` and the
toolchain on ``PATH`` (``GOTOOLCHAIN=local``).

Deliberately left out: cross-compiling and caching beyond Go's own build cache.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FRONT_SRC = REPO_ROOT / "sidecar" / "front"
REFPROXY_SRC = REPO_ROOT / "hack" / "refproxy"


def go_build(src: Path, out: Path) -> Path:
    """Build the Go main package in ``src`` into the executable ``out``; a clear error
    when ``go`` is missing or the build fails."""
    env = dict(os.environ, GOPROXY="off", GOTOOLCHAIN="local", CGO_ENABLED="0")
    try:
        subprocess.run(
            ["go", "build", "-trimpath", "-o", str(out.resolve()), "."],
            cwd=src,
            env=env,
            check=True,
            capture_output=True,
        )
    except FileNotFoundError as exc:
        raise RuntimeError(f"building {src} needs the go toolchain on PATH") from exc
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"building {src} failed: {exc.stderr.decode()[-2000:]}") from exc
    return out


def build_front(into: Path) -> Path:
    """``slipstream-front`` built into the directory ``into``."""
    return go_build(FRONT_SRC, into / "slipstream-front")
