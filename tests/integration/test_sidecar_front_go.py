"""The compiled front's own Go tests (``sidecar/front/*_test.go``) and ``go vet``.

They check the token counting rule against ``sse.py``'s, the priority splice
and the control frames over a real Unix socket pair.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from slipstream_testbed.gobuild import FRONT_SRC

# A cold Go build cache compiles net/http first: about 25 s on an idle 2-core host.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

_ENV = dict(os.environ, GOPROXY="off", GOTOOLCHAIN="local", CGO_ENABLED="0")


@pytest.mark.parametrize("command", [["go", "vet", "./..."], ["go", "test", "./..."]])
def test_the_front_passes_its_go_checks(command: list[str]) -> None:
    proc = subprocess.run(
        command, check=False, cwd=FRONT_SRC, env=_ENV, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
