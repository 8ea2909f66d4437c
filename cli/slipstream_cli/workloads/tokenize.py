"""A deterministic proxy tokenizer: text to token ids without a model vocabulary.

The simulator needs token *ids* only so that prompts sharing text share
prefix blocks (prefix caching, PSM), and token *counts* of roughly the right
size. This splits text into words, numbers, punctuation and whitespace runs,
cuts long pieces into 4-character pieces (about what a BPE vocabulary does
for rare words) and maps each piece to an id with a stable hash. Counts come
out near 1.3 tokens per English word, close to Llama-2's tokenizer.

Deliberately left out: a real vocabulary, special tokens, and any claim that
the ids match a model's. Python's ``hash`` of ``str`` is salted per process,
so ids come from ``zlib.crc32`` instead.
"""

from __future__ import annotations

import re
import zlib
from functools import lru_cache

VOCAB = 32_000
_PIECE = re.compile(r"\s+|[A-Za-z]+|\d|[^\sA-Za-z\d]")
_MAX_PIECE = 4


@lru_cache(maxsize=1 << 16)
def _piece_id(piece: str) -> int:
    return zlib.crc32(piece.encode()) % VOCAB


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``; texts equal up to a word boundary share their id prefix.

    ``tokenize(a + b) == tokenize(a) + tokenize(b)`` whenever ``a`` ends in
    whitespace and ``b`` starts with a non-space character.
    """
    ids: list[int] = []
    for piece in _PIECE.findall(text):
        if piece[0].isspace():
            # A whitespace run joins the next token in BPE vocabularies; keep
            # single spaces free and count newlines.
            if "\n" in piece:
                ids.append(_piece_id(piece))
            continue
        for i in range(0, len(piece), _MAX_PIECE):
            ids.append(_piece_id(piece[i : i + _MAX_PIECE]))
    return ids


def count_tokens(text: str) -> int:
    """Number of proxy tokens in ``text``."""
    return len(tokenize(text))
