"""Where a job's work folder lives, and how a merged result reaches a non-local output.

The sidecars of a job's pods append each shard's results to logs in the job's
*work folder*, and the operator merges them into the output at the end
(:mod:`slipstream_operator.shards`). Logs need a shared file system: appends
and renames, which an object store does not have. So:

* A ``file://`` output keeps its work folder beside it, ``<output>.slipstream``.
* Any other output (``s3://``, or another fsspec protocol) gets a *staging*
  work folder on the shared claim the operator mounts (``job_storage.pvc``),
  inside the job's namespace folder so the namespace-root rule covers it::

      <mount path>/<namespace>/.slipstream/<job name>-<hash of the output URI>/

  The hash keys the folder by the output, as the ``file://`` layout is, so a
  job recreated with the same output resumes its logs. Without a writable
  claim there is nowhere to stage: the job is not admitted, and the message
  names ``spec.output.uri`` and the setting to change.
* Committing a merged file: a local target is renamed into place (atomic on
  one file system); a remote one is uploaded whole with fsspec's ``put_file``
  from a finished local file in the work folder (removed once uploaded), so
  readers see the previous object or the new one, never part of it (S3 makes
  an object visible when its single PUT or its multipart upload completes). A
  merge repeated after an operator restart uploads the same bytes again: every
  ``custom_id`` is still in the object exactly once.

Credentials and endpoint come from the environment (``AWS_*``,
``FSSPEC_S3_ENDPOINT_URL``; docs/operator.md, "Job storage").

Deliberately left out: conditional writes (``If-None-Match``), which would
refuse the idempotent re-upload above, and cleaning a staging folder after
the job (as for ``file://`` outputs, the work folder is kept for audits).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from slipstream_operator.errors import InputError, OutputError

WORK_SUFFIX = ".slipstream"
STAGING_DIR = ".slipstream"


def is_local(uri: str) -> bool:
    """Whether ``uri`` is a ``file://`` URI (a path the operator opens directly)."""
    return urlparse(uri).scheme == "file"


def local_path(uri: str) -> Path:
    """The filesystem path of a ``file://`` URI."""
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        raise InputError("only file:// URIs are supported for this path", uri=uri)
    return Path(parsed.netloc + parsed.path) if parsed.netloc else Path(parsed.path)


def staging_problem(output_uri: str, staging_root: str | None) -> str:
    """Why a job with this output cannot be staged ("" when it can)."""
    if is_local(output_uri) or staging_root:
        return ""
    return (f"spec.output.uri: {output_uri!r} is not a file:// URI, and its results need a "
            "staging folder on storage every pod shares: set the operator's "
            "jobStorage.pvc (a writable claim), or write the output to file://")


def work_dir_for(output_uri: str, *, namespace: str = "", name: str = "",
                 staging_root: str | None = None) -> Path:
    """The job's work folder on shared storage (see the module docstring)."""
    if is_local(output_uri):
        path = local_path(output_uri)
        return path.with_name(path.name + WORK_SUFFIX)
    problem = staging_problem(output_uri, staging_root)
    if problem or not namespace or not name:
        raise InputError(problem or "a staged job needs its namespace and name", uri=output_uri)
    digest = hashlib.sha256(output_uri.encode()).hexdigest()[:12]
    return Path(staging_root or "") / namespace / STAGING_DIR / f"{name}-{digest}"


@dataclass(frozen=True, slots=True)
class MergeTarget:
    """One file a merge writes: ``tmp`` is written, then :meth:`commit` puts it at ``uri``."""

    uri: str
    tmp: Path

    @classmethod
    def of(cls, uri: str, work_dir: Path, label: str) -> MergeTarget:
        if is_local(uri):
            path = local_path(uri)
            return cls(uri, path.with_name(path.name + ".tmp"))
        return cls(uri, work_dir / f"merged.{label}.jsonl")

    def commit(self) -> None:
        """Rename the finished file into place, or upload it whole."""
        if is_local(self.uri):
            os.replace(self.tmp, local_path(self.uri))
            return
        try:
            import fsspec

            fs, path = fsspec.core.url_to_fs(self.uri)
            fs.put_file(str(self.tmp), path)
        except Exception as exc:  # the store's client raises its own kinds (botocore's too)
            raise OutputError(f"cannot upload the merged file: {exc}", uri=self.uri) from exc
        self.tmp.unlink(missing_ok=True)  # the shard logs keep every record
