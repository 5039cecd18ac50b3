"""The torch front end in real member processes: DDP hook, dtypes, strides, staging."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ft_launch.ids import new_job_secret
from tests.ftar.torch_member import member_main

MEMBERS = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    secret = new_job_secret()
    tmp = tmp_path_factory.mktemp("torch-ftar")
    pipes, processes = [], []
    for index in range(MEMBERS):
        parent, child = ctx.Pipe()
        process = ctx.Process(target=member_main, daemon=True,
                              args=(child, index, secret, str(tmp / f"store{index}")))
        process.start()
        pipes.append(parent)
        processes.append(process)
    try:
        addresses = [_recv(p) for p in pipes]
        for pipe in pipes:
            pipe.send(addresses)
        return [_recv(p) for p in pipes]
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def _recv(pipe: Any) -> Any:
    if not pipe.poll(90):
        raise AssertionError("a torch member did not answer within 90 s")
    return pipe.recv()


@pytest.mark.timeout(120)
def test_ddp_hook_gives_the_average_of_plain_gradients(results: list[dict]) -> None:
    for param in range(len(results[0]["plain0"])):
        average = np.mean([r["plain0"][param].astype(np.float64) for r in results], axis=0)
        for member in results:
            assert np.allclose(member["ddp0"][param], average, rtol=1e-5, atol=1e-7)
    assert all(r["buckets0"] >= 1 for r in results)   # FTAR in the hook, beside backward


@pytest.mark.timeout(120)
def test_ddp_hook_leaves_out_a_member_that_does_not_contribute(results: list[dict]) -> None:
    # step 1: member 1 catches up and contributes zeros; the average is member 0's
    for param in range(len(results[0]["plain1"])):
        for member in results:
            assert np.allclose(member["ddp1"][param], results[0]["plain1"][param],
                               rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype, eps", [("bfloat16", 2.0 ** -7), ("float16", 2.0 ** -10),
                                        ("float32", 2.0 ** -23)])
@pytest.mark.parametrize("stage", [False, True])
def test_tensor_allreduce_matches_float64(results: list[dict], dtype: str, eps: float,
                                          stage: bool) -> None:
    inputs = [r[f"in-{dtype}-{stage}"].astype(np.float64) for r in results]
    expected = np.mean(inputs, axis=0)
    bound = (MEMBERS + 1) * eps * np.sum(np.abs(inputs), axis=0) / MEMBERS
    for member in results:
        assert np.all(np.abs(member[f"out-{dtype}-{stage}"] - expected) <= bound)


@pytest.mark.timeout(120)
def test_non_contiguous_tensor_is_reduced_in_place(results: list[dict]) -> None:
    expected = np.sum([r["in-strided"].astype(np.float64) for r in results], axis=0)
    for member in results:
        assert member["out-strided"].shape == (30, 40)
        assert np.allclose(member["out-strided"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_ftar_package_does_not_import_torch() -> None:
    code = ("import sys, ft_launch.ftar, ft_launch.ftar.ring, ft_launch.ftar.transport, "
            "ft_launch.ftar.schedule; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False, cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_tensor_through_pinned_staging() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from ft_launch.config import FtarConfig
    from ft_launch.ftar import FtarGroup, ReduceOp
    from ft_launch.ftar.torch_frontend import allreduce_tensor

    with FtarGroup(FtarConfig(chunk_bytes=4096), new_job_secret()) as group:
        group.reconfigure(1, [group.address], 0)   # one member: staging round trip only
        tensor = torch.arange(10_000, dtype=torch.float32, device="cuda")
        allreduce_tensor(group, tensor, ReduceOp.SUM)
        assert torch.equal(tensor.cpu(), torch.arange(10_000, dtype=torch.float32))


class _FailingGroup:
    """Stands in for an FtarGroup whose ring breaks (or that is misused)."""

    def __init__(self, error: Exception) -> None:
        from ft_launch.config import FtarConfig

        self.config = FtarConfig()
        self.error = error
        self.calls = 0
        self.size = 1      # a ring of one: no bucket layout to compare

    def reduce_flat(self, *args: Any, **kwargs: Any) -> int:
        self.calls += 1
        raise self.error


class _Bucket:
    def __init__(self, tensor: Any) -> None:
        self._tensor = tensor

    def buffer(self) -> Any:
        return self._tensor

    def index(self) -> int:
        return 0

    def parameters(self) -> list[Any]:
        return []


def _hooked(group: _FailingGroup) -> tuple[Any, Any]:
    """The worker's DDP comm hook over ``group`` on an exchange thread, a one-rank
    replica (no DDP model: the hook is called as DDP calls it)."""
    from ft_launch.launcher.worker.exchange import StepWork
    from ft_launch.launcher.worker.manager import Reduction
    from ft_launch.launcher.worker.torch_hooks import BucketLayout, DdpExchange

    work = StepWork()
    exchange = DdpExchange.__new__(DdpExchange)
    exchange.submit = lambda reduce, after=None: work.submit(
        lambda: reduce(Reduction(group, 9, True)), after)   # type: ignore[arg-type]
    exchange.process_group, exchange.calls = None, 0
    exchange.warm_up, exchange.scaled = None, lambda: False
    exchange.layout = BucketLayout(buckets=((),), ids=((),), names=(), cap_mb=25.0)
    work.begin(lambda: None)
    return work, exchange


@pytest.mark.timeout(60)
def test_hook_keeps_a_recoverable_error_and_skips_the_other_buckets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from ft_launch.ftar import PeerFailedError
    from ft_launch.ftar.errors import FailureKind
    from ft_launch.launcher.worker.torch_hooks import ddp_comm_hook

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    error = PeerFailedError(FailureKind.CLOSED, peer_index=1, peer_address="h:1",
                            quorum_id=3, step=9)
    group = _FailingGroup(error)
    work, exchange = _hooked(group)
    futures = [ddp_comm_hook(exchange, _Bucket(torch.ones(4)))  # type: ignore[arg-type]
               for _ in range(3)]
    assert all(torch.equal(f.wait(), torch.ones(4)) for f in futures)   # no raise in backward
    assert work.wait() is error                                         # the commit sees it
    assert group.calls == 1                                          # queued buckets skipped
    work.close()


@pytest.mark.timeout(60)
def test_hook_hands_a_fatal_error_to_the_training_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from ft_launch.ftar import FtarUsageError
    from ft_launch.launcher.worker.torch_hooks import ddp_comm_hook

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    work, exchange = _hooked(_FailingGroup(FtarUsageError("members disagree")))
    future = ddp_comm_hook(exchange, _Bucket(torch.ones(4)))  # type: ignore[arg-type]
    assert torch.equal(future.wait(), torch.ones(4))   # backward itself goes on
    with pytest.raises(FtarUsageError, match="members disagree"):
        work.wait()                                    # raised where the step commits
    work.close()


@pytest.mark.parametrize("state, expected", [
    ({"_fsdp_param_groups": ["a", "b"]}, ["a", "b"]),    # torch 2.13 (this tier's)
    ({"_fsdp_param_group": "a"}, ["a"]),                  # torch 2.11 (the GPU images')
    ({"_fsdp_param_group": None}, []),                    # a unit with no parameters
])
def test_fsdp_param_groups_are_found_in_either_torch_layout(state: dict, expected: list) -> None:
    """The FSDP2 hook installer reads private state whose shape changed between torch
    releases; the GPU tier runs an older torch than this one."""
    from types import SimpleNamespace

    from ft_launch.launcher.worker.torch_hooks import _param_groups

    unit = SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(**state))
    assert _param_groups(unit) == expected
