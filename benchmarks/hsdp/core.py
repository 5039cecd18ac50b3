"""Pure core of ``hsdp_bench``: the arms, the interleaved schedule, step times
from timestamps, the summary, FTAR wire bytes, and the table. No torch, no
processes: the unit tests cover all of it."""

from __future__ import annotations

import ast
import enum
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class Arm(enum.Enum):
    NATIVE_HSDP = "native_hsdp"          # (a) torch HSDP, one world of 6, 2-D mesh
    FTL_OVERLAP = "ftl_overlap"          # (b) ft-launch FT-HSDP, FTAR during backward
    FTL_NO_OVERLAP = "ftl_no_overlap"    # (c) (b) with every reduction after backward
    TORCHFT = "torchft"                  # (d) torchft 0.2.0, FSDP2 + all-reduce hook


ARMS: tuple[Arm, ...] = tuple(Arm)
FTL_ARMS = (Arm.FTL_OVERLAP, Arm.FTL_NO_OVERLAP)

#: summary key -> (numerator arm, denominator arm); each a median of paired ratios
RATIOS: dict[str, tuple[Arm, Arm]] = {
    "step_time_ratio_vs_native_hsdp": (Arm.FTL_OVERLAP, Arm.NATIVE_HSDP),
    "step_time_ratio_no_overlap": (Arm.FTL_NO_OVERLAP, Arm.FTL_OVERLAP),
    "step_time_ratio_vs_torchft": (Arm.FTL_OVERLAP, Arm.TORCHFT),
    "step_time_ratio_no_overlap_vs_native_hsdp": (Arm.FTL_NO_OVERLAP, Arm.NATIVE_HSDP),
}
WIRE_KEY = "wire_bytes_ratio_bf16_vs_fp32"
#: the targets printed beside the figures: each figure should be at most this
TARGETS: dict[str, float] = {"step_time_ratio_vs_native_hsdp": 1.03,
                             "step_time_ratio_vs_torchft": 1.0, WIRE_KEY: 0.51}

NOTES = {
    "ratios": "each ratio is numerator / denominator step time (lower is better for the "
              "numerator): per size, the median over pairs of the ratio of the two runs of "
              "the same pair (paired, interleaved); in summary, the geometric mean over sizes "
              "(the *_worst keys: the largest per-size ratio)",
    "step_time_ratio_vs_native_hsdp": "b / a: ft-launch FT-HSDP (overlapped) over native torch "
                                      "HSDP",
    "step_time_ratio_no_overlap": "c / b: ft-launch with the cross-replica reduce after "
                                  "backward over ft-launch overlapped; above 1 is what overlap "
                                  "saves (c / a is step_time_ratio_no_overlap_vs_native_hsdp)",
    "step_time_ratio_vs_torchft": "b / d: ft-launch FT-HSDP over torchft 0.2.0 FT-HSDP",
    WIRE_KEY: "FTAR payload bytes sent per step with --reduce-dtype bf16 over fp32 (arm b)",
    "cpu": "on CPU, FSDP2's collectives block the training thread (its separate streams are "
           "CUDA's), so native HSDP and torchft (whose all-reduce hook waits for "
           "manager.allreduce, as torchtitan's does) reduce without overlap, while FTAR's "
           "exchange thread competes with compute for the cores; a GPU run can rank them "
           "differently",
    "step_time": "median of the differences of consecutive step-end times on replica 0 rank 0 "
                 "(ft-launch: StepCommitted times), warmup steps skipped; an arm's figure is the "
                 "median of its runs' medians",
}


@dataclass(frozen=True)
class SizePlan:
    name: str
    config: Mapping[str, int]     # GptConfig fields but vocab_size (train.py's SIZES)
    warmup: int
    steps: int                    # steps per run, warmup included


@dataclass(frozen=True)
class RunResult:
    """One run of one arm at one size in one pair."""

    arm: Arm
    size: str
    pair: int
    order: int                            # position of the run in its pair
    durations: tuple[float, ...] = ()     # step times after warmup
    error: str = ""                       # empty when the run worked
    last_loss: float | None = None
    wire_bytes_per_step: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.durations)

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.durations) if self.ok else None


@dataclass(frozen=True)
class RunSettings:
    """What every arm of one size is given: the same model, data and policy."""

    size: str
    config: Mapping[str, int]
    warmup: int
    steps: int
    threads: int
    timeout: float
    replicas: int = 3
    ranks: int = 2
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 0
    param_dtype: str = "bf16"
    reduce_dtype: str = "fp32"


@dataclass(frozen=True)
class RunId:
    arm: Arm
    pair: int
    order: int          # position of the run in its pair (-1: the extra bf16 wire run)


