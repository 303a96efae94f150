#!/usr/bin/env bash
# Plain torchrun, without detcomm-launch: export what the launcher would have set, then start the ranks.
# Single node, 4 ranks (GPUs when present, gloo on CPU otherwise), the model probe under rl-bitwise.
# Multi-node: replace --standalone with --nnodes N --node-rank I --rdzv-backend c10d --rdzv-endpoint HOST:PORT.
set -euo pipefail
# NCCL reads these when a communicator is created: they must exist before any rank starts. They include docs/spec.md
# §8's multicast-off variables (envelope_environment sets them whatever the envelope, unless allow_multicast).
eval "$(python -c 'import detcomm; print("\n".join(f"export {k}={v}" for k, v in detcomm.envelope_environment("rl-bitwise").items()))')"
# Each line tagged [rankN]: by global rank (torchrun's default tag is the role and the local rank).
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:'
exec python -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-4}" --tee 3 \
  -m detcomm.probe model "$@"
