"""Tensor specs and the manifest that describes one rank's state as raw bytes.

Pure: numpy and the standard library only. A state is a flat, ordered mapping
``name -> array``; on the wire and on disk it is one byte buffer in which each
tensor sits at an aligned offset, plus this manifest (JSON) that says where,
with which dtype and shape, and with a CRC-32 per tensor.

CRC-32 (zlib) was chosen after measuring it against adler32, position-weighted
64-bit sums and plain row/column sums: faster than the first two, it releases the
GIL for large buffers, it catches every single flipped byte and every burst of
up to 32 bits, and swapped blocks with odds of 2^-32 of a miss, where row/column
sums miss equal-sum blocks swapped between rows; xxhash is not available
(measurements: benchmarks/results/measurements.md#manifest-checksum). A
snapshot's CRCs are computed when it is first used (``with_checksums`` via
``DualBuffer.lease``), not on every step: see ``snapshot``.

A rank of a sharded model (FSDP2, DTensor) holds only its local shards; its
manifest's shapes are the local shapes and ``meta["layout"]`` says how they sit
in the global tensors (``build_layout``, compared by ``layout_difference``)::

    {"meshes": [{"shape": [2], "dim_names": ["dp"], "coordinate": [0]}],
     "tensors": {"model/0.weight": {"mesh": 0, "placements": ["Shard(dim=0)"],
                                    "global_shape": [16, 8], "local_shape": [8, 8]}}}

Only sharded tensors have an entry; a state without any has no ``layout``.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import CheckpointCorruptError

FORMAT = "ftl-ckpt/1"
#: Offsets are multiples of this, so any dtype view of a tensor is aligned.
ALIGN = 64

#: dtype name -> numpy dtype used to hold its bytes. Types numpy lacks
#: (bfloat16, float8) are held as unsigned integers of the same width.
STORAGE_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(storage) for name, storage in {
        "float64": np.float64, "float32": np.float32, "float16": np.float16,
        "bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8,
        "complex64": np.complex64, "complex128": np.complex128,
        "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8,
        "uint64": np.uint64, "uint32": np.uint32, "uint16": np.uint16, "uint8": np.uint8,
        "bool": np.bool_,
    }.items()
}

Bytes = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class TensorDesc:
    """What a state source says about one tensor before it has a place.

    ``eager`` tensors change outside ``optimizer.step()`` (model buffers such as
    BatchNorm statistics, RNG states), so they are copied in the training thread
    when a snapshot starts, not in the background.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    eager: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * STORAGE_DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class TensorSpec:
    """One tensor's place in the state buffer; ``crc32`` is None until computed."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int | None = None

    def view(self, buffer: Bytes) -> npt.NDArray[Any]:
        """This tensor as a typed array over ``buffer`` (no copy)."""
        raw = buffer[self.offset:self.offset + self.nbytes]
        return raw.view(STORAGE_DTYPES[self.dtype]).reshape(self.shape)

    def raw(self, buffer: Bytes) -> Bytes:
        return buffer[self.offset:self.offset + self.nbytes]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "offset": self.offset, "nbytes": self.nbytes, "crc32": self.crc32}


@dataclass(frozen=True)
class Manifest:
    """One rank's state at one step: where each tensor lies, and its checksum.

    ``meta`` holds the small non-tensor parts (optimizer hyper-parameters,
    scheduler state, loader position) as JSON values.
    """

    step: int
    tensors: tuple[TensorSpec, ...]
    total_bytes: int
    rank: int = 0
    world_size: int = 1
    meta: Mapping[str, Any] = field(default_factory=dict)

    def spec(self, name: str) -> TensorSpec:
        for item in self.tensors:
            if item.name == name:
                return item
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(item.name for item in self.tensors)

    @property
    def checksummed(self) -> bool:
        """True when every tensor carries its CRC-32 (always so once it leaves the process)."""
        return all(item.crc32 is not None for item in self.tensors)

    def same_layout(self, other: Manifest) -> bool:
        """True when both place the same tensors at the same offsets."""
        return (self.total_bytes == other.total_bytes
                and [_layout_key(t) for t in self.tensors]
                == [_layout_key(t) for t in other.tensors])

    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "step": self.step, "rank": self.rank,
            "world_size": self.world_size, "total_bytes": self.total_bytes,
            "tensors": [t.to_json() for t in self.tensors], "meta": dict(self.meta),
        }, separators=(",", ":"))

    @staticmethod
    def from_json(text: str | bytes) -> Manifest:
        """Parse and validate; raises ``ManifestError`` naming what is wrong."""
        try:
            record = json.loads(text)
            manifest = Manifest(
                step=int(record["step"]), rank=int(record["rank"]),
                world_size=int(record["world_size"]),
                total_bytes=int(record["total_bytes"]), meta=dict(record["meta"]),
                tensors=tuple(_spec_from_json(t) for t in record["tensors"]))
            fmt = record["format"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ManifestError(f"unreadable checkpoint manifest: {exc!r}") from None
        problems = ([f"format {fmt!r} is not {FORMAT!r}"] if fmt != FORMAT else [])
        problems += validate(manifest)
        if problems:
            raise ManifestError("invalid checkpoint manifest: " + "; ".join(problems))
        return manifest


class ManifestError(CheckpointCorruptError):
    """A manifest that cannot be parsed or contradicts itself."""


def _layout_key(spec: TensorSpec) -> tuple[str, str, tuple[int, ...], int, int]:
    return (spec.name, spec.dtype, spec.shape, spec.offset, spec.nbytes)


def _spec_from_json(record: Mapping[str, Any]) -> TensorSpec:
    crc = record.get("crc32")
    return TensorSpec(name=str(record["name"]), dtype=str(record["dtype"]),
                      shape=tuple(int(d) for d in record["shape"]),
                      offset=int(record["offset"]), nbytes=int(record["nbytes"]),
                      crc32=None if crc is None else int(crc))


def aligned(offset: int, align: int = ALIGN) -> int:
    return -(-offset // align) * align


def plan_layout(descs: Iterable[TensorDesc], align: int = ALIGN
                ) -> tuple[tuple[TensorSpec, ...], int]:
    """Place tensors one after another at aligned offsets; returns (specs, total)."""
    specs: list[TensorSpec] = []
    offset = 0
    for desc in descs:
        if desc.dtype not in STORAGE_DTYPES:
            raise ValueError(f"tensor {desc.name!r} has unsupported dtype {desc.dtype!r}; "
                             f"supported: {', '.join(STORAGE_DTYPES)}")
        offset = aligned(offset, align)
        specs.append(TensorSpec(desc.name, desc.dtype, desc.shape, offset, desc.nbytes))
        offset += desc.nbytes
    return tuple(specs), aligned(offset, align)


def validate(manifest: Manifest) -> list[str]:
    """Everything wrong with a manifest, as readable sentences (empty if sound)."""
    problems: list[str] = []
    if manifest.step < 0:
        problems.append(f"step {manifest.step} is negative")
    if not 0 <= manifest.rank < max(manifest.world_size, 1):
        problems.append(f"rank {manifest.rank} outside world_size {manifest.world_size}")
    seen: set[str] = set()
    end = 0
    for spec in sorted(manifest.tensors, key=lambda t: t.offset):
        problems.extend(_spec_problems(spec, manifest.total_bytes, end, seen))
        seen.add(spec.name)
        end = spec.offset + spec.nbytes
    return problems + _layout_problems(manifest)


def _layout_problems(manifest: Manifest) -> list[str]:
    """A ``layout`` that cannot be read or names tensors the manifest lacks or
    holds in another shape."""
    try:
        shards = layout_shards(manifest.meta.get("layout"))
    except ManifestError as exc:
        return [exc.message]
    shapes = {spec.name: spec.shape for spec in manifest.tensors}
    return [f"layout of tensor {name!r} says local shape {list(info.local_shape)}, the "
            f"manifest {list(shapes[name]) if name in shapes else 'has no such tensor'}"
            for name, info in shards.items() if shapes.get(name) != info.local_shape]


def _spec_problems(spec: TensorSpec, total: int, previous_end: int,
                   seen: set[str]) -> list[str]:
    problems = []
    if spec.name in seen:
        problems.append(f"tensor {spec.name!r} appears twice")
    if spec.dtype not in STORAGE_DTYPES:
        return problems + [f"tensor {spec.name!r} has unknown dtype {spec.dtype!r}"]
    if any(d < 0 for d in spec.shape):
        problems.append(f"tensor {spec.name!r} has negative shape {spec.shape}")
    expected = math.prod(spec.shape) * STORAGE_DTYPES[spec.dtype].itemsize
    if spec.nbytes != expected:
        problems.append(f"tensor {spec.name!r} nbytes {spec.nbytes} != {expected} "
                        f"for shape {spec.shape} {spec.dtype}")
    if spec.offset < previous_end:
        problems.append(f"tensor {spec.name!r} at offset {spec.offset} overlaps the "
                        f"previous tensor ending at {previous_end}")
    if spec.offset + spec.nbytes > total:
        problems.append(f"tensor {spec.name!r} ends at {spec.offset + spec.nbytes} "
                        f"beyond total_bytes {total}")
    return problems


def checksum(data: Bytes | memoryview) -> int:
    return zlib.crc32(data.data if isinstance(data, np.ndarray) else data)


def with_checksums(specs: Sequence[TensorSpec], buffer: Bytes) -> tuple[TensorSpec, ...]:
    """``specs`` with the CRC-32 of each tensor's bytes in ``buffer`` (kept where present)."""
    return tuple(s if s.crc32 is not None else replace(s, crc32=checksum(s.raw(buffer)))
                 for s in specs)


