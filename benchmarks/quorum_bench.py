"""Benchmark of the replica quorum (not a test).

    python benchmarks/quorum_bench.py [--sizes 3,12,100,1000] [--rounds 40]
                                      [--failover-runs 3] [--json FILE]

Members are real ``QuorumAgent`` s on loopback, one agent per process as in a
job (a replica's rank 0 runs one), started from a fork server that has imported
the quorum once, so each costs about 9 MB of its own memory: 1,000 members need
about 9 GB and every member's work shares this machine's cores. For 3 and 12
members any of them may win the election; for 100 and 1,000 only replica 0 may
(the others are ``electable=False``): one election among 1,000 voters on two
shared cores takes longer than the election slot it is sized for, and the
benchmark measures the rounds, not the election.

* quorum-round latency: every member calls ``request_quorum`` at the same
  instant ``t0``; a round ends when the last member has its answer. p50/p99
  over ``--rounds`` rounds. On this box that includes every member's own
  CPU work (1,000 members' joins and answers on 2 shared cores), which in a
  job runs on 1,000 machines in parallel; so the leader's join window (first
  join arrived -> quorum formed, from its ``QuorumFormed`` event) is printed too,
  with ``formed`` (t0 -> the leader formed the quorum) and ``fan-out`` (formed
  -> the last member has its answer), and the CPU time all member processes
  spent per round (between rounds included: heartbeats go on). The largest
  size is measured again with ``quorum.standing`` on and off (the cases use the
  product default, on): with it, the rounds follow each other as steps do, so
  the leader grants its quorum ahead and most are answered by each member on
  the spot (``summary.standing_round``); without it, every step is a full round
  of joins and answers (``summary.full_round``), both with the keys of a case.
* messages per round: every message any agent sent during the measured
  rounds (joins, announcements, and the heartbeats/acks that fell inside),
  divided by the number of rounds; an announcement published once on the
  leader's feed counts once (ZeroMQ copies it to each follower process).
* failover: 5 members (one process each, default ``QuorumConfig``) run a step
  loop (``get_quorum``, then a 50 ms "step"); the leader's process is
  SIGKILLed; failover = time until every survivor has received a quorum
  without the old leader.
* survivor stall (``summary.two_replica_survivor_stall_s``): 2 replicas and
  a witness (the controller is one in a job), same step loop, the leader
  SIGKILLed: the survivor's longest gap between quorums from the kill on
  (target: ``member_timeout`` + one step).

Figures taken on a shared 2-core machine are noisy. ``shadow_bench.py`` reuses the
hosts (``start_hosts``, ``round_once``, the ``kill`` and ``commit_failed``
commands) with worker-sized addresses (``HostSpec.ranks``).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from record import write_json

from ft_launch.config import QuorumConfig
from ft_launch.errors import RecoverableError
from ft_launch.ids import new_job_secret
from ft_launch.launcher.quorum import FileDirectory, QuorumAgent, QuorumFormed
from ft_launch.launcher.quorum.model import Role, witness_ids
from ft_launch.launcher.worker.protocol import ReplicaEndpoints

JOB = "quorum-bench"
TARGETS = {"p50_ms": 50.0, "p99_ms": 200.0, "failover_s": 3.0}


@dataclass(frozen=True)
class HostSpec:
    replica_id: int
    replicas: int
    secret: str
    directory: str
    electable: bool = True
    #: Ranks each replica advertises in its quorum address (0: the agent's own
    #: address), as the worker does with ``ReplicaEndpoints`` (shadow mode).
    ranks: int = 0
    #: ``quorum.standing`` (off: every step is a full round).
    standing: bool = QuorumConfig().standing


def advertised(replica_id: int, ranks: int) -> str:
    """A replica leader's address as the worker advertises it: every rank's FTAR
    and state-server endpoint (synthetic hosts and ports of a 100K-GPU cluster)."""
    def endpoint(rank: int, base: int) -> tuple[str, int]:
        node = replica_id * ranks + rank
        return f"10.{node // 65536 % 256}.{node // 256 % 256}.{node % 256}", base + rank % 1000
    return ReplicaEndpoints(tuple(endpoint(r, 40000) for r in range(ranks)),
                            tuple(endpoint(r, 50000) for r in range(ranks))).encode()


# --------------------------------------------------------------------------- member process


def process_context() -> Any:
    """Processes forked from a server that imported the quorum (and zmq) once: a
    member starts in milliseconds and shares those pages with the others."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["ft_launch.launcher.quorum", "zmq"])
    return ctx


