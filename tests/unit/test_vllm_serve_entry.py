"""``python -m slipstream_vllm.serve``: the AMX tile permission its processes ask for.

vLLM's CPU attention runs AMX kernels where the CPU has AMX, and Linux kills a process that
touches tile data without having asked (``arch_prctl(ARCH_REQ_XCOMP_PERM)``). The check runs in
a fresh process, as each of vLLM's spawned processes is, and reads the kernel's answer back.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream_vllm.serve import allow_amx_tiles

pytestmark = pytest.mark.unit

PROBE = """
import ctypes
from slipstream_vllm.serve import SYS_ARCH_PRCTL, allow_amx_tiles
ARCH_GET_XCOMP_PERM = 0x1022
libc = ctypes.CDLL(None, use_errno=True)
mask = ctypes.c_ulong(0)
assert libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0
before = bool(mask.value >> 18 & 1)
granted = allow_amx_tiles()
assert libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0
print(before, granted, bool(mask.value >> 18 & 1))
"""


def test_a_process_holds_the_amx_tile_permission_exactly_where_the_cpu_has_amx() -> None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        # AMX is an x86-64 feature and the permission a Linux one: elsewhere nothing is asked.
        assert allow_amx_tiles() is False
        return
    has_amx = " amx_tile" in Path("/proc/cpuinfo").read_text()
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    # A fresh process starts without it; it holds it after the call iff the CPU has AMX.
    assert out == ["False", str(has_amx), str(has_amx)]
