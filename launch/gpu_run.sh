#!/usr/bin/env bash
# One device call: GPU tests, then the bench, logs under $OUT.
#   bash launch/gpu_run.sh            (on the GPU machine, from the repository root; OUT defaults to ./gpu-out)
set -u -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # docs/spec.md §8, children inherit
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export DETCOMM_CACHE_DIR=${DETCOMM_CACHE_DIR:-/tmp/detcomm-kernels}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
{
  date -u; nvidia-smi -L; $PY -c 'import torch, cupy; print("torch", torch.__version__, "cuda", torch.version.cuda, "cupy", cupy.__version__)'
} 2>&1 | tee "$OUT/env.log"

STAGES=${STAGES:-core,inprocess,bench,multiproc}
# 0. the core on CUDA: fold leaf vs oracle, one-rank NCCL, the workspace route through init/routing/self-checks,
#    the fold leaf's bandwidth, and the demo (NCCL when there is a GPU per rank)
if [[ $STAGES == *core* ]]; then
  timeout 420 $PY -m pytest -q -rs -p no:cacheprovider --timeout=400 tests/gpu/test_core_cuda.py tests/gpu/test_core_workspace.py \
    --junitxml="$OUT/junit_core.xml" 2>&1 | tee "$OUT/pytest_core.log"
  timeout 120 $PY -m detcomm.bench.fold_leaves --device cuda --rows 4096 --hidden 8192 --out "$OUT/fold_leaf.json" 2>&1 | tee "$OUT/fold_leaf.log"
  NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')
  timeout 180 $PY -m detcomm demo --nproc "$(( NGPU >= 2 ? NGPU : 4 ))" 2>&1 | tee "$OUT/demo.log"
fi
# 1. in-process W-stream tests + CPU host-logic tests (fast, most informative first)
[[ $STAGES == *inprocess* ]] && timeout 300 $PY -m pytest -q -rs -p no:cacheprovider --timeout=240 \
  tests/gpu/test_workspace_inprocess.py tests/gpu/test_workspace_failures.py tests/test_workspace_plan.py \
  --junitxml="$OUT/junit_inprocess.xml" 2>&1 | tee "$OUT/pytest_inprocess.log"
# 2. bench (fold bandwidth vs copy, in-process latency; the nccl mode runs only where >= 2 GPUs exist)
[[ $STAGES == *bench* ]] && timeout 200 $PY -m detcomm.bench.ipc_kernels --out "$OUT/bench" --modes "${BENCH_MODES:-fold,latency,nccl}" 2>&1 | tee "$OUT/bench.log"
# 3. W processes sharing one GPU (time-sliced: slow), and one GPU each where several GPUs exist
[[ $STAGES == *multiproc* ]] && timeout 240 $PY -m pytest -q -rs -p no:cacheprovider --timeout=200 tests/gpu/test_workspace_multiproc.py \
  --junitxml="$OUT/junit_multiproc.xml" 2>&1 | tee "$OUT/pytest_multiproc.log"
