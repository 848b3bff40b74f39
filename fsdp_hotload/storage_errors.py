"""Why a storage call failed, and what to do about it: retry soon, back off longer, or give up at once.

Object stores fail in ways that need different answers. A dropped connection deserves a quick retry; an S3
``SlowDown`` means the prefix is over its request rate, and retrying fast only makes it worse; a permission error
will not fix itself. :func:`classify_error` decides from the exception and its cause chain, without importing
botocore or any HTTP client, and :func:`backoff_delay` spaces the retries. :class:`~fsdp_hotload.storage.Storage`
uses both; they are plain functions so they can be tested (and reused) without a backend.

Example::

    if classify_error(exc).retryable:
        time.sleep(backoff_delay(attempt, base_s=0.2, cap_s=10.0, u=random.random()))
"""
from __future__ import annotations

import asyncio
import errno
import os
import socket
from enum import Enum
from typing import Any, Iterator, Mapping

__all__ = ["StorageError", "MissingBackendError", "ErrorClass", "classify_error", "backoff_delay",
           "backend_install_hint", "credential_hint", "is_lost_upload"]


class StorageError(Exception):
    """An operation failed for good: retries ran out, or the error was one that retrying cannot fix.

    ``uri`` is the object or prefix, ``op`` the operation, ``attempts`` how many tries were made, ``cause`` the
    last underlying exception (also chained as ``__cause__``).
    """

    def __init__(self, message: str, *, uri: str = "", op: str = "", attempts: int = 0,
                 cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.uri = uri
        self.op = op
        self.attempts = attempts
        self.cause = cause


class MissingBackendError(StorageError, ImportError):
    """The root URI needs an optional package (s3fs, gcsfs) that is not installed; the message says what to install."""


_BACKEND_PACKAGES = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}


def backend_install_hint(protocol: str) -> str | None:
    """The install hint for an optional backend, e.g. ``"s3:// needs s3fs: pip install 'hotload[s3]'"``; None if
    the protocol needs no optional package of ours."""
    entry = _BACKEND_PACKAGES.get(protocol.lower())
    if entry is None:
        return None
    module, extra = entry
    return f"{protocol}:// needs {module}: pip install 'hotload[{extra}]'"


class ErrorClass(Enum):
    """What to do about a failed storage call."""

    THROTTLE = "throttle"    # the service asks us to slow down: retry after the long backoff
    TRANSIENT = "transient"  # network trouble, timeouts, 5xx: retry after the short backoff
    NOT_FOUND = "not_found"  # the object does not exist: tell the caller, never retry
    FATAL = "fatal"          # permissions, auth, bad requests, bugs: retrying cannot help

    @property
    def retryable(self) -> bool:
        return self in (ErrorClass.THROTTLE, ErrorClass.TRANSIENT)


_THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
    "RequestThrottled", "RequestThrottledException", "ServiceUnavailable", "503", "429"})
_THROTTLE_TEXT = ("slowdown", "slow down", "reduce your request rate", "too many requests", "rate exceeded")
_TRANSIENT_CODES = frozenset({"InternalError", "RequestTimeout", "RequestTimeoutException", "BadDigest",
                              "IncompleteBody", "XAmzContentSHA256Mismatch", "OperationAborted", "500", "502", "504"})
_AUTH_CODES = frozenset({
    "AccessDenied", "AccountProblem", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "ExpiredToken", "InvalidToken", "InvalidSecurity", "NotSignedUp", "RequestTimeTooSkewed", "401", "403"})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
# A multipart upload whose id the store no longer knows (aborted by a lifecycle rule, or a retried complete):
# HTTP 404, which s3fs turns into FileNotFoundError, yet the object is fine to write again from the start.
_LOST_UPLOAD_CODES = frozenset({"NoSuchUpload"})
# Matched by class name anywhere in the MRO, so botocore, aiohttp, urllib3 and requests need not be imported.
_TRANSIENT_CLASS_NAMES = frozenset({
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "HTTPClientError", "ProxyConnectionError", "IncompleteRead", "ResponseStreamingError", "ClientPayloadError",
    "ServerDisconnectedError", "ClientConnectionError", "ServerTimeoutError", "RemoteDisconnected", "ProtocolError",
    "ChunkedEncodingError", "ReadTimeout", "ConnectTimeout", "FSTimeoutError", "TransportError",
    # a body cut short on a read (botocore), a checksum that a damaged transfer failed, a proxy's 502 (requests)
    "IncompleteReadError", "FlexibleChecksumError", "ProxyError"})
