"""Which proxy a hot-load request goes through, and the CONNECT tunnel an ``https://`` API is reached by.

Kept apart from :mod:`fsdp_hotload.fireworks_http` (one exchange on the wire): these are the rules the environment
sets, read as ``curl`` and ``requests`` read them (``HTTPS_PROXY`` / ``HTTP_PROXY`` by scheme, then an
``http://`` ``ALL_PROXY``; ``NO_PROXY`` by host suffix, IP address or CIDR block), and what a proxy's refusal
means for the user.

Example::

    proxy = proxy_for(urllib.parse.urlsplit("https://api.fireworks.ai"))   # None: connect directly
    sock = open_tunnel(proxy, "api.fireworks.ai", 443, opener)              # raises ProxyRefused on 407/403
"""
from __future__ import annotations

import base64
import http.client
import ipaddress
import os
import socket
import logging
import urllib.parse
from collections.abc import Callable

from .masking import mask_url

log = logging.getLogger("fsdp_hotload")

#: The environment variables read for each scheme, first found wins (lower case first, as urllib and curl do).
_PROXY_VARS = {"https": ("https_proxy", "HTTPS_PROXY"), "http": ("http_proxy", "HTTP_PROXY")}
_ALL_VARS = ("all_proxy", "ALL_PROXY")
_NO_PROXY_VARS = ("no_proxy", "NO_PROXY")
#: A proxy's answers to CONNECT that no retry changes: credentials missing or refused, the host not allowed.
REFUSING_STATUS = frozenset({403, 407})


class ProxyUnsupported(ValueError):
    """The environment names a proxy the client cannot use (not ``http://``)."""


class ProxyRefused(ConnectionError):
    """The proxy refused to open a tunnel (407: credentials; 403: the API's host is not allowed): the request
    never left the proxy, and retrying cannot change the answer. ``proxy`` is the proxy's URL, masked."""

    def __init__(self, status: int, reason: str, proxy: str) -> None:
        super().__init__(f"the proxy {proxy} refused the tunnel: HTTP {status} {reason}".rstrip())
        self.status = status
        self.proxy = proxy


def _env(names: tuple[str, ...]) -> tuple[str, str] | None:
    """The first of ``names`` set to a non-blank value, with that value."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return None


def _host_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]").partition("%")[0])
    except ValueError:
        return None


def bypasses_proxy(host: str, port: int | None, no_proxy: str) -> bool:
    """Whether ``NO_PROXY`` (``no_proxy``, comma or space separated) names ``host``, as curl and requests read it:
    ``*``; a name that equals the host or is a domain suffix of it (a leading dot optional); an IP address or a
    CIDR block holding the host's address (IPv6 with or without brackets); any of these with ``:port``, which
    must then match ``port``. Why not ``urllib.request.proxy_bypass``: it matches text suffixes only, so a
    cluster's ``NO_PROXY=10.0.0.0/8`` or a bare IPv6 address sent a private gateway's traffic to the proxy."""
    host = host.strip("[]").rstrip(".").lower()
    address = _host_literal(host)
    for entry in no_proxy.replace(",", " ").split():
        entry = entry.lower()
        if entry == "*":
            return True
        entry_port: int | None = None
        if entry.startswith("["):  # [v6]:port or [v6]
            bracketed, _, rest = entry[1:].partition("]")
            entry, entry_port = bracketed, int(rest[1:]) if rest[1:].isdigit() else None
        elif entry.count(":") == 1:  # name:port or v4:port (a bare IPv6 address has several colons)
            name, _, number = entry.partition(":")
            entry, entry_port = name, int(number) if number.isdigit() else None
        if entry_port is not None and entry_port != port:
            continue
        if address is not None:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:  # not an address: a name, matched below (never against a literal)
                pass
            continue
        entry = entry.lstrip(".").rstrip(".")
        if entry and (host == entry or host.endswith("." + entry)):
            return True
    return False


def proxy_for(base: urllib.parse.SplitResult) -> urllib.parse.SplitResult | None:
    """The proxy a request to ``base`` goes through, as ``curl`` and ``requests`` choose it (boto, the snapshot
    uploads, alike but for ``ALL_PROXY``): ``HTTPS_PROXY`` / ``HTTP_PROXY`` by the URL's scheme, else an
    ``http://`` ``ALL_PROXY`` (see :func:`_all_proxy`), unless ``NO_PROXY`` names
    the host (see :func:`bypasses_proxy`); None for a direct connection (always for a loopback host, which a proxy
    cannot reach). Why: on clusters whose outbound traffic must pass a proxy, the uploads went through it and every
    signal failed to resolve the API's host. Only an ``http://`` proxy is supported (a TLS connection to the proxy
    itself is not), which is what such variables name almost always."""
    found = _env(_PROXY_VARS.get(base.scheme, ())) or _all_proxy()
    host = base.hostname or ""
    if found is None or _is_loopback(host):
        return None
    no_proxy = _env(_NO_PROXY_VARS)
    if no_proxy is not None and bypasses_proxy(host, base.port or (443 if base.scheme == "https" else 80),
                                               no_proxy[1]):
        return None
    name, url = found
    proxy = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if proxy.scheme != "http" or not proxy.hostname:
        raise ProxyUnsupported(f"the proxy set in {name} ({mask_url(url)}) is not supported: the hot-load client "
                               "reaches the API through an http:// proxy only")
    try:
        proxy.port  # noqa: B018 - read for its check: a port that is no number, or past 65535
    except ValueError:
        raise ProxyUnsupported(f"the proxy set in {name} ({mask_url(url)}) has no valid port: give it as "
                               "http://host:port, the port a number up to 65535") from None
    return proxy


_told_all_proxy: set[str] = set()


def _all_proxy() -> tuple[str, str] | None:
    """``ALL_PROXY`` where it names an ``http://`` proxy (or one without a scheme); None otherwise. Why not refuse
    a SOCKS one, as a scheme's own variable is: dev images and VPN tools often set ``ALL_PROXY=socks5h://...``
    alone, which the uploads (boto reads the scheme's variable only) ignore, so the signals go direct as well,
    said once at INFO."""
    found = _env(_ALL_VARS)
    if found is None:
        return None
    name, url = found
    scheme = url.partition("://")[0].lower() if "://" in url else "http"
    if scheme == "http":
        return found
    if url not in _told_all_proxy:
        _told_all_proxy.add(url)
        log.info("hotload: %s names a %s proxy (%s), which the hot-load client cannot use: it connects directly",
                 name, scheme, mask_url(url))
    return None


def proxy_shown(base: urllib.parse.SplitResult) -> str | None:
    """The masked URL of the proxy a request to ``base`` goes through (None for none, or one not supported): for
    error messages, which must say that an answer may be the proxy's."""
    try:
        proxy = proxy_for(base)
    except ProxyUnsupported:
        return None
    return None if proxy is None else mask_url(urllib.parse.urlunsplit(proxy))


def _is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    address = _host_literal(host)
    return address is not None and address.is_loopback


def proxy_auth(proxy: urllib.parse.SplitResult) -> dict[str, str]:
    """A ``Proxy-Authorization`` header from the proxy URL's ``user:password@`` part (percent-decoded)."""
    if proxy.username is None:
        return {}
    pair = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
    return {"Proxy-Authorization": "Basic " + base64.b64encode(pair.encode()).decode("ascii")}


def open_tunnel(proxy: urllib.parse.SplitResult, host: str, port: int,
                opener: Callable[[tuple[str, int]], socket.socket]) -> socket.socket:
    """A socket through ``proxy`` to ``host:port`` (``opener`` connects to the proxy), ready for TLS.

    Why not ``http.client``'s ``set_tunnel``: its failure is an ``OSError`` whose status is only in the text, so a
    proxy's 407 or 403 was retried for the whole budget like a passing 502, and on Python 3.10/3.11 it writes an
    IPv6 host unbracketed (``CONNECT 2001:db8::1:443``), which a proxy misreads. Raises :class:`ProxyRefused` for a
    403 or 407, ``OSError`` for any other refusal (a 502 from a proxy whose upstream is down is worth a retry)."""
    shown = mask_url(urllib.parse.urlunsplit(proxy))
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    sock = opener((proxy.hostname or "", proxy.port or 80))
    try:
        head = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in proxy_auth(proxy).items())
        sock.sendall(head.encode("ascii") + b"\r\n")
        # The proxy sends nothing after its header section until the client speaks TLS, so this buffered read
        # takes nothing that belongs to the tunnel.
        resp = http.client.HTTPResponse(sock, method="CONNECT")
        try:
            resp.begin()
        finally:
            resp.close()  # the file over the socket, not the socket
        if resp.status in REFUSING_STATUS:
            raise ProxyRefused(resp.status, resp.reason, shown)
        if resp.status != 200:
            raise OSError(f"the proxy {shown} could not open a tunnel to {authority}: HTTP {resp.status} "
                          f"{resp.reason}".rstrip())
    except BaseException:
        sock.close()
        raise
    return sock


