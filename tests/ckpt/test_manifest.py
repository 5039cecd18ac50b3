"""Manifest, layout and checksums (pure)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ft_launch.ckpt.manifest import (
    ALIGN,
    Manifest,
    ManifestError,
    TensorDesc,
    corrupt_tensors,
    nonfinite_tensors,
    plan_layout,
    validate,
    with_checksums,
)

from .helpers import make_arrays


def _manifest_and_buffer(step: int = 3) -> tuple[Manifest, np.ndarray]:
    arrays = make_arrays(step)
    specs, total = plan_layout(TensorDesc(n, a.dtype.name, a.shape) for n, a in arrays.items())
    buffer = np.zeros(total, dtype=np.uint8)
    for spec, array in zip(specs, arrays.values(), strict=True):
        spec.view(buffer)[...] = array
    return Manifest(step, with_checksums(specs, buffer), total, meta={"k": [1, 2]}), buffer


def test_layout_is_aligned_ordered_and_sized():
    specs, total = plan_layout([TensorDesc("a", "float32", (3,)), TensorDesc("b", "bfloat16", (5, 2)),
                                TensorDesc("c", "bool", ())])
    assert [s.offset % ALIGN for s in specs] == [0, 0, 0]
    assert [s.nbytes for s in specs] == [12, 20, 1]
    assert specs[0].offset < specs[1].offset < specs[2].offset
    assert total >= specs[-1].offset + specs[-1].nbytes and total % ALIGN == 0


def test_unsupported_dtype_is_refused_with_the_list():
    with pytest.raises(ValueError, match="supported: float64"):
        plan_layout([TensorDesc("x", "object", (1,))])


def test_json_round_trip_keeps_everything():
    manifest, _ = _manifest_and_buffer()
    again = Manifest.from_json(manifest.to_json())
    assert again == dataclasses.replace(manifest, meta={"k": [1, 2]})
    assert again.same_layout(manifest)


@pytest.mark.parametrize("change, message", [
    (lambda r: r["tensors"][1].update(offset=0), "overlaps"),
    (lambda r: r["tensors"][0].update(nbytes=3), "nbytes"),
    (lambda r: r["tensors"][0].update(dtype="float99"), "unknown dtype"),
    (lambda r: r.update(total_bytes=10), "beyond total_bytes"),
    (lambda r: r["tensors"][1].update(name=r["tensors"][0]["name"]), "appears twice"),
    (lambda r: r.update(format="other/9"), "format"),
    (lambda r: r.pop("tensors"), "unreadable"),
])
def test_invalid_manifests_are_refused_with_the_reason(change, message):
    manifest, _ = _manifest_and_buffer()
    record = json.loads(manifest.to_json())
    change(record)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(json.dumps(record))


def test_sound_manifest_validates_clean():
    manifest, _ = _manifest_and_buffer()
    assert validate(manifest) == []


def test_checksums_catch_a_flipped_byte_anywhere():
    manifest, buffer = _manifest_and_buffer()
    assert corrupt_tensors(manifest, buffer) == []
    for spec in manifest.tensors:
        if spec.nbytes == 0:
            continue
        for position in (spec.offset, spec.offset + spec.nbytes // 2,
                         spec.offset + spec.nbytes - 1):
            flipped = buffer.copy()
            flipped[position] ^= 0x01
            assert corrupt_tensors(manifest, flipped) == [spec.name]


def test_truncated_buffer_counts_as_corrupt():
    manifest, buffer = _manifest_and_buffer()
    problems = corrupt_tensors(manifest, buffer[:-100])
    assert problems and "bytes" in problems[0]


def test_nonfinite_values_are_named():
    specs, total = plan_layout([TensorDesc("f", "float32", (4,)), TensorDesc("h", "bfloat16", (2,)),
                                TensorDesc("i", "int32", (2,))])
    buffer = np.zeros(total, dtype=np.uint8)
    manifest = Manifest(1, specs, total)
    assert nonfinite_tensors(manifest, buffer) == []
    specs[0].view(buffer)[2] = np.nan
    specs[1].view(buffer)[1] = 0x7FC0  # bfloat16 NaN
    specs[2].view(buffer)[:] = -1  # all ones bits are a fine integer
    assert nonfinite_tensors(manifest, buffer) == ["f", "h"]
