"""The worker runtime: what a training script calls each step (design.md, "The
per-step protocol"): quorum (beside forward) -> reconfigure FTAR -> catch up if
behind -> forward/backward, each gradient shard reduced across replicas by FTAR
as backward produces it -> intra-replica two-phase commit -> snapshot.

The pure parts (``protocol``, ``ledger``, ``lr``) import neither torch nor
sockets; ``manager`` wires quorum, FTAR and checkpoints, with ``exchange`` the
thread that runs a step's quorum and reductions in order; ``torch_api`` is the
torch front end a training script adopts (``torch_hooks``: FSDP2's all-reduce
hook, DDP's comm hook); ``task`` starts a replica's task with its torch world
(``identity``); ``replay`` is the runtime's replay mode (one recorded step,
digested, for the controller's dual-phase replay; ``replay_files`` its files).
The controller imports only ``identity``, ``events``, ``replay_files`` and
``task``'s command line.
"""
