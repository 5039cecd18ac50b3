"""The Hugging Face example (``etc/examples/hf_llama/``): a ``transformers``
``LlamaForCausalLM`` trained with native HSDP (a ``("replicate", "shard")`` mesh,
FSDP2 in bf16) adopts ft-launch in at most 20 lines (the README shows them,
``test_examples.py`` keeps it in sync), trains bit for bit what the native script
trains under ``torchrun``, and goes on through a replica's kill and catch-up.

Both runs are 2 replicas of 1 shard rank: natively a ``(2, 1)`` mesh of one torch
world, under ft-launch 2 worlds of one rank whose ``ft_init_device_mesh`` reports
``(2, 1)``. With two replicas every average has one order, so the bf16 forward
(the same bf16 casts of the same fp32 shards) and the fp32 gradient reduction give
the same bits. ``transformers`` comes with the test extra: without it the scripts
fail, and so do these tests (they never skip).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ft_launch.launcher.reporting.runlog import commits, controller_log
from ft_launch.launcher.reporting.timeline import BandState, MarkKind, read_timeline
from ft_launch.launcher.worker.audit import check_exactly_once
from tests.waiting import patience
from tests.worker.harness import REPO
from tests.worker.test_examples import (  # noqa: F401 (token_data: a fixture)
    clean_env,
    differing,
    flat,
    ft_local,
    token_data,
    torchrun,
)

pytestmark = [pytest.mark.timeout(600)]

HF_LLAMA = REPO / "etc" / "examples" / "hf_llama"
REPLICAS, STEPS = 2, 24
#: Clipping below the gradient norms this run sees, so every step clips.
CLIP = "0.2"
ARGS = ("--replicate", str(REPLICAS), "--steps", str(STEPS), "--log-every", "4",
        "--clip", CLIP, "--warmup", "6", "--batch-size", "16", "--accumulation", "2")


def saved_model(out: Path) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` wrote: the model's weights (one safetensors file)."""
    assert (out / "model" / "config.json").exists()
    return load_file(out / "model" / "model.safetensors")


def native_run(data: Path, out: Path) -> dict[str, object]:
    """The native script under torchrun, HSDP on a (2, 1) mesh: its final training state."""
    stdout = torchrun(HF_LLAMA / "train_native.py", data, out, ARGS)
    norms = [float(n) for n in re.findall(r" norm ([0-9.]+)", stdout)]
    assert norms and min(norms) > float(CLIP), stdout   # clipping took effect
    return flat(torch.load(out / "state.pt", weights_only=False))


def local_run(data: Path, out: Path, run_dir: Path, *options: str,
              **settings: str) -> list[dict[str, object]]:
    """The adopted script as 2 replicas of 1 rank (``ft-launch local``): each replica's
    final training state."""
    ft_local(HF_LLAMA / "train.py", data, out, run_dir, ARGS, *options, **settings)
    return [flat(torch.load(out / f"state-replica{r}.pt", weights_only=False))
            for r in range(REPLICAS)]


def test_hf_llama_trains_bit_for_bit_what_native_hsdp_trains(
        token_data, tmp_path):  # noqa: F811 (the fixture imported above)
    """The same full model and optimizer state (every rank's shards gathered), scheduler
    and step at the end, bit for bit, on both replicas; and the same model from
    ``save_pretrained``, written by replica 0 alone."""
    native, ft = tmp_path / "native", tmp_path / "ft"
    expected = native_run(token_data, native)
    assert any(k.startswith("/optimizer/state/") for k in expected)
    for replica, got in enumerate(local_run(token_data, ft, tmp_path / "run")):
        assert not differing(expected, got), (replica, differing(expected, got)[:10])
    native_model, ft_model = saved_model(native), saved_model(ft)
    assert native_model.keys() == ft_model.keys()
    assert all(torch.equal(native_model[k], ft_model[k]) for k in native_model)
    # save_pretrained wrote the trained weights
    assert all(torch.equal(ft_model[k], expected[f"/model/{k}"]) for k in ft_model)
    assert sorted(p.name for p in ft.iterdir()) == ["model", "state-replica0.pt",
                                                     "state-replica1.pt"]


def test_hf_llama_goes_on_through_a_kill_and_catch_up(
        token_data, tmp_path):  # noqa: F811 (the fixture imported above)
    """Replica 1 killed after step 8 and started again. The survivor cannot train alone
    (``quorum.min_replicas`` 2), so the restarted replica is back before the end: it
    catches up (in that step it contributes no samples, so the run is no longer the
    native one), and both replicas end identical, the schedule at the native run's
    step, every sample trained exactly once; ``ft-launch timeline`` draws the kill."""
    run_dir = tmp_path / "run"
    first, second = local_run(token_data, tmp_path / "ft", run_dir, "--kill", "1@8",
                              FTL_QUORUM_MIN_REPLICAS="2",
                              FTL_RUNTIME_MAX_CONSECUTIVE_FAILURES="1000")
    restarted = [e.replica_id for e in controller_log(run_dir)
                 if type(e).__name__ == "ReplicaLaunched" and e.how == "restart"]
    assert restarted == [1]
    assert any(e.caught_up for e in commits(run_dir)[1])
    assert not differing(first, second), differing(first, second)[:10]
    assert first["/step"] == STEPS and first["/scheduler/last_epoch"] == STEPS
    check_exactly_once(run_dir, REPLICAS, STEPS)
    drawn = subprocess.run(
        [sys.executable, "-m", "ft_launch.launcher.cli", "timeline", str(run_dir),
         "--out", str(tmp_path / "timeline.png")],
        env=clean_env(), capture_output=True, text=True, timeout=patience(120), check=False)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert (tmp_path / "timeline.png").stat().st_size > 0
    timeline = read_timeline(run_dir)
    marks = {(m.replica_id, m.kind) for m in timeline.marks}
    assert {(1, MarkKind.FAILED), (1, MarkKind.RELAUNCHED)} <= marks, marks
    assert any(s.replica_id == 1 and s.state is BandState.DOWN for s in timeline.segments)
    assert [timeline.steps[r][-1][1] for r in range(REPLICAS)] == [STEPS - 1] * REPLICAS