def add_checksums(manifest: Manifest, buffer: Bytes) -> Manifest:
    """``manifest`` with every tensor's CRC-32 computed from ``buffer`` where missing."""
    if manifest.checksummed:
        return manifest
    return replace(manifest, tensors=with_checksums(manifest.tensors, buffer))


def corrupt_tensors(manifest: Manifest, buffer: Bytes) -> list[str]:
    """Names of tensors whose bytes in ``buffer`` do not match their checksum.

    A buffer shorter than the manifest says counts as corrupt (truncated).
    """
    if buffer.nbytes < manifest.total_bytes:
        return [f"buffer holds {buffer.nbytes} bytes, manifest needs {manifest.total_bytes}"]
    bad = []
    for spec in manifest.tensors:
        if spec.crc32 is None:
            bad.append(f"{spec.name} (no checksum)")
        elif checksum(spec.raw(buffer)) != spec.crc32:
            bad.append(spec.name)
    return bad


def nonfinite_tensors(manifest: Manifest, buffer: Bytes) -> list[str]:
    """Names of floating-point tensors holding NaN or infinity.

    A copy can be bit-exact and still useless: a peer that snapshotted after a
    silent data corruption serves NaN with valid checksums.
    """
    bad = []
    for spec in manifest.tensors:
        if _has_nonfinite(spec, buffer):
            bad.append(spec.name)
    return bad


