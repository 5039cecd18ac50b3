"""A user's training loop for ``test_torch_optimizer.py``: a plain module, AdamW, a
warmup + cosine learning rate (torch's ``LambdaLR`` wrapping the optimizer, or set by
hand on ``param_groups``), and an RNG of the script's own that perturbs the inputs.

``--mode native``: plain torch in one process, the replicas' batches of each step
averaged as DDP averages them (each replica's mean-loss gradients, summed and
halved: with two replicas the very sums FTAR makes), then ``optimizer.step()`` and
``scheduler.step()``. ``--mode ft``: the same loop adopted to ft-launch (started by
``LocalJob``): ``FtOptimizer``, the scheduler and the RNG registered.

Each committed step appends a JSON line to ``<out>/<mode>-r<replica>.jsonl``: the
step, the learning rate the wrapped optimizer stepped with, and a digest of the
parameters after it; at the end ``<out>/<mode>-r<replica>-final.json`` holds a
digest of everything (model, optimizer, scheduler, RNG holder) and what the loop saw.
A run is shortened, as the example's is, by a number in ``<run_dir>/end-step``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

FEATURES, BATCH, BASE_LR, WARMUP = 8, 4, 0.01, 5


def schedule(step: int, horizon: int) -> float:
    """Warmup, then cosine down to a tenth (the factor of ``BASE_LR`` at ``step``)."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, horizon - WARMUP))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


class Noise:
    """The script's own RNG (the same on every replica): a tensor-valued state."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(7)
        self.draws = 0

    def draw(self) -> torch.Tensor:
        self.draws += 1
        return 0.01 * torch.randn(BATCH, FEATURES, generator=self.generator)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "draws": self.draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.draws = state["draws"]


def batch(replica: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s samples from ``position`` on (its own stream)."""
    generator = torch.Generator().manual_seed(1_000_003 * replica + position)
    inputs = torch.randn(BATCH, FEATURES, generator=generator)
    return inputs, torch.sin(inputs.sum(dim=1, keepdim=True))


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=BASE_LR, foreach=False)


def digest(*parts: Any) -> str:
    sha = hashlib.sha256()

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):   # a DTensor: this rank's shard
            local = value.to_local() if hasattr(value, "to_local") else value
            sha.update(local.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                sha.update(str(key).encode())
                add(value[key])
        elif isinstance(value, list | tuple):
            for item in value:
                add(item)
        else:
            sha.update(repr(value).encode())
    for part in parts:
        add(part)
    return sha.hexdigest()


def params_digest(model: torch.nn.Module) -> str:
    return digest(dict(model.named_parameters()))


class Records:
    def __init__(self, out: Path, name: str) -> None:
        self.path = out / f"{name}.jsonl"
        self.final = out / f"{name}-final.json"

    def step(self, **fields: Any) -> None:
        with self.path.open("a") as lines:
            lines.write(json.dumps(fields) + "\n")


def native(args: argparse.Namespace) -> None:
    models = build()
    model, optimizer = models
    scheduler = (torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: schedule(s, args.horizon)) if args.schedule == "lambda" else None)
    noises = [Noise() for _ in range(args.replicas)]
    records = Records(args.out, "native-r0")
    used: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, a, k: used.append(opt.param_groups[0]["lr"]))
    for step in range(args.steps):
        if scheduler is None:
            for group in optimizer.param_groups:
                group["lr"] = BASE_LR * schedule(step, args.horizon)
        grads = []
        for replica in range(args.replicas):
            inputs, targets = batch(replica, step * BATCH)
            if args.rng:
                inputs = inputs + noises[replica].draw()
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for index, p in enumerate(model.parameters()):
            total = grads[0][index]
            for other in grads[1:]:
                total = total + other[index]
            p.grad = total / args.replicas
        optimizer.step()
        records.step(step=step, lr=used[-1], params=params_digest(model))
        if scheduler is not None:
            scheduler.step()
        if args.save_at == step:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict() if scheduler else None,
                        "noise": noises[0].state_dict(), "step": step}, args.checkpoint)


