"""Which lab cluster: the host's Slurm (the default), or another release beside it.

``$LAB_SLURM_RELEASE`` (or ``slurm-cluster --slurm R``) names the release; unset
or ``host`` means the host's own Slurm, with exactly the names the cluster has
always had. A release (``22.05``, ``24.11``, ``26.05``) runs from a Debian root
(``debroot.py``) and gets an identity of its own, so it can run while the host's
cluster runs: its own state directory, namespace prefix, bridge and subnet, and
the root's own /etc/hosts (the host's is not touched). Host names (``ftlctl``,
``n1``..) and ports are the same in every cluster: each lives in its own network
namespaces and resolves names in its own /etc/hosts.

Not an ``FTL_`` name: ft-launch reads every ``FTL_<SECTION>_<KEY>`` as config and
refuses unknown ones, and jobs inherit the test's environment.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from . import debroot

HOST = "host"


@dataclass(frozen=True)
class Instance:
    release: str          # "host" or a Slurm release such as "24.11"
    subnet: str           # first three octets
    netns_prefix: str
    bridge: str
    default_state_dir: Path
    root: Path | None     # the Debian root daemons and clients run in; None: the host

    @property
    def label(self) -> str:
        return "host Slurm" if self.root is None else f"Slurm {self.release} ({self.root})"


def release_requested() -> str:
    return (os.environ.get("LAB_SLURM_RELEASE") or HOST).strip()


def current() -> Instance:
    return instance_for(release_requested())


@cache
def instance_for(release: str) -> Instance:
    tmp = Path(tempfile.gettempdir())
    if release == HOST:
        return Instance(HOST, "10.77.0", "ftl-", "ftlbr0", tmp / "ftl-slurm-cluster", None)
    debroot.suite_of(release)               # a clear error for an unknown release
    major, minor = release.split(".")
    tag = major + minor
    return Instance(release, f"10.77.{int(major)}", f"ftl{tag}-", f"ftlbr{tag}",
                    tmp / f"ftl-slurm-{release}", debroot.root_path(release))
