"""``--hotload-*`` flags generated from HotloadConfig, so the two entry points can never drift apart.

Each config field becomes ``--hotload-<field-with-dashes>``; booleans become ``--hotload-x`` / ``--no-hotload-x``;
lists and dicts take JSON. Defaults are left to the config (flags default to None), so the validation and the
error messages are the config's own.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable

from pydantic import ValidationError

from fsdp_hotload.config import HotloadConfig

PREFIX = "hotload"


def flag_name(field: str) -> str:
    return f"--{PREFIX}-{field.replace('_', '-')}"


def _kind(annotation: Any) -> str:
    text = str(annotation)
    if annotation is bool:
        return "bool"
    if "dict" in text or "list" in text:
        return "json"
    if annotation is int or text in ("int | None", "typing.Optional[int]"):
        return "int"
    if annotation is float:
        return "float"
    return "str"


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # a bare string, e.g. one deployment id


def add_hotload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per HotloadConfig field (in an argument group), help text from the field description."""
    group = parser.add_argument_group("hotload", "publish weights to a remote rollout fleet (fsdp_hotload)")
    for name, field in HotloadConfig.model_fields.items():
        kind = _kind(field.annotation)
        help_text = (field.description or name).replace("%", "%%")
        if kind == "bool":
            group.add_argument(flag_name(name), dest=f"{PREFIX}_{name}", default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)
            continue
        convs: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "json": _json}
        conv = convs.get(kind, str)
        group.add_argument(flag_name(name), dest=f"{PREFIX}_{name}", default=None, type=conv, help=help_text)
    return parser


def config_from_args(args: argparse.Namespace) -> HotloadConfig | None:
    """The config from parsed flags, or None when ``--hotload-bucket-url`` is absent (publishing off)."""
    values = {name: getattr(args, f"{PREFIX}_{name}") for name in HotloadConfig.model_fields
              if getattr(args, f"{PREFIX}_{name}", None) is not None}
    if "bucket_url" not in values:
        return None
    try:
        return HotloadConfig(**values)
    except ValidationError as exc:
        bad = ", ".join(flag_name(str(e["loc"][0])) for e in exc.errors() if e.get("loc"))
        raise SystemExit(f"invalid hotload flags ({bad or 'see below'}):\n{exc}") from None

