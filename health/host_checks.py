"""Host checks: memory and swap, disk space, read-only filesystems, /dev/shm,
required mounts, load, leftover and zombie processes, clock.

Each asks the context's ``HostFacts`` for the facts it needs and judges them in a
few lines.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .context import CheckContext
from .result import CheckResult, CheckStatus, failed, format_bytes, from_problems, passed, skipped

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class MemoryParams:
    min_available_bytes: int = 512 * MiB
    max_swap_used_bytes: int = -1        # -1: swap use not judged


@dataclass(frozen=True)
class DiskParams:
    paths: tuple[str, ...] = ("/", "/tmp")
    min_free_bytes: int = GiB


@dataclass(frozen=True)
class WritableParams:
    paths: tuple[str, ...] = ("/", "/tmp", "/dev/shm")


@dataclass(frozen=True)
class ShmParams:
    path: str = "/dev/shm"
    min_free_bytes: int = 256 * MiB


@dataclass(frozen=True)
class MountParams:
    required: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoadParams:
    max_load_per_cpu: float = 2.0


@dataclass(frozen=True)
class LeftoverParams:
    #: Nodes are never shared: before a job, processes of any other job are leftovers.
    exclusive: bool = False


@dataclass(frozen=True)
class ZombieParams:
    max_zombies: int = 50


@dataclass(frozen=True)
class ClockParams:
    require_sync: bool = False           # unsynchronised: FAIL instead of WARN
    min_year: int = 2024                 # an earlier clock means a dead RTC


def memory(name: str, ctx: CheckContext, params: MemoryParams) -> CheckResult:
    available = ctx.host.mem_available_bytes()
    swap_used = ctx.host.swap_used_bytes()
    evidence = {"available": available, "swap_used": swap_used}
    if available < params.min_available_bytes:
        return failed(name, f"memory available {format_bytes(available)}"
                            f"<{format_bytes(params.min_available_bytes)}", **evidence)
    if 0 <= params.max_swap_used_bytes < swap_used:
        return failed(name, f"swap used {format_bytes(swap_used)}", **evidence)
    return passed(name, **evidence)


def disk(name: str, ctx: CheckContext, params: DiskParams) -> CheckResult:
    problems, evidence = [], {}
    for path in params.paths:
        try:
            free = ctx.host.disk_free_bytes(path)
        except OSError as exc:
            problems.append(f"disk {path} unusable: {exc.strerror}")
            continue
        evidence[path] = free
        if free < params.min_free_bytes:
            problems.append(f"disk {path} free {format_bytes(free)}"
                            f"<{format_bytes(params.min_free_bytes)}")
    return from_problems(name, problems, free_bytes=evidence)


def writable(name: str, ctx: CheckContext, params: WritableParams) -> CheckResult:
    problems = []
    for path in params.paths:
        try:
            readonly = ctx.host.readonly(path)
        except OSError as exc:
            problems.append(f"{path} unusable: {exc.strerror}")
            continue
        if readonly:
            problems.append(f"{path} read-only")
    return from_problems(name, problems)


def shm(name: str, ctx: CheckContext, params: ShmParams) -> CheckResult:
    path = params.path
    try:
        free = ctx.host.disk_free_bytes(path)
        readonly = not ctx.host.writable(path)
    except OSError as exc:
        return failed(name, f"{path} unusable: {exc.strerror}")
    if readonly:
        return failed(name, f"{path} not writable")
    if free < params.min_free_bytes:
        return failed(name, f"{path} free {format_bytes(free)}"
                            f"<{format_bytes(params.min_free_bytes)}", free=free)
    return passed(name, free=free)


def mounts(name: str, ctx: CheckContext, params: MountParams) -> CheckResult:
    missing = [f"mount {path} missing" for path in params.required
               if not ctx.host.is_mount(path)]
    return from_problems(name, missing)


def load(name: str, ctx: CheckContext, params: LoadParams) -> CheckResult:
    fields = (ctx.host.proc_root / "loadavg").read_text().split()
    per_cpu = float(fields[0]) / (os.cpu_count() or 1)
    if per_cpu > params.max_load_per_cpu:
        return failed(name, f"load {per_cpu:.1f}/cpu>{params.max_load_per_cpu:g}",
                      load1=float(fields[0]))
    return passed(name, load1=float(fields[0]))


# --------------------------------------------------------------------------- processes


def _processes(proc_root: Path) -> Iterator[tuple[int, str, int]]:
    """(pid, state letter, parent pid) of every process still in /proc."""
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        state, ppid = stat.rpartition(")")[2].split()[:2]
        yield int(entry.name), state, int(ppid)


def _job_of(proc_root: Path, pid: int) -> str | None:
    """The job a process runs for, or None. slurmd gives its hooks (Prolog, Epilog on
    this node or, where several slurmd share a host, on another) the job's id too, and
    marks them with SLURM_SCRIPT_CONTEXT: those run *about* a job, not *in* it."""
    try:
        environ = (proc_root / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    job = None
    for item in environ.split(b"\0"):
        if item.startswith(b"SLURM_SCRIPT_CONTEXT="):
            return None
        if item.startswith(b"SLURM_JOB_ID="):
            job = item[len(b"SLURM_JOB_ID="):].decode(errors="replace")
    return job


def _lineage(table: dict[int, int], pid: int) -> set[int]:
    """``pid`` and its ancestors: the hook's own process chain carries the job id too."""
    seen = set()
    while pid and pid not in seen:
        seen.add(pid)
        pid = table.get(pid, 0)
    return seen


