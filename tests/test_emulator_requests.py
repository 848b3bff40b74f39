"""The emulator's HTTP front door (how long a request may take to arrive, which request headers it needs) and
what it accepts as a retried signal, over real sockets on loopback; hostile requests (deeply nested JSON, a body
truncated, chunked or oversized, a Content-Length that is not one plain number, a stalled client, other methods)
get a JSON error, never an internal one."""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

from typing import Any

import pytest

from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.fireworks import HotLoadClient
from tests.emulator_fixture import EMULATOR_API_KEY, perturb, tiny_model, write_delta_snapshot, write_full_snapshot
from tests.test_emulator_concurrency import wait_accepted

DEP = "accounts/acct/deployments/dep"
HOT_LOAD = "/hot_load/v1/models/hot_load"


def head(method: str, path: str, length: int, extra: dict[str, str] | None = None) -> bytes:
    h = {"Authorization": f"Bearer {EMULATOR_API_KEY}", "fireworks-model": "accounts/acct/models/m",
         "fireworks-deployment": DEP, "Content-Type": "application/json", "Content-Length": str(length),
         **(extra or {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in h.items() if v is not None)
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{lines}\r\n".encode()


def answer(sock: socket.socket) -> tuple[int, dict[str, object]]:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def exchange(emu: HotLoadEmulator, method: str, path: str, body: bytes = b"", *, headers: dict[str, str],
             half_close: bool = True) -> tuple[int, dict[str, str], Any]:
    """Send a hand-written request (any headers, any body, however short) over a socket; returns the status, the
    response headers and the JSON body. ``half_close`` ends the client's side after sending, as a client that
    gave up on its body does."""
    host, port = emu.url.removeprefix("http://").rsplit(":", 1)
    h = {"Authorization": f"Bearer {EMULATOR_API_KEY}", "fireworks-model": "accounts/acct/models/m",
         "fireworks-deployment": DEP, **headers}
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    head_bytes, _, payload = rest.partition(b"\r\n\r\n")
    resp_headers = dict(line.split(": ", 1) for line in head_bytes.decode().split("\r\n") if ": " in line)
    return int(status_line.split()[1]), resp_headers, json.loads(payload) if payload else None


def test_a_trickled_body_gets_408_at_the_request_deadline(tmp_path: Path) -> None:
    """request_timeout_s was a socket timeout per read, so a body sent a byte every 0.2 s held the handler
    thread for as long as the client liked and was then served."""
    body = json.dumps({"identity": "s1"}).encode()
    with HotLoadEmulator(str(tmp_path), replicas=1, api_key=EMULATOR_API_KEY, request_timeout_s=1.0) as emu:
        host, port = emu.url.removeprefix("http://").rsplit(":", 1)
        started = time.monotonic()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head("POST", HOT_LOAD, len(body)))
            try:
                for b in body:
                    sock.sendall(bytes([b]))
                    time.sleep(0.2)
            except OSError:  # the emulator answered and closed: what is tested
                pass
            code, reply = answer(sock)
        assert code == 408 and "within 1s" in str(reply)
        assert time.monotonic() - started < 2.5
        assert emu.state()["deployments"] == {}  # the signal was not acted on


def signal_with(emu: HotLoadEmulator, content_type: str | None, identity: str) -> tuple[int, dict[str, object]]:
    body = json.dumps({"identity": identity}).encode()
    host, port = emu.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head("POST", HOT_LOAD, len(body), {"Content-Type": content_type}) + body)
        return answer(sock)


def test_posts_need_a_json_content_type(tmp_path: Path) -> None:
    """Content-Type is a required header (protocol notes §1.3); a client that lost it passed unnoticed."""
    with HotLoadEmulator(str(tmp_path), replicas=1, api_key=EMULATOR_API_KEY) as emu:
        for content_type in (None, "text/plain", "application/jsonx"):
            code, reply = signal_with(emu, content_type, "s1")
            assert code == 415 and "Content-Type must be application/json" in str(reply), content_type
        assert emu.state()["deployments"] == {}
        for i, content_type in enumerate(("application/json", "Application/JSON; charset=utf-8")):
            assert signal_with(emu, content_type, f"s{i}")[0] == 200, content_type


