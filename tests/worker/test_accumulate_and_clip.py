"""Gradient accumulation and clipping, as users write them: the gradients are the
replicas' average when the last micro-batch's backward returns, for every kind of
model, so ``clip_grad_norm_`` right after it clips by the global norm, and a step
makes one cross-replica exchange whatever its micro-batches.

Native vs ft-launch (``clip_worker.py``), bit for bit, with a warmup + cosine
``LambdaLR`` wrapping ``FtOptimizer``, two micro-batches a step and a clip that
clips every step: 2 x 1 DDP and 2 x 1 plain against one DDP world of two processes,
2 x 2 FSDP2 against native HSDP on a (2, 2) mesh. Before the gradients were made
final at the end of backward (``torch_hooks.BackwardEnd``), a plain module's clip
saw this replica's own gradients, and FSDP2's the replica's (bf16 reduce) or half
reduced ones (fp32: the exchange thread still writing them); DDP's were final
already (DDP waits for its comm hook's futures). A plain module that accumulates
without ``manager.no_sync()`` is refused; a replica killed and started again
catches up through accumulation and clipping and ends as the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ft_launch.errors import UsageError
from ft_launch.launcher.worker.audit import check_exactly_once
from ft_launch.launcher.worker.local import LocalJob, free_port
from tests.waiting import patience

from .harness import TEST_CONFIG, logs_of_a_failed_run, restart_and_end_once_caught_up

torch = pytest.importorskip("torch")

from torch.utils.checkpoint import checkpoint

from ft_launch.launcher.worker.torch_hooks import BackwardEnd

pytestmark = [pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("clip_worker.py")
STEPS, MAX_NORM = 6, 0.05


def worker(mode: str, parallel: str, out: Path, *options: str) -> list[str]:
    return [sys.executable, str(WORKER), "--mode", mode, "--parallel", parallel,
            "--out", str(out), "--max-norm", repr(MAX_NORM), *options]


def run_native(out: Path, parallel: str, replicas: int, ranks: int, *options: str) -> None:
    """One torch world of replicas x ranks processes: DDP, or HSDP on a 2-D mesh."""
    port = free_port()
    procs = [subprocess.Popen(
        worker("native", parallel, out, "--replicas", str(replicas), "--ranks", str(ranks),
               *options),
        env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
             "WORLD_SIZE": str(replicas * ranks), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
        for rank in range(replicas * ranks)]
    assert [p.wait(timeout=patience(180)) for p in procs] == [0] * len(procs)


def ft_job(run_dir: Path, out: Path, parallel: str, replicas: int, ranks: int,
           *options: str) -> LocalJob:
    return LocalJob(run_dir, replicas, worker("ft", parallel, out, *options), TEST_CONFIG,
                    ranks=ranks)


def records(out: Path, name: str) -> dict[int, dict]:
    lines = (out / f"{name}.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def final(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}-final.json").read_text())


@pytest.mark.parametrize(("parallel", "ranks", "reduce_dtype"), [
    ("ddp", 1, "fp32"), ("none", 1, "fp32"), ("fsdp", 2, "fp32"), ("fsdp", 2, "bf16")])
def test_accumulation_and_clipping_train_as_natively(tmp_path, parallel, ranks, reduce_dtype):
    """Every step's clipped norm, learning rate and parameters (each rank's shard)
    are native's, bit for bit, and so are the final model, optimizer and scheduler.
    FSDP2 with an fp32 reduce lays the gradients out in the buffer the exchange
    thread writes (a race before); with bf16 it casts a copy that holds the
    replica's own average until the exchange is finished."""
    out = tmp_path / "out"
    options = ["--steps", str(STEPS), "--reduce-dtype", reduce_dtype]
    run_native(out, parallel, 2, ranks, *options)
    job = ft_job(tmp_path / "run", out, parallel, 2, ranks, *options)
    job.start_all()
    try:
        codes = job.wait_all(timeout=patience(180))
    finally:
        job.stop_everything()
    assert codes == {0: 0, 1: 0}, {r: job.log(r)[-3000:] for r in codes}
    for replica in range(2):
        for rank in range(ranks):
            native = records(out, f"native-r{replica}-k{rank}")
            assert sorted(native) == list(range(STEPS))
            # the clip clips: every step's norm is above it
            assert all(native[s]["norm"] > MAX_NORM for s in native), native
            assert records(out, f"ft-r{replica}-k{rank}") == native, (replica, rank)
            assert (final(out, f"ft-r{replica}-k{rank}")
                    == final(out, f"native-r{replica}-k{rank}")), (replica, rank)


