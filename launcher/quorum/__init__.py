"""The replica quorum: a per-step membership service among replica leaders,
leader-elected over ZeroMQ (no central lighthouse to lose).

Each step every replica's agent calls ``get_quorum(next_step)``; the elected
leader answers all members of the round with the same ``Quorum``
(``quorum_id, members, max_step, behind``). See ``core`` for the pure rules and
``agent`` for the shell.

Voters are the replicas and W witnesses that never train (``witness``; the
controller is witness 0, ``ft-launch witness`` runs more). A replica has one
vote; the witnesses share ``replicas - 1`` votes, so all replicas alone, or
one replica with every witness, hold a strict majority of the ``2R - 1``
votes. A leader needs a majority of the votes to be elected (at most one vote
per voter per term), and a quorum is announced only once voters holding a
majority stand behind it: its members (a replica endorses only the quorum it
joins, and trains in at most one ring per step) plus the witnesses that
endorse it. Safety, why two disjoint sets of replicas A and B can never both
commit steps: any two majorities of the votes intersect, and they cannot meet
in a replica (none is in both A and B), so they meet in a witness. A witness
endorses only for the leader of its current term (a deposed leader is turned
away) and only a quorum sharing a replica with the last round it endorsed or
was told of; a round of A and the next of B share none, so it endorses at most
one side's rounds from there on, and the other side never reaches a majority.
A side with a majority of the votes trains on down to ``quorum.min_replicas``
members; without witnesses this is the plain rule (a majority of replicas).
Every voter writes its term and vote (a witness: its last round too) to the
run directory before it answers on them, and reads them back when it restarts
(``witness.Memory``), so a restart neither makes it vote twice in a term (two
leaders in one term) nor makes a witness forget which side trained.
A leader publishes its broadcasts once on a feed that every follower's process
reads (``feed``), instead of sending one copy per member. While steps come
faster than a round is worth and nothing changes, the members go on with the
last quorum from step to step on the leader's grant, without a round
(``standing``, ``quorum.standing``); any change (a join, a silent member, a
failed commit, a new term) brings the rounds back within the grant's few steps.
"""

from .agent import PendingQuorum, QuorumAgent
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
                     StandingEnded,
)
from .loop import AgentLoop
from .model import Health, Quorum, QuorumMember, QuorumParams, Role
from .node import QuorumStats, QuorumStatus

__all__ = [
    "AgentLoop", "FileDirectory", "Health", "LeaderElected", "LeadershipLost",
    "MajorityLost", "MajorityLostError", "MajorityRegained", "MembersLivenessChanged",
    "PeerDirectory", "PeerRecord", "PendingQuorum", "Quorum", "QuorumAgent", "QuorumFormed",
    "QuorumJoined", "QuorumMember", "QuorumParams", "QuorumStats", "QuorumStatus",
    "QuorumStoppedError", "QuorumTimeoutError", "Role", "StandingEnded", "StaticDirectory",
    "decide",
    "initial_state", "next_deadline",
]
