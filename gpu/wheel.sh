#!/usr/bin/env bash
# One device call that tests what users install: the wheel built on the CPU machine (python -m build --wheel),
# carried to the GPU machine in $WHEEL_DIR, installed OUTSIDE the checkout, and every check run from there:
# init(numerics="rl-bitwise") on the GPUs, the GPU tests (tests/ copied out of the tree, importing the installed
# package), the model probe and a short bench (bench/hf_decode.py from the checkout). Logs and results under $OUT.
#   WHEEL_DIR=.xfer/wheel OUT=./gpu-out bash gpu/wheel.sh      (from the repository root)
set -u -o pipefail
# shellcheck source=.ci/multicast_off.sh
. .ci/multicast_off.sh  # docs/spec.md §8, children inherit
export PYTHONUNBUFFERED=1
export DETCOMM_CACHE_DIR=${DETCOMM_CACHE_DIR:-/tmp/detcomm-kernels}
OUT=$(realpath -m "${OUT:-./gpu-out}"); mkdir -p "$OUT"
REPO=$PWD
WHEEL=$(ls "${WHEEL_DIR:-.xfer/wheel}"/detcomm-*.whl | head -1)
SITE=/tmp/detcomm-site
rm -rf "$SITE" /tmp/detcomm-tests && python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEEL" || exit 1
export PYTHONPATH=$SITE
cp -r "$REPO/tests" /tmp/detcomm-tests && cd /tmp
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
python3 - <<'PY' 2>&1 | tee "$OUT/installed.log"
import detcomm, torch, cupy
assert detcomm.__file__.startswith("/tmp/detcomm-site"), detcomm.__file__
from detcomm.workspace import kernels
print("detcomm from", detcomm.__file__, "| kernel sources", kernels.CSRC, "| torch", torch.__version__, "| cupy", cupy.__version__)
PY
# 1. init(numerics="rl-bitwise") from the wheel: NCCL, one rank per GPU (W = number of GPUs, at least 1).
cat > /tmp/init_job.py <<'PY'
import logging, torch, detcomm
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
comm = detcomm.init(numerics="rl-bitwise")
s = detcomm.site("o_proj", collective="all_reduce", dtype=torch.bfloat16, shape=4096, max_rows=2048)
x = torch.full((3, 4096), 1.0 + comm.rank, dtype=torch.bfloat16, device=comm.device)
y = detcomm.all_reduce(x, site=s)
assert torch.all(y == sum(1.0 + r for r in range(comm.world_size))), y
if comm.rank == 0:
    print(detcomm.routes())
detcomm.shutdown()
PY
timeout 240 python3 -m detcomm.launch --nproc "$(( NGPU >= 1 ? NGPU : 1 ))" /tmp/init_job.py 2>&1 | tee "$OUT/init.log"
# 2. the GPU tests, importing the installed package
timeout ${GPU_TEST_TIMEOUT:-420} python3 -m pytest -q -rs -p no:cacheprovider --timeout=300 -m gpu -k "${GPU_TEST_FILTER:-not soak}" /tmp/detcomm-tests/gpu \
  --junitxml="$OUT/junit_gpu.xml" 2>&1 | tee "$OUT/pytest_gpu.log"
# 3. the probes: NCCL, one rank per GPU, where there are >= 2 GPUs; else 2 ranks sharing the GPU over gloo
if [ "$NGPU" -ge 2 ]; then
  timeout 240 python3 -m detcomm.launch --nproc "$NGPU" -m detcomm.probe model 2>&1 | tee "$OUT/probe_model.log"
  timeout 240 python3 -m detcomm.launch --nproc "$NGPU" -m detcomm.probe hf --config qwen3-tiny --dtype bfloat16 \
    2>&1 | tee "$OUT/probe_hf.log"
  # 4. cost on a real architecture: decode tokens/s, fold vs native phases in one run (hidden 4096, 8 layers, bf16)
  timeout ${HF_BENCH_TIMEOUT:-200} python3 -m detcomm.launch --nproc "$NGPU" "$REPO/bench/hf_decode.py" \
    --concurrency ${HF_CONC:-1,8,64} --steps ${HF_STEPS:-8} --warmup 2 --json "$OUT/hf_decode.json" 2>&1 | tee "$OUT/hf_decode.log"
else
  timeout 240 python3 -m detcomm.launch --nproc 2 -m detcomm.probe hf --config qwen3-tiny --dtype bfloat16 \
    --backend gloo --device cuda:0 2>&1 | tee "$OUT/probe_hf.log"
fi
echo "gpu/wheel.sh done"
