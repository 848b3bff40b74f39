"""HotLoadClient's deadline and cancel() before a request is on the wire: a stalled name lookup and a connect
whose SYN is never answered or that the kernel refuses, against real sockets on loopback."""
from __future__ import annotations

import contextlib
import errno
import os
import socket
import ssl
import threading
import time
import urllib.parse
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from fsdp_hotload.fireworks import HotLoadCancelled, HotLoadError, HotLoadTimeout
from fsdp_hotload.fireworks_connect import Deadline, connect_socket
from fsdp_hotload.fireworks_http import NotSent, send_once

from tests.http_fixture import serve
from tests.test_fireworks_transport import _cancel_after, answering, make_client

STALLED = "stalled.hotload.test"
READY = b'{"replicas": [{"current_snapshot_identity": "s1", "readiness": true}]}'


@pytest.fixture
def stalled_resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Lookups of STALLED hang (as behind a nameserver that does not answer) until the test ends, then resolve
    to loopback; every other name resolves as usual. Yields the count of lookups of STALLED started."""
    real = socket.getaddrinfo
    release = threading.Event()
    started = {"lookups": 0}

    def getaddrinfo(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if host != STALLED:
            return real(host, port, *args, **kw)
        started["lookups"] += 1
        release.wait(30)
        return real("127.0.0.1", port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    try:
        yield started
    finally:
        release.set()


def _stalled_url(url: str) -> str:
    return url.replace("127.0.0.1", STALLED)


@pytest.mark.usefixtures("stalled_resolver")
def test_a_stalled_name_lookup_cannot_hold_a_call_past_its_deadline() -> None:
    """http.client looked the host up with getaddrinfo, which takes no timeout (glibc waits 5 s per attempt per
    nameserver): a signal or a status poll waited as long as the resolver did, past retry_budget_s and the
    wait's timeout_s."""
    with serve(answering(200, READY)) as url:
        client = make_client(_stalled_url(url), allow_insecure=True, retry_budget_s=1.0, timeout_s=30)
        started = time.monotonic()
        with pytest.raises(HotLoadError, match=f"resolving the host name '{STALLED}' did not finish"):
            client.signal("s1")
        assert time.monotonic() - started < 3.0
        started = time.monotonic()
        with pytest.raises(HotLoadTimeout, match="within 1s"):
            client.wait_ready("s1", timeout_s=1.0)
        assert time.monotonic() - started < 3.0


def test_retries_against_a_stalled_resolver_share_one_lookup(stalled_resolver: dict[str, int]) -> None:
    """Each retry and poll would otherwise leave a thread blocked in the resolver until it gives up."""
    with serve(answering(503, b"busy")) as url:
        client = make_client(_stalled_url(url), allow_insecure=True, retry_budget_s=1.0, backoff_initial_s=0.01,
                             backoff_max_s=0.01)
        with pytest.raises(HotLoadError, match="no answer after"):
            client.signal("s1")
        with pytest.raises(HotLoadError):
            client.status()
    assert stalled_resolver["lookups"] == 1
    assert len([t for t in threading.enumerate() if t.name == "hotload-resolve"]) == 1


@pytest.mark.usefixtures("stalled_resolver")
def test_cancel_ends_a_stalled_name_lookup_at_once() -> None:
    with serve(answering(200, READY)) as url:
        client = make_client(_stalled_url(url), allow_insecure=True, retry_budget_s=60, timeout_s=60)
        started = time.monotonic()
        _cancel_after(client, 0.3)
        with pytest.raises(HotLoadCancelled, match="cancelled"):
            client.signal("s1")
        assert time.monotonic() - started < 2.0


@contextmanager
def unanswered_syn() -> Iterator[str]:
    """A loopback listener whose backlog is full: the kernel drops further SYNs, so a connect waits (as to a
    firewalled host) until its timeout."""
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(0)
    filler = socket.create_connection(lsn.getsockname(), timeout=5)  # takes the one backlog slot, never accepted
    try:
        yield f"http://127.0.0.1:{lsn.getsockname()[1]}"
    finally:
        filler.close()
        lsn.close()