def host_main(conn: Any, spec: HostSpec) -> None:
    """Run the agent of ``spec.replica_id`` and obey the coordinator."""
    config = QuorumConfig(standing=spec.standing)
    electable = spec.electable or spec.replica_id == 0
    agent: QuorumAgent | None = QuorumAgent(
        spec.replica_id, range(spec.replicas), FileDirectory(spec.directory, spec.secret, JOB),
        spec.secret, config, job_id=JOB, electable=electable)
    assert agent is not None
    address = advertised(spec.replica_id, spec.ranks) if spec.ranks else None
    windows: list[tuple[float, float]] = []  # (window, monotonic time formed)
    agent.bind()
    # Only a member that may lead forms quorums (and reports their windows).
    if electable:
        agent.subscribe(lambda e: windows.append((e.window_s, time.monotonic()))
                        if isinstance(e, QuorumFormed) else None)
    conn.send("started")
    while True:
        command, *args = conn.recv()
        if command == "begin":
            agent.start()
            conn.send("ok")
        elif command == "leaders":
            conn.send({spec.replica_id: agent.status().leader_id} if agent else {})
        elif command == "round":
            windows.clear()
            reply = _round(agent, address, *args) if agent else {"answered": 0, "sizes": []}
            conn.send({**reply, "windows": list(windows)})
        elif command == "kill":
            # Stopping closes the sockets without a word: to the others it is a crash.
            if agent is not None and spec.replica_id in args[0]:
                agent.stop()
                agent = None
            conn.send("ok")
        elif command == "commit_failed":
            # Its step's all-reduce failed (a member of its quorum is gone), as a
            # worker reports it: the next quorum takes a round.
            if agent is not None and spec.replica_id in args[0]:
                agent.report_commit_failure()
            conn.send("ok")
        elif command == "counters":
            conn.send((agent.stats()["sent"] if agent else 0, time.process_time()))
        elif command == "stop":
            break
    if agent is not None:
        agent.stop()


def _round(agent: QuorumAgent, address: str | None, step: int, t0: float,
           timeout: float) -> dict[str, Any]:
    time.sleep(max(0.0, t0 - time.monotonic()))
    issued = time.monotonic()
    future = agent.request_quorum(step, address=address)
    try:
        quorum = future.result(timeout)
    except Exception:  # noqa: BLE001 - reported as not answered
        return {"last": float("inf"), "first": 0.0, "issued": issued, "answered": 0,
                "quorum_ids": [], "sizes": []}
    answered = time.monotonic()
    return {"last": answered, "first": answered, "issued": issued, "answered": 1,
            "quorum_ids": [quorum.quorum_id], "sizes": [len(quorum.members)]}


# --------------------------------------------------------------------------- coordinator


