"""Replicas start from one model (``runtime.identical_start``).

A script seeded per process builds a different model in every replica. Natively
DDP broadcasts rank 0's at construction, so the same script trains one model; under
ft-launch each replica is a torch world of its own. At the run's first step the
replicas compare digests of their models and, by default, every one takes the
lowest member's parameters and buffers over the ring: then the run is the native
one, bit for bit. With ``refuse`` every replica exits naming those that differ.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import torch

from ft_launch.config import FtarConfig
from ft_launch.errors import ExitCode
from ft_launch.ftar import FtarGroup
from ft_launch.ids import new_job_secret
from ft_launch.launcher.worker.local import LocalJob
from ft_launch.launcher.worker.protocol import QuorumView, ReplicaEndpoints, plan_step
from ft_launch.launcher.worker.torch_start import copy_model, model_digest
from tests.waiting import patience
from tests.worker.harness import logs_of_a_failed_run, run_torch_world

WORKER = Path(__file__).with_name("replicated_worker.py")
REPLICAS, STEPS = 2, 4
SECRET = new_job_secret()
CONFIG_ENV = {"FTL_QUORUM_JOIN_TIMEOUT": "1", "FTL_RUNTIME_MAX_CONSECUTIVE_FAILURES": "5"}


def worker_args(mode: str, out: Path, parallel: str) -> list[str]:
    return [sys.executable, str(WORKER), "--mode", mode, "--parallel", parallel, "--out",
            str(out), "--steps", str(STEPS), "--seed-apart"]


def run_native(out: Path) -> None:
    """One torch world of ``REPLICAS`` processes, one DDP model (rank 0's, broadcast)."""
    run_torch_world(worker_args("native", out, "ddp"), REPLICAS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel", ["ddp", "none"])
def test_replicas_seeded_apart_train_the_lowest_replicas_model_as_ddp_does(
        tmp_path: Path, parallel: str) -> None:
    out = tmp_path / "out"
    run_native(out)
    job = LocalJob(tmp_path / "run", replicas=REPLICAS,
                   command=worker_args("ft", out, parallel), config_env=CONFIG_ENV)
    job.start_all()
    try:
        codes = job.wait_all(timeout=patience(180))
    finally:
        job.stop_everything()
    assert codes == {r: 0 for r in range(REPLICAS)}, job.log(0)[-3000:]
    native = [json.loads((out / f"native-r{r}.json").read_text()) for r in range(REPLICAS)]
    ft = [json.loads((out / f"ft-r{r}.json").read_text()) for r in range(REPLICAS)]
    assert native[0]["state_sha256"] == native[1]["state_sha256"]
    for replica in range(REPLICAS):
        assert ft[replica]["state_sha256"] == native[0]["state_sha256"], replica
        assert ft[replica]["positions"] == native[0]["positions"]
    for replica in range(REPLICAS):   # every replica says so, once
        said = job.log(replica).count("started from another model than replica 0")
        assert said == 1, job.log(replica)[-3000:]


@pytest.mark.timeout(300)
def test_refuse_ends_every_replica_naming_those_that_differ(tmp_path: Path) -> None:
    job = LocalJob(tmp_path / "run", replicas=REPLICAS,
                   command=worker_args("ft", tmp_path / "out", "none"),
                   config_env={**CONFIG_ENV, "FTL_RUNTIME_IDENTICAL_START": "refuse"})
    logs = logs_of_a_failed_run(job)
    assert job.wait_all(timeout=1) == {r: int(ExitCode.FATAL_NO_REQUEUE)
                                       for r in range(REPLICAS)}
    for log in logs:
        assert "replica(s) 1 start from another model than replica 0" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    assert not (tmp_path / "out" / "ft-r0.json").exists()   # no step was trained


def test_the_first_step_names_the_members_whose_models_differ() -> None:
    def view(max_step: int, starts: dict[int, tuple[str, ...]],
             behind: tuple[int, ...] = ()) -> QuorumView:
        members = tuple((r, ReplicaEndpoints(((f"h{r}", 1),), ((f"h{r}", 2),), 0,
                                             start).encode())
                        for r, start in sorted(starts.items()))
        return QuorumView(quorum_id=1, max_step=max_step, members=members, behind=behind)

    apart = {0: ("a0", "a1"), 1: ("a0", "a1"), 2: ("b0", "a1"), 3: ()}
    plan = plan_step(view(0, apart), 1, 0, None, 0)
    assert (plan.diverged, plan.reference) == ((2, 3), ("a0", "a1"))
    alike = plan_step(view(0, {0: ("a",), 1: ("a",)}), 1, 0, None, 0)
    assert alike.diverged == ()
    # after the first commit nobody compares: a replica started fresh catches up instead
    later = plan_step(view(5, {0: (), 1: ("b",)}, behind=(1,)), 1, 0, None, 0)
    assert (later.diverged, later.reference) == ((), ())


class _Model(torch.nn.Module):
    """Parameters and buffers of every dtype the copy handles, -0.0 included."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(300, generator=generator)
        weight[:3] = torch.tensor([-0.0, 0.0, float("inf")])
        self.weight = torch.nn.Parameter(weight)
        self.bf16 = torch.nn.Parameter(torch.randn(70, generator=generator).bfloat16())
        self.fp16 = torch.nn.Parameter(torch.randn(5, generator=generator).half(),
                                       requires_grad=False)
        self.register_buffer("steps", torch.randint(0, 2**40, (4,), generator=generator))
        self.register_buffer("mask", torch.rand(9, generator=generator) > 0.5)


@pytest.mark.timeout(60)
def test_copy_model_gives_every_member_the_sources_bits() -> None:
    models = [_Model(seed) for seed in (11, 22, 33)]
    assert len({model_digest(m) for m in models}) == 3
    groups = [FtarGroup(FtarConfig(chunk_bytes=4096, timeout=10.0), SECRET)
              for _ in models]
    try:
        addresses = [g.address for g in groups]
        errors: list[BaseException] = []

        def member(index: int) -> None:
            try:
                groups[index].reconfigure(1, addresses, index)
                copy_model(models[index], groups[index], 0, source=index == 1)
            except BaseException as error:  # noqa: BLE001 - handed back to the test
                errors.append(error)

        threads = [threading.Thread(target=member, args=(i,)) for i in range(len(models))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=patience(30))
        assert errors == []
    finally:
        for group in groups:
            group.close()
    source = models[1].state_dict()
    for model in models:
        for name, tensor in model.state_dict().items():
            assert tensor.dtype == source[name].dtype
            assert torch.equal(tensor.view(torch.uint8), source[name].view(torch.uint8)), name
    assert len({model_digest(m) for m in models}) == 1
    assert torch.signbit(models[0].weight[0]) and not torch.signbit(models[0].weight[1])

