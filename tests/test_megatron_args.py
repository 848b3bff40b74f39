"""The --hotload-* flags come from HotloadConfig: every field has a flag, values round-trip, errors name flags.

Flags and ``HOTLOAD_*`` environment variables share one text rule, and the config's own checks (floating
snapshot dtypes, no unknown variables) hold for both.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from fsdp_hotload.config import HotloadConfig
from megatron_hotload import add_hotload_args, config_from_args, flag_name
from megatron_hotload.args import SECRET_FIELDS


def parser() -> argparse.ArgumentParser:
    return add_hotload_args(argparse.ArgumentParser())


def test_every_field_has_a_flag_and_the_secrets_flags_are_hidden() -> None:
    p = parser()
    flags = {a for action in p._actions for a in action.option_strings}
    for name in HotloadConfig.model_fields:
        assert flag_name(name) in flags, name
    assert set(SECRET_FIELDS) == {"api_key", "hotload_api_headers"}
    text = p.format_help()
    assert "--hotload-api-key" not in text and "--hotload-api-headers" not in text
    assert not {"hotload_api_key", "hotload_hotload_api_headers"} & set(vars(p.parse_args([])))


# What a deployment needs beside its id: without a URL the config refuses deployment_id (nothing would be signalled).
SIGNAL = ["--hotload-api-url", "https://api.example", "--hotload-account-id", "a", "--hotload-model-id", "m",
          "--hotload-hf-config-dir", "/tmp"]


def test_round_trip() -> None:
    args = parser().parse_args([
        "--hotload-bucket-url", "s3://b/p", "--hotload-full-every", "25", "--hotload-deployment-id", '["a", "b"]',
        "--hotload-storage-options", '{"endpoint_url": "http://127.0.0.1:9000"}', "--hotload-ready-timeout-s",
        "120.5", "--no-hotload-send-hints", "--hotload-codec", "arc_sparse_v1", *SIGNAL])
    cfg = config_from_args(args)
    assert cfg is not None
    assert (cfg.bucket_url, cfg.full_every, cfg.deployments, cfg.ready_timeout_s, cfg.send_hints, cfg.codec) == (
        "s3://b/p", 25, ["a", "b"], 120.5, False, "arc_sparse_v1")
    assert cfg.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    assert config_from_args(parser().parse_args([])) is None


def _flags_of(cfg: HotloadConfig) -> list[str]:
    """The command line that sets every non-None field of ``cfg``: plain text, JSON for lists and dicts."""
    argv: list[str] = []
    for name in HotloadConfig.model_fields:
        value = getattr(cfg, name)
        if value is None or name in SECRET_FIELDS:
            continue
        if isinstance(value, bool):
            argv.append(flag_name(name) if value else f"--no-{flag_name(name)[2:]}")
            continue
        value = value.get_secret_value() if hasattr(value, "get_secret_value") else value
        argv += [flag_name(name), json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return argv


@pytest.mark.parametrize("deployment_id", ["12345", "true", "1e3", "NaN", "dep-1", ["12345", "b"]])
def test_every_field_round_trips_through_its_flag(deployment_id: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every field through its flag, the secrets through their variables."""
    monkeypatch.setenv("HOTLOAD_API_KEY", "12")
    monkeypatch.setenv("HOTLOAD_HOTLOAD_API_HEADERS", '{"x-gateway-secret": "s"}')
    cfg = HotloadConfig(
        hotload_api_headers={"x-gateway-secret": "s"}, hotload_api_allow_http=True, encode_workers=3,
        bucket_url="s3://b/p", storage_options={"endpoint_url": "http://x", "max_concurrency": 3}, upload_concurrency=3,
        storage_attempts=9,
        max_file_bytes=123456, keep_last=4, retention_grace_s=7200, hf_config_dir=str(tmp_path),
        carry_base_tensors=["model.layers.61.*", "mtp.*"],
        hotload_api_url="https://api.fireworks.ai",
        account_id="007", model_id="false", deployment_id=deployment_id, deployments_required="any",
        straggler_wait_s=45.0, api_key="12", ready_timeout_s=5.5,
        poll_interval_s=0.5, collective_timeout_s=90, send_hints=False, reset_prompt_cache="none",
        extra_fields_ignore=["quantization_config"], full_every=3,
        max_chain_length=2, publish_every=2, codec="arc_sparse_v1", snapshot_dtype="float16", identity_prefix="run1",
        dtype_overrides={"*.e_score_correction_bias": "keep", "*.norm.weight": "F32"},
        max_inflight=2, busy_policy="wait", background_nice=0, async_copy=False, cache_on="host",
        keep_training_on_error=True, metrics_path="/tmp/m.jsonl", publish_on_close=False, close_timeout_s=7.5,
        progress_log_s=12.5)
    for name, field in HotloadConfig.model_fields.items():  # a flag that is dropped must change the result
        assert getattr(cfg, name) != field.get_default(call_default_factory=True), name
    back = config_from_args(parser().parse_args(_flags_of(cfg)))
    assert back is not None
    assert back.model_dump() == cfg.model_dump()
    assert back.resolved_api_key() == "12"


