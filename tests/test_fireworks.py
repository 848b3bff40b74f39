"""HotLoadClient against a real scripted HTTP server on loopback: the requests it sends, its retries, the URL rule,
waiting for replicas, and the request models. Its secrets are in test_fireworks_secrets.py, the Signaller over it in
test_fireworks_signaller.py."""
from __future__ import annotations

import email.utils
import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from pydantic import ValidationError

from fsdp_hotload.fireworks import (
    DeploymentTarget,
    HintRequest,
    HotLoadClient,
    HotLoadError,
    HotLoadRequest,
    HotLoadResponseError,
    HotLoadStatus,
    HotLoadTimeout,
    IncrementalSnapshotMetadata,
    validate_identity,
)

from tests.http_fixture import serve

KEY = "fw-secret-key-4f1d9a"
TRANSPORT_HEADERS = {"host", "accept-encoding", "content-length"}


class Scripted:
    """Records every request; answers from a queue of (status, body, headers), then with ``default``."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.responses: deque[tuple[int, Any, dict[str, str]]] = deque()
        self.default: tuple[int, Any, dict[str, str]] = (200, {"status": "ok"}, {})
        self.lock = threading.Lock()

    def push(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        self.responses.append((status, body, headers or {}))

    def bodies(self) -> list[Any]:
        return [r["body"] for r in self.requests]


@pytest.fixture
def server() -> Iterator[tuple[str, Scripted]]:
    script = Scripted()

    class Handler(BaseHTTPRequestHandler):
        def _any(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            with script.lock:
                script.requests.append({
                    "method": self.command, "path": self.path,
                    "headers": {k.lower(): v for k, v in self.headers.items()},
                    "body": json.loads(raw) if raw else None,
                })
                status, body, headers = script.responses.popleft() if script.responses else script.default
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _any

        def log_message(self, *args: Any) -> None:
            pass

    with serve(Handler) as url:
        yield url, script


def make_client(url: str, **kw: Any) -> HotLoadClient:
    opts: dict[str, Any] = dict(account_id="acct", model_id="m", deployment_id="d", api_key=KEY,
                                backoff_initial_s=0.01, backoff_max_s=0.05, retry_budget_s=5, poll_interval_s=0.02)
    opts.update(kw)
    return HotLoadClient(url, **opts)


def status_body(*replicas: tuple[str | None, bool, str, str | None]) -> dict[str, Any]:
    return {"replicas": [
        {"current_snapshot_identity": cur, "readiness": ready,
         "loading_state": {"stage": stage, "target_snapshot_identity": target}, "some_future_field": 1}
        for cur, ready, stage, target in replicas
    ]}


# ------------------------------------------------------------------------------------------------ headers/body


def test_signal_sends_exactly_the_documented_headers_and_body(server: tuple[str, Scripted]) -> None:
    url, script = server
    client = make_client(url)
    assert client.signal("step-1") == {"status": "ok"}
    client.signal("step-2", previous_identity="step-1", reset_prompt_cache="new_session",
                  source_url="s3://b/p/step-2/")
    script.push(200, {"replicas": []})
    assert client.status().replicas == []
    first, second, poll = script.requests
    assert first["method"] == "POST" and first["path"] == "/hot_load/v1/models/hot_load"
    hdrs = {k: v for k, v in first["headers"].items() if k not in TRANSPORT_HEADERS}
    assert hdrs == {
        "authorization": f"Bearer {KEY}",
        "fireworks-model": "accounts/acct/models/m",
        "fireworks-deployment": "accounts/acct/deployments/d",
        "content-type": "application/json",
    }
    assert first["body"] == {"identity": "step-1"}
    assert second["body"] == {
        "identity": "step-2",
        "incremental_snapshot_metadata": {"previous_snapshot_identity": "step-1", "compression_format": "arc_v2",
                                          "checksum_format": "alder32"},
        "reset_prompt_cache": "new_session",
    }
    assert second["headers"]["x-fireworks-hot-load-source-url"] == "s3://b/p/step-2/"
    assert poll["method"] == "GET" and poll["body"] is None
    assert {k: v for k, v in poll["headers"].items() if k not in TRANSPORT_HEADERS} == hdrs


def test_full_resource_names_and_additional_headers(server: tuple[str, Scripted]) -> None:
    url, script = server
    client = make_client(url, model_id="accounts/fireworks/models/qwen3-8b",
                         deployment_id="accounts/acct/deployments/d", additional_headers={"X-Gateway-Secret": "g"})
    client.signal("s1")
    h = script.requests[0]["headers"]
    assert h["fireworks-model"] == "accounts/fireworks/models/qwen3-8b"
    assert h["fireworks-deployment"] == "accounts/acct/deployments/d"
    assert h["x-gateway-secret"] == "g"
    with pytest.raises(ValueError, match="belongs to account"):
        make_client(url, deployment_id="accounts/other/deployments/d")
    with pytest.raises(ValueError, match="model_id"):
        make_client(url, model_id="accounts/x/deployments/m")


def test_hint_and_reset_ledger_paths(server: tuple[str, Scripted]) -> None:
    url, script = server
    client = make_client(url)
    client.hint("step-2", "model-00001.safetensors", previous_identity="step-1")
    client.reset_ledger()
    hint, reset = script.requests
    assert hint["path"] == "/hot_load/v1/models/hot_load/hint"
    assert hint["body"] == {
        "snapshot": {"identity": "step-2", "incremental_snapshot_metadata": {
            "previous_snapshot_identity": "step-1", "compression_format": "arc_v2", "checksum_format": "alder32"}},
        "filename": "model-00001.safetensors",
    }
    assert reset["method"] == "DELETE" and reset["path"] == "/v1/accounts/acct/deployments/d/ledger"
    with pytest.raises(ValueError, match="filename"):
        client.hint("step-2", "../escape.safetensors")


# ------------------------------------------------------------------------------------------------ retries


def test_retries_503_then_succeeds(server: tuple[str, Scripted]) -> None:
    url, script = server
    script.push(503, {"error": "overloaded"})
    script.push(502, "bad gateway".encode())
    assert make_client(url).signal("s1") == {"status": "ok"}
    assert [r["body"] for r in script.requests] == [{"identity": "s1"}] * 3


def test_retry_budget_exhausted_reports_server_message(server: tuple[str, Scripted]) -> None:
    url, script = server
    script.default = (503, {"error": {"message": "replica pool draining"}}, {})
    with pytest.raises(HotLoadError) as info:
        make_client(url, retry_budget_s=1.0).signal("s1")  # room for a retry on a busy machine
    assert info.value.status_code == 503
    assert "replica pool draining" in str(info.value) and "what to do" in str(info.value)
    assert len(script.requests) >= 2


def test_client_errors_are_not_retried(server: tuple[str, Scripted]) -> None:
    url, script = server
    script.push(409, {"error": {"message": "identity reused"}})
    with pytest.raises(HotLoadError, match="identity reused") as info:
        make_client(url).signal("s1")
    assert info.value.status_code == 409 and "new identity" in (info.value.hint or "")
    assert len(script.requests) == 1


def test_a_conflict_for_a_retried_signal_is_the_earlier_attempt_accepted(server: tuple[str, Scripted],
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The first attempt's answer is lost (a 502 from a proxy after the server took it); the retry then meets a
    server that already has that identity. Every identity is new to its run, so a 409 to a retry is the earlier
    attempt accepted: the signal succeeds and the readiness wait decides, instead of failing a loading snapshot."""
    url, script = server
    script.push(502, {"error": {"message": "upstream reset"}})
    script.push(409, {"error": {"message": "identity s1 already exists"}})
    client = make_client(url)
    with caplog.at_level(logging.WARNING):
        assert client.signal("s1") == {}
    assert len(script.requests) == 2
    assert "HTTP 409 after 2 attempts" in caplog.text
    script.default = (200, status_body(("s1", True, "done", "s1")), {})
    assert client.wait_ready("s1", timeout_s=5).is_ready("s1")


