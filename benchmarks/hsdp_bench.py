"""FT-HSDP step time, fault-free: ft-launch against native torch HSDP and torchft.

    python benchmarks/hsdp_bench.py [--quick] [--sizes default 100m] [--pairs N]
                                    [--steps N] [--warmup N] [--arms A ...] [--json F]

3 replicas x 2 ranks on loopback train the example GPT (``etc/examples/gpt``) at
each size with the same seed, data streams, AdamW (foreach=False; ft-launch runs
the example's default ResidentAdamW, the same numbers bit for bit) and FSDP2
mixed precision (params bf16, reduce fp32 unless told otherwise). The arms:

* ``native_hsdp`` (a): one torch world of 6 processes over gloo, a (3, 2) mesh
  ("replicate", "shard"), FSDP2 per block and root (``hsdp/native_worker.py``).
* ``ftl_overlap`` (b): the product's path: ``LocalJob`` running the example's
  ``train.py --parallel fsdp``; FTAR reduces gradient shards across replicas
  during backward.
* ``ftl_no_overlap`` (c): (b) with ``FTL_RUNTIME_OVERLAP_BACKWARD=false``.
* ``torchft`` (d): torchft 0.2.0 the way torchtitan wires it for FT-HSDP (its
  lighthouse, a Manager per rank over a gloo process group, FSDP2's all-reduce
  hook calling ``manager.allreduce``), in its own venv (``hsdp/torchft_env.py``).

Runs are paired and interleaved: each pair runs every arm once, the order rotated
from pair to pair; ratios are medians of the per-pair ratios. A step's time is
the difference of consecutive step-end times on replica 0 rank 0 (ft-launch: its
``StepCommitted`` events), warmup skipped. FTAR's wire bytes come from its own
counters (each rank's ``WorkerStopped`` event), in (b) and in one more run of (b) with ``--reduce-dtype bf16``. An arm
that cannot run here is reported unavailable with the reason; the others still
run. The JSON goes to stdout (and ``--json``), the table to stderr.

Length: the default (2 sizes x 2 pairs x 4 arms + 2 wire runs) is sized for about
10 minutes on 16 cores (threads per process = cores / 6); ``--quick`` for 1-2
minutes (3 on 2 cores). Per-step figures on CPU say little about GPUs: see the
"cpu" note in the output.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from hsdp import core
from hsdp.core import ARMS, FTL_ARMS, Arm, RunResult, SizePlan
from record import commit, write_json

log = logging.getLogger("hsdp_bench")

TRAIN = REPO / "etc" / "examples" / "gpt" / "train.py"
DEFAULT_SIZES = ("default", "100m")
#: size -> (warmup, steps per run); a 100M step takes seconds on CPU
STEPS = {"default": (5, 30), "100m": (2, 8)}
QUICK_STEPS = {"default": (3, 12), "100m": (1, 4)}
OTHER_STEPS = (5, 30)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="size 'default' only, one pair, fewer steps (about 3 minutes)")
    parser.add_argument("--sizes", nargs="+", help=f"model sizes (default: {DEFAULT_SIZES})")
    parser.add_argument("--pairs", type=int, help="interleaved pairs (default 2; quick 1)")
    parser.add_argument("--steps", type=int, help="steps per run, warmup included "
                        f"(default per size: {STEPS}, others {OTHER_STEPS[1]})")
    parser.add_argument("--warmup", type=int, help="steps left out of the timing")
    parser.add_argument("--arms", nargs="+", choices=[a.value for a in ARMS],
                        default=[a.value for a in ARMS])
    parser.add_argument("--no-wire", action="store_true",
                        help="skip the bf16-reduce run that measures FTAR's wire bytes")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per process (0: cores / processes)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2, help="ranks per replica")
    parser.add_argument("--batch-size", type=int, default=16, help="per replica (train.py's)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--param-dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--reduce-dtype", choices=("bf16", "fp32"), default="fp32")
    parser.add_argument("--torchft-env", type=Path,
                        help="the torchft venv (default $XDG_CACHE_HOME/ft-launch/torchft-0.2.0)")
    parser.add_argument("--work-dir", type=Path, help="run directories (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep every run's directory")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    if args.pairs is not None and args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    if args.steps is not None and args.steps < 3:
        parser.error(f"--steps must be at least 3, got {args.steps}")
    if args.warmup is not None and args.warmup < 1:
        parser.error(f"--warmup must be at least 1 (step 0 has no step before it), got "
                     f"{args.warmup}")
    args.sizes = args.sizes or (["default"] if args.quick else list(DEFAULT_SIZES))
    args.pairs = args.pairs or (1 if args.quick else 2)
    args.arms = [Arm(a) for a in args.arms]
    return args


def plan_sizes(args: argparse.Namespace,
               train_sizes: Mapping[str, Mapping[str, int]]) -> list[SizePlan]:
    plans = []
    for name in args.sizes:
        config = core.resolve_size(name, train_sizes)
        warmup, steps = (QUICK_STEPS if args.quick else STEPS).get(name, OTHER_STEPS)
        steps = args.steps or steps
        warmup = args.warmup if args.warmup is not None else min(warmup, steps - 2)
        if steps - warmup < 2:
            raise ValueError(f"size {name}: {steps} steps leave fewer than 2 timed after "
                             f"{warmup} warmup steps")
        plans.append(SizePlan(name, config, warmup, steps))
    return plans


def default_threads(replicas: int, ranks: int, cores: int | None) -> int:
    """One share of the cores per process, so the processes do not oversubscribe."""
    return max(1, (cores or 1) // (replicas * ranks))


# ---------------------------------------------------------------- availability


def ftl_unavailable(plans: Sequence[SizePlan]) -> dict[str, str]:
    """size -> why train.py cannot run arms (b)/(c) at it (sizes that can: absent)."""
    result = subprocess.run([sys.executable, str(TRAIN), "--help"], capture_output=True,
                            text=True, timeout=120, check=False)
    if result.returncode:
        reason = f"train.py --help exited {result.returncode}: {result.stderr[-800:]}"
        return {p.name: reason for p in plans}
    reasons = {}
    for plan in plans:
        missing = core.missing_train_support(result.stdout, plan.name)
        if missing:
            reasons[plan.name] = f"etc/examples/gpt/train.py does not accept {', '.join(missing)} yet"
    return reasons


def torchft_environment(env_dir: Path) -> tuple[Any, str]:
    from hsdp.torchft_env import TorchftUnavailable, ensure
    try:
        return ensure(env_dir), ""
    except (TorchftUnavailable, OSError, subprocess.SubprocessError) as exc:
        return None, f"torchft environment: {exc}"


def count_params(config: Mapping[str, int]) -> int:
    import torch
    sys.path.insert(0, str(TRAIN.parent))
    from corpus import Corpus
    from model import Gpt, GptConfig
    with torch.device("meta"):
        model = Gpt(GptConfig(vocab_size=Corpus(context=config["context"]).vocab_size, **config))
    return sum(p.numel() for p in model.parameters())


def cpu_facts() -> dict[str, Any]:
    """The CPU's vector capability and whether it computes bf16 natively (the
    example's own test). Without, bf16 matmuls are emulated, several times slower
    than fp32: the arms still compare alike, but every run takes that much longer
    and the 100M arm's steps take minutes."""
    import torch
    sys.path.insert(0, str(TRAIN.parent))
    from train import native_bf16
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_bf16_native": native_bf16(torch.device("cpu"))}