@pytest.mark.parametrize("text, value", [
    ("12345", "12345"), ("true", "true"), ("Infinity", "Infinity"), ('"007"', "007"), ('["a", "b"]', ["a", "b"]),
    ("null", None)])
def test_flags_and_env_read_a_value_alike(text: str, value: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    signal = SIGNAL if value is not None else []
    cfg = config_from_args(parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-deployment-id", text,
                                                *signal]))
    assert cfg is not None and cfg.deployment_id == value
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "/tmp/b")
    monkeypatch.setenv("HOTLOAD_DEPLOYMENT_ID", text)
    field_of = {flag_name(name): name for name in HotloadConfig.model_fields}
    for flag, v in zip(signal[0::2], signal[1::2]):
        monkeypatch.setenv("HOTLOAD_" + field_of[flag].upper(), v)
    assert HotloadConfig.from_env().deployment_id == value


def test_bad_value_names_the_flag() -> None:
    """On one line, each field named by its flag with the value given: pydantic's text named the Python field, took
    five lines per field (one block per member of a union) and a docs URL, and never showed the value."""
    args = parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-busy-policy", "sometimes"])
    with pytest.raises(SystemExit, match="--hotload-busy-policy"):
        config_from_args(args)
    args = parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-full-every", "0",
                                "--hotload-deployment-id", "[1, 2]"])
    with pytest.raises(SystemExit) as info:
        config_from_args(args)
    text = str(info.value)
    assert "\n" not in text and "pydantic.dev" not in text and "full_every" not in text, text
    assert text.endswith(": --hotload-deployment-id: Input should be a valid string (got [1, 2]); "
                         "--hotload-full-every: Input should be greater than or equal to 1 (got '0')"), text


def test_a_union_field_is_named_once() -> None:
    args = parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-deployment-id", "[1, 2]"])
    with pytest.raises(SystemExit, match=r"^invalid hotload settings from --hotload-\* flags and HOTLOAD_\* "
                                         r"variables \(--hotload-deployment-id\):"):
        config_from_args(args)


def test_bad_json_in_a_dict_flag_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--hotload-storage-options", "{endpoint: x}"])
    assert "--hotload-storage-options: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["int8", "I32", "uint8", "bool", "torch.int64", "float128"])
def test_snapshot_dtype_must_be_floating(dtype: str) -> None:
    with pytest.raises(ValueError, match=r"snapshot_dtype .* not a floating dtype; accepted: .*bfloat16"):
        HotloadConfig(bucket_url="/tmp/b", snapshot_dtype=dtype)
    args = parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-snapshot-dtype", dtype])
    with pytest.raises(SystemExit, match="--hotload-snapshot-dtype"):
        config_from_args(args)


@pytest.mark.parametrize("dtype, name", [("BF16", "bfloat16"), ("torch.float32", "float32"),
                                         ("F16", "float16"), ("float16", "float16")])
def test_floating_snapshot_dtypes_are_normalised(dtype: str, name: str) -> None:
    assert HotloadConfig(bucket_url="/tmp/b", snapshot_dtype=dtype).snapshot_dtype == name


