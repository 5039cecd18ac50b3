"""Exactly-once data accounting across replicas (pure).

Replica ``r`` of ``R`` trains on its own deterministic stream; its *position* is
how many of its samples committed steps have consumed. Every step, each member
of the all-reduce contributes a vector with its batch size at its own index
(zeros while catching up); the sum, identical on every member, says exactly
whose samples the committed step used. The positions of **all** replicas are
part of the training state, so a replica whose batch went into a step that it
did not commit itself (it died, or its commit vote failed) learns its true
position from the state it fetches, and never trains that batch twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepContribution:
    """Who trained what in one committed step: ``counts[r]`` samples of replica r;
    ``stopping``: a member found the controller lost, and every member stops at
    this step's start together (``controller_loss``)."""

    step: int
    counts: tuple[int, ...]
    stopping: bool = False

    @property
    def contributors(self) -> int:
        return sum(1 for c in self.counts if c > 0)


class DataLedger:
    """Positions of every replica's stream (samples consumed by committed steps)."""

    def __init__(self, num_replicas: int, positions: list[int] | None = None) -> None:
        self.positions = list(positions) if positions is not None else [0] * num_replicas
        if len(self.positions) != num_replicas:
            raise ValueError(f"ledger of {len(self.positions)} replicas, job has {num_replicas}")

    def contribution_vector(self, replica_id: int, batch_size: int,
                            stopping: bool = False) -> np.ndarray:
        """This member's share of the contribution all-reduce (SUM, float64 exact):
        its samples, and last whether it stops (found the controller lost)."""
        vector = np.zeros(len(self.positions) + 1, dtype=np.float64)
        vector[replica_id] = batch_size
        vector[-1] = 1.0 if stopping else 0.0
        return vector

    def decode(self, step: int, summed: np.ndarray) -> StepContribution:
        if len(summed) != len(self.positions) + 1:
            raise ValueError(f"contribution vector of {len(summed)} entries, expected "
                             f"{len(self.positions) + 1}")
        counts = tuple(round(float(v)) for v in summed[:-1])
        if any(c < 0 for c in counts) or not np.allclose(summed[:-1], counts):
            raise ValueError(f"contribution vector {summed.tolist()} is not whole sample counts")
        return StepContribution(step, counts, stopping=bool(summed[-1] > 0))

    def commit(self, contribution: StepContribution) -> None:
        for replica, count in enumerate(contribution.counts):
            self.positions[replica] += count

    def to_state(self) -> dict[str, list[int]]:
        return {"positions": list(self.positions)}

    @staticmethod
    def from_state(state: dict[str, list[int]], num_replicas: int) -> DataLedger:
        return DataLedger(num_replicas, list(state["positions"]))