def post(emu: HotLoadEmulator, body: dict[str, Any]) -> tuple[int, dict[str, object]]:
    data = json.dumps(body).encode()
    host, port = emu.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head("POST", HOT_LOAD, len(data)) + data)
        return answer(sock)


def test_a_resignal_is_accepted_only_as_the_same_request(tmp_path: Path) -> None:
    """A re-signal of the newest identity was compared on previous_snapshot_identity alone, so one that asked
    for another codec (even an unsupported one), cache policy or validation got 200 and was silently ignored."""
    m1 = tiny_model(0)
    m2 = perturb(m1, seed=1)
    write_full_snapshot(tmp_path, "s1", m1)
    write_delta_snapshot(tmp_path, "s2", "s1", m1, m2)
    with HotLoadEmulator(str(tmp_path), replicas=1, api_key=EMULATOR_API_KEY,
                         compression_formats=("arc_v2", "arc_sparse_v1")) as emu:
        client = HotLoadClient(emu.url, account_id="acct", model_id="m", deployment_id="dep",
                               api_key=EMULATOR_API_KEY, poll_interval_s=0.02)
        client.signal("s1")
        client.wait_ready("s1", timeout_s=30)
        meta = {"previous_snapshot_identity": "s1", "compression_format": "arc_v2", "checksum_format": "alder32"}
        sent = {"identity": "s2", "incremental_snapshot_metadata": meta, "reset_prompt_cache": "new_session",
                "validation": {"extra_fields_ignore": ["a", "b"]}}
        assert post(emu, sent) == (200, {"status": "ok"})
        same = {**sent, "validation": {"extra_fields_ignore": ["b", "a"]}}  # the same set of keys
        assert post(emu, same) == (200, {"status": "ok"})
        for change, differs in (
            ({"incremental_snapshot_metadata": {**meta, "compression_format": "arc_sparse_v1"}},
             "incremental_snapshot_metadata"),
            ({"reset_prompt_cache": "none"}, "reset_prompt_cache"),
            ({"reset_prompt_cache": None}, "reset_prompt_cache"),  # unset is the default, all
            ({"validation": {"extra_fields_ignore": ["a"]}}, "validation.extra_fields_ignore"),
        ):
            code, reply = post(emu, {k: v for k, v in {**sent, **change}.items() if v is not None})
            assert code == 409 and f"a different {differs};" in str(reply), change
        code, reply = post(emu, {**sent, "incremental_snapshot_metadata": {**meta, "compression_format": "zstd"}})
        assert code == 400 and "compression_format 'zstd' is not supported" in str(reply)
        client.wait_ready("s2", timeout_s=30)
        rows = emu.state()["deployments"]["accounts/acct/deployments/dep"]["ledger"]
        assert [r["identity"] for r in rows] == ["s1", "s2"] and rows[1]["incremental_snapshot_metadata"] == meta


def test_without_an_api_key_the_service_routes_still_need_a_bearer_header(tmp_path: Path) -> None:
    """An emulator started without --api-key took requests with no Authorization header at all, so a client
    that never sent one passed every test and failed only against the service."""
    from tests.test_emulator import raw

    with HotLoadEmulator(str(tmp_path), replicas=1) as emu:
        for path in (HOT_LOAD, "/v1/accounts", f"/v1/{DEP}/ledger"):
            code, body = raw(emu, "GET", path, auth=False)
            assert code == 401 and "started without --api-key" in body["error"]["message"], path
            assert raw(emu, "GET", path, headers={"Authorization": "Bearer "})[0] == 401
        assert raw(emu, "GET", HOT_LOAD, headers={"Authorization": "Bearer any-key"})[0] == 200
        assert raw(emu, "GET", "/emulator/v1/state", auth=False)[0] == 200  # the emulator's own route stays open


