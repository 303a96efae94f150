#!/usr/bin/env bash
# CI: the collective and model probes at W=4 on CPU (gloo), through detcomm-launch, once under torchrun and
# once under a real mpiexec (Open MPI from Debian packages + mpi4py from PyPI), each with its negative
# control (the native route must be caught changing bits / diverging); then TP-size invariance (W = 1, 2, 4 in the
# virtual-shard layout and the full-K layout, the fold layout as negative control) and the trainer alignment
# probe. The tree order's same runs (W = 1, 2, 4, tp-compare, align) are tests/test_tree_probe.py's.
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

for backend in torchrun mpi; do
  L=("${LAUNCH[@]}" --nproc "$NPROC" --launcher "$backend")
  step "collective probe, rl-bitwise, $backend" "${L[@]}" --numerics rl-bitwise -m detcomm.probe collectives
  step "collective probe, native negative control, $backend" "${L[@]}" --numerics auto -m detcomm.probe collectives --route native --expect-divergence
  step "model probe, rl-bitwise, $backend" "${L[@]}" --numerics rl-bitwise -m detcomm.probe model
  step "model probe, native negative control, $backend" "${L[@]}" --numerics auto -m detcomm.probe model --route native --expect-divergence
done

# TP-size invariance (docs/spec.md "TP-size invariance: layouts"): the same requests at W = 1, 2, 4 give the
# same token ids and logprob bits in each invariant layout; the plain fold layout must differ across W. Then a
# trainer at W=1 (detcomm torch.distributed backend, teacher forcing) must reproduce a W=4 server's
# sampling-time logprobs bit for bit, and must not in the fold layout.
TP_DIR="$(mktemp -d)"
TP_ARGS=(--requests 4 --new-tokens 6 --max-prompt 12)
for layout in vs fk fold; do
  case "$layout" in vs) FLAGS=(--virtual-shards 8) ;;
    fk) FLAGS=(--full-k) ;; fold) FLAGS=() ;; esac
  widths=(1 2 4); [ "$layout" = fold ] && widths=(1 4)  # the negative control needs one pair of widths
  for w in "${widths[@]}"; do
    step "model probe, layout $layout, W=$w" "${LAUNCH[@]}" --nproc "$w" --numerics rl-bitwise -m detcomm.probe model \
      "${TP_ARGS[@]}" ${FLAGS[@]+"${FLAGS[@]}"} --json "$TP_DIR/$layout$w.json"
  done
done
step "tp-compare, virtual shards V=8, W=1,2,4" "$PYTHON" -m detcomm.probe tp-compare "$TP_DIR"/vs{1,2,4}.json
step "tp-compare, full-K, W=1,2,4" "$PYTHON" -m detcomm.probe tp-compare "$TP_DIR"/fk{1,2,4}.json
step "tp-compare, fold negative control, W=1,4" "$PYTHON" -m detcomm.probe tp-compare "$TP_DIR"/fold{1,4}.json --expect-divergence
step "align serve, virtual shards, W=4" "${LAUNCH[@]}" --nproc 4 --numerics rl-bitwise -m detcomm.probe align serve \
  --virtual-shards 8 "${TP_ARGS[@]}" --out "$TP_DIR/serve_vs.json"
step "align train, virtual shards, W=1" "${LAUNCH[@]}" --nproc 1 --numerics rl-bitwise -m detcomm.probe align train \
  --server "$TP_DIR/serve_vs.json"
step "align serve, fold, W=4" "${LAUNCH[@]}" --nproc 4 --numerics rl-bitwise -m detcomm.probe align serve \
  "${TP_ARGS[@]}" --out "$TP_DIR/serve_fold.json"
step "align train, fold negative control, W=1" "${LAUNCH[@]}" --nproc 1 --numerics rl-bitwise -m detcomm.probe align \
  train --server "$TP_DIR/serve_fold.json" --expect-fail
rm -rf "$TP_DIR"
echo "=== all probes passed (W=$NPROC, torchrun and mpi; TP-size invariance at W=1,2,4)"
