"""The hot-load client's HTTP layer: one request on the wire, the base URL check, and what a status means.

Kept apart from :mod:`fsdp_hotload.fireworks` so the client there reads as protocol (signal, hint, poll) while
the rules about the wire (how long one exchange may take, which statuses are worth retrying or polling through,
what to tell the user about each) live, and are tested, in one place.

Name lookup and connection under a deadline live in :mod:`fsdp_hotload.fireworks_connect`, the choice of a
proxy and its tunnel in :mod:`fsdp_hotload.fireworks_proxy`.

Only the standard library speaks HTTP here (``http.client``): the client must work in trainer images where
``requests`` is not installed.

Example::

    base = check_url("https://api.fireworks.ai", False, "base_url")
    reply = send_once(base, "GET", "/hot_load/v1/models/hot_load", None, hdrs, 30.0, ctx)  # -> Reply
    stop = Canceller()  # stop.cancel() from another thread ends a send_once(..., canceller=stop) at once
"""
from __future__ import annotations

import contextlib
import email.utils
import http.client
import ipaddress
import json
import os
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import NamedTuple

from .fireworks_connect import Canceller, Deadline, RequestCancelled, open_socket
from .fireworks_names import API_KEY_ENV
from .fireworks_proxy import ProxyRefused, ProxyUnsupported, open_tunnel, proxy_auth, proxy_for, refusal_hint
from .masking import mask_url, url_has_credentials

#: The most of a response body the client reads. A status is a few hundred bytes per replica and an error a
#: sentence: more is not an answer from the hot-load API, and must not fill the trainer's memory.
MAX_RESPONSE_BYTES = 1 << 20
#: The most of a server's error message kept: it is logged at every retry and quoted in the error raised.
MAX_MESSAGE_CHARS = 500
_CHUNK = 64 * 1024

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Statuses that will not change by polling again: waiting would only hide a configuration error. (So does every
# redirect: the client never follows one, see hint_for.)
_FATAL_POLL_STATUS = frozenset({400, 401, 403, 404, 405, 407, 410, 415, 422})

_NOT_A_SIGNAL_400 = ("the server rejected the request: check model_id (or account_id) and deployment_id, which "
                     "the fireworks-model and fireworks-deployment headers carry, and hotload_api_headers")
_HINTS: dict[int, str] = {
    400: "the server rejected the request: check the identity and incremental_snapshot_metadata "
    "(the previous identity must be the snapshot the deployment serves now; after a ledger reset or a failed "
    "load, publish a full snapshot)",
    401: f"the API key was not accepted: set {API_KEY_ENV} to a valid key (inference-only keys get 401 on "
    "hot-load and training APIs)",
    403: "the key lacks permission for this account or deployment: check account_id and deployment_id, and that "
    "the key belongs to that account",
    404: "not found: check base_url (hotload_api_url), account_id and deployment_id, and that the deployment was "
    "created with hot-load enabled",
    405: "the server does not allow this method on this path: check that base_url (hotload_api_url) points at "
    "the hot-load API, with no extra path",
    407: "a proxy asks for credentials: give them in the proxy URL, HTTPS_PROXY (HTTP_PROXY for an http:// API) "
    "=http://user:password@host:port, or name the API's host in NO_PROXY if it is reachable directly",
    408: "the server timed out reading the request: check the network path and retry",
    409: "conflict: every snapshot needs a new identity; publish under a fresh identity",
    410: "gone: the deployment or the route was removed; check deployment_id and base_url (hotload_api_url)",
    415: "the server did not accept the request's Content-Type: additional_headers must not replace "
    "'Content-Type: application/json'",
    429: "rate limited and the retry budget is spent: signal and poll less often, or raise retry_budget_s "
         "(HotloadConfig: ready_timeout_s, capped at 300 s)",
    500: "server error and the retry budget is spent: check the deployment's status; publish a full snapshot "
    "once it is healthy",
}


def hint_for(status: int | None, location: str | None = None, *, signal: bool = True) -> str | None:
    """What to do about an HTTP ``status`` that ended a request (None when there is nothing specific to say);
    ``location`` is a redirect's ``Location`` header; ``signal``: the request was a signal (a 400 to a status
    poll or a hint is not about the identity or the delta's parent, which only a signal carries)."""
    if status is None:
        return None
    if status in (400, 422) and not signal:
        return _NOT_A_SIGNAL_400
    if 300 <= status < 400:
        # Not followed on purpose: a redirect would carry the Authorization header to wherever it points.
        target = f" ({location})" if location else ""
        return f"the server redirects this request: point hotload_api_url at the final URL{target}; the client " \
            "does not follow redirects, which would send the API key on"
    if status in _HINTS:
        return _HINTS[status]
    if status == 422:
        return _HINTS[400]
    if 500 <= status < 600:
        return _HINTS[500]
    return None


def redirect_base(location: str, path: str) -> str:
    """A redirect's ``Location`` without the request's ``path`` (and any query) at its end: the base URL to set.
    Why: the Location names the request's own URL, and a hotload_api_url set to it had every request's path added
    a second time (a 404)."""
    target = location.partition("#")[0].partition("?")[0]
    return target[:-len(path)] if path and target.endswith(path) and target != path else target


CA_BUNDLE_VARS = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
_CERT_HINT = "check the host name of base_url (hotload_api_url) and the system CA certificates; for a private CA " \
    "(a gateway's own, a TLS-inspecting proxy) point SSL_CERT_FILE, or REQUESTS_CA_BUNDLE, at its PEM bundle"

#: What OpenSSL's strict mode (``VERIFY_X509_STRICT``, on in Python 3.13's default context) refuses in a chain a
#: trusted CA signed: extensions a certificate lacks or marks wrongly (OpenSSL's messages, lower-cased).
_STRICT_CHECKS = ("authority key identifier", "subject key identifier", "basic constraints", "key usage")


def tls_context() -> ssl.SSLContext:
    """The TLS settings of the client: the system's CA certificates (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` where
    set), or, as ``requests`` does, only the bundle that ``REQUESTS_CA_BUNDLE`` (else ``CURL_CA_BUNDLE``) names
    when ``SSL_CERT_FILE`` is not set. Why: users behind a private CA set those for requests, pip and
    huggingface_hub, and the hot-load client refused the same gateway that every other tool on the host trusted."""
    if not os.environ.get("SSL_CERT_FILE"):
        for name in CA_BUNDLE_VARS:
            path = os.environ.get(name, "").strip()
            if not path:
                continue
            folder = os.path.isdir(path)
            try:
                return ssl.create_default_context(cafile=None if folder else path, capath=path if folder else None)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"{name}={path!r} cannot be read as CA certificates ({exc}): point it at a PEM "
                                 "bundle (or a folder of hashed certificates), or unset it") from None
    return ssl.create_default_context()


