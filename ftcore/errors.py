"""One error hierarchy for the whole product, and the exit-code contract.

Every failure falls into one of three classes, chosen by what the caller should
do next, not by where it happened:

* ``RecoverableError``: skip the step, re-form the quorum, retry.
* ``NodeUnhealthyError``: evict the node (drain it) and go on without it.
* ``FatalError``: stop; retrying or requeueing cannot help.

``TerminalAbort`` derives from ``BaseException`` so that training code's
``except Exception`` cannot swallow an order to stop.

Each error carries the ids it knows (job, replica, rank, step, quorum, node) and
renders them into its message, so a log line alone says where it happened.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any


class ExitCode(enum.IntEnum):
    """Process exit codes of every ft-launch executable (documented in README)."""

    OK = 0
    #: Bad command line or input file: fix the invocation; do not requeue.
    USAGE = 2
    #: A transient failure: requeueing (or relaunching) may succeed.
    RECOVERABLE = 75  # EX_TEMPFAIL
    #: This node is unhealthy: drain it; the job may run elsewhere.
    NODE_UNHEALTHY = 76
    #: A replica started after the run had finished: nothing to join (the controller
    #: counts it finished, not failed).
    RUN_FINISHED = 77
    #: Retrying cannot help (bad config, bug, data error): do not requeue.
    FATAL_NO_REQUEUE = 78  # EX_CONFIG
    #: Stopped by a terminal abort (operator or controller order).
    ABORTED = 79


@dataclass(frozen=True)
class ErrorContext:
    """The ids an error knows; unknown ones stay ``None`` and are not printed."""

    job_id: str | None = None
    replica_id: int | None = None
    rank: int | None = None
    step: int | None = None
    quorum_id: int | None = None
    node: str | None = None

    def describe(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                 if getattr(self, f.name) is not None]
        return " ".join(parts)

    def merged(self, **ids: Any) -> ErrorContext:
        known = {f.name: getattr(self, f.name) for f in fields(self)}
        known.update({k: v for k, v in ids.items() if v is not None})
        return ErrorContext(**known)


class FtError(Exception):
    """Base of every error ft-launch raises on purpose.

    ``hint`` says what the reader should do about it.
    """

    exit_code: ExitCode = ExitCode.FATAL_NO_REQUEUE

    def __init__(self, message: str, *, hint: str | None = None,
                 context: ErrorContext | None = None, **ids: Any) -> None:
        self.message = message
        self.hint = hint
        self.context = (context or ErrorContext()).merged(**ids)
        super().__init__(self._render())

    def _render(self) -> str:
        text = self.message
        where = self.context.describe()
        if where:
            text = f"{text} [{where}]"
        if self.hint:
            text = f"{text}; {self.hint}"
        return text

    def with_ids(self, **ids: Any) -> FtError:
        """Add ids learnt higher up the stack, keeping the original class."""
        self.context = self.context.merged(**ids)
        self.args = (self._render(),)
        return self


class RecoverableError(FtError):
    """Transient: skip the step / re-quorum / retry."""

    exit_code = ExitCode.RECOVERABLE


class NodeUnhealthyError(FtError):
    """A node failed a health check or lost hardware: evict it."""

    exit_code = ExitCode.NODE_UNHEALTHY


class FatalError(FtError):
    """Retrying cannot help: stop and do not requeue."""

    exit_code = ExitCode.FATAL_NO_REQUEUE


class ConfigError(FatalError):
    """Invalid configuration; names the source, the key and what was expected."""

    def __init__(self, message: str, *, source: str | None = None,
                 key: str | None = None, hint: str | None = None) -> None:
        self.source = source
        self.key = key
        where = ", ".join(p for p in (source and f"in {source}",
                                      key and f"key '{key}'") if p)
        super().__init__(f"{where}: {message}" if where else message, hint=hint)


class UsageError(FatalError):
    """Bad command-line input."""

    exit_code = ExitCode.USAGE


class SlurmCommandError(RecoverableError):
    """A Slurm command failed or timed out (the controller may be busy)."""


class TerminalAbort(BaseException):
    """Stop now. A ``BaseException`` so ``except Exception`` cannot swallow it."""

    exit_code = ExitCode.ABORTED

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def exit_code_for(error: BaseException) -> ExitCode:
    """The process exit code that reports ``error`` (bugs count as fatal)."""
    code = getattr(error, "exit_code", None)
    return code if isinstance(code, ExitCode) else ExitCode.FATAL_NO_REQUEUE
