#!/usr/bin/env bash
# The GPU tier, in one run on a lent GPU machine (fresh, maybe offline), from the
# repository root:   bash tests/gpu/run.sh
#
# Parts, each under its own time limit; a failing part does not stop the next:
#   install  python packages the tests need that are missing (torch only if it
#            does not import: a machine's own CUDA build is kept as it is)
#   env      nvidia-smi, python / torch / CUDA / NCCL versions
#   tests    python3 -m pytest -m gpu tests/
#   bench    benchmarks/hsdp_bench.py --quick, where that file exists (its torchft
#            arm installs torchft from ./.whl when the machine is offline)
# Everything is written under ${OUT:-/tmp/ftl-gpu} (at most 8 files). Exits
# non-zero if any part failed; a summary is printed last.
#
# tests/bootstrap.sh is not used: it installs Slurm, munge and MPICH with apt,
# which this tier does not need and an offline machine cannot fetch. Nor is
# `pip install -e '.[test]'`: its torch==2.13.0 pin would replace the machine's
# CUDA torch (or fail offline). The package is laid out as pip would install it
# instead, as links into the checkout (installed_layout below), and put on PYTHONPATH.
# Offline, missing wheels are taken from ./.whl when it is there (see
# tests/gpu/wheels.sh, run beforehand on a machine that reaches PyPI).
# The parts run as `bash -c NAME` (under timeout), which shellcheck cannot follow.
# shellcheck disable=SC2317
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.." || exit 1

OUT=${OUT:-/tmp/ftl-gpu}
export OUT
mkdir -p "$OUT"
PY=python3
export PY PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

# installed_layout DIR: ft_launch as an install lays it out (pyproject's package-dir:
# ftcore/ is ft_launch, launcher/ is ft_launch.launcher, ...), made of links to the
# checkout's files, so the tests run this tree's code without pip.
installed_layout() {
  "$PY" - "$1" <<'EOF'
import sys, tomllib
from pathlib import Path
tree = Path(sys.argv[1])
folders = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
for package, folder in sorted(folders.items()):        # a package before its subpackages
    target = tree.joinpath(*package.split("."))
    target.mkdir(parents=True)
    for entry in Path(folder).resolve().iterdir():
        if entry.name != "__pycache__" and not target.joinpath(entry.name).exists():
            target.joinpath(entry.name).symlink_to(entry)
EOF
}
layout=$(mktemp -d)
installed_layout "$layout" || { echo "could not lay out the ft_launch package"; exit 1; }
export PYTHONPATH="$layout:$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Seconds each part may take at most, and all of them together (well under 9
# minutes): a part gets what is left of TOTAL_LIMIT when that is less.
INSTALL_LIMIT=60
ENV_LIMIT=20
TESTS_LIMIT=240
BENCH_LIMIT=240       # --quick is about 3 minutes
TOTAL_LIMIT=480

summary=()
failed=0

# run_part NAME LIMIT LOG COMMAND...: run COMMAND under `timeout` (which signals
# its whole process group, so spawned members and replicas end with it), its
# output into $OUT/LOG, then the log's tail here.
run_part() {
  local name=$1 limit=$2 log=$3
  shift 3
  local started=$SECONDS rc status left=$((TOTAL_LIMIT - SECONDS))
  if [ "$left" -lt 10 ]; then
    summary+=("$(printf '%-8s %-28s' "$name" 'NOT RUN (no time left)')")
    failed=1
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $name (limit ${limit} s, log $OUT/$log)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$log" 2>&1
  rc=$?
  tail -n 25 "$OUT/$log"
  case $rc in
    0) status="ok" ;;
    124|137) status="TIMED OUT after ${limit} s"; failed=1 ;;
    *) status="FAILED (exit $rc)"; failed=1 ;;
  esac
  summary+=("$(printf '%-8s %-28s %4d s' "$name" "$status" $((SECONDS - started)))")
}

install_missing() {
  local missing
  if ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "torch does not import: installing it (PyPI's Linux wheel is a CUDA build)"
    pip_install torch || return 1
  fi
  "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda,
           "available:", torch.cuda.is_available())' || return 1
  # pyproject's dependencies and test extra, but torch (above) and py-spy (not
  # used by this tier), each as: import name=pip requirement
  missing=$("$PY" - <<'EOF'
import importlib.util
need = {"zmq": "pyzmq>=25", "numpy": "numpy>=1.24", "h5py": "h5py>=3.8",
        "pynvml": "nvidia-ml-py>=12", "psutil": "psutil>=5.9", "pytest": "pytest>=8",
        "pytest_timeout": "pytest-timeout>=2.2", "hypothesis": "hypothesis>=6.100"}
print(" ".join(req for name, req in need.items() if importlib.util.find_spec(name) is None))
EOF
  )
  if [ -z "$missing" ]; then
    echo "every python package the tests need is there"
    return 0
  fi
  echo "missing: $missing"
  # shellcheck disable=SC2086  # one word per requirement
  pip_install $missing
}

pip_install() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --find-links .whl "$@"
  else
    "$PY" -m pip install -q --retries 1 --timeout 15 "$@"
  fi
}

show_env() {
  local ok=0
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv
  else
    echo "nvidia-smi: not on PATH"
    ok=1
  fi
  "$PY" - <<'EOF' || ok=1
import platform, sys
print("python", platform.python_version(), sys.executable)
import numpy, torch
print("numpy", numpy.__version__)
print("torch", torch.__version__, "built for CUDA", torch.version.cuda)
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device")
print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0),
      "count", torch.cuda.device_count())
print("cudnn", torch.backends.cudnn.version(), "nccl", ".".join(map(str, torch.cuda.nccl.version())))
try:
    import zmq
    print("pyzmq", zmq.__version__)
except ImportError:
    print("pyzmq: missing (the worker runtime needs it)")
EOF
  return "$ok"
}

run_tests() {
  # --continue-on-collection-errors: a module that cannot be imported here (a
  # missing package of another tier) must not stop the GPU tests from running.
  "$PY" -m pytest -q -m gpu tests/ --continue-on-collection-errors \
    --basetemp=/tmp/ftl-gpu-pytest --junitxml="$OUT/gpu-tests.xml" -p no:cacheprovider
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest ran no test marked gpu"
  fi
  return "$rc"
}

export -f install_missing pip_install show_env run_tests

run_part install "$INSTALL_LIMIT" install.log bash -c install_missing
run_part env "$ENV_LIMIT" env.txt bash -c show_env
run_part tests "$TESTS_LIMIT" gpu-tests.log bash -c run_tests
if [ -f benchmarks/hsdp_bench.py ]; then
  # The bench makes torchft's venv with pip: offline, from the same wheels.
  if compgen -G ".whl/torchft-*.whl" >/dev/null; then
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.whl"
  fi
  run_part bench "$BENCH_LIMIT" hsdp_bench.log \
    "$PY" benchmarks/hsdp_bench.py --quick --json "$OUT/hsdp_bench.json"
else
  summary+=("$(printf '%-8s %-28s' bench 'skipped (no benchmarks/hsdp_bench.py)')")
fi

{
  echo "=== GPU tier summary ($(date -u +%FT%TZ), outputs in $OUT)"
  printf '%s\n' "${summary[@]}"
  tests_line=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/gpu-tests.log" 2>/dev/null | tail -n 1)
  echo "pytest: ${tests_line:-no result line}"
  if [ $failed -ne 0 ]; then echo "RESULT: FAILED"; else echo "RESULT: ok"; fi
} | tee "$OUT/summary.txt"
exit $failed
