"""HotloadConfig: every bad value is refused at construction, naming its field."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsdp_hotload.config import HotloadConfig


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="full_every"):
        HotloadConfig(bucket_url=str(tmp_path), full_every=0)
    with pytest.raises(ValueError, match="codec"):
        HotloadConfig(bucket_url=str(tmp_path), codec="gzip")
    with pytest.raises(ValueError, match="account_id"):
        HotloadConfig(bucket_url=str(tmp_path), hotload_api_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="hf_config_dir"):
        HotloadConfig(bucket_url=str(tmp_path), hotload_api_url="http://127.0.0.1:1", account_id="a",
                      model_id="m", deployment_id="d")
    os.environ["HOTLOAD_BUCKET_URL"] = str(tmp_path)
    os.environ["HOTLOAD_DEPLOYMENT_ID"] = '["a", "b"]'
    try:
        with pytest.raises(ValueError, match="HOTLOAD_DEPLOYMENT_ID is set but HOTLOAD_HOTLOAD_API_URL is not"):
            HotloadConfig.from_env(full_every=5)  # would publish to storage only: the fleet would never move
        cfg = HotloadConfig.from_env(full_every=5, hotload_api_url="https://api.example", account_id="x",
                                     model_id="m", hf_config_dir=str(tmp_path))
        assert cfg.deployments == ["a", "b"] and cfg.full_every == 5
    finally:
        del os.environ["HOTLOAD_BUCKET_URL"], os.environ["HOTLOAD_DEPLOYMENT_ID"]
    with pytest.raises(ValueError, match="account_id, model_id, reset_prompt_cache are set but hotload_api_url"):
        HotloadConfig(bucket_url=str(tmp_path), account_id="x", model_id="m", reset_prompt_cache="all")
    with pytest.raises(ValueError, match="straggler_wait_s is set, so deployments_required must be 'any'"):
        HotloadConfig(bucket_url=str(tmp_path), hotload_api_url="https://api.example", account_id="x", model_id="m",
                      hf_config_dir=str(tmp_path), deployment_id=["a", "b"], straggler_wait_s=30)
    with pytest.raises(ValueError, match="straggler_wait_s is set but hotload_api_url is not"):
        HotloadConfig(bucket_url=str(tmp_path), straggler_wait_s=30)
    with pytest.raises(ValueError, match="straggler_wait_s"):
        HotloadConfig(bucket_url=str(tmp_path), straggler_wait_s=-1)


@pytest.mark.parametrize("prefix", ["aux.run1", "NUL.x", "com1.v2"])
def test_an_identity_prefix_that_makes_unstorable_names_is_refused(tmp_path: Path, prefix: str) -> None:
    """Every identity would start with a Windows device name: refused here, not at the first publish, where it
    stopped publishing for the whole job with an error that blamed the side group."""
    with pytest.raises(ValueError, match="identity_prefix") as info:
        HotloadConfig(bucket_url=str(tmp_path), identity_prefix=prefix)
    assert "Windows device name" in str(info.value)
    assert HotloadConfig(bucket_url=str(tmp_path), identity_prefix=prefix.replace(".", "-")).identity_prefix


def test_values_that_would_fail_or_leak_later_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"snapshot_dtype 'float8_e4m3fn' would cast every floating tensor"):
        HotloadConfig(bucket_url="/tmp/b", snapshot_dtype="float8_e4m3fn")
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "/tmp/b")
    monkeypatch.setenv("HOTLOAD_API_KEY", "")  # an unset shell variable in a launcher: would hide the real key
    with pytest.raises(ValueError, match=r"HOTLOAD_API_KEY: is empty \(set it"):
        HotloadConfig.from_env()
    monkeypatch.delenv("HOTLOAD_API_KEY")
    signalling = dict(bucket_url="/tmp/b", hotload_api_url="https://api.example", account_id="a", model_id="m",
                      hf_config_dir="/tmp")
    with pytest.raises(ValueError, match=r"hotload_api_headers\['X-Token'\] contains a line break") as info:
        HotloadConfig(**signalling, deployment_id="d", hotload_api_headers={"X-Token": "s3cr3t\nX-Evil: 1"})
    assert "s3cr3t" not in str(info.value)
    assert HotloadConfig(**signalling, deployment_id="d",
                         hotload_api_headers={"X-Token": "s3cr3t\n"}).hotload_api_headers == {"X-Token": "s3cr3t"}
    with pytest.raises(ValueError, match="deployment_id names accounts/a/deployments/d more than once"):
        HotloadConfig(**signalling, deployment_id=["d", "accounts/a/deployments/d"])
    with pytest.raises(ValueError, match="belongs to account 'b'"):
        HotloadConfig(**signalling, deployment_id=["accounts/b/deployments/d"])
    # the model too, at construction (it was checked only when the callback built its client)
    for bad in ("bad name", "accounts/a/models/m?x", "accounts/a/m"):
        with pytest.raises(ValueError, match="model_id"):
            HotloadConfig(**{**signalling, "model_id": bad}, deployment_id="d")


def test_snapshot_dtype_errors_list_only_what_it_accepts() -> None:
    """The message used to offer float8_e4m3fn and float8_e5m2, which the next check refuses."""
    with pytest.raises(ValueError, match=r"accepted: float16, bfloat16, float32, float64 \(") as info:
        HotloadConfig(bucket_url="/tmp/b", snapshot_dtype="int8")
    assert "float8" not in str(info.value)
    with pytest.raises(ValueError, match=r"snapshot_dtype 'float8_e5m2' would cast every floating tensor"):
        HotloadConfig(bucket_url="/tmp/b", snapshot_dtype="float8_e5m2")
    assert [HotloadConfig(bucket_url="/tmp/b", snapshot_dtype=d).snapshot_dtype for d in ("fp16", "half", "BF16",
            "bf16", "fp32")] == ["float16", "float16", "bfloat16", "bfloat16", "float32"]


@pytest.mark.parametrize("field", ["metrics_path", "hf_config_dir"])
def test_an_empty_path_is_refused_by_name(field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unset shell variable gives '': metrics_path then turned the metrics file off in silence, and hf_config_dir
    failed only when the publisher started, with an error that named no setting."""
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "/tmp/b")
    monkeypatch.setenv(f"HOTLOAD_{field.upper()}", "")
    with pytest.raises(ValueError, match=rf"\(HOTLOAD_{field.upper()}\): HOTLOAD_{field.upper()}: is empty"):
        HotloadConfig.from_env()
    with pytest.raises(ValueError, match=f"{field} is empty"):
        HotloadConfig(bucket_url="/tmp/b", **{field: " "})
    assert getattr(HotloadConfig(bucket_url="/tmp/b", **{field: None}), field) is None


