"""The persistent map behind the leader's per-round state."""

from __future__ import annotations

import random

from ft_launch.launcher.quorum.pmap import PMap, with_item


def test_behaves_like_a_dict_and_never_changes_old_versions() -> None:
    rng = random.Random(5)
    versions: list[tuple[PMap[int, int], dict[int, int]]] = []
    current: PMap[int, int] = PMap({1: 1})
    model = {1: 1}
    for step in range(3000):
        key, value = rng.randrange(400), step
        current, model = current.set(key, value), {**model, key: value}
        if step % 97 == 0:
            versions.append((current, model))
    versions.append((current, model))
    for pmap, expected in versions:
        assert len(pmap) == len(expected) and dict(pmap.items()) == expected
        assert sorted(pmap) == sorted(expected) and pmap == expected
        assert all(pmap.get(k) == v and k in pmap for k, v in expected.items())
        assert pmap.get(-1) is None and -1 not in pmap


def test_with_item_takes_plain_mappings() -> None:
    plain = {1: "a"}
    updated = with_item(plain, 2, "b")
    assert dict(updated.items()) == {1: "a", 2: "b"} and plain == {1: "a"}
    assert with_item(updated, 1, "c")[1] == "c" and updated[1] == "a"
