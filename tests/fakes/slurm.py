"""A fake ``SlurmBackend`` for unit tests of the controller loop (no Slurm, no processes).

Modelled on submitit's ``MockedSubprocess``: the test owns the cluster. Nodes are
records the test flips (``fail_node``); every launched step is a ``FakeStep`` (the
stand-in for its local ``srun``) that runs until the test ends it (``exit``) or the
controller cancels it; every call is recorded in ``calls`` in order. Allocations
(a reservation's standby jobs) are granted or refused as the test scripts them
(``script_allocations``); unscripted, they raise ``SlurmCommandError`` saying so, the
way a site without them would answer.

The real-cluster tests stay the authority on what Slurm does; this fake only lets
the whole loop run in milliseconds on scripted event sequences.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Mapping
from typing import cast

from ft_launch.errors import SlurmCommandError
from ft_launch.ids import StepRef
from ft_launch.slurm.commands import StepSpec
from ft_launch.slurm.parse import JobInfo, NodeInfo, ReservationInfo, StepInfo
from ft_launch.slurm.states import JobState, NodeState


class FakeStep:
    """What ``launch_step`` returns: polls as running until ``exit`` or a cancel."""

    def __init__(self, spec: StepSpec, env: Mapping[str, str], step_id: str) -> None:
        self.spec = spec
        self.env = dict(env)
        self.step = StepRef(spec.job_id or "", step_id)
        self.returncode: int | None = None
        self.cancelled = False

    @property
    def running(self) -> bool:
        return self.returncode is None

    def exit(self, code: int) -> None:
        """The step ended by itself (the training command's exit, a crash, the gate)."""
        if self.returncode is None:
            self.returncode = code

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.exit(-9)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            # Nothing else would ever end it: waiting would hang the test.
            raise subprocess.TimeoutExpired(self.spec.name, timeout or 0.0)
        return self.returncode


class FakeSlurm:
    """An in-memory ``SlurmBackend``; ``can_drain=False`` answers drains as a user
    without operator rights gets answered."""

    def __init__(self, job_id: str, nodes: Iterable[str], *, can_drain: bool = True) -> None:
        self.job_id = job_id
        self.node_info = {n: NodeInfo(n, NodeState.ALLOCATED, frozenset(), "", n)
                          for n in nodes}
        self.can_drain = can_drain
        self.launched: list[FakeStep] = []
        self.calls: list[tuple[str, ...]] = []
        self.comments: dict[str, str] = {}
        self.allocations: dict[str, tuple[str, ...]] = {}   # job id -> nodes granted
        self._answers: list[tuple[str, ...] | str] = []

    # ------------------------------------------------------------------ the test's side

    def script_allocations(self, *answers: tuple[str, ...] | str) -> None:
        """The next ``allocate`` calls' answers, in order: the nodes granted (each
        becomes a job of its own), or why Slurm refused."""
        self._answers.extend(answers)

    def fail_node(self, node: str) -> None:
        """The node stops answering (as a crashed host does)."""
        self._set(node, NodeState.DOWN, frozenset({"NOT_RESPONDING"}), "Not responding")

    def live_steps(self, name: str | None = None) -> list[FakeStep]:
        return [s for s in self.launched if s.running and name in (None, s.spec.name)]

    def step_named(self, name: str) -> FakeStep:
        """The newest launched step called ``name`` (``replica-0``, ``standby-s1``)."""
        found = [s for s in self.launched if s.spec.name == name]
        if not found:
            raise LookupError(f"no step {name!r} launched; launched: "
                              f"{[s.spec.name for s in self.launched]}")
        return found[-1]

    def _set(self, node: str, state: NodeState, flags: frozenset[str], reason: str) -> None:
        info = self.node_info[node]
        self.node_info[node] = NodeInfo(node, state, flags, reason, info.address)

    # ------------------------------------------------------------------ SlurmBackend

    def job(self, job_id: str) -> JobInfo | None:
        self.calls.append(("job", job_id))
        if job_id in self.allocations:
            return JobInfo(job_id, "allocation", JobState.RUNNING, self.allocations[job_id],
                           None, "", 0, 0)
        if job_id != self.job_id:
            return None
        return JobInfo(job_id, "ft-launch", JobState.RUNNING, tuple(self.node_info), None,
                       "", 0, 0)

    def nodes(self, names: tuple[str, ...] = ()) -> list[NodeInfo]:
        self.calls.append(("nodes", *names))
        return [info for name, info in self.node_info.items() if not names or name in names]

    def steps(self, job_id: str) -> list[StepInfo]:
        self.calls.append(("steps", job_id))
        return [StepInfo(s.step, s.spec.name, s.spec.nodes, "0:01") for s in self.launched
                if s.running and s.step.job_id == job_id]

    def reservation(self, name: str) -> ReservationInfo | None:
        self.calls.append(("reservation", name))
        return None

    def cancel_step(self, step: StepRef, signal: str | None = None) -> None:
        self.calls.append(("cancel_step", str(step)))
        for launched in self.launched:
            if launched.step == step and launched.running:
                launched.cancelled = True
                launched.exit(-15)

    def set_node_state(self, node: str, state: str, reason: str | None = None) -> None:
        self.calls.append(("set_node_state", node, state, reason or ""))
        if not self.can_drain:
            raise SlurmCommandError(f"scontrol update nodename={node} failed: Access/"
                                    "permission denied")
        info = self.node_info[node]
        if state.lower() == "drain":
            self._set(node, info.state, info.flags | {"DRAIN"}, reason or "")
        elif state.lower() == "resume":
            self._set(node, NodeState.IDLE, frozenset(), "")

    def launch_step(self, spec: StepSpec, env: Mapping[str, str] | None = None,
                    stdout: int | None = None) -> subprocess.Popen[bytes]:
        self.calls.append(("launch_step", spec.name, *spec.nodes))
        step = FakeStep(spec, env or {}, str(len(self.launched)))
        self.launched.append(step)
        # Duck-typed: the controller only polls, kills and waits on what srun returns.
        return cast("subprocess.Popen[bytes]", step)

    def create_reservation(self, name: str, nodes: tuple[str, ...], duration_minutes: int,
                           users: tuple[str, ...], flags: tuple[str, ...] = ()) -> None:
        self.calls.append(("create_reservation", name, *nodes))

    def update_reservation(self, name: str, nodes: tuple[str, ...]) -> None:
        self.calls.append(("update_reservation", name, *nodes))

    def delete_reservation(self, name: str) -> None:
        self.calls.append(("delete_reservation", name))

    def resize_job(self, job_id: str, num_nodes: int) -> None:
        self.calls.append(("resize_job", job_id, str(num_nodes)))

    def allocate(self, nodes: int, *, name: str, reservation: str | None = None,
                 nodelist: tuple[str, ...] = (), expand: str | None = None,
                 immediate_s: int | None = None, extra: tuple[str, ...] = (),
                 wait_forever: bool = False) -> str:
        self.calls.append(("allocate", name, str(nodes)))
        if not self._answers:
            raise SlurmCommandError("FakeSlurm grants no allocation: script the reservation "
                                    "pool's answers in the test that needs them")
        answer = self._answers.pop(0)
        if isinstance(answer, str):
            raise SlurmCommandError(answer)
        job_id = str(int(self.job_id) + 1 + len(self.allocations))
        self.allocations[job_id] = answer
        for node in answer:
            self.node_info.setdefault(node, NodeInfo(node, NodeState.ALLOCATED, frozenset(),
                                                     "", node))
        return job_id

    def shrink_job(self, job_id: str, keep: tuple[str, ...]) -> None:
        self.calls.append(("shrink_job", job_id, *keep))

    def cancel_job(self, job_id: str) -> None:
        self.calls.append(("cancel_job", job_id))

    def requeue_job(self, job_id: str) -> None:
        self.calls.append(("requeue_job", job_id))

    def set_comment(self, job_id: str, comment: str) -> None:
        self.calls.append(("set_comment", job_id, comment))
        self.comments[job_id] = comment

    def config(self) -> dict[str, str]:
        self.calls.append(("config",))
        return {}
