"""The environment variables of ft-launch: one namespace, ``FTL_``.

* ``FTL_<SECTION>_<KEY>``: a config value (``ft_launch.config``), ``FTL_CONFIG`` the file;
* ``FTL_WORKER_<NAME>``: what ft-launch tells a process it starts about itself (its
  job, replica, rank, run directory, secret, ...). Set by ft-launch, not config: the
  config loader leaves them alone.
"""

from __future__ import annotations

ENV_PREFIX = "FTL_"
ENV_CONFIG = "FTL_CONFIG"
WORKER_PREFIX = "FTL_WORKER_"

ENV_JOB_ID = WORKER_PREFIX + "JOB_ID"
ENV_REPLICA_ID = WORKER_PREFIX + "REPLICA_ID"
ENV_NUM_REPLICAS = WORKER_PREFIX + "NUM_REPLICAS"
ENV_RUN_DIR = WORKER_PREFIX + "RUN_DIR"
ENV_SECRET = WORKER_PREFIX + "SECRET"
ENV_HOST = WORKER_PREFIX + "HOST"
ENV_RANK = WORKER_PREFIX + "RANK"                  # this task's rank in its replica
ENV_RANKS = WORKER_PREFIX + "RANKS"
ENV_INCARNATION = WORKER_PREFIX + "INCARNATION"    # tells apart relaunches of a replica
ENV_HEARTBEAT = WORKER_PREFIX + "HEARTBEAT"        # the controller's heartbeat file
ENV_INJECT = WORKER_PREFIX + "INJECT"              # faults to inject (drills, tests)
ENV_OBSERVER = WORKER_PREFIX + "OBSERVER"          # a step observer to load (worker.observer)
ENV_KILL_AFTER = WORKER_PREFIX + "KILL_AFTER"      # ft-launch local --kill: die after this step
ENV_ROLLBACKS = WORKER_PREFIX + "ROLLBACKS"        # the run's rollbacks so far (spike steps)
ENV_REPLAY = WORKER_PREFIX + "REPLAY"              # replay one step (the spec file), no training
ENV_REPLAY_GROUP = WORKER_PREFIX + "REPLAY_GROUP"  # a replay job's group (row2, col0)
ENV_REPLAY_NODES = WORKER_PREFIX + "REPLAY_NODES"  # and its nodes, comma-separated
