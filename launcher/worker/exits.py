"""How a worker process ends, whichever way its script ends (torch-free).

* **Closing.** ``Manager`` is a context manager (``with ft_manager(...) as manager:``);
  ``close()`` in a ``finally`` does the same. A manager the script left open is closed
  before the interpreter shuts down (``track``): left running, its snapshot thread
  would still copy tensors while the interpreter finalizes, and a daemon thread stopped
  inside torch's C++ code ends the process with SIGABRT ("terminate called without an
  active exception"), the backups held in ``/dev/shm`` left behind.
* **SIGTERM**, Slurm's and ``ft-launch local``'s way to stop a replica, raises
  ``Terminated`` in the main thread unless the script handles SIGTERM itself: the
  script's ``with`` / ``finally`` close the manager, and the process exits 143 (128 +
  SIGTERM, as a shell reports it). A second SIGTERM while closing is ignored.
* **The run's end.** When a replica's script ends normally its rank 0 marks the run
  finished (``<run_dir>/run-finished.json``, signed with the job secret, so a new job
  in the same run directory does not take it for its own). A replica that starts, or
  waits for a quorum, after that has nothing to join: it exits ``ExitCode.RUN_FINISHED``
  (77) at once (``NothingToJoin``), and the controller counts it finished.
* **Different starts.** Replicas whose models differ at the first step, under
  ``runtime.identical_start = refuse``, exit ``ExitCode.FATAL_NO_REQUEUE`` (78)
  naming them (``DifferentStart``).
* **No quorum.** A replica that cannot reach a quorum for
  ``runtime.max_consecutive_failures`` attempts in a row (the others are gone) exits
  ``ExitCode.RECOVERABLE`` (75) with what it waited for (``NoQuorum``).

These exits are ``SystemExit``: training code's ``except Exception`` cannot swallow
them, and the interpreter exits with their code without a traceback (the message is
logged where they are raised).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import threading
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Protocol, TypeVar

from ft_launch.errors import ExitCode
from ft_launch.files import atomic_write_text
from ft_launch.ids import sign, verify

from .identity import WorkerIdentity

log = logging.getLogger(__name__)

#: In the run directory: written by the first replica whose script ended normally.
FINISHED_FILE = "run-finished.json"
_DOMAIN = b"ftl-run-finished/1"
#: The exit status of a replica stopped by SIGTERM: 128 + the signal, as a shell says.
TERMINATED_CODE = 128 + signal.SIGTERM


class WorkerExit(SystemExit):
    """Ends the worker process with ``code``, through the script's ``with`` / ``finally``
    (the manager closes); ``str()`` is the reason."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(int(code))
        self.message = message

    def __str__(self) -> str:
        return self.message


class NothingToJoin(WorkerExit):
    """The run finished before this replica could join it."""

    def __init__(self, message: str) -> None:
        super().__init__(ExitCode.RUN_FINISHED, message)


class NoQuorum(WorkerExit):
    """No quorum within the failure budget: the others are gone or unreachable."""

    def __init__(self, message: str) -> None:
        super().__init__(ExitCode.RECOVERABLE, message)


class DifferentStart(WorkerExit):
    """The replicas' models differ at the run's first step and the run refuses to go
    on (``runtime.identical_start = refuse``): retrying cannot help."""

    def __init__(self, message: str) -> None:
        super().__init__(ExitCode.FATAL_NO_REQUEUE, message)


class Terminated(WorkerExit):
    """SIGTERM: the replica was asked to stop."""

    def __init__(self) -> None:
        super().__init__(TERMINATED_CODE, "stopped by SIGTERM")


# --------------------------------------------------------------------- the run's end


@dataclass(frozen=True)
class FinishedRun:
    """What the replica that finished the run left: its last committed step."""

    step: int
    replica_id: int


def _parts(job_id: str, step: int, replica_id: int) -> tuple[bytes, ...]:
    return _DOMAIN, job_id.encode(), str(step).encode(), str(replica_id).encode()


