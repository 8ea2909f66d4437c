"""The engine-mode vLLM image's recipe (Containerfile.vllm), checked without a container runtime.

The image is the official vLLM image of the version the suite tests, with the plugin installed
into vLLM's own Python with --no-deps. So what can break it is checked here: the base image's
version, that every third-party package the plugin imports is either vLLM's own or locked in
locks/vllm-plugin.txt (and installed, hash-checked), that the copied paths exist, that nothing
is fetched unlocked, and that ``make images`` and the build context use the recipe.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from integration.test_containerfile import instructions

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "Containerfile.vllm"
LOCK = REPO / "locks" / "vllm-plugin.txt"
# The plugin's entry points: what `--scheduler-cls` loads, and the package itself.
ENTRY = ("slipstream_vllm.scheduler", "slipstream_vllm")
FIRST_PARTY = {"slipstream_vllm": REPO / "sidecar", "slipstream_scheduler": REPO / "scheduler"}
# What the official vLLM image brings and the plugin may use as it is there.
VLLM_BRINGS = {"vllm", "torch", "numpy", "pydantic"}


def pinned_vllm_version() -> str:
    found = re.search(r"^VLLM_VERSION=(\S+)", (REPO / "hack/lock/pins.sh").read_text(), re.M)
    assert found is not None
    return found.group(1)


def module_path(name: str) -> Path | None:
    parts = name.split(".")
    base = FIRST_PARTY[parts[0]].joinpath(*parts)
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None  # a name imported from a module (``from m import f``), not a module


def third_party_imports(entry: tuple[str, ...]) -> dict[str, str]:
    """{top-level package: a module importing it} over every first-party module reachable from
    ``entry`` (imports inside functions included: they run in the engine too)."""
    seen: set[str] = set()
    found: dict[str, str] = {}
    todo = list(entry)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        path = module_path(mod)
        if path is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for name in names:
                top = name.split(".")[0]
                if top in FIRST_PARTY:
                    todo.append(name)
                elif top not in sys.stdlib_module_names:
                    found.setdefault(top, mod)
    assert "slipstream_vllm.scheduler" in seen
    return found


def locked_packages() -> set[str]:
    return {m.group(1).lower().replace("_", "-")
            for m in re.finditer(r"^([A-Za-z0-9_.\-]+)==\S+", LOCK.read_text(), re.M)}


def test_the_base_image_is_the_vllm_version_the_suite_tests() -> None:
    version = pinned_vllm_version()
    ops = instructions(RECIPE)
    assert ops[0] == ("ARG", f"VLLM_IMAGE=vllm/vllm-openai:v{version}"), ops[0]
    assert ops[1] == ("FROM", "${VLLM_IMAGE}"), ops[1]
    assert f"vllm=={version}" in (REPO / "locks/vllm-official.txt").read_text()
    makefile = (REPO / "Makefile").read_text()
    assert "-f Containerfile.vllm --build-arg VLLM_IMAGE=vllm/vllm-openai:v$(VLLM_IMAGE_VERSION)" \
        in makefile
    assert "VLLM_IMAGE_VERSION := $(shell sed -n 's/^VLLM_VERSION=//p' hack/lock/pins.sh)" \
        in makefile


def test_everything_the_plugin_imports_is_vllms_own_or_locked_and_installed() -> None:
    imports = third_party_imports(ENTRY)
    locked = locked_packages()
    missing = {pkg: mod for pkg, mod in imports.items()
               if pkg not in VLLM_BRINGS and pkg.replace("_", "-") not in locked}
    assert not missing, f"imported by the plugin, neither vLLM's nor in {LOCK.name}: {missing}"
    # The lock is what the vllm-plugin extra names beyond vLLM's packages, plus build tools.
    assert "sortedcontainers" in imports and "sortedcontainers" in locked
    install = " ".join(next(rest for op, rest in instructions(RECIPE)
                            if op == "RUN" and "vllm-plugin.txt" in rest).split())
    assert "--require-hashes --no-deps -r /tmp/slipstream/locks/vllm-plugin.txt" in install
    assert {"setuptools", "wheel"} <= locked  # the plugin's own install fetches nothing


def test_the_plugin_installs_without_touching_vllms_packages_and_is_imported() -> None:
    (run,) = [" ".join(rest.split()) for op, rest in instructions(RECIPE) if op == "RUN"]
    steps = [s.strip() for s in run.split("&&")]
    project = next(s for s in steps if s.endswith(" /tmp/slipstream"))
    assert "--no-deps" in project and "--no-build-isolation" in project, project
    assert steps[-1] == 'python3 -c "import slipstream_vllm.scheduler"', steps


def test_every_copied_path_exists_and_the_context_leaves_the_environments_out() -> None:
    copies = [rest.split() for op, rest in instructions(RECIPE) if op == "COPY"]
    sources = [src for parts in copies for src in parts[:-1]]
    assert {"locks/vllm-plugin.txt", "pyproject.toml", "scheduler", "sidecar"} <= set(sources)
    for src in sources:
        assert (REPO / src).exists(), f"Containerfile.vllm copies {src}, not in the repository"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".venv-*", ".git"} <= set(ignored)
    assert not any(src.startswith(".venv") for src in sources)
