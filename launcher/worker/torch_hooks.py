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

**DDP's buckets.** FTAR averages a bucket's buffer by position with the same
bucket of every other replica, so every replica's bucket b must hold the same
parameters in the same order. DDP does not promise that across processes of
different ages: it re-buckets once, at the second forward of a process, from the
order in which the gradients became ready in its first backward. A replica that
restarts and catches up makes its first backward beside survivors that
re-bucketed long ago, and the survivors' average of bucket b would land in other
parameters of the newcomer, for good. So ``DdpExchange`` fixes the layout before
the first exchange of every process: two backward passes of zeros through DDP's
reducer, the first readying the gradients last parameter first (DDP re-buckets
from that order), the second recording the buckets. The layout then follows from
the model and DDP's arguments alone, never from a process's history. That order
is about the order a real backward readies gradients in, so bucket 0 is ready
first and FTAR still overlaps backward as much as with DDP's own layout. (The
alternatives: re-bucketing in forward order, which DDP offers, readies bucket 0
last and DDP launches buckets strictly in order, so nothing would overlap; or
averaging in a canonical chunking of the parameters whatever the buckets, which
copies every gradient twice per step.) What remains, replicas that build DDP
differently (another ``bucket_cap_mb``, another model), is checked on every ring
a member builds, before its first bucket (``DdpExchange.check_layout``): every
member stops with an error that names the parameters laid out differently.

