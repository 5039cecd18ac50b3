"""The replica quorum: a per-step membership service among replica leaders,
leader-elected over ZeroMQ among the replicas and witness voters (no central
lighthouse to lose; README.md says why).

Each step every replica's ``QuorumAgent`` calls ``get_quorum(next_step)``; the
elected leader answers all members of the round with the same ``Quorum``
(``quorum_id, members, max_step, behind``). ``core`` holds the rules (``election``
the Raft part), ``agent`` the sockets, ``witness_service`` the witnesses' files.
"""

from .agent import QuorumAgent
from .directory import FileDirectory
from .events import MembersLivenessChanged, QuorumFormed, StandingEnded

#: What the product and the benchmarks use; the rest is reached by module.
__all__ = ["FileDirectory", "MembersLivenessChanged", "QuorumAgent", "QuorumFormed",
           "StandingEnded"]
