"""The hot-load client's HTTP layer: one request on the wire, the base URL check, and what a status means.

Kept apart from :mod:`fsdp_hotload.fireworks` so the client there reads as protocol (signal, hint, poll) while
the rules about the wire (how long one exchange may take, which statuses are worth retrying or polling through,
what to tell the user about each) live, and are tested, in one place.

Only the standard library speaks HTTP here (``http.client``): the client must work in trainer images where
``requests`` is not installed.

Example::

    base = check_url("https://api.fireworks.ai", False, "base_url")
    reply = send_once(base, "GET", "/hot_load/v1/models/hot_load", None, hdrs, 30.0, ctx)  # -> Reply
    stop = Canceller()  # stop.cancel() from another thread ends a send_once(..., canceller=stop) at once
"""
from __future__ import annotations

import base64
import contextlib
import email.utils
import errno
import http.client
import ipaddress
import json
import os
import select
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

from .fireworks_names import API_KEY_ENV
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
_FATAL_POLL_STATUS = frozenset({400, 401, 403, 404, 405, 410, 415, 422})

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


class RequestCancelled(Exception):
    """The exchange was ended by :meth:`Canceller.cancel` (the client's owner is closing)."""


class Canceller:
    """Ends a client's waits and the exchanges it has on the wire, from any thread.

    Why: a publisher that gives up on a snapshot (``close(timeout=)``) leaves its thread waiting for the
    deployment's replicas for up to ``ready_timeout_s``; cancelling lets that thread end, and free what it holds,
    at once rather than minutes later. Sleeps between polls and retries use :meth:`wait`."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._wakers: set[threading.Event] = set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        self._event.set()
        with self._lock:
            for waker in self._wakers:
                waker.set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True (at once) when cancelled."""
        return self._event.wait(max(0.0, seconds))

    def watch(self, waker: threading.Event) -> None:
        with self._lock:
            self._wakers.add(waker)
            if self._event.is_set():
                waker.set()

    def unwatch(self, waker: threading.Event) -> None:
        with self._lock:
            self._wakers.discard(waker)


#: How often a wait re-reads a caller's ``until()``: a straggler's wait may end this much after its release.
_SLICE_S = 0.1


class _Deadline:
    """When one exchange must end: ``timeout`` after it began, or sooner once the caller's ``until()`` (a
    ``time.monotonic()`` value, re-read every :data:`_SLICE_S` while waiting) comes first, though not before
    ``min(timeout, 0.5)`` s, the least an attempt gets to have a chance.

    Why a moving end: a status poll to a region that stopped answering began before another deployment served the
    snapshot, so only its own ``timeout`` (60 s by default) ended it, long after ``straggler_wait_s`` released the
    wait it serves."""

    def __init__(self, timeout: float, until: Callable[[], float] | None) -> None:
        self.start = time.monotonic()
        self.timeout = timeout
        self._fixed = self.start + timeout
        self._floor = self.start + min(timeout, 0.5)
        self._until = until

    def at(self) -> float:
        if self._until is None:
            return self._fixed
        return min(self._fixed, max(self._floor, self._until()))

    def left(self) -> float:
        return self.at() - time.monotonic()

    def why(self) -> str:
        """What ended the exchange once :meth:`left` is spent: its own timeout, or the caller's ``until()``."""
        return "deadline" if self.at() >= self._fixed else "until"

    def wait(self, event: threading.Event) -> bool:
        """Wait for ``event`` until the end; True when it was set."""
        while not event.is_set():
            left = self.left()
            if left <= 0:
                break
            event.wait(left if self._until is None else min(left, _SLICE_S))
        return event.is_set()


class _Watchdog:
    """Shuts one exchange's socket down at its deadline, or when its canceller fires.

    Why: a socket timeout bounds each read, not the exchange. ``http.client`` reads the status line and up to 100
    header lines of 64 KiB each under that per-read timeout, so a server (or proxy) trickling them a byte at a
    time held a status poll far past the caller's deadline. A shut-down socket reads as end of file at once; the
    caller then asks :meth:`finish` why, since a cut body can look complete to ``http.client``."""

    def __init__(self, conn: http.client.HTTPConnection, deadline: _Deadline, canceller: Canceller | None) -> None:
        self._conn = conn
        self._deadline = deadline
        self._canceller = canceller
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._done = False
        self.fired: str | None = None  # "deadline", "until" or "cancelled"
        if canceller is not None:
            canceller.watch(self._wake)
        threading.Thread(target=self._run, name="hotload-http-watchdog", daemon=True).start()

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


