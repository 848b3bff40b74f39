"""How HotLoadClient reads status answers while it waits: which ones end the wait at once, which are polled
through, and which fields must have their documented types. Real servers on loopback, no mocks."""
from __future__ import annotations

import json
import time
from typing import Any

import pytest

from fsdp_hotload.fireworks import HotLoadClient, HotLoadError, HotLoadResponseError

from tests.http_fixture import serve
from tests.test_fireworks_transport import answering

KEY = "fw-secret-key-4f1d9a"
READY = {"current_snapshot_identity": "s1", "readiness": True,
         "loading_state": {"stage": "done", "target_snapshot_identity": "s1"}}


def make_client(url: str, **kw: Any) -> HotLoadClient:
    opts: dict[str, Any] = dict(account_id="acct", model_id="m", deployment_id="d", api_key=KEY,
                                backoff_initial_s=0.01, backoff_max_s=0.05, retry_budget_s=5, poll_interval_s=0.02)
    opts.update(kw)
    return HotLoadClient(url, **opts)


@pytest.mark.parametrize("odd", [
    {"supports_rdma_weight_sync": "unknown"},
    {"rdma_weight_sync_enabled": 0.5},
    {"loaded_adapters": [{"identity": "a", "status": 1}, "adapter-b", None]},
    {"loaded_adapters": {"a": "loaded"}},
    {"loading_state": "done"},
    {"loading_state": {"stage": 3, "target_snapshot_identity": ["s1"]}},
])
def test_fields_the_readiness_test_does_not_read_may_have_any_type(odd: dict[str, Any]) -> None:
    """A server that retypes a field the readiness test never reads used to end the wait (and the publish) with
    'unrecognized hot-load status' although every replica served the snapshot."""
    with serve(answering(200, json.dumps({"replicas": [{**READY, **odd}]}).encode())) as url:
        st = make_client(url).wait_ready("s1", timeout_s=5)
    assert st.is_ready("s1")
    rep = st.replicas[0]
    assert rep.supports_rdma_weight_sync is None and rep.rdma_weight_sync_enabled is None
    assert all(a.status is None or isinstance(a.status, str) for a in rep.loaded_adapters)


def test_a_status_format_error_names_the_field() -> None:
    bad = {"replicas": [READY, {**READY, "readiness": "maybe"}]}
    with serve(answering(200, json.dumps(bad).encode())) as url:
        with pytest.raises(HotLoadResponseError, match=r"format: replicas\.1\.readiness: Input should be"):
            make_client(url).wait_ready("s1", timeout_s=5)


def test_a_json_object_without_replicas_ends_the_wait_at_once() -> None:
    """A literal ``{}`` used to be taken for an empty body and polled until the timeout; it is a status without
    a ``replicas`` list, which the reference client raises at once (protocol notes §3.3 step 5). An empty body
    is still polled through (tests/test_fireworks.py)."""
    with serve(answering(200, b"{}")) as url:
        started = time.monotonic()
        with pytest.raises(HotLoadResponseError, match="format: replicas: Field required"):
            make_client(url).wait_ready("s1", timeout_s=3)
        assert time.monotonic() - started < 1.0


def test_an_empty_signal_answer_is_an_empty_result() -> None:
    with serve(answering(200, b"")) as url:
        assert make_client(url).signal("s1") == {}


@pytest.mark.parametrize("status,headers", [(301, {"Location": "https://gw.example/v2/hot_load/v1/models/hot_load"}),
                                            (307, {}), (405, {}), (410, {}), (415, {}), (422, {})])
def test_statuses_that_polling_cannot_change_end_both_waits_at_once(status: int, headers: dict[str, str]) -> None:
    """Redirects (never followed: they would carry the key on), 405, 410, 415 and 422 were polled until the
    timeout, and a redirect's message did not say where it pointed."""
    with serve(answering(status, b'{"error": {"message": "nope"}}', headers=headers)) as url:
        client = make_client(url)
        for wait in (lambda: client.wait_ready("s1", timeout_s=5), lambda: client.wait_manager(timeout_s=5)):
            started = time.monotonic()
            with pytest.raises(HotLoadError, match=f"HTTP {status}") as info:
                wait()
            assert time.monotonic() - started < 1.0 and info.value.status_code == status
            if "Location" in headers:
                assert f"(Location: {headers['Location']})" in str(info.value)
                assert "point hotload_api_url at the final URL (https://gw.example/" in str(info.value)


def in_turn(*replies: tuple[int, bytes, dict[str, str]]) -> Any:
    """A handler class that gives ``replies`` in turn, then the last one again and again."""
    from http.server import BaseHTTPRequestHandler

    queue = list(replies)

    class Handler(BaseHTTPRequestHandler):
        def _any(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, body, headers = queue.pop(0) if len(queue) > 1 else queue[0]
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _any

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


DEEP = b"[" * 5000 + b"]" * 5000  # valid JSON, nested deeper than the parser recurses
READY_BODY = json.dumps({"replicas": [READY]}).encode()


def test_a_retry_after_date_out_of_range_is_ignored() -> None:
    """A Retry-After date in the year 10000 raised a bare ValueError out of the wait instead of being ignored
    like any other unreadable header."""
    with serve(in_turn((503, b'{"error": "busy"}', {"Retry-After": "Fri, 01 Jan 10000 00:00:00 GMT"}),
                       (200, READY_BODY, {}))) as url:
        assert make_client(url).wait_ready("s1", timeout_s=5).is_ready("s1")


def test_json_nested_too_deep_is_an_unreadable_body_not_a_recursion_error() -> None:
    """A deeply nested body escaped as RecursionError: a status poll ended the wait instead of polling through,
    and an error answer lost its status code (so no hint and no fallback)."""
    with serve(in_turn((200, DEEP, {}), (200, READY_BODY, {}))) as url:
        assert make_client(url).wait_ready("s1", timeout_s=5).is_ready("s1")
    for status in (400, 503):
        with serve(answering(status, DEEP)) as url:
            with pytest.raises(HotLoadError, match=f"HTTP {status}") as info:
                make_client(url, retry_budget_s=1.0).signal("s1")
            assert info.value.status_code == status


def test_a_servers_error_message_is_cut_short(caplog: pytest.LogCaptureFixture) -> None:
    """``error.message``, a string ``error`` and ``message`` were quoted whole: a 200 kB message went into the
    error and into every retry's log line (11 MB of log in a 3 s budget)."""
    import logging

    for body in ({"error": {"message": "x" * 200_000}}, {"error": "x" * 200_000}, {"message": "x" * 200_000}):
        caplog.clear()
        with serve(answering(503, json.dumps(body).encode())) as url, caplog.at_level(logging.WARNING):
            with pytest.raises(HotLoadError, match="x" * 500) as info:
                make_client(url, retry_budget_s=1.0).signal("s1")
        assert len(str(info.value)) < 2000
        assert caplog.records and max(len(r.getMessage()) for r in caplog.records) < 2000
    bad = {**READY, "readiness": False, "loading_state": {"stage": "error", "target_snapshot_identity": "s1",
                                                          "error": "y" * 100_000}}
    with serve(answering(200, json.dumps({"replicas": [bad]}).encode())) as url:
        with pytest.raises(HotLoadError, match="y" * 500) as info:
            make_client(url).wait_ready("s1", timeout_s=5)
        assert len(str(info.value)) < 2000
