"""Torch front end: a snapshot restores model, optimizer, scheduler and RNG exactly."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ft_launch.ckpt.dual import numpy_allocator
from ft_launch.ckpt.snapshot import DualBufferSnapshotter
from ft_launch.ckpt.torch_state import (
    TorchStateSource,
    load_train_state,
    pinned_allocator,
)

pytestmark = pytest.mark.timeout(120)


def _make(device: str = "cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 2)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps: int, snapshotter=None, first_step: int = 0):
    losses = []
    device = next(model.parameters()).device
    for step in range(first_step, first_step + steps):
        x = torch.randn(32, 8, device=device)
        target = torch.from_numpy(np.random.standard_normal((32, 2)).astype(np.float32))
        loss = ((model(x) - target.to(device)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        if snapshotter is not None:
            snapshotter.wait_ready(timeout=30)
        optimizer.step()
        scheduler.step()
        if snapshotter is not None:
            snapshotter.start(step, TorchStateSource(model, optimizer, scheduler, step=step,
                                                     loader_state={"position": 32 * step}))
        losses.append(loss.item())
    return losses


def _resume_matches(device: str) -> None:
    model, optimizer, scheduler = _make(device)
    snapshotter = DualBufferSnapshotter(
        allocator=pinned_allocator if device == "cuda" else numpy_allocator)
    _train(model, optimizer, scheduler, 3, snapshotter)
    snapshotter.wait_complete(timeout=30)
    with snapshotter.lease() as snap:
        manifest, buffer = snap.manifest, snap.buffer.copy()
    expected = _train(model, optimizer, scheduler, 4)

    model2, optimizer2, scheduler2 = _make(device)
    for param in model2.parameters():
        param.data.add_(1.0)  # a different starting point: everything must come from the copy
    loaded = load_train_state(manifest, buffer, model2, optimizer2, scheduler2)
    assert (loaded.step, dict(loaded.loader_state)) == (2, {"position": 64})
    buffer[:] = 0  # the loaded state must not alias the buffer (reused by the next copy)
    assert _train(model2, optimizer2, scheduler2, 4) == expected


def test_resume_from_a_snapshot_reproduces_training_exactly():
    _resume_matches("cpu")


def test_layout_marks_buffers_and_rng_eager():
    model, optimizer, scheduler = _make()
    _train(model, optimizer, scheduler, 1)
    source = TorchStateSource(model, optimizer, scheduler, step=0)
    eager = {d.name for d in source.describe() if d.eager}
    assert {"model/1.running_mean", "model/1.running_var", "model/1.num_batches_tracked",
            "rng/torch", "rng/numpy"} <= eager
    assert "model/0.weight" not in eager and "optim/state/0/exp_avg" not in eager
    assert source.meta()["optim_param_groups"][0]["lr"] == pytest.approx(1e-2)


def test_bfloat16_state_round_trips():
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    snapshotter = DualBufferSnapshotter()
    snapshotter.start(1, TorchStateSource(model, step=1, rng=False))
    snapshotter.wait_complete(timeout=30)
    copy = torch.nn.Linear(4, 3).to(torch.bfloat16)
    with snapshotter.lease() as snap:
        assert snap.manifest.spec("model/weight").dtype == "bfloat16"
        load_train_state(snap.manifest, snap.buffer, copy, restore_rng=False)
    assert torch.equal(copy.weight, model.weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshot_on_its_own_stream_resumes_exactly():
    _resume_matches("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex128])
def test_non_contiguous_tensors_are_copied_exactly(dtype):
    base = torch.randn(6, 8) > 0 if dtype is torch.bool else (torch.randn(6, 8) * 9).to(dtype)
    module = torch.nn.Module()
    for name, tensor in {"t": base.t(), "strided": base[:, ::3], "scalar": base[2, 5]}.items():
        assert name == "scalar" or not tensor.is_contiguous()
        module.register_buffer(name, tensor)
    snapshotter = DualBufferSnapshotter()
    snapshotter.start(1, TorchStateSource(module, step=1, rng=False))
    snapshotter.wait_complete(timeout=30)
    with snapshotter.lease() as snap:
        for name, tensor in module.named_buffers():
            spec = snap.manifest.spec(f"model/{name}")
            copied = torch.from_numpy(spec.raw(snap.buffer).copy()).view(dtype).view(spec.shape)
            assert torch.equal(copied, tensor), name


def test_a_source_built_on_the_previous_one_describes_the_state_as_a_fresh_one():
    model, optimizer, scheduler = _make()
    _train(model, optimizer, scheduler, 1)
    first = TorchStateSource(model, optimizer, scheduler, step=0)
    _train(model, optimizer, scheduler, 1)
    again = TorchStateSource(model, optimizer, scheduler, step=1, previous=first)
    fresh = TorchStateSource(model, optimizer, scheduler, step=1)
    assert list(again.describe()) == list(fresh.describe())
    assert again.describe()[0] is first.describe()[0]     # the same object: kept
    model[0].weight = torch.nn.Parameter(torch.zeros(4, 8))   # another object, another shape
    changed = TorchStateSource(model, optimizer, scheduler, step=1, previous=again)
    assert list(changed.describe()) == list(TorchStateSource(model, optimizer, scheduler,
                                                             step=1).describe())
    assert next(d for d in changed.describe() if d.name == "model/0.weight").shape == (4, 8)