def test_dtype_overrides_are_normalised_and_a_bad_one_names_its_glob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "/tmp/b")
    monkeypatch.setenv("HOTLOAD_DTYPE_OVERRIDES", '{"*.gate.e_score_correction_bias": "KEEP", "*.norm*": "F32"}')
    cfg = HotloadConfig.from_env()
    assert cfg.dtype_overrides == {"*.gate.e_score_correction_bias": "keep", "*.norm*": "float32"}
    assert list(cfg.dtype_overrides) == ["*.gate.e_score_correction_bias", "*.norm*"]  # order is the rule order
    args = parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-dtype-overrides", '{"*.bias": "int32"}'])
    with pytest.raises(SystemExit, match=r"--hotload-dtype-overrides: \['\*.bias'\] 'int32' is "
                                         r"not a floating dtype; accepted: .*bfloat16.*, or 'keep'"):
        config_from_args(args)
    with pytest.raises(ValueError, match="empty glob"):
        HotloadConfig(bucket_url="/tmp/b", dtype_overrides={" ": "bfloat16"})


def test_misspelt_env_variable_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "/tmp/b")
    monkeypatch.setenv("HOTLOAD_FULL_EVRY", "5")
    with pytest.raises(ValueError, match=r"HOTLOAD_FULL_EVRY \(did you mean HOTLOAD_FULL_EVERY\?\)"):
        HotloadConfig.from_env()
    monkeypatch.delenv("HOTLOAD_FULL_EVRY")
    monkeypatch.setenv("HOTLOAD_ZZZ", "1")
    with pytest.raises(ValueError, match=r"unknown environment variable HOTLOAD_ZZZ: "):
        HotloadConfig.from_env()


def test_the_packages_own_switches_are_not_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "/tmp/b")
    for name, value in {"HOTLOAD_LIBZSTD": "/x.so", "HOTLOAD_ARC_ENCODER": "auto", "HOTLOAD_ARC_ONE_CALL": "0"}.items():
        monkeypatch.setenv(name, value)
    assert HotloadConfig.from_env().bucket_url == "/tmp/b"


def test_env_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "/tmp/b")
    monkeypatch.setenv("HOTLOAD_FULL_EVERY", "0")
    with pytest.raises(ValueError, match=r"\(HOTLOAD_FULL_EVERY\)"):
        HotloadConfig.from_env()
    assert HotloadConfig.from_env(full_every=3).full_every == 3  # an override wins over a bad variable
    monkeypatch.setenv("HOTLOAD_STORAGE_OPTIONS", "{endpoint: x}")
    with pytest.raises(ValueError, match="HOTLOAD_STORAGE_OPTIONS: not valid JSON"):
        HotloadConfig.from_env(full_every=3)


def test_home_is_expanded_in_local_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A quoted variable or a YAML file passes ``~`` through; a folder literally named ``~`` is never meant."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "~/bucket/")
    monkeypatch.setenv("HOTLOAD_METRICS_PATH", "~/m.jsonl")
    monkeypatch.setenv("HOTLOAD_HF_CONFIG_DIR", "~/hf")
    cfg = HotloadConfig.from_env()
    assert (cfg.bucket_url, cfg.metrics_path, cfg.hf_config_dir) == (
        f"{tmp_path}/bucket", f"{tmp_path}/m.jsonl", f"{tmp_path}/hf")
    assert HotloadConfig(bucket_url="s3://b/~x").bucket_url == "s3://b/~x"


def test_secrets_never_reach_an_error_or_a_repr(capsys: pytest.CaptureFixture[str]) -> None:
    """A model-level error used to print the whole input (pydantic shortens it to its ends, so whichever field came
    last showed in clear), and the repr showed storage_options credentials beside a masked api_key."""
    secret = dict(bucket_url="s3://b/p", hotload_api_url="https://x", api_key="fw_TOPSECRET",
                  storage_options={"key": "AKIA", "secret": "S3_TOPSECRET",
                                   "client_kwargs": {"aws_session_token": "TOK_TOPSECRET", "region_name": "eu"}})
    with pytest.raises(ValidationError) as info:
        HotloadConfig(**secret)
    assert "account_id, model_id, deployment_id must be set" in str(info.value)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HOTLOAD_API_KEY", "fw_TOPSECRET")
        env.setenv("HOTLOAD_STORAGE_OPTIONS", json.dumps(secret["storage_options"]))
        args = parser().parse_args(["--hotload-bucket-url", "s3://b/p", "--hotload-hotload-api-url", "https://x"])
        with pytest.raises(SystemExit) as exit_info:
            config_from_args(args)
    # a check of several fields names each field the way it is set here
    assert ("(--hotload-api-url, --hotload-account-id, --hotload-model-id, --hotload-deployment-id)"
            in str(exit_info.value))
    cfg = HotloadConfig(**{**secret, "hotload_api_url": None})
    for text in (str(info.value), str(exit_info.value), repr(cfg), str(cfg)):
        assert "TOPSECRET" not in text, text
    assert "'region_name': 'eu'" in repr(cfg)
    assert cfg.storage_options["secret"] == "S3_TOPSECRET"  # masked when shown, intact for the storage