Every reduced gradient is checked for NaN/Inf (``reduce_gradient``). FTAR hands
every member the same bytes, so every replica in the quorum finds the same
non-finite average, discards the step and retries it: a NaN from one replica (bad
hardware, silent data corruption) never reaches any replica's weights. One that
comes back step after step uses up ``runtime.max_consecutive_failures``. (The
tests make such a node through the step observer, ``observer``: a bit of the loss
gradient flips on it, before anything is reduced.) With a ``GradScaler``
(registered: ``manager.register_state("scaler", scaler)``) an Inf or NaN is what
the scaler looks for: the average goes on to it, every replica's scaler finds the
same non-finite values, skips the optimizer step and lowers its scale alike, and
the step still counts its batches, as natively (the step's gradient norm is then
the scaled gradients'). The check itself cannot overflow: the norm is summed in
float32 (one pass, nothing allocated), and again in float64 only where that
overflows, as a scaler's large scales make it do with every element finite.

FSDP lays each parameter's gradient out as a view into the hook's buffer when
the reduce dtype is the parameter's dtype; then the reduced values land in the
gradients by themselves. Otherwise FSDP casts a copy right after the hook, and
the reduced buffer is copied into the gradients at the end (``finish``). Where
FSDP reads the buffer right after the hook (accumulating into existing
gradients, dividing an fp16 buffer, offloading), the hook waits for its
reduction instead: correct, without the overlap.

**Gradients are final when backward returns.** FSDP's hook hands its reduction
over and returns, so when backward ends the exchange thread may still be writing
the averages into the gradients (views of the hook's buffer), or not have begun
(a cast copy, reduce dtype bf16 under fp32 parameters, holds the replica's own
average until ``finish``). A script that clips right after ``loss.backward()``
would read them half reduced. ``BackwardEnd`` runs a function as the very last
thing of every backward through the model; ``torch_api`` waits there for the
step's exchange and finishes it, for every kind of model (DDP waits for its
buckets' futures by itself; a plain module's gradients are averaged there, all at
once). So ``clip_grad_norm_``, ``GradScaler.unscale_`` or anything else the script
does after backward sees the replicas' average.
"""

# No ``from __future__ import annotations``: DDP checks the comm hook's annotations
# against the real ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]``.
import hashlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from ft_launch.errors import UsageError
from ft_launch.ftar import ReduceOp
from ft_launch.ftar.torch_frontend import allreduce_tensor

from .exchange import Job
from .protocol import NonFiniteGradientsError
from .step import Reduction

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


def reduce_gradient(reduction: Reduction, tensor: torch.Tensor, scaled: bool = False) -> None:
    """Average ``tensor`` with the same rank of every replica (FTAR), in place; a
    non-finite average fails the step on every replica alike, unless ``scaled``: the
    gradients of a ``GradScaler``, whose step skips it on every replica alike (module
    doc)."""
    if reduction.alter is not None:     # the step observer's (a drill's NaN or spike)
        reduction.alter(tensor)
    own_finite = scaled or not reduction.contributes or math.isfinite(_norm(tensor))
    # counted before the reduction overwrites them; a pass only on this rare path
    own_bad = 0 if own_finite else int((~torch.isfinite(tensor)).sum())
    allreduce_tensor(reduction.ftar, tensor, ReduceOp.AVG, reduction.contributes,
                     reduction.step)
    norm = _norm(tensor)
    reduction.norm.add(norm)
    if not (scaled or math.isfinite(norm)):
        raise NonFiniteGradientsError(
            f"step {reduction.step}: the replicas' averaged gradients hold NaN or Inf "
            f"({'this rank' if not own_finite else 'another replica'} contributed them); "
            "every replica discards the step and retries it (a GradScaler's overflow? "
            "register it: manager.register_state('scaler', scaler))", own=not own_finite,
            values=own_bad)


def scaler_found_inf(optimizer: torch.optim.Optimizer, registered: Iterable[object],
                     average: Callable[[], None]) -> bool:
    """Whether ``GradScaler.step(optimizer)``, which is calling ``optimizer.step()`` now,
    finds Inf/NaN in the replicas' averaged gradients: then the step commits without an
    update. False outside ``GradScaler.step``.

    An optimizer that says ``_step_supports_amp_scaling`` (``FtOptimizer``) has its
    step called by the scaler whatever it finds, with ``found_inf`` and ``grad_scale``
    set on it (torch's contract with fused optimizers), so that every step commits, its
    batches counted, as natively. ``average()`` makes sure the gradients are final
    (the end of a synchronising backward made them so, ``BackwardEnd``), and the
    registered scaler decides on them as ``GradScaler.step`` would have: its own
    ``unscale_`` (bit for bit; the wrapped optimizer is no fused one that unscales
    by itself), or where the script called that already (``grad_scale`` None), a
    look for Inf/NaN in the average (what the scaler does for fused optimizers).
    Every replica decides alike, and ``scaler.update()`` lowers every scale alike."""
    if getattr(optimizer, "found_inf", None) is None:
        return False
    scalers = [obj for obj in registered if isinstance(obj, torch.amp.GradScaler)
               and id(optimizer) in obj._per_optimizer_states]
    if len(scalers) != 1:
        raise UsageError("a GradScaler steps this optimizer, but it is not registered",
                         hint="manager.register_state('scaler', scaler) before the loop: "
                              "its scale then rides in every snapshot, and Inf/NaN in the "
                              "averaged gradients is left to it (it skips the update)")
    scaler = scalers[0]
    average()
    if optimizer.grad_scale is not None:   # type: ignore[attr-defined]
        scaler.unscale_(optimizer)
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    else:
        found = scaler._check_inf_per_device(optimizer)
    return any(bool(flag.item()) for flag in found.values())


#: Elements summed at a time where float32 overflows (see ``_norm``).
_WIDE_CHUNK = 1 << 20


def _norm(tensor: torch.Tensor) -> float:
    """The L2 norm, which is NaN or Inf only if an element is: the controller watches it
    and it is the finiteness check (isfinite is much slower on CPU). One float32 pass that
    allocates nothing; only where its squares overflow (elements past ~1.8e19: a
    GradScaler at 2^70 gets there with every element finite) again in float64, a chunk
    at a time (one float64 pass over all of them is slower still). Measurements:
    benchmarks/results/measurements.md#gradient-norm."""
    norm = float(torch.linalg.vector_norm(tensor, dtype=torch.float32))
    if math.isfinite(norm):
        return norm
    parts = [torch.linalg.vector_norm(chunk, dtype=torch.float64)
             for chunk in tensor.reshape(-1).split(_WIDE_CHUNK)]
    return float(torch.linalg.vector_norm(torch.stack(parts)))


def _reduce(reduction: Reduction, tensor: torch.Tensor, ready: Any, scaled: bool) -> None:
    if ready is None:
        reduce_gradient(reduction, tensor, scaled)
        return
    ready.synchronize()
    with torch.cuda.device(tensor.device), torch.cuda.stream(_exchange_stream(tensor.device)):
        reduce_gradient(reduction, tensor, scaled)


def _param_groups(unit: Any) -> list[Any]:
    """An FSDP2 unit's parameter groups: newer torch keeps a list, older releases
    (2.11 on the GPU images) one group or None."""
    state = unit._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


class BackwardEnd:
    """Calls ``on_end`` at the end of every backward that reaches the model, as the
    last thing that backward does: after every other callback queued in it, FSDP2's
    (it reduces what backward left) and DDP's (it waits for its buckets and copies
    them into the gradients) included. An exception ``on_end`` raises comes out of
    ``loss.backward()``.

    ``queue_callback`` runs a function at the end of the backward (autograd's graph
    task) running when it is called. A hook on the model's output tensors (put there
    by a forward hook, where autograd is on) queues it when backward reaches the
    output: that is the backward the script called, never one nested in it (a
    reentrant activation checkpoint runs backward passes of its own inside the
    model, which end before the model's gradients are all in). When it runs, the
    callback queues itself once more, so that it comes after the callbacks queued
    later in the same backward (DDP queues its own at the first gradient ready). A
    backward that reaches the output but no parameter (``torch.autograd.grad`` of
    an input) ends with a call too: ``on_end`` tells them apart.

    An output with no tensor torch's pytree finds (an object of the script's own)
    is covered by ``gradients_reached``, which the hooks that see the model's
    gradients call (FSDP's all-reduce hook, a parameter's post-accumulate hook): it
    queues from there when nothing is queued yet."""

    def __init__(self, model: torch.nn.Module, on_end: Callable[[], None]) -> None:
        self._on_end = on_end
        #: the backward passes (graph task ids) whose end is queued and not yet run
        self._pending: set[int] = set()
        model.register_forward_hook(self._on_forward)

    @torch.compiler.disable   # a compiled model's output: hooked as the tensor it is
    def _on_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for leaf in tree_leaves(output):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    leaf.register_hook(self._on_output_gradient)

    def _on_output_gradient(self, grad: torch.Tensor) -> None:
        self._queue()

    def gradients_reached(self) -> None:
        """A hook saw this backward reach the model's gradients."""
        if not self._pending:
            self._queue()

    def _queue(self) -> None:
        task = torch._C._current_graph_task_id()
        if task < 0 or task in self._pending:   # not in a backward; queued already
            return
        self._pending.add(task)
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(lambda: self._end(task)))

    def _end(self, task: int) -> None:
        self._pending.discard(task)
        self._on_end()

    def reset(self) -> None:
        """A new step: a backward that raised ran none of its callbacks."""
        self._pending.clear()


class FsdpExchange:
    """FTAR in FSDP2's all-reduce hook, one reduction per FSDP unit and step.
    ``on_gradients`` is called in every hook (``BackwardEnd.gradients_reached``)."""

    def __init__(self, model: torch.nn.Module, submit: Submit, *,
                 scaled: Callable[[], bool] = lambda: False,
                 on_gradients: Callable[[], None] = lambda: None) -> None:
        from torch.distributed.fsdp import FSDPModule

        self._submit = submit
        self._scaled = scaled
        self._on_gradients = on_gradients
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
            self._on_gradients()
            ready = _ready_event(output)
            scaled = self._scaled()
            job = self._submit(lambda r: _reduce(r, output, ready, scaled), None)
            # FSDP reads the buffer right after the hook (module doc); otherwise the
            # end of backward waits (BackwardEnd), and backward goes on meanwhile.
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


@dataclass(frozen=True)
class BucketLayout:
    """Which parameters each DDP bucket holds, in order: what each of a step's FTAR
    operations averages (by position). ``buckets[b]``: bucket b's parameters as (name,
    elements, dtype); ``ids``: the same parameters' ``id()``, to hold the reducer to it;
    ``names``: every parameter that takes a gradient, in the model's order."""

    buckets: tuple[tuple[tuple[str, int, str], ...], ...]
    ids: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]
    cap_mb: float

    def summary(self) -> np.ndarray:
        """What every member of a ring must agree on (``_moments``): the parameter count
        and a digest of the whole layout."""
        digest = hashlib.sha256(repr(self.buckets).encode()).digest()
        return _moments([len(self.names)] + [int.from_bytes(digest[i:i + 2], "big")
                                             for i in range(0, 6, 2)])

    def per_parameter(self) -> np.ndarray:
        """Each parameter's bucket, place in it and (a digest of) its name, size and
        dtype, in the model's order: where members disagree, the parameter is named."""
        where = {}
        for b, bucket in enumerate(self.buckets):
            for i, entry in enumerate(bucket):
                where[entry[0]] = (b, i, _digest16(repr(entry)))
        return _moments([v for name in self.names for v in where[name]])

    def describe(self) -> str:
        sizes = [sum(numel for _, numel, _ in bucket) for bucket in self.buckets]
        return (f"{len(sizes)} bucket(s) of {sizes} elements (bucket_cap_mb={self.cap_mb:.3g}, "
                f"{len(self.names)} parameters)")

    def place(self, name: str) -> str:
        for b, bucket in enumerate(self.buckets):
            for i, entry in enumerate(bucket):
                if entry[0] == name:
                    return f"bucket {b}, place {i}"
        return "in no bucket"


