"""Credentials never reach a repr, an error, a log line, a JSON dump or Megatron's printed arguments.

Each test names one way a secret used to get out: a credential option the mask did not know, a URL's
``user:password@`` part, a server echoing a header value in an escaped form, a bucket URL with keys in it.
"""
from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from pydantic import ValidationError

from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.fireworks import HotLoadClient, HotLoadError
from fsdp_hotload.storage import Storage
from megatron_hotload import add_hotload_args, config_from_args

from tests.http_fixture import serve

SIGNALLING = dict(account_id="a", model_id="m", deployment_id="d", hf_config_dir="/tmp")


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("options", [
    {"s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": "TOPSECRET-sse-c-key"}},
    {"client_kwargs": {"aws_access_key_id": "AKIA-TOPSECRET", "region_name": "eu"}},
    {"endpoint_url": "https://minio-user:TOPSECRET@minio.internal:9000"},
    {"config_kwargs": {"proxies": {"https": "http://proxy-user:TOPSECRET@proxy:3128"}}},
    {"client_kwargs": {"headers": {"Authorization": "Bearer TOPSECRET"}}},
    {"headers": {"X-Api-Key": "TOPSECRET"}},
    {"password": "TOPSECRET"}, {"ftp_passwd": "TOPSECRET"}, {"credentials": {"user": "TOPSECRET"}},
    {"client_kwargs": {"headers": {"Cookie": "session=TOPSECRET"}}}, {"connection_string": "TOPSECRET"},
    {"ConnectionString": "TOPSECRET"}, {"auth": ["user", "TOPSECRET"]}, {"basic_auth": "TOPSECRET"},
    {"sas": {"sig": "TOPSECRET"}}, {"url_signature": "TOPSECRET"},
    {"endpoint_url": "https://minio:9000/?X-Amz-Signature=TOPSECRET&X-Amz-Credential=AKIA%2FTOPSECRET&part=1"},
    {"passphrase": "TOPSECRET"}, {"pkey": "TOPSECRET"},  # sftp's key file passphrase, a key given inline
])
def test_every_credential_in_storage_options_is_masked_in_the_repr_and_json(options: dict[str, Any]) -> None:
    cfg = HotloadConfig(bucket_url="s3://b/p", storage_options=options)
    assert "TOPSECRET" not in repr(cfg) and "TOPSECRET" not in str(cfg), repr(cfg)
    # the JSON form (model_dump_json, model_dump(mode="json"): what trackers and config logs store) too
    assert "TOPSECRET" not in cfg.model_dump_json() and "TOPSECRET" not in json.dumps(cfg.model_dump(mode="json"))
    assert "TOPSECRET" in json.dumps(cfg.storage_options)  # intact for the storage
    assert "TOPSECRET" in json.dumps(cfg.model_dump()["storage_options"])  # and in the Python form


def test_the_json_form_masks_headers_and_keeps_the_rest() -> None:
    cfg = HotloadConfig(bucket_url="s3://bucket/snapshots", api_key="TOPSECRET-key",
                        hotload_api_url="https://api.fireworks.ai", hotload_api_headers={"X-Gateway": "TOPSECRET"},
                        storage_options={"region_name": "eu"}, **SIGNALLING)
    shown = json.loads(cfg.model_dump_json())
    assert "TOPSECRET" not in json.dumps(shown)
    assert shown["bucket_url"] == "s3://bucket/snapshots" and shown["hotload_api_headers"] == {
        "X-Gateway": "**********"}
    assert shown["storage_options"] == {"region_name": "eu"} and shown["hotload_api_url"] == "https://api.fireworks.ai"


