"""MMLU 5-shot prompts as prefix-heavy offline work (Hendrycks et al., ICLR 2021; MIT).

Each test question becomes the standard 5-shot prompt: a subject header,
the subject's five dev exemplars with their answers, then the question. All
questions of a subject therefore share a long prefix (the header and the
exemplars). Prompts are tokenized with the proxy tokenizer
(:mod:`slipstream_cli.workloads.tokenize`) and cut into chained 16-token
block hashes, so the shared prefix is real at the engine's block granularity.

The answer is one letter, so requests generate ``output_tokens`` (default 1)
tokens. Requests are queued at t = 0 in a seeded random order, as a batch
file that mixes subjects would be; PSM's job is to regroup them.

Deliberately left out: chain-of-thought prompting and answer checking.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Sequence
from pathlib import Path

from slipstream_cli.workloads import WorkloadError, data_path
from slipstream_cli.workloads.tokenize import tokenize
from slipstream_scheduler.sim.workload import SimRequest, chain_block_hashes, extend_block_hashes
from slipstream_scheduler.types import RequestClass

LETTERS = "ABCD"


def _rows(path: Path) -> list[list[str]]:
    with path.open(encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    if not rows or rows[0][:2] != ["question", "choice0"]:
        raise WorkloadError("unexpected MMLU header", path)
    return rows[1:]


def _format(row: Sequence[str], with_answer: bool) -> str:
    q, *choices, answer = row
    text = q + "".join(f"\n{LETTERS[i]}. {c}" for i, c in enumerate(choices)) + "\nAnswer:"
    if with_answer:
        text += f" {LETTERS[int(answer)]}\n\n"
    return text


def shared_prefix(subject: str, dev_rows: Sequence[Sequence[str]]) -> str:
    """The part of a subject's 5-shot prompt shared by all its questions (ends in a blank line)."""
    header = (
        "The following are multiple choice questions (with answers) about "
        f"{subject.replace('_', ' ')}.\n\n"
    )
    return header + "".join(_format(d, True) for d in dev_rows[:5])


def five_shot_prompt(subject: str, dev_rows: Sequence[Sequence[str]], row: Sequence[str]) -> str:
    """The standard MMLU 5-shot prompt for one test ``row``."""
    return shared_prefix(subject, dev_rows) + _format(row, False)


def load(
    root: Path | str | None = None,
    *,
    subjects: Sequence[str] | None = None,
    per_subject: int | None = None,
    output_tokens: int = 1,
    seed: int = 0,
    prefix: str = "mmlu",
) -> tuple[SimRequest, ...]:
    """Offline requests for MMLU test questions (default: all 57 subjects, all questions)."""
    base = Path(root) if root is not None else data_path("mmlu")
    test_dir, dev_dir = base / "test", base / "dev"
    names = sorted(p.name[: -len("_test.csv")] for p in test_dir.glob("*_test.csv"))
    if subjects is not None:
        names = [s for s in names if s in set(subjects)]
    if not names:
        raise WorkloadError("no MMLU subjects found", test_dir)
    prompts: list[tuple[str, list[int], tuple[int, ...]]] = []
    for subject in names:
        dev = _rows(dev_dir / f"{subject}_dev.csv")
        test = _rows(test_dir / f"{subject}_test.csv")
        # The shared prefix ends in whitespace and a question starts with a
        # non-space, so tokenizing the parts separately equals tokenizing the
        # whole prompt (see tokenize()); the prefix is tokenized once.
        head = tokenize(shared_prefix(subject, dev))
        head_hashes = chain_block_hashes(head)
        for i, row in enumerate(test[:per_subject]):
            prompts.append(
                (f"{prefix}-{subject}-{i}", head + tokenize(_format(row, False)), head_hashes)
            )
    random.Random(seed).shuffle(prompts)
    out: list[SimRequest] = []
    for rid, ids, head_hashes in prompts:
        out.append(
            SimRequest(
                request_id=rid,
                cls=RequestClass.OFFLINE,
                arrival_s=0.0,
                prompt_tokens=len(ids),
                output_tokens=output_tokens,
                block_hashes=extend_block_hashes(head_hashes, ids),
                group=subject_of(rid, prefix),
            )
        )
    return tuple(out)


def subject_of(request_id: str, prefix: str = "mmlu") -> str:
    """The subject encoded in a request id made by :func:`load`."""
    return request_id[len(prefix) + 1 :].rsplit("-", 1)[0]
