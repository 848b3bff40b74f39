"""HotLoadClient's time and size bounds on the wire, against real servers on loopback that misbehave."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from fsdp_hotload.fireworks import HotLoadClient, HotLoadError

KEY = "fw-secret-key-4f1d9a"


def make_client(url: str, **kw: Any) -> HotLoadClient:
    opts: dict[str, Any] = dict(account_id="acct", model_id="m", deployment_id="d", api_key=KEY,
                                backoff_initial_s=0.01, backoff_max_s=0.05, retry_budget_s=5, poll_interval_s=0.02)
    opts.update(kw)
    return HotLoadClient(url, **opts)


@contextmanager
def silent_server() -> Iterator[str]:
    """Accepts connections and reads nothing, answers nothing: a request sent there waits for its timeout."""
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = lsn.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{lsn.getsockname()[1]}"
    finally:
        lsn.close()
        for conn in held:
            conn.close()


def test_an_attempt_never_outlasts_the_retry_budget() -> None:
    """Without a deadline (signal, reset_ledger) the last attempt used to take the full timeout_s, so a server
    that takes the request and never answers held the call far past retry_budget_s (and longest_signal_s)."""
    with silent_server() as url:
        client = make_client(url, retry_budget_s=1.0, timeout_s=10.0)
        for call in (lambda: client.signal("s1"), client.reset_ledger):
            started = time.monotonic()
            with pytest.raises(HotLoadError, match="no answer after"):
                call()
            assert time.monotonic() - started < 3.0
