"""``--hotload-*`` flags generated from HotloadConfig, so the two entry points can never drift apart.

Each config field becomes ``--hotload-<field-with-dashes>``; booleans become ``--hotload-x`` / ``--no-hotload-x``.
Values are read exactly like ``HOTLOAD_*`` environment variables (:func:`fsdp_hotload.config.parse_setting`):
JSON for lists and dicts, or text starting with ``[``, ``{`` or ``"``; anything else stays a string, so
``--hotload-deployment-id 12345`` is the id ``"12345"``. Defaults are left to the config (flags default to None),
so the validation and the error messages are the config's own.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

from pydantic import ValidationError

from fsdp_hotload.config import HotloadConfig, error_names, parse_setting

PREFIX = "hotload"


def flag_name(field: str) -> str:
    return f"--{PREFIX}-{field.replace('_', '-')}"


def _converter(annotation: Any) -> Callable[[str], Any]:
    """The argparse ``type`` of a field: the config's own text rule, bad JSON reported against the flag."""
    def convert(text: str) -> Any:
        try:
            return parse_setting(text, annotation)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def add_hotload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per HotloadConfig field (in an argument group), help text from the field description."""
    group = parser.add_argument_group("hotload", "publish weights to a remote rollout fleet (fsdp_hotload)")
    for name, field in HotloadConfig.model_fields.items():
        help_text = (field.description or name).replace("%", "%%")
        if field.annotation is bool:
            group.add_argument(flag_name(name), dest=f"{PREFIX}_{name}", default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)
            continue
        group.add_argument(flag_name(name), dest=f"{PREFIX}_{name}", default=None,
                           type=_converter(field.annotation), help=help_text)
    return parser


def config_from_args(args: argparse.Namespace) -> HotloadConfig | None:
    """The config from parsed flags, or None when ``--hotload-bucket-url`` is absent (publishing off).

    A flag given as ``null`` counts as not given, i.e. the field's default (None wherever ``null`` is accepted).
    """
    values = {name: getattr(args, f"{PREFIX}_{name}") for name in HotloadConfig.model_fields
              if getattr(args, f"{PREFIX}_{name}", None) is not None}
    if "bucket_url" not in values:
        return None
    try:
        return HotloadConfig(**values)
    except ValidationError as exc:
        raise SystemExit(f"invalid hotload flags ({error_names(exc, flag_name) or 'see below'}):\n{exc}") from None
