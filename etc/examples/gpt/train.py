"""Train the example GPT with ft-launch's fault-tolerant step protocol.

Each replica is a torch world of its own (``ft-launch run`` sets RANK, WORLD_SIZE,
MASTER_ADDR, ... per replica, so ``init_process_group()`` just works); inside it
the model is sharded with FSDP2 (``--parallel fsdp``, the default), replicated
with DDP (``ddp``), or replicated by hand (``none``). Across replicas rank k of
every replica averages its gradient shard with FTAR, during backward.

Run by ``ft-launch run`` (one process per rank of each replica), or by the
loopback tests and benchmarks. Prints one line per committed step; at the end
each rank writes ``<run_dir>/final/replica-<r>-rank-<k>.json`` with the loss and a
hash of its model and optimizer state (its shards), so runs compare bit for bit.

A run can be shortened while it trains: a number N in ``<run_dir>/end-step``, if
smaller than ``--steps``, ends it before step N instead. Every rank reads the file
before each step, so all end at the same step as long as N is ahead of all of them
(``end_step_at``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import Corpus
from model import Gpt, GptConfig

from ft_launch import (
    FtDataLoader,
    FtOptimizer,
    ResidentAdamW,
    StepKind,
    configure_logging,
    ft_manager,
)

SIZES = {"tiny": {"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 32},
         "small": {"d_model": 64, "n_layers": 2, "n_heads": 4, "context": 64},
         "default": {"d_model": 192, "n_layers": 6, "n_heads": 6, "context": 64},
         "100m": {"d_model": 768, "n_layers": 14, "n_heads": 12, "context": 64}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

log = logging.getLogger("train")


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 natively: a GPU, or a CPU whose oneDNN has
    bf16 kernels (AVX512-BF16, AMX). On other CPUs torch emulates bf16 matmuls,
    several times slower than fp32 (6-12x for this model on an AVX2-only CPU)."""
    if device.type == "cuda":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def param_dtype_for(requested: str, device: torch.device) -> str:
    """The compute dtype of ``--param-dtype``: ``auto`` is bf16 where the device
    computes it natively, fp32 where it would be emulated."""
    if requested != "auto":
        return requested
    return "bf16" if native_bf16(device) else "fp32"