def test_a_plain_module_accumulating_without_no_sync_is_refused(tmp_path):
    """The first micro-batch's backward averaged the gradients across replicas; the
    second one's would stay this replica's own: it raises, naming the fix, and no
    step commits."""
    out = tmp_path / "out"
    job = ft_job(tmp_path / "run", out, "none", 2, 1, "--steps", "2", "--no-no-sync")
    for replica, log in enumerate(logs_of_a_failed_run(job)):
        assert "UsageError" in log and "after the step's were averaged across replicas" in log, \
            log[-3000:]
        assert "with manager.no_sync(): loss.backward()" in log, log[-3000:]
        assert not job.committed(replica)


def test_a_killed_replica_catches_up_through_accumulation_and_clipping(tmp_path):
    """3 plain replicas, two micro-batches a step, clipped; replica 1 is SIGKILLed
    after step 4 commits and started again. Its catch-up step contributes zeros to
    the exchange at the end of its last backward and clips the others' average
    there; every step every replica records (norm, rate, parameters) is the same,
    every replica ends with the same model, optimizer and scheduler, and every
    sample is trained once."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    job = ft_job(run_dir, out, "none", 3, 1, "--steps", "100000", "--horizon", "40")
    job.start_all({1: "kill@after_commit:4"})
    try:
        end = restart_and_end_once_caught_up(job, 1, ahead=4)
        codes = job.wait_all(timeout=patience(180))
    finally:
        job.stop_everything()
    assert codes == {0: 0, 1: 0, 2: 0}, {r: job.log(r)[-3000:] for r in codes}
    caught_up = min(e.step for e in job.committed(1) if e.caught_up)
    reference = records(out, "ft-r0-k0")
    assert sorted(reference) == list(range(end))
    for replica in (1, 2):
        mine = records(out, f"ft-r{replica}-k0")
        assert replica != 1 or caught_up in mine
        assert all(mine[step] == reference[step] for step in mine), replica
    assert all(r["norm"] > MAX_NORM for r in reference.values())
    finals = [final(out, f"ft-r{r}-k0") for r in range(3)]
    assert len({f["state"] for f in finals}) == 1, finals
    summary = check_exactly_once(run_dir, 3, end)
    assert all(f["positions"] == list(summary.positions) for f in finals)


# ---------------------------------------------------------------- BackwardEnd, in process


class Checkpointed(torch.nn.Module):
    """Its first layer under a reentrant activation checkpoint: a backward of its own,
    nested in the script's, gives that layer its gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = checkpoint(self.first, x, use_reentrant=True)
        return self.last(hidden).sum()


def test_the_end_of_backward_comes_once_with_every_gradient_in():
    """Once per backward, at the end of the script's own (not of the checkpoint's
    nested one), after the callbacks queued later in it (DDP queues its own at the
    first gradient ready); an error there comes out of ``loss.backward()``."""
    torch.manual_seed(0)
    model = Checkpointed()
    order: list[object] = []

    def on_end() -> None:
        order.append([p.grad is not None for p in model.parameters()])
    BackwardEnd(model, on_end)
    queue = torch.autograd.Variable._execution_engine.queue_callback
    model.last.bias.register_post_accumulate_grad_hook(
        lambda p: queue(lambda: order.append("queued later")))
    x = torch.randn(3, 4, requires_grad=True)
    for _ in range(2):
        model.zero_grad()
        model(x).backward()
    assert order == ["queued later", [True] * 4] * 2
    failing = Checkpointed()
    BackwardEnd(failing, lambda: (_ for _ in ()).throw(UsageError("refused", hint="why")))
    with pytest.raises(UsageError, match="refused"):
        failing(x).backward()


def test_an_output_the_pytree_cannot_see_ends_where_the_gradients_are_reached():
    """A model that returns an object of its own: the end is queued from the first
    hook that sees the model's gradients (``gradients_reached``), once a backward."""
    class Boxed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> object:
            return type("Out", (), {"loss": self.layer(x).sum()})()

    model = Boxed()
    ends = []
    end = BackwardEnd(model, lambda: ends.append(model.layer.weight.grad is not None))
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: end.gradients_reached())
    model(torch.randn(2, 4)).loss.backward()
    assert ends == [True]
