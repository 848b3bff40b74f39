"""``hotload emulate`` as a real subprocess: option checks, the bucket check, codecs, clients that hang up."""
from __future__ import annotations

import contextlib
import json
import signal
import socket
import struct
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdp_hotload.fireworks import HotLoadClient, HotLoadError
from tests.emulator_fixture import (
    EMULATOR_API_KEY,
    perturb,
    digest_map,
    tiny_model,
    write_delta_snapshot,
    write_full_snapshot,
)

HOTLOAD = [sys.executable, "-m", "fsdp_hotload.cli"]


@contextlib.contextmanager
def serving(*args: str, command: tuple[str, ...] = (*HOTLOAD, "emulate")) -> Iterator[tuple[str, int, list[str]]]:
    """Run ``hotload emulate`` (or ``command``) until the block ends, then Ctrl-C it; yields (host, port, stderr
    lines), the stderr list filled once the process has exited."""
    proc = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, line
        url = line.split("listening on ")[1].split()[0]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        yield host, int(port), err
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)
        err.extend(stderr.splitlines())
        assert proc.returncode == 0, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("args, flag", [
    (["--replicas", "0"], "--replicas"),
    (["--port", "99999"], "--port"),
    (["--load-delay", "-1"], "--load-delay"),
    (["--compression-formats", "zstd"], "--compression-formats"),
    (["--api-key", ""], "--api-key"),  # "$KEY" with KEY unset: every client would get 401
    (["--host", ""], "--host"),  # "$HOST" with HOST unset listened on every interface
    (["--endpoint-url", ""], "--endpoint-url"),  # "$URL" with URL unset was dropped: an s3:// bucket went to AWS
    (["--deployment", "dep"], "--deployment"),  # the model it serves is missing
    (["--deployment", "=m"], "--deployment"),
    (["--account", "a/b"], "--account"),
])
def test_bad_options_are_one_line_usage_errors(tmp_path: Path, args: list[str], flag: str) -> None:
    res = subprocess.run([*HOTLOAD, "emulate", "--bucket", str(tmp_path), *args], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(f"hotload emulate: error: argument {flag}:")


@pytest.mark.parametrize("bucket, reason", [("missing-folder", "is not a folder"), ("nosuch://b/p", "nosuch")])
def test_unusable_bucket_fails_at_startup(tmp_path: Path, bucket: str, reason: str) -> None:
    uri = str(tmp_path / bucket) if "://" not in bucket else bucket
    res = subprocess.run([*HOTLOAD, "emulate", "--bucket", uri], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("hotload emulate: error: --bucket") and reason in line


def _without_aws_credentials() -> dict[str, str]:
    """The environment with no AWS credential anywhere botocore looks (variables, files, instance metadata)."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_CONFIG_FILE=os.devnull)
    return env


def test_an_s3_bucket_without_credentials_fails_at_startup(s3_server) -> None:  # noqa: ANN001
    """Missing credentials were found only by the first signal, answered with a 503 that clients retry for
    minutes: the listing at startup refuses them, naming the variables to set."""
    res = subprocess.run([*HOTLOAD, "emulate", "--bucket", s3_server.unique_uri("nocreds"), "--endpoint-url",
                          s3_server.endpoint_url], capture_output=True, text=True, timeout=60,
                         env=_without_aws_credentials())
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("hotload emulate: error: --bucket s3://") and "NoCredentialsError" in line, line
    assert "AWS_ACCESS_KEY_ID" in line and "not retried" in line, line


def test_a_signal_the_bucket_refuses_for_good_is_not_retried(s3_server, monkeypatch) -> None:  # noqa: ANN001
    """Credentials gone after startup: the listing error is answered with 424, which the client does not retry
    (a 503 cost each publish the whole retry budget)."""
    from fsdp_hotload.emulator import HotLoadEmulator

    import os

    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in _without_aws_credentials().items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    with HotLoadEmulator(s3_server.unique_uri("gone"), storage_options={"endpoint_url": s3_server.endpoint_url},
                         replicas=1, api_key=EMULATOR_API_KEY) as emu:
        client = HotLoadClient(emu.url, account_id="a", model_id="m", deployment_id="d", api_key=EMULATOR_API_KEY,
                               retry_budget_s=30)
        with pytest.raises(HotLoadError, match="NoCredentialsError") as info:
            client.signal("step-1")
    assert info.value.status_code == 424 and info.value.attempts == 1, info.value


def test_compression_formats_admits_sparse_deltas(tmp_path: Path) -> None:
    m1 = tiny_model(0)
    m2 = perturb(m1, seed=1)
    write_full_snapshot(tmp_path, "step-1", m1)
    write_delta_snapshot(tmp_path, "step-2", "step-1", m1, m2, codec="arc_sparse_v1")
    with serving("--bucket", str(tmp_path), "--replicas", "1", "--api-key", EMULATOR_API_KEY,
                 "--compression-formats", "arc_v2,arc_sparse_v1") as (host, port, _):
        client = HotLoadClient(f"http://{host}:{port}", account_id="acct", model_id="m", deployment_id="dep",
                               api_key=EMULATOR_API_KEY, poll_interval_s=0.02)
        client.signal("step-1")
        client.wait_ready("step-1", timeout_s=30)
        client.signal("step-2", previous_identity="step-1", compression_format="arc_sparse_v1")
        client.wait_ready("step-2", timeout_s=30)
        req = urllib.request.Request(f"http://{host}:{port}/emulator/v1/state",
                                     headers={"Authorization": f"Bearer {EMULATOR_API_KEY}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            (dep,) = json.load(resp)["deployments"].values()
    assert {n: t["digest"] for n, t in dep["replicas"][0]["tensors"].items()} == digest_map(m2)


def test_clients_that_hang_up_print_no_traceback(tmp_path: Path) -> None:
    """Clients that leave before the answer (a short body then close, or a reset) are the client's problem."""
    with serving("--bucket", str(tmp_path), "--replicas", "1") as (host, port, err):
        for _ in range(5):
            with socket.create_connection((host, port), timeout=10) as sock:  # 2 of 10 body bytes, then close
                sock.sendall(b"POST /hot_load/v1/models/hot_load HTTP/1.0\r\nContent-Length: 10\r\n\r\n{}")
            with socket.create_connection((host, port), timeout=10) as sock:  # whole request, then a reset
                sock.sendall(b"GET /v1/accounts HTTP/1.0\r\n\r\n")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with socket.create_connection((host, port), timeout=10) as sock:  # still serving
            sock.sendall(b"GET /v1/accounts HTTP/1.0\r\nAuthorization: Bearer any-key\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.0 200")
    assert not [line for line in err if "Traceback" in line or "Error" in line], "\n".join(err)


@pytest.mark.parametrize("args, reason", [
    (["--deployment", "a b=m"], "'a b' is not a Fireworks resource id"),
    (["--deployment", "d=m", "--deployment", "d=n"], "the same deployment is given twice"),
    (["--account", "acct", "--deployment", "d=m", "--deployment", "accounts/acct/deployments/d=m"], "twice"),
])
def test_bad_deployments_are_one_line_errors(tmp_path: Path, args: list[str], reason: str) -> None:
    res = subprocess.run([*HOTLOAD, "emulate", "--bucket", str(tmp_path), *args], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("hotload emulate: error: --deployment:") and reason in line, line


def test_deployments_given_on_the_command_line_are_the_only_ones_served(tmp_path: Path) -> None:
    write_full_snapshot(tmp_path, "step-1", tiny_model(0))
    with serving("--bucket", str(tmp_path), "--replicas", "1", "--account", "acct", "--deployment", "dep=m") as (
            host, port, _):
        def client(**kw: str) -> HotLoadClient:
            opts = {"account_id": "acct", "model_id": "m", "deployment_id": "dep", **kw}
            return HotLoadClient(f"http://{host}:{port}", api_key="any", poll_interval_s=0.02, retry_budget_s=5,
                                 **opts)

        with pytest.raises(HotLoadError, match="404.*'accounts/acct/deployments/dpe' not found"):
            client(deployment_id="dpe").signal("step-1")
        with pytest.raises(HotLoadError, match="400.*does not match 'accounts/acct/models/m'"):
            client(model_id="n").signal("step-1")
        client().signal("step-1")
        client().wait_ready("step-1", timeout_s=30)
        with urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/v1/accounts", headers={
                "Authorization": "Bearer any"}), timeout=10) as resp:
            assert json.load(resp) == {"accounts": [{"name": "accounts/acct"}]}


