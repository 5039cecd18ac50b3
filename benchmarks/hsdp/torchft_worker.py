"""Arm (d), torchft 0.2.0 FT-HSDP: one process of one replica group, run with
the torchft environment's python (``torchft_env``).

    python benchmarks/hsdp/torchft_worker.py --spec JSON --rank G \\
        --rendezvous DIR --lighthouse http://127.0.0.1:PORT

As torchtitan wires torchft for FT-HSDP: each replica group is its own torch
world of ``ranks`` processes (gloo), sharded with FSDP2 over a 1-D mesh; a
torchft ``Manager`` per rank with a reconfigurable ``ProcessGroupGloo`` joins
rank k of every group; every FSDP module's all-reduce hook hands its
reduce-scatter output (the gradient shard, in the reduce dtype) to
``manager.allreduce`` (averaged over the quorum's participants); the optimizer
is wrapped in ``torchft.Optimizer`` (``zero_grad`` starts the quorum, which runs
during the forward pass; ``step`` steps only if ``should_commit``).

Rank 0 of a group serves the group's TCPStore on a port the kernel picks and
publishes it through a FileStore in the run's rendezvous directory.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist
import torchft
from replica_train import adamw, build, shard, train, worker_args, write_result
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torchft.process_group import ProcessGroupGloo

TIMEOUT = datetime.timedelta(seconds=600)
PORT_KEY = "tcpstore_port"


def group_store(rendezvous: str, replica_id: int, rank: int, ranks: int) -> dist.TCPStore:
    """The replica group's TCPStore (served by its rank 0, any free port)."""
    board = dist.FileStore(f"{rendezvous}/replica-{replica_id}.filestore", ranks)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size=ranks, is_master=True,
                              wait_for_workers=False, timeout=TIMEOUT)
        board.set(PORT_KEY, str(store.port))
        return store
    port = int(board.get(PORT_KEY))
    return dist.TCPStore("127.0.0.1", port, world_size=ranks, is_master=False,
                         wait_for_workers=False, timeout=TIMEOUT)


def main(argv: list[str] | None = None) -> int:
    args = worker_args(__doc__.split("\n\n")[0], argv)
    spec = args.spec
    replica_id, rank = divmod(args.rank, spec.ranks)
    store = group_store(str(args.rendezvous), replica_id, rank, spec.ranks)
    dist.init_process_group("gloo", store=dist.PrefixStore("replica", store), rank=rank,
                            world_size=spec.ranks, timeout=TIMEOUT)
    mesh = init_device_mesh("cpu", (spec.ranks,), mesh_dim_names=("shard",))
    model, corpus = build(spec)
    shard(model, mesh, spec)
    inner = adamw(model, spec)

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, object]) -> None:   # healing: never in a fault-free run
        model.load_state_dict(state["model"])  # type: ignore[arg-type]
        inner.load_state_dict(state["optim"])  # type: ignore[arg-type]

    manager = torchft.Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT), min_replica_size=spec.replicas,
        load_state_dict=load_state_dict, state_dict=state_dict, use_async_quorum=True,
        timeout=TIMEOUT, quorum_timeout=TIMEOUT, rank=rank, world_size=spec.ranks,
        store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args.lighthouse,
        replica_id=f"hsdp_bench_{replica_id}", hostname="127.0.0.1",
        # every group starts from the same seed: no weight sync at step 0
        init_sync=False)

    def all_reduce_hook(shard_grad: torch.Tensor) -> None:
        manager.allreduce(shard_grad, reduce_op=dist.ReduceOp.AVG).wait()

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(all_reduce_hook)
    optimizer = torchft.Optimizer(manager, inner)
    try:
        ended, losses = train(model, optimizer, corpus, spec, replica_id, rank)
        write_result(spec, replica_id, rank, ended, losses, model,
                     committed=manager.current_step(), torchft_version=torchft_version())
    finally:
        manager.shutdown(wait=False)
    dist.destroy_process_group()
    return 0


def torchft_version() -> str:
    from importlib.metadata import version
    return version("torchft")


if __name__ == "__main__":
    sys.exit(main())