def unsendable(exc: BaseException, base: urllib.parse.SplitResult) -> tuple[str, str] | None:
    """What to say, and what to do, about a failure of :func:`send_once` that no retry can pass; None for one
    that is worth a retry (an ``OSError`` or ``HTTPException`` that is none of these)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = str(getattr(exc, "verify_message", "") or exc)
        if any(check in why.lower() for check in _STRICT_CHECKS):  # the CA is trusted; its certificates are not
            return f"TLS certificate verification failed: {exc}", (
                f"the certificate chain fails a strict X.509 check ({why}) that Python 3.13 and later make by "
                "default: trusting the CA (SSL_CERT_FILE, REQUESTS_CA_BUNDLE) cannot waive it; have the CA's "
                "certificates reissued with that extension, or run on Python 3.12")
        return f"TLS certificate verification failed: {exc}", _CERT_HINT
    if isinstance(exc, NotTLS):
        return str(exc), "the server at this port does not speak TLS: use http:// (for a host other than " \
            "loopback, with HotloadConfig.hotload_api_allow_http) or the port that serves TLS"
    if isinstance(exc, ProxyRefused):
        return str(exc), refusal_hint(exc.status, base)
    if isinstance(exc, http.client.InvalidURL):  # an HTTPException, yet no retry can send it
        return f"the URL cannot be sent: {exc}", "check base_url (hotload_api_url), control_plane_url and the " \
            "account and deployment ids (no spaces or control characters)"
    if isinstance(exc, ProxyUnsupported):
        return str(exc), "set HTTPS_PROXY (HTTP_PROXY for an http:// API) to an http:// proxy, or name the API's " \
            "host in NO_PROXY"
    if isinstance(exc, (OSError, http.client.HTTPException)):
        return None
    # e.g. ValueError/UnicodeError for a bad header value. The text may quote a header, the Authorization one.
    return f"the request could not be sent: {type(exc).__name__}: {exc}", "check additional_headers, the API key " \
        "and source_url (printable ASCII only)"


def fatal_while_polling(status: int | None, *, signalled: bool) -> bool:
    """True when a status poll that got ``status`` should end the wait at once: polling again cannot change it
    (a redirect, a refused method or body, a route that is gone, auth). A 404 after a signal was accepted is the
    route lagging (the reference client polls through it); before one (the manager wait) it is the
    misconfiguration its hint names."""
    if status is not None and 300 <= status < 400:
        return True
    return status in _FATAL_POLL_STATUS and not (status == 404 and signalled)


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_CREDENTIALS_REFUSED = ("must not carry credentials before its host ('user:password@'); pass a gateway's "
                        "credentials as headers (HotloadConfig.hotload_api_headers)")


def check_url(url: str, allow_insecure: bool, field: str) -> urllib.parse.SplitResult:
    """``url`` split, once it is known to be one this client can send to (``field`` names it in errors).

    Credentials before the host are refused first, and every other error shows the URL masked: a gateway's
    password in the URL was printed by whichever check failed before the credentials one."""
    if url_has_credentials(url.strip()):  # never sent, so refusing them costs nothing
        raise ValueError(f"{field} {_CREDENTIALS_REFUSED}")
    parts = urllib.parse.urlsplit(url)
    shown = mask_url(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{field} {shown!r} must be an http(s) URL with a host")
    if parts.scheme == "http" and not allow_insecure and not is_loopback(parts.hostname):
        raise ValueError(
            f"{field} {shown!r} uses plain http to a non-loopback host, which would send the API key in clear "
            "text; use https (or allow_insecure=True, HotloadConfig.hotload_api_allow_http, for a trusted "
            "private network)"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"{field} {shown!r} must not carry a query or fragment")
    try:  # read here: a bad port otherwise surfaced only at the first request, as an unrelated error
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError(f"{field} {shown!r} has an invalid port: give a number from 1 to 65535")
    bad = [c for c in parts.path if not "\x21" <= c <= "\x7e"]
    if bad:  # http.client refuses to send such a path
        raise ValueError(f"{field} {shown!r} has {bad[0]!r} in its path: percent-encode it (a space is %20)")
    if parts.username is not None or parts.password is not None:  # an '@' the pattern above did not read as one
        raise ValueError(f"{field} {_CREDENTIALS_REFUSED}")
    return parts


def extract_server_message(body: bytes, redact: Callable[[str], str] | None = None) -> str:
    """The server's error message: ``error.message``, a string ``error``, any JSON, or the start of the text.

    ``redact`` (a client's secret remover) runs on the raw text and again on every decoded string, each time
    before anything is cut short. Why twice: a server that echoes a header escapes it in its JSON (``\\/`` for
    '/', ``\\u00xx``), which the raw text does not match and decoding turns back into the secret."""
    clean: Callable[[str], str] = redact or (lambda text: text)
    text = clean(body.decode("utf-8", errors="replace"))
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the parser goes
        return text.strip()[:200]
    # Every branch is cut short: the message goes into each retry's log line and into the error raised.
    if isinstance(obj, dict) and "error" in obj:
        err = obj["error"]
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return clean(err["message"])[:MAX_MESSAGE_CHARS]
        if isinstance(err, str):
            return clean(err)[:MAX_MESSAGE_CHARS]
    if isinstance(obj, dict) and isinstance(obj.get("message"), str):
        return clean(obj["message"])[:MAX_MESSAGE_CHARS]
    return clean(json.dumps(obj))[:MAX_MESSAGE_CHARS]


class Headers(dict):  # type: ignore[type-arg]
    """Request headers whose repr names the keys only: tracebacks that record locals (Sentry, rich, pytest
    --showlocals) and debuggers print the dict that holds ``Authorization: Bearer <key>``."""

    def __repr__(self) -> str:
        return f"<headers {sorted(self)}, values hidden>"


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delay-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    parsed = email.utils.parsedate_tz(value)
    if parsed is None:
        return None
    try:
        return max(0.0, email.utils.mktime_tz(parsed) - time.time())
    except (ValueError, OverflowError):  # a date out of range (year 10000): unreadable, like any other
        return None


class Reply(NamedTuple):
    """One answer: status, lower-cased headers, the body (at most ``MAX_RESPONSE_BYTES`` of it), and whether the
    server sent more than that."""

    status: int
    headers: dict[str, str]
    body: bytes
    oversized: bool


class _Watchdog:
    """Shuts one exchange's socket down at its deadline, or when its canceller fires.

    Why: a socket timeout bounds each read, not the exchange. ``http.client`` reads the status line and up to 100
    header lines of 64 KiB each under that per-read timeout, so a server (or proxy) trickling them a byte at a
    time held a status poll far past the caller's deadline. A shut-down socket reads as end of file at once; the
    caller then asks :meth:`finish` why, since a cut body can look complete to ``http.client``."""

    def __init__(self, conn: http.client.HTTPConnection, deadline: Deadline, canceller: Canceller | None) -> None:
        self._conn = conn
        self._deadline = deadline
        self._canceller = canceller
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._done = False
        self.fired: str | None = None  # "deadline", "until" or "cancelled"
        try:  # started before it is registered: a thread that cannot start leaves no waker in the canceller
            threading.Thread(target=self._run, name="hotload-http-watchdog", daemon=True).start()
        except Exception as exc:  # noqa: BLE001 - a process at its thread limit: transient, retried
            raise NotSent(f"cannot start the request's watchdog thread: {type(exc).__name__}: {exc}") from None
        if canceller is not None:
            canceller.watch(self._wake)

    def _run(self) -> None:
        self._deadline.wait(self._wake)
        with self._lock:
            if self._done:
                return
            cancelled = self._canceller is not None and self._canceller.cancelled
            self.fired = "cancelled" if cancelled else self._deadline.why()
            sock = self._conn.sock
            if sock is not None:  # the plain socket's shutdown, also under TLS: it only wakes the reader
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def finish(self) -> str | None:
        """Stop watching; returns why the exchange was cut (None when it was not)."""
        with self._lock:
            self._done = True
        self._wake.set()
        if self._canceller is not None:
            self._canceller.unwatch(self._wake)
        return self.fired


class _TLSConnection(http.client.HTTPSConnection):
    """An HTTPS connection whose TLS handshake its watchdog can cut.

    Why: ``HTTPSConnection.connect`` hands the plain socket to ``wrap_socket``, which moves its descriptor to a new
    TLS socket and runs the handshake before ``sock`` names that one; a watchdog that fired meanwhile shut down a
    detached socket (EBADF), and a server or tunnel that never answered the ClientHello held ``cancel()`` and the
    caller's ``until()`` (``straggler_wait_s``) until the attempt's socket timeout (60 s by default)."""

    def __init__(self, host: str, port: int, timeout: float, context: ssl.SSLContext | None,
                 progress: _Progress) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self.progress = progress
        self.watchdog: _Watchdog | None = None  # set once the watchdog is made (it needs the connection)

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # TCP (through the proxy's tunnel where there is one)
        self.progress.phase = "tls"
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self.host,  # type: ignore[attr-defined]
                                              do_handshake_on_connect=False)
        # From here the watchdog shuts down the socket the handshake reads; one that fired while the descriptor
        # moved found nothing to shut down.
        if self.watchdog is not None and self.watchdog.fired is not None:
            raise ConnectionAbortedError("the exchange was cut before its TLS handshake")
        self.sock.do_handshake()


def send_once(
    base: urllib.parse.SplitResult, method: str, path: str, payload: bytes | None, headers: dict[str, str],
    timeout: float, context: ssl.SSLContext | None, canceller: Canceller | None = None,
    until: Callable[[], float] | None = None,
) -> Reply:
    """One exchange, no retries, done within ``timeout`` seconds, or by ``until()`` where that comes first (see
    :class:`Deadline`). Raises OSError/HTTPException on failure (TimeoutError past either, saying how far the
    exchange got; ``status_seen`` set on an error raised after the status line came) and
    :class:`RequestCancelled` once ``canceller`` is cancelled.

    Why the body is read here in pieces: a plain ``read()`` holds whatever size the server sends. The deadline
    covers the whole exchange, status line and headers included (see :class:`_Watchdog`)."""
    deadline = Deadline(timeout, until)
    if canceller is not None and canceller.cancelled:
        raise RequestCancelled("the client was cancelled")
    # An explicit port: given None, http.client re-parses the host, and an IPv6 literal ("::1") becomes host ":"
    # on port 1.
    host, port = base.hostname or "", base.port or (443 if base.scheme == "https" else 80)
    url = base.path.rstrip("/") + path
    proxy = proxy_for(base)
    progress = _Progress(None if proxy is None else mask_url(urllib.parse.urlunsplit(proxy)))

    def direct(address: tuple[str, int], *_: object) -> socket.socket:
        # Resolution and connection under the deadline and the canceller, which http.client's own connect ignores.
        return open_socket(address, deadline, canceller)

    def to_proxy(address: tuple[str, int]) -> socket.socket:
        conn.sock = open_socket(address, deadline, canceller)  # watched while the tunnel is asked for
        progress.phase = "tunnel"
        return conn.sock

    if proxy is None:
        conn: http.client.HTTPConnection = _TLSConnection(host, port, timeout, context, progress) \
            if base.scheme == "https" else http.client.HTTPConnection(host, port, timeout=timeout)
        conn._create_connection = direct  # type: ignore[attr-defined]
    elif base.scheme == "https":  # a CONNECT tunnel through the proxy; TLS with the API's host end to end
        conn = _TLSConnection(host, port, timeout, context, progress)
        conn._create_connection = lambda *_: open_tunnel(proxy, host, port, to_proxy)  # type: ignore[attr-defined]
    else:  # plain HTTP: the proxy takes the absolute URL
        conn = http.client.HTTPConnection(proxy.hostname or "", proxy.port or 80, timeout=timeout)
        conn._create_connection = direct  # type: ignore[attr-defined]
        url = urllib.parse.urlunsplit((base.scheme, base.netloc, url, "", ""))
        headers = {**headers, **proxy_auth(proxy)}
    watchdog = _Watchdog(conn, deadline, canceller)
    if isinstance(conn, _TLSConnection):
        conn.watchdog = watchdog
    try:
        try:
            reply = _exchange(conn, method, url, payload, headers, deadline, watchdog, progress)
        except Exception as exc:
            why = watchdog.finish()
            if why is None or (why != "cancelled" and isinstance(exc, NotSent)):  # a timed-out connect sent nothing
                if isinstance(exc, TimeoutError) and not isinstance(exc, (NotSent, ExchangeTimeout)):
                    raise progress.mark(ExchangeTimeout(f"timed out {progress}")) from None  # a socket read's own
                if why is not None and not isinstance(exc.__cause__, TimeoutError):  # cut by the watchdog: the
                    raise NotSent(str(_cut(why, deadline, progress))) from None  # reader saw only an end of file
                raise progress.mark(exc)
            # Not chained: the reader's error (an end of file, a reset) only says the socket was shut down.
            raise progress.mark(_cut(why, deadline, progress)) from None
        why = watchdog.finish()
        if why is not None:  # the body may have been cut short and still parsed as whole
            raise progress.mark(_cut(why, deadline, progress))
        return reply
    finally:
        watchdog.finish()
        conn.close()


class _Progress:
    """How far one exchange got, for the error that ends it: no answer at all (a hung server, a proxy that drops
    the request) and a body that stopped (a slow or cut stream) need different fixes."""

    def __init__(self, proxy: str | None) -> None:
        self.proxy = proxy  # the proxy's masked URL, None for a direct connection
        # connecting, tunnel (asking the proxy), tls, connected, status (the request sent), body
        self.phase = "connecting"
        self.got = 0
        self.length: int | None = None

    def __str__(self) -> str:
        if self.phase == "connecting":
            return "while connecting" + (f" via proxy {self.proxy}" if self.proxy else "")
        if self.phase == "tunnel":
            return f"while waiting for the proxy {self.proxy} to answer CONNECT"
        if self.phase == "tls":
            return "during the TLS handshake" + (f" (through the tunnel of proxy {self.proxy})" if self.proxy else "")
        if self.phase == "connected":
            return "as the connection was made, before the request was sent"
        if self.phase == "status":
            return "while waiting for the status line (the request was sent)"
        of = f" of {self.length}" if self.length is not None else ""
        return f"while reading the body, after {self.got}{of} bytes"

    def mark(self, exc: BaseException) -> BaseException:
        """``exc``, with ``status_seen`` set once a status line came: the caller then does not say "no answer"."""
        if self.phase == "body":
            with contextlib.suppress(AttributeError, TypeError):
                exc.status_seen = True  # type: ignore[attr-defined]
        return exc


class ExchangeTimeout(TimeoutError):
    """A timeout whose message says how far the exchange got."""


def status_seen(exc: BaseException) -> bool:
    """Whether ``exc`` ended an exchange after its status line came (the server did answer, in part)."""
    return bool(getattr(exc, "status_seen", False))


class NotSent(ConnectionError):
    """The connection (or a proxy's tunnel) could not be made: the request never reached the server. Why tell it
    apart: an answer to a retry (a 409 for an identity already used) means the server took an earlier attempt
    only if one was sent."""


class NotTLS(ConnectionError):
    """The server at an ``https://`` URL's port answered the TLS handshake with something else (a plain-HTTP port):
    nothing was sent, and no retry can change it."""


#: OpenSSL's reasons for a handshake answered by something that is not TLS (a plain-HTTP server's error page).
_NOT_TLS_REASONS = frozenset({"WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE"})


def _exchange(conn: http.client.HTTPConnection, method: str, url: str, payload: bytes | None,
              headers: dict[str, str], deadline: Deadline, watchdog: _Watchdog, progress: _Progress) -> Reply:
    via = f"via proxy {progress.proxy}: " if progress.proxy else ""
    try:
        conn.connect()
    except (ssl.SSLCertVerificationError, ProxyRefused):  # not sent either, but no retry can pass it
        raise
    except ssl.SSLError as exc:
        if exc.reason not in _NOT_TLS_REASONS:
            raise NotSent(f"{via}{type(exc).__name__}: {exc}") from exc
        raise NotTLS(f"{conn.host}:{conn.port} does not speak TLS (the handshake got {exc.reason})") from None
    except OSError as exc:
        if isinstance(exc, TimeoutError) and progress.phase in ("tunnel", "tls"):
            # The socket's own timeout, set to the deadline: on a loaded machine it can end the handshake (or the
            # wait for the proxy's CONNECT answer) before the watchdog wakes. Said as the watchdog says it.
            raise NotSent(str(_cut(deadline.why(), deadline, progress))) from exc
        raise NotSent(f"{via}{type(exc).__name__}: {exc}") from exc
    progress.phase = "connected"
    try:  # the deadline may have passed, or a cancel come, as the connection was made: send nothing then
        _time_left(conn, deadline, watchdog, progress)
    except ExchangeTimeout as exc:
        raise NotSent(str(exc)) from None
    conn.request(method, url, body=payload, headers=headers)
    progress.phase = "status"
    _time_left(conn, deadline, watchdog, progress)
    resp = conn.getresponse()
    progress.phase, progress.length = "body", resp.length
    status, rheaders = resp.status, {k.lower(): v for k, v in resp.getheaders()}
    chunks: list[bytes] = []
    got = 0
    while got <= MAX_RESPONSE_BYTES:
        _time_left(conn, deadline, watchdog, progress)
        chunk = resp.read1(min(_CHUNK, MAX_RESPONSE_BYTES + 1 - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
        progress.got = got
    body = b"".join(chunks)
    if got <= MAX_RESPONSE_BYTES and resp.length:  # read1 ends at an early end of file without a word
        raise http.client.IncompleteRead(body, resp.length)
    return Reply(status, rheaders, body[:MAX_RESPONSE_BYTES], got > MAX_RESPONSE_BYTES)


def _cut(why: str, deadline: Deadline, progress: _Progress) -> Exception:
    if why == "cancelled":
        return RequestCancelled("the client was cancelled while the request was on the wire")
    if why == "until":
        return ExchangeTimeout(f"the caller's wait ended {time.monotonic() - deadline.start:.1f}s into the exchange, "
                              f"{progress}")
    within = f"within {deadline.timeout:.1f}s"
    if progress.phase == "tunnel":
        return ExchangeTimeout(f"the proxy {progress.proxy} did not answer CONNECT {within}; nothing was sent")
    if progress.phase == "tls":
        via = f" (through the tunnel of proxy {progress.proxy})" if progress.proxy else ""
        return ExchangeTimeout(f"the server did not answer the TLS handshake {within}{via}; nothing was sent")
    if progress.phase == "connecting":
        return ExchangeTimeout(f"no connection was made {within} {progress}; nothing was sent")
    if progress.phase == "connected":
        return ExchangeTimeout(f"the connection took all of the {deadline.timeout:.1f}s; nothing was sent")
    return ExchangeTimeout(f"the response did not arrive in full {within}: no answer came {progress}"
                           if progress.phase == "status" else
                           f"the response did not arrive in full {within}: stopped {progress}")


def _time_left(conn: http.client.HTTPConnection, deadline: Deadline, watchdog: _Watchdog,
               progress: _Progress) -> None:
    """Let the next socket read wait only until ``deadline``; raise once it has passed or the watchdog fired
    (it may have fired while the socket was still being connected, with nothing to shut down)."""
    if watchdog.fired is not None:
        raise _cut(watchdog.fired, deadline, progress)
    left = deadline.left()
    if left <= 0:
        raise _cut(deadline.why(), deadline, progress)
    if conn.sock is not None:
        conn.sock.settimeout(left)
