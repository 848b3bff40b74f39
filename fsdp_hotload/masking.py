"""Masking of credentials in values that get printed: option dicts, header dicts and URLs.

Why a module of its own: the config's repr and JSON form, the Megatron flag check, the hot-load client's URL
errors and the storage layer's messages all need the same rule, and one rule in one place cannot drift between
them. It imports nothing heavy, so the HTTP client (standard library only) can use it too.

Example::

    mask_secrets({"key": "AKIA...", "client_kwargs": {"endpoint_url": "https://u:pw@minio:9000"}})
    # {'key': '**********', 'client_kwargs': {'endpoint_url': 'https://**********@minio:9000'}}
    mask_url("https://h/x?X-Amz-Signature=abc&part=1")   # 'https://h/x?X-Amz-Signature=**********&part=1'
"""
from __future__ import annotations

import re
import urllib.parse
from typing import Any

__all__ = ["MASK", "SECRET_NAME", "is_secret_name", "mask_secrets", "mask_text", "mask_url", "url_has_credentials"]

MASK = "**********"

#: Option, header and query parameter names whose values are credentials: s3fs ``key``/``secret``/``token``,
#: botocore's ``aws_access_key_id``/``aws_secret_access_key``/``aws_session_token``, an SSE-C ``SSECustomerKey``,
#: gcsfs ``token`` dicts, sftp's ``passphrase`` and ``pkey``, ``Authorization``/``Cookie``/``X-Api-Key`` headers,
#: basic ``auth`` pairs, presigned
#: URLs' ``X-Amz-Signature``/``X-Amz-Credential``/``sig``. Names such as ``signature_version`` or
#: ``SSEKMSKeyId`` (settings, not secrets) do not match, so a flag that sets them is not refused.
SECRET_NAME = re.compile(
    r"secret|token|passw(or)?d|passphrase|credential|authoriz|cookie|connection_?string|(^|[^a-z])auth([^a-z]|$)"
    r"|(^|[^a-z])(sig|signature)$|key$|access_?key_?id$",
    re.IGNORECASE)
# scheme://userinfo@ (the userinfo ends at the authority's last '@', as urllib reads it), or scheme://user:password@
# where the password holds '/', '?' or '#' (about half of AWS secret keys hold a '/'), which urllib would cut short
# but a secret all the same: a user (no '/', '?', '#', '@' or ':'), a ':', then anything up to the last '@'. A path
# with a ':' and an '@' in it (s3://bucket/a:b@c) has a '/' before its ':', so it is not read as one.
_USERINFO = re.compile(r"^(\s*[A-Za-z][A-Za-z0-9+.-]*://)([^/?#@:\s]*:\S*|[^/?#]*)@")
# a URL inside free text, which ends at white space or a quote; punctuation after it is the sentence's
_TEXT_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")
_TRAILING = ").,;:]}"
# Azure's fsspec URLs name the container there (abfs://container@account.dfs.core.windows.net/path): no secret
# unless a password follows it
_CONTAINER_SCHEMES = frozenset({"abfs://", "abfss://", "az://", "wasb://", "wasbs://"})
# gcsfs's ``token`` modes, which name how to find credentials rather than holding any
_TOKEN_MODES = frozenset({"anon", "google_default", "cache", "cloud", "browser"})


def is_secret_name(name: object) -> bool:
    return isinstance(name, str) and SECRET_NAME.search(name) is not None


def _is_credential(m: re.Match[str]) -> bool:
    return m.group(1).lower() not in _CONTAINER_SCHEMES or ":" in m.group(2)


def _masked(m: re.Match[str]) -> str:
    return f"{m.group(1)}{MASK}@" if _is_credential(m) else m.group(0)


def url_has_credentials(text: str) -> bool:
    """Whether ``text`` is a URL with a ``user:password@`` (or ``token@``) part, in any link of an fsspec chain
    (``simplecache::sftp://user:pw@host/path``); an Azure URL's ``container@`` is not one."""
    return any((m := _USERINFO.match(link)) is not None and _is_credential(m) for link in text.split("::"))


def mask_url(text: str) -> str:
    """``text`` with a URL's userinfo and the values of credential-named query parameters masked, in each link of
    an fsspec chain; other text is returned as it is. Why: an endpoint, proxy or presigned URL is printed whole in
    reprs and error messages."""
    if "::" in text:
        return "::".join(map(mask_url, text.split("::")))
    masked = _USERINFO.sub(_masked, text, count=1)
    if "?" not in masked or "://" not in masked:
        return masked
    head, _, rest = masked.partition("?")
    query, hash_, fragment = rest.partition("#")
    params = []
    for item in query.split("&"):
        name, eq, _value = item.partition("=")
        params.append(f"{name}={MASK}" if eq and is_secret_name(urllib.parse.unquote_plus(name)) else item)
    return f"{head}?{'&'.join(params)}{hash_}{fragment}"


def mask_text(text: str) -> str:
    """Free text (an exception's message) with every URL in it passed through :func:`mask_url`. Why: botocore
    and others quote the URL they were given whole in their error messages: an endpoint's ``user:password@``,
    or a presigned URL's ``X-Amz-Signature``."""
    def one(m: re.Match[str]) -> str:
        url = m.group(0)
        core = url.rstrip(_TRAILING)
        return mask_url(core) + url[len(core):]

    return _TEXT_URL.sub(one, text)


def _is_secret_entry(name: object, value: Any) -> bool:
    if value is None or not is_secret_name(name):
        return False
    return not (name == "token" and isinstance(value, str) and value in _TOKEN_MODES)


def mask_secrets(value: Any) -> Any:
    """``value`` with every credential-named entry of a nested dict masked (see :data:`SECRET_NAME`; a gcsfs
    ``token`` mode such as ``"anon"`` is not a credential), and every string that is a URL passed through
    :func:`mask_url`."""
    if isinstance(value, dict):
        return {k: MASK if _is_secret_entry(k, v) else mask_secrets(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask_secrets(v) for v in value)
    if isinstance(value, str):
        return mask_url(value)
    return value
