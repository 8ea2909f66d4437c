"""The sidecar's and the engine's command lines: a bad flag value is a usage error (exit 2,
one error line); the sidecar's ready line says what ``/ready`` answers."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from slipstream_scheduler.ordering import ORDERINGS


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slipstream_cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("sidecar", "--ordering", "bogus"), "--ordering"),
        (("sidecar", "--online-prompt-tokens", "sometimes"), "--online-prompt-tokens"),
        (("engine", "--gpu", "z80"), "--gpu"),
    ],
)
def test_a_bad_flag_value_is_a_usage_error(argv: tuple[str, ...], flag: str) -> None:
    out = _cli(*argv)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"argument {flag}: invalid choice" in errors[0]


def test_ordering_help_lists_every_accepted_value() -> None:
    out = _cli("sidecar", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    help_line = text[text.index("--ordering {") :]
    for name in ORDERINGS:
        assert name in help_line.split("--budget-s")[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


@pytest.mark.parametrize("engine_up", [True, False])
def test_the_ready_line_tells_what_ready_answers(engine_up: bool, tmp_path: Path) -> None:
    eport, hport, gport = _free_port(), _free_port(), _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if engine_up:
            eng = subprocess.Popen(
                [sys.executable, "-m", "slipstream_cli.main", "engine", "--port", str(eport)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            procs.append(eng)
            assert eng.stdout is not None
            assert b"listening" in eng.stdout.readline()
        err_path = tmp_path / "sidecar.err"
        with err_path.open("wb") as err:
            sc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "slipstream_cli.main",
                    "sidecar",
                    "--engine",
                    f"http://127.0.0.1:{eport}",
                    "--http-port",
                    str(hport),
                    "--grpc-port",
                    str(gport),
                ],
                stdout=subprocess.PIPE,
                stderr=err,
            )
        procs.append(sc)
        assert sc.stdout is not None
        line = sc.stdout.readline().decode()
        status = _ready_status(f"http://127.0.0.1:{hport}")
        if engine_up:
            assert line.startswith("sidecar ready ") and status == 200
        else:
            assert line.startswith("sidecar serving ") and "not ready" in line and status == 503
        assert f"engine=http://127.0.0.1:{eport}" in line
        # Serving is not a warning (a missing token file, say, is).
        assert b"sidecar serving" not in err_path.read_bytes()
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
            if p.stdout is not None:
                p.stdout.close()
