"""Node health checks (GPU via NVML, host, network), inspection agent, anomaly
detection, stack-trace aggregation, dual-phase replay. Never imports torch at module
level: the Slurm plugins import it."""