_EXPONENT_MASKS = {"bfloat16": (np.uint16, 0x7F80), "float8_e5m2": (np.uint8, 0x7C)}


def _has_nonfinite(spec: TensorSpec, buffer: Bytes) -> bool:
    if spec.dtype in ("float64", "float32", "float16", "complex64", "complex128"):
        return not bool(np.isfinite(spec.view(buffer)).all())
    if spec.dtype in _EXPONENT_MASKS:
        storage, mask = _EXPONENT_MASKS[spec.dtype]
        bits = spec.raw(buffer).view(storage)
        return bool(((bits & storage(mask)) == storage(mask)).any())
    if spec.dtype == "float8_e4m3fn":  # only NaN exists: all exponent and mantissa bits set
        return bool(((spec.raw(buffer) & 0x7F) == 0x7F).any())
    return False


@dataclass(frozen=True)
class ShardInfo:
    """How one tensor of a rank's state is sharded (what ``layout`` records for it).

    ``placements`` are the placements' reprs (``"Shard(dim=0)"``, ``"Replicate()"``);
    ``coordinate`` is this rank's place in the mesh, so two ranks hold the same
    shard only if their coordinates agree too.
    """

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    coordinate: tuple[int, ...]
    placements: tuple[str, ...]
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]

    def same_shard(self, other: ShardInfo) -> bool:
        """True when both hold the same bytes of the same global tensor. Dimension
        names are labels only: a mesh named otherwise shards the same way."""
        return (self.mesh_shape, self.coordinate, self.placements, self.global_shape,
                self.local_shape) == (other.mesh_shape, other.coordinate, other.placements,
                                      other.global_shape, other.local_shape)

    def describe(self) -> str:
        return (f"{'/'.join(self.placements)} on mesh {list(self.mesh_shape)} at "
                f"{list(self.coordinate)} (global {list(self.global_shape)}, "
                f"local {list(self.local_shape)})")


