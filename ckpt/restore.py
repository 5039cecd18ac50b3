"""Restore chain: own memory -> backup peer -> local disk -> persistent store.

Every tier lists the steps it holds; the newest step wins, and among copies of
the same step the nearer tier is tried first. A copy is used only after its
checksums verify and its floating-point tensors are finite; a corrupt,
truncated or NaN-carrying copy is skipped with its reason logged, and the next
candidate is tried. The ordering and the common-step choice are pure.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ft_launch.config import CkptConfig
from ft_launch.errors import FtError
from ft_launch.events import Event, EventLog

from .dual import DualBuffer
from .errors import NoCheckpointError
from .fetch import Peer, fetch_manifest, fetch_state
from .held import HeldCopy
from .manifest import Bytes, Manifest, corrupt_tensors, nonfinite_tensors
from .persist import PersistentStore
from .wire import Route, RouteKind

log = logging.getLogger(__name__)
_DEFAULTS = CkptConfig()


class TierKind(enum.Enum):
    MEMORY = "memory"
    PEER = "backup peer"
    LOCAL_DISK = "local disk"
    PERSISTENT = "persistent store"


#: Nearest first: the order copies of the same step are tried in.
TIER_ORDER = (TierKind.MEMORY, TierKind.PEER, TierKind.LOCAL_DISK, TierKind.PERSISTENT)


@dataclass(frozen=True)
class Candidate:
    tier: TierKind
    step: int


@dataclass(frozen=True)
class Restored:
    """A verified state and where it came from; ``skipped`` says what was passed over."""

    manifest: Manifest
    buffer: Bytes
    tier: TierKind
    skipped: tuple[str, ...] = ()

    @property
    def step(self) -> int:
        return self.manifest.step


@dataclass(frozen=True)
class CheckpointRestored(Event):
    rank: int
    step: int
    tier: str
    skipped: list[str] = field(default_factory=list)


class Tier(Protocol):
    kind: TierKind

    def steps(self) -> list[int]:
        """Steps this tier holds a copy of (cheap: no data read)."""
        ...

    def load(self, step: int, buffer: Bytes | None = None) -> tuple[Manifest, Bytes]:
        """The copy of ``step``, into ``buffer`` if it is large enough; may raise ``FtError``."""
        ...


# ---------------------------------------------------------------------- pure decisions


def order_candidates(candidates: Sequence[Candidate], step: int | None = None
                     ) -> list[Candidate]:
    """Newest step first; for equal steps, nearest tier first; only ``step`` if given."""
    chosen = [c for c in candidates if step is None or c.step == step]
    return sorted(chosen, key=lambda c: (-c.step, TIER_ORDER.index(c.tier)))


def newest_common_step(steps_by_rank: Mapping[int, Collection[int]]) -> int:
    """The newest step every rank can restore, so that all ranks load the same one."""
    if not steps_by_rank:
        raise NoCheckpointError("no ranks reported checkpoints")
    common = set.intersection(*(set(steps) for steps in steps_by_rank.values()))
    if not common:
        reasons = tuple(f"rank {r}: steps {sorted(s)[-5:]}"
                        for r, s in sorted(steps_by_rank.items()))
        raise NoCheckpointError("no step is held for every rank", reasons=reasons)
    return max(common)


def problems_with(manifest: Manifest, buffer: Bytes, check_finite: bool) -> list[str]:
    """Why a copy must not be loaded (empty when it is sound)."""
    bad = corrupt_tensors(manifest, buffer)
    if bad:
        return [f"checksum mismatch in {', '.join(bad[:5])}"]
    if check_finite:
        nonfinite = nonfinite_tensors(manifest, buffer)
        if nonfinite:
            return [f"NaN/Inf in {', '.join(nonfinite[:5])}"]
    return []


# ---------------------------------------------------------------------- tiers


class MemoryTier:
    """This process's own snapshots (after an in-process restart).

    The lease supplies the checksums: kept from the snapshot's first use (or
    from the copy, with eager checksums), else computed now from the snapshot,
    so that the copy handed out is verified against the bytes it came from.
    """

    kind = TierKind.MEMORY

    def __init__(self, snapshots: DualBuffer) -> None:
        self.snapshots = snapshots

    def steps(self) -> list[int]:
        return self.snapshots.complete_steps()

    def load(self, step: int, buffer: Bytes | None = None) -> tuple[Manifest, Bytes]:
        with self.snapshots.lease(step) as snap:
            total = snap.manifest.total_bytes
            if buffer is None or buffer.nbytes < total:
                return snap.manifest, snap.buffer.copy()
            np.copyto(buffer[:total], snap.buffer)
            return snap.manifest, buffer


@dataclass(frozen=True)
class PeerCopy:
    """A backup of global rank ``source`` that the state server at ``peer`` holds, of
    ``step`` (None: whichever is newest there, asked for when listed)."""

    peer: Peer
    source: int
    step: int | None = None


class PeerTier:
    """Backups of this rank's shard held by other ranks' state servers: its own backup
    rank's, or the copies a replica's ranks found on their nodes after a restart.

    Any replica's copy of the same shard will do: every replica holds the same
    state (FT-HSDP), and the chain checks the copy's shard and step anyway."""

    kind = TierKind.PEER

    def __init__(self, copies: Sequence[PeerCopy], secret: str, *,
                 timeout: float = _DEFAULTS.fetch_timeout) -> None:
        self.copies = tuple(copies)
        self._secret = secret
        self._timeout = timeout

    @staticmethod
    def of(peer: Peer, secret: str, *, rank: int,
           timeout: float = _DEFAULTS.fetch_timeout) -> PeerTier:
        """The backup of global rank ``rank`` held by its backup rank ``peer``."""
        return PeerTier([PeerCopy(peer, rank)], secret, timeout=timeout)

    def steps(self) -> list[int]:
        known = {c.step for c in self.copies if c.step is not None}
        errors: list[FtError] = []
        for copy in (c for c in self.copies if c.step is None):
            try:
                known.add(self._newest(copy).step)
            except FtError as exc:
                errors.append(exc)
        if errors and not known:
            raise errors[0]
        return sorted(known)

    def load(self, step: int, buffer: Bytes | None = None) -> tuple[Manifest, Bytes]:
        failures = []
        for copy in self.copies:
            if copy.step not in (None, step):
                continue
            try:
                fetched = fetch_state(copy.peer, self._secret, step=step, backup_of=copy.source,
                                      timeout=self._timeout, buffer=buffer)
            except FtError as exc:
                failures.append(f"{copy.peer} (backup of rank {copy.source}): {exc}")
                continue
            return fetched.manifest, fetched.buffer
        raise NoCheckpointError(f"no backup peer gave step {step}", reasons=tuple(failures))

    def _newest(self, copy: PeerCopy) -> Manifest:
        route = Route(RouteKind.BACKUP_MANIFEST, copy.source)
        return fetch_manifest(copy.peer, self._secret, route, self._timeout)