# TLS: a handshake refused with an alert or cut short (an overloaded terminator) is retried, as botocore's own
# retries do; a certificate that fails verification is not. Both arrive as botocore's SSLError, whose base is not
# the builtin ConnectionError; which one it was shows only in the implicit context (aiohttp's, then ssl's error).
_TLS_CLASS_NAMES = frozenset({"SSLError", "ClientSSLError"})
_CERT_CLASS_NAMES = frozenset({"SSLCertVerificationError", "ClientConnectorCertificateError", "CertificateError"})
_AUTH_CLASS_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                               "RefreshError", "DefaultCredentialsError", "Forbidden", "Unauthorized"})
_TRANSIENT_ERRNOS = frozenset(getattr(errno, name) for name in (
    "ECONNRESET", "ECONNABORTED", "ECONNREFUSED", "ETIMEDOUT", "EPIPE", "EHOSTUNREACH", "ENETUNREACH", "ENETDOWN",
    "ENETRESET", "EAGAIN", "EBUSY", "EREMOTEIO") if hasattr(errno, name))


def _malformed_request(e: BaseException) -> bool:
    """Whether an HTTP client refused to send the request at all: botocore's HTTPClientError around a ValueError
    (a header holding a newline, "Forbidden control character detected in headers"). The same request fails
    the same way on every retry."""
    if "HTTPClientError" not in {klass.__name__ for klass in type(e).__mro__}:
        return False
    kwargs = getattr(e, "kwargs", None)
    inner = kwargs.get("error") if isinstance(kwargs, dict) else None
    return isinstance(inner if inner is not None else e.__context__, ValueError)


_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_CREDENTIAL_OPTIONS = ("key", "secret", "token", "aws_access_key_id", "aws_secret_access_key", "aws_session_token")


