"""The controller: ``ft-launch run``'s one decision and the thin shell that carries it out
(design.md, "Automated fault tolerance"). Torch-free: it runs in the batch script, or
on a login node, and must start fast.

Pure rule tables (no I/O; most of the controller's tests are theirs):

* ``lifecycle``: the one decision, ``decide(state, event, now) -> Decision``; its values
  (state, events, actions) are ``lifecycle_model``'s, re-exported
* ``recovery``: the fault table (retry in place, evict and promote, full restart, give up)
* ``versions``: hot update and rollback of the training code, and its request files
* ``rollback``: a loss spike rolls every replica back
* ``replay_rule``: when a dual-phase replay runs, and what each verdict evicts
* ``run_state``: the one record of every replica's lifecycle, shared by the tables
* ``plan``: which nodes run which replica, which wait as standby; each step's srun

The shell (observes and executes, decides nothing):

* ``supervisor``: the loop of ``ft-launch run``
* ``submit``: ``ft-launch submit``, the allocation and a detached controller from a
  login node
* ``standby``: the warm standby agent (a job step on each standby node) and its
  activation
* ``pool``: warm standbys held in a site reservation
* ``inspection``: the per-node inspection steps during a run
* ``diagnosis``: a stalled replica's stacks (py-spy on its nodes)
* ``sdc_replay``: a dual-phase replay, which node of a replica computes NaN/Inf
* ``events``: the records of ``<run_dir>/controller.jsonl``, and a reader of event files

What it reads of the workers is the worker contract (``ft_launch.launcher.worker``'s
docstring names it: ``identity``, ``events``, ``pids``, ``rollbacks``, ``replay_files``);
what the workers read of it is its heartbeat (``ft_launch.launcher.heartbeat``).

Index of its events and actions (each ``module.Class``, in this package;
tests/unit/test_controller_layout.py keeps it exact):

What ``lifecycle.decide`` takes (the union ``lifecycle_model.Event``):
    ``lifecycle_model.RunStarted``          launch every replica where the plan put it
    ``lifecycle_model.ProcessStarted``      a (re)launched replica's process started
    ``lifecycle_model.StepsCommitted``      commits read from a replica's event files
    ``lifecycle_model.StepExited``          a replica's srun exited
    ``lifecycle_model.StandbyAgentExited``  a standby agent's step ended
    ``lifecycle_model.PromotionFailed``     Slurm would not move a promoted standby in
    ``lifecycle_model.NodesReported``       Slurm's unusable nodes, with why
    ``lifecycle_model.InspectionAlarmed``   a node's inspection failed
    ``lifecycle_model.GradientsNonFinite``  a replica's gradients held NaN/Inf
    ``lifecycle_model.QuorumLostMembers``   a replica's quorum stopped hearing others
    ``lifecycle_model.HangDiagnosed``       a stalled replica's stacks, taken
    ``lifecycle_model.ReplicaSlowed``       a replica is fail-slow against its peers
    ``lifecycle_model.Tick``                time passed
    ``rollback.LossSpikeFound``             the job's mean loss spiked
    ``replay_rule.ReplayLocated``           what a dual-phase replay found
    ``versions.UpdateRequested``            a hot-update request file was read
    ``recovery.StandbyAdded``               a new warm standby joined the pool

What the shell carries out (the union ``lifecycle_model.Order``; each says why):
    ``lifecycle_model.StartReplica``        the first launch of a replica
    ``lifecycle_model.FinishRun``           end the run
    ``lifecycle_model.DiagnoseHang``        take a stalled replica's stacks
    ``replay_rule.RunReplay``               replay a step to find a NaN/Inf node
    ``recovery.EvictNode``                  drain a bad node
    ``recovery.CancelReplica``              stop a replica's step
    ``recovery.PromoteStandby``             a standby node becomes a replica's
    ``recovery.RelaunchReplica``            launch a replica again, on these nodes
    ``recovery.FullRestart``                relaunch every replica from the checkpoint
    ``recovery.GiveUp``                     stop: nothing left to recover with

What ``decide`` feeds the recovery table (``recovery.RecoveryEvent``):
    ``recovery.ReplicaCrashed``             a replica's step failed, no node to blame
    ``recovery.NodeFaulted``                a node is known bad
    ``recovery.ReplicaFinished``            a replica finished training
    ``recovery.RestartRequested``           restart a replica in place, not a failure
    ``run_state.ReplicaProgressed``         a replica committed (also to ``versions``)

What ``decide`` feeds the code-version table (``versions.VersionEvent``), and what that
table answers (``versions.VersionAction``):
    ``versions.ReplicaLaunching``           a replica is about to be launched
    ``versions.ReplicaFailed``              a replica crashed or lost a node
    ``versions.ReplicaRetired``             recovery gave up on a replica
    ``versions.Tick``                       time passed (a forced window may end)
    ``versions.RunVersion``                 launch the replica with this version
    ``versions.RestartReplicaForUpdate``    restart the replica to adopt a version
    ``versions.RollBack``                   a version is bad: launch the older one

What the shell writes to ``controller.jsonl`` (``ft_launch.events.Event`` records;
``decide`` returns some among its actions):
    ``events.ReplicaLaunched``              a replica's step was launched, and how
    ``events.ReplicaExited``                a replica's step ended
    ``events.NodeFaultDetected``            a node was found bad, and why
    ``events.FailSlowDetected``             a replica is fail-slow
    ``events.LossSpiked``                   the loss spiked: rolled back or reported
    ``events.SdcReplayOrdered``             a replica was cancelled to be replayed
    ``events.SdcReplayReported``            a replay's verdict
    ``events.StandbyPromoted``              a standby node became a replica's
    ``events.NodeDrainRequested``           evicted, not drained: left to the Epilog
    ``events.FullRestartOrdered``           every replica restarts from the checkpoint
    ``events.ActionTaken``                  one action of a decision, and why
    ``events.ControllerWitnessChosen``      whether the controller votes as witness 0
    ``events.RunFinished``                  the run ended, with its exit code
    ``versions.CodeUpdateRequested``        a hot-update request, and what became of it
    ``versions.CodeVersionApplied``         a replica launched on a code version
    ``versions.CodeRolledBack``             a code version was rolled back
    ``diagnosis.HangDiagnosisReported``     a stalled replica's stacks, aggregated

Besides its own, the shell observes the workers' events (``worker.events``:
``WorkerStarted``, ``StepCommitted``, ``StepDiscarded``), the quorum's
(``quorum.events.MembersLivenessChanged``) and logs ``ft_launch.events.NodeDrained``.
"""
