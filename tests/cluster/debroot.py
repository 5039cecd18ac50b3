"""A Debian root holding another Slurm release, for a lab cluster of that release.

The host runs one Slurm (Debian 12: 22.05). A newer release runs from a Debian
root made with debootstrap (trixie: 24.11, sid: 26.05), cached under
``/var/cache/ftl-slurm-roots/<suite>`` (``$FTL_ROOT_CACHE``) and built once:
a cold build is debootstrap plus ``apt-get install`` of Slurm, munge and the
libraries the host's Python needs; later bring-ups reuse it.

While a cluster of that release is up, the root sees the host's ``/proc``,
``/sys``, ``/dev``, ``/tmp`` (the cluster's state directory and the tests'
scratch space), the repository and the host's Python environment at the same
paths (bind mounts, each made a slave so nothing done in the root propagates
back). The root has its own ``/etc/hosts``, so the cluster's names do not touch
the host's.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

MIRROR = "http://deb.debian.org/debian"
#: Slurm release -> the Debian suite that ships it (checked on build: ``slurmctld -V``)
SUITES = {"22.05": "bookworm", "24.11": "trixie", "26.05": "sid"}
#: Slurm, munge, and what the host's Python (lib-dynload, torch) links against
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "procps", "libssl3t64",
            "libffi8", "libsqlite3-0", "libbz2-1.0", "liblzma5", "zlib1g", "libncursesw6",
            "libuuid1", "libnsl2", "libexpat1", "libgssapi-krb5-2", "libstdc++6", "libgomp1")
#: bookworm has no 64-bit time_t transition yet: its library names differ
BOOKWORM_NAMES = {"libssl3t64": "libssl3"}
READY = ".ftl-ready"          # written last: the root is complete
BOOTSTRAPPED = ".ftl-debootstrap-done"
REPO = Path(__file__).resolve().parents[2]


class RootError(RuntimeError):
    """A root could not be built or entered; the message says which step and why."""


def cache_dir() -> Path:
    return Path(os.environ.get("FTL_ROOT_CACHE") or "/var/cache/ftl-slurm-roots")


def root_path(release: str) -> Path:
    return cache_dir() / suite_of(release)


def suite_of(release: str) -> str:
    try:
        return SUITES[release]
    except KeyError:
        raise RootError(f"no Debian suite known for Slurm {release!r}: expected one of "
                        f"{', '.join(SUITES)}") from None


def _step(what: str, argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, text=True, capture_output=True, timeout=timeout,
                              check=False, **kw)
    except subprocess.TimeoutExpired:
        raise RootError(f"{what}: no result within {timeout:.0f} s ({' '.join(argv)})") from None
    except FileNotFoundError:
        raise RootError(f"{what}: {argv[0]} not found (apt-get install debootstrap)") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise RootError(f"{what} failed (exit {done.returncode}): {' '.join(argv[:6])} ...\n{tail}")
    return done


def ensure_root(release: str, log=print) -> tuple[Path, str]:
    """The root for ``release``, built if missing; returns (root, 'warm'|'cold')."""
    root = root_path(release)
    if (root / READY).exists():
        return root, "warm"
    suite = suite_of(release)
    partial = root.with_name(root.name + ".partial")
    if mounts_under(partial) or mounts_under(root):
        raise RootError(f"{partial} or {root} still has mounts: run 'slurm-cluster down "
                        f"--slurm {release}' first")
    started = time.monotonic()
    cache_dir().mkdir(parents=True, exist_ok=True)
    if not (partial / BOOTSTRAPPED).exists():
        shutil.rmtree(partial, ignore_errors=True)
        if not shutil.which("debootstrap"):
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            _step("apt-get install debootstrap", ["apt-get", "install", "-y", "-qq",
                                                  "debootstrap"], 600, env=env)
        log(f"debootstrap {suite} into {partial} (once; about a minute)")
        _step(f"debootstrap {suite}", ["debootstrap", "--variant=minbase", suite,
                                       str(partial), MIRROR], 1800)
        (partial / BOOTSTRAPPED).touch()
    # No daemon may start while packages install (the cluster starts its own).
    policy = partial / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    names = [BOOKWORM_NAMES.get(p, p) if suite == "bookworm" else p for p in PACKAGES]
    log(f"apt-get install Slurm and munge in the {suite} root")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive",
           "LC_ALL": "C"}
    with _mounted(partial, ("/proc", "/dev")):
        # The mirror may serve a suite whose Release file is past its Valid-Until (sid
        # here, by weeks): the packages are still what we want.
        _step("apt-get update", ["chroot", str(partial), "apt-get", "update", "-qq",
                                 "-o", "Acquire::Check-Valid-Until=false"], 600, env=env)
        _step("apt-get install", ["chroot", str(partial), "apt-get", "install", "-y", "-qq",
                                  "--no-install-recommends", *names], 1800, env=env)
        _step("apt-get clean", ["chroot", str(partial), "apt-get", "clean"], 60, env=env)
    version = slurm_version(partial)
    if version != release:
        raise RootError(f"the {suite} root has Slurm {version}, not {release}: "
                        f"Debian moved on; update SUITES in {__file__}")
    (partial / READY).write_text(f"{release} {time.monotonic() - started:.0f}s\n")
    shutil.rmtree(root, ignore_errors=True)
    os.replace(partial, root)
    return root, "cold"


def slurm_version(root: Path) -> str:
    """``22.05`` from ``slurm-wlm 22.05.8`` (the root's slurmctld)."""
    out = _step("slurmctld -V", ["chroot", str(root), "slurmctld", "-V"], 60).stdout
    return ".".join(out.split()[-1].split(".")[:2])


class _mounted:
    """Bind mounts for the duration of a ``with`` (package installation)."""

    def __init__(self, root: Path, paths: tuple[str, ...]) -> None:
        self.root, self.paths = root, paths

    def __enter__(self) -> None:
        for path in self.paths:
            bind(self.root, path)

    def __exit__(self, *exc) -> None:
        unmount_all(self.root)


# --------------------------------------------------------------------------- mounts


def shared_paths() -> list[str]:
    """What a job inside the root must see at the same path: scratch (/tmp), the
    repository and the host's Python environment (a pyenv root whole, for its shims)."""
    wanted = ["/proc", "/sys", "/dev", "/tmp", str(REPO)]
    for prefix in {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}:
        pyenv = prefix.parent.parent if prefix.parent.name == "versions" else None
        wanted.append(str(pyenv or prefix))
    kept: list[str] = []
    for path in wanted:   # a path inside another one already shared comes with it
        if path not in kept and not any(path.startswith(k.rstrip("/") + "/") for k in kept
                                        if k not in ("/proc", "/sys", "/dev")):
            kept.append(path)
    return kept


def bind(root: Path, path: str) -> None:
    target = root / path.lstrip("/")
    target.mkdir(parents=True, exist_ok=True)
    _step(f"bind {path} into {root}", ["mount", "--rbind", path, str(target)], 30)
    # A slave: an unmount inside the root must never reach the host's mount.
    _step(f"make {target} a slave", ["mount", "--make-rslave", str(target)], 30)


def mount_shared(root: Path) -> list[str]:
    for path in shared_paths():
        if not os.path.ismount(root / path.lstrip("/")):
            bind(root, path)
    return shared_paths()


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root``, deepest first."""
    prefix = str(root.resolve()) if root.exists() else str(root)
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as table:
        for line in table:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(set(found), key=lambda p: -p.count("/"))


def unmount_all(root: Path) -> None:
    for point in mounts_under(root):
        res = subprocess.run(["umount", point], capture_output=True, text=True, timeout=30,
                             check=False)
        if res.returncode != 0 and os.path.ismount(point):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=30, check=False)
    left = mounts_under(root)
    if left:
        raise RootError(f"could not unmount {', '.join(left)}")


def write_hosts(root: Path, entries: list[str]) -> None:
    """The root's own /etc/hosts: the cluster's names and the machine's own, which the
    login node's clients (salloc, srun: the controller's namespace shares the host's
    hostname) give slurmctld as their address. Unresolvable, it cost slurmctld 10 s
    of failed lookups per message to them, long enough to set live nodes DOWN."""
    path = root / "etc/hosts"
    tmp = path.with_name("hosts.ftl-tmp")
    own = socket.gethostname()
    tmp.write_text("127.0.0.1 localhost\n::1 localhost\n"
                   + (f"127.0.0.1 {own}\n" if own != "localhost" else "")
                   + "\n".join(entries) + "\n")
    os.replace(tmp, path)


def write_enter_script(root: Path, path: Path) -> None:
    """A command prefix that runs the rest of its arguments inside ``root``, in the
    caller's working directory (chroot itself starts in /)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("#!/bin/sh\n# Run a command inside the Slurm root, in the caller's "
                   "directory.\nhere=$(pwd)\n"
                   f"exec chroot {root} /bin/sh -c "
                   "'cd \"$0\" 2>/dev/null || cd /; exec \"$@\"' \"$here\" \"$@\"\n")
    tmp.chmod(0o755)
    os.replace(tmp, path)
