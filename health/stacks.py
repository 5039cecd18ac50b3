"""Capturing Python stacks of training processes with py-spy (the shell), and
parsing py-spy's JSON (pure).

A stopped process (SIGSTOP, state ``T``) cannot be suspended by py-spy's
default mode (it fails with "Failed to suspend process"); it is read with
``--nonblocking``, which needs no cooperation from the target. Each capture has
a timeout; a process that cannot be read at all is kept with its error, which
the aggregation counts as an outlier.

``python -m ft_launch.health.stacks --pid PID... --out FILE`` captures the given processes
of this node and writes JSON (atomically; without ``--out``: to stdout); ``--job
JOB`` instead captures every process of a Slurm job on this node (found by
``SLURM_JOB_ID`` and ``SLURM_PROCID`` in its environment). The controller runs it
with ``srun --overlap`` on each node of a hung replica
(``ft_launch.launcher.controller.diagnosis``).
py-spy is looked for beside this Python first (a virtual environment's ``bin``),
then on ``PATH``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft_launch.files import atomic_write_text


@dataclass(frozen=True)
class Frame:
    function: str
    file: str          # full path as py-spy reports it
    line: int = 0      # for the reader of a report; the aggregation ignores it


@dataclass(frozen=True)
class ThreadStack:
    name: str
    frames: tuple[Frame, ...]   # innermost first (as py-spy prints)
    main: bool = False


@dataclass(frozen=True)
class ProcessStack:
    pid: int
    state: str = ""             # /proc state letter at capture time (R, S, D, T, Z)
    threads: tuple[ThreadStack, ...] = ()
    error: str = ""

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "state": self.state, "error": self.error,
                "threads": [{"name": t.name, "main": t.main,
                             "frames": [[f.function, f.file, f.line] for f in t.frames]}
                            for t in self.threads]}

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> ProcessStack:
        """The inverse of ``to_dict``; ValueError for anything else."""
        try:
            threads = tuple(
                ThreadStack(str(t["name"]), tuple(Frame(str(f[0]), str(f[1]),
                                                        int(f[2]) if len(f) > 2 else 0)
                                                  for f in t["frames"]), bool(t.get("main")))
                for t in raw.get("threads", []))
            return ProcessStack(int(raw["pid"]), str(raw.get("state", "")), threads,
                                str(raw.get("error", "")))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a process stack: {exc!r}") from None


def parse_pyspy_json(pid: int, text: str, state: str = "") -> ProcessStack:
    threads = []
    for thread in json.loads(text):
        frames = tuple(Frame(str(f.get("name", "?")), str(f.get("filename", "?")),
                             int(f.get("line") or 0))
                       for f in thread.get("frames", []))
        main = thread.get("os_thread_id") == pid or thread.get("thread_name") == "MainThread"
        threads.append(ThreadStack(str(thread.get("thread_name") or thread.get("thread_id")),
                                   frames, main))
    return ProcessStack(pid, state, tuple(threads))


def process_state(pid: int, proc_root: Path = Path("/proc")) -> str:
    try:
        return (proc_root / str(pid) / "stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def find_pyspy() -> str:
    """py-spy beside this interpreter (where pip put it), else the one on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else (shutil.which("py-spy") or "py-spy")


def capture(pid: int, timeout: float = 10.0, pyspy: str | None = None) -> ProcessStack:
    pyspy = pyspy or find_pyspy()
    state = process_state(pid)
    if not state:
        return ProcessStack(pid, error="no such process")
    modes = [["--nonblocking"]] if state in ("T", "t") else [[], ["--nonblocking"]]
    error = ""
    for extra in modes:
        try:
            done = subprocess.run([pyspy, "dump", "--pid", str(pid), "--json", *extra],
                                  check=False, capture_output=True, text=True,
                                  timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            error = f"py-spy timed out after {timeout:g}s"
            continue
        except FileNotFoundError:
            return ProcessStack(pid, state, error=f"{pyspy} not found")
        if done.returncode == 0:
            try:
                return parse_pyspy_json(pid, done.stdout, state)
            except ValueError as exc:
                error = f"unreadable py-spy output: {exc}"
                continue
        error = (done.stderr.strip().splitlines() or ["py-spy failed"])[0][:200]
    return ProcessStack(pid, state, error=error)


def capture_all(pids: Iterable[int], timeout: float = 10.0,
                parallel: int = 4) -> dict[int, ProcessStack]:
    """Stacks of many processes, ``parallel`` py-spy runs at a time."""
    targets = list(pids)
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(targets)))) as pool:
        return dict(zip(targets, pool.map(lambda pid: capture(pid, timeout), targets)))


def job_processes(job_id: str, proc_root: Path = Path("/proc")) -> dict[int, int]:
    """{pid: rank} of this node's processes of ``job_id`` (rank: ``SLURM_PROCID``)."""
    found = {}
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = dict(item.split(b"=", 1) for item in
                           (entry / "environ").read_bytes().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if environ.get(b"SLURM_JOB_ID") == job_id.encode() and b"SLURM_PROCID" in environ:
            found[int(entry.name)] = int(environ[b"SLURM_PROCID"])
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ft_launch.health.stacks",
                                     description="Dump Python stacks as JSON with py-spy.")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--pid", type=int, nargs="+")
    group.add_argument("--job", help="every process of this Slurm job on this node")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds one py-spy run may take")
    parser.add_argument("--out", type=Path, help="write the JSON here (atomically)")
    args = parser.parse_args(argv)
    ranks = job_processes(args.job) if args.job else {pid: -1 for pid in args.pid}
    stacks = capture_all(ranks, args.timeout)
    text = json.dumps([{"rank": ranks[pid], **stack.to_dict()}
                       for pid, stack in stacks.items()]) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        atomic_write_text(args.out, text, durable=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
