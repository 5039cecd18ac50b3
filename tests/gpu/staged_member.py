"""Test plumbing: an FTAR member process that reduces the same inputs through the
CPU path (numpy, in place) and through pinned staging on ``device``, and checks
how the staged path orders its device work against the caller's streams.

Started with the spawn context (CUDA cannot be forked); every member runs the
same calls in the same order. Results go back as numpy arrays of raw bits, so the
test process compares them without importing torch.
"""

from __future__ import annotations

import faulthandler
import sys
from multiprocessing.connection import Connection
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
SIZES = (1, 7, 50_001)            # one element, fewer than a chunk, many chunks
#: GPU clock cycles the caller's stream spins before it writes the input: long
#: enough that a copy which did not wait for it would read the old contents.
ORDER_SPIN_CYCLES = 200_000_000
#: Cycles an unrelated stream spins while a reduction runs (about a second at the
#: H200's clock): a device-wide synchronize would wait for all of them.
BUSY_SPIN_CYCLES = 2_000_000_000


def member_main(conn: Connection, index: int, secret: str, device_name: str) -> None:
    # if this member hangs, its stacks reach the test's captured output before the
    # test gives up on it
    faulthandler.dump_traceback_later(50, file=sys.stderr)
    from ft_launch.config import FtarConfig
    from ft_launch.ftar import FtarGroup

    group = FtarGroup(FtarConfig(chunk_bytes=4096, timeout=20.0), secret)
    conn.send(group.address)
    members = conn.recv()
    group.reconfigure(1, members, index)
    out: dict[str, Any] = {}
    try:
        out.update(_same_bits(group, index, len(members), device_name))
        if device_name.startswith("cuda"):
            out.update(_stream_order(group, index, device_name))
        conn.send(out)
    finally:
        group.close()
        faulthandler.cancel_dump_traceback_later()


def _cases(members: int, index: int) -> list[tuple[str, str, bool]]:
    """(name, op, contributes): the same list on every member."""
    return [("sum", "SUM", True), ("avg", "AVG", True),
            # the last member catches up: zeros, left out of the average
            ("avg-left-out", "AVG", index != members - 1)]


def _same_bits(group: Any, index: int, members: int, device_name: str) -> dict[str, Any]:
    """Each case through the CPU path and the staged path: the bits of both results."""
    import torch

    from ft_launch.ftar import ReduceOp
    from ft_launch.ftar.torch_frontend import allreduce_tensor

    device = torch.device(device_name)
    gen = torch.Generator().manual_seed(4321 + index)
    out: dict[str, Any] = {}
    step = 0
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        bits = torch.int32 if dtype is torch.float32 else torch.int16
        for size in SIZES:
            for name, op, contributes in _cases(members, index):
                # magnitudes over seven decades: rounding in every binade, subnormal
                # halves included
                scale = torch.pow(10.0, torch.empty(size).uniform_(-5, 2, generator=gen))
                base = (torch.randn(size, generator=gen) * scale).to(dtype)
                on_cpu = base.clone()
                allreduce_tensor(group, on_cpu, ReduceOp[op], contributes, step)
                staged = base.to(device)
                allreduce_tensor(group, staged, ReduceOp[op], contributes, step + 1,
                                 stage=True)
                key = f"{dtype_name}-{size}-{name}"
                out[f"cpu-{key}"] = on_cpu.view(bits).numpy().copy()
                out[f"staged-{key}"] = staged.cpu().view(bits).numpy().copy()
                step += 2
    return out


def _stream_order(group: Any, index: int, device_name: str) -> dict[str, Any]:
    """The staged path on the caller's own stream: it must read what that stream
    wrote (no synchronize between), hand the result back to it, and not wait for
    unrelated streams of the device."""
    import torch

    from ft_launch.ftar import ReduceOp
    from ft_launch.ftar.torch_frontend import _staging_stream, allreduce_tensor

    device = torch.device(device_name)
    out: dict[str, Any] = {}
    caller = torch.cuda.Stream(device)
    with torch.cuda.stream(caller):
        tensor = torch.zeros(30_000, device=device)
        torch.cuda._sleep(ORDER_SPIN_CYCLES)      # the producer is still busy ...
        tensor.add_(index + 1)                    # ... when this write is queued
        allreduce_tensor(group, tensor, ReduceOp.SUM, step=1000)
        doubled = tensor * 2                      # queued on the caller's stream
        out["order-result"] = doubled.cpu().numpy()
        out["order-staging-is-caller"] = _staging_stream(device) == caller
    busy = torch.cuda.Stream(device)
    out["busy-is-staging"] = busy == _staging_stream(device)
    again = torch.full((30_000,), float(index + 1), device=device)
    torch.cuda.current_stream(device).synchronize()   # only the input is ready; busy not started
    with torch.cuda.stream(busy):
        torch.cuda._sleep(BUSY_SPIN_CYCLES)
    allreduce_tensor(group, again, ReduceOp.SUM, step=1001)
    out["busy-still-running"] = not busy.query()
    busy.synchronize()
    out["busy-result"] = again.cpu().numpy()
    return out


def expected_sum(members: int) -> float:
    """What every element of the stream-order tensors sums to."""
    return float(sum(range(1, members + 1)))