# ---------------------------------------------------------------- running


def run_one(arm: Arm, rid: Any, settings: Any, run_dir: Path, torchft: Any,
            reduce_dtype: str | None = None) -> RunResult:
    from hsdp import arms as shell
    if arm is Arm.NATIVE_HSDP:
        return shell.run_native(rid, settings, run_dir)
    if arm is Arm.TORCHFT:
        return shell.run_torchft(rid, settings, run_dir, torchft)
    return shell.run_ftl(rid, settings, run_dir, overlap=arm is Arm.FTL_OVERLAP,
                         reduce_dtype=reduce_dtype)


def finish_run(result: RunResult, run_dir: Path, keep: bool) -> RunResult:
    if result.ok:
        log.info("%s %s pair %d: median %.4f s over %d steps, last loss %s", result.size,
                 result.arm.value, result.pair, result.median_s, len(result.durations),
                 result.last_loss)
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        return result
    log.warning("%s %s pair %d failed (kept %s): %s", result.size, result.arm.value,
                result.pair, run_dir, result.error[-600:])
    return result


def fresh(run_dir: Path) -> Path:
    """An empty run directory: a stale rendezvous file or event log would be read back."""
    shutil.rmtree(run_dir, ignore_errors=True)
    return run_dir


def run_size(plan: SizePlan, args: argparse.Namespace, arms: Sequence[Arm], torchft: Any,
             work_dir: Path) -> tuple[list[RunResult], RunResult | None]:
    from hsdp.arms import RunId, RunSettings
    settings = RunSettings(plan.name, plan.config, plan.warmup, plan.steps, args.threads,
                           args.run_timeout, args.replicas, args.ranks, args.batch_size,
                           args.lr, args.seed, args.param_dtype, args.reduce_dtype)
    runs = []
    for pair, order in enumerate(core.interleave(arms, args.pairs)):
        for position, arm in enumerate(order):
            run_dir = fresh(work_dir / plan.name / f"pair-{pair}-{arm.value}")
            result = run_one(arm, RunId(arm, pair, position), settings, run_dir, torchft)
            runs.append(finish_run(result, run_dir, args.keep))
    bf16 = None
    if not args.no_wire and Arm.FTL_OVERLAP in arms:
        run_dir = fresh(work_dir / plan.name / "wire-bf16-reduce")
        bf16 = finish_run(run_one(Arm.FTL_OVERLAP, RunId(Arm.FTL_OVERLAP, -1, 0), settings,
                                  run_dir, torchft, reduce_dtype="bf16"), run_dir, args.keep)
    return runs, bf16


