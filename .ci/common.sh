# Sourced by the CI scripts (.ci/run, .ci/probes.sh, .ci/wheel.sh); not run on its own.

# docs/spec.md §8: multicast stays off in every environment CI creates, the scripts' own children included.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

step() {  # step <description> <command...>: show it, time it, stop the script on failure
  local what="$1"; shift
  echo "=== $what: $*"
  local t0=$SECONDS
  if ! "$@"; then echo "=== FAILED: $what" >&2; exit 1; fi
  echo "=== ok: $what ($((SECONDS - t0)) s)"
}
