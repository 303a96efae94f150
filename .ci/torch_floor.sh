#!/usr/bin/env bash
# CI's second job (issue 40 item 10): the package on the oldest torch pyproject.toml admits (TORCH_FLOOR in
# detcomm/_torch_version.py), in a venv of its own, running the backend, trainer and core tests, so the declared
# range `torch>=2.11` is tested at its floor as .ci/run's main job tests 2.13. Budget: 8 minutes of tests on 2
# cores, plus the install.
#
# Which torch build: the CPU build where an index has it ($FLOOR_TORCH_INDEX_URL, e.g.
# https://download.pytorch.org/whl/cpu, about 200 MB). Without one (a machine that reaches PyPI only, as this
# project's CI machine does), PyPI's Linux x86_64 wheel, a CUDA 13 build whose nvidia-* packages pip pulls too:
# measured there 2.6 GB, 112 s to download and 56 s to install alone, 391 s for the whole venv step on the loaded
# 2-core machine; it imports and runs on a machine without a GPU. The tests: 116 in 259 s there (the whole job
# 11 min on the loaded machine, about 7 on an idle one).
#
#   .ci/torch_floor.sh [venv|test]   (both when no argument): .ci/run builds the venv in the background while its
#                                    CPU-bound steps run (the install is mostly download), then runs the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/common.sh
. .ci/common.sh  # step, and the multicast-off variables of docs/spec.md §8
export PIP_DISABLE_PIP_VERSION_CHECK=1

FLOOR="$(python3 -c 'import sys; sys.path.insert(0, "detcomm"); import _torch_version as v; print(".".join(map(str, v.TORCH_FLOOR)))')"
FLOOR_TORCH_VERSION="${FLOOR_TORCH_VERSION:-$FLOOR.0}"
VENV="${FLOOR_VENV:-.venv-torch-floor}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/detcomm-floor.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
# The pin keeps the package's own install (and its extras' dependencies) from moving torch off the floor.
echo "torch==$FLOOR_TORCH_VERSION" > "$tmp/constraints.txt"

# Both installs under this pin, never the caller's: .ci/run exports PIP_CONSTRAINT=torch==2.13.0 for its own venvs,
# which would make `pip install torch==2.11.0` unresolvable.
export PIP_CONSTRAINT="$tmp/constraints.txt"
what="${1:-all}"
case "$what" in all|venv|test) ;; *) echo "usage: $0 [venv|test]" >&2; exit 2 ;; esac

if [ "$what" != test ]; then
  rm -rf "$VENV"
  step "venv with torch $FLOOR_TORCH_VERSION (the floor) and the package's test extra" bash -c '
    python3 -m venv "$0" &&
    if [ -n "${FLOOR_TORCH_INDEX_URL:-}" ]; then
      "$0"/bin/pip install -q "torch==$1" --index-url "$FLOOR_TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple
    else
      "$0"/bin/pip install -q "torch==$1"
    fi &&
    "$0"/bin/pip install -q -e ".[test]"' "$VENV" "$FLOOR_TORCH_VERSION"
  step "torch in $VENV is the floor" "$VENV/bin/python" -c "
import torch, detcomm.dist_backend
assert torch.__version__.startswith('$FLOOR_TORCH_VERSION'), torch.__version__
print('torch', torch.__version__)"
fi
[ "$what" = venv ] && exit 0

# The backend (test_premul_sum_folds among them: PREMUL_SUM's factor on a torch without ReduceOp.factor), the
# trainers on it (DDP, FSDP2, TP), and the core fold and collectives.
step "backend, trainer and core tests on torch $FLOOR_TORCH_VERSION" timeout 600 "$VENV/bin/python" -m pytest -q \
  -p no:cacheprovider \
  tests/test_dist_backend.py tests/test_dist_backend_calls.py \
  tests/test_trainer_dp.py tests/test_trainer_tp.py \
  tests/test_fold_local.py tests/test_collectives_dist.py