def refusal_hint(status: int, base: urllib.parse.SplitResult) -> str:
    """What to do about a proxy's 407 or 403 for a request to ``base``."""
    var = "HTTPS_PROXY" if base.scheme == "https" else "HTTP_PROXY"
    if status == 407:
        return f"the proxy asks for credentials: give them in the proxy URL, {var}=http://user:password@host:port " \
            f"(percent-encode '@' and ':' in them), or name the API's host ({base.hostname}) in NO_PROXY if it is " \
            "reachable directly"
    return f"the proxy does not allow this host: {_allow(base)}"


def _allow(base: urllib.parse.SplitResult) -> str:
    var = "HTTPS_PROXY" if base.scheme == "https" else "HTTP_PROXY"
    return f"ask for the API's host ({base.hostname}) to be allowed, use another proxy ({var}), or name the host " \
        "in NO_PROXY if it is reachable directly"


def unreachable_hint(base: urllib.parse.SplitResult) -> str | None:
    """What to check when no answer came through the proxy a request to ``base`` uses (None: no proxy)."""
    shown = proxy_shown(base)
    if shown is None:
        return None
    return f"check that the proxy {shown} (HTTPS_PROXY, HTTP_PROXY or ALL_PROXY) resolves, is reachable from this " \
        "host and reaches base_url (hotload_api_url), or name the API's host in NO_PROXY if it is reachable directly"


def proxy_answer(status: int, base: urllib.parse.SplitResult) -> tuple[str, str] | None:
    """For a 403 or 407 that a request to ``base`` through a proxy got: a note for the error's message, and what
    to do. None without a proxy, or for another status. Why: a plain-HTTP request goes to the proxy whole, so its
    refusal arrives as an answer, and a proxy's 403 was explained as the API key lacking permission."""
    shown = proxy_shown(base)
    if shown is None or status not in REFUSING_STATUS:
        return None
    note = f" (through the proxy {shown}: the {status} may be the proxy's)"
    if status == 407:
        return note, refusal_hint(407, base)
    return note, f"if the proxy sent it, {_allow(base)}; if the API did, the key may not be allowed this account " \
        "or deployment: check account_id, deployment_id and the key's account"
