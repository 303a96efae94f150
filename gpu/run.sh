#!/usr/bin/env bash
# One device call: the GPU tests, the failure-guard mutants, the benches and the soak, with full logs under $OUT and
# a short summary of each stage on stdout (a remote runner often returns only the tail of stdout).
#   STAGES=kernels bash gpu/run.sh        (from the repository root; OUT defaults to ./gpu-out)
#   LANES="one_store,inprocess failures,norm" bash gpu/run.sh    (two lanes at once; see LANES below)
# Stages, each sized to fit one 10-minute device call on its own (all of them take about 30 minutes):
#   kernels   the workspace kernels' GPU tests (one-store, failures and their negative controls)
#   tests     the in-process and in-place workspace tests and the fused norm tests
#   core      the CUDA core, fold capture, virtual shards, the trainer backend, robustness, processes per GPU
#   tree      the tree-order virtual-shard kernels (plain and fused; the fused tree norm through the API on processes
#             sharing one GPU) and the host routes' tree on CUDA
#   mutants   the failure-guard mutants (tests/mutations.py --gpu-only; MUTANTS=1,1b,... for a subset)
#   bench     the stream and NCCL benches, gather_fold captured, the fused bench, the host path
#   soak      the 40 s soak over every route: processes sharing one GPU, and one GPU per rank where >= 2
#   rl        detcomm.rl's GRPO loop on the GPU (rollout W = 4, trainer W = 2, ranks sharing the GPUs; fp32, bf16)
#   attention the serving step's paged attention (Triton kernel and torch on CUDA), the HF engine on it (triton
#             impl, W = 1 and 2 processes sharing the GPU) and the one-layer bench
#   graphs    the HF engine's steps captured in CUDA graphs (replay == eager bits, the head inside the step too,
#             W = 1 and 2 processes sharing the GPU; the host-staged group's eager fallback); bench/tp_decode.py
#             --graphs --profile --hf-generate (the probe decoder, fold and tree, at issue 42's width, W = 1 over
#             NCCL, with the HBM copy rate and streaming ratios, prefill, device-busy % and transformers' generate in
#             the same run) and bench/hf_decode.py --graphs at that width
#   shardgemm the TP-invariant layouts' fixed-config Triton GEMMs (detcomm.numerics.shard_gemm): the kernel and model
#             tests (bits over V/W and rows, W = 1 and 2 processes sharing the GPU, graphs on/off), bench/shard_gemm.py
#             (per-projection us: per-shard torch vs the kernel vs the fold's cuBLAS) and bench/tp_decode.py fold / tree
#             (fp32 and bf16 shards) at issue 42's width; about 4 minutes
# On one GPU the multi-GPU parts skip themselves: the NCCL bench, the NCCL soak, and the fused bench falls back to W
# streams of the one GPU (bench/fused_streams.py).
set -u -o pipefail
# shellcheck source=.ci/multicast_off.sh
. .ci/multicast_off.sh  # docs/spec.md §8, children inherit
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export DETCOMM_CACHE_DIR=${DETCOMM_CACHE_DIR:-/tmp/detcomm-kernels}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STAGES=${STAGES:-kernels}
# LANES="a,b c,d": run the stage lists a,b and c,d at once on the same machine (each lane in its own copy of this
# script, printing its summary when done), so a 10-minute device call covers more. The GPU time-slices the lanes'
# contexts, so every test still sees its ranks' grids co-resident; only the wall times stretch.
if [ -n "${LANES:-}" ]; then
  i=0
  for lane in $LANES; do
    i=$((i + 1))
    STAGES=$lane LANES= bash "$0" > "$OUT/lane$i.txt" 2>&1 &
  done
  wait
  i=0
  for lane in $LANES; do i=$((i + 1)); echo "== lane $i: $lane"; grep -v '^\[0 s\] [0-9]* GPU' "$OUT/lane$i.txt"; done
  exit 0
fi
# Stage names: the groups below, or kernels (= one_store,failures), tests (= inprocess,norm), core (= corecuda,robust,tree).
expanded=
for t in ${STAGES//,/ }; do
  case $t in kernels) t=one_store,failures ;; tests) t=inprocess,norm ;; core) t=corecuda,robust,tree ;; esac
  expanded+="$t,"
