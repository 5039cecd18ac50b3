"""One rank of a 2-rank FSDP2 replica (gloo, CPU), started by ``test_torch_sharded``.

Each scenario runs in every rank, asserts what a rank can see alone, and
writes what the test checks across ranks to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from ft_launch.ckpt.dual import SlotState
from ft_launch.ckpt.errors import LayoutMismatchError
from ft_launch.ckpt.manifest import Bytes, Manifest, plan_layout
from ft_launch.ckpt.resident import Residency, ResidentAdamW
from ft_launch.ckpt.snapshot import DualBufferSnapshotter
from ft_launch.ckpt.torch_state import (
    TorchStateSource,
    check_layout,
    layout_of,
    load_train_state,
    local_tensor,
)

#: (in, out) of the layers; 3 rows over 2 ranks is an uneven shard (2 and 1).
LAYERS = ((64, 256), (256, 256), (256, 3))
LR, WEIGHT_DECAY = 1e-2, 0.1
WAIT = 60.0  # seconds a rank waits for its own snapshot thread before calling it lost


def run(rank: int, world: int, store_path: str, out: str, scenario: str, *args: Any) -> None:
    """The entry point of ``torch.multiprocessing.start_processes``."""
    torch.set_num_threads(1)  # two ranks on a busy machine: no oversubscribed OpenMP teams
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        result = SCENARIOS[scenario](rank, mesh, *args)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        # Both ranks leave together: gloo aborts a rank whose peer tears the group
        # down while its own pairs still run
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and reported: leave without the interpreter's teardown, where a C++ thread
    # of torch's still joinable at exit can abort the process (std::terminate)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _plain(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in LAYERS:
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).to(dtype)


def _sharded(seed: int, mesh: DeviceMesh, dtype: torch.dtype = torch.float32,
             placement: Callable[[torch.nn.Parameter], Shard | None] | None = None
             ) -> torch.nn.Sequential:
    model = _plain(seed, dtype)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    return model


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)


def _backward(model: torch.nn.Module, step: int, rank: int) -> None:
    """Data parallel: each rank its own batch, the same one for every model."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    dtype = next(model.parameters()).dtype
    x = torch.randn(8, LAYERS[0][0], generator=generator).to(dtype)
    y = torch.randn(8, LAYERS[-1][1], generator=generator).to(dtype)
    model.zero_grad()
    ((model(x) - y) ** 2).mean().backward()


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
           rank: int) -> None:
    _backward(model, step, rank)
    optimizer.step()


def _snapshot(source: TorchStateSource, rank: int, world: int) -> tuple[Manifest, Bytes]:
    snapshots = DualBufferSnapshotter(rank=rank, world_size=world)
    assert snapshots.start(0, source)
    assert snapshots.wait_complete(timeout=WAIT) is SlotState.COMPLETE
    with snapshots.lease() as snap:
        return snap.manifest, snap.buffer.copy()


def _local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                 ) -> dict[str, torch.Tensor]:
    """Every parameter and moment of this rank, as local tensors (copies)."""
    out = {}
    for index, (name, p) in enumerate(model.named_parameters()):
        out[name] = local_tensor(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            if key in optimizer.state[p]:
                out[f"{index}/{key}"] = local_tensor(optimizer.state[p][key]).clone()
    return out


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bit-identical (dtype, shape and every bit)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not torch.equal(a[k].view(torch.uint8) if a[k].numel() else a[k],
                               b[k].view(torch.uint8) if b[k].numel() else b[k])]


def resume(rank: int, mesh: DeviceMesh, dtype_name: str) -> dict[str, Any]:
    """Snapshot after one step, load into another sharded model, step both once more."""
    dtype = getattr(torch, dtype_name)
    model, world = _sharded(0, mesh, dtype), mesh.size()
    optimizer = _adamw(model)
    _train(model, optimizer, 0, rank)
    manifest, buffer = _snapshot(TorchStateSource(model, optimizer, step=0, rng=False),
                                 rank, world)

    assert layout_of(model, optimizer) == manifest.meta["layout"]

    twin = _sharded(1, mesh, dtype)  # other values, and optimizer state of its own
    twin_optimizer = _adamw(twin)
    _train(twin, twin_optimizer, 7, rank)
    check_layout(manifest, twin, twin_optimizer)  # what a catch-up checks before fetching
    load_train_state(manifest, buffer, twin, twin_optimizer, restore_rng=False)
    buffer[:] = 0  # the loaded state must not alias the buffer (reused by the next copy)
    loaded = _differences(_local_state(model, optimizer), _local_state(twin, twin_optimizer))
    for p in twin.parameters():
        moment = twin_optimizer.state[p]["exp_avg"]
        assert isinstance(moment, DTensor) and moment.placements == p.placements
    _train(model, optimizer, 1, rank)
    _train(twin, twin_optimizer, 1, rank)
    stepped = _differences(_local_state(model, optimizer), _local_state(twin, twin_optimizer))

    plain = _plain(0, dtype)
    plain_optimizer = _adamw(plain)
    _train(plain, plain_optimizer, 0, rank)
    _, plain_total = plan_layout(TorchStateSource(plain, plain_optimizer, step=0,
                                                  rng=False).describe())
    sharded_bytes = torch.tensor([sum(s.nbytes for s in manifest.tensors
                                      if s.name in manifest.meta["layout"]["tensors"])])
    dist.all_reduce(sharded_bytes)
    return {"loaded_differs": loaded, "stepped_differs": stepped,
            "shapes": {s.name: list(s.shape) for s in manifest.tensors},
            "dtypes": {s.name: s.dtype for s in manifest.tensors},
            "layout": manifest.meta["layout"], "total_bytes": manifest.total_bytes,
            "plain_total_bytes": plain_total, "sharded_bytes_all_ranks": int(sharded_bytes),
            "global_bytes": sum(p.numel() * p.element_size() * 3 for p in plain.parameters())}


