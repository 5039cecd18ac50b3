"""The detection library that ``benchmarks/detection_bench.py`` measures on loopback (its
library half): ``reporter`` (each rank's metrics and heartbeat), ``monitor`` (what is
wrong, from what the ranks report) and ``tracer`` (stack captures, what to evict).

Not the product's path, and so not in ``ft_launch``: ``ft-launch run`` detects through
its controller (``ft_launch.launcher.controller``: stalls, exits, quorum reports, hang
diagnosis); these modules share only ``ft_launch.health``'s parts (wire, channel,
anomaly, aggregation, stacks). tests/health tests them.
"""
