"""Hooks that hand gradients to the exchange thread while backward goes on.

* FSDP2: ``FSDPModule.set_all_reduce_hook`` on every unit. FSDP calls it once per
  unit with the unit's flat reduce-scatter output (this rank's gradient shard,
  already averaged over the replica's ranks); FTAR averages it with the same
  rank of every other replica on the exchange thread.
* DDP: a comm hook per bucket: the replica's own average (issued here, on the
  training thread, so collectives keep their order), then FTAR on the exchange
  thread; the bucket's future completes when that is done or skipped.

A recoverable FTAR failure never reaches backward: the exchange thread records
it, skips the step's remaining reductions, and the commit votes the step down.

Every reduced gradient is checked for NaN/Inf (``reduce_gradient``). FTAR hands
every member the same bytes, so every replica in the quorum finds the same
non-finite average, discards the step and retries it: a NaN from one replica (bad
hardware, silent data corruption) never reaches any replica's weights. One that
comes back step after step uses up ``runtime.max_consecutive_failures``.
(``corrupt_gradients_while`` makes such a node for tests: a bit of the loss
gradient flips on it, before anything is reduced.)

FSDP lays each parameter's gradient out as a view into the hook's buffer when
the reduce dtype is the parameter's dtype; then the reduced values land in the
gradients by themselves. Otherwise FSDP casts a copy right after the hook, and
the reduced buffer is copied into the gradients at the end (``finish``). Where
FSDP reads the buffer right after the hook (accumulating into existing
gradients, dividing an fp16 buffer, offloading), the hook waits for its
reduction instead: correct, without the overlap.
"""

# No ``from __future__ import annotations``: DDP checks the comm hook's annotations
# against the real ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]``.
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ft_launch.ftar import ReduceOp
from ft_launch.ftar.torch_frontend import allreduce_tensor

from .exchange import Job
from .manager import Reduction
from .protocol import NonFiniteGradientsError

#: Manager.reduce_gradients: queue a reduction (and what runs once it is over).
Submit = Callable[[Callable[[Reduction], None], Callable[[], None] | None], Job]

#: Reduce dtypes FSDP neither divides nor reads after the hook (see module doc).
_UNTOUCHED_AFTER_HOOK = (torch.float32, torch.bfloat16)


def _ready_event(tensor: torch.Tensor) -> Any:
    """On CUDA, an event after the kernels that produced ``tensor`` (on its device's
    current stream: FSDP runs the hook inside its own stream); the exchange thread
    waits for it before reading."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


_exchange_streams: dict[torch.device, Any] = {}


def _exchange_stream(device: torch.device) -> Any:
    """The exchange thread's stream on ``device``: not the default stream, or FTAR's
    staging would queue behind all of backward's kernels there."""
    stream = _exchange_streams.get(device)
    if stream is None:
        stream = _exchange_streams[device] = torch.cuda.Stream(device=device)
    return stream


def reduce_gradient(reduction: Reduction, tensor: torch.Tensor) -> None:
    """Average ``tensor`` with the same rank of every replica (FTAR), in place; a
    non-finite average fails the step on every replica alike (module doc)."""
    if reduction.corrupt:
        tensor.view(-1)[0] = float("nan")
    if reduction.scale != 1.0:          # fault injection: a loss spike (worker.faults)
        tensor.mul_(reduction.scale)
    own_finite = not reduction.contributes or math.isfinite(_norm(tensor))
    # counted before the reduction overwrites them; a pass only on this rare path
    own_bad = 0 if own_finite else int((~torch.isfinite(tensor)).sum())
    allreduce_tensor(reduction.ftar, tensor, ReduceOp.AVG, reduction.contributes,
                     reduction.step)
    norm = _norm(tensor)
    reduction.norm.add(norm)
    if not math.isfinite(norm):
        raise NonFiniteGradientsError(
            f"step {reduction.step}: the replicas' averaged gradients hold NaN or Inf "
            f"({'this rank' if not own_finite else 'another replica'} contributed them); "
            "every replica discards the step and retries it", own=not own_finite,
            values=own_bad)


#: The integer view and the top exponent bit of each float format: flipped in 1.0 (the
#: gradient of a loss, where backward starts) it gives +Inf in every one of them.
_TOP_EXPONENT_BIT = {torch.float32: (torch.int32, 1 << 30), torch.bfloat16: (torch.int16, 1 << 14),
                     torch.float16: (torch.int16, 1 << 14)}