def test_connection_refused_is_retried_then_raised() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(HotLoadError, match="no answer after") as info:
        make_client(f"http://127.0.0.1:{port}", retry_budget_s=0.1).signal("s1")
    assert info.value.status_code is None


def test_reset_prompt_cache_fallback_is_remembered(server: tuple[str, Scripted]) -> None:
    url, script = server
    script.push(400, {"error": {"message": "Extra inputs are not permitted, field: 'reset_prompt_cache', "
                                           "value: True"}})
    client = make_client(url)
    client.signal("s1", reset_prompt_cache=True)
    client.signal("s2", reset_prompt_cache="all")
    assert script.bodies() == [{"identity": "s1", "reset_prompt_cache": True}, {"identity": "s1"}, {"identity": "s2"}]
    assert client.send_reset_prompt_cache is False


def test_other_400_is_raised_without_fallback(server: tuple[str, Scripted]) -> None:
    url, script = server
    script.push(400, {"error": {"message": "previous_snapshot_identity 'x' is not in the ledger"}})
    with pytest.raises(HotLoadError, match="not in the ledger"):
        make_client(url).signal("s1", previous_identity="x", reset_prompt_cache="all")
    assert len(script.requests) == 1


# ------------------------------------------------------------------------------------------------ URL rule


@pytest.mark.parametrize("url", ["http://127.0.0.1:1", "http://127.8.9.10", "http://localhost:8083",
                                 "http://[::1]:9", "https://api.fireworks.ai"])
