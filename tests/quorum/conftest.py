"""The quorum's process tests: clusters of real agents, closed after each test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ft_launch.launcher.quorum import core, election, formation, model, witness

from .cluster import Cluster, MakeCluster

#: The core's modules that copy its values with ``model.evolve``.
_EVOLVING = (core, election, formation, witness)


@pytest.fixture(autouse=True)
def _checked_evolve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy the core makes in these tests names real fields (``evolve``
    itself takes them on trust, for speed)."""
    for module in _EVOLVING:
        monkeypatch.setattr(module, "evolve", model.checked_evolve)


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[MakeCluster]:
    made: list[Cluster] = []

    def make(running: int, **kwargs: object) -> Cluster:
        cluster = Cluster(tmp_path / str(len(made)), running, **kwargs)  # type: ignore[arg-type]
        made.append(cluster)
        return cluster
    yield make
    for cluster in made:
        cluster.close()