def _digest16(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:2], "big")


def _moments(values: list[int]) -> np.ndarray:
    """``[1, v, v*v for each value]`` as float64: summed over the members of a ring, a
    value is the same on every member iff members x sum(v*v) == sum(v) ** 2 (the values
    are below 2^20: the sums stay exact in float64 for thousands of members)."""
    out = np.ones(1 + 2 * len(values), dtype=np.float64)
    out[1::2] = values
    out[2::2] = np.square(out[1::2])
    return out


def _differ(summed: np.ndarray) -> np.ndarray:
    """For each value of ``_moments`` summed over a ring: whether its members differ."""
    members = summed[0]
    return members * summed[2::2] != np.square(summed[1::2])


def _fix_bucket_layout(model: torch.nn.parallel.DistributedDataParallel,
                       exchange: "DdpExchange") -> BucketLayout:
    """Make DDP re-bucket now, the same way in every process, and return its buckets.

    Two backward passes of zeros through DDP's reducer (the comm hook exchanges nothing
    meanwhile): the first readies the gradients last parameter first, the order a real
    backward roughly has, and DDP re-buckets from that order before the next pass, once
    and for all; the second records the buckets. The gradients are left as they were."""
    if model.static_graph:
        raise UsageError("DistributedDataParallel(static_graph=True) is not supported: it "
                         "re-buckets the gradients after its first steps in each process, so "
                         "a replica that restarts would average its buckets into other "
                         "parameters than the others'", hint="build DDP without static_graph")
    names = {id(p): name for name, p in model.module.named_parameters()}
    params = [p for p in model.module.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    for _ in range(2):
        exchange.warm_up = []
        with torch.enable_grad():
            zeros = [(p.reshape(-1)[:1] * 0).sum() for p in params]
            model.reducer.prepare_for_backward(zeros)
            torch.autograd.backward(zeros)
        model.reducer._rebuild_buckets()
    seen, exchange.warm_up = sorted(exchange.warm_up, key=lambda b: b[0]), None
    for p, grad in zip(params, grads):
        p.grad = grad
    if [index for index, _ in seen] != list(range(len(seen))) or not seen:
        raise UsageError("could not fix the gradient buckets of this DistributedDataParallel "
                         f"model (its reducer handed over buckets {[i for i, _ in seen]})",
                         hint="build DDP without mixed_precision, static_graph or a "
                              "Python reducer")
    in_buckets = {id(p) for _, bucket in seen for p in bucket}
    return BucketLayout(
        buckets=tuple(tuple((names[id(p)], p.numel(), str(p.dtype)) for p in bucket)
                      for _, bucket in seen),
        ids=tuple(tuple(id(p) for p in bucket) for _, bucket in seen),
        names=tuple(names[id(p)] for p in params if id(p) in in_buckets),
        cap_mb=model.bucket_bytes_cap / 2 ** 20)


class DdpExchange:
    """FTAR in DDP's comm hook, one reduction per gradient bucket and step, in a bucket
    layout each process fixes before its first exchange (module doc)."""

    def __init__(self, model: torch.nn.parallel.DistributedDataParallel, submit: Submit,
                 *, scaled: Callable[[], bool] = lambda: False) -> None:
        self.submit = submit
        self.scaled = scaled
        self.process_group = model.process_group
        self.calls = 0
        #: the buckets the reducer hands over while the layout is being fixed
        self.warm_up: list[tuple[int, tuple[torch.Tensor, ...]]] | None = None
        model.register_comm_hook(self, ddp_comm_hook)
        self.layout = _fix_bucket_layout(model, self)
        self._checked_ring = 0     # FtarGroup.rings_built of the last ring found agreeing

    def check_bucket(self, bucket: dist.GradBucket) -> None:
        """The reducer still hands over the buckets fixed at the start."""
        index, ids = bucket.index(), tuple(id(p) for p in bucket.parameters())
        if index >= len(self.layout.ids) or ids != self.layout.ids[index]:
            raise UsageError(f"DDP changed gradient bucket {index} after ft-launch fixed the "
                             f"buckets ({self.layout.describe()}): every replica must average "
                             "the same parameters in the same bucket",
                             hint="do not change the DDP model's process group, parameters or "
                                  "static_graph after ft_manager()")

    def check_layout(self, reduction: Reduction) -> None:
        """Once on each ring this member builds, before its first bucket: every member
        lays its buckets out alike, or every member stops with an error that names the
        parameters laid out differently (averaging buckets of other parameters would
        train wrongly without a sign). Each ring's first operation runs on every member
        (``FtarGroup.rings_built``), so all of them check, or none."""
        ftar = reduction.ftar
        if ftar.size < 2 or ftar.rings_built == self._checked_ring:
            return
        summed = ftar.allreduce(self.layout.summary(), op=ReduceOp.SUM, step=reduction.step)
        differ = _differ(summed)
        if not differ.any():
            self._checked_ring = ftar.rings_built
            return
        # Every member found the same sums: all of them are here.
        what = "models differ"
        if not differ[0]:
            per = _differ(ftar.allreduce(self.layout.per_parameter(), op=ReduceOp.SUM,
                                         step=reduction.step))
            odd = [name for i, name in enumerate(self.layout.names) if per[3 * i:3 * i + 3].any()]
            what = (f"{len(odd)} of {len(self.layout.names)} parameters sit elsewhere: "
                    + ", ".join(f"{name} ({self.layout.place(name)} here)" for name in odd[:8])
                    + (f" and {len(odd) - 8} more" if len(odd) > 8 else ""))
        raise UsageError(
            f"the replicas of quorum {ftar.quorum_id} lay their DDP gradient buckets out "
            f"differently ({what}); this replica has {self.layout.describe()}: averaged "
            "bucket by bucket, one replica's gradients would train another's parameters",
            hint="build DDP the same way on every replica: the same model, bucket_cap_mb "
                 "and find_unused_parameters", step=reduction.step)

    def finish(self) -> None:
        self.calls = 0

    def reset(self) -> None:
        self.calls = 0


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def ddp_comm_hook(state: DdpExchange,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket over the replica's ranks, then across replicas with FTAR."""
    tensor = bucket.buffer()
    if state.warm_up is not None:       # fixing the layout: nothing to exchange
        state.warm_up.append((bucket.index(), tuple(bucket.parameters())))
        return _done(tensor)
    state.check_bucket(bucket)
    state.calls += 1
    if state.calls == 1:
        state.submit(state.check_layout, None)
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
        _reduce(reduction, tensor, ready, state.scaled())

    state.submit(reduce_bucket, lambda: future.set_result(tensor))
    return future