def _refused(manifest: Manifest, buffer: Bytes, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Try to load; the error, and whether the live objects were left alone."""
    before = _local_state(model, optimizer)
    try:
        load_train_state(manifest, buffer, model, optimizer, restore_rng=False)
    except LayoutMismatchError as exc:
        error = {"message": str(exc), "exit_code": int(exc.exit_code),
                 "stored": exc.stored, "live": exc.live}
    else:
        error = {"message": None}
    return {**error, "changed": _differences(before, _local_state(model, optimizer))}


def mismatch(rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    """States sharded otherwise than the live model are refused, the model untouched."""
    model, world = _sharded(0, mesh), mesh.size()
    optimizer = _adamw(model)
    _train(model, optimizer, 0, rank)
    sharded = _snapshot(TorchStateSource(model, optimizer, step=0, rng=False), rank, world)

    plain = _plain(3)
    plain_optimizer = _adamw(plain)
    _train(plain, plain_optimizer, 0, rank)
    into_plain = _refused(*sharded, plain, plain_optimizer)
    plain_state = _snapshot(TorchStateSource(plain, plain_optimizer, step=0, rng=False),
                            rank, world)
    into_sharded = _refused(*plain_state, model, optimizer)

    def columns(p: torch.nn.Parameter) -> Shard | None:
        return Shard(1) if p.ndim == 2 else None
    other = _sharded(4, mesh, placement=columns)
    other_optimizer = _adamw(other)  # never stepped: its moments are checked as its params
    into_columns = _refused(*sharded, other, other_optimizer)
    return {"into_plain": into_plain, "into_sharded": into_sharded,
            "into_columns": into_columns}


def resident(rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    """ResidentAdamW on FSDP2 shards against torch's AdamW(foreach=False), 3 steps."""
    world = mesh.size()
    reference = _sharded(0, mesh)
    reference_optimizer = _adamw(reference)
    model = _sharded(0, mesh)
    optimizer = ResidentAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    snapshots = DualBufferSnapshotter(rank=rank, world_size=world)
    residency = Residency(model, optimizer, snapshots, rng=False)
    differs, moments, layouts = [], [], []
    for step in range(3):
        _train(reference, reference_optimizer, step, rank)
        _backward(model, step, rank)
        snapshots.wait_ready(timeout=WAIT)
        optimizer.step()
        source = residency.source(step)
        snapshots.start(step, source)
        differs.append(_differences(_local_state(reference, reference_optimizer),
                                    _local_state(model, optimizer)))
        moments.append([id(optimizer.state[p][k]) for p in optimizer.params_in_order()
                        for k in ("exp_avg", "exp_avg_sq")])
        layouts.append(source.meta()["layout"])
    # the same objects from step to step, described once: and as a fresh description is
    fresh = TorchStateSource(model, optimizer, step=2, rng=False)
    reuse = {"moments_kept": moments[0] == moments[1] == moments[2],
             "layout_kept": layouts[1] is layouts[2],
             "layout_as_fresh": layouts[2] == fresh.meta()["layout"],
             "descs_as_fresh": list(source.describe()) == list(fresh.describe())}
    assert snapshots.wait_complete(timeout=WAIT) is SlotState.COMPLETE
    assert snapshots.stats.skipped == 0
    with snapshots.lease() as snap:
        assert snap.step == 2
        start, end = snap.buffer.ctypes.data, snap.buffer.ctypes.data + snap.buffer.nbytes
        inside = {name: start <= local_tensor(p).data_ptr() < end
                  for name, p in model.named_parameters()}
        restored = _sharded(2, mesh)
        restored_optimizer = _adamw(restored)
        load_train_state(snap.manifest, snap.buffer, restored, restored_optimizer)
    return {"differs": differs, "inside": inside,
            "local_rows": {n: local_tensor(p).shape[0] for n, p in model.named_parameters()},
            "restored_differs": _differences(_local_state(reference, reference_optimizer),
                                             _local_state(restored, restored_optimizer)),
            "refusal": _refusal_without_the_fsdp_hook(mesh), "reuse": reuse}


def _refusal_without_the_fsdp_hook(mesh: DeviceMesh) -> str | None:
    """What Residency says when FSDP2 lacks the private hook it relies on."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    hook = FSDPParam.reset_sharded_param
    del FSDPParam.reset_sharded_param  # as in a torch whose FSDP2 internals moved
    try:
        model = _sharded(5, mesh)
        optimizer = ResidentAdamW(model.parameters())
        Residency(model, optimizer, DualBufferSnapshotter(), rng=False)
    except TypeError as exc:
        assert optimizer.homes is None  # unbound: still an in-place Adam to fall back on
        return str(exc)
    finally:
        FSDPParam.reset_sharded_param = hook
    return None


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "resume": resume, "mismatch": mismatch, "resident": resident,
}