def send_once(
    base: urllib.parse.SplitResult, method: str, path: str, payload: bytes | None, headers: dict[str, str],
    timeout: float, context: ssl.SSLContext, canceller: Canceller | None = None,
    until: Callable[[], float] | None = None,
) -> Reply:
    """One exchange, no retries, done within ``timeout`` seconds, or by ``until()`` where that comes first (see
    :class:`_Deadline`). Raises OSError/HTTPException on failure (TimeoutError past either) and
    :class:`RequestCancelled` once ``canceller`` is cancelled.

    Why the body is read here in pieces: a plain ``read()`` holds whatever size the server sends. The deadline
    covers the whole exchange, status line and headers included (see :class:`_Watchdog`)."""
    deadline = _Deadline(timeout, until)
    if canceller is not None and canceller.cancelled:
        raise RequestCancelled("the client was cancelled")
    # An explicit port: given None, http.client re-parses the host, and an IPv6 literal ("::1") becomes host ":"
    # on port 1.
    host, port = base.hostname or "", base.port or (443 if base.scheme == "https" else 80)
    url = base.path.rstrip("/") + path
    proxy = proxy_for(base)
    if proxy is None:
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=timeout, context=context) if base.scheme == "https" else \
            http.client.HTTPConnection(host, port, timeout=timeout)
    elif base.scheme == "https":  # a CONNECT tunnel through the proxy; TLS with the API's host end to end
        conn = http.client.HTTPSConnection(proxy.hostname or "", proxy.port or 80, timeout=timeout, context=context)
        conn.set_tunnel(host, port, headers=_proxy_auth(proxy))
    else:  # plain HTTP: the proxy takes the absolute URL
        conn = http.client.HTTPConnection(proxy.hostname or "", proxy.port or 80, timeout=timeout)
        url = urllib.parse.urlunsplit((base.scheme, base.netloc, url, "", ""))
        headers = {**headers, **_proxy_auth(proxy)}
    # Resolution and connection under the deadline and the canceller, which http.client's own connect ignores.
    conn._create_connection = lambda address, *_: _open(address, deadline, canceller)  # type: ignore[attr-defined]
    watchdog = _Watchdog(conn, deadline, canceller)
    try:
        try:
            reply = _exchange(conn, method, url, payload, headers, deadline, watchdog)
        except Exception as exc:
            why = watchdog.finish()
            if why is None or (why != "cancelled" and isinstance(exc, NotSent)):  # a timed-out connect sent nothing
                raise
            # Not chained: the reader's error (an end of file, a reset) only says the socket was shut down.
            raise _cut(why, deadline) from None
        why = watchdog.finish()
        if why is not None:  # the body may have been cut short and still parsed as whole
            raise _cut(why, deadline)
        return reply
    finally:
        watchdog.finish()
        conn.close()


def _open(address: tuple[str, int], deadline: _Deadline, canceller: Canceller | None) -> socket.socket:
    """A connected socket to ``address`` (a name, or a literal), by the deadline and until cancelled.

    Why not ``socket.create_connection``: its name lookup takes no timeout and cannot be interrupted (glibc waits
    5 s per attempt per nameserver when one does not answer), and each address gets the full timeout, so a stalled
    resolver or a dropped SYN held a signal, a status poll or ``close()`` past its deadline and past ``cancel()``.
    Addresses are tried in the resolver's order, each with what is left of the time."""
    host, port = address
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in _resolve(host, port, deadline, canceller):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as exc:  # e.g. IPv6 turned off in the kernel: the next address may be IPv4
            last = exc
            continue
        try:
            _connect(sock, sockaddr, host, deadline, canceller)
        except BaseException as exc:
            sock.close()
            if not isinstance(exc, OSError) or isinstance(exc, TimeoutError):  # cancelled, or out of time
                raise
            last = exc  # refused or unreachable: the next address may answer
        else:
            return sock
    raise last if last is not None else OSError(f"no address to connect to for {host}")


