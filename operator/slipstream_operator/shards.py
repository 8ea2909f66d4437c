"""OfflineJob input planning and output merging, streaming and in bounded memory.

**Planning.** The input (OpenAI Batch API JSONL) is read once, line by line.
Each valid line gets a *prefix key*: the first ``prefix_chars`` characters of
its prompt (the concatenated message contents, or ``prompt``). Lines are then
put in PSM order — sorted by prefix key, input order breaking ties — which is
the depth-first order of a trie over the prompts, so requests that share a
prefix are adjacent. The sort is an external merge sort: runs of at most
``run_lines`` lines are sorted in memory and spilled to temporary files, then
merged with a heap, so memory is bounded by ``run_lines`` lines plus one
record per run, whatever the input size. The ordered lines are written to a
*staged* input file; shards are line ranges ``[start, end)`` of it, cut at a
prefix-group boundary once they reach ``shard_size`` lines (or hard-cut at
``2 x shard_size`` inside a very large group). Each shard carries an
``affinity`` (hash of its first prefix) so the placement can keep a group's
shards on one pod, where the engine's prefix cache already holds the prefix.

Lines that are not JSON objects with a string ``custom_id`` and an object
``body`` cannot be ordered or routed; they become error records at planning
time (OpenAI Batch error shape, ``custom_id`` from the line when present,
else ``line-<n>``). They are not fatal. Request-level problems (wrong model,
engine errors) are the sidecar's to report, per shard.

**Layout on shared storage** (next to the job output, so every pod and the
operator see the same files)::

    <output>.slipstream/
        plan.json                 shards, counts, input fingerprint
        input.psm.jsonl           staged input in PSM order
        plan.errors.jsonl         error records of unreadable lines
        shards/<id>.out.jsonl     per-shard output log (append-only, by custom_id)
        shards/<id>.err.jsonl     per-shard error log

A shard keeps its output URIs when it moves to another pod; the sidecar skips
custom_ids already present in them, so a moved shard resumes where it stopped.

**Merging.** Shard logs are read in shard order, deduplicated by custom_id
within each shard (each custom_id belongs to exactly one shard, so per-shard
sets bound the memory), a success beating an error for the same id; the
result is written to temporary files next to the targets and renamed into
place atomically, or, for an object-store output, written in the work folder
and uploaded whole (:mod:`slipstream_operator.staging`, which also says where
such a job's work folder lives). Counts are exact or the merge refuses
(:class:`OutputError`).

Deliberately left out: object stores for the work folder itself (it is on a
shared file system; inputs and outputs may be any fsspec URI), and detecting
duplicate custom_ids across shards (OpenAI requires them unique; a duplicate
is counted twice).
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import io
import json
import logging
import os
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

from slipstream_operator.errors import InputError, OutputError
from slipstream_operator.staging import MergeTarget, local_path, work_dir_for

logger = logging.getLogger(__name__)

PLAN_VERSION = 1
_REC = struct.Struct(">IQI")  # key length, input line number, line length


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """One shard: lines ``[start, end)`` of the staged input."""

    shard_id: str
    start: int
    end: int
    affinity: str

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Plan:
    """A planned job: where the staged input is and how it is cut."""

    staged_uri: str
    work_dir: str
    total: int  # lines in the input, bad ones included
    valid: int
    bad: int
    shards: tuple[ShardPlan, ...]
    input_fingerprint: str

    def shard_output_uri(self, shard_id: str) -> str:
        return f"file://{self.work_dir}/shards/{shard_id}.out.jsonl"

    def shard_error_uri(self, shard_id: str) -> str:
        return f"file://{self.work_dir}/shards/{shard_id}.err.jsonl"

    @property
    def plan_errors_path(self) -> str:
        return f"{self.work_dir}/plan.errors.jsonl"

    def to_json(self) -> str:
        doc = asdict(self)
        doc["version"] = PLAN_VERSION
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        doc = json.loads(text)
        if doc.pop("version", None) != PLAN_VERSION:
            raise ValueError("unsupported plan version")
        doc["shards"] = tuple(ShardPlan(**s) for s in doc["shards"])
        return cls(**doc)


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt of a request body: ``prompt``, or the message contents joined."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "".join(p for p in prompt if isinstance(p, str))
    parts: list[str] = []
    for message in body.get("messages") or ():
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(f"{message.get('role', '')}:{content}\n")
        elif isinstance(content, list):
            parts.extend(
                c.get("text", "")
                for c in content
                if isinstance(c, dict) and c.get("type") == "text"
            )
    return "".join(parts)


def prefix_key(body: dict[str, Any], prefix_chars: int) -> bytes:
    """The PSM sort key of a request: the UTF-8 bytes of its first ``prefix_chars`` characters."""
    return prompt_text(body)[:prefix_chars].encode("utf-8", "surrogatepass")


def error_record(custom_id: str, code: str, message: str) -> str:
    """One OpenAI Batch error-file line."""
    return json.dumps(
        {
            "id": f"batch_req_{hashlib.blake2b(custom_id.encode(), digest_size=12).hexdigest()}",
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
    )


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Planning knobs: shard size (lines), prefix length (characters), sort memory (lines per
    run) and merge fan-in (runs open at once)."""

    shard_size: int = 256
    prefix_chars: int = 256
    run_lines: int = 20_000
    merge_fan_in: int = 32


