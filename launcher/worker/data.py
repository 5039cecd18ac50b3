"""Exactly-once data loading for map-style datasets (imports torch: training side only).

A script hands its dataset to ``FtDataLoader`` with the native **global** batch
size (every replica, rank and micro-batch of one optimizer step together) and
reads batches from it as from any ``DataLoader`` (workers, prefetch, pinned
memory)::

    manager = ft_manager(model, optimizer, batch_size=256 // replicas)  # a replica's
    optimizer = FtOptimizer(manager)
    loader = FtDataLoader(dataset, manager, global_batch_size=256, shuffle=True,
                          num_workers=4, pin_memory=True, persistent_workers=True)
    manager.register_state("data", loader)   # checks every replica reads one stream
    batches = iter(loader)
    while manager.next_step < steps:
        optimizer.zero_grad()
        inputs, targets = next(batches)      # after the last optimizer.step()
        model(inputs, targets).backward()
        optimizer.step()

**The stream.** Sample ids ``g = 0, 1, 2, ...`` are one endless stream over the
epochs: epoch ``g // L``, dataset index ``perm_e[g % L]``, where ``perm_e`` is
the epoch's permutation (``torch.randperm`` seeded with ``seed + epoch``, as
``DistributedSampler`` draws it; the identity without ``shuffle``) and ``L`` the
epoch's length. With ``R`` replicas of ``K`` ranks, replica ``r`` owns the ids
``g(q) = (q // K) * R * K + r * K + q % K`` for ``q = 0, 1, 2, ...``: its
*position* ``q`` counts the samples of its stream that committed steps consumed,
which is ``Manager.data_position`` (``worker/ledger.py``). A step at position
``p`` trains the replica's next ``B = global_batch_size / R`` samples, ``q`` in
``[p, p + B)``, and rank ``k`` takes those with ``q % K == k``, in order, cut into
``accumulation_steps`` micro-batches of ``b = B / (K * accumulation_steps)``.

**Why it is the native global batch.** With every replica at position ``p``
(every step of a fault-free run), the union of the replicas' batches is exactly
the ids ``[p * R, (p + B) * R)``: what ``DataLoader(dataset,
batch_size=global_batch_size)`` over the same permutations trains at that step,
and rank ``k`` of replica ``r`` gets, in the same order, what native HSDP's data
rank ``r * K + k`` (its ``("replicate", "shard")`` mesh flattened) gets from
``DistributedSampler(num_replicas=R * K, rank=r * K + k, shuffle, seed)`` and a
``DataLoader`` of batch ``b`` with ``set_epoch`` each epoch, whenever an epoch is
a whole number of global batches (always with ``drop_last`` and one micro-batch
a step). A replica that missed steps keeps its own position: its stream lags
behind the others', and every sample is still trained exactly once.

**Where an epoch ends.** A step always trains a whole global batch (the
ledger counts a fixed batch per step). Without ``drop_last`` (default) ``L`` is
``len(dataset)``: every sample is trained once per epoch, and the step that
crosses an epoch's end takes the first samples of the next epoch's permutation
for the rest of its batch. With ``drop_last``, ``L`` is the whole global batches
of the dataset: each step lies in one epoch, and the tail of each permutation is
left out, as ``DataLoader(batch_size=global_batch_size, drop_last=True)`` leaves
it. The loader never ends: bound the loop by steps.

**Rewinding.** The loader's workers read ahead. A step that is discarded or
retried does not advance the position, and a replica that catches up takes its
position from a peer's ledger (it jumps). So before each batch the loader checks
that what its workers read next belongs to the position the manager is at now;
if not, it throws the read-ahead away and restarts its workers' iterator there
(``FtDataLoader.rewinds`` counts it; logged at INFO). A step's first batch must
therefore be asked for after the previous step's ``optimizer.step()`` settled the
position: before the step's forward, or right after an explicit
``manager.start_step()``, the same way every step. A loop that takes the next
step's batch before ``optimizer.step()`` (a prefetch beside backward) is refused
with a ``UsageError``: what it takes would be the wrong samples whenever the step
is discarded or the replica catches up.

**State.** Positions live in the manager's ledger, which rides in every snapshot,
catch-up and restore: the loader needs no state of its own to resume.
``state_dict()`` / ``load_state_dict()`` carry what defines the stream (dataset
length, batch, replicas, ranks, shuffle, seed, drop_last); registered with the
manager (``manager.register_state``), a replica that restores or catches up
checks it reads the stream it was trained on. An iterable dataset has no position
to rewind to: index it (sample ``i`` -> item) and load it through this.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sized
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from ft_launch.errors import UsageError

if TYPE_CHECKING:
    from .manager import Manager

__all__ = ["FtBatchSampler", "FtDataLoader", "StreamDefinition"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamDefinition:
    """What decides which sample every position of every replica's stream holds."""

    num_samples: int
    global_batch_size: int
    num_replicas: int
    ranks: int
    shuffle: bool
    seed: int
    drop_last: bool


