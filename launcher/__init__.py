"""ft-launch: the srun wrapper that splits an allocation into replicas and standby
nodes, launches one job step per replica and keeps training going through faults.

Never imports torch: it runs in the batch script and must start fast."""
