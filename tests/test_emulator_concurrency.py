"""The emulator while work is in flight: stop() with loads reading the bucket and requests still arriving, and a
fault injected while a request names a new deployment. Real HTTP on loopback and real snapshot files; the slow
or hanging bucket is the emulator's own reader wrapped with a delay (``settings.get_bytes`` is read at use time)."""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import pytest

from fsdp_hotload import emulator as emulator_module
from fsdp_hotload.emulator import HotLoadEmulator
from tests.emulator_fixture import EMULATOR_API_KEY, tiny_model, write_full_snapshot
from tests.test_emulator import raw

HOT_LOAD = "/hot_load/v1/models/hot_load"
DEPLOYMENTS = ("accounts/acct/deployments/d1", "accounts/acct/deployments/d2")


def replica_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hotload-emulator-accounts")]


def signal_everywhere(emu: HotLoadEmulator, identity: str) -> None:
    for dep in DEPLOYMENTS:
        code, body = raw(emu, "POST", HOT_LOAD, {"identity": identity}, headers={"fireworks-deployment": dep})
        assert code == 200, body


def shard_reads_wait_for(emu: HotLoadEmulator, wait: Callable[[], None]) -> list[str]:
    """Make each shard read call ``wait`` first; returns the list the shard reads are recorded in as they start."""
    started: list[str] = []
    read = emu.settings.get_bytes

    def slow(rel: str) -> bytes:
        if rel.endswith(".safetensors"):
            started.append(rel)
            wait()
        return read(rel)

    emu.settings.get_bytes = slow
    return started


def test_stop_ends_every_load_at_its_next_file(tmp_path: Path) -> None:
    """A load reading the bucket never looked at cancellation (only the artificial delay did), and stop() joined
    each replica in turn: with four replicas loading a slow three-shard snapshot it read all twelve shards before
    returning. Now every load stops after the shard it is reading, and no replica thread outlives stop()."""
    write_full_snapshot(tmp_path, "s1", tiny_model(0))  # three shard files
    emu = HotLoadEmulator(str(tmp_path), replicas=2, api_key=EMULATOR_API_KEY).start()
    started = shard_reads_wait_for(emu, lambda: time.sleep(1.0))
    signal_everywhere(emu, "s1")
    deadline = time.monotonic() + 10
    while len(started) < 4 and time.monotonic() < deadline:  # each replica is in its first shard read
        time.sleep(0.01)
    assert len(started) == 4, started
    emu.stop()
    assert replica_threads() == []
    assert len(started) == 4, f"loads went on reading after stop(): {started}"


def test_stop_waits_for_every_replica_against_one_deadline_and_says_which_still_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A bucket read that hangs kept stop() waiting its whole join timeout once per replica thread; now the wait
    is one deadline for all of them, and the threads still running then are named in a warning."""
    monkeypatch.setattr(emulator_module, "STOP_JOIN_S", 0.5)
    write_full_snapshot(tmp_path, "s1", tiny_model(0))
    emu = HotLoadEmulator(str(tmp_path), replicas=2, api_key=EMULATOR_API_KEY).start()
    release = threading.Event()
    started = shard_reads_wait_for(emu, lambda: release.wait(30))
    try:
        signal_everywhere(emu, "s1")
        deadline = time.monotonic() + 10
        while len(started) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger="fsdp_hotload.emulator"):
            t0 = time.monotonic()
            emu.stop()
            took = time.monotonic() - t0
        assert took < 1.5, f"stop() took {took:.1f}s with a 0.5 s deadline"
        (record,) = [r for r in caplog.records if "still running" in r.getMessage()]
        assert record.levelno == logging.WARNING and "4 replica thread(s)" in record.getMessage()
        assert all(name in record.getMessage() for name in replica_threads())
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while replica_threads() and time.monotonic() < deadline:  # released, each stops at its next file
        time.sleep(0.01)
    assert replica_threads() == [] and len(started) == 4


def wait_accepted(before: set[threading.Thread], timeout_s: float = 30) -> None:
    """Until the emulator's accept loop took the connection (a handler thread runs): one still in the listen queue
    at stop() is reset, not answered 503, and a loaded machine may not run the accept loop within a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while not any("process_request_thread" in t.name for t in set(threading.enumerate()) - before):
        assert time.monotonic() < deadline, "the emulator never accepted the connection"
        time.sleep(0.01)


