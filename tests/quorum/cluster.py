"""A quorum of real processes on loopback for the multi-process tests.

Each member is a spawned process running one ``QuorumAgent`` with a
``FileDirectory`` in a temporary folder, obeying commands sent over a pipe.
Quorum answers come back asynchronously and are kept per (member, step).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ft_launch.config import QuorumConfig
from ft_launch.ids import new_job_secret
from ft_launch.launcher.quorum import FileDirectory, QuorumAgent
from ft_launch.launcher.quorum.agent import QuorumStatus
from ft_launch.launcher.quorum.model import Quorum
from ft_launch.launcher.quorum.witness_service import MemoryFile
from tests.waiting import patience, wait_until

from .helpers import FAST_CONFIG, round_timeout

#: A spawned member importing zmq and the agent: seconds on a busy machine.
START_TIMEOUT = 60.0
#: A command over the pipe and its reply: milliseconds, but the member may be descheduled.
CALL_TIMEOUT = 10.0

JOB = "quorum-test"


def member_main(conn: Any, replica_id: int, replicas: int, directory: str, secret: str,
                config: dict[str, Any], witnesses: tuple[int, ...] = (),
                memory: str = "") -> None:
    """``memory``: a witness's memory file (``witness_service.MemoryFile``), if any."""
    agent = QuorumAgent(replica_id, range(replicas), FileDirectory(directory, secret, JOB),
                        secret, QuorumConfig(**config), job_id=JOB, witnesses=witnesses,
                        electable=replica_id not in witnesses,
                        memory=MemoryFile(Path(memory), JOB) if memory else None).start()
    lock = threading.Lock()

    def reply(*message: Any) -> None:
        with lock:
            conn.send(message)

    def answered(step: int, future: Any) -> None:
        if future.cancelled():  # superseded by a later step's request
            return
        error = future.exception()
        if error is None:
            reply("quorum", step, future.result())
        else:
            reply("quorum", step, (type(error).__name__, str(error),
                                   getattr(error, "reachable", ())))

    reply("started", agent.address)
    while True:
        command, *args = conn.recv()
        if command == "quorum":
            step = args[0]
            agent.request_quorum(step).add_done_callback(lambda f, s=step: answered(s, f))
        elif command == "status":
            reply("status", agent.status())
        elif command == "stats":
            reply("stats", agent.stats())
        elif command == "drop":
            agent.drop_traffic(args[0])
            reply("ok")
        elif command == "stop":
            agent.stop()
            reply("ok")
            return