class FtBatchSampler(Sampler[list[int]]):
    """The batches of rank ``rank`` of replica ``replica_id``, from a position of the
    replica's stream on (the module doc says which samples): a step's share of this
    rank, as ``accumulation_steps`` micro-batches, then the next step's, endlessly.
    ``set_position`` says where the next iteration starts.

    Usable without ft-launch too: from position 0 it gives a native HSDP rank the
    same batches, e.g. for the native run a test compares with.

    Args:
        num_samples: the dataset's length.
        global_batch_size: the samples of one optimizer step, every replica, rank and
            micro-batch together.
        replica_id: this replica's index, below ``num_replicas``.
        num_replicas: the replicas of the run.
        rank: this rank's index in its replica, below ``ranks``.
        ranks: the ranks of one replica.
        accumulation_steps: micro-batches per optimizer step.
        shuffle: a permutation per epoch (``torch.randperm`` seeded with ``seed +
            epoch``); False: the dataset's order.
        seed: the base seed of the permutations.
        drop_last: leave out the tail of each epoch that fills no whole global batch.

    Raises:
        UsageError: ``accumulation_steps`` below 1; ``global_batch_size`` not a
            positive multiple of ``num_replicas * ranks * accumulation_steps``;
            ``replica_id`` or ``rank`` out of range; an empty dataset; with
            ``drop_last``, a dataset smaller than one global batch.
    """

    def __init__(self, num_samples: int, global_batch_size: int, *, replica_id: int,
                 num_replicas: int, rank: int = 0, ranks: int = 1,
                 accumulation_steps: int = 1, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = False) -> None:
        super().__init__()
        if accumulation_steps < 1:
            raise UsageError(f"accumulation_steps is {accumulation_steps}: a step takes at "
                             "least one micro-batch")
        shares = num_replicas * ranks * accumulation_steps
        if global_batch_size <= 0 or global_batch_size % shares:
            raise UsageError(
                f"global batch size {global_batch_size} does not divide into {num_replicas} "
                f"replica(s) x {ranks} rank(s) x {accumulation_steps} micro-batch(es) = "
                f"{shares} equal shares",
                hint=f"take a positive multiple of {shares} (the batch of all replicas and "
                     "ranks of one optimizer step together)")
        if not 0 <= replica_id < num_replicas or not 0 <= rank < ranks:
            raise UsageError(f"replica {replica_id} of {num_replicas} / rank {rank} of {ranks} "
                             "is out of range")
        if num_samples <= 0:
            raise UsageError("the dataset is empty")
        epoch_length = (num_samples // global_batch_size * global_batch_size if drop_last
                        else num_samples)
        if epoch_length == 0:
            raise UsageError(f"with drop_last, a dataset of {num_samples} sample(s) holds no "
                             f"whole global batch of {global_batch_size}",
                             hint="a smaller global batch, or drop_last=False")
        self.stream = StreamDefinition(num_samples, global_batch_size, num_replicas, ranks,
                                       shuffle, seed, drop_last)
        self.replica_id, self.rank = replica_id, rank
        self.accumulation_steps = accumulation_steps
        #: samples of the replica's stream one step consumes (what its ledger counts)
        self.replica_batch_size = global_batch_size // num_replicas
        #: samples of one batch this sampler yields (one rank, one micro-batch)
        self.micro_batch_size = global_batch_size // shares
        self.epoch_length = epoch_length
        self._position = 0
        self._permutations: dict[int, list[int]] = {}

    def set_position(self, position: int) -> None:
        """The next iteration starts at the step at ``position`` of the replica's stream.

        Args:
            position: samples of the replica's stream before that step.

        Raises:
            ValueError: ``position`` is negative.
        """
        if position < 0:
            raise ValueError(f"a stream position is never negative: {position}")
        self._position = position

    def __iter__(self) -> Iterator[list[int]]:
        return self._batches(self._position)   # the start is taken now, not at first next

    def _batches(self, position: int) -> Iterator[list[int]]:
        size = self.micro_batch_size
        while True:
            share = self.rank_share(position)
            for micro in range(self.accumulation_steps):
                yield share[micro * size:(micro + 1) * size]
            position += self.replica_batch_size

    def rank_share(self, position: int) -> list[int]:
        """This rank's dataset indices of the step at ``position``, micro-batches in order.

        Args:
            position: samples of the replica's stream before that step.

        Returns:
            ``replica_batch_size / ranks`` dataset indices.
        """
        return [self.dataset_index(self.sample_id(q))
                for q in range(position + self.rank, position + self.replica_batch_size,
                               self.stream.ranks)]

    def sample_id(self, q: int) -> int:
        """The global sample id at position ``q`` of this replica's stream.

        Args:
            q: a position of this replica's stream.

        Returns:
            The sample id ``g(q)`` of the module doc.
        """
        replicas, ranks = self.stream.num_replicas, self.stream.ranks
        return (q // ranks) * replicas * ranks + self.replica_id * ranks + q % ranks

    def dataset_index(self, sample_id: int) -> int:
        """Where global sample ``sample_id`` is in the dataset.

        Args:
            sample_id: a global sample id.

        Returns:
            Its index in the dataset: its offset in its epoch, through the epoch's
            permutation with ``shuffle``.
        """
        epoch, offset = divmod(sample_id, self.epoch_length)
        return self._permutation(epoch)[offset] if self.stream.shuffle else offset

    def _permutation(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order, as ``DistributedSampler`` draws it; the latest two
        are kept (a step may straddle two epochs)."""
        if epoch not in self._permutations:
            generator = torch.Generator()
            generator.manual_seed(self.stream.seed + epoch)
            order = torch.randperm(self.stream.num_samples, generator=generator).tolist()
            self._permutations = {e: p for e, p in self._permutations.items() if e == epoch - 1}
            self._permutations[epoch] = order
        return self._permutations[epoch]


#: DataLoader arguments FtDataLoader decides itself.
_OWN_ARGUMENTS = ("batch_size", "sampler", "batch_sampler")


class FtDataLoader(DataLoader):  # type: ignore[type-arg]
    """A ``torch.utils.data.DataLoader`` that trains every sample exactly once across
    replicas and rewinds after a discarded, retried or caught-up step (module doc).

    ``global_batch_size``: the native batch of one optimizer step (every replica,
    rank and micro-batch together); each batch it yields is this rank's share of
    one micro-batch, ``global_batch_size / (replicas * ranks * accumulation_steps)``
    samples. ``shuffle``, ``seed``: a permutation per epoch, the same on every
    replica. ``drop_last``: where an epoch ends (module doc). Every other argument
    (``num_workers``, ``pin_memory``, ``prefetch_factor``, ``persistent_workers``,
    ``collate_fn``, ...) is the ``DataLoader``'s. ``ft_manager``'s ``batch_size``
    must be ``global_batch_size / replicas``: what the ledger counts a step.

    Args:
        dataset: a map-style dataset with a length.
        manager: this rank's manager (``ft_manager``); the loader reads its position.
        global_batch_size: the samples of one optimizer step, every replica, rank and
            micro-batch together.
        shuffle: a permutation per epoch, the same on every replica.
        seed: the base seed of the permutations.
        drop_last: leave out the tail of each epoch that fills no whole global batch.
        accumulation_steps: micro-batches per optimizer step.
        **loader_args: the ``DataLoader``'s other arguments.

    Raises:
        UsageError: ``batch_size``, ``sampler`` or ``batch_sampler`` given;
            ``in_order=False``; an iterable dataset, or one without a length; the
            manager counts another batch than ``global_batch_size / replicas``; and
            what ``FtBatchSampler`` refuses.
    """

    def __init__(self, dataset: Dataset[Any], manager: Manager, *, global_batch_size: int,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 accumulation_steps: int = 1, **loader_args: Any) -> None:
        own = sorted(set(_OWN_ARGUMENTS) & loader_args.keys())
        if own:
            raise UsageError(f"FtDataLoader takes no {', '.join(own)}: it batches and samples "
                             "itself", hint="give global_batch_size (every replica and rank "
                                            "of a step together), shuffle and seed")
        if not loader_args.get("in_order", True):
            raise UsageError("FtDataLoader needs its batches in order (in_order=True)")
        if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
            raise UsageError(f"FtDataLoader takes a map-style dataset with a length, not "
                             f"{type(dataset).__name__}",
                             hint="index the data (sample i -> item): a position of the "
                                  "stream must say which samples it holds")
        me = manager.identity
        sampler = FtBatchSampler(len(dataset), global_batch_size, replica_id=me.replica_id,
                                 num_replicas=me.num_replicas, rank=me.rank, ranks=me.ranks,
                                 accumulation_steps=accumulation_steps, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
        # What the ledger counts a step, where the manager says it (Manager.batch_size):
        # any other batch skips or repeats samples.
        counted = getattr(manager, "batch_size", None)
        if counted is not None and counted != sampler.replica_batch_size:
            raise UsageError(
                f"the manager counts {counted} samples a step for each replica, but a global "
                f"batch of {global_batch_size} over {me.num_replicas} replicas is "
                f"{sampler.replica_batch_size} each",
                hint=f"ft_manager(..., batch_size={sampler.replica_batch_size})")
        super().__init__(dataset, batch_sampler=sampler, **loader_args)
        self.manager = manager
        self.ft_sampler = sampler   # the batch_sampler, typed
        #: times the read-ahead was dropped and the workers restarted at another position
        self.rewinds = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """An endless iterator over this rank's batches, each the one the manager's
        position asks for (module doc: rewinding).

        Raises:
            UsageError: from ``next()``: a step's first batch asked for before the
                previous ``optimizer.step()``, or not at the same place every step; a
                step that ended before its ``accumulation_steps`` batches were taken.
        """
        return _StepBatches(self)

    def __len__(self) -> int:
        """No length: the loader never ends (the epochs follow one another in it).

        Raises:
            TypeError: always; bound the loop by steps (``manager.next_step``).
        """
        raise TypeError("an FtDataLoader never ends (the epochs follow one another in it): "
                        "bound the loop by steps (manager.next_step); an epoch is "
                        f"{self.ft_sampler.epoch_length} / "
                        f"{self.ft_sampler.stream.global_batch_size} steps")

    def batches_from(self, position: int) -> Iterator[Any]:
        """The DataLoader's own iterator (its workers, read-ahead and all), from the step
        at ``position`` of this replica's stream on.

        Args:
            position: samples of the replica's stream before the first batch's step.

        Returns:
            The ``DataLoader``'s iterator, without the position checks of ``iter()``.

        Raises:
            ValueError: ``position`` is negative.
        """
        self.ft_sampler.set_position(position)
        return super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        """What defines the stream (positions are in the manager's ledger).

        Returns:
            ``{"stream": ...}``: dataset length, batch, replicas, ranks, shuffle, seed,
            drop_last.
        """
        return {"stream": asdict(self.ft_sampler.stream)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check that ``state`` (a snapshot's, or a peer's at a catch-up) was saved by a
        loader of this stream: any other reads other samples at the same positions.

        Args:
            state: what ``state_dict`` returned.

        Raises:
            UsageError: ``state`` defines another stream (it names what differs).
        """
        mine = asdict(self.ft_sampler.stream)
        theirs = dict(state["stream"])
        differ = [f"{key} {mine[key]!r} here, {theirs.get(key)!r} there" for key in mine
                  if theirs.get(key) != mine[key]]
        if differ:
            raise UsageError("the data stream differs from the one the state was trained on: "
                             + "; ".join(differ),
                             hint="every replica and every restart must build FtDataLoader "
                                  "the same way; start a new run to train on other data")


class _StepBatches(Iterator[Any]):
    """One pass of an ``FtDataLoader``: the DataLoader's iterator, restarted wherever
    what it read ahead is not the batch the manager's position asks for."""

    def __init__(self, loader: FtDataLoader) -> None:
        self._loader = loader
        self._sampler = loader.ft_sampler
        self._inner: Iterator[Any] | None = None
        self._inner_next: tuple[int, int] | None = None   # (position, micro) it reads next
        self._last: tuple[int, int] | None = None         # (position, micro) yielded last
        #: whether a step was started when its first batch was asked for (the same each step)
        self._asked_in_step: bool | None = None

    def __next__(self) -> Any:
        wanted = self._wanted()
        if self._inner_next != wanted:
            self._restart(wanted[0])
        assert self._inner is not None
        batch = next(self._inner)
        self._last = wanted
        position, micro = wanted
        self._inner_next = ((position, micro + 1) if micro + 1 < self._sampler.accumulation_steps
                            else (position + self._sampler.replica_batch_size, 0))
        return batch

    def _wanted(self) -> tuple[int, int]:
        """The (position, micro-batch) the script asks for now."""
        manager = self._loader.manager
        position = manager.data_position
        steps = self._sampler.accumulation_steps
        if self._last is not None and self._last[1] + 1 < steps:
            if position != self._last[0]:
                raise UsageError(f"the step ended after {self._last[1] + 1} of its {steps} "
                                 "micro-batches",
                                 hint="take accumulation_steps batches each optimizer step")
            return self._last[0], self._last[1] + 1
        started = manager.step_started
        if self._asked_in_step is None:
            self._asked_in_step = started
        elif started != self._asked_in_step:
            raise UsageError(
                "a step's first batch was asked for "
                + ("while the step before it was still in flight" if started else
                   "outside a step, where the steps before had asked inside one"),
                hint="take a step's first batch after the previous optimizer.step() (it "
                     "settles the position the batch starts at), at the same place every "
                     "step: a batch taken before optimizer.step() holds the wrong samples "
                     "whenever the step is discarded or the replica catches up")
        return position, 0

    def _restart(self, position: int) -> None:
        if self._inner is not None:
            self._loader.rewinds += 1
            assert self._inner_next is not None
            log.info("data rewinds to position %d (the step was discarded or retried, or "
                     "the replica caught up): what was read ahead from position %d is "
                     "dropped (rewind %d)", position, self._inner_next[0],
                     self._loader.rewinds)
        self._inner = None   # the old workers shut down first (non-persistent)
        self._inner = self._loader.batches_from(position)