def _fingerprint(stream_size: int, first: bytes) -> str:
    return f"{stream_size}:{hashlib.blake2b(first, digest_size=8).hexdigest()}"


def _open_input(uri: str) -> IO[bytes]:
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        try:
            return open(local_path(uri), "rb")
        except OSError as exc:
            raise InputError(f"cannot open input: {exc.strerror}", uri=uri) from exc
    try:
        import fsspec

        return fsspec.open(uri, "rb").open()  # type: ignore[no-any-return]
    except (ImportError, OSError, ValueError) as exc:
        raise InputError(f"cannot open input: {exc}", uri=uri) from exc


def _write_run(records: list[tuple[bytes, int, bytes]], directory: Path) -> Path:
    records.sort(key=lambda r: (r[0], r[1]))
    fd, name = tempfile.mkstemp(prefix="run-", suffix=".bin", dir=directory)
    pack = _REC.pack
    with os.fdopen(fd, "wb", buffering=1 << 16) as out:
        out.writelines(
            pack(len(key), line_no, len(line)) + key + line for key, line_no, line in records
        )
    records.clear()
    return Path(name)


def _read_run(path: Path) -> Iterator[tuple[bytes, int, bytes]]:
    with open(path, "rb", buffering=1 << 14) as f:
        while True:
            head = f.read(_REC.size)
            if not head:
                return
            key_len, line_no, line_len = _REC.unpack(head)
            data = f.read(key_len + line_len)
            yield data[:key_len], line_no, data[key_len:]


