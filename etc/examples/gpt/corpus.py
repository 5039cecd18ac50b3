"""A deterministic text corpus and each replica's resumable sample stream.

The corpus is generated from a fixed seed (no download): sentences from a small
grammar, so a character-level model has structure to learn. Sample ``i`` is a
fixed window of the corpus; ``Corpus`` is a map-style dataset of them (the example
trains it through ``FtDataLoader``). ``replica_sample_ids`` is that loader's stream
cut by hand, for the tests' and benchmarks' workers: replica ``r`` of ``R`` (of one
rank) consumes samples ``r, r + R, r + 2R, ...`` in order.
"""

from __future__ import annotations

import random

import numpy as np

SUBJECTS = ["the model", "a replica", "the quorum", "every rank", "the leader", "a node",
            "the scheduler", "our launcher", "the ring", "a standby"]
VERBS = ["trains", "recovers", "waits for", "reduces", "checkpoints", "promotes", "drains",
         "elects", "fetches", "replays"]
OBJECTS = ["the gradients", "a snapshot", "its neighbours", "the next step", "a warm node",
           "the batch", "every shard", "the loss", "a new quorum", "the state"]
ENDINGS = [".", " quickly.", " again.", " without a restart.", " in seconds.", " on time."]


def make_corpus(n_sentences: int = 20_000, seed: int = 1234) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
                    f"{rng.choice(ENDINGS)}" for _ in range(n_sentences))


class Corpus:
    """Character-level tokens of the generated corpus, cut into fixed samples."""

    def __init__(self, context: int, n_sentences: int = 20_000, seed: int = 1234) -> None:
        text = make_corpus(n_sentences, seed)
        self.alphabet = sorted(set(text))
        index = {ch: i for i, ch in enumerate(self.alphabet)}
        self.tokens = np.array([index[ch] for ch in text], dtype=np.int64)
        self.context = context
        # Sample i covers tokens [i * context, (i + 1) * context]: input + shifted target.
        self.num_samples = (len(self.tokens) - 1) // context

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        return self.sample(sample_id)

    def sample(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        k = sample_id % self.num_samples
        window = self.tokens[k * self.context:(k + 1) * self.context + 1]
        return window[:-1], window[1:]

    def batch(self, sample_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        pairs = [self.sample(i) for i in sample_ids]
        return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def replica_sample_ids(replica_id: int, num_replicas: int, position: int,
                       batch_size: int, rank: int = 0, ranks: int = 1) -> list[int]:
    """The sample ids of rank ``rank`` (of ``ranks``) in the next ``batch_size`` samples
    of a replica's stream from ``position``: what ``FtDataLoader`` without shuffling
    gives it (stream position ``q`` is sample ``(q // K) * R * K + r * K + q % K``,
    and rank ``k`` takes the positions with ``q % K == k``)."""
    return [(q // ranks) * num_replicas * ranks + replica_id * ranks + q % ranks
            for q in range(position, position + batch_size) if q % ranks == rank]