def leftover_processes(name: str, ctx: CheckContext, params: LeftoverParams) -> CheckResult:
    if ctx.job is None:
        return skipped(name, "no job")
    procs = list(_processes(ctx.host.proc_root))
    parents = {pid: ppid for pid, _, ppid in procs}
    ours = _lineage(parents, os.getpid())
    leftovers = []
    for pid, state, _ in procs:
        if pid in ours or state == "Z":
            continue
        job = _job_of(ctx.host.proc_root, pid)
        if job is None:
            continue
        if (ctx.job.ended and job == ctx.job.job_id) or \
                (params.exclusive and not ctx.job.ended and job != ctx.job.job_id):
            leftovers.append(pid)
    if not leftovers:
        return passed(name)
    which = f"job {ctx.job.job_id}" if ctx.job.ended else "earlier jobs"
    return failed(name, f"{len(leftovers)} leftover procs of {which}", pids=leftovers[:50])


def zombies(name: str, ctx: CheckContext, params: ZombieParams) -> CheckResult:
    count = sum(1 for _, state, _ in _processes(ctx.host.proc_root) if state == "Z")
    if count > params.max_zombies:
        return failed(name, f"zombies {count}>{params.max_zombies}", zombies=count)
    return passed(name, zombies=count)


# --------------------------------------------------------------------------- clock


class _Timex(ctypes.Structure):
    # struct timex from <sys/timex.h>: only ``modes`` (first) is set; the kernel
    # fills the rest. Generous padding covers every architecture's layout.
    _fields_ = [("modes", ctypes.c_uint), ("_rest", ctypes.c_byte * 256)]


TIME_ERROR = 5  # adjtimex(): clock not synchronised


def ntp_synchronised() -> bool | None:
    """The kernel's NTP status (None: cannot tell)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        state = libc.adjtimex(ctypes.byref(_Timex()))
    except (OSError, AttributeError):
        return None
    return None if state < 0 else state != TIME_ERROR


def clock(name: str, ctx: CheckContext, params: ClockParams) -> CheckResult:
    year = time.gmtime().tm_year
    if year < params.min_year:
        return failed(name, f"clock says year {year}<{params.min_year}")
    synced = ntp_synchronised()
    if synced is False:
        status = CheckStatus.FAIL if params.require_sync else CheckStatus.WARN
        return CheckResult(name, status, "clock not ntp-synchronised", {"synced": False})
    return passed(name, synced=synced)
