"""A stand-in replica task for Slurm tests: records where it ran, optionally waits
for a release file (bounded), then records that it finished."""

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

from ft_launch.files import atomic_write_text

parser = argparse.ArgumentParser()
parser.add_argument("outdir", type=Path)
parser.add_argument("--wait-for", type=Path)
parser.add_argument("--timeout", type=float, default=120)
args = parser.parse_args()

replica = os.environ.get("FTL_WORKER_REPLICA_ID", "?")
rank = os.environ.get("SLURM_PROCID", "0")
record = {"replica": replica, "rank": rank, "host": socket.gethostname(),
          "job": os.environ.get("SLURM_JOB_ID"), "step": os.environ.get("SLURM_STEP_ID"),
          "pid": os.getpid()}
tag = f"replica-{replica}-rank-{rank}"
# whole records only: the test polls the directory while they are written
atomic_write_text(args.outdir / f"{tag}.started", json.dumps(record), durable=False)
if args.wait_for is not None:
    deadline = time.monotonic() + args.timeout
    while not args.wait_for.exists():
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)
atomic_write_text(args.outdir / f"{tag}.finished", json.dumps(record), durable=False)
