"""The sharding layout of a manifest: built, read back, compared (pure)."""

from __future__ import annotations

import json

import pytest

from ft_launch.ckpt.manifest import (
    ManifestError,
    ShardInfo,
    build_layout,
    layout_difference,
    layout_digest,
    layout_shards,
)


def _shard(coordinate: int = 0, placement: str = "Shard(dim=0)", local: int = 8,
           mesh: tuple[int, ...] = (2,), names: tuple[str, ...] | None = ("dp",)) -> ShardInfo:
    return ShardInfo(mesh_shape=mesh, mesh_dim_names=names, coordinate=(coordinate,),
                     placements=(placement,), global_shape=(16, 4), local_shape=(local, 4))


def _layout(**shards: ShardInfo) -> dict:
    return build_layout({f"model/{name}": info for name, info in shards.items()})


def test_a_layout_is_json_and_reads_back_as_it_was_built():
    shards = {"model/w": _shard(), "optim/state/0/exp_avg": _shard()}
    layout = build_layout(shards)
    assert layout["meshes"] == [{"shape": [2], "coordinate": [0], "dim_names": ["dp"]}]
    assert layout["tensors"]["model/w"] == {"mesh": 0, "placements": ["Shard(dim=0)"],
                                            "global_shape": [16, 4], "local_shape": [8, 4]}
    assert layout_shards(json.loads(json.dumps(layout))) == shards
    assert build_layout({}) == {"meshes": [], "tensors": {}}
    assert layout_shards(None) == {} and layout_shards({}) == {}


def test_equal_layouts_agree_whatever_the_mesh_dimensions_are_called():
    assert layout_difference(_layout(w=_shard()), _layout(w=_shard(names=("fsdp",)))) is None
    assert layout_difference(None, {}) is None
    assert layout_digest(_layout(w=_shard())) == layout_digest(_layout(w=_shard(names=None)))


@pytest.mark.parametrize("live, expected", [
    (_shard(placement="Shard(dim=1)", local=16),
     ("live Shard(dim=1) on mesh [2] at [0] (global [16, 4], local [16, 4])")),
    (_shard(coordinate=1), "live Shard(dim=0) on mesh [2] at [1]"),
    (_shard(mesh=(1, 2), names=None), "live meshes: [1, 2]"),
    (_shard(local=4, mesh=(4,)), "local [4, 4]); stored meshes: [2] (dp), live meshes: [4] (dp)"),
])
def test_any_difference_of_a_tensor_is_named_with_both_sides(live, expected):
    difference = layout_difference(_layout(w=_shard()), _layout(w=live))
    assert difference is not None and expected in difference
    assert difference.startswith("tensor 'model/w' was saved Shard(dim=0) on mesh [2] at [0] "
                                 "(global [16, 4], local [8, 4]) but is live")
    assert layout_digest(_layout(w=_shard())) != layout_digest(_layout(w=live))


def test_plain_against_sharded_either_way_names_the_plain_shape():
    sharded = _layout(w=_shard())
    assert layout_difference(None, sharded, stored_shapes={"model/w": (16, 4)}) == (
        "tensor 'model/w' was saved plain (unsharded) [16, 4] but is live Shard(dim=0) on mesh "
        "[2] at [0] (global [16, 4], local [8, 4]); stored meshes: none (unsharded), live "
        "meshes: [2] (dp)")
    into_plain = layout_difference(sharded, {})
    assert into_plain is not None and "but is live plain (unsharded);" in into_plain
    # The first differing tensor in stored order, then any live-only one.
    two = _layout(a=_shard(), b=_shard())
    assert "'model/b'" in (layout_difference(two, _layout(a=_shard())) or "")
    assert "'model/c'" in (layout_difference(two, _layout(a=_shard(), b=_shard(),
                                                           c=_shard())) or "")


def test_an_unreadable_layout_is_a_corrupt_manifest():
    with pytest.raises(ManifestError, match="sharding layout"):
        layout_shards({"meshes": [], "tensors": {"model/w": {"mesh": 0}}})


def test_a_manifest_whose_layout_contradicts_its_tensors_is_invalid():
    from ft_launch.ckpt.manifest import Manifest, TensorDesc, plan_layout

    specs, total = plan_layout([TensorDesc("model/w", "float32", (8, 4))])
    good = Manifest(0, specs, total, meta={"layout": _layout(w=_shard())})
    assert Manifest.from_json(good.to_json()) == good
    for layout in (_layout(w=_shard(local=7)), _layout(v=_shard()), {"meshes": 3}):
        bad = Manifest(0, specs, total, meta={"layout": layout})
        with pytest.raises(ManifestError, match="layout"):
            Manifest.from_json(bad.to_json())
