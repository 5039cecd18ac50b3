#!/usr/bin/env bash
# Fetch, on a machine that reaches PyPI, the wheels tests/gpu/run.sh installs on
# an offline GPU machine: the packages the tests need that the GPU image lacks
# (seen there: pyzmq; torch, numpy, pytest and the rest are in the image), and
# torchft for the benchmark's torchft arm. They
# go to ./.whl (ignored by git through .git/info/exclude); carry `.whl` to the
# GPU machine with the checkout.
#   bash tests/gpu/wheels.sh [PYTHON_VERSION]     # the GPU machine's, default 3.12
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
version=${1:-3.12}
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
download() {
  python3 -m pip download -q --only-binary=:all: --python-version "$version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}
download --no-deps 'pyzmq>=25'
# The benchmark's torchft arm, as benchmarks/hsdp/torchft_env.py pins it: torchft
# alone (its torch is the machine's), then what its import needs, with theirs.
read -r -a torchft < <(python3 -c 'from benchmarks.hsdp.torchft_env import IMPORT_DEPS, TORCHFT_VERSION
print(f"torchft=={TORCHFT_VERSION}", *IMPORT_DEPS)')
download --no-deps "${torchft[0]}"
download "${torchft[@]:1}"
ls -l .whl
