"""Real workloads for the simulator and benchmarks, read from the shared data folder.

Each module turns one dataset into :class:`slipstream_scheduler.sim.workload.SimRequest`
values: Azure LLM 2023 traces (``azure``), Mooncake traces (``mooncake``),
arXiv-summarisation lengths (``arxiv``), MMLU 5-shot prompts (``mmlu``).
AlpacaEval prompts with real outputs live in ``alpaca_eval`` (another owner).
``tokenize`` is the deterministic proxy tokenizer that gives text prompts
token ids, so prompts that share text share prefix blocks.

Data is never copied into the repository: it is read from ``$SLIPSTREAM_DATA``
(default ``<repo>/../shared/data``). Deliberately left out: downloading
anything, and caching parsed files.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

DATA_ENV = "SLIPSTREAM_DATA"


class WorkloadError(Exception):
    """A dataset is missing or malformed. Carries the offending ``path``."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message if path is None else f"{path}: {message}")
        self.path = path


def data_root() -> Path:
    """The shared data folder: ``$SLIPSTREAM_DATA`` or ``<repo>/../shared/data``."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[3]
    return repo.parent / "shared" / "data"


def data_path(relative: str) -> Path:
    """Path of a file under :func:`data_root`; raises if it does not exist."""
    path = data_root() / relative
    if not path.exists():
        raise WorkloadError(f"not found (set ${DATA_ENV} to the shared data folder)", path)
    return path


def stable_salt(prefix: str, n: int) -> int:
    """An int key for request ``n`` of a source; stable across processes (unlike ``hash(str)``)."""
    return zlib.crc32(prefix.encode()) * 1_000_003 + n