def test_settings_that_look_alike_stay_readable() -> None:
    """``signature_version`` and ``SSEKMSKeyId`` are settings: masking them would also refuse them as flags."""
    options = {"config_kwargs": {"signature_version": "s3v4"}, "endpoint_url": "https://minio:9000",
               "s3_additional_kwargs": {"SSEKMSKeyId": "alias/k"}, "client_kwargs": {"region_name": "eu"}}
    shown = repr(HotloadConfig(bucket_url="s3://b/p", storage_options=options))
    assert "{'signature_version': 's3v4'}" in shown and "'SSEKMSKeyId': 'alias/k'" in shown
    assert "'endpoint_url': 'https://minio:9000'" in shown


def test_api_url_credentials_are_refused_and_never_echoed() -> None:
    """A gateway's basic-auth password in the URL used to be echoed by the plain-http check, and a https URL with
    one passed the config (its repr showing it) to fail only when the client was built."""
    for url in ("http://gw-user:TOPSECRET@10.0.0.5:8083", "https://gw-user:TOPSECRET@gateway.internal"):
        with pytest.raises(ValidationError) as info:
            HotloadConfig(bucket_url="/tmp/b", hotload_api_url=url, **SIGNALLING)
        assert "TOPSECRET" not in str(info.value) and "credentials" in str(info.value)


@pytest.mark.parametrize("url", ["sftp://user:TOPSECRET@files.internal/runs",
                                 # an fsspec chain: the password is in its second link
                                 "simplecache::sftp://user:TOPSECRET@files.internal/runs",
                                 # a password holding '/', '?' or '#' (half of AWS secret keys hold a '/'), and a
                                 # leading space (refused now): neither was masked
                                 "sftp://user:TOP/SECRET@files.internal/runs", "sftp://u:TOP?SE#CRET@files/runs",
                                 " sftp://user:TOPSECRET@files.internal/runs"])