def end_step(run_dir: Path, steps: int) -> int:
    path = run_dir / "end-step"
    return min(steps, int(path.read_text())) if path.exists() else steps


def ft(args: argparse.Namespace) -> None:
    from ft_launch import FtOptimizer, configure_logging, ft_manager

    configure_logging("INFO")
    model, inner = build()
    manager = ft_manager(model, inner, batch_size=BATCH)
    me = manager.identity
    optimizer = FtOptimizer(manager)
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert optimizer.param_groups is inner.param_groups and optimizer.state is inner.state
    scheduler = (torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: schedule(s, args.horizon)) if args.schedule == "lambda" else None)
    noise = Noise()
    offset = 0       # the steps the script's own checkpoint had trained
    if args.checkpoint and args.save_at is None:
        saved = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        if scheduler is not None:   # torch's order: the scheduler, then the optimizer
            scheduler.load_state_dict(saved["scheduler"])
        optimizer.load_state_dict(saved["optimizer"])
        noise.load_state_dict(saved["noise"])
        offset = saved["step"] + 1
        assert digest(optimizer.state_dict()) == digest(saved["optimizer"])
        assert inner.state_dict()["state"][0]["step"] == offset
    if scheduler is not None:
        manager.register_state("scheduler", scheduler)
    if args.rng:
        manager.register_state("noise", noise)
    used: list[float] = []
    inner.register_step_pre_hook(lambda opt, a, k: used.append(opt.param_groups[0]["lr"]))
    calls = {"pre": 0, "post": 0}
    optimizer.register_step_pre_hook(lambda *_: calls.__setitem__("pre", calls["pre"] + 1))
    optimizer.register_step_post_hook(lambda *_: calls.__setitem__("post", calls["post"] + 1))
    records = Records(args.out, f"ft-r{me.replica_id}")
    steps = commits = 0
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while manager.next_step < end_step(me.run_dir, args.steps):
                if scheduler is None:   # keyed by the step being committed
                    for group in optimizer.param_groups:
                        group["lr"] = BASE_LR * schedule(offset + manager.next_step,
                                                         args.horizon)
                if args.zero_grad == "start":
                    optimizer.zero_grad()
                inputs, targets = batch(me.replica_id, offset * BATCH + manager.data_position)
                if args.rng:
                    inputs = inputs + noise.draw()
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                loss.backward()
                steps += 1
                if optimizer.step(loss=loss.item()):
                    commits += 1
                    if args.commit_again:
                        manager.commit()
                    records.step(step=offset + manager.plan.step, lr=used[-1],
                                 params=params_digest(model))
                if scheduler is not None:
                    scheduler.step()      # every iteration, as scripts do
                if args.zero_grad == "end":
                    optimizer.zero_grad()
        registered = {"scheduler": scheduler.state_dict() if scheduler else None,
                      "noise": noise.state_dict()}
        records.final.write_text(json.dumps({
            "state": digest(dict(model.named_parameters()), inner.state_dict(), registered),
            "params": params_digest(model), "step": manager.next_step - 1,
            "positions": manager.positions, "calls": calls, "steps": steps,
            "commits": commits, "warnings": [str(w.message) for w in caught]}))
    finally:
        manager.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("native", "ft"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replicas", type=int, default=2, help="native: replicas averaged")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--horizon", type=int, default=12, help="the cosine's last step")
    parser.add_argument("--schedule", choices=("lambda", "manual"), default="lambda")
    parser.add_argument("--zero-grad", choices=("start", "end"), default="start")
    parser.add_argument("--rng", action="store_true", help="perturb inputs by a registered RNG")
    parser.add_argument("--commit-again", action="store_true",
                        help="ft: call manager.commit() again after each committed step")
    parser.add_argument("--checkpoint", type=Path, help="the script's own checkpoint: native "
                        "writes it after --save-at, ft resumes from it")
    parser.add_argument("--save-at", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    (native if args.mode == "native" else ft)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
