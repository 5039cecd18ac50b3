"""Exactly-once data loading (``ft_launch.launcher.worker.data``): the real sampler in
real ``DataLoader``s with worker processes that read ahead, compared with torch's
own ``DataLoader`` and ``DistributedSampler`` as a native run uses them; then real
replicas on loopback, one killed and started again, whose scripts train exactly
the samples their ledger counts."""

from __future__ import annotations

import gc
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from ft_launch import FtBatchSampler, FtDataLoader
from ft_launch.errors import UsageError
from ft_launch.launcher.worker import exits
from ft_launch.launcher.worker.audit import audit_records, check_exactly_once
from ft_launch.launcher.worker.identity import WorkerIdentity
from ft_launch.launcher.worker.local import LocalJob
from tests.waiting import patience

from .harness import TEST_CONFIG
from .test_fault_tolerance import kill_and_restart

pytestmark = [pytest.mark.timeout(240)]

WORKERS = 2          # DataLoader worker processes of each loader: they read ahead
SEED = 11


class Indexed(Dataset):
    """Sample ``i`` is ``i``: a batch shows which samples it holds."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


@dataclass
class ManagerStandIn:
    """The little of a ``Manager`` that ``FtDataLoader`` reads: who this worker is, the
    position of its replica's stream, whether a step is in flight, and (optionally)
    the batch it counts a step. Commits, discards and catch-ups are played by setting
    ``data_position`` as the ledger would."""

    identity: WorkerIdentity
    data_position: int = 0
    step_started: bool = False
    batch_size: int | None = None


def stand_in(replica: int, replicas: int, rank: int = 0, ranks: int = 1) -> ManagerStandIn:
    return ManagerStandIn(WorkerIdentity(job_id="test", replica_id=replica,
                                         num_replicas=replicas, rank=rank, ranks=ranks,
                                         host="127.0.0.1", run_dir=Path("."), secret="test"))


def permutation(size: int, epoch: int, seed: int = SEED) -> list[int]:
    """Epoch ``epoch``'s order as ``DistributedSampler(shuffle=True, seed=seed)`` draws it."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def native_global_batches(size: int, batch: int, epochs: int, drop_last: bool) -> list[list[int]]:
    """What one native ``DataLoader(batch_size=global batch)`` trains step by step over
    the epochs' permutations: one loader per epoch with ``drop_last``, else one over
    the permutations end to end (a step that crosses an epoch's end goes on into the
    next epoch's order, as the module doc says)."""
    if drop_last:
        return [b.tolist() for e in range(epochs)
                for b in DataLoader(Indexed(size), batch_size=batch, drop_last=True,
                                    sampler=permutation(size, e), num_workers=WORKERS)]
    order = [i for e in range(epochs) for i in permutation(size, e)]
    return [b.tolist() for b in DataLoader(Indexed(size), batch_size=batch, sampler=order,
                                           num_workers=WORKERS, drop_last=True)]


def native_rank_batches(size: int, micro: int, epochs: int, data_rank: int,
                        data_ranks: int) -> list[list[int]]:
    """One rank of native HSDP: ``DistributedSampler`` + ``DataLoader``, ``set_epoch``."""
    batches = []
    for epoch in range(epochs):
        sampler = DistributedSampler(Indexed(size), num_replicas=data_ranks, rank=data_rank,
                                     shuffle=True, seed=SEED, drop_last=True)
        sampler.set_epoch(epoch)
        batches += [b.tolist() for b in DataLoader(Indexed(size), batch_size=micro,
                                                   sampler=sampler, drop_last=True)]
    return batches


def test_the_replicas_batches_are_the_native_global_batch_at_every_step():
    """2 replicas x 2 ranks, global batch 8, 24 samples: at each step (every replica at
    the same position) the union of the four ranks' batches is the native global
    batch of that step, and each rank's batch is what native HSDP's data rank
    ``r * K + k`` reads through ``DistributedSampler``; nothing read ahead is dropped."""
    size, batch, replicas, ranks, steps = 24, 8, 2, 2, 6         # two epochs
    native = native_global_batches(size, batch, epochs=2, drop_last=False)
    workers = {}
    for replica in range(replicas):
        for rank in range(ranks):
            manager = stand_in(replica, replicas, rank, ranks)
            loader = FtDataLoader(Indexed(size), manager, global_batch_size=batch,
                                  shuffle=True, seed=SEED, num_workers=WORKERS)
            workers[replica, rank] = (manager, loader, iter(loader))
    taken: dict[tuple[int, int], list[list[int]]] = {key: [] for key in workers}
    for step in range(steps):
        union = []
        for key, (manager, _, batches) in workers.items():
            manager.data_position = step * batch // replicas     # every replica trained
            taken[key].append(next(batches).tolist())
            union += taken[key][-1]
        assert sorted(union) == sorted(native[step]), step
    for (replica, rank), batches in taken.items():
        assert batches == native_rank_batches(size, batch // (replicas * ranks), 2,
                                              replica * ranks + rank, replicas * ranks)
    assert all(loader.rewinds == 0 for _, loader, _ in workers.values())