@pytest.mark.parametrize("field, value, match", [
    ("bucket_url", "/", "names no folder or bucket"), ("bucket_url", "s3://", "names no folder or bucket"),
    ("bucket_url", "s3://b/p\n", "ends with white space"), ("bucket_url", " /tmp/b", "starts or ends with white"),
    ("ready_timeout_s", float("inf"), "finite"), ("collective_timeout_s", 1e15, "less than or equal"),
    ("poll_interval_s", float("nan"), "finite"),
])
def test_values_that_would_fail_later_are_refused_here(field: str, value: Any, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        HotloadConfig(**{"bucket_url": "b", field: value})


def test_secrets_are_not_flags_because_megatron_prints_and_saves_its_arguments(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron prints every argument on rank 0 and pickles them into each checkpoint."""
    with pytest.raises(SystemExit):
        parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-api-key", "fw_TOPSECRET"])
    err = capsys.readouterr().err
    assert "argument --hotload-api-key: a secret is not taken as a flag" in err and "TOPSECRET" not in err
    creds = json.dumps({"endpoint_url": "http://minio:9000", "secret": "S3_TOPSECRET"})
    with pytest.raises(SystemExit):
        parser().parse_args(["--hotload-storage-options", creds])
    err = capsys.readouterr().err
    assert "--hotload-storage-options: holds credentials" in err and "HOTLOAD_STORAGE_OPTIONS" in err
    assert "TOPSECRET" not in err
    text = " ".join(parser().format_help().split())
    assert ("the API key comes from HOTLOAD_API_KEY or FIREWORKS_API_KEY (HOTLOAD_API_KEY wins when both are set), "
            "the API headers from HOTLOAD_HOTLOAD_API_HEADERS") in text


def test_variables_fill_in_what_the_flags_leave_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launchers pass settings to every rank as HOTLOAD_* variables; the Megatron path used to ignore them, so
    HOTLOAD_BUCKET_URL alone left publishing off in silence."""
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "/tmp/b")
    monkeypatch.setenv("HOTLOAD_FULL_EVERY", "5")
    monkeypatch.setenv("HOTLOAD_PUBLISH_EVERY", "3")
    cfg = config_from_args(parser().parse_args(["--hotload-publish-every", "2"]))
    assert cfg is not None and (cfg.bucket_url, cfg.full_every, cfg.publish_every) == ("/tmp/b", 5, 2)
    monkeypatch.setenv("HOTLOAD_FULL_EVRY", "5")
    with pytest.raises(SystemExit, match="did you mean HOTLOAD_FULL_EVERY"):
        config_from_args(parser().parse_args([]))
    monkeypatch.delenv("HOTLOAD_FULL_EVRY")
    monkeypatch.setenv("HOTLOAD_FULL_EVERY", "0")
    with pytest.raises(SystemExit, match=r"\(HOTLOAD_FULL_EVERY\)"):
        config_from_args(parser().parse_args([]))
    with pytest.raises(ValueError, match="extra_args_provider"):  # e.g. a --yaml-cfg namespace
        config_from_args(argparse.Namespace(yaml_cfg="x.yaml"))


def test_help_shows_choices_and_defaults() -> None:
    text = " ".join(parser().format_help().split())
    assert "one of skip, wait (default: skip)" in text
    assert "one of all, new_session, none" in text and "(default: 20)" in text
    # typed as `null`, as the flags and variables read it: `None` is a string there, refused by a number field
    assert "null = never (default: 30.0)" in text and "null keeps all" in text and "None" not in text


def test_null_and_empty_values_are_refused_by_name(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--hotload-storage-options", "null"])
    assert "--hotload-storage-options: null is not a value of this field" in capsys.readouterr().err
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "/tmp/b")
    monkeypatch.setenv("HOTLOAD_STORAGE_OPTIONS", "null")
    with pytest.raises(ValueError, match="HOTLOAD_STORAGE_OPTIONS: null is not a value"):
        HotloadConfig.from_env()
    monkeypatch.delenv("HOTLOAD_STORAGE_OPTIONS")
    monkeypatch.setenv("HOTLOAD_HOTLOAD_API_URL", "")  # an unset shell variable: signalling was silently off
    with pytest.raises(ValueError, match=r"\(HOTLOAD_HOTLOAD_API_URL\): HOTLOAD_HOTLOAD_API_URL: is empty"):
        HotloadConfig.from_env()


def test_storage_option_flag_merges_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README sends credentials to HOTLOAD_STORAGE_OPTIONS and refuses them as a flag; an endpoint given as the
    flag used to replace the variable's dict whole, so the credentials were dropped in silence."""
    monkeypatch.setenv("HOTLOAD_STORAGE_OPTIONS", '{"key": "AK", "secret": "SK", "endpoint_url": "http://old"}')
    cfg = config_from_args(parser().parse_args(["--hotload-bucket-url", "s3://b/p", "--hotload-storage-options",
                                                '{"endpoint_url": "https://minio:9000"}']))
    assert cfg is not None
    assert cfg.storage_options == {"key": "AK", "secret": "SK", "endpoint_url": "https://minio:9000"}
    # and inside a nested dict: the flag's client_kwargs replaced the variable's, and their credentials with them
    monkeypatch.setenv("HOTLOAD_STORAGE_OPTIONS", json.dumps({
        "client_kwargs": {"aws_access_key_id": "AK", "aws_secret_access_key": "SK", "region_name": "us-east-1"},
        "s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": "K"}}))
    flag = {"client_kwargs": {"endpoint_url": "https://minio:9000", "region_name": "eu"},
            "s3_additional_kwargs": {"ACL": "bucket-owner-full-control"},
            "config_kwargs": {"retries": {"mode": "adaptive"}}}
    cfg = config_from_args(parser().parse_args(["--hotload-bucket-url", "s3://b/p", "--hotload-storage-options",
                                                json.dumps(flag)]))
    assert cfg is not None and cfg.storage_options == {
        "client_kwargs": {"aws_access_key_id": "AK", "aws_secret_access_key": "SK", "region_name": "eu",
                          "endpoint_url": "https://minio:9000"},
        "s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": "K",
                                 "ACL": "bucket-owner-full-control"},
        "config_kwargs": {"retries": {"mode": "adaptive"}}}
    monkeypatch.setenv("HOTLOAD_STORAGE_OPTIONS", "{bad")
    with pytest.raises(SystemExit, match="HOTLOAD_STORAGE_OPTIONS: not valid JSON"):
        config_from_args(parser().parse_args(["--hotload-bucket-url", "s3://b", "--hotload-storage-options", "{}"]))


