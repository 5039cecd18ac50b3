"""Run the example training as real replica processes on loopback, inject faults,
and read back what happened (events, audit, final state)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ftcore.events import read_events
from ftcore.ids import new_job_secret
from launcher.worker import events as _worker_events  # noqa: F401  (registers event types)

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "etc" / "examples" / "gpt" / "train.py"

#: Fast failure detection for tests (seconds), through the real config path (FTL_*).
TEST_CONFIG = {
    "FTL_QUORUM_HEARTBEAT_INTERVAL": "0.1", "FTL_QUORUM_ELECTION_TIMEOUT": "0.5",
    "FTL_QUORUM_MEMBER_TIMEOUT": "1.0", "FTL_QUORUM_JOIN_TIMEOUT": "1.0",
    "FTL_FTAR_TIMEOUT": "3", "FTL_FTAR_CONNECT_TIMEOUT": "3",
    "FTL_CKPT_FETCH_TIMEOUT": "30", "FTL_CKPT_PERSIST_EVERY": "1000",
    "FTL_RUNTIME_MAX_CONSECUTIVE_FAILURES": "50",
}


@dataclass
class LoopbackJob:
    run_dir: Path
    replicas: int
    steps: int
    size: str = "tiny"
    batch_size: int = 8
    secret: str = field(default_factory=new_job_secret)
    procs: dict[int, list[subprocess.Popen]] = field(default_factory=dict)

    def env(self, replica_id: int, inject: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FTL_", "FTLAUNCH_"))}
        env.update(TEST_CONFIG)
        env.update({"FTLAUNCH_REPLICA_ID": str(replica_id),
                    "FTLAUNCH_NUM_REPLICAS": str(self.replicas),
                    "FTLAUNCH_RUN_DIR": str(self.run_dir), "FTLAUNCH_JOB_SECRET": self.secret,
                    "FTLAUNCH_HOST": "127.0.0.1", "FTLAUNCH_JOB_ID": "loopback",
                    "FTLAUNCH_INJECT": inject, "OMP_NUM_THREADS": "1"})
        return env

    def start(self, replica_id: int, inject: str = "") -> subprocess.Popen:
        log = (self.run_dir / f"replica-{replica_id}.log").open("ab")
        proc = subprocess.Popen([sys.executable, str(TRAIN), "--steps", str(self.steps),
                                 "--size", self.size, "--batch-size", str(self.batch_size),
                                 "--threads", "1"],
                                env=self.env(replica_id, inject), stdout=log,
                                stderr=subprocess.STDOUT)
        self.procs.setdefault(replica_id, []).append(proc)
        return proc

    def start_all(self, injects: dict[int, str] | None = None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for replica_id in range(self.replicas):
            self.start(replica_id, (injects or {}).get(replica_id, ""))

    def current(self, replica_id: int) -> subprocess.Popen:
        return self.procs[replica_id][-1]

    def wait_all(self, timeout: float) -> dict[int, int]:
        return {r: p[-1].wait(timeout=timeout) for r, p in self.procs.items()}

    def stop_everything(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                    proc.wait(timeout=30)

    # ------------------------------------------------------------------ results

    def events(self, replica_id: int) -> list:
        path = self.run_dir / "events" / f"replica-{replica_id}-rank-0.jsonl"
        return list(read_events(path)) if path.exists() else []

    def committed(self, replica_id: int) -> list:
        return [e for e in self.events(replica_id) if type(e).__name__ == "StepCommitted"]

    def last_committed_step(self, replica_id: int) -> int:
        steps = [e.step for e in self.committed(replica_id)]
        return max(steps) if steps else -1

    def finals(self) -> dict[int, dict]:
        return {r: json.loads((self.run_dir / "final" / f"replica-{r}-rank-0.json").read_text())
                for r in range(self.replicas)}

    def log(self, replica_id: int) -> str:
        return (self.run_dir / f"replica-{replica_id}.log").read_text(errors="replace")


def audit_records(run_dir: Path) -> dict[int, dict]:
    """Committed steps from every replica's audit log, merged (they must agree)."""
    merged: dict[int, dict] = {}
    for path in sorted((run_dir / "audit").glob("replica-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            key = {k: record[k] for k in ("positions_before", "counts")}
            previous = merged.setdefault(record["step"], key)
            assert previous == key, f"replicas disagree on step {record['step']}: {previous} {key}"
    return merged


def check_exactly_once(run_dir: Path, replicas: int, batch_size: int, steps: int) -> list[int]:
    """Every committed step present once; each replica's samples consumed as one gapless,
    overlap-free run from 0. Returns the final positions."""
    records = audit_records(run_dir)
    assert sorted(records) == list(range(steps)), f"steps committed: {sorted(records)}"
    positions = [0] * replicas
    for step in range(steps):
        record = records[step]
        assert record["positions_before"] == positions, (step, record, positions)
        for r, count in enumerate(record["counts"]):
            assert count in (0, batch_size), (step, record)
            positions[r] += count
    return positions


def max_gap(events: list, start_step: int = 1) -> float:
    """Longest wall-clock gap between consecutive commits (from ``start_step``)."""
    times = sorted(e.time for e in events if type(e).__name__ == "StepCommitted"
                   and e.step >= start_step)
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)
