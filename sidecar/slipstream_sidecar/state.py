"""Durable sidecar state in ``--state-dir``: the configuration in force and assigned shards.

Each document is one JSON file replaced atomically (write a temporary file,
fsync, rename, fsync the directory), so a ``kill -9`` leaves either the old or
the new version. A restarted sidecar reloads both: it applies the last
configuration (so an older ``Configure`` generation is still ignored) and
resumes every shard that had not ended.

Deliberately left out: shard progress (that lives in the shard's own output
and error logs, which are the source of truth) and online requests (a client
whose connection dropped retries on its own).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class StateDir:
    """Reads and writes the sidecar's JSON documents; a no-op without a directory."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)

    def load(self, name: str) -> Any:
        if self.root is None:
            return None
        path = self.root / f"{name}.json"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None

    def save(self, name: str, doc: Any) -> None:
        if self.root is None:
            return
        path = self.root / f"{name}.json"
        tmp = path.with_suffix(".json.tmp")
        data = json.dumps(doc, indent=1, sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
