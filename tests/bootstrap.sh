#!/usr/bin/env bash
# Install everything ft-launch's tests and demo need on a fresh Debian 12/13 machine
# (as root). Idempotent: what is already there is not installed again.
#   tests/bootstrap.sh          the tests: Slurm, munge, torch, MPICH + mpi4py, the project
#   tests/bootstrap.sh --demo   only what etc/demo.sh runs (no MPI: building mpi4py
#                               is most of a fresh install, and only the MPI benchmark
#                               and its tests use it)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
demo_only=false
case "${1:-}" in
  --demo) demo_only=true ;;
  "") ;;
  *) echo "usage: $0 [--demo]" >&2; exit 2 ;;
esac

APT_PACKAGES=(slurmctld slurmd slurm-client munge iproute2 util-linux procps)
# debootstrap: the lab cluster of another Slurm release runs from a Debian root
# (tests/cluster/debroot.py; .ci/run tests 24.11 that way)
$demo_only || APT_PACKAGES+=(mpich libmpich-dev debootstrap)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
export PIP_ROOT_USER_ACTION=ignore
PY=${PYTHON:-python3}
# torch: the CPU build from the local file (any other spec downloads gigabytes).
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
if $demo_only; then
  "$PY" -m pip install -q -e '.[plot]'
else
  # mpi4py's wheel does not load against Debian's MPICH: build it against libmpich-dev.
  "$PY" -c "from mpi4py import MPI" 2>/dev/null \
    || "$PY" -m pip install -q --no-binary mpi4py mpi4py
  "$PY" -m pip install -q -e '.[test,plot]'
fi
echo "bootstrap: ok ($("$PY" --version), $(slurmctld -V))"