def test_cancel_ends_a_connect_that_gets_no_answer() -> None:
    """A blocking connect cannot be woken from another thread: cancel() waited out the attempt's timeout_s."""
    with unanswered_syn() as url:
        client = make_client(url, retry_budget_s=60, timeout_s=60)
        started = time.monotonic()
        _cancel_after(client, 0.3)
        with pytest.raises(HotLoadCancelled, match="cancelled"):
            client.signal("s1")
        assert time.monotonic() - started < 2.0


def test_a_connect_cut_by_the_deadline_counts_as_not_sent() -> None:
    """A request whose connection timed out never reached the server, so a 409 to a later attempt does not mean
    an earlier one was accepted. It read as a cut response (a TimeoutError that may have been sent)."""
    with unanswered_syn() as url:
        started = time.monotonic()
        with pytest.raises(NotSent, match="did not finish by the deadline"):
            send_once(urllib.parse.urlsplit(url), "GET", "/", None, {}, 0.5, ssl.create_default_context())
        assert time.monotonic() - started < 2.0


@contextmanager
def silent_server() -> Iterator[str]:
    """A loopback listener that is never accepted from: the kernel takes the connection and the request, and no
    answer comes (a server that hangs)."""
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(8)
    try:
        yield f"http://127.0.0.1:{lsn.getsockname()[1]}"
    finally:
        lsn.close()


@pytest.mark.parametrize("phase", ["lookup", "connect", "answer"])
def test_an_exchange_ends_when_the_callers_until_comes(phase: str, stalled_resolver: dict[str, int]) -> None:
    """until() moves from never to 0.2 s after a release 0.3 s into the exchange (straggler_wait_s: another
    deployment served the snapshot). An exchange begun before the release ended only at its own timeout (30 s
    here, 60 s by default), whether it waited on the name lookup, the connect or the answer."""
    release = [float("inf")]
    timer = threading.Timer(0.3, lambda: release.__setitem__(0, time.monotonic() + 0.2))
    with contextlib.ExitStack() as stack:
        if phase == "lookup":
            url = _stalled_url(stack.enter_context(serve(answering(200, READY))))
        else:
            url = stack.enter_context(unanswered_syn() if phase == "connect" else silent_server())
        started = time.monotonic()
        timer.start()
        with pytest.raises((TimeoutError, NotSent)) as caught:
            send_once(urllib.parse.urlsplit(url), "GET", "/", None, {}, 30.0, ssl.create_default_context(),
                      None, lambda: release[0])
        took = time.monotonic() - started
    timer.cancel()
    assert 0.45 < took < 10.0, took  # the timeout it stands for is 30 s; a busy machine wakes the timer late
    if phase == "answer":
        assert "the caller's wait ended" in str(caught.value)


