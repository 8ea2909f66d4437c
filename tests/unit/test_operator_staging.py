"""Object-store outputs: where such a job's work folder lives, the admission rule when there
is none, and a merge that uploads the result whole (fsspec's in-memory file system standing in
for the store; tests/e2e/test_s3_job_e2e.py runs the same path against an S3 server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fsspec
import pytest

from slipstream_operator.api import OfflineJobSpec
from slipstream_operator.errors import InputError, OutputError
from slipstream_operator.podspec import JobStorage
from slipstream_operator.reconcile_job import JobSettings, storage_error
from slipstream_operator.shards import PlanOptions, merge_outputs, plan_input
from slipstream_operator.staging import MergeTarget, local_path, work_dir_for

pytestmark = pytest.mark.unit


def spec(output: str, **extra: Any) -> OfflineJobSpec:
    return OfflineJobSpec.model_validate(
        {"model": "m", "input": {"uri": "s3://batch/ns/in.jsonl"}, "output": {"uri": output},
         **extra})


def test_a_file_output_keeps_its_work_folder_beside_it() -> None:
    assert work_dir_for("file:///data/ns/out.jsonl") == Path("/data/ns/out.jsonl.slipstream")
    # The staging root does not move a file:// job's folder (its logs stay where they were).
    assert work_dir_for("file:///data/ns/out.jsonl", namespace="ns", name="j",
                        staging_root="/jobs") == Path("/data/ns/out.jsonl.slipstream")


def test_an_object_store_output_is_staged_in_its_namespace_folder_keyed_by_the_output() -> None:
    a = work_dir_for("s3://batch/ns/a.jsonl", namespace="ns", name="j", staging_root="/jobs")
    b = work_dir_for("s3://batch/ns/b.jsonl", namespace="ns", name="j", staging_root="/jobs")
    assert a.parent == b.parent == Path("/jobs/ns/.slipstream")
    assert a.name.startswith("j-") and a != b
    assert a == work_dir_for("s3://batch/ns/a.jsonl", namespace="ns", name="j",
                             staging_root="/jobs")  # a recreated job resumes the same logs
    with pytest.raises(InputError, match=r"spec\.output\.uri.*jobStorage\.pvc"):
        work_dir_for("s3://batch/ns/a.jsonl", namespace="ns", name="j", staging_root=None)


def test_the_staging_root_is_a_writable_claim() -> None:
    assert JobStorage().staging_root() is None
    claim = {"claim_name": "jobs", "mount_path": "/data/jobs"}
    assert JobStorage.model_validate({"pvc": claim}).staging_root() == "/data/jobs"
    read_only = JobStorage.model_validate({"pvc": {**claim, "read_only": True}})
    assert read_only.staging_root() is None


@pytest.mark.parametrize(
    ("output", "settings", "reason", "names"),
    [
        ("file:///d/ns/out.jsonl", JobSettings(), "", ""),
        ("s3://batch/ns/out.jsonl", JobSettings(staging_root="/jobs"), "", ""),
        ("s3://batch/ns/out.jsonl", JobSettings(), "NoStagingFolder", "jobStorage.pvc"),
        # Scoped by namespace: the staging folder must lie under a file:// root too.
        ("s3://batch/ns/out.jsonl",
         JobSettings(staging_root="/jobs", storage_roots=("s3://batch",)),
         "NoStagingFolder", "storageRoots"),
        ("s3://batch/ns/out.jsonl",
         JobSettings(staging_root="/jobs", storage_roots=("s3://batch", "file:///jobs")), "", ""),
        ("s3://batch/other/out.jsonl",
         JobSettings(staging_root="/jobs", storage_roots=("s3://batch", "file:///jobs")),
         "StorageOutOfScope", "spec.output.uri"),
    ],
)
def test_admission_of_an_object_store_output(
    output: str, settings: JobSettings, reason: str, names: str
) -> None:
    got_reason, message = storage_error(spec(output), "ns", "j", settings)
    assert got_reason == reason
    assert names in message and bool(message) == bool(reason)


def request(cid: str, content: str) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": body})


def result(cid: str) -> str:
    return json.dumps({"id": f"r-{cid}", "custom_id": cid,
                       "response": {"status_code": 200, "body": {}}, "error": None})


def test_a_merge_uploads_the_output_whole_and_a_repeat_leaves_each_id_once(
    tmp_path: Path,
) -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe("/batch/ns/in.jsonl",
            "".join(request(f"r{i}", f"prompt {i}") + "\n" for i in range(6)).encode()
            + b"not json\n")
    output = "memory://batch/ns/out.jsonl"
    work = tmp_path / "jobs" / "ns" / ".slipstream" / "j-x"
    plan = plan_input("memory://batch/ns/in.jsonl", output, "ns.j", PlanOptions(shard_size=3),
                      work_dir=work)
    assert plan.work_dir == str(work) and plan.staged_uri.startswith(f"file://{work}/")
    for shard in plan.shards:  # what the sidecars append, a torn last line included
        staged = local_path(plan.staged_uri).read_text().splitlines()[shard.start:shard.end]
        ids = [json.loads(x)["custom_id"] for x in staged]
        local_path(plan.shard_output_uri(shard.shard_id)).write_text(
            "".join(result(c) + "\n" for c in ids) + '{"custom_id": "r')
    errors = "memory://batch/ns/out.errors.jsonl"
    first = merge_outputs(plan, output, errors)
    assert (first.completed, first.failed, first.total) == (6, 1, 7)
    body = fs.cat("/batch/ns/out.jsonl").decode().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in body) == [f"r{i}" for i in range(6)]
    assert [json.loads(x)["custom_id"] for x in fs.cat("/batch/ns/out.errors.jsonl")
            .decode().splitlines()] == ["line-7"]
    assert not list(work.glob("merged.*"))  # uploaded, then removed: the logs keep it all
    # An operator restart merges again: the object is replaced by the same bytes.
    merge_outputs(plan, output, errors)
    assert fs.cat("/batch/ns/out.jsonl").decode().splitlines() == body
    fs.rm("/batch", recursive=True)


def test_a_failed_upload_is_an_output_error_naming_the_uri(tmp_path: Path) -> None:
    tmp = tmp_path / "merged.output.jsonl"
    tmp.write_text("{}\n")
    target = MergeTarget("nosuchprotocol://bucket/out.jsonl", tmp)
    with pytest.raises(OutputError, match=r"nosuchprotocol://bucket/out\.jsonl"):
        target.commit()
