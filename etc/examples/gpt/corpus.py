"""A deterministic text corpus and each replica's resumable sample stream.

The corpus is generated from a fixed seed (no download): sentences from a small
grammar, so a character-level model has structure to learn. Sample ``i`` is a
fixed window of the corpus; replica ``r`` of ``R`` consumes samples
``r, r + R, r + 2R, ...`` in order, so its position alone says what it has
trained on. No sample is shared by two replicas.
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

    def sample(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        k = sample_id % self.num_samples
        window = self.tokens[k * self.context:(k + 1) * self.context + 1]
        return window[:-1], window[1:]

    def batch(self, sample_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        pairs = [self.sample(i) for i in sample_ids]
        return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def replica_sample_ids(replica_id: int, num_replicas: int, position: int,
                       batch_size: int) -> list[int]:
    """The next ``batch_size`` sample ids of a replica's stream from ``position``."""
    return [(position + j) * num_replicas + replica_id for j in range(batch_size)]
