"""Running a witness voter: the controller's (witness 0) and ``ft-launch witness``.

A witness needs what a replica's agent needs (the job id, the secret, the number
of replicas, the peer directory) and never trains. The controller writes them to
``<run_dir>/quorum-witness.json`` (mode 0600) with the nodes it probed, so that a
witness on a login or service node sharing the run directory can join at the
source address of its own route towards them (``reach``). Whether witness 0
votes is a fact of the run, not of its config: the controller writes it once it
has started its witness at an address the nodes reach, before any replica starts,
and every voter reads it from there (``run_witnesses``).

Each voter keeps its ``Memory`` in a file of the run directory, written
atomically and durably before it answers anything that depends on it. An
unreadable memory counts as "a round I do not know": the witness endorses nothing
until told of a round whose members alone are a majority (safe; the job may wait).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import zmq

from ft_launch.config import QuorumConfig
from ft_launch.errors import ConfigError, UsageError
from ft_launch.files import atomic_write_text

from .agent import QuorumAgent
from .directory import FileDirectory
from .model import WITNESS_BASE, Memory
from .reach import Reach, probe, spread

log = logging.getLogger(__name__)

WITNESS_FILE = "quorum-witness.json"


def memory_path(run_dir: Path, index: int) -> Path:
    return run_dir / f"quorum-witness-{index}.memory.json"


def replica_memory_path(run_dir: Path, replica_id: int) -> Path:
    """Where replica ``replica_id``'s voter memory is kept: in the run directory, so
    its replacement on another node votes as it did."""
    return run_dir / f"quorum-replica-{replica_id}.memory.json"


class MemoryFile:
    """A voter's ``Memory`` in one JSON file of its job's run directory."""

    def __init__(self, path: Path, job_id: str) -> None:
        self.path = path
        self.job_id = job_id

    def load(self) -> Memory:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return Memory()  # a voter new to this job
        except OSError as exc:
            return self._unknown(f"unreadable: {exc}")
        try:
            body = json.loads(text)
            if body.get("job_id") != self.job_id:
                return self._unknown(f"written for job {body.get('job_id')!r}, "
                                     f"not {self.job_id!r}")
            voted = body["voted_for"]
            endorsed = body["endorsed"]
            return Memory(int(body["term"]), None if voted is None else int(voted),
                          None if endorsed is None else frozenset(int(m) for m in endorsed))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            return self._unknown(f"expected JSON with job_id, term, voted_for and "
                                 f"endorsed ({type(exc).__name__}: {str(exc)[:200]})")

    def save(self, memory: Memory) -> None:
        body = {"job_id": self.job_id, "term": memory.term, "voted_for": memory.voted_for,
                "endorsed": None if memory.endorsed is None else sorted(memory.endorsed)}
        atomic_write_text(self.path, json.dumps(body) + "\n")

    def _unknown(self, problem: str) -> Memory:
        log.error("quorum memory %s is %s; a witness endorses nothing until it sees "
                  "a round that a majority of replicas forms", self.path, problem)
        return Memory(endorsed=frozenset())


def job_witnesses(config: QuorumConfig, *, controller: bool) -> tuple[int, ...]:
    """The witnesses' voter ids, the same on every voter of the job: the
    controller's (index 0) when it votes (``WitnessJob.controller``, never the
    config alone), then ``quorum.witnesses`` more."""
    first = [WITNESS_BASE] if controller else []
    return tuple(first + [WITNESS_BASE + k for k in range(1, config.witnesses + 1)])


def run_witnesses(run_dir: Path, config: QuorumConfig, *, controlled: bool) -> tuple[int, ...]:
    """The witnesses a replica of the run in ``run_dir`` counts. ``controlled``: an
    ``ft-launch run`` started it; then the controller's witness file says whether
    witness 0 votes (it was written before any replica started)."""
    votes = controlled and WitnessJob.read(run_dir).controller
    return job_witnesses(config, controller=votes)


@dataclass(frozen=True)
class WitnessJob:
    """What a witness must know of its job. ``controller``: the controller votes
    as witness 0 (it started its witness at an address the nodes reach).
    ``nodes``: ``(name, address)`` of the job's nodes that a witness probes for
    the address it advertises (at most ``reach.PROBED_NODES``)."""

    job_id: str
    secret: str
    replicas: int
    controller: bool = False
    nodes: tuple[tuple[str, str], ...] = ()

    def write(self, run_dir: Path) -> Path:
        path = run_dir / WITNESS_FILE
        body = {"job_id": self.job_id, "secret": self.secret, "replicas": self.replicas,
                "controller": self.controller,
                "nodes": [list(pair) for pair in spread(self.nodes)]}
        atomic_write_text(path, json.dumps(body) + "\n")
        os.chmod(path, 0o600)
        return path

    @staticmethod
    def read(run_dir: Path) -> WitnessJob:
        path = run_dir / WITNESS_FILE
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
            nodes = tuple((str(name), str(address))
                          for name, address in body.get("nodes", []))
            return WitnessJob(str(body["job_id"]), str(body["secret"]), int(body["replicas"]),
                              body.get("controller") is True, nodes)
        except FileNotFoundError:
            raise UsageError(f"{path} does not exist",
                             hint="give the run directory of a running 'ft-launch run' "
                                  "(it writes this file when it starts)") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"{path} is unreadable: {exc}",
                             hint="expected job_id, secret, replicas and nodes "
                                  "(JSON)") from None


def witness_agent(run_dir: Path, job: WitnessJob, index: int, config: QuorumConfig,
                  host: str) -> QuorumAgent:
    """A started witness agent for witness ``index`` of ``job``."""
    witnesses = job_witnesses(config, controller=job.controller)
    me = WITNESS_BASE + index
    if me not in witnesses:
        raise ConfigError(f"witness index {index} is not configured: the job's witnesses are "
                          f"{[w - WITNESS_BASE for w in witnesses]}",
                          key="quorum.witnesses",
                          hint="index 0 is the controller; 1..quorum.witnesses run as "
                               "'ft-launch witness'")
    directory = FileDirectory(run_dir / "peers", job.secret, job.job_id)
    memory = MemoryFile(memory_path(run_dir, index), job.job_id)
    return QuorumAgent(me, range(job.replicas), directory, job.secret, config,
                       job_id=job.job_id, host=host, electable=False,
                       witnesses=witnesses, memory=memory).start()


def controller_witness(run_dir: Path, job: WitnessJob, config: QuorumConfig,
                       reach: Reach) -> tuple[QuorumAgent | None, Reach]:
    """Witness 0, started when ``quorum.controller_witness`` is on and ``reach``
    (``probe`` of ``job.nodes``) found an address the nodes reach, else None; and
    why. The witness file says which, for every voter of the job."""
    if not config.controller_witness:
        reach = Reach(None, "quorum.controller_witness = false")
    agent = None
    if reach.address is not None:
        try:
            agent = witness_agent(run_dir, replace(job, controller=True), 0, config,
                                  reach.address)
        except zmq.ZMQError as error:
            reach = Reach(None, f"cannot listen at {reach.address} (quorum.port = "
                                f"{config.port}): {error}")
    # Written once the witness listens, or is known not to: a replica counts it only then.
    replace(job, controller=agent is not None).write(run_dir)
    return agent, reach


def serve(run_dir: Path, index: int, config: QuorumConfig, stop: threading.Event) -> None:
    """Vote as witness ``index`` until ``stop`` is set, at the source address of
    this host's route to the job's nodes. Refused (never
    advertised where no replica can reach it) when there is none."""
    job = WitnessJob.read(run_dir)
    reach = probe(job.nodes) if job.nodes else \
        Reach(None, f"{run_dir / WITNESS_FILE} names no nodes to reach")
    if reach.address is None:
        raise UsageError(f"witness {index} cannot vote from this host: {reach.reason}",
                         hint="run 'ft-launch witness' on a host that reaches the job's "
                              "nodes (a login or service node on their network)")
    agent = witness_agent(run_dir, job, index, config, reach.address)
    log.info("witness %d votes at %s: %s", index, agent.address, reach.reason)
    try:
        stop.wait()
    finally:
        agent.stop()