def plan_input(input_uri: str, output_uri: str, job_id: str, options: PlanOptions, *,
               work_dir: Path | None = None) -> Plan:
    """Stage the input in PSM order and cut it into shards; writes ``plan.json`` last.

    The work folder is ``work_dir``, or ``<output>.slipstream`` for a ``file://``
    output (:mod:`slipstream_operator.staging`). Idempotent: when ``plan.json``
    exists for the same input fingerprint it is returned as is (an operator
    restart does not re-plan and move shards).
    """
    work = work_dir if work_dir is not None else work_dir_for(output_uri)
    work.mkdir(parents=True, exist_ok=True)
    (work / "shards").mkdir(exist_ok=True)
    manifest = work / "plan.json"
    with _open_input(input_uri) as probe:
        first = probe.read(65536)
        probe.seek(0, io.SEEK_END)
        size = probe.tell()
    fingerprint = _fingerprint(size, first)
    if manifest.exists():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            existing = Plan.from_json(manifest.read_text())
            if existing.input_fingerprint == fingerprint:
                return existing
    runs: list[Path] = []
    total = bad = 0
    records: list[tuple[bytes, int, bytes]] = []
    errors_tmp = work / "plan.errors.jsonl.tmp"
    with (
        tempfile.TemporaryDirectory(prefix="plan-", dir=work) as tmp,
        _open_input(input_uri) as src,
        open(errors_tmp, "w", encoding="utf-8") as errors,
    ):
        tmp_dir = Path(tmp)
        for line_no, raw in enumerate(src):
            total += 1
            line = raw.rstrip(b"\r\n")
            if not line.strip():
                bad += 1
                errors.write(
                    error_record(f"line-{line_no + 1}", "invalid_json", "empty line") + "\n"
                )
                continue
            key, err = _key_of(line, line_no, options.prefix_chars)
            if key is None:
                bad += 1
                errors.write((err or "") + "\n")
                continue
            records.append((key, line_no, line))
            if len(records) >= options.run_lines:
                runs.append(_write_run(records, tmp_dir))
        if records:
            runs.append(_write_run(records, tmp_dir))
        runs = _reduce_runs(runs, tmp_dir, max(2, options.merge_fan_in))
        shards = _stage(runs, work / "input.psm.jsonl.tmp", job_id, options)
    os.replace(work / "input.psm.jsonl.tmp", work / "input.psm.jsonl")
    os.replace(errors_tmp, work / "plan.errors.jsonl")
    plan = Plan(
        staged_uri=f"file://{work}/input.psm.jsonl",
        work_dir=str(work),
        total=total,
        valid=total - bad,
        bad=bad,
        shards=tuple(shards),
        input_fingerprint=fingerprint,
    )
    tmp_manifest = work / "plan.json.tmp"
    tmp_manifest.write_text(plan.to_json())
    os.replace(tmp_manifest, manifest)
    logger.info(
        "planned job %s: %d lines, %d bad, %d shards, %d runs",
        job_id, total, bad, len(shards), len(runs),
    )
    return plan


_DECODER = json.JSONDecoder()