@pytest.mark.parametrize("url", ["api.fireworks.ai", "ftp://api.fireworks.ai", "https://", "https://host:99999",
                                 "https://api.fireworks.ai/?x=1"])
def test_a_hot_load_url_the_client_cannot_use_is_refused_naming_the_field(tmp_path: Path, url: str) -> None:
    """Such a URL passed the config and failed only when the callback was built, as 'base_url ...', a name the
    user never set (and, from a variable or a flag, without naming it)."""
    with pytest.raises(ValueError, match="hotload_api_url") as info:
        HotloadConfig(bucket_url=str(tmp_path), hotload_api_url=url, account_id="a", model_id="m",
                      deployment_id="d", hf_config_dir=str(tmp_path))
    assert "base_url" not in str(info.value)


def test_a_bad_hot_load_url_from_the_environment_names_its_variable(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """from_env and the Megatron flags name the variable a field came from, found in the message."""
    for name, value in dict(BUCKET_URL=str(tmp_path), HOTLOAD_API_URL="api.fireworks.ai", ACCOUNT_ID="a",
                            MODEL_ID="m", DEPLOYMENT_ID="d", HF_CONFIG_DIR=str(tmp_path)).items():
        monkeypatch.setenv("HOTLOAD_" + name, value)
    with pytest.raises(ValueError, match=r"\(HOTLOAD_HOTLOAD_API_URL\)"):
        HotloadConfig.from_env()


def test_a_required_setting_missing_from_the_environment_is_named_by_its_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Building from the environment, the user sets a missing field through its variable: that is its name."""
    for var in [k for k in os.environ if k.startswith("HOTLOAD_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("HOTLOAD_FULL_EVERY", "3")
    with pytest.raises(ValueError, match=r"environment variables \(HOTLOAD_BUCKET_URL\)"):
        HotloadConfig.from_env()
    with pytest.raises(ValueError, match=r"environment variables \(bucket_url\)"):  # an override the code gives
        HotloadConfig.from_env(bucket_url=None)


def test_max_file_bytes_takes_a_whole_number_but_not_the_text_5e9(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """As the README says: ``5e9`` in Python is a whole float and is taken; as text (a variable) it is refused,
    naming the variable; a fraction of a byte is refused either way."""
    assert HotloadConfig(bucket_url=str(tmp_path), max_file_bytes=5e9).max_file_bytes == 5_000_000_000
    with pytest.raises(ValueError, match="max_file_bytes"):
        HotloadConfig(bucket_url=str(tmp_path), max_file_bytes=1.5)
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", str(tmp_path))
    monkeypatch.setenv("HOTLOAD_MAX_FILE_BYTES", "5e9")
    with pytest.raises(ValueError, match=r"\(HOTLOAD_MAX_FILE_BYTES\)"):
        HotloadConfig.from_env()
    monkeypatch.setenv("HOTLOAD_MAX_FILE_BYTES", "5000000000")
    assert HotloadConfig.from_env().max_file_bytes == 5_000_000_000


def test_a_publisher_keeps_a_checked_copy_of_its_config(tmp_path: Path) -> None:
    """pydantic keeps an assignment a model validator refused, and model_copy(update=) validates nothing: a
    publisher then started on a config it would have refused (signalling without account_id failed on a bare
    assert; full_every=0), and later edits of the object changed a running publisher."""
    import torch
    from pydantic import ValidationError

    from fsdp_hotload import HotloadCallback
    from fsdp_hotload.publish import TensorPublisher

    cfg = HotloadConfig(bucket_url=str(tmp_path / "b"))
    with pytest.raises(ValidationError, match="account_id, model_id, deployment_id must be set"):
        cfg.hotload_api_url = "https://127.0.0.1:9"
    for start in (lambda c: HotloadCallback(torch.nn.Linear(2, 2), c),
                  lambda c: TensorPublisher({"w": torch.zeros(2)}, c)):
        with pytest.raises(ValidationError, match="(?s)hotload_api_url is set, so account_id"):
            start(cfg)
        with pytest.raises(ValidationError, match="(?s)full_every"):
            start(HotloadConfig(bucket_url=str(tmp_path / "b")).model_copy(update={"full_every": 0}))
    good = HotloadConfig(bucket_url=str(tmp_path / "b"), full_every=4)
    with TensorPublisher({"w": torch.zeros(2)}, good) as pub:
        good.full_every = 9
        assert pub.engine.config.full_every == 4 and pub.engine.config is not good


def test_a_storage_options_argument_merges_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``from_env(storage_options={"endpoint_url": ...})`` replaced HOTLOAD_STORAGE_OPTIONS whole: the credentials
    there were dropped in silence and the provider's credential chain (another identity) was used instead. The
    Megatron flags already merged; code now does the same, inside nested dicts too."""
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "s3://b/p")
    monkeypatch.setenv("HOTLOAD_STORAGE_OPTIONS", '{"key": "AK", "secret": "SK", "client_kwargs": {"region_name": '
                                                  '"eu", "endpoint_url": "http://old"}}')
    cfg = HotloadConfig.from_env(storage_options={"client_kwargs": {"endpoint_url": "https://minio:9000"}})
    assert cfg.storage_options == {"key": "AK", "secret": "SK", "client_kwargs": {
        "region_name": "eu", "endpoint_url": "https://minio:9000"}}
    monkeypatch.setenv("HOTLOAD_STORAGE_OPTIONS", '["not", "options"]')
    with pytest.raises(ValueError, match="HOTLOAD_STORAGE_OPTIONS: not a JSON object"):
        HotloadConfig.from_env(storage_options={})


