"""Test plumbing: FTAR members as real processes ("spawn"), driven over pipes.

Each member process owns one ``FtarGroup`` and obeys commands from the test
(reconfigure, all-reduce deterministic data, report stats). Data are generated
from ``(seed, data_index)`` on both sides, so the test computes the float64
reference without shipping inputs. Fault injection is explicit: a member can be
told to SIGKILL or SIGSTOP itself, or to stall, when its ring reaches a given
ring step (through ``FtarGroup``'s progress hook).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ft_launch.ftar.dtypes import f32_to_bf16
from tests.waiting import patience

DTYPES = ("float32", "float64", "float16", "bfloat16")


def make_data(seed: int, data_index: int, size: int, dtype: str) -> np.ndarray:
    """Member ``data_index``'s input: normal values, stored as ``dtype``."""
    values = np.random.default_rng([seed, data_index]).standard_normal(size).astype(np.float32)
    if dtype == "bfloat16":
        bits = np.empty(size, np.uint16)
        f32_to_bf16(values, bits, np.empty(size, np.uint32))
        return bits
    return values.astype(dtype)


def as_float64(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return array.astype(np.float64)


@dataclass(frozen=True)
class Fault:
    """Injected at the end of ``ring_step`` of the first partition of the next op."""

    action: str            # "kill" | "stop" | "stall"
    ring_step: int
    stall_seconds: float = 0.0


@dataclass(frozen=True)
class Reduce:
    seed: int
    size: int
    dtype: str = "float32"
    op: str = "AVG"
    contributes: bool = True
    step: int = 0
    data_index: int = 0
    then_close: bool = False     # close the group right after the operation


def _member_main(conn: Connection, config_kwargs: dict[str, Any], secret: str,
                 group_kwargs: dict[str, Any]) -> None:
    from ft_launch.config import FtarConfig
    from ft_launch.errors import FtError
    from ft_launch.ftar import FtarGroup, ReduceOp

    armed: list[Fault] = []

    def hook(transfer: Any) -> None:
        if armed and transfer.partition == 0 and transfer.ring_step == armed[0].ring_step:
            fault = armed.pop()
            if fault.action == "stall":
                time.sleep(fault.stall_seconds)  # a slow member (fault), not synchronisation
            else:
                os.kill(os.getpid(), signal.SIGKILL if fault.action == "kill"
                        else signal.SIGSTOP)

    group = FtarGroup(FtarConfig(**config_kwargs), secret, progress_hook=hook, **group_kwargs)
    conn.send(group.address)
    while True:
        command, argument = conn.recv()
        started = time.monotonic()
        try:
            if command == "exit":
                break
            if command == "reconfigure":
                group.reconfigure(*argument)
                reply: Any = None
            elif command == "arm":
                armed[:] = [argument]
                reply = None
            elif command == "stats":
                reply = group.stats()
            elif command == "reduce":
                spec: Reduce = argument
                data = make_data(spec.seed, spec.data_index, spec.size, spec.dtype)
                group.allreduce(data, ReduceOp[spec.op], spec.contributes, spec.step,
                                dtype="bfloat16" if spec.dtype == "bfloat16" else None)
                reply = (data, group.stats().last_contributors)
                if spec.then_close:
                    group.close()
            else:
                raise ValueError(f"unknown command {command}")
            conn.send(("ok", reply, time.monotonic() - started))
        except FtError as exc:
            conn.send(("error", (type(exc).__name__, str(exc), exc.context.step,
                                 exc.context.quorum_id, getattr(exc, "peer_index", None)),
                       time.monotonic() - started))
    group.close()


@dataclass
class Member:
    process: Any
    conn: Connection
    address: tuple[str, int]


@dataclass
class Ring:
    """A set of member processes and the quorum counter the test uses."""

    config: dict[str, Any]
    secret: str
    members: list[Member] = field(default_factory=list)
    quorum_id: int = 0

    def spawn(self, count: int = 1, secret: str | None = None,
              **group_kwargs: Any) -> list[Member]:
        ctx = multiprocessing.get_context("spawn")
        new = []
        for _ in range(count):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_member_main, daemon=True,
                                  args=(child, self.config, secret or self.secret,
                                        group_kwargs))
            process.start()
            new.append(Member(process, parent, tuple(parent.recv())))  # type: ignore[arg-type]
        self.members.extend(new)
        return new

    def call(self, members: list[Member], command: str, arguments: list[Any],
             timeout: float = 30.0) -> list[tuple[str, Any, float]]:
        for member, argument in zip(members, arguments):
            member.conn.send((command, argument))
        replies = []
        wait = patience(timeout)
        for member in members:
            if not member.conn.poll(wait):
                raise AssertionError(f"member {member.address} did not answer {command} "
                                     f"within {wait:.1f} s")
            replies.append(member.conn.recv())
        return replies

    def form(self, members: list[Member]) -> None:
        """Put ``members`` (in this order) into a new quorum; every reconfigure must pass."""
        self.quorum_id += 1
        addresses = [m.address for m in members]
        replies = self.call(members, "reconfigure",
                            [(self.quorum_id, addresses, i) for i in range(len(members))])
        assert all(r[0] == "ok" for r in replies), replies

    def close(self) -> None:
        for member in self.members:
            if member.process.is_alive():
                try:
                    member.conn.send(("exit", None))
                except OSError:
                    pass
        for member in self.members:
            member.process.join(timeout=5)
            if member.process.is_alive():
                member.process.kill()
                member.process.join(timeout=5)


def reference(specs: list[Reduce]) -> tuple[np.ndarray, int]:
    """The float64 result every member should get, and the contributor count."""
    total = np.zeros(specs[0].size, np.float64)
    count = 0
    for spec in specs:
        if spec.contributes:
            total += as_float64(make_data(spec.seed, spec.data_index, spec.size, spec.dtype),
                                spec.dtype)
            count += 1
    if specs[0].op == "AVG" and count:
        total /= count
    return total, count


def tolerance(specs: list[Reduce]) -> np.ndarray:
    """Per-element bound: one rounding of the element type per ring step and at the end,
    relative to the sum of magnitudes."""
    spec = specs[0]
    eps = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10,
           "bfloat16": 2.0 ** -7}[spec.dtype]
    magnitude = sum(np.abs(as_float64(make_data(s.seed, s.data_index, s.size, s.dtype),
                                      s.dtype)) for s in specs)
    divisor = max(1, sum(s.contributes for s in specs)) if spec.op == "AVG" else 1
    return (len(specs) + 1) * eps * magnitude / divisor + 1e-300
