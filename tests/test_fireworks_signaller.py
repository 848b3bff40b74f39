"""The Signaller over HotLoadClient, against a real scripted HTTP server on loopback: hints bounded and sent only
once a snapshot's status reports a replica, the retry budget that follows ready_timeout_s, and a config's gateway
headers on every request."""
from __future__ import annotations

import time
from typing import Any

import pytest
from pydantic import ValidationError

from tests import test_fireworks
from tests.test_fireworks import KEY, Scripted, make_client, status_body

server = test_fireworks.server  # the scripted server fixture: pytest finds it under this name here too


def test_hints_are_bounded_and_stop_for_a_snapshot_after_one_fails(server: tuple[str, Scripted]) -> None:
    """Hints are best effort: with the API answering 503, each used to retry for the client's whole budget, once
    per file, holding the upload workers (and close()) for minutes. Now one hint takes at most the signaller's
    deadline, and after it fails that snapshot's other files send none; the next snapshot tries again, after one
    status request (a 5xx may mean the hot-load manager went down, and a POST before it is up can crash it)."""
    from fsdp_hotload.engine.signal import Signaller

    url, script = server
    script.push(200, {"replicas": [{"current_snapshot_identity": None, "readiness": True}]})  # the manager is up
    script.default = (503, {"error": "down"}, {})
    sig = Signaller([make_client(url, retry_budget_s=300)], ready_timeout_s=0.3)
    t0 = time.monotonic()
    for name in ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                 "model-00003-of-00003.safetensors"):
        sig.hint("step-000001-aaaaaaaa", name, None)
    assert time.monotonic() - t0 < 5  # one bounded hint, not three budgets of 300 s
    first = len(script.requests)
    posts = [r for r in script.requests if r["method"] == "POST"]
    assert first >= 3 and len(posts) == first - 1
    assert {r["body"]["filename"] for r in posts} == {"model-00001-of-00003.safetensors"}
    script.push(200, {"replicas": [{"current_snapshot_identity": None, "readiness": True}]})  # up again
    sig.hint("step-000002-aaaaaaaa", "model-00001-of-00003.safetensors", "step-000001-aaaaaaaa")
    later = [r["method"] for r in script.requests[first:]]
    assert later[0] == "GET" and len(later) > 1 and set(later[1:]) == {"POST"}, later
    sig.close()


def test_no_hint_before_the_deployment_reports_a_replica(server: tuple[str, Scripted]) -> None:
    """A POST before the deployment's hot-load manager is up can crash the serving container (the reference
    client waits for replicas before its first signal), and a hint is a POST. So a Signaller reads the status
    before each snapshot's first hint: no replica, or no readable status, means no hints for that snapshot. It
    reads it again for the next snapshot, even once a replica was reported: the container may restart meanwhile
    (step 5), where the hints used to go without asking."""
    from fsdp_hotload.engine.signal import Signaller

    url, script = server
    up = {"replicas": [{"current_snapshot_identity": None, "readiness": True}]}
    script.push(200, {"replicas": []})  # snapshot 1: the manager is not up
    script.push(503, {"error": "starting"})  # snapshot 2: the status cannot be read
    script.push(200, up)  # snapshot 3: up
    sig = Signaller([make_client(url, retry_budget_s=0)], ready_timeout_s=5)
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for n, identity in enumerate(("step-000001-aaaaaaaa", "step-000002-aaaaaaaa", "step-000003-aaaaaaaa")):
        for name in files:
            sig.hint(identity, name, None)
        assert [r["method"] for r in script.requests] == ["GET"] * (n + 1) + ["POST"] * (2 if n == 2 else 0)
    script.push(200, up)  # snapshot 4: still up
    script.push(200, {"replicas": []})  # snapshot 5: its container restarts
    for identity in ("step-000004-aaaaaaaa", "step-000005-aaaaaaaa"):
        for name in files:
            sig.hint(identity, name, "step-000003-aaaaaaaa")
    assert [r["method"] for r in script.requests[3:]] == ["POST", "POST", "GET", "POST", "POST", "GET"]
    assert [r["body"]["snapshot"]["identity"] for r in script.requests[3:] if r["method"] == "POST"] == [
        "step-000003-aaaaaaaa", "step-000003-aaaaaaaa", "step-000004-aaaaaaaa", "step-000004-aaaaaaaa"]
    sig.close()


def test_signaller_retry_budget_follows_ready_timeout(tmp_path: Any) -> None:
    from fsdp_hotload import HotloadConfig
    from fsdp_hotload.engine.signal import Signaller

    def budget(ready_timeout_s: float) -> float:
        cfg = HotloadConfig(bucket_url=str(tmp_path), hotload_api_url="http://127.0.0.1:1", account_id="a",
                            model_id="m", deployment_id="d", api_key=KEY, ready_timeout_s=ready_timeout_s,
                            hf_config_dir=str(tmp_path))
        sig = Signaller.from_config(cfg)
        assert sig is not None
        sig.close()
        return sig.clients[0].retry_budget_s

    assert budget(5) == 5 and budget(3600) == 300


def test_config_reaches_a_private_gateway_with_its_headers(server: tuple[str, Scripted], tmp_path: Any) -> None:
    """A gateway secret set in the config is sent on every request (masked in the config's repr), and plain
    http to another host needs the config's explicit consent, refused by name without it."""
    from fsdp_hotload.config import HotloadConfig
    from fsdp_hotload.engine.signal import Signaller

    url, script = server
    common = dict(bucket_url=str(tmp_path), account_id="acct", model_id="m", deployment_id="d", api_key=KEY,
                  hf_config_dir=str(tmp_path), poll_interval_s=0.02)
    with pytest.raises(ValidationError, match="hotload_api_allow_http"):
        HotloadConfig(hotload_api_url="http://10.0.0.5:8083", **common)
    remote = HotloadConfig(hotload_api_url="http://10.0.0.5:8083", hotload_api_allow_http=True, **common)
    assert Signaller.from_config(remote) is not None
    cfg = HotloadConfig(hotload_api_url=url, hotload_api_headers={"x-gateway-secret": "gw-S3CRET"}, **common)
    assert "gw-S3CRET" not in repr(cfg) and "x-gateway-secret" in repr(cfg)
    script.default = (200, status_body(("s1", True, "done", "s1")), {})
    sig = Signaller.from_config(cfg)
    assert sig is not None
    sig.signal_and_wait("s1", None)
    sig.close()
    assert [r["method"] for r in script.requests] == ["GET", "POST", "GET"]  # the manager check comes first
    assert all(r["headers"]["x-gateway-secret"] == "gw-S3CRET" for r in script.requests)