class Hosts:
    """One process per member, replica ``i`` in ``procs[i]``."""

    def __init__(self, replicas: int, electable: bool, ranks: int = 0,
                 standing: bool = QuorumConfig().standing) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="quorum-bench-")
        secret = new_job_secret()
        ctx = process_context()
        self.pipes = []
        self.procs = []
        for replica_id in range(replicas):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=host_main, daemon=True,
                               args=(theirs, HostSpec(replica_id, replicas, secret,
                                                      self._tmp.name, electable, ranks,
                                                      standing)))
            proc.start()
            self.pipes.append(ours)
            self.procs.append(proc)
        for pipe in self.pipes:
            if not pipe.poll(120) or pipe.recv() != "started":
                raise RuntimeError("a host process did not start")

    def ask(self, *command: Any, timeout: float = 60.0) -> list[Any]:
        for pipe in self.pipes:
            pipe.send(command)
        replies = []
        for pipe in self.pipes:
            if not pipe.poll(timeout):
                raise RuntimeError(f"no reply to {command[0]} within {timeout}s")
            replies.append(pipe.recv())
        return replies

    def leader(self) -> int | None:
        """The leader every member agrees on, if they all agree."""
        views: dict[int, int | None] = {}
        for reply in self.ask("leaders"):
            views.update(reply)
        leaders = set(views.values())
        return leaders.pop() if len(leaders) == 1 and None not in leaders else None

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        self._tmp.cleanup()