done
STAGES=$expanded
has() { [[ ",$STAGES," == *",$1,"* ]]; }
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')
{ date -u; nvidia-smi -L; $PY -c 'import torch, cupy; print("torch", torch.__version__, "cuda", torch.version.cuda, "cupy", cupy.__version__)'; } > "$OUT/env.log" 2>&1
say "$NGPU GPU(s): $(grep -m1 GPU "$OUT/env.log")"

# pytest group NAME LIMIT_S FILES...: one line of counts, then the failures (never the whole log).
group() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" $PY -m pytest -q --tb=line -rfE -p no:cacheprovider --timeout=$((150 * LIMIT / 100)) --durations=5 -m gpu "$@" \
    > "$OUT/pytest_$name.log" 2>&1
  local rc=$?
  say "tests $name rc=$rc: $(grep -E '(passed|failed|error)' "$OUT/pytest_$name.log" | tail -1)"
  [ $rc -eq 124 ] && echo "  (timed out; last progress line: $(grep -E '^[.FEsx]+' "$OUT/pytest_$name.log" | tail -1))"
  grep -E '^(FAILED|ERROR)|^E  ' "$OUT/pytest_$name.log" | head -12
}

LIMIT=${LIMIT:-100}  # percent: scales every group's time limits (lanes run slower than a stage alone)
lim() { echo $(( $1 * LIMIT / 100 )); }
has one_store && group one_store "$(lim 220)" tests/gpu/test_workspace_one_store.py
has failures && group failures "$(lim 330)" tests/gpu/test_workspace_failures.py
has inprocess && group inprocess "$(lim 300)" tests/gpu/test_workspace_inprocess.py tests/gpu/test_workspace_in_place.py
has norm && group norm "$(lim 250)" tests/gpu/test_norm_gpu.py
has tree && group tree "$(lim 400)" tests/gpu/test_workspace_tree.py tests/test_tree_fold.py
has corecuda && group core "$(lim 440)" tests/gpu/test_core_cuda.py tests/gpu/test_core_workspace.py \
  tests/gpu/test_fold_capture.py tests/gpu/test_workspace_virtual.py tests/gpu/test_dist_backend_gpu.py \
  tests/gpu/test_rs_ag_fold_gpu.py tests/gpu/test_trainers_shared_gpu.py
has robust && group robust "$(lim 300)" tests/gpu/test_robust_gpu.py tests/gpu/test_workspace_multiproc.py \
  tests/gpu/test_failed_call_output.py tests/test_robust_guard_modes.py -k "not soak"
has rl && group rl "$(lim 400)" -s tests/gpu/test_rl_gpu.py
if has attention; then
  group attention "$(lim 360)" tests/gpu/test_paged_attention_gpu.py tests/gpu/test_hf_engine_gpu.py
  timeout 150 $PY bench/paged_attention.py > "$OUT/paged_attention.md" 2>&1
  say "bench paged attention rc=$?"; grep -E '^(\||device)' "$OUT/paged_attention.md" | head -12
