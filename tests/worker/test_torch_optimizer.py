"""``FtOptimizer`` is a ``torch.optim.Optimizer``: a user's loop with torch's LR
scheduler (or a learning rate set by hand), ``zero_grad`` at either end of the loop
body, its own checkpoint and its own RNG trains as the same loop does natively, bit
for bit; the registered objects ride in snapshots, so a replica killed and started
again continues the schedule at the right step.

Native (``loop_worker.py --mode native``): one process, each step the replicas'
batches averaged as DDP averages them (with two replicas, the very sums FTAR makes).
The in-process tests below check the parts one by one: the learning rate a step
uses, a dropped step undone, the state codec.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ft_launch.launcher.worker.audit import check_exactly_once
from ft_launch.launcher.worker.local import LocalJob
from tests.waiting import patience

from .harness import TEST_CONFIG, logs_of_a_failed_run, restart_and_end_once_caught_up

torch = pytest.importorskip("torch")

from ft_launch.ckpt.snapshot import DualBufferSnapshotter
from ft_launch.ckpt.torch_state import (
    decode_state,
    encode_state,
)
from ft_launch.errors import UsageError
from ft_launch.launcher.worker.torch_api import TorchTrainState

from . import loop_worker

pytestmark = pytest.mark.timeout(240)

WORKER = Path(loop_worker.__file__)
STEPS = 12


def run_native(out: Path, *args: str) -> None:
    subprocess.run([sys.executable, str(WORKER), "--mode", "native", "--out", str(out), *args],
                   check=True, timeout=patience(120))


def ft_job(run_dir: Path, out: Path, replicas: int, *args: str, **config: str) -> LocalJob:
    return LocalJob(run_dir, replicas,
                    [sys.executable, str(WORKER), "--mode", "ft", "--out", str(out), *args],
                    {**TEST_CONFIG, **config})


def run_ft(run_dir: Path, out: Path, replicas: int, *args: str,
           injects: dict[int, str] | None = None) -> LocalJob:
    job = ft_job(run_dir, out, replicas, *args)
    job.start_all(injects)
    try:
        codes = job.wait_all(timeout=patience(180))
    finally:
        job.stop_everything()
    assert codes == dict.fromkeys(range(replicas), 0), {r: job.log(r)[-3000:] for r in codes}
    return job


def records(out: Path, name: str) -> dict[int, dict]:
    """The committed steps of one run, by step (a step committed again after a
    rollback would replace its first record: none is here)."""
    lines = (out / f"{name}.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def final(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}-final.json").read_text())


def expected_lr(step: int, factor: float = 1.0, horizon: int = STEPS) -> float:
    """What ``LambdaLR`` (and the hand-set schedule) give step ``step``, times the
    replica LR factor: the same operations, so the same bits."""
    lr = loop_worker.BASE_LR * loop_worker.schedule(step, horizon)
    return lr * factor if factor != 1.0 else lr


# ---------------------------------------------------------------- native vs ft-launch


@pytest.mark.parametrize(("schedule", "zero_grad", "dropped"), [
    ("lambda", "start", None), ("lambda", "end", None), ("manual", "start", None),
    ("lambda", "start", 5)])
def test_a_loop_with_a_schedule_trains_as_natively_bit_for_bit(tmp_path, schedule, zero_grad,
                                                               dropped):
    """2 replicas x 1 rank: every step's learning rate is the schedule's and every
    step's parameters are native's, on both replicas; ``zero_grad`` at the end of the
    loop body works as at its start. ``dropped``: a NaN in replica 0's gradients of
    that step makes every replica drop it and train it again; the loop steps its
    scheduler after the dropped step too, as scripts do, and the schedule still is
    native's (the script's RNG is left out there: it draws before the step starts,
    so the step trained again draws anew). Before: ``LambdaLR(FtOptimizer)`` raised
    TypeError, a hand-set rate was overwritten by the one at ``ft_manager()``,
    ``zero_grad`` at the end raised ``start_step() first``."""
    out = tmp_path / "out"
    out.mkdir()
    args = ["--steps", str(STEPS), "--schedule", schedule, *(["--rng"] if dropped is None else [])]
    run_native(out, *args)
    run_ft(tmp_path / "run", out, 2, *args, "--zero-grad", zero_grad,
           injects=None if dropped is None else {0: f"nan@gradients:{dropped}"})
    native = records(out, "native-r0")
    assert sorted(native) == list(range(STEPS))
    assert [native[s]["lr"] for s in range(STEPS)] == [expected_lr(s) for s in range(STEPS)]
    tries = STEPS + (dropped is not None)
    for replica in (0, 1):
        assert records(out, f"ft-r{replica}") == native, replica
        seen = final(out, f"ft-r{replica}")
        assert (seen["commits"], seen["steps"]) == (STEPS, tries)
        # torch's step hooks ran around every step(); LambdaLR saw optimizer.step() first
        assert seen["calls"] == {"pre": tries, "post": tries}
        assert not [w for w in seen["warnings"] if "lr_scheduler" in w], seen["warnings"]
    assert final(out, "ft-r0")["state"] == final(out, "ft-r1")["state"]


def test_a_second_commit_of_one_step_is_refused(tmp_path):
    """It would step the optimizer again and count the step's samples twice (the next
    batch skipped without a word): it raises, naming the fix, after the first."""
    out = tmp_path / "out"
    job = ft_job(tmp_path / "run", out, 2, "--commit-again")
    for replica, log in enumerate(logs_of_a_failed_run(job)):
        assert "UsageError" in log and "commit() called twice for step 0" in log, log[-3000:]
        assert [e.step for e in job.committed(replica)] == [0]


def test_a_script_resumes_from_its_own_checkpoint_through_load_state_dict(tmp_path):
    """The script's checkpoint of step 5 (model, ``optimizer.state_dict()``,
    scheduler, RNG) loaded into a fresh ft-launch run through
    ``FtOptimizer.load_state_dict``: steps 6.. are native's, bit for bit (Adam's
    moments and step count came through). Before: FtOptimizer had no load_state_dict."""
    out, checkpoint = tmp_path / "out", tmp_path / "own.pt"
    out.mkdir()
    run_native(out, "--steps", str(STEPS), "--rng", "--checkpoint", str(checkpoint),
               "--save-at", "5")
    run_ft(tmp_path / "run", out, 2, "--steps", str(STEPS - 6), "--rng",
           "--checkpoint", str(checkpoint))
    native = records(out, "native-r0")
    for replica in (0, 1):
        resumed = records(out, f"ft-r{replica}")
        assert sorted(resumed) == list(range(6, STEPS))
        assert all(resumed[s] == native[s] for s in resumed), replica


# ---------------------------------------------------------------- kill and catch up


def test_a_replica_killed_and_started_again_continues_the_schedule(tmp_path):
    """3 replicas, LambdaLR and the script's RNG registered; replica 1 is SIGKILLed
    after step 6 commits and started again. It catches up from the others: at the
    catch-up step and every step after it steps with the schedule's rate of that
    step (times the replica LR factor the step's contributors give), and every
    replica ends with the same model, optimizer, scheduler and RNG state; every
    sample is trained once. Before the registered state rode in the snapshots the
    newcomer's scheduler started over (and LambdaLR would not take FtOptimizer)."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    horizon = 20_000       # the run is ended (end-step) long before: a rate per step
    job = ft_job(run_dir, out, 3, "--steps", "100000", "--horizon", str(horizon), "--rng")
    job.start_all({1: "kill@after_commit:6"})
    try:
        end = restart_and_end_once_caught_up(job, 1, ahead=15)
        codes = job.wait_all(timeout=patience(180))
    finally:
        job.stop_everything()
    assert codes == {0: 0, 1: 0, 2: 0}, {r: job.log(r)[-3000:] for r in codes}
    caught_up = min(e.step for e in job.committed(1) if e.caught_up)
    assert caught_up < horizon
    for replica in range(3):
        factors = {e.step: e.lr_factor for e in job.committed(replica)}
        steps = records(out, f"ft-r{replica}")
        assert max(steps) == end - 1 and (replica != 1 or caught_up in steps), replica
        for step, record in steps.items():
            assert record["lr"] == expected_lr(step, factors[step], horizon), (replica, step)
    finals = [final(out, f"ft-r{r}") for r in range(3)]
    assert len({f["state"] for f in finals}) == 1, finals
    summary = check_exactly_once(run_dir, 3, end)
    assert all(f["positions"] == list(summary.positions) for f in finals)


# ---------------------------------------------------------------- in process


def model_and_scheduler(lr: float = 0.1):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    optimizer.step()    # no gradients: changes nothing (the scheduler asks for a step first)
    return model, optimizer, scheduler


def test_the_step_uses_the_scripts_rate_times_the_factor_and_puts_it_back():
    model, optimizer, scheduler = model_and_scheduler()
    state = TorchTrainState(model, optimizer)
    used = []
    optimizer.register_step_pre_hook(lambda opt, a, k: used.append(opt.param_groups[0]["lr"]))
    for step in range(3):
        model(torch.ones(1, 3)).sum().backward()
        state.apply(0.5)
        scheduler.step()
    assert used == [0.1 * (1.0 / (s + 1)) * 0.5 for s in range(3)]
    assert optimizer.param_groups[0]["lr"] == 0.1 * (1.0 / 4)   # the scheduler's, unscaled


def test_a_dropped_step_leaves_no_trace_in_registered_objects():
    """After a step that returned False the loop steps its scheduler (and counters)
    anyway; the next step begins where the dropped one did."""
    model, optimizer, scheduler = model_and_scheduler()
    state = TorchTrainState(model, optimizer)
    state.register_state("scheduler", scheduler)
    scheduler.step()
    before = (scheduler.state_dict(), optimizer.param_groups[0]["lr"])
    state.zero_gradients()          # the manager drops the step
    scheduler.step()                # the loop goes on regardless
    assert scheduler.last_epoch == 2
    state.begin_step()
    assert (scheduler.state_dict(), optimizer.param_groups[0]["lr"]) == before


def test_registered_state_round_trips_a_snapshot_exactly():
    """Tensors (an RNG state) go to the flat layout, the rest to JSON; tuples and
    non-string keys come back as they were."""
    class Holder:
        def __init__(self) -> None:
            self.value: dict = {}

        def state_dict(self) -> dict:
            return self.value

        def load_state_dict(self, state: dict) -> None:
            self.value = state

    model, optimizer, scheduler = model_and_scheduler()
    state = TorchTrainState(model, optimizer)
    holder = Holder()
    holder.value = {"rng": torch.Generator().manual_seed(3).get_state(), "pair": (1, 2.5),
                    "by_step": {4: "x", (5, 6): [None, True]}, "__tensor__": "mine"}
    state.register_state("holder", holder)
    state.register_state("scheduler", scheduler)
    scheduler.step()
    snapshots = DualBufferSnapshotter()
    snapshots.start(0, state.snapshot_source(0, {}))
    snapshots.wait_complete(timeout=30)
    expected = dict(holder.value)
    with snapshots.lease() as snap:
        assert any(t.name == "state/0" for t in snap.manifest.tensors)
        twin_model, twin_optimizer, twin_scheduler = model_and_scheduler()
        twin = TorchTrainState(twin_model, twin_optimizer)
        twin.register_state("scheduler", twin_scheduler)
        twin.load(snap.manifest, snap.buffer)
    assert twin.registered.pending.keys() == {"holder"}   # not registered there: kept
    loaded = twin.registered.pending["holder"]
    assert torch.equal(loaded.pop("rng"), expected.pop("rng"))
    assert loaded == expected
    assert twin_scheduler.state_dict() == scheduler.state_dict()
    late = Holder()
    twin.register_state("holder", late)      # loaded on registration
    assert late.value["pair"] == (1, 2.5)


def test_a_state_a_snapshot_cannot_hold_is_refused_naming_the_object_and_key():
    import numpy as np

    class Loader:
        def state_dict(self) -> dict:
            return {"epoch": 1, "order": {"seed": 3, "perm": np.arange(4)}}

        def load_state_dict(self, state: dict) -> None:
            pass

    model, optimizer, _ = model_and_scheduler()
    state = TorchTrainState(model, optimizer)
    with pytest.raises(UsageError, match=r"register_state\('loader'\), a Loader: the state "
                                         r"at 'loader/order/perm' is a ndarray"):
        state.register_state("loader", Loader())
    with pytest.raises(UsageError, match="has no state_dict"):
        state.register_state("counter", 3)


def test_the_codec_keeps_types():
    value = {"a": (1, [2.0, None]), 3: {"b": torch.arange(3)}, "s": "t", "f": float("inf")}
    encoded, tensors = encode_state(value)
    json.dumps(encoded)
    back = decode_state(json.loads(json.dumps(encoded)), tensors)
    assert torch.equal(back[3]["b"], torch.arange(3))
    back[3] = value[3]
    assert back == value


def torch_schedulers(optimizer):
    lr = torch.optim.lr_scheduler
    return {
        "lambda": lambda: lr.LambdaLR(optimizer, lambda s: 0.9 ** s),
        "cosine": lambda: lr.CosineAnnealingLR(optimizer, T_max=7),
        "one_cycle": lambda: lr.OneCycleLR(optimizer, max_lr=0.5, total_steps=20),
        "sequential": lambda: lr.SequentialLR(
            optimizer, [lr.LinearLR(optimizer, 0.1, total_iters=3),
                        lr.CosineAnnealingLR(optimizer, T_max=9)], milestones=[3]),
        "plateau": lambda: lr.ReduceLROnPlateau(optimizer, patience=0),
    }


@pytest.mark.parametrize("kind", ["lambda", "cosine", "one_cycle", "sequential", "plateau"])
def test_torch_schedulers_ride_in_a_snapshot_and_continue_exactly(kind):
    """Registered, each of torch's schedulers loads back into a twin that then goes on
    with the very learning rates the original does."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch_schedulers(optimizer)[kind]()
        optimizer.step()
        return model, optimizer, scheduler

    def advance(scheduler, steps):
        rates = []
        for _ in range(steps):
            scheduler.step(*([1.0] if kind == "plateau" else []))   # a loss that stalls
            rates.append(scheduler.optimizer.param_groups[0]["lr"])
        return rates

    model, optimizer, scheduler = build()
    state = TorchTrainState(model, optimizer)
    state.register_state("scheduler", scheduler)
    advance(scheduler, 4)
    snapshots = DualBufferSnapshotter()
    snapshots.start(4, state.snapshot_source(4, {}))
    snapshots.wait_complete(timeout=30)
    twin_model, twin_optimizer, twin_scheduler = build()
    twin = TorchTrainState(twin_model, twin_optimizer)
    twin.register_state("scheduler", twin_scheduler)
    with snapshots.lease() as snap:
        twin.load(snap.manifest, snap.buffer)
    assert twin_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert advance(twin_scheduler, 6) == advance(scheduler, 6)


def test_add_param_group_reduces_the_new_parameters_and_refuses_foreign_ones():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
    state = TorchTrainState(model, optimizer)
    assert len(state.params) == 2
    model[0].requires_grad_(True)           # unfrozen: trained from now on
    state.add_param_group({"params": model[0].parameters(), "lr": 0.01})
    assert len(state.params) == 4 and len(optimizer.param_groups) == 2
    with pytest.raises(UsageError, match="not a parameter of the model"):
        state.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})


def test_a_scheduler_built_after_a_restore_goes_on_from_the_restored_step():
    """The manager restores before the script builds its scheduler (which sets the
    rate it starts with): registering it loads its state and the restored rate."""
    model, optimizer, scheduler = model_and_scheduler()
    state = TorchTrainState(model, optimizer)
    state.register_state("scheduler", scheduler)
    for _ in range(3):
        scheduler.step()
    snapshots = DualBufferSnapshotter()
    snapshots.start(2, state.snapshot_source(2, {}))
    snapshots.wait_complete(timeout=30)
    torch.manual_seed(0)
    twin_model = torch.nn.Linear(3, 2)
    twin_optimizer = torch.optim.SGD(twin_model.parameters(), lr=0.1)
    twin = TorchTrainState(twin_model, twin_optimizer)
    with snapshots.lease() as snap:
        twin.load(snap.manifest, snap.buffer)              # in ft_manager()
    twin_scheduler = torch.optim.lr_scheduler.LambdaLR(twin_optimizer, lambda s: 1.0 / (s + 1))
    assert twin_optimizer.param_groups[0]["lr"] == 0.1     # the scheduler's first rate
    twin.register_state("scheduler", twin_scheduler)
    assert twin_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    twin_optimizer.step()
    scheduler.step()
    twin_scheduler.step()
    assert twin_scheduler.state_dict() == scheduler.state_dict()
    assert twin_optimizer.param_groups[0]["lr"] == 0.1 * (1.0 / 5)