def test_null_sets_an_optional_field_to_none_over_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``--hotload-progress-log-s null`` turned progress lines off only when no variable was set: a flag's None read
    as 'not given'. A non-optional field given null reached pydantic as the word (or a prefix named 'null')."""
    monkeypatch.setenv("HOTLOAD_PROGRESS_LOG_S", "5")
    cfg = config_from_args(parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-progress-log-s", "null"]))
    assert cfg is not None and cfg.progress_log_s is None
    cfg = config_from_args(parser().parse_args(["--hotload-bucket-url", "/tmp/b"]))
    assert cfg is not None and cfg.progress_log_s == 5.0
    for flag in ("--hotload-full-every", "--hotload-identity-prefix", "--hotload-busy-policy"):
        with pytest.raises(SystemExit):
            parser().parse_args([flag, "null"])
        assert f"{flag}: null is not a value of this field" in capsys.readouterr().err
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "/tmp/b")
    monkeypatch.setenv("HOTLOAD_IDENTITY_PREFIX", "null")
    with pytest.raises(ValueError, match=r"HOTLOAD_IDENTITY_PREFIX: null is not a value.*quote the word"):
        HotloadConfig.from_env()
    monkeypatch.setenv("HOTLOAD_IDENTITY_PREFIX", '"null"')
    assert HotloadConfig.from_env().identity_prefix == "null"


def test_hotload_fields_answer_to_the_flag_without_the_doubled_word() -> None:
    args = parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-api-url", "http://10.0.0.5:8083",
                                "--hotload-api-allow-http", "--hotload-account-id", "a", "--hotload-model-id", "m",
                                "--hotload-deployment-id", "d", "--hotload-hf-config-dir", "/tmp"])
    cfg = config_from_args(args)
    assert cfg is not None and (cfg.hotload_api_url, cfg.hotload_api_allow_http) == ("http://10.0.0.5:8083", True)


def test_the_parsed_flags_load_back_from_a_megatron_checkpoint() -> None:
    """Megatron saves the argument namespace in every checkpoint and reads it back with ``torch.load``, whose
    default (``weights_only``) refuses every class but the ones allowed (Megatron allows ``argparse.Namespace``). A
    flag given as ``null`` used to leave a private marker object in the namespace: resuming failed to unpickle it."""
    import io

    torch = pytest.importorskip("torch")
    args = parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-keep-last", "null",
                                "--hotload-deployment-id", '["a", "b"]', "--hotload-progress-log-s", "null",
                                "--hotload-progress-log-s", "5", *SIGNAL])
    buf = io.BytesIO()
    torch.save({"args": args}, buf)
    buf.seek(0)
    with torch.serialization.safe_globals([argparse.Namespace]):
        loaded = torch.load(buf, map_location="cpu", weights_only=True)["args"]
    cfg = config_from_args(loaded)
    assert cfg is not None and (cfg.keep_last, cfg.deployments, cfg.progress_log_s) == (None, ["a", "b"], 5.0)


def test_publishing_is_not_turned_off_in_silence(monkeypatch: pytest.MonkeyPatch) -> None:
    """No bucket means publishing off (None), but the check for misspelt variables came after that decision: a
    misspelt HOTLOAD_BUCKET_URL, or settings given as flags without the bucket, turned publishing off unnoticed."""
    monkeypatch.setenv("HOTLOAD_BUCKET_ULR", "s3://b/p")
    with pytest.raises(SystemExit, match=r"HOTLOAD_BUCKET_ULR \(did you mean HOTLOAD_BUCKET_URL\?\)"):
        config_from_args(parser().parse_args([]))
    monkeypatch.delenv("HOTLOAD_BUCKET_ULR")
    with pytest.raises(SystemExit, match=r"--hotload-full-every, --hotload-keep-last given, but neither "
                                         r"--hotload-bucket-url nor HOTLOAD_BUCKET_URL is set"):
        config_from_args(parser().parse_args(["--hotload-full-every", "5", "--hotload-keep-last", "null"]))
    with pytest.raises(SystemExit, match=r"^--hotload-api-url, --no-hotload-send-hints given, but"):  # as written
        config_from_args(parser().parse_args(["--no-hotload-send-hints", "--hotload-hotload-api-url", "https://x"]))
    monkeypatch.setenv("HOTLOAD_FULL_EVERY", "5")  # a launcher's standing settings: the bucket alone switches
    assert config_from_args(parser().parse_args([])) is None


@pytest.mark.parametrize("text", ['["key", "secret"]', '"x"', ""])
def test_a_storage_options_variable_that_is_no_json_object_is_refused_beside_the_flag(
        text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Merged under the flag's entries, a variable that was not a JSON object (or was empty: an unset shell variable)
    was dropped without a word, and its credentials with it; alone it is an error naming the variable."""
    monkeypatch.setenv("HOTLOAD_STORAGE_OPTIONS", text)
    with pytest.raises(ValueError, match="HOTLOAD_STORAGE_OPTIONS"):
        HotloadConfig.from_env(bucket_url="s3://b/p")
    args = parser().parse_args(["--hotload-bucket-url", "s3://b/p", "--hotload-storage-options", '{"anon": false}'])
    with pytest.raises(SystemExit, match="HOTLOAD_STORAGE_OPTIONS"):
        config_from_args(args)