fi
if has graphs; then
  # ~6 min wall at most: the replay == eager tests (head inside the step included), then issue 42's bench and width
  group graphs "$(lim 180)" tests/gpu/test_hf_graphs_gpu.py
  # the probe decoder (issue 42's bench/tp_decode.py and width: hidden 2048, 4 layers, 16 heads x 128, FFN 8192,
  # vocab 32000, bf16), fold and tree, eager and graphs (step + head: next_tokens), and its peers in the same run:
  # the HBM copy rate and each config's step / weight + KV streaming ratio, prefill tokens/s, the device-busy %
  # (--profile), transformers' own generate at the same width (static cache + its compile, then eager)
  timeout 170 $PY -m detcomm.launch --nproc 1 --numerics rl-bitwise bench/tp_decode.py --graphs --layouts fold,tree \
    --hidden 2048 --heads 16 --head-dim 128 --ffn 8192 --vocab 32000 --layers 4 --dtype bfloat16 --t-pad 64 \
    --concurrency 1,64 --steps 8 --repeats 3 --profile --hf-generate static+compile,eager \
    --json "$OUT/tp_decode_graphs.json" > "$OUT/tp_decode_graphs.log" 2>&1
  say "bench tp_decode --graphs --profile --hf-generate rc=$?"
  grep -vE '^\[rank0\]: -+' "$OUT/tp_decode_graphs.log" | grep -E '^(\[rank0\]: )?( *[0-9]+ |probe decoder|concurrency|layout|prefill|device limit|rank 0, per|transformers|fold|tree|graphs:|.* graphs: CUDA)' | head -40
  # detcomm.hf at the probe width (eager and graphs; prefill under the table)
  timeout 80 $PY -m detcomm.launch --nproc 1 --numerics rl-bitwise bench/hf_decode.py --graphs --phases fold \
    --hidden 2048 --layers 4 --heads 16 --kv-heads 16 --ffn 8192 --vocab 32000 --concurrency 1,8,64 --steps 16 \
    --warmup 3 --json "$OUT/hf_decode_graphs_probe_width.json" > "$OUT/hf_decode_graphs_probe_width.log" 2>&1
  say "bench hf_decode --graphs (probe width) rc=$?"; grep -E '^(\[rank0\]: )?( *[0-9]+ |HF decode|fold graphs|concurrency|prefill)' "$OUT/hf_decode_graphs_probe_width.log" | head -10
fi
if has shardgemm; then
  group shardgemm "$(lim 150)" tests/gpu/test_shard_gemm_gpu.py
  timeout 60 $PY bench/shard_gemm.py --json "$OUT/shard_gemm.json" > "$OUT/shard_gemm.md" 2>&1
  say "bench shard_gemm rc=$?"; grep -E '^(\||device|.*max \|)' "$OUT/shard_gemm.md" | head -24
  for sw in fp32 model; do
    timeout 90 $PY -m detcomm.launch --nproc 1 --numerics rl-bitwise bench/tp_decode.py --layouts fold,tree \
      --shard-weights $sw --hidden 2048 --heads 16 --head-dim 128 --ffn 8192 --vocab 32000 --layers 4 \
      --dtype bfloat16 --t-pad 64 --concurrency 1,64 --steps 8 --repeats 3 --json "$OUT/tp_decode_shard_$sw.json" \
      > "$OUT/tp_decode_shard_$sw.log" 2>&1
    say "bench tp_decode --shard-weights $sw rc=$?"
    grep -E '^(\[rank0\]: )?( *[0-9]+ |probe decoder|concurrency)' "$OUT/tp_decode_shard_$sw.log" | head -6
  done
fi
if has mutants; then
  timeout 560 $PY tests/mutations.py --gpu-only --jobs 6 ${MUTANTS:+--only $MUTANTS} > "$OUT/mutations.log" 2>&1
  say "mutants rc=$?: $(grep -E 'mutant/test pairs caught' "$OUT/mutations.log" | tail -1)"
  grep -E '^\| [0-9]' "$OUT/mutations.log" | grep -v ' caught ' | head -12
