"""The --hotload-* flags come from HotloadConfig: every field has a flag, values round-trip, errors name flags."""
from __future__ import annotations

import argparse

import pytest

from fsdp_hotload.config import HotloadConfig
from megatron_hotload import add_hotload_args, config_from_args, flag_name


def parser() -> argparse.ArgumentParser:
    return add_hotload_args(argparse.ArgumentParser())


def test_every_field_has_a_flag() -> None:
    flags = {a for action in parser()._actions for a in action.option_strings}
    for name in HotloadConfig.model_fields:
        assert flag_name(name) in flags, name


def test_round_trip() -> None:
    args = parser().parse_args([
        "--hotload-bucket-url", "s3://b/p", "--hotload-full-every", "25", "--hotload-deployment-id", '["a", "b"]',
        "--hotload-storage-options", '{"endpoint_url": "http://127.0.0.1:9000"}', "--hotload-ready-timeout-s",
        "120.5", "--no-hotload-send-hints", "--hotload-codec", "arc_sparse_v1"])
    cfg = config_from_args(args)
    assert cfg is not None
    assert (cfg.bucket_url, cfg.full_every, cfg.deployments, cfg.ready_timeout_s, cfg.send_hints, cfg.codec) == (
        "s3://b/p", 25, ["a", "b"], 120.5, False, "arc_sparse_v1")
    assert cfg.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    assert config_from_args(parser().parse_args([])) is None


def test_bad_value_names_the_flag() -> None:
    args = parser().parse_args(["--hotload-bucket-url", "/tmp/b", "--hotload-busy-policy", "sometimes"])
    with pytest.raises(SystemExit, match="--hotload-busy-policy"):
        config_from_args(args)
