"""Network checks: interface and InfiniBand port state from sysfs, reachability of
peers (TCP connect with a timeout)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from .context import CheckContext
from .result import CheckResult, from_problems, skipped


@dataclass(frozen=True)
class LinkParams:
    interfaces: tuple[str, ...] = ()     # empty: not judged (which NICs matter is site-specific)


@dataclass(frozen=True)
class IbParams:
    ports: tuple[str, ...] = ()          # "mlx5_0/1"; empty: every port present must be up
    min_rate_gbps: int = 0


@dataclass(frozen=True)
class PeerParams:
    targets: tuple[str, ...] = ()        # "host:port" the node must reach (slurmctld, storage)
    connect_timeout: float = 1.0


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def links(name: str, ctx: CheckContext, params: LinkParams) -> CheckResult:
    problems, states = [], {}
    for iface in params.interfaces:
        base = ctx.sys_root / "class" / "net" / iface
        if not base.exists():
            problems.append(f"{iface} missing")
            continue
        state = states[iface] = _read(base / "operstate")
        # Virtual devices report "unknown" while passing traffic: trust the carrier.
        up = state == "up" or (state == "unknown" and _read(base / "carrier") == "1")
        if iface in ctx.faults.links_down or not up:
            problems.append(f"{iface} down")
    return from_problems(name, problems, operstate=states)


@dataclass(frozen=True)
class IbPort:
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


def ib_ports(sys_root: Path) -> list[IbPort]:
    ports = []
    for device in sorted((sys_root / "class" / "infiniband").glob("*")):
        for port in sorted((device / "ports").glob("*")):
            ports.append(IbPort(f"{device.name}/{port.name}", _read(port / "state"),
                                _read(port / "phys_state"), _read(port / "rate")))
    return ports


def infiniband(name: str, ctx: CheckContext, params: IbParams) -> CheckResult:
    found = {p.name: p for p in ib_ports(ctx.sys_root)}
    if not found and not params.ports:
        return skipped(name, "no infiniband")
    problems = [f"ib {port} missing" for port in params.ports if port not in found]
    for port in (found[p] for p in (params.ports or found) if p in found):
        if port.name in ctx.faults.ib_ports_down:
            problems.append(f"ib {port.name} DOWN")
        elif not port.active:
            state = port.state.partition(": ")[2] or "DOWN"
            phys = port.phys_state.partition(": ")[2] or "?"
            problems.append(f"ib {port.name} {state}/{phys}")
        elif params.min_rate_gbps and port.rate_gbps < params.min_rate_gbps:
            problems.append(f"ib {port.name} rate {port.rate_gbps:g}<{params.min_rate_gbps}Gb/s")
    return from_problems(name, problems, ports={p: found[p].state for p in found})


def reachable(target: str, timeout: float) -> str | None:
    """None when a TCP connection to ``host:port`` opens within ``timeout``, else why not."""
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    except ValueError as exc:  # a port that is not a number
        return str(exc)


def peers(name: str, ctx: CheckContext, params: PeerParams) -> CheckResult:
    problems = []
    for target in params.targets:
        why = "simulated" if target in ctx.faults.unreachable else \
            reachable(target, params.connect_timeout)
        if why is not None:
            problems.append(f"peer {target} unreachable ({why})")
    return from_problems(name, problems)