def test_list_and_dict_flags_say_they_take_json(capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron's own list flags are space-separated (``nargs='+'``), and the help's examples were Python literals
    that the flags refuse; neither the help nor the error said the flags take JSON."""
    p = add_hotload_args(argparse.ArgumentParser())
    helps = {o: a.help for a in p._actions for o in a.option_strings}
    for flag in ("--hotload-storage-options", "--hotload-carry-base-tensors", "--hotload-dtype-overrides",
                 "--hotload-deployment-id"):
        assert "JSON" in (helps[flag] or ""), (flag, helps[flag])
    text = " ".join(p.format_help().split())
    assert "{'" not in text and "['" not in text  # every example in the help is a value the flag takes
    with pytest.raises(SystemExit):
        p.parse_args(["--hotload-carry-base-tensors", '["model.layers.61.*"'])
    assert 'a JSON list, e.g. ["a", "b"]' in capsys.readouterr().err
    args = p.parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-dtype-overrides",
                         '{"*.e_score_correction_bias": "keep"}', "--hotload-deployment-id", '["d1", "d2"]'])
    # the spelling the help shows is the one the flags take
    assert args.hotload_deployment_id == ["d1", "d2"]
    assert args.hotload_dtype_overrides == {"*.e_score_correction_bias": "keep"}


def test_s3_options_s3fs_would_misread_are_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``"anon": "false"`` in a JSON variable is true to s3fs (unsigned requests, the credentials dropped), and a
    misspelt s3_additional_kwargs key is dropped by it: both stop the launch, naming where they came from."""
    pytest.importorskip("s3fs")
    monkeypatch.setenv("HOTLOAD_STORAGE_OPTIONS", '{"anon": "false", "key": "AK", "secret": "SK"}')
    with pytest.raises(SystemExit, match=r"HOTLOAD_STORAGE_OPTIONS: .*options\.anon must be true or false"):
        config_from_args(parser().parse_args(["--hotload-bucket-url", "s3://b/p"]))
    monkeypatch.delenv("HOTLOAD_STORAGE_OPTIONS")
    flag = json.dumps({"s3_additional_kwargs": {"SSEKMSKeyID": "alias/k"}})
    with pytest.raises(SystemExit, match=r"--hotload-storage-options: .*options\.s3_additional_kwargs\.SSEKMSKeyID "
                                         r"\(did you mean SSEKMSKeyId\?\)"):
        config_from_args(parser().parse_args(["--hotload-bucket-url", "s3://b/p", "--hotload-storage-options", flag]))


def test_a_fields_own_check_is_labelled_once_and_names_other_fields_as_they_are_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The label (flag or variable) already names the field: its check's text does not name it again as the
    Python field; other fields it names are spelt as this path sets them. Checks of several fields keep their text,
    respelt."""
    args = parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-snapshot-dtype", "int8"])
    with pytest.raises(SystemExit) as info:
        config_from_args(args)
    assert "(--hotload-snapshot-dtype): --hotload-snapshot-dtype: 'int8' is not a floating dtype" in str(info.value)
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", " /tmp/b")
    with pytest.raises(ValueError, match=r": HOTLOAD_BUCKET_URL: ' /tmp/b' starts or ends with white space"):
        HotloadConfig.from_env()
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "/tmp/b")
    monkeypatch.setenv("HOTLOAD_HOTLOAD_API_URL", "https://user:pw@api.example")
    with pytest.raises(SystemExit) as info:
        config_from_args(parser().parse_args([]))
    assert ("HOTLOAD_HOTLOAD_API_URL: must not carry credentials before its host ('user:password@'); pass a "
            "gateway's credentials as headers (HOTLOAD_HOTLOAD_API_HEADERS)") in str(info.value)
    monkeypatch.delenv("HOTLOAD_HOTLOAD_API_URL")
    args = parser().parse_args(["--hotload-carry-base-tensors", "mtp.*"])
    with pytest.raises(SystemExit, match=r": --hotload-carry-base-tensors is set, so --hotload-hf-config-dir must be "
                                         "set too"):
        config_from_args(args)
