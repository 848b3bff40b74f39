"""HotLoadClient's secrets against a real scripted HTTP server on loopback: the API key read from the environment
and stripped, refused when it cannot be a header, and never shown in reprs, errors, logs or tracebacks, nor are a
gateway header's value or credentials in the URL."""
from __future__ import annotations

import logging
import socket

import pytest

from fsdp_hotload.fireworks import HotLoadError, HotLoadResponseError, HotLoadTimeout

from tests import test_fireworks
from tests.test_fireworks import KEY, Scripted, make_client

server = test_fireworks.server  # the scripted server fixture: pytest finds it under this name here too


# ------------------------------------------------------------------------------------------------ key handling


def test_api_key_from_env_and_missing_key(monkeypatch: pytest.MonkeyPatch, server: tuple[str, Scripted]) -> None:
    url, script = server
    monkeypatch.setenv("FIREWORKS_API_KEY", "env-key-123")
    client = make_client(url, api_key=None)
    client.signal("s1")
    assert script.requests[0]["headers"]["authorization"] == "Bearer env-key-123"
    monkeypatch.delenv("FIREWORKS_API_KEY")
    with pytest.raises(ValueError, match="FIREWORKS_API_KEY"):
        make_client(url, api_key=None)


def test_key_is_redacted_in_repr_and_errors(server: tuple[str, Scripted]) -> None:
    url, script = server
    client = make_client(url)
    assert KEY not in repr(client) and KEY not in str(client)
    assert "redacted" in repr(client)
    script.push(401, {"error": {"message": f"invalid key {KEY}"}})
    with pytest.raises(HotLoadError) as info:
        client.signal("s1")
    err = info.value
    assert err.status_code == 401
    assert KEY not in str(err) and KEY not in (err.server_message or "")
    assert "invalid key <redacted>" in str(err)
    assert "FIREWORKS_API_KEY" in str(err)  # the "what to do" hint


def test_key_with_surrounding_whitespace_is_stripped(monkeypatch: pytest.MonkeyPatch,
                                                     server: tuple[str, Scripted]) -> None:
    url, script = server
    make_client(url, api_key=KEY + "\n").signal("s1")           # as read from a secrets file
    monkeypatch.setenv("FIREWORKS_API_KEY", f"  {KEY}\r\n")
    make_client(url, api_key=None).signal("s2")
    assert [r["headers"]["authorization"] for r in script.requests] == [f"Bearer {KEY}"] * 2


@pytest.mark.parametrize("bad,what", [
    (f"{KEY}\nX-Injected: 1", "line break"),
    (f"{KEY[:6]}\r{KEY[6:]}", "line break"),
    (f"{KEY[:6]}\x7f{KEY[6:]}", "control character"),
    (f"{KEY[:6]}\x1b{KEY[6:]}", "control character"),
    (f"{KEY[:6]} {KEY[6:]}", "whitespace"),
    (f"{KEY[:6]}\u00e9{KEY[6:]}", "non-ASCII"),
])
def test_key_that_cannot_be_a_header_is_refused_without_showing_it(
        monkeypatch: pytest.MonkeyPatch, server: tuple[str, Scripted], bad: str, what: str) -> None:
    url, script = server
    with pytest.raises(ValueError, match=what) as info:
        make_client(url, api_key=bad)
    msg = str(info.value)
    assert "api_key" in msg and KEY[:6] not in msg and KEY[6:] not in msg and "X-Injected" not in msg
    monkeypatch.setenv("FIREWORKS_API_KEY", bad)
    with pytest.raises(ValueError, match=what) as info:
        make_client(url, api_key=None)
    msg = str(info.value)
    assert "$FIREWORKS_API_KEY" in msg and KEY[:6] not in msg and KEY[6:] not in msg
    assert script.requests == []