def ftl_command(s: RunSettings, python: str, train: Path, reduce_dtype: str) -> list[str]:
    """Arms (b)/(c): the example's own train.py with the FT-HSDP flags and the same
    seed, batch, learning rate and threads as (a)/(d). Its default optimizer,
    ResidentAdamW, computes torch's AdamW(foreach=False) bit for bit, with the state
    in the snapshot buffers: the per-step snapshot copies nothing."""
    return [python, str(train),
            "--size", s.size, "--steps", str(s.steps), "--parallel", "fsdp",
            "--param-dtype", s.param_dtype, "--reduce-dtype", reduce_dtype,
            "--optimizer", "resident-adamw", "--batch-size", str(s.batch_size), "--lr", str(s.lr),
            "--seed", str(s.seed), "--threads", str(s.threads)]


def ftl_config_env(overlap: bool, threads: int, replicas: int) -> dict[str, str]:
    """``LocalJob.config_env`` of arms (b) (overlap) and (c) (reduce after backward).
    Every quorum needs all ``replicas``, as torchft's lighthouse is told (its
    ``min_replicas``): otherwise a replica that builds the model more than the join
    window after the others misses step 0 and catches up, and the run is not the
    fault-free one both arms are timed on."""
    env = {"OMP_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": "lo",
           "FTL_QUORUM_MIN_REPLICAS": str(replicas)}
    if not overlap:
        env["FTL_RUNTIME_OVERLAP_BACKWARD"] = "false"
    return env


# ---------------------------------------------------------------- schedule


def interleave(arms: Sequence[Arm], pairs: int) -> list[list[Arm]]:
    """Each pair runs every arm once, the order rotated by one per pair, so no arm
    is always first (cold caches) or always after the same neighbour."""
    if pairs < 1:
        raise ValueError(f"pairs must be at least 1, got {pairs}")
    if not arms:
        return [[] for _ in range(pairs)]
    return [[arms[(pair + i) % len(arms)] for i in range(len(arms))] for pair in range(pairs)]


def step_durations(ended_by_step: Sequence[float], warmup: int) -> list[float]:
    """Step ``k``'s time is ``ended[k] - ended[k - 1]``; steps before ``warmup``
    (and step 0, which has no predecessor) are left out."""
    return [ended_by_step[k] - ended_by_step[k - 1]
            for k in range(max(1, warmup), len(ended_by_step))]


def commit_times(commits: Iterable[tuple[int, float]]) -> list[float]:
    """(step, time) pairs of one rank's commits -> times indexed by step. A fault-free
    run commits steps 0, 1, ... once each; anything else is an error."""
    by_step: dict[int, float] = {}
    for step, time in commits:
        if step in by_step:
            raise ValueError(f"step {step} committed twice: not a fault-free run")
        by_step[step] = time
    steps = sorted(by_step)
    if steps != list(range(len(steps))):
        raise ValueError(f"committed steps are not 0..{len(steps) - 1}: {steps[:10]}...")
    return [by_step[s] for s in steps]


# ---------------------------------------------------------------- summary


