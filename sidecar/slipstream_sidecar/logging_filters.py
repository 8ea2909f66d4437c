"""Keep request bytes out of aiohttp's own log lines (the prompt is never logged).

aiohttp's server logger reports a request it cannot parse with the exception
attached, and the exception's text quotes the offending bytes. When a client's
``Content-Length`` is shorter than its body, the rest of the body (the prompt)
is parsed as the next request, so the prompt would reach the log at ERROR.
:func:`install_payload_filter` adds a filter to the ``aiohttp.server`` and
``aiohttp.access`` loggers that rewrites such a record into one line naming the
exception's type and HTTP status, without the traceback or the bytes. Both the
sidecar and the engine server (``slipstream engine``) install it at startup.

Deliberately left out: exceptions raised by our own handlers (their tracebacks
carry no request bytes and are kept), and any change to levels or handlers.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

REDACTED_LOGGERS = ("aiohttp.server", "aiohttp.access")


class PayloadRedactingFilter(logging.Filter):
    """Rewrite records that carry an HTTP parsing error into a line without its payload."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else None
        record.msg = "refused a malformed HTTP request from %s: %s (status %s; bytes not logged)"
        record.args = (peer if isinstance(peer, str) else "?", type(exc).__name__, exc.code)
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        return True


_FILTER = PayloadRedactingFilter()


def install_payload_filter() -> None:
    """Add the redacting filter to aiohttp's server loggers (idempotent)."""
    for name in REDACTED_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