def test_key_never_reaches_exceptions_or_logs(server: tuple[str, Scripted], caplog: pytest.LogCaptureFixture) -> None:
    url, script = server
    caplog.set_level(logging.DEBUG)
    # A header http.client would refuse to send (its ValueError quotes the whole header): a caller's Authorization
    # override that carries the key with a line break inside is refused up front, naming the header only.
    with pytest.raises(ValueError) as refused:
        make_client(url, additional_headers={"Authorization": f"Bearer {KEY}\nX-Other: 1"})
    assert "additional_headers['Authorization']" in str(refused.value) and "line break" in str(refused.value)
    errors: list[BaseException] = [refused.value]
    # A secret file's trailing newline is stripped, and the header is sent.
    make_client(url, additional_headers={"Authorization": f"Bearer {KEY}\n"}).signal("s1")
    assert script.requests.pop()["headers"]["authorization"] == f"Bearer {KEY}"

    # The server echoes the key while failing: retried (logged), then given up on.
    script.default = (503, {"error": {"message": f"overloaded, key {KEY}"}}, {})
    with pytest.raises(HotLoadError) as info:
        make_client(url, retry_budget_s=1.0).signal("s1")
    errors.append(info.value)
    # Transient poll failures are logged and polled through until the wait times out.
    with pytest.raises(HotLoadTimeout) as info:
        make_client(url, retry_budget_s=0).wait_ready("s1", timeout_s=0.2)
    errors.append(info.value)

    for exc in errors:
        assert KEY not in str(exc) and KEY not in repr(exc) and KEY not in (getattr(exc, "server_message", "") or "")
    assert any("failed" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    for record in caplog.records:
        assert KEY not in record.getMessage() and KEY not in (record.exc_text or "")


def test_the_key_is_hidden_before_an_error_text_is_cut(server: tuple[str, Scripted]) -> None:
    """A server (or proxy) echoing the Authorization header near the point where a long error text is cut: the
    key must be removed from the whole text first, or the part before the cut survives."""
    url, script = server
    for body in (b"x" * 170 + f" Authorization: Bearer {KEY}".encode(),
                 {"detail": "y" * 455, "echo": f"Bearer {KEY}"}):
        script.push(403, body)
        with pytest.raises(HotLoadError) as info:
            make_client(url).signal("s1")
        assert KEY[:6] not in str(info.value) and "<redact" in str(info.value), str(info.value)
    script.push(200, b"z" * 180 + f" Bearer {KEY}".encode())
    with pytest.raises(HotLoadResponseError) as info:
        make_client(url).signal("s1")
    assert KEY[:6] not in str(info.value)


def test_tracebacks_that_record_locals_do_not_show_the_key(server: tuple[str, Scripted]) -> None:
    import traceback

    url, script = server
    script.push(403, {"error": "denied"})
    with pytest.raises(HotLoadError) as info:
        make_client(url).signal("s1")
    text = "".join(traceback.TracebackException.from_exception(info.value, capture_locals=True).format())
    assert "headers" in text and KEY not in text
    assert script.requests[0]["headers"]["authorization"] == f"Bearer {KEY}"  # still sent, of course


def test_credentials_in_the_url_are_refused_never_printed() -> None:
    with pytest.raises(ValueError, match="must not carry credentials") as info:
        make_client("https://gwuser:GW-PASSWORD@127.0.0.1:9")
    assert "GW-PASSWORD" not in str(info.value)


def test_extra_header_values_are_redacted_from_errors(server: tuple[str, Scripted],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    url, script = server
    secret = "gateway-S3CR3T-value"
    script.default = (503, {"error": {"message": f"bad gateway token {secret}"}}, {})
    with pytest.raises(HotLoadError) as info:
        make_client(url, retry_budget_s=1.0, additional_headers={"X-Gateway-Token": secret + "\n"}).signal("s1")
    assert script.requests[0]["headers"]["x-gateway-token"] == secret  # the file's newline stripped, then sent
    assert secret not in str(info.value) and "<redacted>" in str(info.value)
    assert all(secret not in r.getMessage() for r in caplog.records)


def test_a_short_api_key_leaves_error_text_readable(caplog: pytest.LogCaptureFixture) -> None:
    """The emulator takes any key, and a one-letter one (FIREWORKS_API_KEY=k) was cut out of every word of every
    error and retry line ('chec<redacted> that ...'). Like header values, keys under 4 characters are not
    searched for: they would match ordinary text."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = make_client(f"http://127.0.0.1:{port}", api_key="k", retry_budget_s=0.05)
    with pytest.raises(HotLoadError) as info:  # the timeout quotes the last poll's error, hint included
        client.wait_manager(timeout_s=0.2)
    assert "<redacted>" not in str(info.value) and "check that" in str(info.value), str(info.value)
    assert all("<redacted>" not in r.getMessage() for r in caplog.records)
    polls = [r.getMessage() for r in caplog.records if "status poll" in r.getMessage()]
    assert polls and all(m.startswith("status poll for a replica failed") for m in polls), polls  # not "for None"
