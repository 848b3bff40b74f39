"""What ``config_from_args`` reads from a namespace built the way Megatron builds it: parsed with the flags, then
given ``args_defaults`` (Megatron sets each key whose attribute is None or missing), or built by a launcher.

Only the attributes the ``--hotload-*`` flags store into are read, so any other ``hotload_*`` attribute is refused
naming the one meant rather than ignored, and a secret on the namespace (which Megatron prints and saves in every
checkpoint) is refused naming its variables, never showing its value. Megatron's own attributes are not looked at.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Callable

import pytest

import megatron_hotload
from fsdp_hotload.config import HotloadConfig
from megatron_hotload import add_hotload_args, config_from_args

REPO = Path(__file__).resolve().parents[1]


def parse_and_validate(argv: list[str], provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser],
                       args_defaults: dict[str, Any]) -> argparse.Namespace:
    """Megatron's order of work: its own flags, the extra provider, parsing, then the defaults where unset."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--tokenizer-type", default=None)
    args = provider(parser).parse_args(argv)
    for key, value in args_defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


@pytest.fixture(autouse=True)
def _no_hotload_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("HOTLOAD_") or n == "FIREWORKS_API_KEY"]:
        monkeypatch.delenv(name)


def test_defaults_under_the_flags_attributes_are_read_and_megatrons_own_are_ignored(tmp_path: Path) -> None:
    def modelopt(p: argparse.ArgumentParser) -> argparse.ArgumentParser:  # a provider of the script's own
        p.add_argument("--export-quant-cfg", default=None)
        return p

    args = parse_and_validate(
        ["--export-quant-cfg", "fp8", "--hotload-bucket-url", str(tmp_path), "--hotload-progress-log-s", "null"],
        lambda p: add_hotload_args(modelopt(p)),
        {"tokenizer_type": "GPT2BPETokenizer", "hotload_full_every": 5, "hotload_hotload_api_allow_http": True,
         "hotload_api_key": None})  # an unset secret (a launcher naming every attribute) is no secret given
    cfg = config_from_args(args)
    assert cfg is not None and args.export_quant_cfg == "fp8" and args.tokenizer_type == "GPT2BPETokenizer"
    assert (cfg.bucket_url, cfg.full_every, cfg.hotload_api_allow_http, cfg.progress_log_s) == (
        str(tmp_path), 5, True, None)
    built = argparse.Namespace(lr=0.1, **{f"hotload_{f}": None for f in HotloadConfig.model_fields})
    built.hotload_bucket_url = str(tmp_path)
    assert config_from_args(built).bucket_url == str(tmp_path)  # type: ignore[union-attr]


@pytest.mark.parametrize(("attr", "meant", "flag"), [
    ("hotload_api_url", "hotload_hotload_api_url", "--hotload-api-url"),  # the name argparse gives the flag
    ("hotload_api_allow_http", "hotload_hotload_api_allow_http", "--hotload-api-allow-http"),
    ("hotload_full_evry", "hotload_full_every", "--hotload-full-every"),
    ("hotload_hotload_full_every", "hotload_full_every", "--hotload-full-every"),
])
def test_a_hotload_attribute_no_flag_stores_into_is_refused_naming_the_one_meant(
        attr: str, meant: str, flag: str, tmp_path: Path) -> None:
    args = parse_and_validate(["--hotload-bucket-url", str(tmp_path)], add_hotload_args, {attr: "5"})
    with pytest.raises(SystemExit) as info:
        config_from_args(args)
    assert f"unknown hotload argument {attr} (did you mean {meant}, which {flag} stores into?)" in str(info.value)


def test_a_misspelt_bucket_attribute_is_refused_rather_than_publishing_off() -> None:
    args = parse_and_validate([], add_hotload_args, {"hotload_bucket_ulr": "/tmp/b", "hotload_zz": 1})
    with pytest.raises(SystemExit, match=r"arguments hotload_bucket_ulr \(did you mean hotload_bucket_url, which "
                                         r"--hotload-bucket-url stores into\?\), hotload_zz: "):
        config_from_args(args)


@pytest.mark.parametrize(("attr", "value", "variables"), [
    ("hotload_api_key", "fw_0123456789abcdef", "HOTLOAD_API_KEY or FIREWORKS_API_KEY"),
    ("hotload_hotload_api_headers", {"X-Gateway-Secret": "s3cr3t-value"}, "HOTLOAD_HOTLOAD_API_HEADERS"),
    ("hotload_api_headers", {"X-Gateway-Secret": "s3cr3t-value"}, "HOTLOAD_HOTLOAD_API_HEADERS"),
])
def test_a_secret_on_the_namespace_is_refused_naming_its_variables(attr: str, value: Any, variables: str,
                                                                   tmp_path: Path) -> None:
    signal = {"hotload_hotload_api_url": "https://api.example", "hotload_account_id": "a", "hotload_model_id": "m",
              "hotload_deployment_id": "d", "hotload_hf_config_dir": str(tmp_path)}
    args = parse_and_validate(["--hotload-bucket-url", str(tmp_path)], add_hotload_args, {**signal, attr: value})
    with pytest.raises(SystemExit) as info:
        config_from_args(args)
    text = str(info.value)
    assert f"the arguments hold {attr} (the value not shown)" in text and f"set {variables}" in text
    assert "s3cr3t" not in text and "fw_0123" not in text


def test_the_megatron_recipes_of_both_core_versions_are_documented() -> None:
    """Megatron Core 0.18 took ``extra_args_provider`` out of ``pretrain`` (a TypeError there): the flags go to
    ``parse_and_validate_args`` in the launch script; up to 0.17 they go to ``pretrain``."""
    readme = (REPO / "README.md").read_text()
    for text in (readme, megatron_hotload.__doc__ or "", config_from_args.__doc__ or ""):
        assert "parse_and_validate_args(extra_args_provider=add_hotload_args" in " ".join(text.split())
        assert "pretrain" in text and "0.17" in text
    flat = " ".join(readme.split())
    assert "lambda p: add_hotload_args(add_modelopt_args(p)" in flat  # chaining the script's own provider
    assert "megatron.training.training.train_step" in flat and "--distributed-timeout-minutes" in flat
    assert "close_timeout_s` below that timeout" in flat
