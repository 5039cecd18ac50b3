"""The worker runtime: what a training script calls each step (design.md, "The
per-step protocol"): quorum (beside forward) -> reconfigure FTAR -> catch up if
behind -> forward/backward, each gradient shard reduced across replicas by FTAR
as backward produces it -> intra-replica two-phase commit -> snapshot.

The pure parts (``protocol``, ``ledger``, ``lr``) import neither torch nor
sockets; ``manager`` is the step protocol (a step's own state: ``step``), with
``exchange`` the thread that runs a step's quorum and reductions in order, and
beside it ``step_quorum`` (each step's quorum and plan), ``checkpoints`` (the
checkpointer, the restore at start), ``controller_loss``, ``ring_relay`` (a lost
member fails the rings at once) and ``observer`` (the step observer: no-op in
production, the seam fault drills inject through); ``torch_api`` is the
torch front end a training script adopts (``torch_hooks``: FSDP2's all-reduce
hook, DDP's comm hook); ``task`` starts a replica's task with its torch world
(``identity``); ``replay`` is the runtime's replay mode (one recorded step,
digested, for the controller's dual-phase replay; ``replay_files`` its files).

The worker contract: what the controller (``ft_launch.launcher.controller``) reads of
the workers, torch-free; a change here is a change to both sides
(tests/unit/test_controller_layout.py keeps this list exact):

* ``identity``: who a worker is, from its step's environment, and its torch world
* ``events``: the workers' event files (started, committed, discarded)
* ``pids``: where each rank's process is (hang diagnosis)
* ``rollbacks``: the run's rollbacks, as every launch passes them on
* ``replay_files``: the files of a dual-phase replay

and ``task``'s command line (``python -m ft_launch.launcher.worker.task``), which it
runs but never imports. The other way, the workers read the controller's heartbeat
(``ft_launch.launcher.heartbeat``).
"""
