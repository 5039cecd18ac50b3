"""The real-world examples: each adopts ft-launch in a few lines (the README shows the
difference) and trains exactly what its native version trains, through a replica's
kill and catch-up."""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ft_launch.launcher.controller import events as controller_events
from ft_launch.launcher.reporting.runlog import commits, controller_log
from ft_launch.launcher.worker.audit import check_exactly_once
from tests.waiting import patience
from tests.worker.harness import REPO, TEST_CONFIG

TOKENS = REPO / "etc" / "examples" / "tokens"
HF_LLAMA = REPO / "etc" / "examples" / "hf_llama"   # its runs: test_hf_example.py
#: Clipping below the gradient norms this run sees, so every step clips.
CLIP = "0.2"
ARGS = ("--steps", "24", "--eval-every", "4", "--clip", CLIP, "--warmup", "6",
        "--batch-size", "16", "--accumulation", "2")


def example_diff(folder: Path) -> str:
    native = (folder / "train_native.py").read_text().splitlines(keepends=True)
    adopted = (folder / "train.py").read_text().splitlines(keepends=True)
    return "".join(difflib.unified_diff(native, adopted, "train_native.py", "train.py", n=1))


@pytest.mark.parametrize("folder", [TOKENS, HF_LLAMA], ids=lambda folder: folder.name)
def test_the_readme_shows_each_example_as_a_short_diff(folder):
    diff = example_diff(folder)
    changed = [line for line in diff.splitlines()
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert 0 < len(changed) <= 20, diff
    assert f"```diff\n{diff}```" in (REPO / "README.md").read_text()


def flat(state: object, prefix: str = "") -> dict[str, object]:
    """A nested checkpoint as path -> leaf."""
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in flat(value, f"{prefix}/{key}")
                .items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in flat(value, f"{prefix}/{i}")
                .items()}
    return {prefix: state}


def differing(expected: dict[str, object], got: dict[str, object]) -> list[str]:
    return [k for k, v in expected.items() if k not in got or not (
        torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k])] + \
        sorted(set(got) - set(expected))


@pytest.fixture(scope="module")
def token_data(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("tokens")
    subprocess.run([sys.executable, str(TOKENS / "prepare.py"), str(data)], check=True,
                   capture_output=True, timeout=patience(60))
    return data


def clean_env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("FTL_")},
            "OMP_NUM_THREADS": "1"}


def torchrun(script: Path, data: Path, out: Path, args: tuple[str, ...]) -> str:
    """A native example script under torchrun, 2 processes: its printed output."""
    native = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(script), str(data), "--out", str(out), *args],
        env=clean_env(), capture_output=True, text=True, timeout=patience(300), check=False)
    assert native.returncode == 0, native.stdout[-2000:] + native.stderr[-3000:]
    return native.stdout


def ft_local(script: Path, data: Path, out: Path, run_dir: Path, args: tuple[str, ...],
             *options: str, **settings: str) -> None:
    """An adopted example script as 2 replicas of 1 rank (``ft-launch local``)."""
    done = subprocess.run(
        [sys.executable, "-m", "ft_launch.launcher.cli", "local", "--replicas", "2",
         "--run-dir", str(run_dir), *options, "--",
         sys.executable, str(script), str(data), "--out", str(out), *args],
        env={**clean_env(), **TEST_CONFIG, **settings}, capture_output=True, text=True,
        timeout=patience(400), check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def native_run(data: Path, out: Path) -> dict[str, object]:
    """The native script under torchrun, DDP over 2 ranks: its final checkpoint."""
    stdout = torchrun(TOKENS / "train_native.py", data, out, ARGS)
    norms = [float(n) for n in re.findall(r" norm ([0-9.]+)", stdout)]
    assert norms and max(norms) > float(CLIP), stdout   # clipping took effect
    return flat(torch.load(out / "ckpt.pt", weights_only=False))


def local_run(data: Path, out: Path, run_dir: Path, *options: str,
              **settings: str) -> list[dict[str, object]]:
    """The adopted script as 2 replicas of 1 rank (``ft-launch local``): each replica's
    final checkpoint."""
    ft_local(TOKENS / "train.py", data, out, run_dir, ARGS, *options, **settings)
    return [flat(torch.load(out / f"ckpt-replica{r}.pt", weights_only=False)) for r in (0, 1)]


def test_token_example_trains_bit_for_bit_what_native_ddp_trains(token_data, tmp_path):
    """Native: DDP over 2 ranks. ft-launch: 2 replicas of 1 rank. The same model,
    optimizer and scheduler state at the end, bit for bit, on both replicas."""
    expected = native_run(token_data, tmp_path / "native")
    for replica, got in enumerate(local_run(token_data, tmp_path / "ft", tmp_path / "run")):
        assert not differing(expected, got), (replica, differing(expected, got)[:10])


def test_token_example_goes_on_through_a_kill_and_catch_up(token_data, tmp_path):
    """Replica 1 killed after step 8 and started again. The survivor cannot train alone
    (``quorum.min_replicas`` 2), so the restarted replica is back before the end: it
    catches up (in that step it contributes no samples, so the run is no longer the
    native one), and both replicas end identical, the schedule at the native run's
    step, every sample trained exactly once."""
    run_dir = tmp_path / "run"
    first, second = local_run(token_data, tmp_path / "ft", run_dir, "--kill", "1@8",
                              FTL_QUORUM_MIN_REPLICAS="2",
                              FTL_RUNTIME_MAX_CONSECUTIVE_FAILURES="1000")
    restarted = [e.replica_id for e in controller_log(run_dir)
                 if isinstance(e, controller_events.ReplicaLaunched) and e.how == "restart"]
    assert restarted == [1]
    assert any(e.caught_up for e in commits(run_dir)[1])
    assert not differing(first, second), differing(first, second)[:10]
    schedule = {k: v for k, v in first.items() if k.startswith(("/scheduler/", "/step"))}
    assert schedule["/step"] == int(ARGS[1]) and schedule["/scheduler/last_epoch"] == int(ARGS[1])
    check_exactly_once(run_dir, 2, int(ARGS[1]))
