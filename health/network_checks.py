"""Network checks: interface and InfiniBand port state, reachability of peers (the
facts come from the context's ``HostFacts``: sysfs, a TCP connect with a timeout)."""

from __future__ import annotations

from dataclasses import dataclass

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


def links(name: str, ctx: CheckContext, params: LinkParams) -> CheckResult:
    problems, states = [], {}
    for iface in params.interfaces:
        state = ctx.host.link_state(iface)
        if state is None:
            problems.append(f"{iface} missing")
            continue
        states[iface] = state
        if not ctx.host.link_up(iface):
            problems.append(f"{iface} down")
    return from_problems(name, problems, operstate=states)


def infiniband(name: str, ctx: CheckContext, params: IbParams) -> CheckResult:
    found = {p.name: p for p in ctx.host.ib_ports()}
    if not found and not params.ports:
        return skipped(name, "no infiniband")
    problems = [f"ib {port} missing" for port in params.ports if port not in found]
    for port in (found[p] for p in (params.ports or found) if p in found):
        if not port.active:
            state = port.state.partition(": ")[2] or "DOWN"
            phys = port.phys_state.partition(": ")[2]  # empty: not known, left out
            problems.append(f"ib {port.name} {state}" + (f"/{phys}" if phys else ""))
        elif params.min_rate_gbps and port.rate_gbps < params.min_rate_gbps:
            problems.append(f"ib {port.name} rate {port.rate_gbps:g}<{params.min_rate_gbps}Gb/s")
    return from_problems(name, problems, ports={p: found[p].state for p in found})


def peers(name: str, ctx: CheckContext, params: PeerParams) -> CheckResult:
    problems = []
    for target in params.targets:
        why = ctx.host.reachable(target, params.connect_timeout)
        if why is not None:
            problems.append(f"peer {target} unreachable ({why})")
    return from_problems(name, problems)
