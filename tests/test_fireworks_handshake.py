"""A TLS handshake that gets no answer (a gateway's TLS terminator that hangs, or the API behind a proxy's tunnel):
cancel() and the caller's until() (straggler_wait_s) end it at once, and a timeout names the handshake.

Real sockets on loopback: a TLS server with a certificate from a CA made for the test that accepts each connection
and holds back its answer to the ClientHello until the test ends, and a forward proxy whose tunnel leads to it.
"""
from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fsdp_hotload.engine.signal import NotSignalled, Signaller
from fsdp_hotload.fireworks import HotLoadCancelled
from fsdp_hotload.fireworks_http import NotSent, send_once, tls_context
from tests.http_fixture import tls_files
from tests.test_fireworks_proxy import _use_proxy, forward_proxy
from tests.test_fireworks_transport import _cancel_after, make_client

API_HOST = "hotload-api.test"  # behind the proxy: only it knows where that is


@contextmanager
def held_handshake(tmp_path: Path) -> Iterator[int]:
    """A TLS server on loopback that accepts connections and answers none's ClientHello until the test ends (it
    then completes the handshake of those still open); yields its port."""
    _, cert, key = tls_files(tmp_path, API_HOST)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(16)
    release = threading.Event()
    accepted: list[socket.socket] = []

    def handshake(conn: socket.socket) -> None:
        release.wait(30)
        with contextlib.suppress(OSError):  # the client has mostly gone by then
            ctx.wrap_socket(conn, server_side=True).close()

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn = lsn.accept()[0]
                accepted.append(conn)
                threading.Thread(target=handshake, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield lsn.getsockname()[1]
    finally:
        release.set()
        lsn.close()
        for conn in accepted:
            conn.close()


@contextmanager
def api_url(tmp_path: Path, route: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The https:// URL of a held handshake, reached directly or through a proxy's CONNECT tunnel."""
    with held_handshake(tmp_path) as port:
        if route == "direct":
            _use_proxy(monkeypatch)
            yield f"https://127.0.0.1:{port}"
            return
        with forward_proxy({f"{API_HOST}:443": ("127.0.0.1", port)}) as (proxy, _):
            _use_proxy(monkeypatch, HTTPS_PROXY=proxy)
            yield f"https://{API_HOST}"


@pytest.mark.parametrize("route", ["direct", "proxy"])
def test_cancel_ends_a_tls_handshake_that_gets_no_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         route: str) -> None:
    """ssl moves the plain socket's descriptor to the TLS socket before the handshake, so the watchdog shut down a
    detached socket: cancel() waited out the attempt's timeout_s (60 s by default)."""
    with api_url(tmp_path, route, monkeypatch) as url:
        client = make_client(url, retry_budget_s=30, timeout_s=30)
        started = time.monotonic()
        _cancel_after(client, 0.3)
        with pytest.raises(HotLoadCancelled, match="cancelled"):
            client.signal("s1")
        assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("route", ["direct", "proxy"])
def test_the_callers_until_ends_a_tls_handshake_and_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             route: str) -> None:
    """until() moves from never to 0.2 s after a release 0.3 s in (straggler_wait_s: another deployment served the
    snapshot); the handshake held the exchange until its own timeout. Nothing was sent: a NotSent."""
    release = [float("inf")]
    timer = threading.Timer(0.3, lambda: release.__setitem__(0, time.monotonic() + 0.2))
    with api_url(tmp_path, route, monkeypatch) as url:
        started = time.monotonic()
        timer.start()
        try:
            with pytest.raises(NotSent, match="wait ended .* during the TLS handshake") as err:
                send_once(urllib.parse.urlsplit(url), "GET", "/", None, {}, 30.0, tls_context(), None,
                          lambda: release[0])
        finally:
            timer.cancel()
        assert 0.45 < time.monotonic() - started < 2.0
    assert ("tunnel of proxy" in str(err.value)) == (route == "proxy"), err.value


def test_a_handshake_past_the_timeout_says_the_server_did_not_answer_it(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut by the watchdog at the attempt's timeout: the error names the handshake, not a response cut short."""
    with api_url(tmp_path, "direct", monkeypatch) as url:
        started = time.monotonic()
        with pytest.raises(NotSent, match="did not answer the TLS handshake within 0.5s"):
            send_once(urllib.parse.urlsplit(url), "GET", "/", None, {}, 0.5, tls_context())
        assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("route", ["direct", "proxy"])
def test_a_handshake_that_the_socket_timeout_ends_before_the_watchdog_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str) -> None:
    """On a loaded machine the watchdog thread can wake after the socket's own timeout (set to the same deadline)
    ended the handshake: the error was ssl's "TimeoutError: _ssl.c:989: The handshake operation timed out". It
    must read as the watchdog's does. The watchdog is held back 1 s here, as a busy scheduler would."""
    from fsdp_hotload import fireworks_http

    run = fireworks_http._Watchdog._run

    def late(self: fireworks_http._Watchdog) -> None:
        time.sleep(1.0)
        run(self)

    monkeypatch.setattr(fireworks_http._Watchdog, "_run", late)
    with api_url(tmp_path, route, monkeypatch) as url:
        with pytest.raises(NotSent, match="did not answer the TLS handshake within 0.5s") as err:
            send_once(urllib.parse.urlsplit(url), "GET", "/", None, {}, 0.5, tls_context())
    assert ("tunnel of proxy" in str(err.value)) == (route == "proxy"), err.value
    assert isinstance(err.value.__cause__, TimeoutError), repr(err.value.__cause__)


def test_a_signaller_cancelled_mid_handshake_frees_the_publish_at_once(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """close(timeout=) gives up on a publish through Signaller.cancel(): a deployment whose API never answered the
    handshake held the publish thread for the client's timeout_s, against README's promise."""
    with api_url(tmp_path, "direct", monkeypatch) as url:
        sig = Signaller([make_client(url, retry_budget_s=60, timeout_s=60)], ready_timeout_s=600)
        caught: list[BaseException] = []

        def publish() -> None:
            try:
                sig.signal_and_wait("s1", None)
            except BaseException as exc:  # noqa: BLE001 - what ended it is asserted below
                caught.append(exc)

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        time.sleep(0.5)
        sig.cancel()
        thread.join(3.0)
        assert not thread.is_alive()
        sig.close(0.0)
    assert len(caught) == 1 and isinstance(caught[0], NotSignalled) and "cancelled" in str(caught[0]), caught
