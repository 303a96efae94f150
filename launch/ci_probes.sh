#!/usr/bin/env bash
# CI: the collective and model probes at W=4 on CPU (gloo), through detcomm-launch, once under torchrun and
# once under a real mpiexec (Open MPI from Debian packages + mpi4py from PyPI), each with its negative
# control (the native route must be caught changing bits / diverging).
#
#   PYTHON=/path/to/venv/bin/python launch/ci_probes.sh        # from the repository root
#
# Exits non-zero on the first probe that fails. Installs what is missing: needs root (or sudo) for apt-get.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
NPROC="${NPROC:-4}"
cd "$(dirname "$0")/.."

# shellcheck source=launch/ci_common.sh
. launch/ci_common.sh  # step, and the multicast-off variables of docs/spec.md §8

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
  echo "ci_probes.sh: need root or sudo to run: $*" >&2; return 1; fi; }

if ! command -v mpiexec >/dev/null; then
  as_root apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin libopenmpi-dev
fi
if ! "$PYTHON" -c "import mpi4py" 2>/dev/null; then
  "$PYTHON" -m pip install -q mpi4py
fi
# Open MPI refuses to start as root without both of these (CI containers run as root).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

if command -v detcomm-launch >/dev/null; then LAUNCH=(detcomm-launch); else LAUNCH=("$PYTHON" -m detcomm.launch); fi

for backend in torchrun mpi; do
  L=("${LAUNCH[@]}" --nproc "$NPROC" --launcher "$backend")
  step "collective probe, rl-bitwise, $backend" "${L[@]}" --numerics rl-bitwise -m detcomm.probe collectives
  step "collective probe, native negative control, $backend" "${L[@]}" --numerics auto -m detcomm.probe collectives --route native --expect-divergence
  step "model probe, rl-bitwise, $backend" "${L[@]}" --numerics rl-bitwise -m detcomm.probe model
  step "model probe, native negative control, $backend" "${L[@]}" --numerics auto -m detcomm.probe model --route native --expect-divergence
done
echo "=== all probes passed (W=$NPROC, torchrun and mpi)"
