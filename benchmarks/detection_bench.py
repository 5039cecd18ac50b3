"""Detection benchmark (not a test): the product's detection in real runs, and the
detection library's on loopback.

**The product** (``benchmarks/product_run.py``; root, the lab cluster up): one real
``ft-launch run`` of ``etc/examples/train.sbatch`` per fault, the fault on replica 1's
node; timed from the fault (the rank's own log line, or the injector's clock) to the
controller's detection event, to the node drained with the fault's reason, and to the
replica back on the standby (``summary.product[FAULT]``: ``fault_to_event_s``,
``fault_to_drained_s``, ``fault_to_back_s``):

* ``hang_diagnose_s``: one rank deadlocks -> the controller's ``HangDiagnosisReported``
  (stall seen, py-spy stacks of both ranks taken and aggregated);
* ``sdc_locate_s``: one rank computes NaN gradients from a step on -> its node drained
  with the ``sdc`` reason;
* ``fail_slow_detect_s``: the node's training processes throttled -> ``FailSlowDetected``;
* ``kill``: the node crashes (its figures under ``product`` only).

Each is None, with ``product_not_run`` saying why, when the lab cluster is not up or
not as root, or with ``--library-only`` (and with ``details.product[FAULT].error``
when a run did not get there).

**The library** (``benchmarks/detection``: monitor, reporter, tracer, over ``health``'s
collector; not the product path):
eight worker processes form 4 data-parallel replicas of a 2-stage pipeline (one
rank per simulated node). Each step: stage 0 computes forward and sends
activations, stage 1 computes and sends gradients back, then all ranks meet in
an "all-reduce" run by a small coordinator; every rank reports its metrics and a
heartbeat to ``health``'s collector, and ``DetectionMonitor`` judges them.

* ``kill_detect_s``: SIGKILL one rank -> RANK_SILENT alarm.
* ``hang_detect_s`` / ``hang_detect_step_times``: SIGSTOP or a rank stuck in
  another function -> HANG alarm (median over the hang trials; max alongside).
* ``nan_detect_steps``: a NaN loss at step s -> the step the alarm names, minus s.
* ``over_eviction_accuracy``: randomised hang (SIGSTOP, stuck) and fail-slow
  injections through py-spy stack aggregation; a trial is right when the evicted
  nodes include the faulty one and stay within its pipeline (PP) group.

With ``--product-only`` these are None (``library_not_run`` says so).

    python benchmarks/detection_bench.py [--trials 24] [--seed 1] [--json FILE]
        [--product-only | --library-only] [--faults hang,sdc,slow,kill] [--fault-step 60]
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

from benchmarks.detection.monitor import AlarmKind, DetectionMonitor, MonitorSettings
from benchmarks.detection.reporter import MetricsReporter
from benchmarks.detection.tracer import fail_slow_eviction, hang_eviction
from benchmarks.hang_diagnosis import hang_figures
from benchmarks.product_run import DETECTION, FAULTS, run_with_fault, why_unavailable
from ft_launch.health.aggregation import RankPlace
from ft_launch.health.channel import Collector
from ft_launch.ids import new_job_secret

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
        env = {**os.environ, SECRET_ENV: self.secret}
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


def product(faults: list[str], step: int) -> dict[str, Any]:
    """One real run per fault (``product_run``); the reason instead when none can be."""
    reason = why_unavailable()
    if reason:
        return {"not_run": reason, "runs": {}}
    return {"not_run": None, "runs": {fault: run_with_fault(fault, step=step)
                                      for fault in faults}}


#: The product's headline figures: (summary key, fault, figure of product_run).
PRODUCT_KEYS = (("hang_diagnose_s", "hang", "fault_to_event_s"),
                ("sdc_locate_s", "sdc", "fault_to_drained_s"),
                ("fail_slow_detect_s", "slow", "fault_to_event_s"))
#: Per fault in ``summary.product``: the rest is in ``details.product``.
PRODUCT_FIGURES = ("event", "fault_to_event_s", "fault_to_drained_s", "fault_to_back_s")


def product_summary(found: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(summary keys, details) of the product runs."""
    figures = {fault: run.figures() for fault, run in found["runs"].items()}
    summary: dict[str, Any] = {key: figures.get(fault, {}).get(figure)
                               for key, fault, figure in PRODUCT_KEYS}
    summary["product"] = {fault: {k: f[k] for k in PRODUCT_FIGURES}
                          for fault, f in figures.items()}
    summary["product_not_run"] = found["not_run"]
    details = {"product": figures, "product_settings": dict(DETECTION)}
    if "hang" in found["runs"]:
        details["hang_diagnosis"] = hang_figures(found["runs"]["hang"])
    return summary, details


