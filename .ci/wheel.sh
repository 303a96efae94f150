#!/usr/bin/env bash
# CI: the wheel alone works. Builds the wheel from the tracked files, installs it (with the bench extra) into a
# fresh venv outside the checkout and, from a directory outside the checkout, runs the model probe at W=4 under
# detcomm-launch and `detcomm-bench --quick`. Nothing here can import the source tree by accident: PYTHONPATH is
# cleared and the check below fails unless detcomm is imported from the venv's site-packages.
#
#   PYTHON=/path/to/venv/bin/python .ci/wheel.sh       # PYTHON: an environment with `build` and setuptools
#
# torch comes first, from $TORCH_INDEX_URL (default: PyTorch's CPU index), as the README installs it.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
cd "$(dirname "$0")/.."
REPO="$PWD"

# shellcheck source=.ci/common.sh
. .ci/common.sh  # step, and the multicast-off variables of docs/spec.md §8
unset PYTHONPATH

WORK="$(mktemp -d "${TMPDIR:-/tmp}/detcomm-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# A copy of the tracked files, so that no build/ or egg-info left in the checkout by an earlier build or an
# editable install can add files to the wheel.
copy_tracked() {
  mkdir -p "$WORK/src"
  if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -C "$REPO" ls-files -z | tar -C "$REPO" --null -T - -cf - | tar -C "$WORK/src" -xf -
  else
    tar -C "$REPO" --exclude=.venv --exclude=build --exclude='*.egg-info' -cf - . | tar -C "$WORK/src" -xf -
  fi
}
step "copy the tracked files" copy_tracked
build_wheel() {  # setuptools' file-by-file log only when the build fails
  "$PYTHON" -m build --wheel --no-isolation --outdir "$WORK/dist" "$WORK/src" > "$WORK/build.log" 2>&1 ||
    { cat "$WORK/build.log"; return 1; }
}
step "build the wheel" build_wheel
WHEEL="$(ls "$WORK"/dist/detcomm-*.whl)"

# The wheel holds one top-level package (detcomm), the kernel sources as detcomm/csrc, and py.typed.
step "check the wheel's contents" "$PYTHON" - "$WHEEL" <<'EOF'
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
top = sorted({n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))})
problems = []
if top != ["detcomm"]:
    problems.append(f"top-level entries {top}, expected ['detcomm']")
for need in ("detcomm/py.typed", "detcomm/csrc/one_shot.cu", "detcomm/csrc/detcomm_common.cuh"):
    if need not in names:
        problems.append(f"missing {need}")
if problems:
    sys.exit("wheel: " + "; ".join(problems))
print(f"{len(names)} files, top level {top}")
EOF

VENV="$WORK/venv"
step "fresh venv" python3 -m venv "$VENV"
step "torch from $TORCH_INDEX_URL" "$VENV/bin/pip" install -q torch --index-url "$TORCH_INDEX_URL"
step "install the wheel with the bench extra" "$VENV/bin/pip" install -q "$WHEEL[bench]"

mkdir -p "$WORK/run"
cd "$WORK/run"
step "detcomm imported from the installed wheel" "$VENV/bin/python" - "$VENV" "$REPO" <<'EOF'
import importlib.resources
import os
import sys

import detcomm

venv, repo = (os.path.realpath(p) for p in sys.argv[1:3])
where = os.path.realpath(detcomm.__file__)
if not where.startswith(venv + os.sep) or where.startswith(repo + os.sep):
    sys.exit(f"detcomm imported from {where}, not from the venv {venv}")
kernels = importlib.resources.files("detcomm.csrc")
assert kernels.joinpath("one_shot.cu").is_file(), "the kernel sources are not reachable through importlib.resources"
# Every kernel file and every header it includes, as the GPU run-time compile will read them from the wheel.
from detcomm.workspace import kernels as runtime_kernels

source = runtime_kernels.flatten_source()
missing = [f for f in runtime_kernels.KERNEL_FILES if f"// ---- {f}" not in source]
assert not missing, f"kernel files missing from the flattened source: {missing}"
print(f"detcomm {detcomm.__version__} from {os.path.dirname(where)}; {len(source.splitlines())} kernel source lines")
EOF
step "model probe at W=4 (rl-bitwise) from the wheel" \
  "$VENV/bin/detcomm-launch" --nproc 4 --numerics rl-bitwise -m detcomm.probe model
step "detcomm-bench --quick from the wheel" "$VENV/bin/detcomm-bench" --quick --out "$WORK/run/bench"
echo "=== the wheel works on its own"