def test_a_request_in_flight_as_stop_runs_leaves_no_replica_running(tmp_path: Path) -> None:
    """A handler still reading its body when stop() cleared the deployments then made a new deployment, whose
    replica threads nothing joined, and answered 200 after the stop."""
    import threading

    emu = HotLoadEmulator(str(tmp_path), replicas=2, api_key=EMULATOR_API_KEY).start()
    host, port = emu.url.removeprefix("http://").rsplit(":", 1)
    before = set(threading.enumerate())
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head("GET", HOT_LOAD, 2) + b"{")
        wait_accepted(before)  # the handler waits for the body's second byte
        emu.stop()
        sock.sendall(b"}")
        code, reply = answer(sock)
    assert code == 503 and "stopping" in str(reply)
    time.sleep(0.2)
    assert emu.state()["deployments"] == {}
    assert not [t.name for t in threading.enumerate() if t.name.startswith("hotload-emulator-accounts")]
    emu.start()  # a restart serves again
    try:
        HotLoadClient(emu.url, account_id="acct", model_id="m", deployment_id="dep", api_key=EMULATOR_API_KEY,
                      poll_interval_s=0.02).wait_manager(timeout_s=10)
    finally:
        emu.stop()


def test_a_bucket_that_cannot_be_listed_is_a_storage_error_not_an_emulator_bug(s3_server: Any) -> None:
    """A storage error while listing the signalled snapshot answered 500 'internal emulator error' and made
    stop() raise, as for a bug; the same error during a load was a plain load failure. Access denied is no
    outage: 424, which the client does not retry (a 503 cost each publish its whole retry budget)."""
    from fsdp_hotload.fireworks import HotLoadError
    from tests.s3_fixture import DeleteErrorsProxy

    with DeleteErrorsProxy(s3_server.endpoint_url, "InternalError", lambda body: False, deny_lists=True) as proxy:
        emu = HotLoadEmulator(s3_server.unique_uri("emu"), replicas=1, api_key=EMULATOR_API_KEY,
                              storage_options={**s3_server.storage_options, "endpoint_url": proxy.url}).start()
        try:
            client = HotLoadClient(emu.url, account_id="acct", model_id="m", deployment_id="dep",
                                   api_key=EMULATOR_API_KEY, poll_interval_s=0.02, retry_budget_s=60.0,
                                   backoff_initial_s=0.05, backoff_max_s=0.1)  # 0.5 s: one listing outlasted it
            client.wait_manager(timeout_s=10)
            with pytest.raises(HotLoadError, match="HTTP 424.*cannot list 'step-1'.*Access Denied") as info:
                client.signal("step-1")
            assert info.value.status_code == 424 and info.value.attempts == 1
        finally:
            emu.stop()  # raised RuntimeError: 'hot-load emulator hit N internal error(s)'


