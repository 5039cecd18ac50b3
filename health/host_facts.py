"""``HostFacts``: what the host and network checks know about the node, read from
the running system (/proc, /sys, the filesystems, the network).

The checks ask only through this object (``CheckContext.host``) and judge what it
answers, so a test root for /proc and /sys, or the simulated node of
``simulation.py``, changes what they see without changing how they judge.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class IbPort:
    """One InfiniBand port as sysfs shows it."""

    name: str          # mlx5_0/1
    state: str         # "4: ACTIVE"
    phys_state: str    # "5: LinkUp"
    rate: str          # "200 Gb/sec (4X HDR)"

    @property
    def active(self) -> bool:
        return self.state.endswith("ACTIVE") and self.phys_state.endswith("LinkUp")

    @property
    def rate_gbps(self) -> float:
        head = self.rate.split()
        try:
            return float(head[0]) if head else 0.0
        except ValueError:
            return 0.0


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class HostFacts:
    """The facts of the node the checks run on, read when asked (never cached: the
    inspection agent asks again every round). ``proc_root`` and ``sys_root`` are
    where /proc and /sys are read (tests point them at a prepared tree)."""

    proc_root: Path = Path("/proc")
    sys_root: Path = Path("/sys")

    # ------------------------------------------------------------------ memory

    def meminfo(self) -> dict[str, int]:
        """/proc/meminfo in bytes."""
        values = {}
        for line in (self.proc_root / "meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        return values

    def mem_available_bytes(self) -> int:
        info = self.meminfo()
        # Kernels before 3.14 have no MemAvailable: free memory is the closest.
        return info.get("MemAvailable", info.get("MemFree", 0))

    def swap_used_bytes(self) -> int:
        info = self.meminfo()
        return info.get("SwapTotal", 0) - info.get("SwapFree", 0)

    # ------------------------------------------------------------------ filesystems

    def disk_free_bytes(self, path: str) -> int:
        """Bytes an unprivileged user may still write under ``path`` (OSError: unusable)."""
        stat = os.statvfs(path)
        return stat.f_bavail * stat.f_frsize

    def readonly(self, path: str) -> bool:
        """Whether the filesystem of ``path`` is mounted read-only (OSError: unusable)."""
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)

    def writable(self, path: str) -> bool:
        """Whether this process may write into ``path`` (permissions included)."""
        return os.access(path, os.W_OK)

    def is_mount(self, path: str) -> bool:
        return os.path.ismount(path)

    # ------------------------------------------------------------------ network

    def link_state(self, iface: str) -> str | None:
        """The interface's operstate ("up", "down", "unknown"...), None when it does not exist."""
        base = self.sys_root / "class" / "net" / iface
        return _read(base / "operstate") if base.exists() else None

    def link_up(self, iface: str) -> bool:
        base = self.sys_root / "class" / "net" / iface
        state = _read(base / "operstate")
        # Virtual devices report "unknown" while passing traffic: trust the carrier.
        return state == "up" or (state == "unknown" and _read(base / "carrier") == "1")

    def ib_ports(self) -> list[IbPort]:
        """Every InfiniBand port present, in name order."""
        ports = []
        for device in sorted((self.sys_root / "class" / "infiniband").glob("*")):
            for port in sorted((device / "ports").glob("*")):
                ports.append(IbPort(f"{device.name}/{port.name}", _read(port / "state"),
                                    _read(port / "phys_state"), _read(port / "rate")))
        return ports

    def reachable(self, target: str, timeout: float) -> str | None:
        """None when a TCP connection to ``host:port`` opens within ``timeout``, else why not."""
        host, _, port = target.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                return None
        except OSError as exc:
            return exc.strerror or type(exc).__name__
        except ValueError as exc:  # a port that is not a number
            return str(exc)

    # ------------------------------------------------------------------ compute

    def computes_wrong(self) -> bool:
        """Whether the node is known to compute wrong results, for the alignment run to
        reproduce. A real node's silent data corruption is not known in advance: it
        shows in the alignment digest itself, so the answer here is no."""
        return False