def test_loopback_http_and_https_are_allowed(url: str) -> None:
    make_client(url)


def test_plain_http_to_remote_host_needs_allow_insecure() -> None:
    with pytest.raises(ValueError, match="https"):
        make_client("http://10.0.0.5:8083")
    make_client("http://10.0.0.5:8083", allow_insecure=True)
    with pytest.raises(ValueError, match="http"):
        make_client("ftp://127.0.0.1/")


# ------------------------------------------------------------------------------------------------ waiting


def test_wait_ready_needs_every_replica(server: tuple[str, Scripted]) -> None:
    url, script = server
    script.push(200, status_body(("s1", True, "done", "s1"), ("s0", True, "downloading", "s1")))
    script.push(200, status_body(("s1", True, "done", "s1"), ("s0", False, "swapping", "s1")))
    script.default = (200, status_body(("s1", True, "done", "s1"), ("s1", True, "done", "s1")), {})
    seen: list[HotLoadStatus] = []
    st = make_client(url).wait_ready("s1", timeout_s=10, on_poll=seen.append)
    assert st.is_ready("s1") and len(seen) == 3
    assert st.replicas[0].model_extra == {"some_future_field": 1}


def test_a_failing_progress_callback_does_not_fail_the_wait(server: tuple[str, Scripted],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    url, script = server
    script.push(200, status_body(("s0", True, "downloading", "s1"), ("s0", True, "downloading", "s1")))
    script.default = (200, status_body(("s1", True, "done", "s1"), ("s1", True, "done", "s1")), {})
    calls: list[int] = []

    def report(_: HotLoadStatus) -> None:
        calls.append(1)
        raise KeyError("a bug in the progress report")

    st = make_client(url).wait_ready("s1", timeout_s=10, on_poll=report)
    assert st.is_ready("s1") and len(calls) == 2
    assert "the on_poll callback failed (the wait goes on)" in caplog.text


def test_wait_ready_timeout_message_shows_each_replica(server: tuple[str, Scripted]) -> None:
    url, script = server
    script.default = (200, status_body(("s1", True, "done", "s1"), ("s0", True, "downloading", "s1")), {})
    with pytest.raises(HotLoadTimeout) as info:
        make_client(url).wait_ready("s1", timeout_s=0.2)
    msg = str(info.value)
    assert "replica 0: current='s1' readiness=True stage='done'" in msg
    assert "replica 1: current='s0' readiness=True stage='downloading' target='s1'" in msg


def test_empty_replica_list_is_not_ready(server: tuple[str, Scripted]) -> None:
    url, script = server
    script.default = (200, {"replicas": []}, {})
    with pytest.raises(HotLoadTimeout, match="no replicas reported"):
        make_client(url).wait_ready("s1", timeout_s=0.1)


def test_wait_ready_fails_fast_on_error_for_this_identity(server: tuple[str, Scripted]) -> None:
    url, script = server
    script.default = (200, status_body(("s0", True, "done", "s1"), ("s0", True, "error", "s1")), {})
    with pytest.raises(HotLoadError) as info:
        make_client(url).wait_ready("s1", timeout_s=30)
    assert not isinstance(info.value, HotLoadTimeout)
    assert "replica(s) 1" in str(info.value)
    assert len(script.requests) == 1


def test_every_replica_serving_the_identity_is_ready_despite_an_error_for_it(server: tuple[str, Scripted]) -> None:
    """The reference wait tests readiness before the error stage (§3.3): a replica that serves the snapshot and
    still reports an error for it (a repeated signal's second load, say) does not fail a snapshot every replica
    serves."""
    url, script = server
    script.default = (200, status_body(("s1", True, "done", "s1"), ("s1", True, "error", "s1")), {})
    assert make_client(url).wait_ready("s1", timeout_s=10).is_ready("s1")
    assert len(script.requests) == 1


def test_stale_error_is_ignored(server: tuple[str, Scripted]) -> None:
    url, script = server
    script.push(200, status_body(("s0", True, "error", "s-old"), ("s0", True, "pending", "s1")))
    script.default = (200, status_body(("s1", True, "done", "s1"), ("s1", True, "done", "s1")), {})
    assert make_client(url).wait_ready("s1", timeout_s=10).is_ready("s1")


def test_wait_ready_polls_through_transient_errors_but_not_auth(server: tuple[str, Scripted]) -> None:
    url, script = server
    script.push(500, {"error": "hiccup"})
    script.default = (200, status_body(("s1", True, "done", "s1")), {})
    assert make_client(url, retry_budget_s=0).wait_ready("s1", timeout_s=10).is_ready("s1")
    script.push(401, {"error": "bad key"})
    with pytest.raises(HotLoadError) as info:
        make_client(url).wait_ready("s1", timeout_s=10)
    assert info.value.status_code == 401


def test_404_is_polled_through_after_a_signal_but_not_before(server: tuple[str, Scripted]) -> None:
    """Once a signal was accepted the deployment exists, so a 404 on status is a route catching up (the reference
    client polls through it); in the manager wait before any signal it is a wrong URL or deployment."""
    url, script = server
    script.push(404, {"error": "no route"})
    script.push(404, {"error": "no route"})
    script.default = (200, status_body(("s1", True, "done", "s1")), {})
    assert make_client(url).wait_ready("s1", timeout_s=10).is_ready("s1")
    script.push(404, {"error": "no route"})
    with pytest.raises(HotLoadError, match="no route") as info:
        make_client(url).wait_manager(timeout_s=10)
    assert info.value.status_code == 404 and "deployment_id" in (info.value.hint or "")
    script.default = (404, {"error": "no route"}, {})
    with pytest.raises(HotLoadTimeout, match="last error: .*404: no route"):
        make_client(url).wait_ready("s1", timeout_s=0.3)


def test_retry_after_in_seconds_or_as_an_http_date_is_a_floor(server: tuple[str, Scripted]) -> None:
    url, script = server
    client = make_client(url, backoff_max_s=5)
    for as_date in (False, True):
        value = email.utils.formatdate(time.time() + 2, usegmt=True) if as_date else "1"
        script.push(503, {"error": "busy"}, {"Retry-After": value})
        t0 = time.monotonic()
        assert client.signal(f"s-{len(script.requests)}") == {"status": "ok"}
        assert time.monotonic() - t0 >= 0.9, f"Retry-After {value!r} was not honoured"
    script.push(503, {"error": "busy"}, {"Retry-After": "soon"})  # unreadable: the backoff alone applies
    script.push(503, {"error": "busy"}, {"Retry-After": email.utils.formatdate(time.time() - 60, usegmt=True)})
    t0 = time.monotonic()
    assert client.signal("s-last") == {"status": "ok"}
    assert time.monotonic() - t0 < 0.9


def test_unrecognized_status_format(server: tuple[str, Scripted]) -> None:
    url, script = server
    script.default = (200, {"replicas": "nope"}, {})
    with pytest.raises(HotLoadResponseError, match="unrecognized hot-load status"):
        make_client(url).wait_ready("s1", timeout_s=10)


def test_nulls_and_a_page_that_is_not_json_are_polled_through(server: tuple[str, Scripted]) -> None:
    """Only a status without a ``replicas`` list ends the wait, as in the reference client: null fields read as
    their defaults, and a 200 that is not JSON (a proxy's page while the gateway warms up) is polled again."""
    url, script = server
    replica = {"current_snapshot_identity": "s1", "readiness": True, "loaded_adapters": None,
               "loading_state": {"stage": None, "target_snapshot_identity": "s1"}}
    script.push(200, b"<html>upstream warming up</html>")
    script.push(200, {"replicas": [{"current_snapshot_identity": None, "readiness": None, "loading_state": None}]})
    script.default = (200, {"replicas": [replica, replica]}, {})
    st = make_client(url).wait_ready("s1", timeout_s=10)
    assert st.is_ready("s1") and st.replicas[0].stage == "unknown" and st.replicas[0].loaded_adapters == []
    assert len(script.requests) == 3
    script.default = (200, b"<html>still warming up</html>", {})
    with pytest.raises(HotLoadTimeout, match="not JSON"):
        make_client(url).wait_ready("s1", timeout_s=0.2)


# ------------------------------------------------------------------------------------------------ models


@pytest.mark.parametrize("bad,rule", [("", "must not be empty"), ("a/b", "single path segment"),
                                      ("..", "'.' or '..'"), ("x" * 129, "limit is 128"), ("step 1", "may only use")])
def test_validate_identity_rules(bad: str, rule: str) -> None:
    with pytest.raises(ValueError, match="identity") as info:
        validate_identity(bad)
    assert rule in str(info.value)


def test_models_forbid_extras_and_drop_none() -> None:
    assert validate_identity("step-00040.a_b") == "step-00040.a_b"
    req = HotLoadRequest(identity="s2", incremental_snapshot_metadata=IncrementalSnapshotMetadata(
        previous_snapshot_identity="s1"))
    assert req.to_body() == {"identity": "s2", "incremental_snapshot_metadata": {
        "previous_snapshot_identity": "s1", "compression_format": "arc_v2", "checksum_format": "alder32"}}
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        HotLoadRequest.model_validate({"identity": "s1", "bogus": 1})
    with pytest.raises(ValidationError):
        HotLoadRequest.model_validate({"identity": "s1", "reset_prompt_cache": "sometimes"})
    assert HotLoadRequest.model_validate({"identity": "s1", "reset_prompt_cache": False}).reset_prompt_cache is False
    with pytest.raises(ValidationError):
        HintRequest.model_validate({"snapshot": {"identity": "s1"}, "filename": "/etc/passwd"})
    target = DeploymentTarget(account_id="a", model_id="m", deployment_id="d", base_url="http://127.0.0.1:1")
    assert target.deployment_name == "accounts/a/deployments/d"
    assert target.client(api_key="k").model_name == "accounts/a/models/m"


def test_an_empty_status_body_is_polled_through(server: tuple[str, Scripted]) -> None:
    """An empty 200 (a proxy, or the route still coming up) is no status: poll again, like a body that is not
    JSON, instead of failing the wait at once as an unrecognized status."""
    url, script = server
    script.push(200, b"")
    script.push(200, b"   ")
    script.default = (200, status_body(("s1", True, "done", "s1")), {})
    assert make_client(url).wait_ready("s1", timeout_s=10).is_ready("s1")
    assert len(script.requests) == 3


def test_hints_name_the_config_fields_behind_the_client_parameters(server: tuple[str, Scripted]) -> None:
    """A publisher's errors come from this client, whose hints said 'check base_url' and 'raise timeout_s':
    names a HotloadConfig user never set. They now also give the field (hotload_api_url, ready_timeout_s)."""
    url, script = server
    client = make_client(url)
    script.push(404, {"error": {"message": "no such deployment"}})
    with pytest.raises(HotLoadError) as info:
        client.signal("s1")
    assert "hotload_api_url" in str(info.value), str(info.value)
    script.default = (200, status_body(("s0", True, "done", "s0")), {})
    with pytest.raises(HotLoadTimeout) as timeout:
        client.wait_ready("s1", timeout_s=0.1)
    assert "ready_timeout_s" in str(timeout.value), str(timeout.value)


@pytest.mark.parametrize("body", [
    {"error": {"message": "Extra inputs are not permitted", "field": "reset_prompt_cache", "value": True}},
    {"code": 3, "message": "Extra inputs are not permitted", "details": [{"field": "reset_prompt_cache"}]},
    ("1 validation error for HotLoadRequest: " + "x" * 200 + " Extra inputs are not permitted, field: "
     "'reset_prompt_cache', value: True").encode(),
])
def test_reset_prompt_cache_fallback_reads_the_whole_response(server: tuple[str, Scripted], body: Any) -> None:
    """The reference client falls back on a 400 whose response text names both the field and the pydantic
    rejection; the message a client extracts for display (error.message, or the first 200 characters) may leave
    the field name out, and without the fallback every signal to an older server fails."""
    url, script = server
    script.push(400, body)
    client = make_client(url)
    client.signal("s1", reset_prompt_cache="all")
    assert script.bodies() == [{"identity": "s1", "reset_prompt_cache": "all"}, {"identity": "s1"}]
    assert client.send_reset_prompt_cache is False
