"""The namespace-root rule for OfflineJob storage (``slipstream_scheduler.storage_scope``)."""

from __future__ import annotations

import posixpath
from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream_scheduler.storage_scope import ScopeError, check_resolved_path, check_uri

pytestmark = pytest.mark.unit

ROOTS = ("file:///var/lib/slipstream", "s3://batch-bucket/jobs")


@pytest.mark.parametrize("uri", [
    "file:///var/lib/slipstream/team-a/in.jsonl",
    "file:///var/lib/slipstream/team-a/deep/dir/out.jsonl",
    "file:///var/lib/slipstream//team-a/./x/../in.jsonl",
    "s3://batch-bucket/jobs/team-a/in.jsonl",
])
def test_inside_the_namespace_root_is_allowed(uri: str) -> None:
    assert check_uri(uri, namespace="team-a", roots=ROOTS, field="spec.input.uri") == uri


@pytest.mark.parametrize("uri", [
    "file:///var/lib/slipstream/team-b/in.jsonl",  # another namespace
    "file:///var/lib/slipstream/team-a/../team-b/in.jsonl",  # climbs out
    "file:///var/lib/slipstream/team-a/%2e%2e/team-b/in.jsonl",  # percent-encoded climb
    "file:///var/lib/slipstream/team-a",  # the namespace dir itself, not a file in it
    "file:///var/lib/slipstream/team-a/",
    "file:///var/lib/slipstream/team-ab/in.jsonl",  # a prefix of another namespace
    "file:///etc/passwd",
    "file://var/lib/slipstream/team-a/in.jsonl",  # relative
    "/var/lib/slipstream/team-a/in.jsonl",  # no scheme
    "s3://other-bucket/jobs/team-a/in.jsonl",
    "s3://batch-bucket/team-a/in.jsonl",  # outside the bucket's root prefix
    "gs://batch-bucket/jobs/team-a/in.jsonl",  # scheme without a root
    "file:///var/lib/slipstream/team-a/in\x00.jsonl",
    "memory://team-a/in.jsonl",
])
def test_outside_is_refused_naming_the_field(uri: str) -> None:
    with pytest.raises(ScopeError) as info:
        check_uri(uri, namespace="team-a", roots=ROOTS, field="spec.output.uri")
    assert str(info.value).startswith("spec.output.uri: ")
    assert info.value.field == "spec.output.uri" and info.value.namespace == "team-a"


def test_no_roots_means_no_rule_and_bad_namespaces_are_refused() -> None:
    assert check_uri("file:///anywhere", namespace="x", roots=(), field="f") == "file:///anywhere"
    with pytest.raises(ScopeError, match="no valid namespace"):
        check_uri("file:///var/lib/slipstream/../x", namespace="..", roots=ROOTS, field="f")


def test_a_link_resolved_out_of_the_root_is_refused() -> None:
    with pytest.raises(ScopeError):
        check_resolved_path("/var/lib/slipstream/team-b/secret.jsonl", namespace="team-a",
                            roots=ROOTS, field="spec.input.uri")


segments = st.sampled_from(["team-a", "team-b", "..", ".", "", "x", "%2e%2e", "%2F", "in.jsonl"])


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(parts=st.lists(segments, max_size=6))
def test_an_accepted_uri_always_normalises_into_the_namespace(parts: list[str]) -> None:
    uri = "file:///var/lib/slipstream/" + "/".join(parts)
    try:
        check_uri(uri, namespace="team-a", roots=ROOTS, field="f")
    except ScopeError:
        return
    norm = posixpath.normpath(unquote(uri[len("file://"):]))
    assert norm.startswith("/var/lib/slipstream/team-a/")
