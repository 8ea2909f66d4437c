"""Errors of the engine server, and their translation into vLLM's error JSON.

::

    EngineServerError
     +-- RequestError      (a request the server refuses: carries HTTP status,
                            vLLM error ``type`` and the offending ``param``)

vLLM answers errors as ``{"error": {"message", "type", "param", "code"}}``
where ``code`` is the HTTP status as an integer
(``vllm/entrypoints/openai/protocol.py``: ``ErrorInfo``/``ErrorResponse``).
Its ``type`` is ``"BadRequestError"`` for refusals raised by the serving
layer, ``"Bad Request"`` for request-body validation failures and
``"NotFoundError"`` for an unknown model.

Deliberately left out: anything about the engine model's own errors; those
are bugs and surface as a 500 with ``InternalServerError``.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any


class EngineServerError(Exception):
    """Base of the engine server's errors."""


class RequestError(EngineServerError):
    """A request the server refuses, with what vLLM would answer."""

    def __init__(
        self,
        message: str,
        *,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        """vLLM's ``ErrorResponse`` as a dict."""
        return error_body(self.message, self.err_type, self.status, self.param)


def error_body(
    message: str, err_type: str, status: HTTPStatus, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": int(status)}}