class Member:
    def __init__(self, ctx: Any, replica_id: int, cluster: Cluster) -> None:
        self.replica_id = replica_id
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(
            target=member_main, daemon=True,
            args=(theirs, replica_id, cluster.replicas, str(cluster.directory), cluster.secret,
                  asdict(cluster.config), cluster.witnesses, cluster.memory_of(replica_id)))
        self.process.start()
        self.answers: dict[int, Any] = {}
        self.replies: list[Any] = []
        self.address = self._expect("started", START_TIMEOUT)[0]

    def pump(self) -> None:
        while self.process.is_alive() and self.conn.poll():
            kind, *rest = self.conn.recv()
            if kind == "quorum":
                self.answers[rest[0]] = rest[1]
            else:
                self.replies.append((kind, *rest))

    def _expect(self, kind: str, timeout: float) -> list[Any]:
        def got() -> Any:
            self.pump()
            return next((r for r in self.replies if r[0] == kind), None)
        found = wait_until(got, timeout, f"{kind} from replica {self.replica_id}")
        self.replies.remove(found)
        return list(found[1:])

    def call(self, kind: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        self.conn.send((kind, *args))
        reply = self._expect("status" if kind == "status" else
                             "stats" if kind == "stats" else "ok", timeout)
        return reply[0] if reply else None


class Cluster:
    def __init__(self, tmp_path: Path, running: int, replicas: int | None = None,
                 config: QuorumConfig = FAST_CONFIG, witnesses: tuple[int, ...] = (),
                 witness_memory: bool = False) -> None:
        """``witnesses``: voter ids of witness members, started after the replicas;
        ``witness_memory``: each keeps its memory in a file (as in a job), which
        a witness started again reads back."""
        self.ctx = mp.get_context("spawn")
        self.witness_memory = witness_memory
        self.replicas = replicas or running
        self.witnesses = tuple(witnesses)
        self.directory = tmp_path / "peers"
        self.secret = new_job_secret()
        self.config = config
        self.round_timeout = round_timeout(config)
        self.members: dict[int, Member] = {}
        for r in [*range(running), *self.witnesses]:
            self.start(r)

    def memory_of(self, replica_id: int) -> str:
        if not self.witness_memory or replica_id not in self.witnesses:
            return ""
        return str(self.directory.parent / f"witness-{replica_id}.memory.json")

    def start(self, replica_id: int) -> Member:
        member = Member(self.ctx, replica_id, self)
        self.members[replica_id] = member
        return member

    def alive(self) -> list[int]:
        return [r for r, m in self.members.items() if m.process.is_alive()]

    def status(self, replica_id: int) -> QuorumStatus:
        return self.members[replica_id].call("status")  # type: ignore[no-any-return]

    def leader(self, among: list[int] | None = None, timeout: float | None = None) -> int:
        """The leader that every member of ``among`` follows."""
        among = among or self.alive()

        def agreed() -> int | None:
            views = {self.status(r).leader_id for r in among}
            return views.pop() if len(views) == 1 and None not in views else None
        wait_until(lambda: agreed() is not None, timeout or self.round_timeout,
                   f"one leader among {among}")
        found = agreed()
        assert found is not None
        return found

    def ask(self, members: list[int], step: int) -> None:
        for r in members:
            self.members[r].answers.pop(step, None)
            self.members[r].conn.send(("quorum", step))

    def answers(self, members: list[int], step: int,
                timeout: float | None = None) -> dict[int, Any]:
        def complete() -> bool:
            for r in members:
                self.members[r].pump()
            return all(step in self.members[r].answers for r in members)
        wait_until(complete, timeout or self.round_timeout,
                   f"answers for step {step} from {members}")
        return {r: self.members[r].answers[step] for r in members}

    def round(self, members: list[int], step: int, timeout: float | None = None) -> Quorum:
        """One round in which every member of ``members`` must get the same quorum."""
        self.ask(members, step)
        got = self.answers(members, step, timeout)
        quorums = set(got.values())
        assert len(quorums) == 1, f"members disagree: {got}"
        [quorum] = quorums
        assert isinstance(quorum, Quorum), f"not a quorum: {quorum}"
        return quorum

    def first_round(self, members: list[int], step: int = 1) -> Quorum:
        """The first round, with every member of ``members`` in it. Started one
        after another, a member may be unknown to the leader when the others
        have joined: the leader forms without it (everyone it knows of joined)
        and its join waits for the next round. Then everyone asks again for the
        same step, as a replica does after a timeout, until one round has all."""
        return self.settled_round(members, step, expect=members, same_step=True)

    def settled_round(self, members: list[int], step: int, expect: list[int],
                      timeout: float | None = None, *, same_step: bool = False) -> Quorum:
        """Rounds until one has exactly ``expect`` as members. Right after a
        fault a round may still wait out timeouts, fail fast, or leave a late
        member alone in the next window: then everyone asks again, next step
        (or ``same_step``). A member left out will not be answered until the
        others join again, so a round that left one out is retried at once;
        one that is merely slow gets a round's own timeouts, stretched by load."""
        wanted = tuple(expect)
        slow = 2 * (self.config.join_timeout + self.config.member_timeout)
        current, asked_at, wait = step, 0.0, 0.0

        def ask(at_step: int) -> None:
            nonlocal current, asked_at, wait
            self.ask(members, at_step)
            current, asked_at, wait = at_step, time.monotonic(), patience(slow)

        def settled() -> Quorum | None:
            for r in members:
                self.members[r].pump()
            got = [self.members[r].answers.get(current) for r in members]
            first = got[0]
            if isinstance(first, Quorum) and first.replica_ids == wanted and \
                    all(q == first for q in got):
                return first
            left_out = any(isinstance(q, Quorum) and not set(wanted) <= set(q.replica_ids)
                           for q in got)
            if left_out or None not in got or time.monotonic() - asked_at > wait:
                ask(current if same_step else current + 1)
            return None
        ask(step)
        try:
            return wait_until(settled, timeout or 2 * self.round_timeout,
                              f"a round of exactly {expect} among {members}")
        except AssertionError as error:
            last = {r: self.members[r].answers.get(current) for r in members}
            raise AssertionError(f"{error}; step {current} answers: {last}") from None

    def partition(self, side: list[int]) -> None:
        """Drop all traffic between ``side`` and the other running members."""
        others = [r for r in self.alive() if r not in side]
        for r in side:
            self.members[r].call("drop", others)
        for r in others:
            self.members[r].call("drop", side)

    def heal(self) -> None:
        for r in self.alive():
            self.members[r].call("drop", [])

    def kill(self, replica_id: int) -> None:
        process = self.members[replica_id].process
        process.kill()
        process.join(10)

    def close(self) -> None:
        for member in self.members.values():
            if member.process.is_alive():
                try:
                    member.conn.send(("stop",))
                except OSError:
                    pass
        for member in self.members.values():
            member.process.join(5)
            if member.process.is_alive():
                member.process.kill()
                member.process.join(5)


#: ``make_cluster(running, **kwargs)``: the fixture in this folder's conftest
MakeCluster = Callable[..., Cluster]
