"""The operator's error tree.

Everything the operator raises on purpose derives from :class:`OperatorError`
and carries the fields a caller needs to act (which object, which field, which
pod). kopf's ``TemporaryError``/``PermanentError`` are produced only at the edge,
in ``handlers.py``; pure modules never import kopf. ::

    OperatorError
     +-- SpecError            (a spec the API server accepted but we cannot use)
     +-- InputError           (an OfflineJob input that cannot be read at all)
     +-- OutputError          (shard outputs that cannot be merged)
     +-- SidecarError         (a sidecar control call failed; carries the pod)

Deliberately left out: wrapping Kubernetes API errors (kopf and the kubernetes
client already carry status codes; handlers let them through as temporary).
"""

from __future__ import annotations


class OperatorError(Exception):
    """Base of every error this package raises on purpose."""


class SpecError(OperatorError):
    """A spec passed schema validation but cannot be acted on."""

    def __init__(self, message: str, *, field_path: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field_path = field_path


class InputError(OperatorError):
    """An OfflineJob's input cannot be opened or read (bad lines are not errors)."""

    def __init__(self, message: str, *, uri: str) -> None:
        super().__init__(f"{uri}: {message}")
        self.uri = uri


class OutputError(OperatorError):
    """Shard outputs cannot be merged into the job's output and error files."""

    def __init__(self, message: str, *, uri: str) -> None:
        super().__init__(f"{uri}: {message}")
        self.uri = uri


class SidecarError(OperatorError):
    """A control call to one pod's sidecar failed."""

    def __init__(self, message: str, *, pod: str, address: str) -> None:
        super().__init__(f"sidecar {pod} at {address}: {message}")
        self.pod = pod
        self.address = address
