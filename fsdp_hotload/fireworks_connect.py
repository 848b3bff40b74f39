"""Name lookup and connection for the hot-load client, bounded by a deadline and ended by a canceller.

Kept apart from :mod:`fsdp_hotload.fireworks_http` (one exchange on the wire) because neither ``getaddrinfo`` nor a
blocking ``connect`` honours a deadline or another thread's cancel: the rules that make them do so, and the
lookups shared between requests meanwhile, are tested here on their own (tests/test_fireworks_connect.py).

Example::

    stop = Canceller()                     # stop.cancel() from another thread ends the wait at once
    sock = open_socket(("api.fireworks.ai", 443), Deadline(30.0, None), stop)
"""
from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, cast


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


class Deadline:
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


def open_socket(address: tuple[str, int], deadline: Deadline, canceller: Canceller | None) -> socket.socket:
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
            connect_socket(sock, sockaddr, host, deadline, canceller)
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


def _resolve(host: str, port: int, deadline: Deadline, canceller: Canceller | None) -> list[tuple[Any, ...]]:
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
        args = failed.args
        if isinstance(failed, OSError) and len(args) == 2:  # a gaierror's text names no host: the proxy's or the API's?
            args = (args[0], f"{args[1]} (resolving the host name {host!r})")
        try:  # of the same type: a UnicodeError (a label over 63 characters) is no transient error to retry
            fresh_error = type(failed)(*args)
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


def connect_socket(sock: socket.socket, sockaddr: tuple[Any, ...], host: str, deadline: Deadline,
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


