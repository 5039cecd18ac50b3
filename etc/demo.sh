#!/usr/bin/env bash
# The main job: fault-tolerant training on a local 6-node Slurm cluster (network
# namespaces on this machine), with a replica's node killed mid-run and recovered
# live (eviction, warm standby promotion, catch-up), then the run summary.
# --fault hang|sdc|slow: one rank deadlocks, computes NaN gradients, or the node is
# throttled instead; each is found, named, drained and replaced. --fault spike: the
# loss spikes everywhere; every replica is rolled back to before it.
# Run as root. Installs what is missing (only what the demo needs: the tests'
# bootstrap adds the rest); leaves the cluster up
# ('tests/cluster/slurm-cluster down' removes it).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
bash tests/bootstrap.sh --demo
tests/cluster/slurm-cluster up
exec python3 etc/demo.py "$@"
