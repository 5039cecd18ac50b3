"""The quorum's process tests: clusters of real agents, closed after each test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .cluster import Cluster, MakeCluster


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
