"""ft-launch: the srun wrapper that splits an allocation into replicas and standby
nodes, launches one job step per replica and keeps training going through faults.

* ``cli``: the ``ft-launch`` command line
* ``controller/``: ``ft-launch run``'s decision and the shell that carries it out
  (its docstring indexes its events and actions)
* ``worker/``: the runtime inside each training process (its docstring names the
  worker contract, what the controller reads of it)
* ``quorum/``: the replicas' ZeroMQ quorum
* ``reporting/``: status, live view, timeline, summary, ETTR model, plots
* ``heartbeat``: the controller's heartbeat file and the workers' watch on it, the
  one module both sides import

Never imports torch (only ``worker``'s torch front end does): the controller runs in
the batch script and must start fast."""
