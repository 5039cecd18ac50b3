"""Test plumbing: a training-side member process using FTAR through torch.

It runs a tiny model under DDP with the worker's comm hook (DDP over a
one-process gloo group: the replica; FTAR on the exchange thread) and, on a copy
of the same model, plain backward; then
the tensor front end on several dtypes. It returns inputs and outputs as numpy
arrays, so the test process never imports torch.
"""

from __future__ import annotations

import copy
import os
from multiprocessing.connection import Connection
from typing import Any

import numpy as np


def member_main(conn: Connection, index: int, secret: str, store_path: str) -> None:
    import faulthandler
    import sys

    # if this member hangs, its stacks reach the test's captured output before the
    # test gives up on it
    faulthandler.dump_traceback_later(60, file=sys.stderr)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ft_launch.config import FtarConfig
    from ft_launch.ftar import FtarGroup, ReduceOp
    from ft_launch.ftar.torch_frontend import allreduce_tensor
    from ft_launch.launcher.worker.exchange import StepWork
    from ft_launch.launcher.worker.manager import Reduction
    from ft_launch.launcher.worker.torch_hooks import DdpExchange

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0,
                            world_size=1)
    group = FtarGroup(FtarConfig(chunk_bytes=4096, timeout=20.0), secret)
    conn.send(group.address)
    group.reconfigure(1, conn.recv(), index)
    out: dict[str, Any] = {}

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8))
    plain = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.004)   # several buckets
    work = StepWork()
    this_step = Reduction(group, 0, True)

    def submit(reduce: Any, after: Any = None) -> Any:
        return work.submit(lambda: reduce(this_step), after)

    exchange = DdpExchange(ddp, submit)
    for step, contributes in enumerate([True, index == 0]):
        gen = torch.Generator().manual_seed(1000 * step + index)
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        this_step = Reduction(group, step, contributes)
        work.begin(lambda: None)
        ddp.zero_grad()
        plain.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        torch.nn.functional.mse_loss(plain(x), y).backward()
        assert work.wait() is None
        out[f"buckets{step}"] = exchange.calls
        exchange.reset()
        out[f"ddp{step}"] = [p.grad.numpy().copy() for p in ddp.parameters()]
        out[f"plain{step}"] = [p.grad.numpy().copy() for p in plain.parameters()]
    work.close()

    gen = torch.Generator().manual_seed(77 + index)
    for name, dtype in [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                        ("float32", torch.float32)]:
        for stage in (False, True):       # stage=True: the pinned-staging (device) path
            tensor = torch.randn(3001, generator=gen).to(dtype)
            out[f"in-{name}-{stage}"] = tensor.float().numpy().copy()
            allreduce_tensor(group, tensor, ReduceOp.AVG, step=5, stage=stage)
            out[f"out-{name}-{stage}"] = tensor.float().numpy().copy()
    strided = torch.randn(40, 30, generator=gen).t()       # not contiguous
    out["in-strided"] = strided.numpy().copy()
    allreduce_tensor(group, strided, ReduceOp.SUM)
    out["out-strided"] = strided.numpy().copy()
    conn.send({k: (np.asarray(v) if not isinstance(v, list) else v) for k, v in out.items()})
    group.close()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
