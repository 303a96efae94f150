#!/usr/bin/env bash
# torchrun across nodes: run this on every node, NODE_RANK 0..NNODES-1, the same RDZV_HOST:PORT everywhere
# (node 0's address). detcomm-launch sets the envelope's and the multicast-off variables on each node before
# torchrun starts its ranks; --nproc is the ranks per node. The group spans hosts, so the CUDA-IPC workspace does
# not arm, all-reduce sites take rs_ag_fold (above its break-even) or gather_fold, and the route table says so
# (docs/multinode.md; `detcomm routes --world-size $((NNODES * 8)) --nodes $NNODES` prints it in advance).
#
#   NNODES=2 NODE_RANK=0 RDZV_HOST=node0 bash launch/examples/multinode_torchrun.sh     # on node0
#   NNODES=2 NODE_RANK=1 RDZV_HOST=node0 bash launch/examples/multinode_torchrun.sh     # on node1
set -euo pipefail
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${RDZV_HOST:?set RDZV_HOST (node 0)}"
exec detcomm-launch --nproc "${NPROC_PER_NODE:-8}" --numerics rl-bitwise \
  --torchrun-args "--nnodes $NNODES --node-rank $NODE_RANK --rdzv-backend c10d --rdzv-endpoint $RDZV_HOST:${RDZV_PORT:-29500} --rdzv-id ${RDZV_ID:-detcomm}" \
  launch/examples/quickstart.py "$@"
