"""Thin shell of ``hsdp_bench``: one run of one arm, as real processes on this
machine, read back into a ``core.RunResult``. Every process is one this module
(or ``LocalJob``) started, ended by its own handle. No fixed port: arm (a) meets
through a FileStore, arm (d) through TCPStores and a lighthouse on ports the
kernel picks, arms (b)/(c) as ``LocalJob`` arranges."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .core import (
    RunId,
    RunResult,
    RunSettings,
    bytes_per_step,
    commit_times,
    ftl_command,
    ftl_config_env,
    step_durations,
)
from .replica_train import WorkerSpec
from .torchft_env import TorchftEnv

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TRAIN = REPO / "etc" / "examples" / "gpt" / "train.py"
LOG_TAIL = 1500


def worker_env(threads: int) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), GLOO_SOCKET_IFNAME="lo",
                PYTHONUNBUFFERED="1")


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-LOG_TAIL:] if path.exists() else "(no log)"


def run_processes(argvs: Sequence[Sequence[str]], env: Mapping[str, str], run_dir: Path,
                  timeout: float) -> str:
    """Start every argv (log ``run_dir/proc-I.log``); wait for all to exit 0.
    Returns "" or what went wrong (the first failure, with its log's tail); on a
    failure or ``timeout`` the others are killed."""
    procs: list[subprocess.Popen[bytes]] = []
    logs = [run_dir / f"proc-{i}.log" for i in range(len(argvs))]
    try:
        for argv, path in zip(argvs, logs):
            with path.open("wb") as out:
                procs.append(subprocess.Popen(list(argv), env=dict(env), stdout=out,
                                              stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout
        while True:
            for i, proc in enumerate(procs):
                code = proc.poll()
                if code not in (None, 0):
                    return f"process {i} exited {code}: {tail(logs[i])}"
            if all(p.poll() == 0 for p in procs):
                return ""
            if time.monotonic() > deadline:
                return f"ran past {timeout:.0f} s; process 0: {tail(logs[0])}"
            running = next(p for p in procs if p.poll() is None)
            try:
                running.wait(timeout=0.5)   # wake on an exit, or look again soon
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def _spec(s: RunSettings, out_dir: Path) -> WorkerSpec:
    return WorkerSpec(size=dict(s.config), steps=s.steps, batch_size=s.batch_size, lr=s.lr,
                      seed=s.seed, threads=s.threads, param_dtype=s.param_dtype,
                      reduce_dtype=s.reduce_dtype, replicas=s.replicas, ranks=s.ranks,
                      out_dir=str(out_dir))


def _worker_result(rid: RunId, s: RunSettings, out_dir: Path, error: str) -> RunResult:
    record_path = out_dir / "replica-0-rank-0.json"
    if error or not record_path.exists():
        return RunResult(rid.arm, s.size, rid.pair, rid.order,
                         error=error or f"no result file {record_path}")
    record = json.loads(record_path.read_text())
    extra = {"committed_steps": record.get("committed"), "params": record["params"]}
    if "torchft_version" in record:
        extra["torchft_version"] = record["torchft_version"]
    return RunResult(rid.arm, s.size, rid.pair, rid.order,
                     durations=tuple(step_durations(record["step_ended"], s.warmup)),
                     last_loss=record["losses"][-1], extra=extra)


def _worker_argvs(python: str, script: Path, spec: WorkerSpec, rendezvous: Path,
                  world: int, *extra: str) -> list[list[str]]:
    return [[python, str(script), "--spec", spec.to_json(), "--rank", str(g),
             "--rendezvous", str(rendezvous), *extra] for g in range(world)]


# ---------------------------------------------------------------- (a) native HSDP


def run_native(rid: RunId, s: RunSettings, run_dir: Path) -> RunResult:
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "out"
    argvs = _worker_argvs(sys.executable, HERE / "native_worker.py", _spec(s, out),
                          run_dir / "filestore", s.replicas * s.ranks)
    error = run_processes(argvs, worker_env(s.threads), run_dir, s.timeout)
    return _worker_result(rid, s, out, error)


# ---------------------------------------------------------------- (d) torchft


def run_torchft(rid: RunId, s: RunSettings, run_dir: Path, env: TorchftEnv) -> RunResult:
    """A fresh lighthouse per run (needing every replica group), then the workers."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "out"
    address_file = run_dir / "lighthouse.address"
    with (run_dir / "lighthouse.log").open("wb") as lh_log:
        lighthouse = subprocess.Popen(
            [str(env.python), str(HERE / "torchft_lighthouse.py"), "--min-replicas",
             str(s.replicas), "--address-file", str(address_file)],
            env=worker_env(1), stdin=subprocess.PIPE, stdout=lh_log, stderr=subprocess.STDOUT)
    try:
        error = _wait_for_file(address_file, lighthouse, 60.0)
        if not error:
            argvs = _worker_argvs(str(env.python), HERE / "torchft_worker.py", _spec(s, out),
                                  run_dir, s.replicas * s.ranks, "--lighthouse",
                                  address_file.read_text().strip())
            error = run_processes(argvs, worker_env(s.threads), run_dir, s.timeout)
    finally:
        assert lighthouse.stdin is not None
        lighthouse.stdin.close()           # its signal to stop
        try:
            lighthouse.wait(timeout=30)
        except subprocess.TimeoutExpired:
            lighthouse.kill()
            lighthouse.wait(timeout=30)
    if error and not address_file.exists():
        error += f"; lighthouse: {tail(run_dir / 'lighthouse.log')}"
    return _worker_result(rid, s, out, error)


def _wait_for_file(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            return f"the lighthouse exited {proc.returncode} before listening"
        if time.monotonic() > deadline:
            return f"the lighthouse did not listen within {timeout:.0f} s"
        try:
            proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
    return ""


# ---------------------------------------------------------------- (b), (c) ft-launch


def run_ftl(rid: RunId, s: RunSettings, run_dir: Path, overlap: bool,
            reduce_dtype: str | None = None) -> RunResult:
    from ft_launch.launcher.worker.events import WorkerStopped
    from ft_launch.launcher.worker.local import LocalJob

    job = LocalJob(run_dir, replicas=s.replicas, ranks=s.ranks,
                   command=ftl_command(s, sys.executable, TRAIN, reduce_dtype or s.reduce_dtype),
                   config_env=ftl_config_env(overlap, s.threads, s.replicas))
    error = ""
    try:
        job.start_all()
        codes = job.wait_all(s.timeout)
        bad = {r: c for r, c in codes.items() if c}
        if bad:
            first = min(bad)
            error = f"replica {first} exited {bad[first]}: {job.log(first)[-LOG_TAIL:]}"
    except subprocess.TimeoutExpired:
        error = f"ran past {s.timeout:.0f} s: {job.log(0)[-LOG_TAIL:]}"
    finally:
        job.stop_everything()
    if error:
        return RunResult(rid.arm, s.size, rid.pair, rid.order, error=error)
    commits = job.committed(0)
    try:
        ended = commit_times((e.step, e.time) for e in commits)
    except ValueError as exc:
        return RunResult(rid.arm, s.size, rid.pair, rid.order, error=str(exc))
    # FTAR's own counters, published by each rank when its runtime closes
    counters = [{"bytes_sent": e.ftar_bytes_sent, "ops": e.ftar_ops}
                for rank in range(s.ranks) for e in job.events(0, rank)
                if isinstance(e, WorkerStopped)]
    wire = bytes_per_step(counters, s.steps) if len(counters) >= s.ranks else None
    return RunResult(rid.arm, s.size, rid.pair, rid.order,
                     durations=tuple(step_durations(ended, s.warmup)),
                     last_loss=commits[-1].loss if commits else None,
                     wire_bytes_per_step=wire,
                     extra={"committed_steps": len(ended), "reduce_dtype":
                            reduce_dtype or s.reduce_dtype, "ftar_counters": counters})
