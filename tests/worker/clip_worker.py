"""Test plumbing for ``test_accumulate_and_clip.py``: the example GPT trained by a loop
as users write it, with a warmup + cosine ``LambdaLR``, gradient accumulation and
``clip_grad_norm_`` right after the last micro-batch's backward, natively or under
ft-launch.

``--mode native``: one torch world of R x K processes (started by the test with RANK
and WORLD_SIZE): DDP over all of them (``--parallel ddp`` or ``none``, K = 1), or
native HSDP on a 2-D mesh (R, K) (``fsdp``). ``--mode ft``: R replicas of K ranks
(started by ``LocalJob``), a DDP of the replica's ranks, FSDP2 over them, or a plain
module (K = 1), averaged across replicas by ft-launch. Either way rank k of replica
r trains at each step on its share of ``replica_sample_ids(r, R, position, batch)``,
in ``--accumulate`` micro-batches: all but the last under the model's no-sync
(``model.no_sync()``, ``set_requires_gradient_sync(False)``, and for a plain module
under ft-launch ``manager.no_sync()``, unless ``--no-no-sync``).

Each committed step appends a JSON line to ``<out>/<mode>-r<replica>-k<rank>.jsonl``:
the step, the learning rate it stepped with, the total norm ``clip_grad_norm_``
returned and a digest of this rank's parameters after it. At the end
``<out>/<mode>-r<replica>-k<rank>-final.json`` holds a digest of the model,
optimizer and scheduler and the samples consumed. A run is shortened, as the
example's is, by a number in ``<run_dir>/end-step``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "etc" / "examples" / "gpt"))

from corpus import Corpus, replica_sample_ids
from loop_worker import digest  # beside this script
from model import Gpt, GptConfig

SIZE = {"d_model": 32, "n_layers": 2, "n_heads": 2, "context": 16}
BATCH, BASE_LR, WARMUP = 8, 1e-2, 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def schedule(step: int, horizon: int) -> float:
    """Warmup, then cosine down to a tenth: the factor of ``BASE_LR`` at ``step``."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, horizon - WARMUP))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def build(args: argparse.Namespace, mesh: Any) -> tuple[torch.nn.Module, Corpus]:
    torch.manual_seed(0)
    corpus = Corpus(context=SIZE["context"], n_sentences=2000)
    model: torch.nn.Module = Gpt(GptConfig(vocab_size=corpus.vocab_size, **SIZE))
    if args.parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                      reduce_dtype=DTYPES[args.reduce_dtype])
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    elif args.parallel == "ddp" or args.mode == "native":   # native "none": DDP too
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model, corpus


def end_step(run_dir: Path | None, steps: int) -> int:
    path = run_dir / "end-step" if run_dir is not None else None
    return min(steps, int(path.read_text())) if path is not None and path.exists() else steps


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("native", "ft"), required=True)
    parser.add_argument("--parallel", choices=("ddp", "none", "fsdp"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replicas", type=int, default=2, help="native: R")
    parser.add_argument("--ranks", type=int, default=1, help="native: K")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--horizon", type=int, default=6, help="the cosine's last step")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--max-norm", type=float, default=0.05)
    parser.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--no-no-sync", action="store_true",
                        help="ft, plain module: accumulate without manager.no_sync()")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    args.out.mkdir(parents=True, exist_ok=True)

    manager: Any = None
    if args.mode == "native":
        dist.init_process_group("gloo")
        replicas, ranks = args.replicas, args.ranks
        replica, rank = divmod(dist.get_rank(), ranks)
        mesh = None
        if args.parallel == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (replicas, ranks),
                                    mesh_dim_names=("replicate", "shard"))
        model, corpus = build(args, mesh)
    else:
        from ft_launch.launcher.worker.identity import WorkerIdentity

        me = WorkerIdentity.from_env()
        replica, replicas, rank, ranks = me.replica_id, me.num_replicas, me.rank, me.ranks
        mesh = None
        if args.parallel != "none":
            dist.init_process_group("gloo")      # the replica's world, from the env
        if args.parallel == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (ranks,))
        model, corpus = build(args, mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=BASE_LR, foreach=False)
    optimizer: torch.optim.Optimizer = inner
    batch = BATCH * args.accumulate               # the replica's samples per step
    if args.mode == "ft":
        from ft_launch import FtOptimizer, ft_manager

        manager = ft_manager(model, inner, batch_size=batch)
        optimizer = FtOptimizer(manager)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  lambda s: schedule(s, args.horizon))
    if manager is not None:
        manager.register_state("scheduler", scheduler)
    used: list[float] = []
    inner.register_step_pre_hook(lambda opt, a, k: used.append(opt.param_groups[0]["lr"]))
    plain = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
        else model
    name = f"{args.mode}-r{replica}-k{rank}"
    lines = args.out / f"{name}.jsonl"

    def no_sync(last: bool) -> Any:
        """Every micro-batch but the last keeps its gradients to itself."""
        if args.parallel == "fsdp":
            model.set_requires_gradient_sync(last)   # type: ignore[operator]
            return contextlib.nullcontext()
        if last:
            return contextlib.nullcontext()
        if args.parallel == "ddp" or args.mode == "native":
            return model.no_sync()                   # type: ignore[operator]
        return contextlib.nullcontext() if args.no_no_sync else manager.no_sync()

    def train_step(position: int) -> tuple[bool, float]:
        optimizer.zero_grad()
        ids = replica_sample_ids(replica, replicas, position, batch)[rank::ranks]
        size = len(ids) // args.accumulate
        for micro in range(args.accumulate):
            tokens, targets = (torch.from_numpy(a) for a in
                               corpus.batch(ids[micro * size:(micro + 1) * size]))
            with no_sync(micro == args.accumulate - 1):
                loss = model(tokens, targets) / args.accumulate
                loss.backward()
        # right after the last backward: the gradients are the replicas' average here
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        stepped = optimizer.step()
        scheduler.step()
        return bool(stepped) or args.mode == "native", float(norm)

    def record(step: int, norm: float) -> None:
        with lines.open("a") as out:
            out.write(json.dumps({"step": step, "lr": used[-1], "norm": norm,
                                  "params": digest(dict(plain.named_parameters()))}) + "\n")

    if manager is None:
        for step in range(args.steps):
            record(step, train_step(step * batch)[1])
        positions = [args.steps * batch] * replicas
    else:
        with manager:
            while manager.next_step < end_step(manager.identity.run_dir, args.steps):
                committed, norm = train_step(manager.data_position)
                if committed:
                    record(manager.plan.step, norm)
            positions = manager.positions
    final = {"state": digest(dict(plain.named_parameters()), inner.state_dict(),
                             scheduler.state_dict()), "positions": positions}
    (args.out / f"{name}-final.json").write_text(json.dumps(final))
    if args.mode == "native":
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
