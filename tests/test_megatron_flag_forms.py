"""The ways users write ``--hotload-*`` flags beside the plain ``--flag value``, and the checks config_from_args runs
at startup: a secret written as a flag, a boolean with a value, a list as space-separated values, an API key that
cannot be sent, storage options the storage layer refuses. Real argparse parsers, as Megatron builds them
(``allow_abbrev=False``), with ``parse_args`` and with ``parse_known_args`` (``ignore_unknown_args=True``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from pydantic import ValidationError

from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.engine.signal import Signaller
from megatron_hotload import add_hotload_args, config_from_args

SIGNAL = ["--hotload-api-url", "https://api.example", "--hotload-account-id", "a", "--hotload-model-id", "m",
          "--hotload-deployment-id", "d", "--hotload-hf-config-dir", "/tmp"]


def parser() -> argparse.ArgumentParser:
    return add_hotload_args(argparse.ArgumentParser(allow_abbrev=False, prog="pretrain_gpt.py"))


@pytest.fixture(autouse=True)
def _no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("FIREWORKS_API_KEY", "HOTLOAD_API_KEY", "HOTLOAD_STORAGE_OPTIONS"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("argv, variable", [
    (["--hotload-api-key", "fw_TOPSECRET"], "HOTLOAD_API_KEY or FIREWORKS_API_KEY"),
    (["--hotload-api-key=fw_TOPSECRET"], "HOTLOAD_API_KEY or FIREWORKS_API_KEY"),
    (["--hotload-api-headers", '{"Authorization": "Bearer TOPSECRET"}'], "HOTLOAD_HOTLOAD_API_HEADERS"),
    (["--hotload-hotload-api-headers", '{"x-gw": "TOPSECRET"}'], "HOTLOAD_HOTLOAD_API_HEADERS")])
@pytest.mark.parametrize("known", [False, True])
def test_a_secret_written_as_a_flag_is_refused_without_showing_it(
        argv: list[str], variable: str, known: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's 'unrecognized arguments' quoted the value on every rank's stderr; parse_known_args dropped it."""
    p = parser()
    with pytest.raises(SystemExit) as exc:
        (p.parse_known_args if known else p.parse_args)(["--hotload-bucket-url", "/tmp/b", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "TOPSECRET" not in err
    flag = argv[0].split("=")[0]
    assert f"argument {flag}: a secret is not taken as a flag" in err and f"set {variable}" in err


def test_the_help_names_both_key_variables_and_which_wins() -> None:
    text = " ".join(parser().format_help().split())
    assert "HOTLOAD_API_KEY or FIREWORKS_API_KEY (HOTLOAD_API_KEY wins when both are set)" in text
    assert "--hotload-api-key" not in text


@pytest.mark.parametrize("variable", ["HOTLOAD_API_KEY", "FIREWORKS_API_KEY"])
def test_an_api_key_that_cannot_be_sent_is_refused_at_startup_naming_its_variable(
        variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, "fw_abc defTOPSECRET")  # a space: no Authorization header can carry it
    with pytest.raises(SystemExit) as exc:
        config_from_args(parser().parse_args(["--hotload-bucket-url", "/tmp/b", *SIGNAL]))
    assert variable in str(exc.value) and "whitespace at position 6" in str(exc.value)
    assert "TOPSECRET" not in str(exc.value)


def test_fireworks_api_key_is_not_checked_where_nothing_is_signalled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher's FIREWORKS_API_KEY may serve other tools; without a hot-load URL this config never sends it."""
    monkeypatch.setenv("FIREWORKS_API_KEY", "fw_abc def")
    cfg = config_from_args(parser().parse_args(["--hotload-bucket-url", "/tmp/b"]))
    assert cfg is not None and cfg.hotload_api_url is None


def test_the_config_refuses_an_api_key_that_cannot_be_sent() -> None:
    with pytest.raises(ValidationError, match="API key from api_key contains"):
        HotloadConfig(bucket_url="/tmp/b", api_key="fw_\u00e9")


def test_no_key_builds_the_config_and_the_signaller_names_both_variables() -> None:
    """Ranks that never signal may hold no key; the rank that does is told the variables of this path."""
    cfg = config_from_args(parser().parse_args(["--hotload-bucket-url", "/tmp/b", *SIGNAL]))
    assert cfg is not None
    with pytest.raises(ValueError, match=r"set FIREWORKS_API_KEY, or the config's api_key \(HOTLOAD_API_KEY"):
        Signaller.from_config(cfg)


@pytest.mark.parametrize("field, flag", [("publish_on_close", "--hotload-publish-on-close"),
                                         ("send_hints", "--hotload-send-hints"),
                                         ("keep_training_on_error", "--hotload-keep-training-on-error")])
@pytest.mark.parametrize("text, value", [("false", False), ("False", False), ("0", False), ("no", False),
                                         ("true", True), ("1", True), ('"on"', True)])
def test_a_boolean_flag_takes_a_value_as_its_variable_does(
        field: str, flag: str, text: str, value: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--hotload-x false`` was a bare switch and a stray word: True under parse_known_args."""
    args, rest = parser().parse_known_args(["--hotload-bucket-url", "/tmp/b", flag, text])
    assert rest == []
    cfg = config_from_args(args)
    assert cfg is not None and getattr(cfg, field) is value
    monkeypatch.setenv(f"HOTLOAD_{field.upper()}", text)  # the variable reads the text alike
    assert getattr(HotloadConfig.from_env(bucket_url="/tmp/b"), field) is value


def test_boolean_flags_alone_and_negated_keep_their_meaning(capsys: pytest.CaptureFixture[str]) -> None:
    args = parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-keep-training-on-error",
                                "--no-hotload-send-hints", "--hotload-hotload-api-allow-http", "false"])
    assert (args.hotload_keep_training_on_error, args.hotload_send_hints, args.hotload_hotload_api_allow_http) == (
        True, False, False)
    with pytest.raises(SystemExit):
        parser().parse_known_args(["--hotload-send-hints", "maybe"])
    assert "argument --hotload-send-hints: 'maybe' is not a boolean" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser().parse_known_args(["--no-hotload-send-hints", "true"])
    assert "--no-hotload-send-hints: takes no value" in capsys.readouterr().err
    helps = {o: a.help for a in parser()._actions for o in a.option_strings}
    assert "--no-hotload-send-hints or --hotload-send-hints false sets it false" in helps["--hotload-send-hints"]


def test_a_list_flag_takes_space_separated_values() -> None:
    """Megatron's own list flags are ``nargs='+'``: ``dep-b`` was dropped under parse_known_args."""
    args, rest = parser().parse_known_args([
        "--hotload-bucket-url", "/tmp/b", *SIGNAL, "--hotload-deployment-id", "dep-a", "dep-b",
        "--hotload-carry-base-tensors", "mtp.*", "model.layers.61.*", "--hotload-extra-fields-ignore",
        "quantization_config"])
    assert rest == []
    cfg = config_from_args(args)
    assert cfg is not None and cfg.deployment_id == ["dep-a", "dep-b"]
    assert cfg.carry_base_tensors == ["mtp.*", "model.layers.61.*"]
    assert cfg.extra_fields_ignore == ["quantization_config"]  # one plain value of a list-only field: one item
    one = parser().parse_args(["--hotload-deployment-id", "12345"])  # a field that takes a string keeps it one
    assert one.hotload_deployment_id == "12345"


@pytest.mark.parametrize("field", ["carry_base_tensors", "extra_fields_ignore"])
def test_a_plain_value_of_a_list_field_reads_alike_as_variable_and_flag(
        field: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """One plain word of a field that takes only lists was a list of one as a flag, and 'not valid JSON' as its
    variable; both now read it alike, and both refuse "a,b" (a glob or key of its own, matching nothing)."""
    var, flag = f"HOTLOAD_{field.upper()}", f"--hotload-{field.replace('_', '-')}"
    monkeypatch.setenv(var, "mtp_weight")
    assert getattr(HotloadConfig.from_env(bucket_url="/tmp/b", hf_config_dir=str(tmp_path)), field) == ["mtp_weight"]
    monkeypatch.delenv(var)
    cfg = config_from_args(parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-hf-config-dir",
                                                str(tmp_path), flag, " mtp_weight "]))
    assert cfg is not None and getattr(cfg, field) == ["mtp_weight"]
    monkeypatch.setenv(var, "a,b")
    with pytest.raises(ValueError, match=f"{var}: 'a,b' is not one plain value: write several as a JSON list"):
        HotloadConfig.from_env(bucket_url="/tmp/b", hf_config_dir=str(tmp_path))
    monkeypatch.delenv(var)
    with pytest.raises(SystemExit):
        parser().parse_args([flag, "a,b"])
    assert f"argument {flag}: 'a,b' is not one plain value" in capsys.readouterr().err


@pytest.mark.parametrize("words", [["a", '["b"]'], ["a", "null"], ["a", ""], ["a,b", "c"]])
def test_json_among_several_list_values_is_refused_by_flag(words: list[str],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--hotload-deployment-id", *words])
    assert "argument --hotload-deployment-id" in capsys.readouterr().err


@pytest.mark.parametrize("root, options, match", [
    ("s3://bucket/run", '{"endpoint": "http://minio:9000"}', r"'endpoint' \(did you mean 'endpoint_url'\?\)"),
    ("/tmp/run", '{"endpoint_url": "http://minio:9000"}', "are for an object store")])
@pytest.mark.parametrize("where", ["flag", "variable", "both"])
def test_storage_options_the_storage_refuses_are_refused_at_startup(
        root: str, options: str, match: str, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--hotload-bucket-url", root]
    if where != "variable":
        argv += ["--hotload-storage-options", options]
    if where != "flag":
        monkeypatch.setenv("HOTLOAD_STORAGE_OPTIONS", options if where == "variable" else '{"anon": false}')
    label = {"flag": "--hotload-storage-options", "variable": "HOTLOAD_STORAGE_OPTIONS",
             "both": "--hotload-storage-options merged over HOTLOAD_STORAGE_OPTIONS"}[where]
    with pytest.raises(SystemExit, match=f"^invalid hotload setting {label}: .*{match}"):
        config_from_args(parser().parse_args(argv))


def test_a_local_root_does_not_import_the_s3_backend(tmp_path: Path) -> None:
    """The option check imports a backend only to read its keywords, for an object-store root with options."""
    code = ("import argparse, sys\n"
            "from megatron_hotload import add_hotload_args, config_from_args\n"
            "p = add_hotload_args(argparse.ArgumentParser())\n"
            f"cfg = config_from_args(p.parse_args(['--hotload-bucket-url', {str(tmp_path)!r}, "
            "'--hotload-storage-options', '{\"auto_mkdir\": true}']))\n"
            "assert cfg is not None and 's3fs' not in sys.modules, sorted(m for m in sys.modules if 's3' in m)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOTLOAD_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("variable, flag, match", [
    ({"client_kwargs": {"endpoint_url": "http://minio-a.internal:9000"}}, {"endpoint_url": "http://127.0.0.1:9000"},
     r"options\.endpoint_url and client_kwargs\.endpoint_url are both given, with different values "
     r"\('http://127\.0\.0\.1:9000' and 'http://minio-a\.internal:9000'\)"),
    ({}, {"config_kwargs": {"retries": {"mode": "a"}}}, r"InvalidRetryModeError: .*\"mode\": \"a\" must be one of"),
    ({}, {"max_concurrency": "4"}, r"options\.max_concurrency must be a number, not str '4'"),
    ({"client_kwargs": {"region_name": 5}}, {}, r"client_kwargs\.region_name must be a string"),
    ({}, {"client_kwargs": {"verify": "false"}}, r"client_kwargs\.verify is the string 'false', which botocore reads "
                                                  r"as the path of a CA bundle"),
    ({}, {"config_kwargs": {"connect_timeout": "5"}}, r"config_kwargs\.connect_timeout must be a positive number")])
def test_s3_options_botocore_cannot_use_are_refused_at_startup(
        variable: dict, flag: dict, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Options merged from a cluster-wide variable and a job's flag passed the start-up check and failed only on
    rank 0 at the first publishing step (after the step's gather), naming neither: an endpoint spelt two ways with
    two values, a retry mode botocore does not know, a number written as a JSON string, a region that is no
    string, a certificate check turned "off" with a string. They are checked at start-up now, offline (the storage
    is not opened: its client would look up credentials), and the error names both places the options came from."""
    pytest.importorskip("s3fs")
    monkeypatch.setenv("HOTLOAD_STORAGE_OPTIONS", json.dumps({"key": "AK", "secret": "SK", **variable}))
    argv = ["--hotload-bucket-url", "s3://bucket/run", "--hotload-storage-options", json.dumps(flag)]
    with pytest.raises(SystemExit, match=r"^invalid hotload setting --hotload-storage-options merged over "
                                         rf"HOTLOAD_STORAGE_OPTIONS: cannot open s3://bucket/run: .*{match}"):
        config_from_args(parser().parse_args(argv))


def test_s3_options_botocore_takes_pass_the_startup_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same settings, written as botocore takes them, start: one endpoint spelt the same way twice, a known
    retry mode, numbers and booleans in JSON, a CA bundle's path."""
    pytest.importorskip("s3fs")
    monkeypatch.setenv("HOTLOAD_STORAGE_OPTIONS", json.dumps({
        "key": "AK", "secret": "SK", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu"}}))
    flag = {"endpoint_url": "http://127.0.0.1:9000", "max_concurrency": 4,
            "client_kwargs": {"verify": "/etc/ssl/certs/ca-certificates.crt"},
            "config_kwargs": {"retries": {"mode": "standard"}, "connect_timeout": 5, "read_timeout": 30.5}}
    cfg = config_from_args(parser().parse_args(["--hotload-bucket-url", "s3://bucket/run",
                                                "--hotload-storage-options", json.dumps(flag)]))
    assert cfg is not None and cfg.storage_options["config_kwargs"]["retries"] == {"mode": "standard"}
    assert cfg.storage_options["client_kwargs"]["region_name"] == "eu"


def test_the_startup_check_of_s3_options_looks_up_no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening the storage at flag parsing built s3fs's client, which looked up credentials on every rank (the
    instance metadata endpoint here, a local server that counts what it is asked; a container's endpoint or a
    credential_process alike), and a passing failure there stopped the launch as an invalid setting."""
    pytest.importorskip("s3fs")
    seen: list[str] = []

    class Metadata(BaseHTTPRequestHandler):
        def _any(self) -> None:
            seen.append(f"{self.command} {self.path}")
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_PUT = _any

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name in [k for k in os.environ if k.startswith("AWS_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}/")
        monkeypatch.delenv("HOTLOAD_STORAGE_OPTIONS", raising=False)
        flag = {"endpoint_url": "http://127.0.0.1:9", "client_kwargs": {"region_name": "us-east-1"},
                "config_kwargs": {"retries": {"mode": "standard"}}}
        cfg = config_from_args(parser().parse_args(["--hotload-bucket-url", "s3://bucket/run",
                                                    "--hotload-storage-options", json.dumps(flag)]))
        assert cfg is not None and cfg.storage_options["endpoint_url"] == "http://127.0.0.1:9"
        assert seen == []
    finally:
        server.shutdown()
        server.server_close()