def library(trials: int, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(summary keys, details) of the loopback runs of the detection library."""
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
        "over_eviction_accuracy": round(sum(t["correct"] for t in details) / len(details), 4)
        if details else None,
        "trials": len(details),
    }
    return summary, {"hang_detect_step_times_max": round(max(hang_steps), 2)
                     if hang_steps else None, "trials": details}


LIBRARY_KEYS = ("kill_detect_s", "hang_detect_s", "hang_detect_step_times", "nan_detect_steps",
                "over_eviction_accuracy", "trials")


def run(trials: int, seed: int, faults: list[str], step: int,
        product_only: bool = False, library_only: bool = False) -> dict[str, Any]:
    found = ({"not_run": "--library-only", "runs": {}} if library_only
             else product(faults, step))
    product_keys, product_details = product_summary(found)
    if product_only:
        library_keys: dict[str, Any] = {key: None for key in LIBRARY_KEYS}
        library_details: dict[str, Any] = {"hang_detect_step_times_max": None, "trials": []}
    else:
        library_keys, library_details = library(trials, seed)
    summary = {**library_keys, **product_keys,
               "library_not_run": "--product-only" if product_only else None}
    return {"summary": summary, "details": {**library_details, **product_details}}


def fault_list(text: str) -> list[str]:
    faults = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or not faults:
        raise argparse.ArgumentTypeError(
            f"unknown fault(s) {unknown or text!r}: expected a comma-separated list of "
            f"{', '.join(FAULTS)}")
    return faults


def print_table(summary: dict[str, Any], details: dict[str, Any]) -> None:
    targets = {"kill_detect_s": "<= 5 s", "hang_detect_step_times": "<= 3",
               "nan_detect_steps": "<= 1", "over_eviction_accuracy": ">= 0.978"}
    sys.stdout.write("| metric | value | target |\n| --- | --- | --- |\n")
    for key, value in summary.items():
        if key == "product":
            for fault, figures in value.items():
                for name, figure in figures.items():
                    sys.stdout.write(f"| product[{fault}].{name} | {figure} | |\n")
        else:
            sys.stdout.write(f"| {key} | {value} | {targets.get(key, '')} |\n")
    sys.stdout.write(f"| hang_detect_step_times (max) | "
                     f"{details['hang_detect_step_times_max']} | |\n")
    for fault, figures in details.get("product", {}).items():
        if figures["error"]:
            sys.stdout.write(f"{fault}: {figures['error']} (run directory {figures['run_dir']})\n")


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list[:1] == ["--worker"]:
        worker_main(int(args_list[1]), args_list[2], args_list[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=24,
                        help="library: hang / fail-slow injections (default 24)")
    parser.add_argument("--seed", type=int, default=1, help="library: the trials' random seed")
    parser.add_argument("--json", help="write the results here")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--product-only", action="store_true",
                      help="only the real runs on the lab cluster, not the library's")
    only.add_argument("--library-only", action="store_true",
                      help="only the library's loopback runs, not the lab cluster's")
    parser.add_argument("--faults", type=fault_list, default=list(FAULTS),
                        help=f"product: the faults to inject, one run each "
                             f"(default {','.join(FAULTS)})")
    parser.add_argument("--fault-step", type=int, default=60,
                        help="product: the step at which each fault is injected (default 60)")
    args = parser.parse_args(args_list)
    result = run(args.trials, args.seed, args.faults, args.fault_step, args.product_only,
                 args.library_only)
    print_table(result["summary"], result["details"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