Layout = dict[str, Any]


def build_layout(shards: Mapping[str, ShardInfo]) -> Layout:
    """The JSON ``layout`` of a state's sharded tensors (empty mappings if none)."""
    meshes: list[dict[str, Any]] = []
    tensors: dict[str, Any] = {}
    for name, info in shards.items():
        mesh = {"shape": list(info.mesh_shape), "coordinate": list(info.coordinate),
                "dim_names": None if info.mesh_dim_names is None else list(info.mesh_dim_names)}
        if mesh not in meshes:
            meshes.append(mesh)
        tensors[name] = {"mesh": meshes.index(mesh), "placements": list(info.placements),
                         "global_shape": list(info.global_shape),
                         "local_shape": list(info.local_shape)}
    return {"meshes": meshes, "tensors": tensors}


def layout_shards(layout: Mapping[str, Any] | None) -> dict[str, ShardInfo]:
    """The per-tensor view of a ``layout`` (None: a state with no sharded tensor)."""
    if not layout:
        return {}
    try:
        meshes = list(layout["meshes"])
        shards = {}
        for name, entry in dict(layout["tensors"]).items():
            mesh = meshes[int(entry["mesh"])]
            names = mesh.get("dim_names")
            shards[str(name)] = ShardInfo(
                mesh_shape=tuple(int(d) for d in mesh["shape"]),
                mesh_dim_names=None if names is None else tuple(str(n) for n in names),
                coordinate=tuple(int(c) for c in mesh["coordinate"]),
                placements=tuple(str(p) for p in entry["placements"]),
                global_shape=tuple(int(d) for d in entry["global_shape"]),
                local_shape=tuple(int(d) for d in entry["local_shape"]))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ManifestError(f"unreadable sharding layout in a checkpoint manifest: "
                            f"{exc!r}") from None
    return shards


def layout_difference(stored: Mapping[str, Any] | None, live: Mapping[str, Any] | None, *,
                      stored_shapes: Mapping[str, Sequence[int]] | None = None,
                      live_shapes: Mapping[str, Sequence[int]] | None = None) -> str | None:
    """The first tensor sharded differently in ``stored`` and ``live``, with both
    sides and both meshes, as a sentence; None if every tensor agrees. A tensor
    missing from one layout is plain (unsharded) there; ``*_shapes`` give the
    shapes of plain tensors, for the sentence only."""
    old, new = layout_shards(stored), layout_shards(live)
    for name in [*old, *(n for n in new if n not in old)]:
        before, after = old.get(name), new.get(name)
        if before is None or after is None or not before.same_shard(after):
            return (f"tensor {name!r} was saved {_shard_text(before, name, stored_shapes)} "
                    f"but is live {_shard_text(after, name, live_shapes)}; stored meshes: "
                    f"{_meshes_text(stored)}, live meshes: {_meshes_text(live)}")
    return None


def layout_digest(layout: Mapping[str, Any] | None) -> str:
    """A short fingerprint of what ``layout_difference`` compares, for ranks to
    exchange (rank r of one replica must match rank r of the one it catches up
    from: the coordinate is part of it)."""
    shards = layout_shards(layout)
    canonical = [[name, list(s.mesh_shape), list(s.coordinate), list(s.placements),
                  list(s.global_shape), list(s.local_shape)] for name, s in sorted(shards.items())]
    text = json.dumps(canonical, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _shard_text(info: ShardInfo | None, name: str,
                shapes: Mapping[str, Sequence[int]] | None) -> str:
    if info is not None:
        return info.describe()
    shape = (shapes or {}).get(name)
    return "plain (unsharded)" + ("" if shape is None else f" {list(shape)}")


def _meshes_text(layout: Mapping[str, Any] | None) -> str:
    meshes = list((layout or {}).get("meshes", []))
    if not meshes:
        return "none (unsharded)"
    return ", ".join(f"{list(m['shape'])}" + (f" ({', '.join(m['dim_names'])})"
                                              if m.get("dim_names") else "") for m in meshes)
