"""Parts of ``benchmarks/hsdp_bench.py``: the pure core (``core``: arms, schedule,
summary, the ft-launch command), the thin shell that runs one arm (``arms``), the
workers of arms (a) and (d) (``native_worker``, ``torchft_worker``, sharing
``replica_train``), and torchft's environment and lighthouse (``torchft_env``,
``torchft_lighthouse``). Arms (b)/(c) run the product's own example through
``LocalJob``; their wire bytes come from each rank's ``WorkerStopped`` event."""