def _key_of(line: bytes, line_no: int, prefix_chars: int) -> tuple[bytes | None, str | None]:
    try:
        doc = _DECODER.decode(line.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None, error_record(f"line-{line_no + 1}", "invalid_json", "line is not valid JSON")
    if not isinstance(doc, dict):
        return None, error_record(f"line-{line_no + 1}", "invalid_request", "line is not an object")
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, error_record(
            f"line-{line_no + 1}", "invalid_request", "custom_id is missing or not a string"
        )
    body = doc.get("body")
    if not isinstance(body, dict):
        return None, error_record(custom_id, "invalid_request", "body is missing or not an object")
    return prefix_key(body, prefix_chars), None


def _affinity(key: bytes) -> str:
    return hashlib.blake2b(key, digest_size=6).hexdigest()


def _reduce_runs(runs: list[Path], directory: Path, fan_in: int) -> list[Path]:
    """Merge runs in groups of ``fan_in`` until at most ``fan_in`` remain (bounded open files)."""
    pack = _REC.pack
    while len(runs) > fan_in:
        merged: list[Path] = []
        for i in range(0, len(runs), fan_in):
            group = runs[i : i + fan_in]
            if len(group) == 1:
                merged.append(group[0])
                continue
            fd, name = tempfile.mkstemp(prefix="run-", suffix=".bin", dir=directory)
            with os.fdopen(fd, "wb", buffering=1 << 16) as out:
                out.writelines(
                    pack(len(key), line_no, len(line)) + key + line
                    for key, line_no, line in heapq.merge(*(_read_run(p) for p in group))
                )
            for path in group:
                path.unlink()
            merged.append(Path(name))
        runs = merged
    return runs


def _stage(runs: list[Path], staged: Path, job_id: str, options: PlanOptions) -> list[ShardPlan]:
    shards: list[ShardPlan] = []
    start = position = 0
    previous: bytes | None = None
    shard_key = b""
    hard_cap = 2 * options.shard_size
    with open(staged, "wb", buffering=1 << 16) as out:
        for key, _, line in heapq.merge(*(_read_run(p) for p in runs)):
            size = position - start
            new_group = key != previous
            if size > 0 and ((size >= options.shard_size and new_group) or size >= hard_cap):
                shards.append(_shard(job_id, len(shards), start, position, shard_key))
                start = position
            if position == start:
                shard_key = key
            out.write(line + b"\n")
            previous = key
            position += 1
    if position > start:
        shards.append(_shard(job_id, len(shards), start, position, shard_key))
    return shards


def _shard(job_id: str, index: int, start: int, end: int, key: bytes) -> ShardPlan:
    shard_id = f"{job_id}-{index:05d}"
    return ShardPlan(shard_id=shard_id, start=start, end=end, affinity=_affinity(key))


# --------------------------------------------------------------------------- results


def _records(path: Path) -> Iterator[tuple[str, str]]:
    """(custom_id, raw line) of each well-formed record in a JSONL log; torn tails are skipped."""
    if not path.exists():
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.endswith("\n"):
                return  # a torn final write: the sidecar will redo that request
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and isinstance(doc.get("custom_id"), str):
                yield doc["custom_id"], line.rstrip("\n")


@dataclass(frozen=True, slots=True)
class ShardResult:
    completed: int
    failed: int


def count_shard(plan: Plan, shard: ShardPlan) -> ShardResult:
    """Distinct custom_ids with a success, and with only an error, in one shard's logs."""
    ok = {cid for cid, _ in _records(local_path(plan.shard_output_uri(shard.shard_id)))}
    err = {cid for cid, _ in _records(local_path(plan.shard_error_uri(shard.shard_id)))} - ok
    return ShardResult(completed=len(ok), failed=len(err))


@dataclass(frozen=True, slots=True)
class MergeResult:
    completed: int
    failed: int
    total: int


def merge_outputs(plan: Plan, output_uri: str, error_uri: str) -> MergeResult:
    """Merge shard logs into the job's output and error files, exactly once per custom_id."""
    work = Path(plan.work_dir)
    out_target = MergeTarget.of(output_uri, work, "output")
    err_target = MergeTarget.of(error_uri, work, "errors")
    completed = failed = 0
    out_target.tmp.parent.mkdir(parents=True, exist_ok=True)
    err_target.tmp.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(out_target.tmp, "w", encoding="utf-8") as out,
        open(err_target.tmp, "w", encoding="utf-8") as err,
    ):
        for shard in plan.shards:
            seen: set[str] = set()
            for cid, line in _records(local_path(plan.shard_output_uri(shard.shard_id))):
                if cid not in seen:
                    seen.add(cid)
                    out.write(line + "\n")
                    completed += 1
            for cid, line in _records(local_path(plan.shard_error_uri(shard.shard_id))):
                if cid not in seen:
                    seen.add(cid)
                    err.write(line + "\n")
                    failed += 1
            if len(seen) != shard.size:
                raise OutputError(
                    f"shard {shard.shard_id} has {len(seen)} records for {shard.size} requests",
                    uri=plan.shard_output_uri(shard.shard_id),
                )
        plan_errors = Path(plan.plan_errors_path)
        if plan_errors.exists():
            with open(plan_errors, encoding="utf-8") as f:
                for line in f:
                    err.write(line)
                    failed += 1
        for handle in (out, err):
            handle.flush()
            os.fsync(handle.fileno())
    if completed + failed != plan.total:
        raise OutputError(
            f"{completed} results + {failed} errors != {plan.total} input lines", uri=output_uri
        )
    err_target.commit()
    out_target.commit()  # last: the output's presence means both are complete
    return MergeResult(completed=completed, failed=failed, total=plan.total)