def corrupt_gradients_while(model: torch.nn.Module, corrupting: Callable[[], bool]) -> None:
    """Silent data corruption on this node (``faults.node_sdc_probe``): while
    ``corrupting()``, one bit of the gradient of the model's output flips before
    backward goes on from it, so this rank's every local gradient is off before
    FSDP's reduce-scatter (or DDP's all-reduce) mixes it into every rank's shard."""
    def on_output(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if (isinstance(output, torch.Tensor) and output.requires_grad
                and output.dtype in _TOP_EXPONENT_BIT and corrupting()):
            output.register_hook(_flip_top_exponent_bit)
    model.register_forward_hook(on_output)


def _flip_top_exponent_bit(grad: torch.Tensor) -> torch.Tensor:
    flipped = grad.clone()
    kind, bit = _TOP_EXPONENT_BIT[grad.dtype]
    flipped.view(-1)[:1].view(kind).bitwise_xor_(bit)
    return flipped


def _norm(tensor: torch.Tensor) -> float:
    # One pass that allocates nothing gives both the norm the controller watches and
    # the finiteness check: NaN and Inf survive it (isfinite is ~100x slower on CPU).
    # It accumulates in fp32, so only a gradient above ~1e19 (a divergence anyway)
    # overflows to Inf and counts as non-finite.
    return float(torch.linalg.vector_norm(tensor, dtype=torch.float32))


def _reduce(reduction: Reduction, tensor: torch.Tensor, ready: Any) -> None:
    if ready is None:
        reduce_gradient(reduction, tensor)
        return
    ready.synchronize()
    with torch.cuda.device(tensor.device), torch.cuda.stream(_exchange_stream(tensor.device)):
        reduce_gradient(reduction, tensor)


def _param_groups(unit: Any) -> list[Any]:
    """An FSDP2 unit's parameter groups: newer torch keeps a list, older releases
    (2.11 on the GPU images) one group or None."""
    state = unit._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


class FsdpExchange:
    """FTAR in FSDP2's all-reduce hook, one reduction per FSDP unit and step."""

    def __init__(self, model: torch.nn.Module, submit: Submit) -> None:
        from torch.distributed.fsdp import FSDPModule

        self._submit = submit
        self.calls = 0
        self._copy_outs: list[tuple[list[Any], torch.Tensor]] = []
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                params = [p for g in _param_groups(unit) for p in g.fsdp_params]
                if params:
                    unit.set_all_reduce_hook(self._hook_for(params))

    def _hook_for(self, params: list[Any]) -> Callable[[torch.Tensor], None]:
        def on_reduced(output: torch.Tensor) -> None:
            self.calls += 1
            ready = _ready_event(output)
            job = self._submit(lambda r: _reduce(r, output, ready), None)
            if (output.dtype not in _UNTOUCHED_AFTER_HOOK
                    or any(p.sharded_param.grad is not None or p.offload_to_cpu
                           for p in params)):
                job.wait()
            elif any(p.orig_dtype != output.dtype for p in params):
                self._copy_outs.append((params, output))
        return on_reduced

    def finish(self) -> None:
        """Copy reduced buffers FSDP had cast into the gradients (same layout)."""
        with torch.no_grad():
            for params, output in self._copy_outs:
                offset = output.storage_offset()
                for p in params:
                    view = torch.as_strided(output, p.sharded_size,
                                            p.contiguous_sharded_stride, offset)
                    p.sharded_param.grad._local_tensor.copy_(view)
                    offset += p.padded_sharded_param_size.numel()
        self.reset()

    def reset(self) -> None:
        self._copy_outs.clear()
        self.calls = 0


class DdpExchange:
    """FTAR in DDP's comm hook, one reduction per gradient bucket and step."""

    def __init__(self, model: torch.nn.parallel.DistributedDataParallel,
                 submit: Submit) -> None:
        self.submit = submit
        self.process_group = model.process_group
        self.calls = 0
        model.register_comm_hook(self, ddp_comm_hook)

    def finish(self) -> None:
        self.calls = 0

    def reset(self) -> None:
        self.calls = 0


def ddp_comm_hook(state: DdpExchange,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket over the replica's ranks, then across replicas with FTAR."""
    state.calls += 1
    tensor = bucket.buffer()
    ranks = dist.get_world_size(state.process_group)
    inside = None
    if ranks > 1:
        tensor.div_(ranks)
        inside = dist.all_reduce(tensor, group=state.process_group, async_op=True)
    ready = _ready_event(tensor)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def reduce_bucket(reduction: Reduction) -> None:
        if inside is not None:
            inside.wait()
        _reduce(reduction, tensor, ready)

    state.submit(reduce_bucket, lambda: future.set_result(tensor))
    return future
