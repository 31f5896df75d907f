"""Address guard: which URLs a page fetch may open.

A fetched page can redirect anywhere, so every hop is checked: the scheme must be http(s)
and every address the host resolves to must be public (no loopback, private, link-local,
multicast, reserved or unspecified address) unless the user named the host with
``--allow-host HOST[:PORT]``. :func:`is_public_address` is a pure function over literal IPs
(unit-tested on its own); :func:`check_url` adds name resolution. The reader checks the
peer address of the actual connection again, so a name that resolves differently the
second time (DNS rebinding) is still caught before the body is read.

Example::

    python -c "from deepr.search.guard import is_public_address as p; print(p('10.0.0.1'))"
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit


class BlockedAddress(PermissionError):
    """A URL whose scheme or resolved address the guard refuses."""


def is_public_address(ip: str) -> bool:
    """True for a globally routable unicast address; False for anything internal or special."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address):
        mapped = addr.ipv4_mapped or addr.sixtofour
        if mapped is not None:
            return is_public_address(str(mapped))
    return not (addr.is_private or addr.is_loopback or addr.is_link_local or addr.is_multicast
                or addr.is_reserved or addr.is_unspecified or not addr.is_global)


def parse_allow(entries: Iterable[str]) -> set[tuple[str, int | None]]:
    """``--allow-host`` values as (lower-case host, port or None); a bad value raises ValueError."""
    out: set[tuple[str, int | None]] = set()
    for raw in entries:
        item = raw.strip().lower()
        host, port = item, None
        if item.startswith("["):  # [v6]:port
            host, _, rest = item[1:].partition("]")
            port = _port(rest[1:], raw) if rest.startswith(":") else None
        elif item.count(":") == 1:
            host, p = item.split(":")
            port = _port(p, raw)
        if not host:
            raise ValueError(f"--allow-host {raw!r}: expected HOST or HOST:PORT")
        out.add((host, port))
    return out


def _port(text: str, raw: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"--allow-host {raw!r}: port must be a number 1-65535")
    return int(text)


def host_allowed(host: str, port: int, allow: set[tuple[str, int | None]]) -> bool:
    host = host.lower().strip("[]")
    return (host, None) in allow or (host, port) in allow


def url_parts(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL; other schemes raise BlockedAddress."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise BlockedAddress(f"{url!r}: only http and https URLs are fetched, not {scheme or 'no scheme'!r}")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError as e:
        raise BlockedAddress(f"{url!r}: bad port ({e})") from None
    if not parts.hostname:
        raise BlockedAddress(f"{url!r}: no host")
    return scheme, parts.hostname, port


def check_address(ip: str, host: str, port: int, allow: set[tuple[str, int | None]]) -> None:
    """Raise BlockedAddress unless ``ip`` is public or the host is explicitly allowed."""
    if host_allowed(host, port, allow) or is_public_address(ip):
        return
    raise BlockedAddress(f"{host}:{port} resolves to the non-public address {ip}; "
                         f"pass --allow-host {host}:{port} to permit it")


def needs_resolution(url: str, allow: set[tuple[str, int | None]]) -> bool:
    """Whether :func:`check_url` would look a name up (so callers keep the cheap cases, a bad
    URL, an allowed host or an IP literal, off a worker thread); never raises."""
    try:
        _, host, port = url_parts(url)
    except BlockedAddress:
        return False
    if host_allowed(host, port, allow):
        return False
    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return True
    return False


def check_url(url: str, allow: set[tuple[str, int | None]]) -> None:
    """Check scheme and EVERY resolved address of ``url``'s host (before any request is sent)."""
    _, host, port = url_parts(url)
    if host_allowed(host, port, allow):
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise BlockedAddress(f"{host}: cannot resolve ({e})") from None
    for info in infos:
        check_address(str(info[4][0]), host, port, allow)