def test_a_bucket_url_with_credentials_is_refused_without_showing_them(url: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """sftp:// (a scheme hotload does not write to) is refused; the message masks the password however it is
    written (TOPSECRET, TOP/SECRET, TOP?SE#CRET), from the config and from its variable."""
    with pytest.raises(ValueError, match="starts or ends with white space" if url != url.strip() else
                       "not a storage hotload writes to|chain of fsspec filesystems") as info:
        HotloadConfig(bucket_url=url)
    assert "TOP" not in str(info.value)
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", url)
    with pytest.raises(ValueError, match="HOTLOAD_BUCKET_URL") as info:
        HotloadConfig.from_env()
    assert "TOP" not in str(info.value)


def test_the_emulator_never_echoes_a_bucket_s_credentials() -> None:
    """``hotload emulate --bucket`` printed the bucket as given before the storage layer's (masked) reason, and an
    ftp bucket it could not reach ended in a traceback (exit 1) instead of one line (exit 2)."""
    import subprocess
    import sys

    for bucket in ("s3://AKIA:TOPSECRET@bkt/p", "ftp://user:TOPSECRET@127.0.0.1:1/runs"):
        res = subprocess.run([sys.executable, "-m", "fsdp_hotload.cli", "emulate", "--bucket", bucket],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and "TOPSECRET" not in res.stdout + res.stderr, res.stderr
        assert res.stderr.startswith("hotload emulate: error: --bucket") and "Traceback" not in res.stderr


# ------------------------------------------------------------------------------------------------ megatron


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_hotload_args(p)
    return p


@pytest.mark.parametrize("argv", [
    ["--hotload-storage-options", '{"s3_additional_kwargs": {"SSECustomerKey": "TOPSECRET"}}'],
    ["--hotload-storage-options", '{"endpoint_url": "https://u:TOPSECRET@minio:9000"}'],
    ["--hotload-api-url", "https://gw-user:TOPSECRET@gateway.internal"],
    ["--hotload-bucket-url", "s3a://AKIA:TOPSECRET@bucket/run"],
    ["--hotload-bucket-url", "s3a://AKIA:TOP/SECRET@bucket/run"],
    ["--hotload-storage-options", '{"endpoint_url": "https://u:TOP/SECRET@minio:9000"}'],
])
def test_megatron_flags_refuse_credentials(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron prints every argument on rank 0 and saves them in its checkpoints."""
    with pytest.raises((SystemExit, argparse.ArgumentError)) as info:
        parser().parse_args(["--hotload-bucket-url", "/tmp/b", *argv])
    shown = str(info.value) + capsys.readouterr().err
    assert "credentials" in shown and "TOP" not in shown  # TOPSECRET, TOP/SECRET


def test_flags_take_what_only_looks_like_a_credential(capsys: pytest.CaptureFixture[str]) -> None:
    """An Azure URL names its container before the '@', and gcsfs's token modes say where to find credentials:
    both were refused as flags holding credentials. Azure is refused as a backend hotload does not support, with
    the container shown."""
    azure = "abfs://runs@myaccount.dfs.core.windows.net/rl/acct-dep"
    with pytest.raises(SystemExit) as refused:
        config_from_args(parser().parse_args(["--hotload-bucket-url", azure]))
    assert "Azure Blob Storage" in str(refused.value) and azure in str(refused.value)
    assert "credentials" not in str(refused.value)
    cfg = config_from_args(parser().parse_args(["--hotload-bucket-url", "gs://runs/rl", "--hotload-storage-options",
                                                '{"token": "anon"}']))
    assert cfg is not None and cfg.storage_options == {"token": "anon"} and "'token': 'anon'" in repr(cfg)
    for argv in (["--hotload-bucket-url", "abfs://runs:TOPSECRET@myaccount.dfs.core.windows.net/rl"],
                 ["--hotload-storage-options", '{"token": "/home/me/TOPSECRET.json"}'],
                 ["--hotload-storage-options", '{"token": {"refresh_token": "TOPSECRET"}}']):
        with pytest.raises((SystemExit, argparse.ArgumentError)) as info:
            parser().parse_args(["--hotload-bucket-url", "/tmp/b", *argv])
        shown = str(info.value) + capsys.readouterr().err
        assert "credentials" in shown and "TOPSECRET" not in shown


# ------------------------------------------------------------------------------------------------ client


def test_a_plain_http_url_with_credentials_is_refused_without_echoing_them() -> None:
    with pytest.raises(ValueError, match="credentials") as info:
        HotLoadClient("http://gw-user:TOPSECRET@10.0.0.5:8083", account_id="a", model_id="m", deployment_id="d",
                      api_key="k")
    assert "TOPSECRET" not in str(info.value)


@pytest.fixture
def echo_server() -> Iterator[str]:
    """Answers 401 with the request's gateway header echoed in a JSON string, '/' escaped (as PHP encodes it)."""

    class Handler(BaseHTTPRequestHandler):
        def _any(self) -> None:
            token = (self.headers.get("X-Gateway-Token") or "").replace("/", "\\/")
            data = ('{"error": {"message": "gateway refused token ' + token + '"}}').encode()
            self.send_response(401)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _any

        def log_message(self, *args: Any) -> None:
            pass

    with serve(Handler) as url:
        yield url


def test_a_header_value_echoed_json_escaped_is_redacted(echo_server: str, caplog: pytest.LogCaptureFixture) -> None:
    secret = "dG9w/U0VDUkVU+gw/token"  # base64 tokens hold '/'
    client = HotLoadClient(echo_server, account_id="a", model_id="m", deployment_id="d", api_key="fw-test-key-0123",
                           additional_headers={"X-Gateway-Token": secret}, retry_budget_s=1.0)
    with caplog.at_level(logging.DEBUG), pytest.raises(HotLoadError) as info:
        client.signal("step-1")
    assert "gateway refused token <redacted>" in str(info.value), str(info.value)
    for text in (str(info.value), info.value.server_message or "", info.value.response_text or "", caplog.text):
        assert secret not in text and secret.replace("/", "\\/") not in text


# ------------------------------------------------------------------------------------------------ storage


@pytest.mark.parametrize("root", ["s3://AKIA:TOPSECRET@bucket/run", "s3a://AKIA:TOPSECRET@bucket/run",
                                  "gs://user:TOPSECRET@bucket/run", "s3://AKIA:TOP/SECRET+x@bucket/run"])
def test_keys_in_an_object_store_url_are_refused_without_echoing_them(root: str) -> None:
    """s3fs takes 'AKIA:TOPSECRET@bucket' for the bucket's name: every put failed with the keys in its error, which
    went to the logs and the metrics file."""
    with pytest.raises(ValueError, match="storage_options") as info:
        Storage(root)
    assert "TOP" not in str(info.value)  # TOPSECRET, TOP/SECRET


def test_storage_refuses_a_root_with_credentials_without_showing_them() -> None:
    """An sftp root may carry them (fsspec reads them there): the refusal of the scheme masks them, as a file://
    root's refusal of its host does."""
    import fsspec

    for root in ("sftp://user:TOPSECRET@files.internal/runs", "file://user:TOPSECRET@files.internal/runs"):
        with pytest.raises(ValueError) as info:
            Storage(root, fs=fsspec.filesystem("memory"))
        assert "TOPSECRET" not in str(info.value) and "**********" in str(info.value)


def test_an_endpoint_s_password_quoted_in_an_open_error_is_masked() -> None:
    """botocore quotes the endpoint it refuses whole ("Invalid endpoint: http://user:pw@..."): the StorageError
    carried the password into logs and the metrics file, and its chained cause into tracebacks."""
    import traceback

    from fsdp_hotload.masking import mask_text
    from fsdp_hotload.storage_errors import StorageError

    options = {"endpoint_url": "http://minio:TOPSECRET@minio_host:9000", "key": "k", "secret": "s"}
    with pytest.raises(StorageError, match="Invalid endpoint") as info:
        Storage("s3://bkt/run", options)
    printed = "".join(traceback.format_exception(info.value))
    assert "TOPSECRET" not in printed and "minio_host:9000" in printed
    assert mask_text('x "https://u:p@w@h:1/a?b" and s3://k@b/c, ftp://h/p@x') == (
        'x "https://**********@h:1/a?b" and s3://**********@b/c, ftp://h/p@x')


def test_a_presigned_url_quoted_in_free_text_loses_its_signature() -> None:
    """An error message that quotes a presigned URL ("... for url: https://h/k?X-Amz-Signature=...") printed the
    signature, which grants access until it expires: only a URL's userinfo was masked in free text."""
    from fsdp_hotload.masking import MASK, mask_text

    text = ("403 Client Error for url: https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F1&part=2&"
            "X-Amz-Signature=0123abcd. Retry (see https://u:pw@h/x?sig=feed), then 'gs://b/o?alt=media'")
    masked = mask_text(text)
    for secret in ("AKIA", "0123abcd", "feed", "pw@"):
        assert secret not in masked, secret
    assert masked == ("403 Client Error for url: https://b.s3.amazonaws.com/k?X-Amz-Credential="
                      f"{MASK}&part=2&X-Amz-Signature={MASK}. Retry (see https://{MASK}@h/x?sig={MASK}), then "
                      "'gs://b/o?alt=media'")


def test_the_clients_extra_headers_print_without_their_values() -> None:
    """A gateway's token sits in additional_headers: vars(client), a debugger or an error reporter that records
    locals printed the plain dict, value included."""
    from fsdp_hotload.fireworks import HotLoadClient

    client = HotLoadClient("http://127.0.0.1:9", account_id="a", model_id="m", deployment_id="d", api_key="k" * 8,
                           additional_headers={"X-Gateway-Token": "gw-secret-0123"})
    assert "gw-secret-0123" not in repr(vars(client))
    assert client.headers()["X-Gateway-Token"] == "gw-secret-0123"  # still sent