def test_a_burst_of_connections_is_not_held_back_by_the_listen_backlog(tmp_path: Path) -> None:
    """socketserver listens with a backlog of 5: a burst of clients overflowed it, and the kernel's dropped SYNs
    cost each of them a 1 s retransmit before it was even connected."""
    with HotLoadEmulator(str(tmp_path), replicas=1, api_key=EMULATOR_API_KEY) as emu:
        port = int(emu.url.rsplit(":", 1)[1])
        took: list[float] = []
        socks: list[socket.socket] = []
        lock = threading.Lock()

        def connect() -> None:
            t0 = time.monotonic()
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            with lock:
                took.append(time.monotonic() - t0)
                socks.append(s)

        threads = [threading.Thread(target=connect) for _ in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in socks:
            s.close()
    assert len(took) == 64 and max(took) < 0.9, sorted(took)[-5:]


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused_at_construction(tmp_path: Path, key: str) -> None:
    """No bearer token can match an empty key: every client got 401 from an emulator that looked healthy."""
    with pytest.raises(ValueError, match="api_key is empty"):
        HotLoadEmulator(str(tmp_path), replicas=1, api_key=key)


def test_trickled_headers_get_408_at_the_request_deadline(tmp_path: Path) -> None:
    """The deadline covered only the body: headers sent a byte every 0.1 s held the handler thread for as long
    as the client liked (8 s with a 1 s limit, then the request was served)."""
    with HotLoadEmulator(str(tmp_path), replicas=1, api_key=EMULATOR_API_KEY, request_timeout_s=1.0) as emu:
        host, port = emu.url.removeprefix("http://").rsplit(":", 1)
        started = time.monotonic()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            try:
                for b in head("GET", f"{HOT_LOAD}?deployment={DEP}", 0):
                    sock.sendall(bytes([b]))
                    time.sleep(0.1)
            except OSError:  # the emulator answered and closed: what is tested
                pass
            code, reply = answer(sock)
        assert code == 408 and "headers not received within 1s" in str(reply), reply
        assert time.monotonic() - started < 2.5


def test_an_emulator_given_its_deployments_serves_only_those(tmp_path: Path) -> None:
    """Fireworks answers only for deployments created in the account, each for its own model, so a misspelt
    deployment_id or model_id must fail against the emulator too, at the first request and naming what it serves
    (it used to create a deployment for any name and serve whatever model the first request named)."""
    from fsdp_hotload.fireworks import HotLoadError

    served = {"dep": "m", "accounts/other/deployments/d2": "m2"}
    with HotLoadEmulator(str(tmp_path), replicas=1, api_key=EMULATOR_API_KEY, account_id="acct",
                         deployments=served) as emu:
        def client(**kw: Any) -> HotLoadClient:
            opts: dict[str, Any] = dict(account_id="acct", model_id="m", deployment_id="dep",
                                        api_key=EMULATOR_API_KEY, poll_interval_s=0.02, retry_budget_s=5)
            return HotLoadClient(emu.url, **{**opts, **kw})

        write_full_snapshot(tmp_path, "step-1", tiny_model(0))
        with pytest.raises(HotLoadError, match="404") as info:
            client(deployment_id="dpe").signal("step-1")
        assert "accounts/acct/deployments/dpe" in str(info.value) and DEP in str(info.value)
        with pytest.raises(HotLoadError, match="400") as info:
            client(model_id="n").signal("step-1")
        assert "accounts/acct/models/n" in str(info.value) and "accounts/acct/models/m" in str(info.value)
        with pytest.raises(HotLoadError, match="404"):  # the same id in another account is another deployment
            client(account_id="other").signal("step-1")
        assert list(emu.state()["deployments"]) == [DEP]  # no request made a deployment it does not serve
        client().signal("step-1")
        client().wait_ready("step-1", timeout_s=30)
        other = client(account_id="other", deployment_id="d2", model_id="m2")  # a bare model is in its account
        other.signal("step-1")
        other.wait_ready("step-1", timeout_s=30)
        with pytest.raises(ValueError, match="no deployment 'accounts/acct/deployments/d2'"):
            emu.fail_next_loads(1, deployment="accounts/acct/deployments/d2")
    for bad, what in [({}, "empty"), ({"a b": "m"}, "'a b'"), ({"d": ""}, "model_id"),
                      ({"d": "m", "accounts/acct/deployments/d": "n"}, "twice")]:
        with pytest.raises(ValueError, match=what):
            HotLoadEmulator(str(tmp_path), account_id="acct", deployments=bad)


# ------------------------------------------------------------------------------------------------ hostile clients


def test_deeply_nested_json_is_a_400_not_an_internal_error(emulator: HotLoadEmulator) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    code, _, body = exchange(emulator, "POST", "/hot_load/v1/models/hot_load", deep,
                             headers={"Content-Length": str(len(deep)), "Content-Type": "application/json"})
    assert code == 400 and "not valid JSON" in body["error"]["message"]
    emulator.check()  # nothing was recorded as an emulator bug


def test_request_body_must_arrive_whole(emulator: HotLoadEmulator) -> None:
    """A truncated body is not taken for the whole request, and a chunked one needs a Content-Length."""
    code, _, body = exchange(emulator, "GET", "/emulator/v1/state", b"{}", headers={"Content-Length": "10"})
    assert code == 400 and "2 of the 10 bytes" in body["error"]["message"]
    chunked = b'10\r\n{"identity":"zz"}\r\n0\r\n\r\n'
    code, _, body = exchange(emulator, "POST", "/hot_load/v1/models/hot_load", chunked,
                             headers={"Transfer-Encoding": "chunked"})
    assert code == 411 and "Content-Length" in body["error"]["message"]
    assert emulator.state()["deployments"] == {}  # the chunked signal was not acted on
    emulator.check()


def test_content_length_must_be_one_plain_number(emulator: HotLoadEmulator) -> None:
    """``int()`` took "1_8" and " +18", and of two different Content-Length headers the first won: a proxy that took
    the other would split the stream elsewhere (RFC 9110 8.6 says refuse). A POST without one is not an empty body."""
    payload = b'{"identity":"s-1"}'
    for headers in ({"Content-Length": "1_8"}, {"Content-Length": "+18"}, {"Content-Length": "\u00b2"}):
        code, _, body = exchange(emulator, "POST", "/hot_load/v1/models/hot_load", payload,
                                 headers={"Content-Type": "application/json", **headers})
        assert code == 400 and "Content-Length" in body["error"]["message"], headers
    host, port = emulator.url.removeprefix("http://").rsplit(":", 1)
    head = (f"POST /hot_load/v1/models/hot_load HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {EMULATOR_API_KEY}\r\n"
            f"fireworks-model: accounts/acct/models/m\r\nfireworks-deployment: {DEP}\r\n"
            "Content-Length: 18\r\nContent-Length: 3\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + payload)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.split()[1] == b"400", data[:200]
    code, _, body = exchange(emulator, "POST", "/hot_load/v1/models/hot_load", payload, headers={})
    assert code == 411 and "Content-Length" in body["error"]["message"]
    assert emulator.state()["deployments"] == {}  # none of them was acted on
    code, _, _ = exchange(emulator, "GET", "/emulator/v1/state", headers={})  # a GET needs none
    assert code == 200
    emulator.check()


def test_an_oversized_body_gets_its_413_while_the_client_is_still_sending(emulator: HotLoadEmulator) -> None:
    """The 413 went out before the body was read, and the connection closed with it unread: a client still sending
    its 8 MiB saw a broken pipe (or a reset) and never the answer. The body is now read and dropped first."""
    from fsdp_hotload.emulator_http import MAX_BODY

    host, port = emulator.url.removeprefix("http://").rsplit(":", 1)
    body = b"x" * (8 * MAX_BODY)
    head = (f"POST /hot_load/v1/models/hot_load HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {EMULATOR_API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        time.sleep(0.2)  # the server has the headers, and answered there and then before
        sock.sendall(body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.split()[1] == b"413", data[:200]
    assert f"{len(body)} bytes" in json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    emulator.check()


def test_stalled_request_times_out(tmp_path: Path) -> None:
    """A client that stops sending mid-body does not hold its handler thread forever."""
    with HotLoadEmulator(str(tmp_path), replicas=1, api_key=EMULATOR_API_KEY, request_timeout_s=0.5) as emu:
        started = time.monotonic()
        code, _, body = exchange(emu, "GET", "/emulator/v1/state", b"{}", headers={"Content-Length": "10"},
                                 half_close=False)
        assert code == 408 and "0.5s" in body["error"]["message"] and time.monotonic() - started < 5


def test_other_methods_get_json_errors(emulator: HotLoadEmulator) -> None:
    for method, want in (("HEAD", 405), ("OPTIONS", 405), ("TRACE", 501)):
        code, headers, body = exchange(emulator, method, "/hot_load/v1/models/hot_load", headers={})
        assert code == want and headers["Content-Type"] == "application/json", method
        if method == "HEAD":
            assert body is None  # a HEAD answer has no body, only its length
        else:
            assert body["error"]["code"] == want and method in body["error"]["message"]
