"""Resident state: Adam's step writes into the snapshot buffer; nothing big is copied.

Checked against torch's own Adam / AdamW bit for bit, and against the dual
buffer's promises: the previous snapshot stays intact while a step writes the
next, a reader is waited for (bounded), loading a state never edits a snapshot.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ft_launch.ckpt.resident import Residency, ResidentAdam, ResidentAdamW
from ft_launch.ckpt.restore import MemoryTier, RestoreChain
from ft_launch.ckpt.snapshot import DualBufferSnapshotter
from ft_launch.ckpt.torch_state import TorchStateSource, load_train_state

pytestmark = pytest.mark.timeout(120)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12),
                               torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 6, generator=generator), torch.randn(16, 3, generator=generator)


def _backward(model: torch.nn.Module, step: int) -> None:
    x, y = _batch(step)
    model.zero_grad(set_to_none=False)
    ((model(x) - y) ** 2).mean().backward()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    out = {f"p{i}": p.detach().numpy().copy() for i, p in enumerate(model.parameters())}
    for i, p in enumerate(model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}{i}"] = optimizer.state[p][key].numpy().copy()
    return out


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert np.array_equal(value, b[key]), key


class Resident:
    """A model trained with ResidentAdam and a snapshot every step."""

    def __init__(self, decoupled: bool, wait: float = 5.0) -> None:
        self.model = _model()
        self.optimizer = (ResidentAdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
                          if decoupled else
                          ResidentAdam(self.model.parameters(), lr=1e-2, weight_decay=0.1))
        self.snapshots = DualBufferSnapshotter()
        self.residency = Residency(self.model, self.optimizer, self.snapshots, wait=wait)

    def step(self, step: int) -> None:
        _backward(self.model, step)
        self.snapshots.wait_ready(timeout=30)
        self.optimizer.step()
        self.snapshots.start(step, self.residency.source(step, {"position": step}))

    def trained(self, steps: int) -> Resident:
        """After ``steps`` steps, every snapshot complete."""
        for step in range(steps):
            self.step(step)
        self.snapshots.wait_complete(timeout=30)
        return self


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam-l2", "adamw"])
def test_same_numbers_as_torch_bit_for_bit(decoupled):
    reference = _model()
    torch_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    torch_opt = torch_class(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    unbound_model = _model()
    unbound = ResidentAdam(unbound_model.parameters(), lr=1e-2, weight_decay=0.1,
                           decoupled_weight_decay=decoupled)
    resident = Resident(decoupled)
    for step in range(6):
        for model, optimizer in ((reference, torch_opt), (unbound_model, unbound)):
            _backward(model, step)
            optimizer.step()
        resident.step(step)
    expected = _state(reference, torch_opt)
    _assert_same(expected, _state(unbound_model, unbound))
    _assert_same(expected, _state(resident.model, resident.optimizer))


def test_parameters_live_in_the_newest_snapshot_and_the_previous_one_stays_intact():
    run = Resident(decoupled=True).trained(1)
    with run.snapshots.lease() as snap:
        before = snap.buffer.copy()
        start, end = snap.buffer.ctypes.data, snap.buffer.ctypes.data + snap.buffer.nbytes
        assert snap.step == 0
    # No copy: every parameter's memory is inside the newest snapshot's buffer.
    assert all(start <= p.data_ptr() < end for p in run.model.parameters())
    live = _state(run.model, run.optimizer)
    _backward(run.model, 1)
    run.optimizer.step()          # writes step 1 into the other buffer...
    with run.snapshots.lease() as snap:
        assert snap.step == 0      # ...while step 0 is still the newest complete one
        assert np.array_equal(snap.buffer, before)
        restored = _model(seed=5)
        load_train_state(snap.manifest, snap.buffer, restored)
        _assert_same({k: v for k, v in live.items() if k.startswith("p")},
                     {f"p{i}": p.detach().numpy() for i, p in enumerate(restored.parameters())})
    run.snapshots.start(1, run.residency.source(1))
    run.snapshots.wait_complete(timeout=30)
    assert run.snapshots.buffers.complete_steps() == [0, 1]
    assert not any(start <= p.data_ptr() < end for p in run.model.parameters())


def test_a_step_waits_for_a_reader_of_the_buffer_it_writes():
    run = Resident(decoupled=False, wait=30.0).trained(2)
    # Step 2 writes where step 0 is: hold a lease on step 0 meanwhile.
    with run.snapshots.lease(0):
        _backward(run.model, 2)
        done = threading.Event()
        stepper = threading.Thread(target=lambda: (run.optimizer.step(), done.set()))
        stepper.start()
        assert not done.wait(0.3)   # bounded check: it is waiting for the lease
    stepper.join(30)
    assert done.is_set()
    run.snapshots.start(2, run.residency.source(2))
    run.snapshots.wait_complete(timeout=30)
    assert run.snapshots.buffers.complete_steps() == [1, 2]


def test_a_reader_holding_on_makes_the_step_run_in_private_memory_and_skip_its_snapshot():
    run = Resident(decoupled=True, wait=0.05).trained(2)
    twin = Resident(decoupled=True).trained(2)
    with run.snapshots.lease(1) as newest:
        newest_bytes = newest.buffer.copy()
        with run.snapshots.lease(0) as oldest:
            oldest_bytes = oldest.buffer.copy()
            run.step(2)   # both buffers read: no wait beyond 0.05 s, no exception
            assert np.array_equal(oldest.buffer, oldest_bytes)
            assert np.array_equal(newest.buffer, newest_bytes)
    assert run.snapshots.stats.skipped == 1
    assert run.snapshots.buffers.complete_steps() == [0, 1]
    twin.step(2)
    _assert_same(_state(twin.model, twin.optimizer), _state(run.model, run.optimizer))
    # Once the readers are gone the next step is resident again.
    run.step(3)
    run.snapshots.wait_complete(timeout=30)
    with run.snapshots.lease(3) as snap:
        start = snap.buffer.ctypes.data
        assert all(start <= p.data_ptr() < start + snap.buffer.nbytes
                   for p in run.model.parameters())


def test_loading_a_state_after_release_leaves_every_snapshot_as_it_was():
    run = Resident(decoupled=True).trained(3)
    with run.snapshots.lease(1) as old:
        old_manifest, old_bytes = old.manifest, old.buffer.copy()
    with run.snapshots.lease(2) as new:
        new_bytes = new.buffer.copy()
    run.residency.release()
    with run.snapshots.lease(1) as old:
        load_train_state(old.manifest, old.buffer, run.model, run.optimizer)
    for step, expected in ((1, old_bytes), (2, new_bytes)):
        with run.snapshots.lease(step) as snap:
            assert np.array_equal(snap.buffer, expected), f"snapshot of step {step} changed"
    # Training goes on from step 1's state exactly as a fresh run resumed there.
    run.step(3)
    twin = Resident(decoupled=True)
    twin.residency.release()
    load_train_state(old_manifest, old_bytes, twin.model, twin.optimizer)
    twin.step(3)
    _assert_same(_state(twin.model, twin.optimizer), _state(run.model, run.optimizer))


def test_the_restore_chain_reads_a_resident_snapshot():
    run = Resident(decoupled=True).trained(2)
    live = _state(run.model, run.optimizer)
    restored = RestoreChain([MemoryTier(run.snapshots.buffers)], rank=0).restore()
    assert restored.step == 1 and restored.manifest.checksummed
    model = _model(seed=9)
    optimizer = torch.optim.AdamW(model.parameters())
    load_train_state(restored.manifest, restored.buffer, model, optimizer)
    _assert_same(live, _state(model, optimizer))


def test_a_snapshot_laid_out_otherwise_than_the_claim_is_refused():
    run = Resident(decoupled=False)
    _backward(run.model, 0)
    run.optimizer.step()
    other_layout = TorchStateSource(run.model, run.optimizer, step=0, rng=False)
    with pytest.raises(ValueError, match="laid out otherwise"):
        run.snapshots.start(0, other_layout)


def test_bad_hyperparameters_and_foreign_parameters_are_refused():
    with pytest.raises(ValueError, match="betas"):
        ResidentAdam(_model().parameters(), betas=(0.9, 1.5))
    stray = torch.nn.Parameter(torch.zeros(2))
    optimizer = ResidentAdam([*_model().parameters(), stray])
    with pytest.raises(ValueError, match="not a parameter of the model"):
        Residency(_model(), optimizer, DualBufferSnapshotter())
