"""``--hotload-*`` flags generated from HotloadConfig, so the two entry points can never drift apart.

Each config field becomes ``--hotload-<field-with-dashes>``; booleans become ``--hotload-x`` / ``--no-hotload-x``.
The fields named ``hotload_*`` drop the doubled word (``hotload_api_url`` is ``--hotload-api-url``); the
doubled form (``--hotload-hotload-api-url``) is still accepted.
Values are read exactly like ``HOTLOAD_*`` environment variables (:func:`fsdp_hotload.config.parse_setting`):
JSON for lists and dicts, or text starting with ``[``, ``{`` or ``"``; anything else stays a string, so
``--hotload-deployment-id 12345`` is the id ``"12345"``. Defaults are left to the config (flags default to None),
so the validation and the error messages are the config's own. ``HOTLOAD_*`` variables fill in what the flags
leave unset; ``--hotload-storage-options`` is merged over ``HOTLOAD_STORAGE_OPTIONS`` entry by entry (nested
dicts too), so the endpoint can be a flag while the credentials stay in the variable.

Secrets are not flags: Megatron prints every argument on rank 0 and saves them in its checkpoints, so the API
key and the API headers come from the environment (``FIREWORKS_API_KEY`` or ``HOTLOAD_API_KEY``,
``HOTLOAD_HOTLOAD_API_HEADERS``), ``--hotload-storage-options`` refuses credential entries (use
``HOTLOAD_STORAGE_OPTIONS`` or the provider's own credential chain), and no flag takes a URL with credentials in it
(``user:password@``, a signed query).
"""
from __future__ import annotations

import argparse
import os
import re
import types
from typing import Any, Callable, Literal, Union, get_args, get_origin

from pydantic_core import PydanticUndefined

from fsdp_hotload.config import ENV_PREFIX, HotloadConfig, json_hint, parse_setting, spell_fields
from fsdp_hotload.masking import mask_secrets, mask_url

PREFIX = "hotload"
#: Fields with no flag: their values would be printed in Megatron's argument dump and stored in checkpoints.
SECRET_FIELDS: tuple[str, ...] = ("api_key", "hotload_api_headers")


def flag_name(field: str) -> str:
    """The flag of ``field``, as messages name it: ``--hotload-api-url`` for ``hotload_api_url``."""
    if field.startswith(PREFIX + "_"):
        field = field[len(PREFIX) + 1:]
    return f"--{PREFIX}-{field.replace('_', '-')}"


def flag_names(field: str) -> list[str]:
    """The flags of ``field``: its :func:`flag_name`, and for a ``hotload_*`` field the doubled form too."""
    names = [flag_name(field)]
    if field.startswith(PREFIX + "_"):
        names.append(f"--{PREFIX}-{field.replace('_', '-')}")
    return names


def _given_as(field: str, value: Any) -> str:
    """The flag as the user wrote it: ``--no-hotload-x`` for a boolean set to False."""
    negated = value is False and HotloadConfig.model_fields[field].annotation is bool
    return f"--no-{flag_name(field)[2:]}" if negated else flag_name(field)


#: The namespace attribute that lists, by field name, the flags given as ``null``.
NULL_FIELDS = f"{PREFIX}_null_fields"


class _StoreSetting(argparse.Action):
    """Stores a flag's value; a ``null`` (None) is also listed in :data:`NULL_FIELDS`.

    None in the flag's own attribute reads as 'not given', so the list is what lets a ``null`` flag win over its
    variable. Megatron saves the namespace in every checkpoint and reads it back with ``torch.load``, which by
    default refuses any class it was not told of: the namespace holds builtin values only (a marker object of
    ours made every such checkpoint unloadable).
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        field = self.dest[len(PREFIX) + 1:]
        nulls = [f for f in getattr(namespace, NULL_FIELDS, None) or [] if f != field]  # the last flag wins
        setattr(namespace, NULL_FIELDS, [*nulls, field] if values is None else nulls)


def _setting_name(field: str) -> str:
    """How a user sets ``field`` on this path: its flag, or its variable for a secret."""
    return ENV_PREFIX + field.upper() if field in SECRET_FIELDS else flag_name(field)


def _credentials_home(name: str) -> str:
    """Where a URL field's credentials go instead of its flag."""
    if name == "hotload_api_url":
        return f"headers ({ENV_PREFIX}HOTLOAD_API_HEADERS)"
    return f"storage options ({ENV_PREFIX}STORAGE_OPTIONS) or the storage provider's own credential chain"


