"""``--hotload-*`` flags generated from HotloadConfig, so the two entry points can never drift apart.

Each config field becomes ``--hotload-<field-with-dashes>``; booleans become ``--hotload-x`` (optionally with a
value, ``--hotload-x false``, read as the variable is) / ``--no-hotload-x``. The fields named ``hotload_*`` drop
the doubled word (``hotload_api_url`` is ``--hotload-api-url``); the doubled form (``--hotload-hotload-api-url``)
is still accepted.
Values are read exactly like ``HOTLOAD_*`` environment variables (:func:`fsdp_hotload.config.parse_setting`):
JSON for lists and dicts, or text starting with ``[``, ``{`` or ``"``; anything else stays a string, so
``--hotload-deployment-id 12345`` is the id ``"12345"``. List flags also take plain values separated by spaces,
as Megatron's own list flags do (``--hotload-deployment-id dep-a dep-b``). Defaults are left to the config (flags
default to None), so the validation and the error messages are the config's own. ``HOTLOAD_*`` variables fill in
what the flags leave unset; ``--hotload-storage-options`` is merged over ``HOTLOAD_STORAGE_OPTIONS`` entry by
entry (nested dicts too), so the endpoint can be a flag while the credentials stay in the variable; the merged
options are checked against the storage root at once (the storage layer's own check).

Secrets are not flags: Megatron prints every argument on rank 0 and saves them in its checkpoints, so the API
key and the API headers come from the environment (``HOTLOAD_API_KEY`` or ``FIREWORKS_API_KEY``, the first
winning, and ``HOTLOAD_HOTLOAD_API_HEADERS``); their flags are hidden and refuse any use without showing the value.
``--hotload-storage-options`` refuses credential entries (use ``HOTLOAD_STORAGE_OPTIONS`` or the provider's own
credential chain), and no flag takes a URL with credentials in it (``user:password@``, a signed query).
Only the attributes the flags store into are read: any other ``hotload_*`` attribute (set through Megatron's
``args_defaults``, or by a launcher that builds the namespace) is an error naming the one meant, and so is a secret
set on the namespace.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import types
from typing import Any, Callable, Literal, Union, get_args, get_origin

from pydantic_core import PydanticUndefined

from fsdp_hotload.config import ENV_PREFIX, HotloadConfig, spell_fields
from fsdp_hotload.config_text import json_hint, parse_setting
from fsdp_hotload.masking import mask_secrets, mask_url

from .flag_actions import NULL_FIELDS, PREFIX, ListSetting, NegatedSwitch, RefuseSecret, StoreSetting, Switch

#: Fields with no usable flag: their values would be printed in Megatron's argument dump and stored in checkpoints.
#: Their flags exist, hidden, only to refuse a value without echoing it.
SECRET_FIELDS: tuple[str, ...] = ("api_key", "hotload_api_headers")
#: Where each secret comes from on this path instead.
SECRET_VARIABLES: dict[str, str] = {
    "api_key": f"{ENV_PREFIX}API_KEY or FIREWORKS_API_KEY ({ENV_PREFIX}API_KEY wins when both are set)",
    "hotload_api_headers": f"{ENV_PREFIX}HOTLOAD_API_HEADERS"}
_GROUP_HELP = (f"publish weights to a remote rollout fleet (fsdp_hotload); {ENV_PREFIX}* variables fill in the flags "
               "not given. The secrets are not flags (Megatron prints its arguments and saves them in checkpoints): "
               f"the API key comes from {SECRET_VARIABLES['api_key']}, the API headers from "
               f"{SECRET_VARIABLES['hotload_api_headers']}")


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
    if _is_list(name):  # Megatron's own list flags are space-separated (nargs='+'): both spellings are taken
        text += '; a JSON list, e.g. ["a", "b"], or values separated by spaces (a b)'
    elif hint := json_hint(field.annotation):
        text += "; " + hint
    if type(None) in members:  # written `null` on the command line, as in a variable
        text = re.sub(r"\bNone\b", "null", text)
    default = field.get_default(call_default_factory=True)
    if default is not PydanticUndefined and default not in (None, {}, []):
        text += f" (default: {default})"
    if field.annotation is bool:
        text += f"; {_negated(name)} or {flag_name(name)} false sets it false"
    return text.replace("%", "%%")


def _is_list(name: str) -> bool:
    """Whether ``name`` takes a list (and so several space-separated values)."""
    return "list" in json_hint(HotloadConfig.model_fields[name].annotation)


def _negated(name: str) -> str:
    return f"--no-{flag_name(name)[2:]}"


def add_hotload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per HotloadConfig field (in an argument group), help from the field description, with its
    choices and default; the secrets' flags are hidden and refuse any use, naming the variables to set."""
    group = parser.add_argument_group("hotload", _GROUP_HELP)
    for name, field in HotloadConfig.model_fields.items():
        dest = f"{PREFIX}_{name}"
        if name in SECRET_FIELDS:
            group.add_argument(*flag_names(name), dest=dest, action=RefuseSecret, variables=SECRET_VARIABLES[name])
        elif field.annotation is bool:
            group.add_argument(*flag_names(name), dest=dest, default=None, action=Switch, help=_help(name))
            group.add_argument(*(f"--no-{f[2:]}" for f in flag_names(name)), dest=dest, action=NegatedSwitch,
                               help=argparse.SUPPRESS)  # named in the positive flag's help
        elif _is_list(name):
            group.add_argument(*flag_names(name), dest=dest, default=None, action=ListSetting,
                               convert=_converter(name, field.annotation), help=_help(name))
        else:
            group.add_argument(*flag_names(name), dest=dest, default=None, action=StoreSetting,
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
    ``--hotload-storage-options`` are merged over those of ``HOTLOAD_STORAGE_OPTIONS``, and checked against the
    storage root as the storage layer will check them. Call it where Megatron's arguments are parsed: with
    Megatron Core 0.18 and later, on what ``parse_and_validate_args(extra_args_provider=add_hotload_args)``
    returns (their ``pretrain`` takes no ``extra_args_provider``); up to 0.17, ``config_from_args(get_args())``
    after ``initialize_megatron`` or in a provider that ``pretrain(..., extra_args_provider=add_hotload_args)``
    calls. Raises SystemExit naming the flags and variables at fault, a ``hotload_*`` attribute that no flag stores
    into (set by ``args_defaults`` or a launcher: it would be ignored) or a secret on the namespace; and ValueError
    when ``args`` has no hotload flags at all (the parser never had :func:`add_hotload_args`, or Megatron's
    ``--yaml-cfg`` replaced the arguments).
    """
    _check_namespace(args)
    if not hasattr(args, f"{PREFIX}_bucket_url"):
        raise ValueError("these arguments have no --hotload-* flags: pass megatron_hotload.add_hotload_args as "
                         "Megatron's extra_args_provider (to parse_and_validate_args from Megatron Core 0.18, to "
                         "pretrain or initialize_megatron before; with --yaml-cfg, set HOTLOAD_* variables and call "
                         "HotloadConfig.from_env() instead)")
    values = {name: getattr(args, f"{PREFIX}_{name}") for name in HotloadConfig.model_fields
              if getattr(args, f"{PREFIX}_{name}", None) is not None}
    values.update(dict.fromkeys(getattr(args, NULL_FIELDS, None) or [], None))
    if "bucket_url" not in values and ENV_PREFIX + "BUCKET_URL" not in os.environ:
        _check_publishing_off(values)
        return None
    try:
        cfg = HotloadConfig.from_env_under(values, name_of=_setting_name,
                                           source=f"--{PREFIX}-* flags and {ENV_PREFIX}* variables")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    _check_storage_options(cfg, flag_given="storage_options" in values)
    _check_fireworks_key(cfg)
    return cfg


def _check_namespace(args: argparse.Namespace) -> None:
    """SystemExit for a ``hotload_*`` attribute that no flag stores into, and for a secret on the namespace.

    Why: only the flags' own attributes are read, so one set another way (Megatron's ``args_defaults``, a launcher
    that builds the namespace) under another name was dropped without a word: ``hotload_api_url`` (the flag
    ``--hotload-api-url`` stores into ``hotload_hotload_api_url``) published without signalling the fleet. And a
    secret set there was taken, although Megatron prints the namespace and saves it in every checkpoint. The
    values are never shown. Attributes not starting with ``hotload_`` (Megatron's own) are not looked at.
    """
    dests = {f"{PREFIX}_{name}": name for name in HotloadConfig.model_fields}
    wrong: list[str] = []
    secrets: dict[str, str] = {}  # attribute: the secret field it holds
    for attr in sorted(vars(args)):
        if not attr.startswith(PREFIX + "_") or attr == NULL_FIELDS:
            continue
        field = _field_meant(attr, dests)
        if field in SECRET_FIELDS and getattr(args, attr) is not None:
            secrets[attr] = field
        elif attr not in dests:
            meant = "" if field is None or field in SECRET_FIELDS else \
                f" (did you mean {PREFIX}_{field}, which {flag_name(field)} stores into?)"
            wrong.append(attr + meant)
    if wrong:
        many = len(wrong) > 1
        raise SystemExit(f"unknown hotload argument{'s' if many else ''} {', '.join(wrong)}: only the attributes "
                         f"the --{PREFIX}-* flags store into ({PREFIX}_<field>) are read, so "
                         f"{'they' if many else 'it'} would be ignored; rename {'each' if many else 'it'} to the "
                         "attribute meant, or give the flag instead")
    if secrets:
        variables = " and ".join(dict.fromkeys(SECRET_VARIABLES[f] for f in secrets.values()))
        raise SystemExit(f"the arguments hold {' and '.join(secrets)} (the value not shown): a secret is not taken "
                         "from them, since Megatron prints its arguments and saves them in its checkpoints; remove "
                         f"{'them' if len(secrets) > 1 else 'it'} (from args_defaults, or wherever the namespace is "
                         f"built) and set {variables} instead")


def _field_meant(attr: str, dests: dict[str, str]) -> str | None:
    """The field a ``hotload_*`` attribute stands for: its own, a ``hotload_*`` field named with one ``hotload_``
    (``hotload_api_url``, as argparse would name ``--hotload-api-url``), or the closest field name."""
    field = dests.get(attr) or dests.get(f"{PREFIX}_{attr}") or dests.get(attr.replace(f"{PREFIX}_", "", 1))
    if field is None:
        close = difflib.get_close_matches(attr[len(PREFIX) + 1:], list(dests.values()), n=1)
        field = close[0] if close else None
    return field


def _check_storage_options(cfg: HotloadConfig, *, flag_given: bool) -> None:
    """SystemExit naming the flag or variable when the storage layer would refuse ``storage_options`` (a misspelt
    s3fs option, object-store options on a local root). Why here: the refusal came only when the storage opened,
    often at the first publishing step, naming the Python field. The backend's package is imported only for an
    object-store root with options (its keywords are what is checked), and on ``s3://`` the values botocore would
    trip over (a retry mode it does not know, a number as a JSON string, an endpoint given twice with two values).
    The storage is not opened here: s3fs's client looks up credentials when it is built (instance metadata, a
    container's endpoint, a ``credential_process``), on every rank, and a passing failure there is no setting's
    fault."""
    from fsdp_hotload.storage_errors import StorageError
    from fsdp_hotload.storage_paths import check_options

    try:
        check_options(cfg.bucket_url, cfg.storage_options)
    except (ValueError, StorageError) as exc:
        variable = f"{ENV_PREFIX}STORAGE_OPTIONS"
        names = [flag_name("storage_options")] if flag_given else []
        names += [variable] if variable in os.environ else []
        label = " merged over ".join(names) or "storage_options"
        raise SystemExit(f"invalid hotload setting {label}: {str(exc).replace('storage_options', 'options', 1)}") \
            from None


def _check_fireworks_key(cfg: HotloadConfig) -> None:
    """SystemExit naming FIREWORKS_API_KEY when the key this config would signal with cannot be sent (white
    space inside, a character outside printable ASCII): it failed only when the hot-load clients were built.
    ``HOTLOAD_API_KEY`` is the config's own ``api_key``, checked when the config is built. A missing key is not an
    error here: the ranks that do not signal may have none."""
    key = os.environ.get("FIREWORKS_API_KEY")
    if cfg.hotload_api_url and cfg.api_key is None and key:
        from fsdp_hotload.fireworks_names import clean_api_key

        try:
            clean_api_key(key, "$FIREWORKS_API_KEY")
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
