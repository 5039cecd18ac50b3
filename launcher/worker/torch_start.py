"""Replicas start from one model (imports torch: training side only).

Each replica builds its model itself, and a script seeded per process (``seed +
RANK``, whose RANK restarts at 0 in every replica; a per-replica seed) builds a
different one in each. DDP hides this inside one torch world: it broadcasts rank
0's parameters and buffers at construction. Across replicas the manager compares
digests of every rank's model at the run's first step (``Manager.start_step``) and,
where they differ, ``copy_model`` makes every member's the lowest member's.

The copy is a SUM over the rank's FTAR ring to which every replica but the source
adds negative zero: ``x + -0.0`` is ``x`` for every float, zeros' signs included, so
the result is the source's bits (FTAR widens half types to float32 to add, exactly).
Tensors of other dtypes (integer counters, boolean masks) travel as float64, exact
below 2^53; the digest check after the copy catches anything that is not.
"""

from __future__ import annotations

import hashlib

import torch

from ft_launch.ckpt.torch_state import local_tensor
from ft_launch.ftar import FtarGroup, ReduceOp
from ft_launch.ftar.torch_frontend import allreduce_tensor

#: dtypes FTAR reduces as they are; the rest go as float64
_RING_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's parameters (a sharded one's local shard) and buffers, in the
    module's order (the same in every replica of the same script)."""
    return [local_tensor(t).detach() for t in (*model.parameters(), *model.buffers())]


def model_digest(model: torch.nn.Module) -> str:
    """A digest of the bytes of this rank's parameters and buffers (16 hex digits)."""
    digest = hashlib.blake2b(digest_size=8)
    for tensor in model_tensors(model):
        digest.update(str((tensor.dtype, tuple(tensor.shape))).encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data)
    return digest.hexdigest()


def copy_model(model: torch.nn.Module, ftar: FtarGroup, step: int, source: bool) -> None:
    """Make this rank's parameters and buffers the ``source`` replica's (its same rank),
    bit for bit: every member of the ring calls this, the source with ``source=True``."""
    tensors = model_tensors(model)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        wire = tensor.dtype if tensor.dtype in _RING_DTYPES else torch.float64
        by_dtype.setdefault(wire, []).append(tensor)
    with torch.no_grad():
        for wire, group in by_dtype.items():
            if source:
                flat = torch.cat([t.reshape(-1).to(wire) for t in group])
            else:
                flat = torch.full((sum(t.numel() for t in group),), -0.0, dtype=wire,
                                  device=group[0].device)
            allreduce_tensor(ftar, flat, ReduceOp.SUM, step=step)
            offset = 0
            for tensor in group:
                tensor.copy_(flat[offset:offset + tensor.numel()].view(tensor.shape))
                offset += tensor.numel()
