"""The emulator's HTTP front door: how long a request may take to arrive and which request headers it needs,
over real sockets on loopback."""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from fsdp_hotload.emulator import HotLoadEmulator
from tests.emulator_fixture import EMULATOR_API_KEY

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
