#!/usr/bin/env bash
# CI: the collective and model probes at W=4 on CPU (gloo), through detcomm-launch under a real mpiexec (Open MPI
# from Debian packages + mpi4py from PyPI), each with its negative control (the native route must be caught
# changing bits / diverging). Installing Open MPI also makes pytest's MPI launcher tests run instead of skipping.
#
# What this script no longer runs, and where it runs instead (each was a second run of the same probe at the
# same W): the four probes under torchrun at W=4 are tests/test_probe_dist.py's (detcomm-launch's default
# launcher, W = 3 and 4, rl-bitwise and the native controls), with the README's main job and tour (the model
# probe and its native control at W=4, the probes' default sizes); TP-size invariance (virtual shards and full-K
# at W = 1, 2, 4, the fold layout's control, the W=1 trainer against a W=4 server) is tests/test_probe_tp.py's,
# the virtual shards at W = 1, 2, 4 again in the README's tour; the tree order's in tests/test_tree_probe.py.
#
#   PYTHON=/path/to/venv/bin/python .ci/probes.sh        # from the repository root
#
# Exits non-zero on the first probe that fails. Installs what is missing: needs root (or sudo) for apt-get.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
NPROC="${NPROC:-4}"
cd "$(dirname "$0")/.."

# shellcheck source=.ci/common.sh
. .ci/common.sh  # step, and the multicast-off variables of docs/spec.md §8

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
  echo ".ci/probes.sh: need root or sudo to run: $*" >&2; return 1; fi; }

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

L=("${LAUNCH[@]}" --nproc "$NPROC" --launcher mpi)
step "collective probe, rl-bitwise, mpi" "${L[@]}" --numerics rl-bitwise -m detcomm.probe collectives
step "collective probe, native negative control, mpi" "${L[@]}" --numerics auto -m detcomm.probe collectives --route native --expect-divergence
step "model probe, rl-bitwise, mpi" "${L[@]}" --numerics rl-bitwise -m detcomm.probe model
step "model probe, native negative control, mpi" "${L[@]}" --numerics auto -m detcomm.probe model --route native --expect-divergence
echo "=== all probes passed (W=$NPROC under mpiexec)"
