"""What HotLoadClient refuses to send: resource ids and URLs checked when the client is made, and requests that
cannot be sent ending a wait at once. Real servers on loopback, no mocks."""
from __future__ import annotations

import time
import urllib.parse
from typing import Any

import pytest

from fsdp_hotload.fireworks import HotLoadClient, HotLoadError, HotLoadRequestError

from tests.http_fixture import serve
from tests.test_fireworks_transport import answering

KEY = "fw-secret-key-4f1d9a"
IDS = dict(account_id="acme", model_id="m", deployment_id="dep")


@pytest.mark.parametrize("field,value", [
    ("account_id", "acme?x=1"),            # would have addressed another resource on the control plane
    ("deployment_id", "dep#frag"),
    ("deployment_id", " dep"),
    ("deployment_id", "部署"),
    ("deployment_id", "dep\nX-Injected: 1"),
    ("deployment_id", "accounts/acme/deployments/d p"),
    ("model_id", "my model"),
    ("model_id", "accounts/fire works/models/m"),
    ("model_id", "-m"),
])
def test_ids_that_are_not_fireworks_resource_ids_are_refused_naming_the_field(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{field}.*not a Fireworks resource id"):
        HotLoadClient("http://127.0.0.1:9", api_key=KEY, **{**IDS, field: value})


@pytest.mark.parametrize("ids", [
    dict(account_id="fireworks", model_id="accounts/fireworks/models/qwen3-8b", deployment_id="rl-rollouts"),
    dict(account_id="accounts/acme", model_id="llama-v3p1-8b-instruct", deployment_id="accounts/acme/deployments/x1"),
    dict(account_id="007", model_id="My_Model.v2", deployment_id="a1b2c3d4"),
])
def test_real_world_ids_are_accepted(ids: dict[str, str]) -> None:
    client = HotLoadClient("http://127.0.0.1:9", api_key=KEY, **ids)
    assert client.deployment_name.startswith("accounts/") and client.model_name.startswith("accounts/")


@pytest.mark.parametrize("url,why", [
    ("http://127.0.0.1:80x83", "invalid port"),
    ("http://127.0.0.1:99999", "invalid port"),
    ("http://127.0.0.1:0", "invalid port"),
    ("http://127.0.0.1:8083/my gateway", "in its path"),
    ("http://127.0.0.1:8083/gw\x7f", "in its path"),
])
def test_urls_that_cannot_be_sent_are_refused_naming_the_field(url: str, why: str) -> None:
    """A bad port used to pass, then fail at the first request with a hint about the headers and the key."""
    with pytest.raises(ValueError, match=f"base_url .*{why}"):
        HotLoadClient(url, api_key=KEY, **IDS)
    with pytest.raises(ValueError, match=f"control_plane_url .*{why}"):
        HotLoadClient("http://127.0.0.1:9", control_plane_url=url, api_key=KEY, **IDS)


def test_a_request_that_cannot_be_sent_ends_the_waits_at_once() -> None:
    """http.client's InvalidURL is an HTTPException, so it was retried as transient, and wait_manager/wait_ready
    then polled it until their timeout. The constructor's checks make it rare; a URL changed after them is one
    way it still happens."""
    with serve(answering(200, b'{"replicas": [{}]}')) as url:
        client = HotLoadClient(url, api_key=KEY, retry_budget_s=5, poll_interval_s=0.05, **IDS)
        client.base_url = urllib.parse.urlsplit(url + "/my gw")
        calls: list[Any] = [lambda: client.wait_manager(timeout_s=5), lambda: client.wait_ready("s1", timeout_s=5),
                            lambda: client.signal("s1")]
        for call in calls:
            started = time.monotonic()
            with pytest.raises(HotLoadError) as info:
                call()
            assert time.monotonic() - started < 1.0
            assert isinstance(info.value, HotLoadRequestError)
            assert "/my gw" in str(info.value) and "check base_url" in str(info.value)


@pytest.mark.parametrize("field,value", [("account_id", 12345), ("deployment_id", 7), ("model_id", None)])
def test_ids_that_are_not_strings_are_refused_naming_the_field(field: str, value: object) -> None:
    """Outside the config (which types the ids) an int id raised AttributeError ('int' object has no attribute
    'removeprefix'), naming no field."""
    with pytest.raises(ValueError, match=f"^{field} must be a string, got {type(value).__name__} {value!r}$"):
        HotLoadClient("http://127.0.0.1:9", api_key=KEY, **{**IDS, field: value})
