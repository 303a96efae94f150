#!/usr/bin/env bash
# CI: the HF probe (a transformers model sharded over detcomm) at W=4 on CPU (gloo) through detcomm-launch:
# a tiny real config in fp32 under rl-bitwise (every row 0, PASS), and the native negative control (must
# diverge); then an MoE config with its experts spread over the ranks (two placements compared, and the rank-order
# combine as the negative control); then a 2-KV-head model at W=4 (KV heads replicated), loaded sliced, and its
# native control. Needs the hf extra (transformers, safetensors, accelerate); installs it when missing.
# qwen3-tiny in bf16 at W=4 under rl-bitwise is tests/test_hf_probe.py's (this script ran the same probe too).
#
#   PYTHON=/path/to/venv/bin/python .ci/hf.sh        # from the repository root
set -euo pipefail

PYTHON="${PYTHON:-python3}"
NPROC="${NPROC:-4}"
cd "$(dirname "$0")/.."

# shellcheck source=.ci/multicast_off.sh
. .ci/multicast_off.sh  # docs/spec.md §8, this script's own children included

if ! "$PYTHON" -c "import transformers, safetensors, accelerate" 2>/dev/null; then
  "$PYTHON" -m pip install -q -e '.[hf]'
fi
if command -v detcomm-launch >/dev/null; then LAUNCH=(detcomm-launch); else LAUNCH=("$PYTHON" -m detcomm.launch); fi
L=("${LAUNCH[@]}" --nproc "$NPROC")

run() {  # run <description> <command...>: show it, time it, stop on failure
  local what="$1"; shift
  echo "=== $what: $*"
  local t0=$SECONDS
  if ! "$@"; then echo "=== FAILED: $what" >&2; exit 1; fi
  echo "=== ok: $what ($((SECONDS - t0)) s)"
}

run "HF probe, llama-tiny fp32, rl-bitwise" "${L[@]}" --numerics rl-bitwise -m detcomm.probe hf --config llama-tiny --dtype float32 --requests 6 --new-tokens 6
run "HF probe, native negative control" "${L[@]}" --numerics auto -m detcomm.probe hf --config llama-tiny --route native --expect-divergence --requests 6 --new-tokens 6
# MoE (qwen3-moe-tiny: 8 experts, top-4, renormalized) with the experts spread over the ranks: two random
# placements (replicas allowed) must each pass and give identical token ids and logprob bits; the engines'
# rank-order combine (numerics auto, sum sites forced onto the fold so only the combine differs) must diverge.
MOE=(--config qwen3-moe-tiny --ep --requests 4 --new-tokens 4 --max-prompt 12 --expert-block 16)
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
run "HF MoE probe, placement seed 1, rl-bitwise" "${L[@]}" --numerics rl-bitwise -m detcomm.probe hf "${MOE[@]}" --placement-seed 1 --json "$TMP/p1.json"
run "HF MoE probe, placement seed 2, rl-bitwise" "${L[@]}" --numerics rl-bitwise -m detcomm.probe hf "${MOE[@]}" --placement-seed 2 --json "$TMP/p2.json"
run "HF MoE probe, placement seeds 1 and 2 give identical bits" "$PYTHON" -m detcomm.probe hf --compare "$TMP/p1.json" "$TMP/p2.json"
run "HF MoE probe, rank-order combine negative control" "${L[@]}" --numerics auto -m detcomm.probe hf "${MOE[@]}" --placement-seed 1 --combine-order rank --route gather_fold --expect-divergence
# Grouped-query attention with fewer KV heads than ranks (qwen3-kv2-tiny: 4 heads over 2 KV heads, each KV head
# replicated over 2 ranks at W=4), loaded sliced (each rank reads its slices of the safetensors file): bitwise, and
# the native negative control. The MoE variant (qwen2-moe-kv2-tiny) runs in tests/test_hf_probe.py.
KV2=(--config qwen3-kv2-tiny --dtype bfloat16 --requests 4 --new-tokens 4 --max-prompt 12)
run "HF probe, 2 KV heads replicated, sliced load, rl-bitwise" "${L[@]}" --numerics rl-bitwise -m detcomm.probe hf "${KV2[@]}"
run "HF probe, 2 KV heads replicated, native negative control" "${L[@]}" --numerics auto -m detcomm.probe hf "${KV2[@]}" --route native --expect-divergence
echo "=== HF probes passed (W=$NPROC)"