fi
if has bench; then
  # W ranks as W streams of one GPU: W = 1 against a copy, W = 2 and 8 (one-store, one-shot, two-shot)
  timeout 150 $PY bench/ipc_kernels.py --out "$OUT/bench_streams" --modes latency --worlds 1,2,8 \
    --sizes 16,256,65536 > "$OUT/bench_streams.log" 2>&1
  say "bench streams rc=$?"; grep -E '^\| [0-9]' "$OUT/bench_streams.log" | head -40
  timeout 90 $PY bench/ipc_kernels.py --out "$OUT/bench_streams_untiered" --modes latency --worlds 2 \
    --sizes 16,256 --untiered > "$OUT/bench_streams_untiered.log" 2>&1
  say "bench streams, one-store untiered rc=$?"; grep -E '^\| [0-9].*one_store' "$OUT/bench_streams_untiered.log" | head -6
  if [ "$NGPU" -ge 2 ]; then
    timeout 150 $PY bench/ipc_kernels.py --out "$OUT/bench_nccl" --modes nccl --nccl-envs default \
      --sizes 16,64,256,1024,65536 > "$OUT/bench_nccl.log" 2>&1
    say "bench nccl rc=$?"; grep -E '^\| [0-9]' "$OUT/bench_nccl.log" | head -60
    # The one-store launches untiered (every size on the whole grid, one_store_tiers=()): the raw workspace's one-store
    # rows against the tiered ones above (plan.DEFAULT_ONE_STORE_TIERS)
    timeout 120 $PY bench/ipc_kernels.py --out "$OUT/bench_nccl_untiered" --modes nccl --nccl-envs default \
      --sizes 16,64,256,1024 --untiered > "$OUT/bench_nccl_untiered.log" 2>&1
    say "bench nccl, one-store untiered rc=$?"; grep -E '^\| [0-9].*one_store' "$OUT/bench_nccl_untiered.log" | head -8
    timeout 180 $PY bench/norm.py --fused --iters 30 --calls-per-graph 10 --out "$OUT/fused" > "$OUT/fused.log" 2>&1
  else
    timeout 180 $PY bench/fused_streams.py --world 2 --json "$OUT/fused_streams.json" > "$OUT/fused.log" 2>&1
  fi
  say "fused bench rc=$?"; grep -E '^\| [0-9]' "$OUT/fused.log" | head -20
  # The fused kernels' other builds on two streams of GPU 0 (csrc/fused_norm_row.cuh): the load batch of 4, and the
  # host never taking the wide kernels (hidden 8192 streams: what the wide kernels save); on one GPU the canonical build's
  # rows are already in fused.log (the same shapes), on several it runs here beside them
  builds="fused_batch4 fused_no_wide"; [ "$NGPU" -ge 2 ] && builds="canonical $builds"
  for build in $builds; do
    timeout 120 $PY bench/fused_streams.py --world 2 --hidden 4096,8192 --rows 1,8 --build $build \
      > "$OUT/fused_$build.log" 2>&1
    say "fused streams, $build build rc=$?"; grep -E '^\| [0-9]' "$OUT/fused_$build.log" | head -4
  done
  # The eager host time of the workspace route on this host, torch's own one-kernel op beside it
  timeout 120 $PY bench/host_path.py --cuda --repeats 15 > "$OUT/host.log" 2>&1
  say "host path rc=$?"; grep -E 'us/call|^route' "$OUT/host.log"
  if [ "$NGPU" -ge 2 ]; then
    # gather_fold captured in a CUDA graph, in its own processes and last (a capture that wedges NCCL cannot spoil
    # the rest)
    timeout 80 $PY bench/ipc_kernels.py --out "$OUT/bench_gather_graph" --modes nccl --nccl-envs default \
      --sizes 16 --gather-graph > "$OUT/bench_gather_graph.log" 2>&1
    say "bench gather_fold graph rc=$?"; grep -E '^\| [0-9].*(gather_fold|nccl) ' "$OUT/bench_gather_graph.log" | head -6
  fi
  # The goals tables of docs/performance.md (the workspace's and the fused kernels' speed goals) from this call's JSON (rows this machine cannot measure: "not measured")
  $PY bench/goals_table.py "$OUT/bench_streams.json" "$OUT/bench_nccl.json" "$OUT/bench_gather_graph.json" \
    "$OUT/fused/fused.json" "$OUT/fused_streams.json" 2>&1 | tee "$OUT/goals.md"
fi
if has soak; then
  # processes sharing one GPU (W = 2 for SOAK_S seconds, W = 3 for half of it), then one GPU per rank where >= 2
  DETCOMM_GPU_SOAK_S=${SOAK_S:-40} timeout 420 $PY -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_robust_gpu.py \
    -k soak > "$OUT/soak.log" 2>&1
  say "soak rc=$?: $(grep -E 'passed|failed' "$OUT/soak.log" | tail -1)"
  grep -E 'GPU soak|^E  |^FAILED' "$OUT/soak.log" | head -12
fi
say done
