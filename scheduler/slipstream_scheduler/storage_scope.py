"""Which storage an OfflineJob of one namespace may read and write: the namespace-root rule.

An OfflineJob names its input, output and error files by URI, and the operator
and the sidecars open them with their own (broad) file-system and object-store
access. Without a rule, a job in namespace ``a`` could name ``b``'s files and
have Slipstream read or overwrite them. The rule: the platform configures one
or more *storage roots* (``file:///var/lib/slipstream``, ``s3://batch``); a
job in namespace ``ns`` may use exactly the URIs under ``<root>/<ns>/`` of
some root. :func:`check_uri` enforces it on the URI's text, after
normalising the path (``.``/``..`` segments, repeated slashes) and
percent-decoding, so ``file:///root/a/../b/x`` is ``b``'s and refused for
``a``. No roots configured: no rule (a single-tenant install).

Hooks (the callers own them): the operator checks ``spec.input.uri``,
``spec.output.uri`` and ``spec.output.errorUri`` before planning and marks the
job not admitted with the error's message (which names the field); the sidecar
checks the three URIs of every ``AssignShard`` against the shard's
``job_namespace`` and refuses with ``INVALID_ARGUMENT``, and, because a path
that is textually inside the root can still be a symbolic link out of it,
checks the *resolved* local path again with :func:`check_resolved_path` when
it opens the file.

Deliberately left out: reading the file system (resolving links is the
caller's I/O), and who may create which namespace (Kubernetes RBAC).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class ScopeError(ValueError):
    """A URI outside the namespace's storage; ``field`` names the spec field."""

    def __init__(self, field: str, uri: str, namespace: str, reason: str) -> None:
        super().__init__(f"{field}: {uri!r} {reason}")
        self.field = field
        self.uri = uri
        self.namespace = namespace
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _Parsed:
    scheme: str
    authority: str
    path: str


def _parse(uri: str) -> _Parsed | None:
    scheme, sep, rest = uri.partition("://")
    if not sep or not scheme or not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        return None
    if scheme == "file":
        return _Parsed("file", "", rest)
    authority, slash, path = rest.partition("/")
    return _Parsed(scheme, authority, "/" + path if slash else "/")


def _normal(path: str) -> str | None:
    """The normalised absolute path, or None when it cannot be judged safely."""
    if "\x00" in path or "\\" in path:
        return None
    decoded = unquote(path)
    if "\x00" in decoded or "\\" in decoded:
        return None
    if not decoded.startswith("/"):
        return None
    norm = posixpath.normpath(decoded)
    if norm.startswith("//"):
        norm = "/" + norm.lstrip("/")
    return norm


def namespace_prefixes(roots: Sequence[str], namespace: str) -> tuple[str, ...]:
    """The URI prefixes (``<root>/<namespace>/``) a job of ``namespace`` may use."""
    return tuple(root.rstrip("/") + "/" + namespace + "/" for root in roots)


def check_uri(uri: str, *, namespace: str, roots: Sequence[str], field: str) -> str:
    """Return ``uri`` if it lies under ``<root>/<namespace>/`` of one of ``roots``.

    Raise :class:`ScopeError` (naming ``field``) otherwise. ``roots`` empty: no rule.
    """
    if not roots:
        return uri
    if not _DNS_LABEL.match(namespace):
        raise ScopeError(field, uri, namespace, f"belongs to no valid namespace ({namespace!r})")
    got = _parse(uri)
    if got is None:
        raise ScopeError(field, uri, namespace, "is not an absolute URI with a scheme")
    path = _normal(got.path)
    if path is None:
        raise ScopeError(field, uri, namespace, "has a path that cannot be checked")
    for root in roots:
        want = _parse(root.rstrip("/") + "/")
        if want is None or want.scheme != got.scheme or want.authority != got.authority:
            continue
        base = _normal(want.path)
        if base is None:
            continue
        ns_dir = posixpath.join(base, namespace)
        if path.startswith(ns_dir + "/") and path != ns_dir + "/":
            return uri
    allowed = ", ".join(namespace_prefixes(roots, namespace))
    raise ScopeError(field, uri, namespace,
                     f"is outside namespace {namespace!r}'s storage (allowed: {allowed})")


def check_resolved_path(
    resolved: str, *, namespace: str, roots: Sequence[str], field: str
) -> str:
    """Check an already resolved (``os.path.realpath``) local path against the ``file://`` roots.

    The text check of :func:`check_uri` cannot see symbolic links; callers resolve the path
    (I/O, theirs) and pass the result here before opening it.
    """
    return check_uri("file://" + resolved, namespace=namespace, roots=roots, field=field)
