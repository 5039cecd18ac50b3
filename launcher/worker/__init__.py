"""The worker runtime: what a training script calls each step (design.md, "The
per-step protocol"): quorum -> reconfigure FTAR -> catch up if behind ->
forward/backward -> FTAR -> intra-replica two-phase commit -> snapshot.

The pure parts (``protocol``, ``ledger``, ``lr``) import neither torch nor
sockets; ``manager`` wires quorum, FTAR and checkpoints; ``torch_api`` is the
torch front end a training script adopts. The controller imports none of it.
"""