@pytest.mark.parametrize("method, path", [("GET", "/v1/accounts"), ("GET", "/emulator/v1/state"),
                                          ("GET", "/v1/accounts/acct/deployments/d1/ledger"),
                                          ("DELETE", "/v1/accounts/acct/deployments/d1/ledger"),
                                          ("GET", HOT_LOAD)])
def test_every_route_answers_503_to_a_request_finished_after_stop(tmp_path: Path, method: str, path: str) -> None:
    """Only the routes that make a deployment said 'stopping'; the account lookup, the state and ledger routes
    answered a request that was in flight as stop() ran as if the emulator were still up."""
    emu = HotLoadEmulator(str(tmp_path), replicas=1, api_key=EMULATOR_API_KEY).start()
    host, port = emu.url.removeprefix("http://").rsplit(":", 1)
    before = set(threading.enumerate())
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {EMULATOR_API_KEY}\r\n"
                     "fireworks-model: accounts/acct/models/m\r\n"
                     f"fireworks-deployment: {DEPLOYMENTS[0]}\r\n".encode())  # the headers are not finished
        wait_accepted(before)
        emu.stop()
        sock.sendall(b"\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line.split()[1] == b"503", data
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["message"] == "the emulator is stopping"


class _LockThatLetsARequestIn:
    """The emulator's settings lock, which the first time the test's own thread takes it lets a GET name a new
    deployment first (waiting up to a second for it): the moment fail_next_loads has listed the deployments and
    not yet set their counts."""

    def __init__(self, lock: threading.Lock, request: Callable[[], None]) -> None:
        self.lock, self.request, self.armed = lock, request, True

    def __enter__(self) -> bool:
        if self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            t = threading.Thread(target=self.request, daemon=True)
            t.start()
            t.join(1.0)  # a fail_next_loads holding the deployments' lock makes the GET wait for it instead
        return self.lock.__enter__()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.lock.__exit__(kind, exc, tb)


def test_a_deployment_named_while_fail_next_loads_runs_fails_its_first_load(tmp_path: Path) -> None:
    """fail_next_loads(k) listed the deployments under one lock and set their counts under another: a deployment
    that a request named in between got neither its own count nor that of deployments named later."""
    write_full_snapshot(tmp_path, "s1", tiny_model(0))
    with HotLoadEmulator(str(tmp_path), replicas=1, api_key=EMULATOR_API_KEY) as emu:
        real = emu.settings.lock
        answers: list[int] = []

        def first_poll() -> None:  # the trainer's first status poll makes the deployment
            answers.append(raw(emu, "GET", HOT_LOAD, headers={"fireworks-deployment": DEPLOYMENTS[0]})[0])

        emu.settings.lock = _LockThatLetsARequestIn(real, first_poll)  # type: ignore[assignment]
        try:
            emu.fail_next_loads(1)
        finally:
            emu.settings.lock = real
        deadline = time.monotonic() + 10
        while not answers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert answers == [200]
        code, _ = raw(emu, "POST", HOT_LOAD, {"identity": "s1"}, headers={"fireworks-deployment": DEPLOYMENTS[0]})
        assert code == 200
        while time.monotonic() < deadline:
            (replica,) = emu.state()["deployments"][DEPLOYMENTS[0]]["replicas"]
            if replica["stage"] in ("done", "error"):
                break
            time.sleep(0.02)
        assert replica["stage"] == "error" and "fail_next_loads" in replica["error"], replica
