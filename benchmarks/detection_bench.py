"""Detection benchmark (not a test): real training-like processes on loopback.

Eight worker processes form 4 data-parallel replicas of a 2-stage pipeline (one
rank per simulated node). Each step: stage 0 computes forward and sends
activations, stage 1 computes and sends gradients back, then all ranks meet in
an "all-reduce" run by a small coordinator; every rank reports its metrics and a
heartbeat to ``health``'s collector, and ``DetectionMonitor`` judges them.

Measured:
* ``kill_detect_s``: SIGKILL one rank -> RANK_SILENT alarm.
* ``hang_detect_s`` / ``hang_detect_step_times``: SIGSTOP or a rank stuck in
  another function -> HANG alarm (median over the hang trials; max alongside).
* ``nan_detect_steps``: a NaN loss at step s -> the step the alarm names, minus s.
* ``over_eviction_accuracy``: randomised hang (SIGSTOP, stuck) and fail-slow
  injections through py-spy stack aggregation; a trial is right when the evicted
  nodes include the faulty one and stay within its pipeline (PP) group.
* ``hang_diagnose_s``: the product (``benchmarks/hang_diagnosis.py``): in a real
  ``ft-launch run`` on the lab cluster one rank deadlocks -> the controller's hang
  diagnosis names it (None when the lab cluster is not up, or not as root).

``python benchmarks/detection_bench.py [--trials 24] [--seed 1] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ftcore.ids import new_job_secret
from health.aggregation import RankPlace
from health.channel import Collector
from health.monitor import AlarmKind, DetectionMonitor, MonitorSettings
from health.reporter import MetricsReporter
from health.tracer import fail_slow_eviction, hang_eviction

REPLICAS, STAGES = 4, 2
RANKS = REPLICAS * STAGES
COMPUTE_S = 0.05          # forward and backward each, per stage
WAIT_LIMIT_S = 300.0      # a worker gives up (exits) if a wait lasts longer
SECRET_ENV = "FTL_WORKER_SECRET"


# =========================================================================== worker side


def compute_forward(slow: float) -> None:
    time.sleep(COMPUTE_S * slow)  # stands for GPU work (released GIL, like a CUDA sync)


def compute_backward(slow: float) -> None:
    time.sleep(COMPUTE_S * slow)


def _request(sock: zmq.Socket, *parts: str) -> list[bytes]:
    sock.send_multipart([p.encode() for p in parts])
    deadline = time.monotonic() + WAIT_LIMIT_S
    while time.monotonic() < deadline:
        if sock.poll(100):
            return sock.recv_multipart()
    raise TimeoutError(f"no answer to {parts} in {WAIT_LIMIT_S}s")


def recv_activation(sock: zmq.Socket, step: int) -> None:
    _request(sock, "recv_act", str(step))


def recv_gradient(sock: zmq.Socket, step: int) -> None:
    _request(sock, "recv_grad", str(step))


def wait_allreduce(sock: zmq.Socket, step: int) -> dict[str, Any]:
    reply = _request(sock, "allreduce", str(step))
    return json.loads(reply[1])


def stuck_in_dataloader(sock: zmq.Socket) -> None:
    """A rank stuck in the wrong place (a dead dataloader): only 'release' frees it."""
    _request(sock, "stuck")


def train_step(sock: zmq.Socket, stage: int, step: int, directive: dict[str, Any]) -> dict:
    if directive.get("stuck"):
        stuck_in_dataloader(sock)
    slow = float(directive.get("slow", 1.0))
    if stage == 0:
        compute_forward(slow)
        sock.send_multipart([b"send_act", str(step).encode()])
        recv_gradient(sock, step)
        compute_backward(slow)
    else:
        recv_activation(sock, step)
        compute_forward(slow)
        compute_backward(slow)
        sock.send_multipart([b"send_grad", str(step).encode()])
    return wait_allreduce(sock, step)


def worker_main(rank: int, endpoint: str, metrics: str) -> None:
    reporter = MetricsReporter(metrics, os.environ[SECRET_ENV], rank,
                               heartbeat_interval=0.25).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, str(rank).encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    directive: dict[str, Any] = {}
    for step in range(10 ** 9):
        start = time.monotonic()
        nan_at = directive.get("nan_at")
        directive = train_step(sock, rank % STAGES, step, directive)
        loss = math.nan if nan_at == step else 2.0 + 0.1 * math.sin(step)
        reporter.report_step(step, loss, grad_norm=1.0 + 0.05 * math.cos(step),
                             step_time=time.monotonic() - start)


# =========================================================================== coordinator


@dataclass
class Collective:
    """Loopback stand-in for the pipeline's p2p and the all-reduce (a ROUTER thread)."""

    sock: zmq.Socket = field(init=False)
    endpoint: str = field(init=False)
    commands: queue.Queue = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.directives: dict[int, dict[str, Any]] = {}
        self.stuck_since: dict[int, float] = {}     # when a rank actually got stuck
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def set_directive(self, rank: int, directive: dict[str, Any]) -> None:
        self.commands.put(("directive", rank, directive))

    def release(self, rank: int) -> None:
        self.commands.put(("release", rank, {}))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        arrived: dict[int, set[int]] = {}
        ready: set[tuple[str, int, int]] = set()           # (kind, replica, step) sent
        parked: dict[tuple[str, int, int], bytes] = {}     # waiting receiver per message
        stuck: set[int] = set()
        while not self._stop.is_set():
            self._apply_commands(stuck)
            if not self.sock.poll(20):
                continue
            ident, verb, *rest = self.sock.recv_multipart()
            rank = int(ident)
            step = int(rest[0]) if rest else -1
            replica = rank // STAGES
            if verb == b"stuck":
                stuck.add(rank)
                self.stuck_since[rank] = time.monotonic()
            elif verb in (b"send_act", b"send_grad"):
                key = ("act" if verb == b"send_act" else "grad", replica, step)
                ready.add(key)
                if key in parked:
                    self.sock.send_multipart([parked.pop(key), b"ok"])
            elif verb in (b"recv_act", b"recv_grad"):
                key = ("act" if verb == b"recv_act" else "grad", replica, step)
                if key in ready:
                    self.sock.send_multipart([ident, b"ok"])
                else:
                    parked[key] = ident
            elif verb == b"allreduce":
                arrived.setdefault(step, set()).add(rank)
                if len(arrived[step]) == RANKS:
                    for member in sorted(arrived.pop(step)):
                        directive = json.dumps(self.directives.get(member, {}))
                        self.sock.send_multipart([str(member).encode(), b"done",
                                                  directive.encode()])
                    ready = {k for k in ready if k[2] >= step}

    def _apply_commands(self, stuck: set[int]) -> None:
        while True:
            try:
                kind, rank, directive = self.commands.get_nowait()
            except queue.Empty:
                return
            if kind == "directive":
                self.directives[rank] = directive
            elif rank in stuck:
                stuck.discard(rank)
                self.sock.send_multipart([str(rank).encode(), b"released"])