def _local_bytes(tensor: torch.Tensor) -> bytes:
    """This rank's part of a (possibly sharded) tensor, as bytes of any dtype."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of this rank's model and optimizer state (its shards under FSDP)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(_local_bytes(tensor))
    for param_id, values in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(values.items()):
            digest.update(f"{param_id}/{key}".encode())
            if isinstance(value, torch.Tensor):
                digest.update(_local_bytes(value))
    return digest.hexdigest()


#: In the run directory: the step count that ends the run instead of --steps, if smaller.
END_STEP_FILE = "end-step"


def end_step_at(run_dir: Path, steps: int) -> int:
    """``steps``, or the smaller count ``<run_dir>/end-step`` names (written whole, by
    rename; unreadable content is reported and ignored)."""
    try:
        text = (run_dir / END_STEP_FILE).read_text()
    except FileNotFoundError:
        return steps
    try:
        return min(steps, int(text))
    except ValueError:
        log.warning("%s: expected a step count, found %r; ignored", run_dir / END_STEP_FILE,
                    text[:40])
        return steps


def parallelize(model: Gpt, how: str, param_dtype: str, reduce_dtype: str,
                device: torch.device) -> torch.nn.Module:
    """Shard (FSDP2: each block, then the root) or replicate the model in this
    replica's torch world, on ``device``'s type."""
    if how == "none":
        return model
    if not dist.is_initialized():
        # from RANK, WORLD_SIZE, MASTER_ADDR, ...; gloo for a CPU model even where a
        # GPU is visible (torch's default group there has no CPU backend)
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # An explicit mesh: FSDP2's default one is on CUDA wherever a GPU is visible,
    # and would move a --device cpu model there.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16,
                        help="a replica's samples per step (its ranks' together; default 16)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--optimizer", choices=("resident-adamw", "adamw"),
                        help="AdamW with its state in the snapshot buffers (default on cpu), "
                             "or torch's (default on cuda: there the snapshot copy runs on "
                             "its own stream anyway)")
    parser.add_argument("--parallel", choices=("fsdp", "ddp", "none"), default="fsdp",
                        help="inside a replica: shard with FSDP2 (default), DDP, or by hand")
    parser.add_argument("--param-dtype", choices=["auto", *sorted(DTYPES)], default="bf16",
                        help="FSDP2 compute dtype of the parameters (default bf16; auto: bf16 "
                             "on a GPU or a CPU that computes it natively, fp32 on a CPU "
                             "that would emulate it, several times slower)")
    parser.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32",
                        help="FSDP2 gradient reduce dtype, also FTAR's wire dtype (default fp32)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: this rank's GPU (LOCAL_RANK of the GPUs it sees)")
    parser.add_argument("--code-tag", default="",
                        help="a label for this code version, kept in the final record")
    parser.add_argument("--min-step-seconds", type=float, default=0.0,
                        help="pad each step to at least this long, as a bigger model's "
                             "compute would (default 0: no padding); the lab cluster's "
                             "tests use it so a run outlasts a recovery on a fast machine "
                             "without running for minutes on a slow one")
    args = parser.parse_args()
    configure_logging("INFO")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # every replica starts from the same weights
    size = SIZES[args.size]
    corpus = Corpus(context=size["context"])
    device = torch.device(args.device)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))
                              % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model = Gpt(GptConfig(vocab_size=corpus.vocab_size, **size)).to(device)
    args.param_dtype = param_dtype_for(args.param_dtype, device)
    if args.parallel == "fsdp":
        log.info("FSDP2 computes in %s (--param-dtype)", args.param_dtype)
    model = parallelize(model, args.parallel, args.param_dtype, args.reduce_dtype, device)
    # The same numbers either way; resident-adamw keeps its state in the snapshot
    # buffers, so a snapshot every step copies nothing big (ckpt/resident.py).
    args.optimizer = args.optimizer or ("adamw" if args.device == "cuda" else "resident-adamw")
    optimizer = (ResidentAdamW(model.parameters(), lr=args.lr) if args.optimizer == "resident-adamw"
                 else torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False))
    manager = ft_manager(model, optimizer, batch_size=args.batch_size)
    optimizer = FtOptimizer(manager)
    me = manager.identity
    # Every replica's batch of a step together: rank k of replica r reads its share,
    # each sample exactly once, rewound after a dropped step or a catch-up.
    batches = iter(FtDataLoader(corpus, manager, global_batch_size=args.batch_size
                                * me.num_replicas))
    loss_value = float("nan")
    started = time.monotonic()
    try:
        while manager.next_step < end_step_at(me.run_dir, args.steps):
            step_started = time.monotonic()
            optimizer.zero_grad()       # the forward below starts the step (quorum beside it)
            # This rank's part of the replica's next batch (a catching-up replica's
            # gradients count for nothing: it learns only when the quorum answers).
            tokens, targets = (t.to(device) for t in next(batches))
            loss = model(tokens, targets)
            loss.backward()
            step_loss = loss.item()
            if optimizer.step(loss=step_loss):
                plan = manager.plan
                if plan.kind is StepKind.TRAIN:
                    loss_value = step_loss
                elapsed = time.monotonic() - started
                log.info("replica %d step %d loss %.4f quorum %d %s %.2f steps/s",
                         me.replica_id, plan.step, loss_value, plan.quorum_id,
                         plan.kind.value, (plan.step + 1) / max(elapsed, 1e-9))
            if args.min_step_seconds:  # after the commit: it stands for compute
                time.sleep(max(0.0, step_started + args.min_step_seconds - time.monotonic()))
        final = {"replica_id": me.replica_id, "rank": me.rank, "step": manager.next_step - 1,
                 "loss": loss_value, "state_sha256": state_hash(model, optimizer.optimizer),
                 "positions": manager.positions, "code_tag": args.code_tag}
        out = me.run_dir / "final" / f"replica-{me.replica_id}-rank-{me.rank}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(final))
    finally:
        manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