def run_record(run: RunResult) -> dict[str, Any]:
    record = asdict(run)
    record["arm"] = run.arm.value
    record["median_s"] = run.median_s
    return record


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level="INFO", stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args.threads = args.threads or default_threads(args.replicas, args.ranks, os.cpu_count())
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        plans = plan_sizes(args, core.sizes_in_source(TRAIN.read_text()))
    except ValueError as exc:
        raise SystemExit(f"hsdp_bench: {exc}") from exc
    cpu = cpu_facts()
    if args.param_dtype == "bf16" and not cpu["cpu_bf16_native"]:
        log.warning("this CPU (%s) has no native bf16: bf16 matmuls are emulated, several "
                    "times slower than fp32, so every run takes that much longer; "
                    "--param-dtype fp32 measures the same overheads against less compute",
                    cpu["cpu_capability"])
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="hsdp-bench-"))
    unavailable: dict[str, dict[str, str]] = {p.name: {} for p in plans}
    if any(a in args.arms for a in FTL_ARMS):
        for size, reason in ftl_unavailable(plans).items():
            unavailable[size].update({a.value: reason for a in FTL_ARMS if a in args.arms})
    torchft = None
    if Arm.TORCHFT in args.arms:
        from hsdp.torchft_env import default_dir
        torchft, reason = torchft_environment(args.torchft_env or default_dir())
        if reason:
            for reasons in unavailable.values():
                reasons[Arm.TORCHFT.value] = reason
    per_size: dict[str, dict[str, Any]] = {}
    for plan in plans:
        arms = [a for a in args.arms if a.value not in unavailable[plan.name]]
        for arm, reason in unavailable[plan.name].items():
            log.warning("%s: arm %s unavailable: %s", plan.name, arm, reason)
        runs, bf16 = run_size(plan, args, arms, torchft, work_dir)
        params = count_params(plan.config)
        per_size[plan.name] = {
            **core.size_summary(runs, bf16, params, args.replicas),
            "config": dict(plan.config),
            "warmup": plan.warmup, "steps": plan.steps, "unavailable": unavailable[plan.name],
            "runs": [run_record(r) for r in runs],
            "wire_run": run_record(bf16) if bf16 is not None else None}
    summary = core.summarise(per_size)
    failed = any(not run["median_s"] for s in per_size.values()
                 for run in [*s["runs"], *([s["wire_run"]] if s["wire_run"] else [])])
    if args.work_dir is None and not args.keep and not failed:
        shutil.rmtree(work_dir, ignore_errors=True)     # every run's directory went already
    output = {
        "summary": summary, "targets": {k: f"<= {v}" for k, v in core.TARGETS.items()},
        "meets_targets": core.verdicts(summary), "notes": core.NOTES, "sizes": per_size,
        "setup": {"replicas": args.replicas, "ranks": args.ranks, "pairs": args.pairs,
                  "threads_per_process": args.threads, "cpu_count": os.cpu_count(), **cpu,
                  "batch_size_per_replica": args.batch_size, "lr": args.lr, "seed": args.seed,
                  "param_dtype": args.param_dtype, "reduce_dtype": args.reduce_dtype,
                  "arms": [a.value for a in args.arms], "quick": args.quick,
                  "torchft_env": torchft.describe() if torchft is not None else None,
                  "code": commit(),
                  "work_dir": str(work_dir) if work_dir.exists() else None}}
    text = json.dumps(output, indent=2, default=str)
    print(core.table(per_size, summary), file=sys.stderr)
    print(text)
    if args.json:
        write_json(args.json, output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
