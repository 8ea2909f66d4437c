"""The sidecar's error tree.

::

    SidecarError
    ├── EngineError            the engine answered badly or could not be reached
    │   └── EngineUnavailableError  connection refused / reset / timed out
    ├── BatchLineError         one input line cannot become a request (line_no, code)
    ├── ShardError             a shard cannot run at all (shard_id)
    │   └── ShardIOError       its input or output cannot be read or written
    ├── AuthError              the token file is missing or empty
    └── DrainingError              the sidecar no longer admits new work

Errors carry fields and chain their cause; they are translated only at the
edges: HTTP error JSON in the proxy, gRPC status codes in the control server,
error records in the batch output.
"""

from __future__ import annotations


class SidecarError(Exception):
    """Base of every error the sidecar raises on purpose."""


class EngineError(SidecarError):
    """The engine returned a non-2xx answer (``status``, raw ``body``) or garbage."""

    def __init__(self, message: str, *, status: int = 502, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class EngineUnavailableError(EngineError):
    """The engine could not be reached at all.

    ``str(exc)`` is for the sidecar's log (what failed, the exception's repr);
    :attr:`public` is what a client is told: the fact and a short cause, nothing of
    the sidecar's internals.
    """

    def __init__(self, message: str, *, cause: str = "") -> None:
        super().__init__(message, status=503)
        self.cause = cause

    @property
    def public(self) -> str:
        tail = f" ({self.cause})" if self.cause else ""
        return f"the inference engine is not reachable{tail}"


def unreachable(what: str, exc: BaseException) -> EngineUnavailableError:
    """The error for ``what`` (``"POST /tokenize"``) failing to reach the engine with ``exc``."""
    return EngineUnavailableError(f"{what}: {exc!r}", cause=describe(exc))


def describe(exc: BaseException | None) -> str:
    """A short, client-safe cause of a connection failure: ``connection refused``."""
    os_error = getattr(exc, "os_error", None)  # aiohttp's ClientConnectorError wraps one
    if isinstance(os_error, OSError):
        exc = os_error
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if exc is None:
        return "connection closed"
    return "connection failed"


class BatchLineError(SidecarError):
    """One OpenAI Batch input line is unusable; the rest of the shard goes on.

    ``code`` is the error code written to the error file (``invalid_json``,
    ``invalid_request``, ``model_not_found``, ``invalid_url``,
    ``context_length_exceeded``, ``engine_error``, ``duplicate_custom_id``).
    """

    def __init__(self, line_no: int, code: str, message: str, custom_id: str | None = None):
        super().__init__(f"line {line_no}: {message}")
        self.line_no = line_no
        self.code = code
        self.custom_id = custom_id


class ShardError(SidecarError):
    """A shard as a whole cannot proceed."""

    def __init__(self, shard_id: str, message: str) -> None:
        super().__init__(f"shard {shard_id}: {message}")
        self.shard_id = shard_id


class ShardIOError(ShardError):
    """Reading the shard's input or writing its output failed."""

    def __init__(self, shard_id: str, uri: str, message: str) -> None:
        super().__init__(shard_id, f"{uri}: {message}")
        self.uri = uri


class AuthError(SidecarError):
    """The control API's token could not be loaded."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class DrainingError(SidecarError):
    """New work is refused because a Drain is in progress."""
