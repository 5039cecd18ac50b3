"""Arm (a), native torch HSDP: one process of a single torch world of
``replicas x ranks`` processes over gloo, a 2-D mesh (replicate, shard), FSDP2
doing the reduce-scatter inside a replica and the all-reduce across replicas.

    python benchmarks/hsdp/native_worker.py --spec JSON --rank G --rendezvous FILE

Global rank ``G`` is replica ``G // ranks``, rank ``G % ranks`` (the mesh's
row-major layout). The rendezvous is a FileStore: no port to pick.
"""

from __future__ import annotations

import datetime
import sys

import torch.distributed as dist
from replica_train import adamw, build, shard, train, worker_args, write_result
from torch.distributed.device_mesh import init_device_mesh


def main(argv: list[str] | None = None) -> int:
    args = worker_args(__doc__.split("\n\n")[0], argv)
    spec = args.spec
    world = spec.replicas * spec.ranks
    replica_id, rank = divmod(args.rank, spec.ranks)
    store = dist.FileStore(str(args.rendezvous), world)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (spec.replicas, spec.ranks),
                            mesh_dim_names=("replicate", "shard"))
    model, corpus = build(spec)
    shard(model, mesh, spec)
    optimizer = adamw(model, spec)
    ended, losses = train(model, optimizer, corpus, spec, replica_id, rank)
    write_result(spec, replica_id, rank, ended, losses, model, committed=spec.steps)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
