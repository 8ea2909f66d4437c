"""Print the staging modules that k8s.io/kubernetes' go.mod maps to ./staging, one per line.

Used by build.sh to generate the wrapper module's `replace` lines from kubernetes' own go.mod
(instead of a hand-copied list). Leaves out everything else in go.mod.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_REPLACE_STAGING = re.compile(r"^\s*(?:replace\s+)?(k8s\.io/[A-Za-z0-9._-]+)\s+=>\s+\./staging/")
_REQUIRE_V000 = re.compile(r"^\s*(?:require\s+)?(k8s\.io/[A-Za-z0-9._-]+)\s+v0\.0\.0(?:\s|$)")


def staging_modules(go_mod_text: str) -> list[str]:
    """Modules kubernetes requires at v0.0.0 or replaces with a ./staging directory."""
    found: set[str] = set()
    for line in go_mod_text.splitlines():
        for pattern in (_REPLACE_STAGING, _REQUIRE_V000):
            match = pattern.match(line)
            if match:
                found.add(match.group(1))
    return sorted(found)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} PATH/TO/kubernetes/go.mod", file=sys.stderr)
        return 2
    modules = staging_modules(Path(argv[1]).read_text(encoding="utf-8"))
    if not modules:
        print(f"no staging modules found in {argv[1]}", file=sys.stderr)
        return 1
    print("\n".join(modules))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