def mark_finished(identity: WorkerIdentity, step: int) -> None:
    """This replica's script ended normally after committing ``step``: the run is over."""
    body = {"job_id": identity.job_id, "step": step, "replica_id": identity.replica_id,
            "mac": sign(identity.secret, *_parts(identity.job_id, step,
                                                 identity.replica_id)).hex()}
    try:
        atomic_write_text(identity.run_dir / FINISHED_FILE, json.dumps(body) + "\n")
    except OSError as error:     # a late replica then waits for the quorum bound instead
        log.warning("the run's end not marked in %s: %s", identity.run_dir, error)


def run_finished(identity: WorkerIdentity) -> FinishedRun | None:
    """The run's end, if a replica of this job (this secret) marked it."""
    path = identity.run_dir / FINISHED_FILE
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        step, replica_id = int(body["step"]), int(body["replica_id"])
        mac = bytes.fromhex(body["mac"])
        job_id = str(body["job_id"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
        log.warning("ignoring unreadable %s: %s", path, str(error)[:200])
        return None
    if job_id != identity.job_id or not verify(identity.secret, mac,
                                               *_parts(job_id, step, replica_id)):
        return None     # an earlier job's, in the same run directory
    return FinishedRun(step, replica_id)


def nothing_to_join(finished: FinishedRun, identity: WorkerIdentity) -> NothingToJoin:
    """The exit of a replica that found the run finished (logged here)."""
    message = (f"the run finished at step {finished.step} (replica {finished.replica_id} "
               f"ended it): nothing to join; replica {identity.replica_id} rank "
               f"{identity.rank} exits {int(ExitCode.RUN_FINISHED)}")
    log.error("%s", message)
    return ending(NothingToJoin(message))


# --------------------------------------------------------------------- closing


class Closable(Protocol):
    @property
    def closing(self) -> bool: ...
    def close(self) -> None: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()
_Exit = TypeVar("_Exit", bound=WorkerExit)
_hooked = False
#: An exit of ours on its way (SIGTERM, nothing to join, no quorum).
_ending: WorkerExit | None = None


def ending(exit_: _Exit) -> _Exit:
    """Record ``exit_`` as how this process ends (``ended_by_error``); returns it."""
    global _ending
    _ending = exit_
    return exit_


def ended_by_error() -> bool:
    """Whether the process ends by an error though no exception is being handled here:
    an exit of ours on its way, or one the interpreter reported (uncaught: at exit)."""
    return _ending is not None or getattr(sys, "last_value", None) is not None


def track(manager: Closable) -> None:
    """Close ``manager`` before the interpreter shuts down if the script does not, and
    stop it on SIGTERM (see the module doc). Held weakly; ``untrack`` after closing."""
    global _hooked
    if not _hooked:
        # threading's exit hook (concurrent.futures' too) runs before the interpreter
        # joins threads and shuts concurrent.futures down, after which a persist could
        # not be scheduled; atexit runs only after that.
        getattr(threading, "_register_atexit", atexit.register)(_close_open)
        _hooked = True
    _open.add(manager)
    if _in_main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def untrack(manager: Closable) -> None:
    _open.discard(manager)
    if not _open and _in_main_thread() and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _close_open() -> None:
    for manager in list(_open):
        try:
            manager.close()
        except Exception:     # the others are closed all the same
            log.exception("closing the ft-launch manager at exit failed")


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _ending is not None or any(manager.closing for manager in list(_open)):
        log.warning("SIGTERM ignored: the manager is closing already")
        return
    log.warning("SIGTERM: stopping; the manager closes and the process exits %d",
                TERMINATED_CODE)
    raise ending(Terminated())


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) holds copies of its parent's managers: it
    must never close them (threading's exit hook runs as a multiprocessing child ends:
    it would mark the run finished at a stale step), nor take the parent's SIGTERM."""
    _open.clear()
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_forget_in_child)