def credential_hint(exc: BaseException, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """Which credential (by name, never its value) starts or ends in whitespace, when ``exc`` is an error such a
    credential causes (a refused signature, a header the client will not send), else None.

    Why: a key read from a secret file or a Kubernetes secret often keeps its trailing newline; botocore then
    fails with a header-injection error or SignatureDoesNotMatch, neither of which names the culprit."""
    caused = False
    for e in _exception_chain(exc):
        code, status = _code_and_status(e)
        caused = caused or _malformed_request(e) or code in _AUTH_CODES or status in (401, 403)
    if not caused:
        return None
    options = dict(storage_options or {})
    nested = options.get("client_kwargs") if isinstance(options.get("client_kwargs"), dict) else {}
    places = [(f"storage_options[{key!r}]", options.get(key)) for key in _CREDENTIAL_OPTIONS]
    places += [(f"storage_options['client_kwargs'][{key!r}]", nested.get(key)) for key in _CREDENTIAL_OPTIONS]
    if not any(value for _where, value in places):  # botocore reads the environment only without options' keys
        places = [(f"${name}", os.environ.get(name)) for name in _CREDENTIAL_ENV]
    padded = [where for where, value in places if isinstance(value, str) and value != value.strip()]
    if not padded:
        return None
    return (f"{', '.join(padded)} starts or ends in whitespace (a newline kept from a secret file?), which may be "
            "the cause: strip it, as S3 signs and sends credentials byte for byte")


def is_throttle(code: str | None, status: int | None) -> bool:
    """Whether a store's answer (its error code, its HTTP status) asks the caller to slow down."""
    return code in _THROTTLE_CODES or status in (429, 503)


def is_lost_upload(exc: BaseException) -> bool:
    """Whether ``exc`` says a multipart upload's id is gone (``NoSuchUpload``). A request naming that upload fails
    the same way however often it is sent: only a fresh upload of the whole object helps."""
    return any(_code_and_status(e)[0] in _LOST_UPLOAD_CODES for e in _exception_chain(exc))


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and its explicit causes (s3fs raises an OSError ``from`` the botocore ClientError).
    Implicit contexts are not followed: an error raised while handling a dropped connection is not transient."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(seen) < 16:
        seen.add(id(e))
        yield e
        e = e.__cause__


def _certificate_failure(exc: BaseException) -> bool:
    """Whether a TLS error, or any error its cause or context chain holds, is a failed certificate verification."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < 16:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if {klass.__name__ for klass in type(e).__mro__} & _CERT_CLASS_NAMES:
            return True
        todo += [e.__cause__, e.__context__]
    return False


def _code_and_status(exc: BaseException) -> tuple[str | None, int | None]:
    """Service error code and HTTP status, from botocore's ``response`` dict or an HTTP client's attributes."""
    code: str | None = None
    status: int | None = None
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error") or {}
        code = str(err["Code"]) if isinstance(err, dict) and err.get("Code") is not None else None
        meta = response.get("ResponseMetadata") or {}
        if isinstance(meta, dict) and isinstance(meta.get("HTTPStatusCode"), int):
            status = meta["HTTPStatusCode"]
    elif response is not None and isinstance(getattr(response, "status_code", None), int):
        status = response.status_code
    if status is None:
        for attr in ("status_code", "status", "code"):
            value = getattr(exc, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and 400 <= value <= 599:
                status = value
                break
    return code, status


def classify_error(exc: BaseException) -> ErrorClass:
    """Decide whether a failed storage call should be retried, and with which backoff.

    Pure function of the exception and its cause chain. Throttling wins over everything (an S3 SlowDown arrives
    as an ``OSError(EBUSY)`` whose cause is the ClientError), then not-found, then permission/auth errors, then
    connection errors, timeouts and 5xx. A lost multipart upload (``NoSuchUpload``) is TRANSIENT although it
    arrives as a 404: the write starts over. A TLS error is TRANSIENT unless a certificate failed verification.
    A request the HTTP client refuses to send (a header holding a newline) is FATAL, though botocore wraps it in
    an HTTPClientError, like the dropped connections it also reports that way.
    Anything unrecognised is FATAL: retrying a bug only hides it.
    """
    found: set[ErrorClass] = set()
    for e in _exception_chain(exc):
        code, status = _code_and_status(e)
        names = {klass.__name__ for klass in type(e).__mro__}
        # The throttle phrases are a last resort for errors that carry no code or status, and never read a file
        # name: a root such as /data/slowdown/ must not turn a missing directory into minutes of retries.
        try:
            text = ("" if code is not None or status is not None
                    else (e.strerror or "") if isinstance(e, OSError) and (e.filename or e.filename2)
                    else str(e)).lower()
        except Exception:  # noqa: BLE001 - a broken __str__ must not break classification
            text = ""
        if code in _LOST_UPLOAD_CODES:
            return ErrorClass.TRANSIENT
        if is_throttle(code, status) or any(t in text for t in _THROTTLE_TEXT):
            found.add(ErrorClass.THROTTLE)
        elif isinstance(e, FileNotFoundError) or code in _NOT_FOUND_CODES or status == 404:
            found.add(ErrorClass.NOT_FOUND)
        elif (isinstance(e, PermissionError) or code in _AUTH_CODES or status in (401, 403)
              or names & _AUTH_CLASS_NAMES):
            found.add(ErrorClass.FATAL)
        elif _malformed_request(e):
            found.add(ErrorClass.FATAL)
        elif names & (_TLS_CLASS_NAMES | _CERT_CLASS_NAMES):
            found.add(ErrorClass.FATAL if _certificate_failure(e) else ErrorClass.TRANSIENT)
        elif (isinstance(e, (ConnectionError, TimeoutError, socket.timeout, asyncio.TimeoutError))
              or names & _TRANSIENT_CLASS_NAMES or code in _TRANSIENT_CODES
              or status in (408, 500, 502, 504)
              or (isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS)):
            found.add(ErrorClass.TRANSIENT)
    for cls in (ErrorClass.THROTTLE, ErrorClass.NOT_FOUND, ErrorClass.FATAL, ErrorClass.TRANSIENT):
        if cls in found:
            return cls
    return ErrorClass.FATAL


def backoff_delay(attempt: int, base_s: float, cap_s: float, u: float) -> float:
    """Full-jitter exponential backoff: ``u * min(cap, base * 2**(attempt-1))`` for ``u`` uniform in [0, 1).

    Full jitter (rather than a fixed schedule) spreads the retries of many ranks hitting the same throttled
    prefix, so they do not come back in lockstep.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    return max(0.0, min(1.0, u)) * min(cap_s, base_s * 2.0 ** min(attempt - 1, 60))  # 2**1024 overflows
