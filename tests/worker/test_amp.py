"""AMP: a ``GradScaler`` under ft-launch trains as it does natively, bit for bit.

Native: a torch world of two processes, one DDP model. ft-launch: two replicas of
one rank, the model a DDP of its rank or plain, averaged across replicas by FTAR.
Both scale the loss with ``torch.amp.GradScaler("cpu")`` and step through it.

* At a scale of 2^70 every gradient element is finite (float32), but a float32 sum
  of their squares is not: the non-finite check must not take that for NaN/Inf.
* Under float16 autocast at 2^22 the backward overflows for the first steps: every
  replica's scaler finds the same Inf in the averaged gradients, skips the update
  and halves its scale, and the step still consumes its batches, as natively.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ft_launch.launcher.worker.local import LocalJob
from tests.waiting import patience
from tests.worker.harness import run_torch_world

WORKER = Path(__file__).with_name("replicated_worker.py")
REPLICAS, STEPS = 2, 8

pytestmark = [pytest.mark.timeout(300)]

#: (initial scale, autocast to float16)
CASES = {"scale-2^70": (2.0 ** 70, False), "overflowing-fp16": (2.0 ** 22, True)}


def worker_args(mode: str, out: Path, parallel: str, options: list[str]) -> list[str]:
    return [sys.executable, str(WORKER), "--mode", mode, "--parallel", parallel,
            "--out", str(out), "--steps", str(STEPS), *options]


def scaler_options(init_scale: float, autocast: bool) -> list[str]:
    return ["--init-scale", repr(init_scale), *(["--autocast"] if autocast else [])]


def run_native(out: Path, options: list[str]) -> None:
    """The worker as one torch world of ``REPLICAS`` processes, one DDP model."""
    run_torch_world(worker_args("native", out, "ddp", options), REPLICAS)


def run_ft(run_dir: Path, out: Path, parallel: str, options: list[str]) -> LocalJob:
    """The worker as ``REPLICAS`` ft-launch replicas of one rank (``LocalJob``)."""
    job = LocalJob(run_dir, replicas=REPLICAS,
                   command=worker_args("ft", out, parallel, options),
                   config_env={"FTL_QUORUM_JOIN_TIMEOUT": "1",
                               "FTL_RUNTIME_MAX_CONSECUTIVE_FAILURES": "5"})
    job.start_all()
    try:
        codes = job.wait_all(timeout=patience(180))
    finally:
        job.stop_everything()
    assert codes == {r: 0 for r in range(REPLICAS)}, job.log(0)[-3000:]
    return job


@pytest.mark.parametrize("parallel", ["ddp", "none"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_grad_scaler_trains_as_natively(tmp_path: Path, case: str, parallel: str) -> None:
    init_scale, autocast = CASES[case]
    out = tmp_path / "out"
    run_native(out, scaler_options(init_scale, autocast))
    job = run_ft(tmp_path / "run", out, parallel, scaler_options(init_scale, autocast))
    native = [json.loads((out / f"native-r{r}.json").read_text()) for r in range(REPLICAS)]
    ft = [json.loads((out / f"ft-r{r}.json").read_text()) for r in range(REPLICAS)]
    for replica in range(REPLICAS):
        assert ft[replica]["scales"] == native[replica]["scales"]
        assert ft[replica]["state_sha256"] == native[replica]["state_sha256"], replica
        assert ft[replica]["positions"] == native[replica]["positions"]  # skipped steps too
    if autocast:   # the scaler did skip updates (and lowered its scale) on the way
        assert native[0]["scales"][0] < init_scale
    assert native[0]["scales"][-1] == native[0]["scales"][-2]   # it trains at the end
    # an overflow the scaler skips is no failed step
    assert not [e for r in range(REPLICAS) for e in job.events(r)
                if type(e).__name__ == "StepDiscarded"]