@pytest.mark.parametrize("persistent", [False, True])
def test_a_discarded_step_gets_its_batch_again_and_a_catch_up_its_new_position(persistent):
    """The workers read ahead (prefetch) while the step trains. The step is discarded
    (its position stays): the next batch is the same batch again, not the one read
    ahead. Then a commit takes the read-ahead as it is; then a catch-up jumps the
    position and the batch is that position's."""
    manager = stand_in(0, 2)
    loader = FtDataLoader(Indexed(20), manager, global_batch_size=8, shuffle=True, seed=SEED,
                          num_workers=WORKERS, prefetch_factor=2, persistent_workers=persistent)
    reference = FtBatchSampler(20, 8, replica_id=0, num_replicas=2, shuffle=True, seed=SEED)
    batches = iter(loader)
    first = next(batches).tolist()
    assert first == reference.rank_share(0)
    assert next(batches).tolist() == first                       # discarded: again
    assert loader.rewinds == 1
    manager.data_position = 4                                    # committed
    assert next(batches).tolist() == reference.rank_share(4)
    assert loader.rewinds == 1                                   # what was read ahead
    manager.data_position = 36                                   # caught up from a peer
    assert next(batches).tolist() == reference.rank_share(36)
    assert loader.rewinds == 2
    manager.data_position = 40
    assert next(batches).tolist() == reference.rank_share(40)
    assert loader.rewinds == 2


