"""The example GPT under FSDP2 on a CUDA device, through the worker runtime's real
path: two replicas of one rank each on the same GPU (each replica its own torch
world of size 1: NCCL for CUDA tensors, as ``init_process_group()`` picks), FTAR
across them from FSDP2's all-reduce hook through pinned staging. Both replicas
must end with the same state, bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ft_launch.launcher.worker.local import LocalJob
from tests.waiting import patience

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "etc" / "examples" / "gpt" / "train.py"
REPLICAS, STEPS = 2, 20


def run_fsdp_replicas(run_dir: Path, device: str) -> tuple[LocalJob, dict[int, int]]:
    """Train ``STEPS`` steps in ``REPLICAS`` one-rank replicas; the job and exit codes."""
    # torch's AdamW: ResidentAdamW (train.py's default) keeps parameters in host
    # snapshot buffers and refuses CUDA ones.
    job = LocalJob(run_dir, replicas=REPLICAS, ranks=1,
                   command=[sys.executable, str(TRAIN), "--size", "tiny", "--steps", str(STEPS),
                            "--parallel", "fsdp", "--device", device, "--optimizer", "adamw"])
    job.start_all()
    try:
        codes = job.wait_all(timeout=patience(100))
    except subprocess.TimeoutExpired:
        codes = {r: -1 for r in range(REPLICAS)}
    finally:
        job.stop_everything()
    return job, codes


def _logs(job: LocalJob) -> str:
    return "\n".join(f"--- replica {r} ---\n{job.log(r)[-2500:]}" for r in range(REPLICAS))


@pytest.mark.timeout(180)
def test_fsdp2_replicas_on_one_gpu_end_identical(cuda_torch: Any, tmp_path: Path) -> None:
    job, codes = run_fsdp_replicas(tmp_path / "cuda", "cuda")
    assert codes == {r: 0 for r in range(REPLICAS)}, _logs(job)
    finals = job.finals()
    assert {f["step"] for f in finals.values()} == {STEPS - 1}, finals
    hashes = {f["state_sha256"] for f in finals.values()}
    assert len(hashes) == 1, f"replicas diverged: {finals}\n{_logs(job)}"
    # The same run on the CPU ends elsewhere (other kernels, other rounding): the
    # replicas above did train on the GPU.
    on_cpu, cpu_codes = run_fsdp_replicas(tmp_path / "cpu", "cpu")
    assert cpu_codes == {r: 0 for r in range(REPLICAS)}, _logs(on_cpu)
    assert {f["state_sha256"] for f in on_cpu.finals().values()}.isdisjoint(hashes)
