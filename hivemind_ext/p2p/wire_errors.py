"""Error frames: how a failure on one side becomes a typed exception on the other.

An ERROR frame's header is ``{"kind": str, "type": str, "message": str}``. ``kind`` says which
layer failed and picks the exception class the receiver raises; ``type`` and ``message`` describe
the original exception. Only the exception's class name and (truncated) text cross the wire:
never a traceback, never local variables. A received error header is untrusted input and is
validated like any other.
"""

from __future__ import annotations

import enum
from typing import Any

from hivemind_ext.errors import (
    DeadlineExceededError,
    HivemindExtError,
    MessageTooLargeError,
    PeerUnreachableError,
    ProtocolError,
    RemoteError,
)

MAX_ERROR_TEXT = 1024


class ErrorKind(str, enum.Enum):
    PROTOCOL = "protocol"  # the receiver of a frame found it malformed or unexpected
    TOO_LARGE = "too_large"  # a frame exceeded the receiver's (or the sender's own) limits
    DEADLINE = "deadline"  # the handler's deadline passed
    HANDLER = "handler"  # the handler raised an exception
    UNAVAILABLE = "unavailable"  # the server is shutting down


def error_kind_of(exc: BaseException, *, from_handler: bool) -> ErrorKind:
    """The kind to report for ``exc``; exceptions raised by handler code are HANDLER whatever their type."""
    if from_handler:
        return ErrorKind.HANDLER
    if isinstance(exc, MessageTooLargeError):
        return ErrorKind.TOO_LARGE
    if isinstance(exc, ProtocolError):
        return ErrorKind.PROTOCOL
    if isinstance(exc, DeadlineExceededError):
        return ErrorKind.DEADLINE
    return ErrorKind.UNAVAILABLE


def error_header(kind: ErrorKind, exc: BaseException) -> dict[str, str]:
    """The header of an ERROR frame describing ``exc`` (class name and truncated text only)."""
    return {"kind": kind.value, "type": type(exc).__name__[:100], "message": str(exc)[:MAX_ERROR_TEXT]}


_EXCEPTIONS_BY_KIND: dict[str, type[HivemindExtError]] = {
    ErrorKind.PROTOCOL.value: ProtocolError,
    ErrorKind.TOO_LARGE.value: MessageTooLargeError,
    ErrorKind.DEADLINE.value: DeadlineExceededError,
    ErrorKind.UNAVAILABLE.value: PeerUnreachableError,
    ErrorKind.HANDLER.value: RemoteError,
}


def exception_from_error_header(header: dict[Any, Any], peer: str) -> HivemindExtError:
    """The exception a caller raises for an ERROR frame received from ``peer``.

    Unknown kinds become :class:`RemoteError`; malformed fields are replaced, not trusted.
    """
    kind, type_name, message = header.get("kind"), header.get("type"), header.get("message")
    kind = kind if isinstance(kind, str) else "?"
    type_name = type_name[:100] if isinstance(type_name, str) else "?"
    message = message[:MAX_ERROR_TEXT] if isinstance(message, str) else ""
    exception_type = _EXCEPTIONS_BY_KIND.get(kind, RemoteError)
    if exception_type is RemoteError:
        return RemoteError(f"{peer} failed with {type_name}: {message}")
    return exception_type(f"{peer} reported {kind} error ({type_name}): {message}")