def peer_copies(gathered: Sequence[tuple[str, Peer, Sequence[HeldCopy]]], shard: int
                ) -> list[PeerCopy]:
    """The copies of ``shard`` that a replica's ranks found on their nodes.

    ``gathered``: per rank, in rank order, (its node, its state server, the copies
    held on its node). Ranks on one node list the same files: the first of them
    serves them. Pure.
    """
    seen: set[tuple[str, int, int]] = set()
    copies = []
    for node, server, held in gathered:
        for copy in sorted(held, key=lambda c: (-c.step, c.source)):
            key = (node, copy.source, copy.step)
            if copy.shard == shard and key not in seen:
                seen.add(key)
                copies.append(PeerCopy(server, copy.source, copy.step))
    return copies


class DiskTier:
    """A ``PersistentStore``: node-local disk or the shared persistent store."""

    def __init__(self, store: PersistentStore, kind: TierKind) -> None:
        self.store = store
        self.kind = kind

    def steps(self) -> list[int]:
        return self.store.complete_steps()

    def load(self, step: int, buffer: Bytes | None = None) -> tuple[Manifest, Bytes]:
        return self.store.load(step, buffer)


# ---------------------------------------------------------------------- the chain


class RestoreChain:
    """Try the tiers' copies newest first and return the first sound one."""

    def __init__(self, tiers: Sequence[Tier], *, rank: int,
                 check_finite: bool = _DEFAULTS.check_finite,
                 events: EventLog | None = None) -> None:
        self.tiers = {tier.kind: tier for tier in tiers}
        self.rank = rank
        self.check_finite = check_finite
        self.events = events

    def available(self) -> tuple[list[Candidate], list[str]]:
        """Every (tier, step) listed, and why a tier could not list its copies."""
        candidates: list[Candidate] = []
        reasons: list[str] = []
        for kind in TIER_ORDER:
            tier = self.tiers.get(kind)
            if tier is None:
                continue
            try:
                candidates.extend(Candidate(kind, step) for step in tier.steps())
            except (FtError, OSError) as exc:
                reasons.append(self._skip(kind, None, exc))
        return candidates, reasons

    def restore(self, step: int | None = None, buffer: Bytes | None = None) -> Restored:
        """The newest sound copy (of ``step`` if given); ``NoCheckpointError`` if none.

        ``buffer``: preallocated memory to restore into (fresh memory costs page
        faults, slow at first touch: measurements:
        benchmarks/results/measurements.md#restore-first-touch).
        """
        candidates, skipped = self.available()
        for candidate in order_candidates(candidates, step):
            try:
                manifest, buffer = self.tiers[candidate.tier].load(candidate.step, buffer)
            except (FtError, OSError) as exc:
                skipped.append(self._skip(candidate.tier, candidate.step, exc))
                continue
            problems = self._problems(candidate, manifest, buffer)
            if problems:
                skipped.append(self._skip(candidate.tier, candidate.step, problems))
                continue
            return self._restored(candidate, manifest, buffer, skipped)
        wanted = f" of step {step}" if step is not None else ""
        raise NoCheckpointError(f"no sound checkpoint{wanted} in any tier",
                                reasons=tuple(skipped), rank=self.rank)

    def _problems(self, candidate: Candidate, manifest: Manifest, buffer: Bytes) -> str:
        if manifest.step != candidate.step or manifest.rank != self.rank:
            return (f"copy is step {manifest.step} of rank {manifest.rank}, wanted step "
                    f"{candidate.step} of rank {self.rank}")
        return "; ".join(problems_with(manifest, buffer, self.check_finite))

    def _skip(self, kind: TierKind, step: int | None, reason: object) -> str:
        text = f"{kind.value}" + (f" step {step}" if step is not None else "") + f": {reason}"
        log.warning("restore of rank %d skipped %s", self.rank, text)
        return text

    def _restored(self, candidate: Candidate, manifest: Manifest, buffer: Bytes,
                  skipped: list[str]) -> Restored:
        log.info("rank %d restored step %d from %s", self.rank, candidate.step,
                 candidate.tier.value)
        if self.events is not None:
            self.events.emit(CheckpointRestored(rank=self.rank, step=candidate.step,
                                                tier=candidate.tier.value,
                                                skipped=list(skipped)))
        return Restored(manifest, np.asarray(buffer), candidate.tier, tuple(skipped))