def test_paths_with_surrounding_white_space_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ConfigMap value built ``--from-file`` ends in a newline: the metrics file was created with it in its
    name, without a word."""
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "/tmp/bucket")
    monkeypatch.setenv("HOTLOAD_METRICS_PATH", "/tmp/m.jsonl\n")
    with pytest.raises(ValueError, match="HOTLOAD_METRICS_PATH") as info:
        HotloadConfig.from_env()
    assert "white space" in str(info.value)


@pytest.mark.parametrize("field", ["hf_config_dir", "metrics_path"])
def test_a_url_for_a_local_path_is_refused_by_name(field: str) -> None:
    """Both are opened as local paths on rank 0: an S3 URL for hf_config_dir failed at start with "does not exist
    or is not a folder", and one for metrics_path created a folder named s3: in the working directory."""
    with pytest.raises(ValueError, match=f"{field} 's3://models/qwen3-8b' is a URL, and rank 0 opens it as a local"):
        HotloadConfig(bucket_url="/tmp/bucket", **{field: "s3://models/qwen3-8b"})
    with pytest.raises(ValueError, match="is a URL") as info:
        HotloadConfig(bucket_url="/tmp/bucket", **{field: "https://u:Hunter2pw@hub.internal/qwen"})
    assert "Hunter2pw" not in str(info.value)
    assert getattr(HotloadConfig(bucket_url="/tmp/bucket", **{field: "models/s3:/x"}), field) == "models/s3:/x"
    for url in ["s3:models/qwen3-8b", "gs:b/x"]:  # no slashes: a folder "s3:models" was made in the working dir
        with pytest.raises(ValueError, match=f"{field} '{url}' is a URL"):
            HotloadConfig(bucket_url="/tmp/bucket", **{field: url})
    with pytest.raises(ValueError, match="give the local path '/srv/qwen'"):
        HotloadConfig(bucket_url="/tmp/bucket", **{field: "file:///srv/qwen"})
    for path in ["C:/models/qwen", "a:b/qwen", "./qwen"]:  # a drive letter, a name with a colon
        assert getattr(HotloadConfig(bucket_url="/tmp/bucket", **{field: path}), field) == path


def test_a_bucket_url_naming_no_bucket_is_refused_without_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    """sftp://u:$PW@host:$PORT with PORT unset: the error printed the password (every rank's log)."""
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", "sftp://trainer:Hunter2pw@storage.internal:")
    with pytest.raises(ValueError, match="names no folder or bucket") as info:
        HotloadConfig.from_env()
    assert "Hunter2pw" not in str(info.value)


def test_extra_fields_ignore_takes_top_level_keys_only() -> None:
    """The server ignores top-level config.json keys only: a dotted path or a padded name would be sent and never
    match, so every publish it was meant to save would still be refused."""
    assert HotloadConfig(bucket_url="/tmp/b", extra_fields_ignore=["quantization_config"]).extra_fields_ignore == \
        ["quantization_config"]
    for bad in ["quantization_config.quant_method", " quantization_config", ""]:
        with pytest.raises(ValueError, match=f"extra_fields_ignore names {bad!r}"):
            HotloadConfig(bucket_url="/tmp/b", extra_fields_ignore=[bad])
