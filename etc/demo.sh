#!/usr/bin/env bash
# The main job on a local Slurm cluster: install what is missing, bring up a
# 6-node cluster (network namespaces on this machine), submit the job, show it.
# Run as root. Leaves the cluster up; 'tests/cluster/slurm-cluster down' removes it.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
bash tests/bootstrap.sh
tests/cluster/slurm-cluster up
out=$(mktemp -d)
cluster() { tests/cluster/slurm-cluster exec -- "$@"; }
job=$(cluster sbatch --parsable --chdir="$out" --output="$out/job.out" etc/examples/smoke.sbatch)
echo "submitted job $job; output in $out/job.out"
for _ in $(seq 1 600); do
  state=$(cluster squeue -h -j "$job" -o %T 2>/dev/null || true)
  [ -z "$state" ] && break
  sleep 0.2
done
cat "$out/job.out"
cluster scontrol show job "$job" | grep -o 'JobState=[A-Z_]*'
