"""Start one task of a replica as torchrun would: ``python -m ft_launch.launcher.worker.task
-- CMD...`` sets ``RANK``, ``LOCAL_RANK`` and ``MASTER_ADDR`` of the replica's torch
world for this task (the controller set the rest), then execs ``CMD``, so a
script's own ``init_process_group()`` / ``init_device_mesh()`` just work."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from ft_launch.env import ENV_REPLAY
from ft_launch.errors import UsageError

from .identity import WorkerIdentity, task_world_env
from .pids import write_rank_pid


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.stderr.write("usage: python -m ft_launch.launcher.worker.task -- COMMAND [ARGS...]\n")
        return 2
    env = {**os.environ, **task_world_env(os.environ)}
    if not env.get(ENV_REPLAY):   # a replay is not its replica's process (worker.replay)
        announce_pid(env)
    try:
        os.execvpe(args[0], args, env)
    except OSError as error:
        sys.stderr.write(f"ft_launch.launcher.worker.task: cannot run {args[0]!r}: {error}\n")
        return 127
    return 0  # not reached


def announce_pid(env: Mapping[str, str]) -> None:
    """Where a hang diagnosis finds this task from its start (the pid outlives the
    exec; the manager writes the file again once it runs)."""
    try:
        write_rank_pid(WorkerIdentity.from_env(env))
    except (UsageError, OSError) as error:
        sys.stderr.write(f"ft_launch.launcher.worker.task: no pid file written ({error})\n")


if __name__ == "__main__":
    sys.exit(main())