class _Lookup:
    """One name lookup in flight, shared by every request for the same host and port meanwhile: retries and
    status polls against a stalled resolver wait on it rather than each leaving a thread behind."""

    def __init__(self) -> None:
        self.answer: list[object] = []  # the address list, or the lookup's exception, once it has ended
        self.waiters: set[threading.Event] = set()


_lookups: dict[tuple[str, int], _Lookup] = {}
_lookups_lock = threading.Lock()


def _resolve(host: str, port: int, deadline: _Deadline, canceller: Canceller | None) -> list[tuple[Any, ...]]:
    """``getaddrinfo`` on a daemon thread, waited for until the deadline or a cancel. A lookup left behind ends
    when the resolver gives up; its thread holds nothing of the client's."""
    with contextlib.suppress(ValueError):  # a literal address: nothing to look up, nothing to wait for
        ipaddress.ip_address(host.partition("%")[0])
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    woken = threading.Event()
    with _lookups_lock:
        lookup = _lookups.get((host, port))
        fresh = lookup is None
        if lookup is None:
            lookup = _lookups[(host, port)] = _Lookup()
        lookup.waiters.add(woken)
    if fresh:
        try:
            threading.Thread(target=_look_up, args=(host, port, lookup), name="hotload-resolve",
                             daemon=True).start()
        except BaseException as exc:  # no thread (a process at its limit): no lookup to wait for, now or later
            with _lookups_lock:
                if _lookups.get((host, port)) is lookup:
                    del _lookups[(host, port)]
                lookup.waiters.discard(woken)
            if isinstance(exc, Exception):
                raise OSError(f"resolving the host name {host!r}: {type(exc).__name__}: {exc}") from None
            raise
    if canceller is not None:
        canceller.watch(woken)
    try:
        deadline.wait(woken)
    finally:
        if canceller is not None:
            canceller.unwatch(woken)
        with _lookups_lock:
            lookup.waiters.discard(woken)
    if canceller is not None and canceller.cancelled:
        raise RequestCancelled("the client was cancelled while the API's host name was being resolved")
    if not lookup.answer:
        raise TimeoutError(f"resolving the host name {host!r} did not finish by the deadline")
    failed = lookup.answer[0]
    if isinstance(failed, BaseException):  # a fresh exception per waiter: one raised in several threads is shared
        try:  # of the same type: a UnicodeError (a label over 63 characters) is no transient error to retry
            fresh_error = type(failed)(*failed.args)
        except Exception:  # noqa: BLE001 - a type that cannot be rebuilt from its args
            fresh_error = OSError(f"resolving the host name {host!r}: {type(failed).__name__}: {failed}")
        raise fresh_error from None
    return cast("list[tuple[Any, ...]]", lookup.answer[0])


def _forget_lookups() -> None:
    """In a forked child: the lookups in flight belong to the parent's threads, which the child does not have."""
    global _lookups_lock
    _lookups.clear()
    _lookups_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_lookups)


def _look_up(host: str, port: int, lookup: _Lookup) -> None:
    try:
        answer: object = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except BaseException as exc:  # noqa: BLE001 - handed to every waiter
        answer = exc
    with _lookups_lock:
        lookup.answer.append(answer)
        del _lookups[(host, port)]
        for waiter in lookup.waiters:
            waiter.set()


def _connect(sock: socket.socket, sockaddr: tuple[Any, ...], host: str, deadline: _Deadline,
             canceller: Canceller | None) -> None:
    """A non-blocking connect, waited for in slices of at most 0.1 s so a cancel ends it (a blocking connect
    cannot be woken from another thread). ``poll``, not ``select``: a trainer may hold over 1024 descriptors."""
    sock.setblocking(False)
    err = sock.connect_ex(sockaddr)
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    while err in (errno.EINPROGRESS, errno.EALREADY, errno.EINTR):  # not EAGAIN: for TCP, a failure (no ports)
        if canceller is not None and canceller.cancelled:
            raise RequestCancelled("the client was cancelled while connecting to the API's host")
        left = deadline.left()
        if left <= 0:
            raise TimeoutError(f"connecting to {host} did not finish by the deadline")
        if poller.poll(max(1, int(min(left, 0.1) * 1000))):  # writable, or an error: SO_ERROR says which
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, f"connecting to {host}: {os.strerror(err)}")
    sock.settimeout(max(0.01, deadline.left()))


