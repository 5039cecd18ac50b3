"""The device mesh of an HSDP script under ft-launch (imports torch: training side only).

A native HSDP script builds a ``("replicate", "shard")`` mesh over its whole torch
world, shards with FSDP2 on it and splits its data by the mesh. It adopts ft-launch
by swapping the mesh call; the mesh, FSDP2 and the data split stay as they are,
and the lines every script adds (``ft_manager``, ``FtOptimizer``, the loop bounded
by the manager's step) come with it::

    -from torch.distributed.device_mesh import init_device_mesh
    +from ft_launch import FtOptimizer, ft_init_device_mesh, ft_manager
     dist.init_process_group()
    -mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    +mesh = ft_init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
     replica, replicas = mesh.get_local_rank("replicate"), mesh["replicate"].size()
     shard, shards = mesh.get_local_rank("shard"), mesh["shard"].size()
     sampler = DistributedSampler(data, num_replicas=replicas * shards,
                                  rank=replica * shards + shard)      # the script's own split
     for block in model.layers:
         fully_shard(block, mesh=mesh, mp_policy=policy)
     fully_shard(model, mesh=mesh, mp_policy=policy)
     optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    +manager = ft_manager(model, optimizer, global_batch_size=global_batch)
    +optimizer = FtOptimizer(manager)
    -for step in range(steps):
    +while manager.next_step < steps:
    +    step = manager.next_step
         model(*batch(step)).backward()
         optimizer.step()
         optimizer.zero_grad()

The replica count and index come from the worker environment, so the script
reads them before ``ft_manager`` and before it builds its data; the manager
takes the native global batch and counts each replica's share. Keyed by
the step, the script's own split trains at every step what native HSDP trains,
with every replica in the quorum; a replica that missed steps goes on with the
step the others are at. ``FtDataLoader`` (the global batch) also trains every
sample exactly once through failures.

**What it is.** Under ft-launch each replica is a torch world of its own (``RANK``
and ``WORLD_SIZE`` count the replica's ranks), and the replicate dimension is the
fault-tolerant one: ft-launch averages every gradient shard across replicas
(FTAR, in FSDP2's all-reduce hook, ``torch_hooks.FsdpExchange``), in a quorum
that survives the loss of a replica. ``ft_init_device_mesh`` returns an
``FtDeviceMesh``: torch's own ``DeviceMesh`` of the replica's world with a
replicate dimension of one rank (a ``(1, shards)`` mesh), on which FSDP2 runs
HSDP as natively, placements ``(Replicate(), Shard(0))``: its replicate
all-reduce, over a group of one rank, leaves the reduce-scatter's average as it
is, and the hook then averages it across replicas. The replicate dimension
*reports* the run's layout: ``size``, ``shape``, ``get_local_rank`` and
``mesh["replicate"]`` give the replica count and this replica's index, as a
native ``(replicas, shards)`` mesh does.

**Why the numbers are native.** FSDP2 divides the gradients by the sizes of the
*process groups* it reduces over (reduce-scatter group x all-reduce group: the
replica's shard ranks x 1), never by the mesh's reported sizes (the gradients are
those of a 1-D mesh of the replica's ranks, bit for bit); and a dimension with
``Replicate()`` placements never enters a shard's shape or offset. So each
rank's gradient shard reaches the hook averaged over its replica's ranks, and
FTAR averages that over the replicas. ``tests/worker/test_mesh.py`` checks it
bit for bit against the same script run as native HSDP on a real ``(2, 2)`` mesh.

**What stays the replica's.** The process groups: ``get_group("replicate")`` is
the replica's group of one rank (a script's own collective on it, say to average
a logged loss, sees this replica's value only). ``get_coordinate()`` is the
rank's place in the replica's torch mesh (replicate coordinate 0): rank ``k`` of
every replica holds the same shards at the same coordinate, which is what
snapshots and a catch-up compare (``ckpt/torch_state.py``); read the replica
index from ``get_local_rank``. ``get_rank()`` and ``torch.distributed`` are the
replica's world. A DTensor sharded or partial over the replicate dimension, or a
flattened mesh spanning it (``_flatten``, refused with a ``UsageError``), would
need collectives across replicas that torch cannot make here.

**Saving the model.** Every replica holds the same model: save it from one, as a
native HSDP script does from one replicate group. A full state dict
(``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
cpu_offload=True))`` on every rank of the replica, written by its rank 0) or
``torch.distributed.checkpoint.save`` (every rank of the replica) work on the
mesh as natively; pick the replica with ``mesh.get_local_rank("replicate") ==
0``: ``dist.get_rank() == 0`` holds in every replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ft_launch.errors import UsageError

from .identity import WorkerIdentity

__all__ = ["FtDeviceMesh", "ft_init_device_mesh"]

#: The fault-tolerant dimension: FSDP2's HSDP replicates over a 2-D mesh's first.
REPLICATE_DIM = 0


class FtDeviceMesh(DeviceMesh):
    """A ``DeviceMesh`` of one replica's torch world whose replicate dimension
    (``replicate_dim``) reports the run's ``replicas`` and this replica's index
    ``replica`` (module doc). Made by ``ft_init_device_mesh``; slicing it keeps the
    replicate dimension fault-tolerant (``mesh["replicate"]`` is a 1-D one)."""

    replicate_dim: int
    replicas: int
    replica: int

    @classmethod
    def _adopt(cls, mesh: DeviceMesh, replicate_dim: int, replicas: int,
               replica: int) -> FtDeviceMesh:
        """``mesh`` (torch's, built with a replicate dimension of one rank) as an
        ``FtDeviceMesh``: the same layout, process groups and root mesh."""
        if mesh.size(replicate_dim) != 1:
            raise AssertionError(f"the replica's own mesh has {mesh.size(replicate_dim)} "
                                 f"ranks in its replicate dimension {replicate_dim}, not 1")
        adopted = cls.__new__(cls)
        adopted.__dict__.update(mesh.__dict__)
        adopted.replicate_dim, adopted.replicas, adopted.replica = replicate_dim, replicas, replica
        adopted._hash = None
        return adopted

    def _dim_index(self, mesh_dim: int | str | None) -> int:
        if mesh_dim is None:
            if self.ndim > 1:   # as DeviceMesh.get_local_rank says it
                raise RuntimeError(f"the mesh has {self.ndim} dimensions: name one (mesh_dim)")
            return 0
        if isinstance(mesh_dim, str):
            return self._get_mesh_dim_by_name(mesh_dim)
        return mesh_dim % self.ndim

    def size(self, mesh_dim: int | None = None) -> int:
        if mesh_dim is None:
            return math.prod(self.shape)
        if self._dim_index(mesh_dim) == self.replicate_dim:
            return self.replicas
        return super().size(mesh_dim)

    @property
    def shape(self) -> tuple[int, ...]:
        sizes = list(super().shape)
        sizes[self.replicate_dim] = self.replicas
        return tuple(sizes)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        if self._dim_index(mesh_dim) == self.replicate_dim:
            return self.replica
        return super().get_local_rank(mesh_dim)

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        submesh = super().__getitem__(mesh_dim_names)
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        assert self.mesh_dim_names is not None   # DeviceMesh slices named meshes only
        replicate_name = self.mesh_dim_names[self.replicate_dim]
        if submesh is self or replicate_name not in names:
            return submesh
        return FtDeviceMesh._adopt(submesh, names.index(replicate_name), self.replicas,
                                   self.replica)

    def _flatten(self, mesh_dim_name: str | None = None, backend_override: Any = None
                 ) -> DeviceMesh:
        names = self.mesh_dim_names or ()
        raise UsageError(
            f"flattening the mesh dimensions {list(names)}, which include the fault-tolerant "
            f"replicate dimension {names[self.replicate_dim]!r} (each replica is a torch "
            "world of its own: no torch group spans the replicas)",
            hint="flatten the other dimensions only, and take the data-parallel rank as "
                 "mesh.get_local_rank('replicate') * mesh['shard'].size() + "
                 "mesh.get_local_rank('shard') (of replicas * shards ranks)")

    # Not equal to (nor hashed as) torch's mesh of the same layout, which reports other
    # sizes: caches keyed by a mesh (DTensor's sharding propagation) keep them apart.
    def _hash_key(self) -> tuple[Any, ...]:
        return (*super()._hash_key(), self.replicate_dim, self.replicas, self.replica)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, FtDeviceMesh) and super().__eq__(other)
                and (self.replicate_dim, self.replicas, self.replica)
                == (other.replicate_dim, other.replicas, other.replica))

    __hash__ = DeviceMesh.__hash__

    def __repr__(self) -> str:
        names = self.mesh_dim_names or tuple(str(d) for d in range(self.ndim))
        dims = ", ".join(f"{name}={size}" for name, size in zip(names, self.shape))
        return (f"FtDeviceMesh(({dims}), {self.device_type!r}, fault-tolerant "
                f"{names[self.replicate_dim]!r}: replica {self.replica} of {self.replicas})")


def ft_init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                        mesh_dim_names: Sequence[str] | None = None,
                        backend_override: dict[Any, Any] | None = None,
                        identity: WorkerIdentity | None = None) -> FtDeviceMesh:
    """``torch.distributed.device_mesh.init_device_mesh`` for a script that ft-launch
    runs as replicas: the same arguments, the mesh of the whole run
    (``(replicas, shards, ...)``, dimension 0 the one FSDP2's HSDP replicates
    over), built as this replica's torch world with a fault-tolerant replicate
    dimension (module doc). ``mesh_shape[0]`` must be the number of replicas
    ft-launch runs; the other dimensions together the replica's ranks
    (``WORLD_SIZE``). Starts the replica's process group from the environment if
    the script has not, as ``init_device_mesh`` does.

    Args:
        device_type: as ``init_device_mesh``'s (``"cuda"``, ``"cpu"``).
        mesh_shape: the run's mesh, ``(replicas, shards, ...)``: at least two
            dimensions, the first the replica count.
        mesh_dim_names: as ``init_device_mesh``'s; the first names the replicate
            dimension.
        backend_override: as ``init_device_mesh``'s.
        identity: this rank's place in the run; None: from the worker environment.

    Returns:
        The replica's ``FtDeviceMesh``, reporting the run's layout.

    Raises:
        UsageError: fewer than two dimensions; ``mesh_shape[0]`` is not the number of
            replicas ft-launch runs; the other dimensions do not hold the replica's
            ranks; the worker environment is missing or invalid.
    """
    identity = identity or WorkerIdentity.from_env()
    shape = tuple(int(size) for size in mesh_shape)
    names = None if mesh_dim_names is None else tuple(mesh_dim_names)
    if len(shape) < 2:
        raise UsageError(
            f"ft_init_device_mesh{shape}: an HSDP mesh has a replicate dimension and at least "
            "one more", hint="for FSDP2 inside each replica, keep torch's init_device_mesh("
                             "device, (ranks_per_replica,)): ft-launch averages across replicas")
    if shape[REPLICATE_DIM] != identity.num_replicas:
        raise UsageError(
            f"the mesh's replicate dimension has {shape[REPLICATE_DIM]} replica(s), but "
            f"ft-launch runs {identity.num_replicas}",
            hint="give the run's replica count (each replica is a torch world of its own: "
                 "WORLD_SIZE counts one replica's ranks, not the run's)")
    inner = math.prod(shape[REPLICATE_DIM + 1:])
    if inner != identity.ranks:
        raise UsageError(
            f"the mesh's other dimensions {list(shape[1:])} hold {inner} rank(s), but each "
            f"replica has {identity.ranks}",
            hint="the dimensions after the replicate one lay out one replica's ranks")
    own = init_device_mesh(device_type, (1, *shape[1:]), mesh_dim_names=names,
                           backend_override=backend_override)
    return FtDeviceMesh._adopt(own, REPLICATE_DIM, identity.num_replicas, identity.replica_id)
