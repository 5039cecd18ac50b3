"""The replica quorum: a per-step membership service among replica leaders,
leader-elected over ZeroMQ (no central lighthouse to lose).

Each step every replica's agent calls ``get_quorum(next_step)``; the elected
leader answers all members of the round with the same ``Quorum``
(``quorum_id, members, max_step, behind``). See ``core`` for the pure rules and
``agent`` for the shell.
"""

from .agent import QuorumAgent
from .core import decide, initial_state, next_deadline
from .directory import FileDirectory, PeerDirectory, PeerRecord, StaticDirectory
from .errors import MajorityLostError, QuorumStoppedError, QuorumTimeoutError
from .events import (
                     LeaderElected,
                     LeadershipLost,
                     MajorityLost,
                     MajorityRegained,
                     MembersLivenessChanged,
                     QuorumFormed,
                     QuorumJoined,
)
from .loop import AgentLoop
from .model import Health, Quorum, QuorumMember, QuorumParams, Role
from .node import QuorumStats, QuorumStatus

__all__ = [
    "AgentLoop", "FileDirectory", "Health", "LeaderElected", "LeadershipLost",
    "MajorityLost", "MajorityLostError", "MajorityRegained", "MembersLivenessChanged",
    "PeerDirectory", "PeerRecord", "Quorum", "QuorumAgent", "QuorumFormed", "QuorumJoined",
    "QuorumMember", "QuorumParams", "QuorumStats", "QuorumStatus", "QuorumStoppedError",
    "QuorumTimeoutError", "Role", "StaticDirectory", "decide", "initial_state",
    "next_deadline",
]
