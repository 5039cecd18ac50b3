"""Draining a node with a short, precise reason (``ft: gpu3 xid 79``)."""

from __future__ import annotations

import logging
import re

from ft_launch.errors import SlurmCommandError
from ft_launch.slurm.client import SlurmBackend

log = logging.getLogger(__name__)

REASON_PREFIX = "ft: "
MAX_REASON = 100
_UNSAFE = re.compile(r"[^A-Za-z0-9 _.:/<>=+%,()#\-]")


def drain_reason(reason: str) -> str:
    """``ft: <reason>``, one line of safe characters, short enough for ``sinfo -R``."""
    text = _UNSAFE.sub("", " ".join(reason.split()))
    return (REASON_PREFIX + text)[:MAX_REASON].rstrip()


def drain_node(slurm: SlurmBackend, node: str, reason: str, *, keep_existing: bool = True) -> bool:
    """Drain ``node``; True when this call drained it.

    With ``keep_existing`` a node that is already drained keeps its reason (an
    admin's note or an earlier, more precise verdict is not overwritten). When the
    node's state cannot be read, it is drained anyway: draining twice is harmless.
    """
    if keep_existing:
        try:
            info = slurm.nodes((node,))
        except SlurmCommandError as exc:
            log.warning("cannot read the state of %s (%s); draining anyway", node, exc)
            info = []
        if info and info[0].drained:
            log.info("%s already drained (%s): reason kept", node, info[0].reason)
            return False
    slurm.set_node_state(node, "drain", drain_reason(reason))
    return True