def _converter(name: str, annotation: Any) -> Callable[[str], Any]:
    """The argparse ``type`` of a field: the config's own text rule, bad JSON reported against the flag."""
    def convert(text: str) -> Any:
        try:
            value = parse_setting(text, annotation)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if name == "storage_options" and mask_secrets(value) != value:
            raise argparse.ArgumentTypeError(
                "holds credentials, which Megatron would print and save in its checkpoints; pass them in "
                f"{ENV_PREFIX}STORAGE_OPTIONS or the storage provider's own credential chain instead")
        if isinstance(value, str) and mask_url(value) != value:  # a URL's user:password@ or a signed query
            raise argparse.ArgumentTypeError(
                "holds credentials in its URL, which Megatron would print and save in its checkpoints; pass them "
                f"as {_credentials_home(name)} instead")
        return value
    return convert


def _help(name: str) -> str:
    field = HotloadConfig.model_fields[name]
    text = field.description or name
    text = spell_fields(text, _setting_name, but=name)  # other settings as this path sets them
    text = re.sub(r"(--[\w-]+)='([^']*)'", r"\1 \2", text)  # deployments_required='any': --hotload-... any
    union = get_origin(field.annotation) in (Union, types.UnionType)
    members = get_args(field.annotation) if union else (field.annotation,)
    choices = [a for m in members if get_origin(m) is Literal for a in get_args(m)]
    if choices:
        text += f"; one of {', '.join(map(str, choices))}"
    if hint := json_hint(field.annotation):  # Megatron's own list flags are space-separated (nargs='+'); JSON here
        text += "; " + hint
    if type(None) in members:  # written `null` on the command line, as in a variable
        text = re.sub(r"\bNone\b", "null", text)
    default = field.get_default(call_default_factory=True)
    if default is not PydanticUndefined and default not in (None, {}, []):
        text += f" (default: {default})"
    return text.replace("%", "%%")


def add_hotload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per HotloadConfig field but the secrets (in an argument group), help from the field
    description, with its choices and default."""
    group = parser.add_argument_group(
        "hotload", "publish weights to a remote rollout fleet (fsdp_hotload); HOTLOAD_* variables fill in the "
        f"flags not given, and the secrets come only from them: {', '.join(map(_setting_name, SECRET_FIELDS))}")
    for name, field in HotloadConfig.model_fields.items():
        if name in SECRET_FIELDS:
            continue
        if field.annotation is bool:
            group.add_argument(*flag_names(name), dest=f"{PREFIX}_{name}", default=None,
                               action=argparse.BooleanOptionalAction, help=_help(name))
            continue
        group.add_argument(*flag_names(name), dest=f"{PREFIX}_{name}", default=None, action=_StoreSetting,
                           type=_converter(name, field.annotation), help=_help(name))
    return parser


def _check_publishing_off(values: dict[str, Any]) -> None:
    """SystemExit unless no bucket means publishing is meant to be off: a misspelt variable (``HOTLOAD_BUCKET_ULR``)
    or settings given as flags would otherwise be dropped without a word. Other ``HOTLOAD_*`` variables may stand
    in a launcher's environment for every job, so they alone do not count."""
    try:
        HotloadConfig.check_env_names()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if values:
        given = ", ".join(_given_as(f, v) for f, v in values.items())
        raise SystemExit(f"{given} given, but neither {flag_name('bucket_url')} nor {ENV_PREFIX}BUCKET_URL is set: "
                         f"publishing would be off; set one, or leave out the --{PREFIX}-* flags")


def config_from_args(args: argparse.Namespace) -> HotloadConfig | None:
    """The config from parsed flags and ``HOTLOAD_*`` variables (flags win), or None when neither
    ``--hotload-bucket-url`` nor ``HOTLOAD_BUCKET_URL`` is set (publishing off; then any other ``--hotload-*``
    flag, or a misspelt ``HOTLOAD_*`` variable, is an error).

    A flag given as ``null`` sets its (optional) field to None, whatever the variable says. The entries of
    ``--hotload-storage-options`` are merged over those of ``HOTLOAD_STORAGE_OPTIONS``. Raises
    SystemExit naming the flags and variables at fault, and ValueError when ``args`` has no hotload flags at
    all (the parser never had :func:`add_hotload_args`, or Megatron's ``--yaml-cfg`` replaced the arguments).
    """
    if not hasattr(args, f"{PREFIX}_bucket_url"):
        raise ValueError("these arguments have no --hotload-* flags: pass megatron_hotload.add_hotload_args as "
                         "Megatron's extra_args_provider (with --yaml-cfg, set HOTLOAD_* variables and call "
                         "HotloadConfig.from_env() instead)")
    values = {name: getattr(args, f"{PREFIX}_{name}") for name in HotloadConfig.model_fields
              if getattr(args, f"{PREFIX}_{name}", None) is not None}
    values.update(dict.fromkeys(getattr(args, NULL_FIELDS, None) or [], None))
    if "bucket_url" not in values and ENV_PREFIX + "BUCKET_URL" not in os.environ:
        _check_publishing_off(values)
        return None
    try:
        return HotloadConfig.from_env_under(values, name_of=_setting_name,
                                               source=f"--{PREFIX}-* flags and {ENV_PREFIX}* variables")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
