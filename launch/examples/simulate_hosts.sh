#!/usr/bin/env bash
# Two hosts simulated on one machine: DETCOMM_HOSTS names every global rank's host (docs/multinode.md), so W = 4
# local ranks form a group on hosts a and b. The workspace does not arm ("ranks on several hosts"), and the
# quickstart's o_proj site (bf16 4096 x 2048 rows = 16 MiB) takes rs_ag_fold with the network's break-even;
# compare the printed table with the static one:
#   detcomm routes --backend gloo --world-size 4 --nodes 2 --site layers.o_proj:all_reduce:bf16:4096:2048
set -euo pipefail
export DETCOMM_HOSTS=a,a,b,b
exec detcomm-launch --nproc 4 --numerics rl-bitwise launch/examples/quickstart.py "$@"
