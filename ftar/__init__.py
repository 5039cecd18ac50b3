"""FTAR: the fault-tolerant ring all-reduce across replicas (design.md, "FTAR").

``FtarGroup`` is the plain API on numpy arrays; ``ft_launch.ftar.torch_frontend`` (imported
only by training code: it imports torch) adds torch tensors, CUDA staging and the
DDP communication hook.
"""

from .errors import AuthenticationError, FtarUsageError, PeerFailedError, StaleQuorumError
from .ring import FtarGroup, FtarStats, GroupState, ReduceOp

__all__ = ["AuthenticationError", "FtarGroup", "FtarStats", "FtarUsageError", "GroupState",
           "PeerFailedError", "ReduceOp", "StaleQuorumError"]
