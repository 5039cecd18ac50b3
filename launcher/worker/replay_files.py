"""The files of a dual-phase replay (torch-free: the controller writes and reads them).

Everything lives under ``<run_dir>/replay/``:

* ``servers/replica-R.json``: where each rank of replica R serves its snapshots.
  Rank 0 writes it when its ``Manager`` starts; the controller reads it to capture
  a healthy replica's state (``ft_launch.launcher.controller.sdc_replay``).
* ``<id>/state/rank-K.manifest`` and ``rank-K.bin``: that captured state, one step
  of every rank's shard, pinned for the whole replay (a training replica moves on
  and its snapshot buffers with it). Read back CRC-checked.
* ``<id>/spec.json``: what the replay processes do (``FTL_WORKER_REPLAY`` names it).
* ``<id>/results/<group>/rank-K.json``: each replay rank's digest of its reduced
  gradient shard and how many of its values were NaN/Inf.

Every reader bounds what it reads and names the file, the field and what was
expected when a file is not what it should be; every writer writes atomically.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from ft_launch.ckpt.manifest import Bytes, Manifest, ManifestError, corrupt_tensors
from ft_launch.errors import FatalError
from ft_launch.files import atomic_write_bytes, atomic_write_text

REPLAY_DIR = "replay"
SERVERS_DIR = "servers"
#: Small JSON records (spec, result, servers) are far below this; more is not ours.
MAX_RECORD_BYTES = 1 << 20
#: A manifest lists every tensor of a rank's shard: thousands of entries at most.
MAX_MANIFEST_BYTES = 64 << 20
#: Labels and ids become file names: keep them to plain characters.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

Address = tuple[str, int]


class ReplayFileError(FatalError):
    """A replay file is missing, unreadable, or not what it should be."""


def replay_dir(run_dir: Path) -> Path:
    return run_dir / REPLAY_DIR


# --------------------------------------------------------------------------- reading


def _read_bounded(path: Path, limit: int) -> bytes:
    try:
        with path.open("rb") as handle:
            data = handle.read(limit + 1)
    except OSError as error:
        raise ReplayFileError(f"{path}: cannot read it ({error})") from None
    if len(data) > limit:
        raise ReplayFileError(f"{path}: longer than {limit} bytes, not a replay file")
    return data


def _read_record(path: Path, what: str) -> Mapping[str, Any]:
    try:
        record = json.loads(_read_bounded(path, MAX_RECORD_BYTES))
    except ValueError as error:
        raise ReplayFileError(f"{path}: not JSON ({error}); expected {what}") from None
    if not isinstance(record, dict):
        raise ReplayFileError(f"{path}: expected a JSON object ({what})")
    return record


def _field(record: Mapping[str, Any], key: str, kind: type, path: Path) -> Any:
    value = record.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ReplayFileError(f"{path}: field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _name(value: str, key: str, path: Path) -> str:
    return check_name(value, f"{path}: field {key!r}")


def check_name(value: str, what: str) -> str:
    """A label or id that becomes a file name: plain characters only."""
    if not _NAME.fullmatch(value):
        raise ReplayFileError(f"{what} must be 1-64 letters, digits, '_', '.' or '-', "
                              f"got {value!r}")
    return value


# --------------------------------------------------------------------------- servers


def servers_file(run_dir: Path, replica_id: int) -> Path:
    return replay_dir(run_dir) / SERVERS_DIR / f"replica-{replica_id}.json"


def publish_state_servers(run_dir: Path, replica_id: int, job_id: str,
                          addresses: Sequence[Address]) -> Path:
    """Where every rank of this replica serves its snapshots (rank 0, at start; not
    fsynced: it matters only while the replica lives)."""
    record = {"replica_id": replica_id, "job_id": job_id,
              "state": [[host, port] for host, port in addresses]}
    return atomic_write_text(servers_file(run_dir, replica_id), json.dumps(record) + "\n",
                             durable=False)


def read_state_servers(run_dir: Path, replica_id: int, job_id: str) -> tuple[Address, ...]:
    path = servers_file(run_dir, replica_id)
    record = _read_record(path, '{"replica_id", "job_id", "state": [[host, port], ...]}')
    if record.get("replica_id") != replica_id or record.get("job_id") != job_id:
        raise ReplayFileError(f"{path}: written for replica {record.get('replica_id')!r} of "
                              f"job {record.get('job_id')!r}, not replica {replica_id} of "
                              f"job {job_id!r}")
    state = _field(record, "state", list, path)
    try:
        addresses = tuple((str(host), int(port)) for host, port in state)
    except (TypeError, ValueError):
        raise ReplayFileError(f"{path}: field 'state' must list [host, port] pairs, "
                              f"got {state!r}") from None
    if not addresses:
        raise ReplayFileError(f"{path}: field 'state' lists no rank")
    return addresses


# --------------------------------------------------------------------------- captured state


def state_files(state_dir: Path, rank: int) -> tuple[Path, Path]:
    return state_dir / f"rank-{rank}.manifest", state_dir / f"rank-{rank}.bin"


def save_captured(state_dir: Path, rank: int, manifest: Manifest, buffer: Bytes) -> None:
    """One rank's captured state: its bytes first, then the manifest that makes it
    count (a reader finds both or no manifest)."""
    manifest_path, data_path = state_files(state_dir, rank)
    view = buffer.reshape(-1).data[:manifest.total_bytes]
    atomic_write_bytes(data_path, cast(bytes, view), durable=False)
    atomic_write_text(manifest_path, manifest.to_json(), durable=False)


def load_captured(state_dir: Path, rank: int) -> tuple[Manifest, Bytes]:
    """One rank's captured state, every tensor's CRC-32 checked."""
    manifest_path, data_path = state_files(state_dir, rank)
    try:
        manifest = Manifest.from_json(_read_bounded(manifest_path, MAX_MANIFEST_BYTES))
    except ManifestError as error:
        raise ReplayFileError(f"{manifest_path}: {error}") from None
    try:
        size = data_path.stat().st_size
        if size != manifest.total_bytes:
            raise ReplayFileError(f"{data_path}: holds {size} bytes, its manifest says "
                                  f"{manifest.total_bytes}")
        buffer = np.fromfile(data_path, dtype=np.uint8)
    except OSError as error:
        raise ReplayFileError(f"{data_path}: cannot read it ({error})") from None
    bad = corrupt_tensors(manifest, buffer)
    if bad:
        raise ReplayFileError(f"{data_path}: fails its checksums ({', '.join(bad[:5])})")
    return manifest, buffer


# --------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class ReplaySpec:
    """What every replay process of one replay does: load the captured ``step`` of
    rank K from ``state_dir``, run step ``step + 1`` on replica ``replica_id``'s data
    stream, and write its digest into ``results_dir/<group>/rank-K.json``."""

    replay_id: str
    replica_id: int
    step: int
    ranks: int
    state_dir: str
    results_dir: str

    def result_file(self, group: str, rank: int) -> Path:
        return Path(self.results_dir) / group / f"rank-{rank}.json"


def spec_file(run_dir: Path, replay_id: str) -> Path:
    return replay_dir(run_dir) / replay_id / "spec.json"


def write_spec(path: Path, spec: ReplaySpec) -> Path:
    return atomic_write_text(path, json.dumps(asdict(spec), indent=1) + "\n", durable=False)


def read_spec(path: Path) -> ReplaySpec:
    record = _read_record(path, "a replay spec written by ft-launch run")
    spec = ReplaySpec(
        replay_id=_name(_field(record, "replay_id", str, path), "replay_id", path),
        replica_id=_field(record, "replica_id", int, path),
        step=_field(record, "step", int, path), ranks=_field(record, "ranks", int, path),
        state_dir=_field(record, "state_dir", str, path),
        results_dir=_field(record, "results_dir", str, path))
    if spec.step < 0 or spec.ranks < 1 or spec.replica_id < 0:
        raise ReplayFileError(f"{path}: step and replica_id must be >= 0 and ranks >= 1 "
                              f"(got step {spec.step}, replica_id {spec.replica_id}, "
                              f"ranks {spec.ranks})")
    return spec


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class RankDigest:
    """One replay rank's reduced gradient shard of the replayed step."""

    group: str
    rank: int
    node: str
    step: int               # the step replayed (the captured one + 1)
    digest: str             # SHA-256 of the shard's bytes, reduction by reduction
    nonfinite: int          # its values that were NaN/Inf (0: all finite)
    reductions: int         # how many reductions the digest covers


def write_result(spec: ReplaySpec, result: RankDigest) -> Path:
    return atomic_write_text(spec.result_file(result.group, result.rank),
                             json.dumps(asdict(result)) + "\n", durable=False)


def read_result(path: Path) -> RankDigest:
    record = _read_record(path, "a replay rank's digest")
    result = RankDigest(group=_name(_field(record, "group", str, path), "group", path),
                        rank=_field(record, "rank", int, path),
                        node=_field(record, "node", str, path),
                        step=_field(record, "step", int, path),
                        digest=_field(record, "digest", str, path),
                        nonfinite=_field(record, "nonfinite", int, path),
                        reductions=_field(record, "reductions", int, path))
    if not re.fullmatch(r"[0-9a-f]{64}", result.digest) or result.nonfinite < 0:
        raise ReplayFileError(f"{path}: field 'digest' must be 64 hex digits and "
                              f"'nonfinite' >= 0")
    return result