def test_shuffling_is_seeded_the_same_on_every_replica_and_new_each_epoch():
    size, batch = 16, 8

    def epoch_orders(seed: int) -> list[list[int]]:
        """Each replica's loader, built twice (as two processes build it), two epochs."""
        orders = []
        for _ in range(2):
            union: list[int] = []
            for replica in range(2):
                manager = stand_in(replica, 2)
                batches = iter(FtDataLoader(Indexed(size), manager, global_batch_size=batch,
                                            shuffle=True, seed=seed, num_workers=WORKERS))
                for step in range(4):
                    manager.data_position = step * batch // 2
                    union += next(batches).tolist()
            orders.append(union)
        return orders

    built_once, built_again = epoch_orders(SEED)
    assert built_once == built_again
    sample_ids = [step * batch + j * 2 + replica for replica in range(2) for step in range(4)
                  for j in range(batch // 2)]                    # the global ids, in order
    assert built_once == [(permutation(size, 0) + permutation(size, 1))[g] for g in sample_ids]
    assert epoch_orders(SEED + 100)[0] != built_once
    assert permutation(size, 0) != permutation(size, 1)


@pytest.mark.parametrize("drop_last", [False, True])
def test_epochs_roll_over_as_documented(drop_last):
    """10 samples, global batch 4. Without drop_last every sample is trained once an
    epoch and step 2 crosses into epoch 1; with drop_last the tail of each epoch's
    order (2 samples) is left out and step 2 starts epoch 1, as torch's
    DataLoader(drop_last=True) leaves it out."""
    size, batch, steps = 10, 4, 5
    managers = [stand_in(replica, 2) for replica in range(2)]
    iterators = [iter(FtDataLoader(Indexed(size), manager, global_batch_size=batch,
                                   shuffle=True, seed=SEED, drop_last=drop_last,
                                   num_workers=WORKERS)) for manager in managers]
    unions = []
    for step in range(steps):
        for manager in managers:
            manager.data_position = step * batch // 2
        unions.append(sorted(i for batches in iterators for i in next(batches).tolist()))
    native = native_global_batches(size, batch, epochs=3, drop_last=drop_last)
    assert unions == [sorted(b) for b in native[:steps]]
    first, second = permutation(size, 0), permutation(size, 1)
    if drop_last:
        assert sorted(unions[0] + unions[1]) == sorted(first[:8])
        assert unions[2] == sorted(second[:4])
    else:
        assert sorted(unions[0] + unions[1]) == sorted(first[:8])
        assert unions[2] == sorted(first[8:] + second[:2])     # crosses into epoch 1
        assert sorted(unions[3] + unions[4]) == sorted(second[2:])
        trained = Counter(i for union in unions for i in union)
        assert trained == Counter(range(size)) + Counter(range(size))   # once an epoch


def test_micro_batches_of_an_accumulated_step_are_its_global_batch_and_rewind_together():
    """Two micro-batches a step: both belong to the step's position; a discarded step
    starts over at its first micro-batch; a step that ends early is refused."""
    managers = [stand_in(replica, 2) for replica in range(2)]
    loaders = [FtDataLoader(Indexed(32), m, global_batch_size=16, accumulation_steps=2,
                            shuffle=True, seed=SEED, num_workers=WORKERS) for m in managers]
    iterators = [iter(loader) for loader in loaders]
    native = native_global_batches(32, 16, epochs=1, drop_last=False)
    step0 = [[next(batches).tolist() for _ in range(2)] for batches in iterators]
    assert all(len(micro) == 4 for micros in step0 for micro in micros)
    assert sorted(i for micros in step0 for micro in micros for i in micro) == sorted(native[0])
    assert [next(iterators[0]).tolist() for _ in range(2)] == step0[0]   # discarded
    assert loaders[0].rewinds == 1
    managers[0].data_position = 8
    next(iterators[0])
    managers[0].data_position = 16            # a commit after one of two micro-batches
    with pytest.raises(UsageError, match="ended after 1 of its 2 micro-batches"):
        next(iterators[0])


def test_a_batch_taken_ahead_of_the_commit_is_refused():
    """A loop that takes the next step's batch while the step before is in flight
    (before ``optimizer.step()``) would train the wrong samples after a discard."""
    manager = stand_in(0, 2)
    batches = iter(FtDataLoader(Indexed(16), manager, global_batch_size=4,
                                num_workers=WORKERS))
    next(batches)                  # the first batch, before the loop's first step
    manager.step_started = True    # the forward started the step; the loop reads ahead
    with pytest.raises(UsageError, match="while the step before it was still in flight"):
        next(batches)


def test_a_global_batch_that_does_not_divide_is_refused_naming_the_numbers():
    manager = stand_in(1, 2, rank=0, ranks=2)
    with pytest.raises(UsageError) as error:
        FtDataLoader(Indexed(64), manager, global_batch_size=6, num_workers=WORKERS)
    assert "global batch size 6 does not divide into 2 replica(s) x 2 rank(s) x 1 " \
           "micro-batch(es) = 4 equal shares" in str(error.value)
    assert "multiple of 4" in str(error.value.hint)
    with pytest.raises(UsageError, match="= 8 equal shares"):
        FtDataLoader(Indexed(64), manager, global_batch_size=12, accumulation_steps=2)
    with pytest.raises(UsageError, match="holds no whole global batch of 8"):
        FtDataLoader(Indexed(6), manager, global_batch_size=8, drop_last=True)


def test_other_bad_usage_is_refused_with_a_hint():
    manager = stand_in(0, 2)
    manager.batch_size = 8         # the replica's batch, mistaken for the global one
    with pytest.raises(UsageError, match="counts 8 samples a step for each replica, but a "
                                         "global batch of 8 over 2 replicas is 4 each"):
        FtDataLoader(Indexed(16), manager, global_batch_size=8)
    manager.batch_size = 4
    FtDataLoader(Indexed(16), manager, global_batch_size=8)
    with pytest.raises(UsageError, match="takes no batch_size"):
        FtDataLoader(Indexed(16), manager, global_batch_size=8, batch_size=4)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    with pytest.raises(UsageError, match="map-style dataset with a length, not Stream"):
        FtDataLoader(Stream(), manager, global_batch_size=8)
    with pytest.raises(TypeError, match="never ends"):
        len(FtDataLoader(Indexed(16), manager, global_batch_size=8))


def test_the_state_says_which_stream_it_was_trained_on():
    manager = stand_in(0, 2)
    loader = FtDataLoader(Indexed(16), manager, global_batch_size=8, shuffle=True, seed=1)
    peer = FtDataLoader(Indexed(16), stand_in(1, 2), global_batch_size=8, shuffle=True,
                        seed=1)
    loader.load_state_dict(peer.state_dict())       # another replica, the same stream
    other = FtDataLoader(Indexed(16), manager, global_batch_size=8, shuffle=True, seed=2)
    with pytest.raises(UsageError, match="seed 1 here, 2 there"):
        loader.load_state_dict(other.state_dict())


class Closed:
    """Something ``exits.track`` closes at exit: it notes in a file which process did."""

    closing = False

    def __init__(self, note: Path) -> None:
        self.note = note

    def close(self) -> None:
        with self.note.open("a") as note:
            note.write(f"{os.getpid()}\n")


def test_a_data_loader_worker_ending_leaves_the_scripts_manager_open(tmp_path):
    """DataLoader workers are forked from the training process, its manager and exit
    hooks included: a worker that ends (every iterator's end, every rewind without
    persistent workers) must not close its copy of the manager, which marked the run
    finished at the step the worker was forked at (the loopback run below found it)."""
    manager = Closed(tmp_path / "closed")
    exits.track(manager)
    try:
        for persistent in (False, True):
            loader = FtDataLoader(Indexed(8), stand_in(0, 1), global_batch_size=2,
                                  num_workers=WORKERS, persistent_workers=persistent)
            batches = iter(loader)
            next(batches)
            del batches, loader       # the workers shut down and exit
        gc.collect()
    finally:
        exits.untrack(manager)
    assert not manager.note.exists(), manager.note.read_text()


# ---------------------------------------------------------------------- real replicas

WORKER = Path(__file__).with_name("data_worker.py")


def test_replicas_train_exactly_the_samples_their_ledger_counts(tmp_path):
    """2 replicas x 1 rank on loopback, each script reading through FtDataLoader (a
    worker process that reads ahead). Replica 0 poisons step 4's gradients (every
    replica discards it and trains it again); replica 1 is killed after committing
    step 12 and started again. The audit holds exactly once, and what each script
    trained at each committed step is exactly what the ledger counts for it: the
    samples at the replica's position of the native global stream."""
    steps, samples, batch, replicas = 30, 20, 8, 2
    out = tmp_path / "trained"
    job = LocalJob(tmp_path / "run", replicas,
                   [sys.executable, str(WORKER), "--out", str(out), "--steps", str(steps),
                    "--samples", str(samples), "--global-batch-size", str(batch),
                    "--seed", str(SEED)], TEST_CONFIG)
    job.start_all({0: "nan@gradients:4", 1: "kill@after_commit:12"})
    try:
        kill_and_restart(job, 1, "after_commit")
        codes = job.wait_all(patience(120))
    finally:
        job.stop_everything()
    assert codes == {0: 0, 1: 0}, {r: job.log(r)[-3000:] for r in codes}
    summary = check_exactly_once(job.run_dir, replicas, steps)
    lines = {r: [json.loads(line) for line in (out / f"r{r}.jsonl").read_text().splitlines()]
             for r in range(replicas)}
    order = [i for epoch in range(replicas * max(summary.positions) // samples + 1)
             for i in permutation(samples, epoch)]             # the native global stream
    trained: list[int] = []
    for step, record in sorted(audit_records(job.run_dir).items()):
        for replica, count in enumerate(record["counts"]):
            if count == 0:
                continue
            # the replica's last try of the step is the one it committed
            line = [x for x in lines[replica] if x["step"] == step][-1]
            position = record["positions_before"][replica]
            assert line["kind"] == "train" and line["position"] == position, (step, line)
            assert line["ids"] == [order[(position + j) * replicas + replica]
                                   for j in range(count)], (step, replica)
            trained += line["ids"]
    # over the run: each replica's stream from 0 to its position, every sample once (a
    # replica that caught up lags behind by the steps it did not train)
    streams = [order[q * replicas + replica] for replica in range(replicas)
               for q in range(summary.positions[replica])]
    assert Counter(trained) == Counter(streams)
    for replica in range(replicas):    # step 4 trained twice, the second time rewound
        assert sum(x["step"] == 4 for x in lines[replica]) > 1, lines[replica]
        assert "data rewinds to position" in job.log(replica)
    assert json.loads((out / "r0-final.json").read_text())["rewinds"] >= 1