def wait_for(predicate: Any, timeout: float, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise RuntimeError(f"condition not met within {timeout}s")


def start_hosts(members: int, ranks: int = 0,
                standing: bool = QuorumConfig().standing) -> Hosts:
    """Hosts with every agent started and a leader everyone follows (replica 0
    beyond 12 members: the only electable one)."""
    hosts = Hosts(members, electable=members <= 12, ranks=ranks, standing=standing)
    try:
        hosts.ask("begin")
        wait_for(lambda: hosts.leader() is not None, 120)
    except BaseException:
        hosts.close()
        raise
    return hosts


def round_once(hosts: Hosts, step: int, expect: int, timeout: float = 30.0
               ) -> tuple[float, list[dict[str, Any]]]:
    """One round from a common start; (latency, the hosts' replies)."""
    t0 = time.monotonic() + 0.02 + 1e-4 * len(hosts.pipes)  # the commands reach them all
    replies = hosts.ask("round", step, t0, timeout, timeout=timeout + 30)
    if sum(r["answered"] for r in replies) != expect:
        raise RuntimeError(f"round {step}: not every member was answered: {replies}")
    return max(r["last"] for r in replies if r["answered"]) - t0, replies


def measure_rounds(members: int, rounds: int, ranks: int = 0,
                   standing: bool = QuorumConfig().standing) -> dict[str, Any]:
    hosts = start_hosts(members, ranks, standing)
    try:
        leader = hosts.leader() or 0
        latencies = []
        windows = []
        phases = []  # (t0 -> formed, formed -> first answer, formed -> last answer)
        before, before_leader = (0, 0.0), 0.0
        for step in range(rounds + 3):
            if step == 3:
                counters = hosts.ask("counters")
                before, before_leader = _totals(counters), counters[leader][1]
            latency, replies = round_once(hosts, step, members)
            if step >= 3:
                latencies.append(latency)
                formed = [w for r in replies for w in r["windows"]]
                windows += [w for w, _ in formed]
                if formed:
                    at = formed[-1][1]
                    first = min(r["first"] for r in replies if r["answered"])
                    last = max(r["last"] for r in replies)
                    phases.append((at - (last - latency), first - at, last - at))
        final = hosts.ask("counters")
        after = _totals(final)
        sent, cpu = after[0] - before[0], after[1] - before[1]
        leader_cpu = final[leader][1] - before_leader
    finally:
        hosts.close()
    latencies.sort()
    windows.sort()
    phase_p50 = [statistics.median(p[i] for p in phases) if phases else float("nan")
                 for i in range(3)]
    return {"members": members, "p50_ms": round(1000 * _quantile(latencies, 0.50), 2),
            "p99_ms": round(1000 * _quantile(latencies, 0.99), 2),
            "messages_per_round": round(sent / rounds, 1), "rounds": rounds,
            "leader_window_p50_ms": round(1000 * _quantile(windows, 0.50), 2),
            "cpu_ms_per_round": round(1000 * cpu / rounds, 1),
            "formed_p50_ms": round(1000 * phase_p50[0], 2),
            "fan_out_p50_ms": round(1000 * phase_p50[2], 2),
            "leader_cpu_ms_per_round": round(1000 * leader_cpu / rounds, 1)}


def _totals(replies: list[tuple[int, float]]) -> tuple[int, float]:
    return sum(r[0] for r in replies), sum(r[1] for r in replies)


def _quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted ``values`` (NaN for none: every step of a
    standing quorum may be answered without a round, so no window is measured)."""
    if not values:
        return float("nan")
    index = min(len(values) - 1, max(0, round(q * len(values) + 0.5) - 1))
    return values[index]


# --------------------------------------------------------------------------- failover


def failover_main(conn: Any, spec: HostSpec, witnesses: tuple[int, ...] = ()) -> None:
    """One member in a step loop; reports every quorum it receives. A witness
    (its id among ``witnesses``) only votes."""
    me = spec.replica_id
    agent = QuorumAgent(me, range(spec.replicas),
                        FileDirectory(spec.directory, spec.secret, JOB), spec.secret,
                        QuorumConfig(), job_id=JOB, witnesses=witnesses,
                        electable=me not in witnesses).start()
    if me in witnesses:
        conn.send("witness")
        conn.recv()  # until the coordinator ends it
        return
    step = 0
    while True:
        try:
            quorum = agent.get_quorum(step, timeout=10)
        except RecoverableError:
            continue
        conn.send((time.monotonic(), quorum.replica_ids, agent.status().role is Role.LEADER))
        step = quorum.max_step + 1
        time.sleep(0.05)  # the training step this benchmark does not run


def measure_failover(members: int = 5) -> float:
    tmp = tempfile.TemporaryDirectory(prefix="quorum-failover-")
    secret = new_job_secret()
    ctx = process_context()
    pipes, procs = [], []
    for r in range(members):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=failover_main, daemon=True,
                           args=(theirs, HostSpec(r, members, secret, tmp.name)))
        proc.start()
        pipes.append(ours)
        procs.append(proc)
    try:
        reports: list[list[tuple[float, tuple[int, ...], bool]]] = [[] for _ in procs]

        def drain() -> None:
            for i, pipe in enumerate(pipes):
                while procs[i].is_alive() and pipe.poll():
                    reports[i].append(pipe.recv())

        def steady() -> bool:
            drain()
            return all(len(r) >= 10 and len(r[-1][1]) == members for r in reports)

        wait_for(steady, 120, 0.05)
        leader = next(i for i, r in enumerate(reports) if r[-1][2])
        killed_at = time.monotonic()
        procs[leader].kill()

        def recovered() -> list[float] | None:
            drain()
            firsts = [next((t for t, ids, _ in r if t > killed_at and leader not in ids), None)
                      for i, r in enumerate(reports) if i != leader]
            return None if None in firsts else firsts  # type: ignore[return-value]

        firsts = wait_for(recovered, 30, 0.02)
        return max(firsts) - killed_at
    finally:
        for proc in procs:
            proc.kill()
            proc.join(5)
        tmp.cleanup()


# --------------------------------------------------------------------------- survivor stall


def measure_survivor_stall(step_s: float = 0.05) -> dict[str, float]:
    """2 replicas and a witness (as the controller is one), default timeouts, in a
    step loop; the leader is SIGKILLed; the survivor's longest gap between two
    quorums (a commit each) from the kill on, and its bound by the config:
    ``member_timeout`` + one step."""
    [witness] = witness_ids(1)
    tmp = tempfile.TemporaryDirectory(prefix="quorum-survivor-")
    secret = new_job_secret()
    ctx = process_context()
    pipes, procs = [], []
    for r in (0, 1, witness):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=failover_main, daemon=True,
                           args=(theirs, HostSpec(r, 2, secret, tmp.name), (witness,)))
        proc.start()
        pipes.append(ours)
        procs.append(proc)
    try:
        reports: list[list[tuple[float, tuple[int, ...], bool]]] = [[], []]

        def drain() -> None:
            for i in (0, 1):
                while procs[i].is_alive() and pipes[i].poll():
                    reports[i].append(pipes[i].recv())

        def steady() -> bool:
            drain()
            return all(len(r) >= 10 and r[-1][1] == (0, 1) for r in reports)

        wait_for(steady, 120, 0.05)
        leader = next(i for i, r in enumerate(reports) if r[-1][2])
        survivor = 1 - leader
        killed_at = time.monotonic()
        procs[leader].kill()

        def trained_alone() -> bool:
            drain()
            return sum(1 for t, ids, _ in reports[survivor]
                       if t > killed_at and ids == (survivor,)) >= 10
        wait_for(trained_alone, 60, 0.02)
        times = [killed_at] + [t for t, _, _ in reports[survivor] if t > killed_at]
        stall = max(b - a for a, b in itertools.pairwise(times))
        bound = QuorumConfig().member_timeout + step_s
        return {"stall_s": stall, "bound_s": bound}
    finally:
        for proc in procs:
            proc.kill()
            proc.join(5)
        tmp.cleanup()


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="3,12,100,1000")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--failover-runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    cases = []
    print(f"{'members':>8} {'p50 ms':>8} {'p99 ms':>8} {'msgs/round':>11} "
          f"{'leader window p50 ms':>21} {'formed p50 ms':>14} {'fan-out p50 ms':>15} "
          f"{'cpu ms/round':>13} {'leader cpu ms/round':>20}")
    for members in (int(s) for s in args.sizes.split(",")):
        case = measure_rounds(members, args.rounds)
        cases.append(case)
        print(f"{case['members']:>8} {case['p50_ms']:>8.2f} {case['p99_ms']:>8.2f} "
              f"{case['messages_per_round']:>11.1f} {case['leader_window_p50_ms']:>21.2f} "
              f"{case['formed_p50_ms']:>14.2f} {case['fan_out_p50_ms']:>15.2f} "
              f"{case['cpu_ms_per_round']:>13.1f} {case['leader_cpu_ms_per_round']:>20.1f}",
              flush=True)
    largest = max(case["members"] for case in cases)
    standing = measure_rounds(largest, args.rounds, standing=True)
    print(f"{largest} members, steps on the leader's grant (quorum.standing on): "
          f"p50 {standing['p50_ms']:.2f} ms, p99 {standing['p99_ms']:.2f} ms, "
          f"{standing['messages_per_round']:.1f} msgs/round, "
          f"cpu {standing['cpu_ms_per_round']:.1f} ms/round", flush=True)
    full = measure_rounds(largest, args.rounds, standing=False)
    print(f"{largest} members, a full round every step (quorum.standing off): "
          f"p50 {full['p50_ms']:.2f} ms, p99 {full['p99_ms']:.2f} ms, "
          f"{full['messages_per_round']:.1f} msgs/round, "
          f"cpu {full['cpu_ms_per_round']:.1f} ms/round", flush=True)
    runs = [measure_failover() for _ in range(args.failover_runs)]
    failover = statistics.median(runs) if runs else float("nan")
    print(f"leader failover (5 members, default timeouts): median {failover:.2f} s, "
          f"runs {[round(r, 2) for r in runs]}")
    stall = measure_survivor_stall()
    print(f"2 replicas + a witness, the leader killed: the survivor's longest gap between "
          f"quorums {stall['stall_s']:.2f} s (bound member_timeout + one step = "
          f"{stall['bound_s']:.2f} s)")
    print(f"targets: 1,000 members p50 <= {TARGETS['p50_ms']:.0f} ms, "
          f"p99 <= {TARGETS['p99_ms']:.0f} ms; failover <= {TARGETS['failover_s']:.0f} s")
    if args.json:
        summary = {"failover_s": round(failover, 3), "failover_runs_s": [round(r, 3) for r in runs],
                   "failover_members": 5,
                   "two_replica_survivor_stall_s": round(stall["stall_s"], 3),
                   "two_replica_survivor_stall_bound_s": round(stall["bound_s"], 3),
                   "standing_round": standing, "full_round": full}
        write_json(args.json, {"cases": cases, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())