def geomean(values: Sequence[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def paired_ratio(runs: Sequence[RunResult], numerator: Arm, denominator: Arm) -> float | None:
    """Median over pairs of numerator / denominator, pairs where both ran only."""
    by_pair: dict[int, dict[Arm, float]] = {}
    for run in runs:
        if run.ok:
            by_pair.setdefault(run.pair, {})[run.arm] = statistics.median(run.durations)
    ratios = [p[numerator] / p[denominator] for p in by_pair.values()
              if numerator in p and denominator in p]
    return statistics.median(ratios) if ratios else None


MEASURED = ("measured: FTAR's own counters (bytes sent by replica 0's ranks, from their "
            "WorkerStopped events), per step")
COMPUTED = ("computed, not measured (no FTAR counters came back): 2 (n - 1) / n x the "
            "gradient bytes (params x reduce-dtype size) per replica per step")


def wire_summary(runs: Sequence[RunResult], bf16_run: RunResult | None, params: int,
                 replicas: int) -> dict[str, Any]:
    """FTAR bytes per step with fp32 (arm b's runs) and bf16 (``bf16_run``) reduce
    dtypes. The ratio is measured when both have counters; computed from the ring
    algorithm when the bf16 run worked but left no counters; None otherwise."""
    fp32 = [r.wire_bytes_per_step for r in runs
            if r.arm is Arm.FTL_OVERLAP and r.ok and r.wire_bytes_per_step]
    bf16 = bf16_run.wire_bytes_per_step if bf16_run is not None and bf16_run.ok else None
    computed = {"fp32": ring_wire_bytes(params * 4, replicas),
                "bf16": ring_wire_bytes(params * 2, replicas)}
    wire: dict[str, Any] = {
        "fp32_bytes_per_step": statistics.median(fp32) if fp32 else None,
        "bf16_bytes_per_step": bf16,
        "computed_fp32_bytes_per_step": computed["fp32"],
        "computed_bf16_bytes_per_step": computed["bf16"],
        "bf16_run_error": bf16_run.error if bf16_run is not None else "not run"}
    if fp32 and bf16:
        wire.update(ratio=bf16 / wire["fp32_bytes_per_step"], source=MEASURED)
    elif bf16_run is not None and bf16_run.ok:
        wire.update(ratio=computed["bf16"] / computed["fp32"], source=COMPUTED)
    else:
        wire.update(ratio=None, source="not measured: the bf16 reduce run did not work")
    return wire


def arm_figures(runs: Sequence[RunResult], arm: Arm) -> dict[str, Any]:
    mine = [r for r in runs if r.arm is arm]
    medians = [statistics.median(r.durations) for r in mine if r.ok]
    return {"median_step_s": statistics.median(medians) if medians else None,
            "run_medians_s": medians,
            "errors": sorted({r.error for r in mine if r.error}),
            "last_loss": next((r.last_loss for r in reversed(mine) if r.ok), None)}


def size_summary(runs: Sequence[RunResult], bf16_run: RunResult | None, params: int,
                 replicas: int) -> dict[str, Any]:
    ratios: dict[str, float | None] = {k: paired_ratio(runs, *arms) for k, arms in RATIOS.items()}
    wire = wire_summary(runs, bf16_run, params, replicas)
    ratios[WIRE_KEY] = wire["ratio"]
    return {"params": params, "arms": {arm.value: arm_figures(runs, arm) for arm in ARMS},
            "ratios": ratios, "wire": wire}


def summarise(per_size: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """Across sizes: the geometric mean of each per-size ratio, and the worst one."""
    summary: dict[str, float | None] = {}
    for key in [*RATIOS, WIRE_KEY]:
        values = [s["ratios"][key] for s in per_size.values() if s["ratios"].get(key)]
        summary[key] = geomean(values)
        summary[f"{key}_worst"] = max(values) if values else None
    return summary


def verdicts(summary: Mapping[str, float | None]) -> dict[str, bool | None]:
    """Each target met (figure at most the target), or None when not measured."""
    return {key: None if summary.get(key) is None else summary[key] <= target  # type: ignore[operator]
            for key, target in TARGETS.items()}


# ---------------------------------------------------------------- wire bytes


def bytes_per_step(counters: Iterable[Mapping[str, int]], steps: int) -> float:
    """FTAR payload bytes one replica sent per step: its ranks' ``bytes_sent`` summed."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    return sum(c["bytes_sent"] for c in counters) / steps


def ring_wire_bytes(payload_bytes: float, members: int) -> float:
    """What one member of a ring all-reduce sends: 2 (n - 1) / n of the payload."""
    if members < 1:
        raise ValueError(f"a ring has at least one member, got {members}")
    return 2 * (members - 1) / members * payload_bytes


# ---------------------------------------------------------------- sizes


def sizes_in_source(source: str) -> dict[str, dict[str, int]]:
    """The literal ``SIZES = {...}`` of the example's ``train.py`` ({} if none)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "SIZES" for t in targets):
                try:
                    value = ast.literal_eval(node.value)  # type: ignore[arg-type]
                except ValueError:
                    return {}
                return value if isinstance(value, dict) else {}
    return {}


def resolve_size(name: str, train_sizes: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """train.py's config for ``name``, so that every arm trains the same model;
    an unknown name fails with the valid ones."""
    if name not in train_sizes:
        raise ValueError(f"unknown size {name!r}; etc/examples/gpt/train.py has "
                         f"{sorted(train_sizes)}")
    return dict(train_sizes[name])


#: what arms (b) and (c) need of train.py
FTL_TRAIN_FLAGS = ("--parallel", "--param-dtype", "--reduce-dtype", "--optimizer")


def missing_train_support(help_text: str, size: str) -> list[str]:
    """What ``train.py --help`` lacks for the ft-launch arms at ``size`` ([] if none)."""
    missing = [flag for flag in FTL_TRAIN_FLAGS if flag not in help_text]
    choices = re.search(r"--size \{([^}]*)\}", help_text)
    if choices and size not in choices.group(1).split(","):
        missing.append(f"--size {size} (choices: {choices.group(1)})")
    return missing


# ---------------------------------------------------------------- table


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(per_size: Mapping[str, Mapping[str, Any]], summary: Mapping[str, float | None]) -> str:
    lines = [f"{'size':>8} {'params':>11} " + " ".join(f"{a.value:>15}" for a in ARMS)
             + "   (median step s)"]
    for name, s in per_size.items():
        lines.append(f"{name:>8} {s.get('params', 0):>11,} " + " ".join(
            f"{_fmt(s['arms'][a.value]['median_step_s'], '.4f'):>15}" for a in ARMS))
    lines.append("")
    for key in [*RATIOS, WIRE_KEY]:
        per = ", ".join(f"{n} {_fmt(s['ratios'][key], '.3f')}" for n, s in per_size.items())
        target = TARGETS.get(key)
        verdict = "" if target is None else f"  target <= {target}"
        if target is not None and summary.get(key) is not None:
            verdict += "  met" if summary[key] <= target else "  MISSED"  # type: ignore[operator]
        lines.append(f"{key:42s} {_fmt(summary.get(key), '.3f'):>7}{verdict}   ({per})")
    return "\n".join(lines)
