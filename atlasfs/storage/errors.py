"""What a failed request to an object store means: worth retrying, or not, and how to say it.

fsspec's back ends fail in many shapes (botocore ``ClientError``s wrapped in
``OSError``s by s3fs, aiohttp's errors for ``https://``, timeouts, socket errors);
these functions read them without importing any of those libraries, so that the
retry loop (:mod:`.requests`) can tell "later" from "never" and messages never carry
credentials.
"""

from __future__ import annotations

import asyncio
import errno
import os

from atlasfs.storage import redact

#: Error codes of S3 (and kin) that mean "later", not "never".
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "TooManyRequests", "RequestLimitExceeded",
    "503", "500", "502", "504", "429",
})
_TRANSIENT_ERRNOS = frozenset({
    errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
    errno.ECONNABORTED, errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN,
})


def describe_error(exc: BaseException) -> str:
    """A short, credential-free account of a failed request for a log line or message."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    status, code = http_status(exc)
    if status or code:
        return f"HTTP {status or '?'} {code or ''}".strip()
    text = str(exc).splitlines()[0] if str(exc) else ""
    return redact(f"{type(exc).__name__}: {text}"[:200])


def http_status(exc: BaseException) -> tuple[int | None, str | None]:
    """``(HTTP status, error code)`` of a botocore ``ClientError`` anywhere in the
    exception's chain (s3fs translates them into ``OSError``s carrying the original)."""
    seen = 0
    while exc is not None and seen < 8:
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            meta = response.get("ResponseMetadata") or {}
            return meta.get("HTTPStatusCode"), error.get("Code")
        status = getattr(exc, "status", None)  # aiohttp's ClientResponseError (https://)
        if isinstance(status, int):
            return status, None
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None, None


def is_transient(exc: BaseException) -> bool:
    """True if a request that failed with ``exc`` may work if tried again."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    status, code = http_status(exc)
    if status is not None or code is not None:
        if code in ("PreconditionFailed", "NoSuchKey", "NoSuchBucket", "AccessDenied", "InvalidRange"):
            return False
        return (status is not None and (status >= 500 or status == 429)) or (code in _TRANSIENT_CODES)
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    # Connection-level failures of the HTTP stacks under fsspec, by name (so that
    # neither aiohttp nor botocore has to be imported for the check).
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {
        "ClientConnectionError", "ServerDisconnectedError", "ClientPayloadError", "ClientOSError",
        "ServerTimeoutError", "HTTPClientError", "EndpointConnectionError", "ConnectionClosedError",
        "ReadTimeoutError", "ConnectTimeoutError", "ResponseParserError", "IncompleteRead",
        "IncompleteReadError", "FSTimeoutError", "ProxyConnectionError",
    })


def precondition_failed(exc: BaseException) -> bool:
    """True if ``exc`` is the store refusing a conditional read: the ETag differs."""
    status, code = http_status(exc)
    return status == 412 or code == "PreconditionFailed"


def permanent_error(exc: BaseException) -> OSError:
    """A failure not worth retrying, as the ``OSError`` the format layer expects."""
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
    if isinstance(exc, PermissionError):
        return PermissionError(errno.EACCES, "access denied by the store")
    if isinstance(exc, OSError) and exc.errno and not http_status(exc)[0]:
        return OSError(exc.errno, redact(exc.strerror or os.strerror(exc.errno)))
    return OSError(errno.EIO, describe_error(exc))
