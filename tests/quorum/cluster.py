"""A quorum of real processes on loopback for the multi-process tests.

Each member is a spawned process running one ``QuorumAgent`` with a
``FileDirectory`` in a temporary folder, obeying commands sent over a pipe.
Quorum answers come back asynchronously and are kept per (member, step).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ftcore.config import QuorumConfig
from ftcore.ids import new_job_secret
from launcher.quorum import FileDirectory, Quorum, QuorumAgent, QuorumStatus
from tests.waiting import wait_until

from .helpers import FAST_CONFIG

JOB = "quorum-test"


def member_main(conn: Any, replica_id: int, replicas: int, directory: str, secret: str,
                config: dict[str, Any]) -> None:
    agent = QuorumAgent(replica_id, range(replicas), FileDirectory(directory, secret, JOB),
                        secret, QuorumConfig(**config), job_id=JOB).start()
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
            reply("stats", agent.stats().counts)
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
                  asdict(cluster.config)))
        self.process.start()
        self.answers: dict[int, Any] = {}
        self.replies: list[Any] = []
        self.address = self._expect("started", 60)[0]

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

    def call(self, kind: str, *args: Any, timeout: float = 10.0) -> Any:
        self.conn.send((kind, *args))
        reply = self._expect("status" if kind == "status" else
                             "stats" if kind == "stats" else "ok", timeout)
        return reply[0] if reply else None


class Cluster:
    def __init__(self, tmp_path: Path, running: int, replicas: int | None = None,
                 config: QuorumConfig = FAST_CONFIG) -> None:
        self.ctx = mp.get_context("spawn")
        self.replicas = replicas or running
        self.directory = tmp_path / "peers"
        self.secret = new_job_secret()
        self.config = config
        self.members: dict[int, Member] = {}
        for r in range(running):
            self.start(r)

    def start(self, replica_id: int) -> Member:
        member = Member(self.ctx, replica_id, self)
        self.members[replica_id] = member
        return member

    def alive(self) -> list[int]:
        return [r for r, m in self.members.items() if m.process.is_alive()]

    def status(self, replica_id: int) -> QuorumStatus:
        return self.members[replica_id].call("status")  # type: ignore[no-any-return]

    def leader(self, among: list[int] | None = None, timeout: float = 15.0) -> int:
        """The leader that every member of ``among`` follows."""
        among = among or self.alive()

        def agreed() -> int | None:
            views = {self.status(r).leader_id for r in among}
            return views.pop() if len(views) == 1 and None not in views else None
        wait_until(lambda: agreed() is not None, timeout, f"one leader among {among}")
        found = agreed()
        assert found is not None
        return found

    def ask(self, members: list[int], step: int) -> None:
        for r in members:
            self.members[r].answers.pop(step, None)
            self.members[r].conn.send(("quorum", step))

    def answers(self, members: list[int], step: int, timeout: float = 15.0) -> dict[int, Any]:
        def complete() -> bool:
            for r in members:
                self.members[r].pump()
            return all(step in self.members[r].answers for r in members)
        wait_until(complete, timeout, f"answers for step {step} from {members}")
        return {r: self.members[r].answers[step] for r in members}

    def round(self, members: list[int], step: int, timeout: float = 15.0) -> Quorum:
        """One round in which every member of ``members`` must get the same quorum."""
        self.ask(members, step)
        got = self.answers(members, step, timeout)
        quorums = set(got.values())
        assert len(quorums) == 1, f"members disagree: {got}"
        [quorum] = quorums
        assert isinstance(quorum, Quorum), f"not a quorum: {quorum}"
        return quorum

    def settled_round(self, members: list[int], step: int, expect: list[int],
                      timeout: float = 30.0) -> Quorum:
        """Rounds until one has exactly ``expect`` as members. Right after a
        fault a round may still wait out timeouts, fail fast, or leave a late
        member alone in the next window: then everyone asks again, next step."""
        deadline = time.monotonic() + timeout
        attempt = 2 * (self.config.join_timeout + self.config.member_timeout)
        while True:
            self.ask(members, step)
            try:
                got = self.answers(members, step, attempt)
            except AssertionError:
                got = {r: self.members[r].answers.get(step) for r in members}
            quorums = set(got.values())
            if len(quorums) == 1:
                [quorum] = quorums
                if isinstance(quorum, Quorum) and list(quorum.replica_ids) == expect:
                    return quorum
            assert time.monotonic() < deadline, f"no quorum of {expect}: {got}"
            step += 1

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
