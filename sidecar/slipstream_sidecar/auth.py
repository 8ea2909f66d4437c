"""Bearer-token authentication of the control API (a gRPC server interceptor).

The token is read from a file (a mounted Kubernetes Secret) and re-read when
the file's modification time changes, so a rotated Secret takes effect without
a restart. Each call's ``authorization`` metadata must be ``Bearer <token>``;
the comparison is constant-time (``hmac.compare_digest``). Anything else is
refused with ``UNAUTHENTICATED`` before the servicer runs. Without a token
file every call is refused.

Deliberately left out: TLS (the pod network policy and a service mesh provide
transport security) and per-caller identities.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from slipstream_sidecar.errors import AuthError

log = logging.getLogger(__name__)


class TokenFile:
    """The expected token, reloaded when its file changes."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._mtime: float | None = None
        self._token: bytes | None = None
        if path is not None:
            self._load()

    def _load(self) -> None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
            if st.st_mtime == self._mtime:
                return
            token = self.path.read_bytes().strip()
        except OSError as exc:
            raise AuthError(str(self.path), f"cannot read the token: {exc}") from exc
        if not token:
            raise AuthError(str(self.path), "the token file is empty")
        self._token, self._mtime = token, st.st_mtime

    def check(self, presented: str | bytes | None) -> bool:
        if self.path is None or presented is None:
            return False
        try:
            self._load()
        except AuthError as exc:
            log.error("control API token unavailable: %s", exc)
            return False
        if self._token is None:
            return False
        raw = presented.encode() if isinstance(presented, str) else presented
        if not raw.startswith(b"Bearer "):
            return False
        return hmac.compare_digest(raw[len(b"Bearer ") :].strip(), self._token)


def _deny_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        yield None  # pragma: no cover - abort raises

    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            deny_stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return grpc.unary_unary_rpc_method_handler(
        deny_unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call whose bearer token does not match the token file."""

    def __init__(self, tokens: TokenFile) -> None:
        self._tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        presented = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value
                break
        handler = await continuation(handler_call_details)
        if handler is None or self._tokens.check(presented):
            return handler
        log.warning("refused unauthenticated call to %s", handler_call_details.method)
        return _deny_handler(handler)
