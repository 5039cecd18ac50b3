"""The HTTP contract of the state server: routes, authentication, byte ranges.

Pure. State travels as raw tensor bytes (the snapshot buffer as it is) plus the
JSON manifest, never as pickles: a pickle from a peer could run code, and
torch.save -> HTTP -> torch.load was many times slower than the raw bytes
(measurements: benchmarks/results/measurements.md#state-wire-format).

Every request carries ``X-Ftl-Auth: <unix seconds>:<nonce>:<hex HMAC>``, keyed by
the per-job secret, so that another user on the cluster can neither read state
nor push a backup. The HMAC covers the method, the request target (so the
``?rank=`` and ``?step=``), the time, a random nonce and the body claim: for a
PUT its length, the manifest's length and the SHA-256 of the manifest and of
the tensor bytes (``BodyClaim``). A token is accepted for ``AUTH_WINDOW``
seconds either side of the server's clock, and once: the server keeps the
nonces it accepted until their tokens expire (``NonceCache``).

Why SHA-256 of the whole body rather than the manifest's CRC-32s: a CRC is no
MAC, and whoever holds a manifest can craft other bytes with the same CRC-32s
(four patched bytes per tensor). SHA-256 is fast enough for every push (SHA-NI;
hashlib releases the GIL): its hashing on each side, in the background sender
and the receiving handler thread, is a small part of the fetch timeout
(measurements: benchmarks/results/measurements.md#push-digest). The manifest
digest is separate so that the server can check the manifest, and the size it
claims, before allocating anything.
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import math
import re
import secrets
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from ft_launch.ids import sign, verify

AUTH_HEADER = "X-Ftl-Auth"
MANIFEST_BYTES_HEADER = "X-Ftl-Manifest-Bytes"
BODY_DIGEST_HEADER = "X-Ftl-Body-Sha256"
#: Seconds a token is valid either side of the server's clock. Cluster nodes run
#: NTP (skew of milliseconds); a client signs just before it sends.
AUTH_WINDOW = 30.0
#: Accepted nonces held at most; beyond it new tokens are refused (FLOODED), never
#: a live nonce forgotten. ~150 B each: ~10 MB; legitimate use is far below it.
NONCE_CAPACITY = 65_536
#: A manifest larger than this is refused before it is read.
MAX_MANIFEST_BYTES = 64 << 20
#: The longest ``?wait=`` a request may ask for (the server caps it lower still).
MAX_WAIT = 86_400.0
_DOMAIN = b"ftl-ckpt-http/2"


class AuthVerdict(enum.Enum):
    OK = "ok"
    MISSING = "no auth header"
    MALFORMED = "malformed auth header"
    EXPIRED = "auth token outside the time window"
    BAD_SIGNATURE = "auth token does not match the job secret"
    REPLAYED = "auth token already used"
    FLOODED = "too many requests inside the auth window"


class RouteError(ValueError):
    """A request target the server cannot serve; ``status`` is the HTTP reply."""

    status = 400


class NoRouteError(RouteError):
    status = 404


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
_BACKUP_KINDS = (RouteKind.BACKUP_MANIFEST, RouteKind.BACKUP_DATA, RouteKind.BACKUP_PUT)
_PARAMS = ("rank", "step", "wait")
# ASCII digits only, bounded: str.isdigit() and int() also take "²", "١" or 5,000 digits.
_UINT = re.compile(r"[0-9]{1,18}")
_SECONDS = re.compile(r"[0-9]{1,6}(?:\.[0-9]{1,9})?")


def target_for(route: Route) -> str:
    """The request target (path and query) that asks for ``route``."""
    wait = f"{min(route.wait, MAX_WAIT):.3f}" if route.wait > 0 else None
    query = {name: value for name, value in (("rank", route.rank), ("step", route.step),
                                              ("wait", wait))
             if value is not None}
    path = _PATH_OF[route.kind]
    return f"{path}?{urllib.parse.urlencode(query)}" if query else path


def method_for(route: Route) -> str:
    return "PUT" if route.kind is RouteKind.BACKUP_PUT else "GET"


def parse_target(method: str, target: str) -> Route:
    """The route a request asks for; ``RouteError`` (a ``ValueError``) with the reason."""
    parsed = urllib.parse.urlsplit(target)
    kind = _PATHS.get((method, parsed.path))
    if kind is None:
        raise NoRouteError(f"no route for {method} {parsed.path}")
    try:
        pairs = urllib.parse.parse_qsl(parsed.query, strict_parsing=bool(parsed.query),
                                       max_num_fields=len(_PARAMS))
    except ValueError as exc:
        raise RouteError(f"bad query {parsed.query[:100]!r}: {exc}") from None
    query = dict(pairs)
    unknown = set(query) - set(_PARAMS)
    if unknown or len(query) != len(pairs):
        raise RouteError(f"unknown or repeated query parameters in {parsed.query[:100]!r}; "
                         f"expected each of {', '.join(_PARAMS)} at most once")
    rank, step = _uint_param(query, "rank"), _uint_param(query, "step")
    if kind in _BACKUP_KINDS and rank is None:
        raise RouteError(f"{kind.value} needs ?rank=")
    if kind is RouteKind.BACKUP_PUT and step is None:
        raise RouteError(f"{kind.value} needs ?step= (the step of the manifest it carries)")
    return Route(kind, rank, step, _wait_param(query))


def _uint_param(query: Mapping[str, str], name: str) -> int | None:
    if name not in query:
        return None
    if not _UINT.fullmatch(query[name]):
        raise RouteError(f"?{name}={query[name][:40]!r} is not a non-negative integer "
                         f"of at most 18 digits")
    return int(query[name])


def _wait_param(query: Mapping[str, str]) -> float:
    text = query.get("wait", "0")
    wait = float(text) if _SECONDS.fullmatch(text) else math.nan
    if not 0.0 <= wait <= MAX_WAIT:  # also false for NaN
        raise RouteError(f"?wait={text[:40]!r} is not a number of seconds from 0 to "
                         f"{MAX_WAIT:g}")
    return wait


@dataclass(frozen=True)
class BodyClaim:
    """What a token says about the request body, so that no other body can use it.

    ``length`` is the Content-Length; a backup body is the manifest
    (``manifest_bytes`` long) followed by the tensor bytes.
    """

    length: int = 0
    manifest_bytes: int = 0
    manifest_sha256: str = ""
    data_sha256: str = ""

    @staticmethod
    def of_backup(manifest: bytes, data: memoryview) -> BodyClaim:
        return BodyClaim(len(manifest) + data.nbytes, len(manifest),
                         hashlib.sha256(manifest).hexdigest(), hashlib.sha256(data).hexdigest())

    def headers(self) -> dict[str, str]:
        if self == NO_BODY:
            return {}
        return {"Content-Length": str(self.length),
                MANIFEST_BYTES_HEADER: str(self.manifest_bytes),
                BODY_DIGEST_HEADER: f"{self.manifest_sha256}:{self.data_sha256}"}

    def parts(self) -> tuple[bytes, ...]:
        return (str(self.length).encode(), str(self.manifest_bytes).encode(),
                self.manifest_sha256.encode(), self.data_sha256.encode())


NO_BODY = BodyClaim()
_LENGTH = re.compile(r"[0-9]{1,15}")
_DIGESTS = re.compile(r"([0-9a-f]{64}):([0-9a-f]{64})")


def parse_body_claim(method: str, headers: Mapping[str, str]) -> BodyClaim:
    """The claim a request's headers make; ``ValueError`` when they are malformed.

    A GET has no body; a PUT names its length, its manifest's length and both digests.
    """
    length = headers.get("Content-Length")
    if method != "PUT":
        if length not in (None, "0") or BODY_DIGEST_HEADER in headers:
            raise ValueError(f"a {method} request carries no body")
        return NO_BODY
    manifest_bytes = headers.get(MANIFEST_BYTES_HEADER, "")
    digests = _DIGESTS.fullmatch(headers.get(BODY_DIGEST_HEADER, ""))
    if length is None or not _LENGTH.fullmatch(length) or not _LENGTH.fullmatch(manifest_bytes) \
            or digests is None:
        raise ValueError(f"a PUT needs Content-Length, {MANIFEST_BYTES_HEADER} and "
                         f"{BODY_DIGEST_HEADER} (<manifest sha256>:<data sha256>)")
    return BodyClaim(int(length), int(manifest_bytes), digests.group(1), digests.group(2))


def auth_token(secret: str, method: str, target: str, now: float, *,
               body: BodyClaim = NO_BODY, nonce: str | None = None) -> str:
    stamp = str(int(now))
    nonce = secrets.token_hex(16) if nonce is None else nonce
    mac = sign(secret, *_signed_parts(method, target, stamp, nonce, body))
    return f"{stamp}:{nonce}:{mac.hex()}"


def _signed_parts(method: str, target: str, stamp: str, nonce: str,
                  body: BodyClaim) -> tuple[bytes, ...]:
    return (_DOMAIN, method.encode(), target.encode(), stamp.encode(), nonce.encode(),
            *body.parts())


_TOKEN = re.compile(r"([0-9]{1,12}):([0-9a-f]{32}):([0-9a-f]{64})")


def check_token(secret: str, method: str, target: str, token: str | None,
                now: float, *, body: BodyClaim = NO_BODY, window: float = AUTH_WINDOW,
                seen: NonceCache | None = None) -> AuthVerdict:
    """Whether ``token`` authorises this request; with ``seen``, only its first use."""
    if not token:
        return AuthVerdict.MISSING
    match = _TOKEN.fullmatch(token)
    if match is None:
        return AuthVerdict.MALFORMED
    stamp, nonce, mac_hex = match.groups()
    if not abs(now - int(stamp)) <= window:
        return AuthVerdict.EXPIRED
    if not verify(secret, bytes.fromhex(mac_hex),
                  *_signed_parts(method, target, stamp, nonce, body)):
        return AuthVerdict.BAD_SIGNATURE
    # Only now, with the signature checked, may a nonce take memory.
    return AuthVerdict.OK if seen is None else seen.admit(nonce, int(stamp) + window, now)


class NonceCache:
    """Nonces of accepted tokens that have not expired yet: each token works once.

    Memory is bounded twice over: a nonce is dropped once its token has expired
    (so the window bounds the set), and at most ``capacity`` are held; when full,
    new tokens are refused rather than a live nonce forgotten, which would make
    its token replayable. Only tokens with a valid signature get here.
    """

    def __init__(self, capacity: int = NONCE_CAPACITY) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._expiry: list[tuple[float, str]] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def admit(self, nonce: str, expires: float, now: float) -> AuthVerdict:
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._live.discard(heapq.heappop(self._expiry)[1])
            if nonce in self._live:
                return AuthVerdict.REPLAYED
            if len(self._live) >= self.capacity:
                return AuthVerdict.FLOODED
            self._live.add(nonce)
            heapq.heappush(self._expiry, (expires, nonce))
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
