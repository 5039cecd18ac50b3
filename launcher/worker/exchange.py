"""The exchange thread: one step's cross-replica work, in order, beside backward.

Each step's quorum and every reduction of its gradients run on this one thread,
in the order the training thread queued them: the quorum first (its answer
configures the ring), then each reduction as training hands it over (FSDP2's
all-reduce hook per unit, DDP's comm hook per bucket, or all the gradients after
backward). The training thread waits only where it needs the result: at the
commit, or where a hook must see its reduction done.

A recoverable failure (a broken ring, a member lost) is recorded and the step's
remaining work skipped; the commit then votes the step down on every rank. Any
other exception is raised again in the training thread when it waits.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ft_launch.errors import RecoverableError


@dataclass(eq=False)
class Job:
    """One piece of a step's work; ``done`` is set once it ran or was skipped."""

    run: Callable[[], None]
    generation: int
    #: called once the job ran or was skipped (a DDP bucket's future must complete)
    after: Callable[[], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self) -> None:
        self.done.wait()


class StepWork:
    """A single worker thread that runs a step's jobs in order (see the module doc)."""

    def __init__(self, name: str = "ftl-exchange") -> None:
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._generation = 0
        self._error: RecoverableError | None = None
        self._fatal: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def begin(self, first: Callable[[], None]) -> Job:
        """Start a step: forget the last step's outcome and queue its first job."""
        self._generation += 1
        self._error, self._fatal = None, None
        return self.submit(first)

    def submit(self, run: Callable[[], None], after: Callable[[], None] | None = None) -> Job:
        job = Job(run, self._generation, after)
        self._queue.put(job)
        return job

    def wait(self) -> RecoverableError | None:
        """Wait for everything queued so far; the step's recoverable error, if any.
        Anything else that failed a job is raised here, in the caller's thread."""
        self.submit(lambda: None).wait()
        if self._fatal is not None:
            raise self._fatal
        return self._error

    @property
    def failed(self) -> bool:
        """True once a job of this step failed (later jobs are skipped)."""
        return self._error is not None or self._fatal is not None

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if job.generation == self._generation and not self.failed:
                    job.run()
            except RecoverableError as error:
                self._error = error
            except BaseException as error:  # noqa: BLE001 - handed to the training thread
                self._fatal = error
            finally:
                if job.after is not None:
                    job.after()
                job.done.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5.0)