class ProxyUnsupported(ValueError):
    """The environment names a proxy the client cannot use (not ``http://``)."""


def proxy_for(base: urllib.parse.SplitResult) -> urllib.parse.SplitResult | None:
    """The proxy a request to ``base`` goes through, as ``curl``, ``requests`` and boto (the snapshot uploads)
    choose it: ``HTTPS_PROXY`` / ``HTTP_PROXY`` by the URL's scheme, unless ``NO_PROXY`` names the host; None for a
    direct connection (always for a loopback host). Why: on clusters whose outbound traffic must pass a proxy, the
    uploads went through it and every signal failed to resolve the API's host. Only an ``http://`` proxy is
    supported (a TLS connection to the proxy itself is not), which is what such variables name almost always."""
    url = urllib.request.getproxies().get(base.scheme)
    if not url or is_loopback(base.hostname or "") or urllib.request.proxy_bypass(base.netloc):
        return None  # a proxy cannot reach this host's loopback (a local emulator or gateway)
    proxy = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if proxy.scheme != "http" or not proxy.hostname:
        raise ProxyUnsupported(f"the {base.scheme} proxy set in the environment ({mask_url(url)}) is not "
                               "supported: the hot-load client reaches the API through an http:// proxy only")
    return proxy


def _proxy_auth(proxy: urllib.parse.SplitResult) -> dict[str, str]:
    """A ``Proxy-Authorization`` header from the proxy URL's ``user:password@`` part (percent-decoded)."""
    if proxy.username is None:
        return {}
    pair = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
    return {"Proxy-Authorization": "Basic " + base64.b64encode(pair.encode()).decode("ascii")}


class NotSent(ConnectionError):
    """The connection (or a proxy's tunnel) could not be made: the request never reached the server. Why tell it
    apart: an answer to a retry (a 409 for an identity already used) means the server took an earlier attempt
    only if one was sent."""


def _exchange(conn: http.client.HTTPConnection, method: str, url: str, payload: bytes | None,
              headers: dict[str, str], deadline: _Deadline, watchdog: _Watchdog) -> Reply:
    try:
        conn.connect()
    except ssl.SSLCertVerificationError:  # not sent either, but no retry can pass it: the caller says so at once
        raise
    except OSError as exc:
        raise NotSent(f"{type(exc).__name__}: {exc}") from exc
    conn.request(method, url, body=payload, headers=headers)
    _time_left(conn, deadline, watchdog)
    resp = conn.getresponse()
    status, rheaders = resp.status, {k.lower(): v for k, v in resp.getheaders()}
    chunks: list[bytes] = []
    got = 0
    while got <= MAX_RESPONSE_BYTES:
        _time_left(conn, deadline, watchdog)
        chunk = resp.read1(min(_CHUNK, MAX_RESPONSE_BYTES + 1 - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    body = b"".join(chunks)
    return Reply(status, rheaders, body[:MAX_RESPONSE_BYTES], got > MAX_RESPONSE_BYTES)


def _cut(why: str, deadline: _Deadline) -> Exception:
    if why == "cancelled":
        return RequestCancelled("the client was cancelled while the request was on the wire")
    if why == "until":
        return TimeoutError(f"the caller's wait ended {time.monotonic() - deadline.start:.1f}s into the exchange, "
                            "before the response arrived in full")
    return TimeoutError(f"the response did not arrive in full within {deadline.timeout:.1f}s")


def _time_left(conn: http.client.HTTPConnection, deadline: _Deadline, watchdog: _Watchdog) -> None:
    """Let the next socket read wait only until ``deadline``; raise once it has passed or the watchdog fired
    (it may have fired while the socket was still being connected, with nothing to shut down)."""
    if watchdog.fired is not None:
        raise _cut(watchdog.fired, deadline)
    left = deadline.left()
    if left <= 0:
        raise _cut(deadline.why(), deadline)
    if conn.sock is not None:
        conn.sock.settimeout(left)
