"""Fireworks resource names and the API key, as the hot-load client builds and checks them.

Kept apart from the HTTP client so the rules that turn user input into a request (which account, which
deployment, which key) read on their own and are tested directly.

Example::

    deployment_name("acme", "rl-rollouts")   # ('accounts/acme/deployments/rl-rollouts', 'acme', 'rl-rollouts')
    model_name("acme", "my-sft-8b")          # 'accounts/acme/models/my-sft-8b' (a model of the account)
    model_name("acme", "accounts/fireworks/models/qwen3-8b")   # a public base model, as given
    key = Secret(clean_api_key(os.environ["FIREWORKS_API_KEY"], "FIREWORKS_API_KEY"))
    repr(key)                                # '<redacted>'
"""
from __future__ import annotations

import re

__all__ = ["API_KEY_ENV", "Secret", "clean_api_key", "clean_headers", "deployment_name", "model_name"]

API_KEY_ENV = "FIREWORKS_API_KEY"
_MODEL_RE = re.compile(r"accounts/([^/]+)/models/([^/]+)")
_DEPLOYMENT_RE = re.compile(r"accounts/([^/]+)/deployments/([^/]+)")
# One segment of a resource name. Fireworks ids are lowercase letters, digits and '-' (``qwen3-8b``,
# ``llama-v3p1-8b-instruct``); upper case, '.' and '_' are let through for gateways and emulators that allow more.
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class Secret:
    """Holds the API key; its repr never shows it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "<redacted>"

    __str__ = __repr__


def _describe_char(c: str) -> str:
    if c in "\r\n":
        return "a line break"
    if c.isspace():
        return "whitespace"
    if ord(c) < 0x20 or ord(c) == 0x7F:
        return "a control character"
    return "a non-ASCII character"


def clean_api_key(value: object, source: str) -> str:
    """The key as it goes into the ``Authorization`` header.

    Keys read from secret files often end in a newline, so surrounding whitespace is stripped. Anything left
    outside printable ASCII cannot be sent in a header (``http.client`` would raise an error quoting the whole
    header, key included) and is most likely a paste or encoding accident, so it is refused here with a message
    that names where the key came from and never shows it.
    """
    if not isinstance(value, str):
        raise TypeError(f"the Fireworks API key from {source} must be a string, not {type(value).__name__}")
    key = value.strip()
    if not key:
        raise ValueError(f"the Fireworks API key from {source} is empty: set {API_KEY_ENV} (or pass api_key=)")
    for i, c in enumerate(key):
        if not "\x21" <= c <= "\x7e":
            raise ValueError(
                f"the Fireworks API key from {source} contains {_describe_char(c)} at position {i} (of {len(key)}); "
                "an API key must be printable ASCII without spaces (the key is not shown)"
            )
    return key


_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP header name (RFC 9110 token)


def clean_headers(headers: object, source: str) -> dict[str, str]:
    """Extra request headers as they are sent: names checked, values stripped of surrounding whitespace.

    Why: a value read from a secret file often ends in a newline, and ``http.client`` then raises an error that
    quotes the whole header, secret included, into logs and metrics. So every value must be printable ASCII
    (spaces and tabs inside are allowed), and a bad one is refused naming the header, never showing its value.
    """
    if not isinstance(headers, dict):
        raise TypeError(f"{source} must be a dict of header name to value, not {type(headers).__name__}")
    out: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not _TOKEN.match(name):
            raise ValueError(f"{source}: {name!r} is not a valid HTTP header name")
        if not isinstance(value, str):
            raise ValueError(f"{source}[{name!r}] must be a string, not {type(value).__name__}")
        text = value.strip()
        for i, c in enumerate(text):
            if not ("\x20" <= c <= "\x7e" or c == "\t"):
                raise ValueError(f"{source}[{name!r}] contains {_describe_char(c)} at position {i} (of {len(text)}); "
                                 "a header value must be printable ASCII (the value is not shown)")
        out[name] = text
    return out


def _segment(value: str, what: str, full: str = "") -> str:
    """One id of a resource name, checked. Why so strict: the ids go into a URL path and into headers as they
    are, so a '?', '#' or space would address another resource or make a request that cannot be sent (which
    used to be found only at the first request, blamed on the headers, or polled until the timeout)."""
    if not isinstance(value, str) or not value or "/" in value:
        alt = f" or {full!r}" if full else ""
        raise ValueError(f"{what} must be a non-empty name without '/'{alt}, got {value!r}")
    if not _ID_RE.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a Fireworks resource id: use letters, digits, '-', '.' and '_', "
                         "starting with a letter or digit")
    return value


def _text(value: object, what: str) -> str:
    """``value`` if it is a string; a call made without the config (which types the ids) may pass an int."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__} {value!r}")
    return value


def deployment_name(account_id: str, deployment_id: str) -> tuple[str, str, str]:
    """(resource name, account, deployment); ``deployment_id`` may already be ``accounts/<a>/deployments/<d>``."""
    account_id, deployment_id = _text(account_id, "account_id"), _text(deployment_id, "deployment_id")
    account = _segment(account_id.removeprefix("accounts/"), "account_id")
    if deployment_id.startswith("accounts/"):
        m = _DEPLOYMENT_RE.fullmatch(deployment_id)
        if not m:
            raise ValueError(f"deployment_id {deployment_id!r} must be a name or 'accounts/<acct>/deployments/<id>'")
        if m.group(1) != account:
            raise ValueError(f"deployment_id {deployment_id!r} belongs to account {m.group(1)!r}, not {account!r}")
        return deployment_id, account, _segment(m.group(2), "the deployment in deployment_id")
    dep = _segment(deployment_id, "deployment_id", "accounts/<acct>/deployments/<id>")
    return f"accounts/{account}/deployments/{dep}", account, dep


def model_name(account: str, model_id: str) -> str:
    model_id = _text(model_id, "model_id")
    if model_id.startswith("accounts/"):
        m = _MODEL_RE.fullmatch(model_id)
        if not m:
            raise ValueError(f"model_id {model_id!r} must be a name or 'accounts/<acct>/models/<model>'")
        _segment(m.group(1), "the account in model_id")
        _segment(m.group(2), "the model in model_id")
        return model_id
    return f"accounts/{account}/models/{_segment(model_id, 'model_id', 'accounts/<acct>/models/<model>')}"