# =========================================================================== the benchmark


class Harness:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.secret = new_job_secret()
        self.collector = Collector(self.secret)
        self.collective = Collective()
        self.monitor = DetectionMonitor(MonitorSettings(silent_timeout=1.5, hang_factor=2.0,
                                                        min_hang_timeout=0.3))
        self.alarms: list[Any] = []
        self.topology = [RankPlace(rank=r, node=f"n{r}", replica_id=r // STAGES,
                                   dp_group=r % STAGES, tp_group=r, pp_group=r // STAGES)
                         for r in range(RANKS)]
        env = {**os.environ, SECRET_ENV: self.secret, "PYTHONPATH": str(REPO)}
        self.workers = [subprocess.Popen(
            [sys.executable, __file__, "--worker", str(r), self.collective.endpoint,
             self.collector.endpoint], env=env, stdin=subprocess.DEVNULL) for r in range(RANKS)]

    @property
    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in enumerate(self.workers)}

    def pump(self, seconds: float) -> None:
        """Feed the monitor for ``seconds`` (collector poll is the only wait)."""
        deadline = time.monotonic() + seconds
        while True:
            for envelope in self.collector.poll(max(0.0, min(0.05, deadline - time.monotonic()))):
                self.alarms += self.monitor.observe(envelope, time.monotonic())
            self.alarms += self.monitor.check(time.monotonic())
            if time.monotonic() >= deadline:
                return

    def wait_alarm(self, match: Any, timeout: float) -> Any:
        start = len(self.alarms)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump(0.02)
            for alarm in self.alarms[start:]:
                if match(alarm):
                    return alarm
        raise TimeoutError("no matching alarm")

    def wait_steps(self, count: int, timeout: float = 60.0) -> None:
        target = self.monitor.max_step + count
        deadline = time.monotonic() + timeout
        while self.monitor.max_step < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"training did not make {count} steps")
            self.pump(0.05)

    def pumping(self, work: Any, timeout: float = 120.0) -> Any:
        """Run ``work()`` in a thread while the monitor keeps reading: a controller's
        collector never stops while the tracer samples stacks."""
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError("the tracer did not finish")
            self.pump(0.05)
        return result[0]

    def allowed(self, rank: int) -> set[str]:
        pipeline = self.topology[rank].pp_group
        return {p.node for p in self.topology if p.pp_group == pipeline}

    def close(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(10)
        self.collective.stop()
        self.collector.close()


def hang_trial(h: Harness, kind: str, rank: int) -> dict[str, Any]:
    interval = h.monitor.step_interval or 0.0
    start = time.monotonic()
    if kind == "sigstop":
        os.kill(h.workers[rank].pid, signal.SIGSTOP)
    else:
        h.collective.stuck_since.pop(rank, None)
        h.collective.set_directive(rank, {"stuck": True})
    alarm = h.wait_alarm(lambda a: a.kind is AlarmKind.HANG and a.at >= start, 60)
    if kind != "sigstop":  # the directive takes effect at a step boundary: count from then
        start = h.collective.stuck_since[rank]
    detect = alarm.at - start
    _, decision = h.pumping(lambda: hang_eviction(h.pids, h.topology))
    if kind == "sigstop":
        os.kill(h.workers[rank].pid, signal.SIGCONT)
    else:
        h.collective.set_directive(rank, {})
        h.collective.release(rank)
    return {"kind": kind, "rank": rank, "detect_s": detect, "step_interval": interval,
            "evicted": list(decision.nodes) if decision else []}


def slow_trial(h: Harness, rank: int) -> dict[str, Any]:
    h.collective.set_directive(rank, {"slow": 4.0})
    h.wait_steps(2)
    decision = h.pumping(lambda: fail_slow_eviction(h.pids, h.topology, rounds=5,
                                                    interval=0.25))
    h.collective.set_directive(rank, {})
    return {"kind": "fail_slow", "rank": rank,
            "evicted": list(decision.nodes) if decision else []}


def nan_trial(h: Harness) -> int:
    rank = h.rng.randrange(RANKS)
    at = h.monitor.max_step + 3
    h.collective.set_directive(rank, {"nan_at": at})
    alarm = h.wait_alarm(lambda a: a.anomaly == "nan_loss", 60)
    h.collective.set_directive(rank, {})
    return alarm.step - at


def kill_trial(h: Harness) -> float:
    rank = h.rng.randrange(RANKS)
    start = time.monotonic()
    h.workers[rank].kill()
    h.wait_alarm(lambda a: a.kind is AlarmKind.RANK_SILENT and a.rank == rank, 60)
    return time.monotonic() - start


def product_hang() -> dict[str, Any] | None:
    """``hang_diagnosis.measure`` when the lab cluster is up and we are root."""
    from tests.cluster import labcluster
    if os.geteuid() != 0 or labcluster.current_state() is None:
        return None
    from benchmarks.hang_diagnosis import measure
    return measure()


def run(trials: int, seed: int) -> dict[str, Any]:
    hang = product_hang()
    h = Harness(seed)
    details: list[dict[str, Any]] = []
    try:
        h.wait_steps(15, timeout=120)                      # warm-up: baselines
        nan_steps = nan_trial(h)
        h.wait_steps(3)
        for _ in range(trials):
            kind = h.rng.choice(["sigstop", "stuck", "fail_slow"])
            rank = h.rng.randrange(RANKS)
            trial = slow_trial(h, rank) if kind == "fail_slow" else hang_trial(h, kind, rank)
            node = h.topology[rank].node
            trial["correct"] = node in trial["evicted"] and set(trial["evicted"]) <= h.allowed(rank)
            details.append(trial)
            h.wait_steps(6)                                # back to the healthy pace
        kill_s = kill_trial(h)
    finally:
        h.close()
    hangs = [t for t in details if "detect_s" in t]
    hang_steps = [t["detect_s"] / t["step_interval"] for t in hangs if t["step_interval"]]
    summary = {
        "kill_detect_s": round(kill_s, 3),
        "hang_detect_s": round(statistics.median(t["detect_s"] for t in hangs), 3) if hangs
        else None,
        "hang_detect_step_times": round(statistics.median(hang_steps), 2) if hang_steps else None,
        "nan_detect_steps": nan_steps,
        "over_eviction_accuracy": round(sum(t["correct"] for t in details) / len(details), 4),
        "trials": len(details),
        "hang_diagnose_s": hang["hang_diagnose_s"] if hang else None,
    }
    return {"summary": summary,
            "details": {"hang_detect_step_times_max": round(max(hang_steps), 2)
                        if hang_steps else None, "trials": details,
                        "hang_diagnosis": hang}}


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list[:1] == ["--worker"]:
        worker_main(int(args_list[1]), args_list[2], args_list[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=24, help="hang / fail-slow injections")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(args_list)
    result = run(args.trials, args.seed)
    targets = {"kill_detect_s": "<= 5 s", "hang_detect_step_times": "<= 3",
               "nan_detect_steps": "<= 1", "over_eviction_accuracy": ">= 0.978"}
    sys.stdout.write("| metric | value | target |\n| --- | --- | --- |\n")
    for key, value in result["summary"].items():
        sys.stdout.write(f"| {key} | {value} | {targets.get(key, '')} |\n")
    sys.stdout.write(f"| hang_detect_step_times (max) | "
                     f"{result['details']['hang_detect_step_times_max']} | |\n")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
