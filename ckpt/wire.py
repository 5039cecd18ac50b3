"""The HTTP contract of the state server: routes, authentication, byte ranges.

Pure. State travels as raw tensor bytes (the snapshot buffer as it is) plus the
JSON manifest, never as pickles: a pickle from a peer could run code, and
torch.save -> HTTP -> torch.load took ~10 s for 1.5 GB here against ~0.5 s raw.

Every request carries ``X-Ftl-Auth: <unix seconds>:<hex HMAC>`` over the method,
the request target and the time, keyed by the per-job secret, so that another
user on the cluster can neither read state nor push a backup. A token is
accepted for ``AUTH_WINDOW`` seconds either side of the server's clock.
"""

from __future__ import annotations

import enum
import re
import urllib.parse
from dataclasses import dataclass

from ftcore.ids import sign, verify

AUTH_HEADER = "X-Ftl-Auth"
MANIFEST_BYTES_HEADER = "X-Ftl-Manifest-Bytes"
AUTH_WINDOW = 300.0
#: A manifest larger than this is refused before it is read.
MAX_MANIFEST_BYTES = 64 << 20
_DOMAIN = b"ftl-ckpt-http/1"


class AuthVerdict(enum.Enum):
    OK = "ok"
    MISSING = "no auth header"
    MALFORMED = "malformed auth header"
    EXPIRED = "auth token outside the time window"
    BAD_SIGNATURE = "auth token does not match the job secret"


class RouteKind(enum.Enum):
    STATE_MANIFEST = "state manifest"
    STATE_DATA = "state data"
    BACKUP_MANIFEST = "backup manifest"
    BACKUP_DATA = "backup data"
    BACKUP_PUT = "backup put"


@dataclass(frozen=True)
class Route:
    """A parsed request: what is asked for, whose backup, which step, how long to wait."""

    kind: RouteKind
    rank: int | None = None
    step: int | None = None
    wait: float = 0.0


_PATHS = {
    ("GET", "/v1/state/manifest"): RouteKind.STATE_MANIFEST,
    ("GET", "/v1/state/data"): RouteKind.STATE_DATA,
    ("GET", "/v1/backup/manifest"): RouteKind.BACKUP_MANIFEST,
    ("GET", "/v1/backup/data"): RouteKind.BACKUP_DATA,
    ("PUT", "/v1/backup/data"): RouteKind.BACKUP_PUT,
}
_PATH_OF = {kind: path for (_method, path), kind in _PATHS.items()}


def target_for(route: Route) -> str:
    """The request target (path and query) that asks for ``route``."""
    query = {name: value for name, value in (("rank", route.rank), ("step", route.step),
                                              ("wait", route.wait or None))
             if value is not None}
    path = _PATH_OF[route.kind]
    return f"{path}?{urllib.parse.urlencode(query)}" if query else path


def method_for(route: Route) -> str:
    return "PUT" if route.kind is RouteKind.BACKUP_PUT else "GET"


def parse_target(method: str, target: str) -> Route:
    """The route a request asks for; ``ValueError`` with the reason if none."""
    parsed = urllib.parse.urlsplit(target)
    kind = _PATHS.get((method, parsed.path))
    if kind is None:
        raise ValueError(f"no route for {method} {parsed.path}")
    query = urllib.parse.parse_qs(parsed.query, strict_parsing=bool(parsed.query))
    unknown = set(query) - {"rank", "step", "wait"}
    if unknown:
        raise ValueError(f"unknown query parameters {sorted(unknown)}")
    rank = _int_param(query, "rank")
    if kind in (RouteKind.BACKUP_MANIFEST, RouteKind.BACKUP_DATA, RouteKind.BACKUP_PUT) \
            and rank is None:
        raise ValueError(f"{kind.value} needs ?rank=")
    wait = float(query["wait"][0]) if "wait" in query else 0.0
    return Route(kind, rank, _int_param(query, "step"), max(wait, 0.0))


def _int_param(query: dict[str, list[str]], name: str) -> int | None:
    return int(query[name][0]) if name in query else None


def auth_token(secret: str, method: str, target: str, now: float) -> str:
    stamp = str(int(now))
    mac = sign(secret, _DOMAIN, method.encode(), target.encode(), stamp.encode())
    return f"{stamp}:{mac.hex()}"


def check_token(secret: str, method: str, target: str, token: str | None,
                now: float, window: float = AUTH_WINDOW) -> AuthVerdict:
    if not token:
        return AuthVerdict.MISSING
    stamp, sep, mac_hex = token.partition(":")
    if not sep or not stamp.isdigit():
        return AuthVerdict.MALFORMED
    try:
        mac = bytes.fromhex(mac_hex)
    except ValueError:
        return AuthVerdict.MALFORMED
    if abs(now - int(stamp)) > window:
        return AuthVerdict.EXPIRED
    if not verify(secret, mac, _DOMAIN, method.encode(), target.encode(), stamp.encode()):
        return AuthVerdict.BAD_SIGNATURE
    return AuthVerdict.OK


_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def parse_range(header: str | None, total: int) -> tuple[int, int]:
    """``[start, end)`` asked by a ``Range`` header (whole body when absent)."""
    if header is None:
        return 0, total
    match = _RANGE.match(header.strip())
    if match is None:
        raise ValueError(f"unsupported Range {header!r}; expected bytes=START-END")
    start = int(match.group(1))
    end = int(match.group(2)) + 1 if match.group(2) else total
    if not start < end <= total:
        raise ValueError(f"Range {header!r} outside 0..{total}")
    return start, end


def range_header(start: int, end: int) -> str:
    return f"bytes={start}-{end - 1}"


def split_ranges(total: int, parts: int, align: int = 1 << 20) -> list[tuple[int, int]]:
    """Cut ``[0, total)`` into at most ``parts`` contiguous aligned pieces."""
    size = -(-total // max(parts, 1))
    size = -(-size // align) * align
    return [(start, min(start + size, total)) for start in range(0, total, max(size, 1))]