def test_the_emulator_cli_module_runs_as_a_script(tmp_path: Path) -> None:
    """``python -m fsdp_hotload.emulator_cli`` defined main() and exited 0 without serving, a bad flag included."""
    module = (sys.executable, "-m", "fsdp_hotload.emulator_cli")
    res = subprocess.run([*module, "--bucket", str(tmp_path), "--no-such-flag"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "unrecognized arguments: --no-such-flag" in res.stderr, res.stderr
    with serving("--bucket", str(tmp_path), "--replicas", "1", command=module) as (host, port, _):
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(b"GET /v1/accounts HTTP/1.0\r\nAuthorization: Bearer any-key\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.0 200")


@pytest.mark.parametrize("args, warned", [(["--host", "0.0.0.0"], True),
                                          (["--host", "0.0.0.0", "--api-key", EMULATOR_API_KEY], False),
                                          (["--host", "127.0.0.1"], False)])
def test_listening_beyond_loopback_without_an_api_key_is_warned_about(tmp_path: Path, args: list[str],
                                                                        warned: bool) -> None:
    """Without --api-key any bearer key is accepted: harmless on loopback, but on another address anyone who can
    reach the port may signal loads and reset ledgers, which nothing said."""
    with serving("--bucket", str(tmp_path), "--replicas", "1", *args) as (_, port, err):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # it serves either way
            sock.sendall(f"GET /v1/accounts HTTP/1.0\r\nAuthorization: Bearer {EMULATOR_API_KEY}\r\n\r\n".encode())
            assert sock.recv(100).startswith(b"HTTP/1.0 200")
    warnings = [line for line in err if "not a loopback address" in line]
    assert len(warnings) == int(warned), err
    if warned:
        assert warnings[0].startswith("hotload emulate: WARNING:") and "--api-key" in warnings[0], warnings