def test_a_connect_the_kernel_refuses_with_eagain_is_not_taken_for_one_in_progress(tmp_path: Any) -> None:
    """A non-blocking connect that returns EAGAIN has failed (over TCP: no ephemeral port left); it is not under
    way. Read as in progress, the socket polled writable at once and the request went out on an unconnected socket.
    A Unix socket whose listen backlog is full returns the same errno from connect, with no root needed."""
    path = str(tmp_path / "api.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held = [listener]
    try:
        listener.bind(path)
        listener.listen(0)
        err = 0
        while err != errno.EAGAIN and len(held) < 64:  # fill the backlog: the kernel admits one past listen(0)
            held.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            held[-1].setblocking(False)
            err = held[-1].connect_ex(path)
        assert err == errno.EAGAIN
        held.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        with pytest.raises(OSError, match="connecting to api") as caught:
            connect_socket(held[-1], path, "api", Deadline(5, None), None)  # type: ignore[arg-type]
        assert caught.value.errno == errno.EAGAIN
    finally:
        for sock in held:
            sock.close()


def test_an_address_no_socket_can_be_made_for_gives_way_to_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """As socket.create_connection does: a family the kernel refuses (IPv6 turned off) ended the connect."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if host != STALLED:
            return real(host, port, *args, **kw)
        return [(12345, socket.SOCK_STREAM, 6, "", ("nowhere", port))] + real("127.0.0.1", port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    with serve(answering(200, READY)) as url:
        assert make_client(_stalled_url(url), allow_insecure=True).status().replicas[0].readiness


def test_a_lookup_thread_that_cannot_start_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its entry stayed in the shared lookups, so every later request for the host waited out its deadline."""
    start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name == "hotload-resolve":
            raise RuntimeError("can't start new thread")
        start(self)

    with serve(answering(200, READY)) as url:
        client = make_client(url.replace("127.0.0.1", "localhost"), retry_budget_s=0.5)
        monkeypatch.setattr(threading.Thread, "start", refuse)
        with pytest.raises(HotLoadError, match="can't start new thread"):
            client.status()
        monkeypatch.setattr(threading.Thread, "start", start)
        started = time.monotonic()
        assert client.status().replicas[0].readiness
        assert time.monotonic() - started < 0.5


def test_a_watchdog_thread_that_cannot_start_is_retried_and_leaves_no_waker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A process at its thread limit: the request was refused as one that cannot be sent (blaming the headers and
    the API key), not retried, and each left its watchdog's waker in the client's canceller."""
    start = threading.Thread.start
    refused = [0]

    def refuse_twice(self: threading.Thread) -> None:
        if self.name == "hotload-http-watchdog" and refused[0] < 2:
            refused[0] += 1
            raise RuntimeError("can't start new thread")
        start(self)

    with serve(answering(200, READY)) as url:
        client = make_client(url, retry_budget_s=5)
        monkeypatch.setattr(threading.Thread, "start", refuse_twice)
        assert client.status().replicas[0].readiness  # the third attempt got its thread
        assert refused[0] == 2 and not client._canceller._wakers
        refused[0] = 1
        with pytest.raises(NotSent, match="cannot start the request's watchdog thread: RuntimeError"):
            send_once(urllib.parse.urlsplit(url), "GET", "/", None, {}, 1.0, None, client._canceller)
        assert not client._canceller._wakers
        monkeypatch.setattr(threading.Thread, "start", start)


def test_a_name_no_lookup_can_take_is_not_retried() -> None:
    """A label over 63 characters fails IDNA encoding: no retry can send it (it was retried for the budget)."""
    client = make_client(f"https://{'a' * 64}.example.com", retry_budget_s=30)
    started = time.monotonic()
    with pytest.raises(HotLoadError, match="could not be sent: UnicodeError"):
        client.status()
    assert time.monotonic() - started < 2.0


def test_a_forked_child_looks_up_for_itself(stalled_resolver: dict[str, int]) -> None:
    """A lookup in flight when the process forks belongs to a parent's thread, which the child does not have: the
    child's requests for that host must not wait on it (they would wait out every deadline, never answered)."""
    parent = os.getpid()
    real = socket.getaddrinfo

    def in_child_at_once(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if os.getpid() != parent and host == STALLED:  # the child's resolver answers
            return real("127.0.0.1", port, *args, **kw)
        return stalled(host, port, *args, **kw)

    stalled = socket.getaddrinfo
    socket.getaddrinfo = in_child_at_once
    try:
        with serve(answering(200, READY)) as url:
            client = make_client(_stalled_url(url), allow_insecure=True, retry_budget_s=30.0, timeout_s=30)
            def poll() -> None:
                with contextlib.suppress(HotLoadError):  # its outcome is not the point: its lookup is
                    client.status()

            waiting = threading.Thread(target=poll, daemon=True)
            waiting.start()
            deadline = time.monotonic() + 10
            while stalled_resolver["lookups"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert stalled_resolver["lookups"] == 1  # the parent's lookup is in flight
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads: this test's point
                pid = os.fork()
            if pid == 0:  # the child: one status call, on a short budget
                code = 1
                try:
                    child = make_client(_stalled_url(url), allow_insecure=True, retry_budget_s=3.0, timeout_s=3)
                    code = 0 if child.status() else 2
                finally:
                    os._exit(code)
            started = time.monotonic()
            try:
                _, status = os.waitpid(pid, 0)
            finally:  # the parent's request must not outlive the test (later tests' servers would see it)
                client.cancel()
                waiting.join(10)
            assert not waiting.is_alive()
            assert os.waitstatus_to_exitcode(status) == 0
            assert time.monotonic() - started < 3.0
    finally:
        socket.getaddrinfo = stalled
