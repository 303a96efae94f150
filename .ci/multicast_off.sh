# Sourced by every shell script that creates an environment (.ci/, gpu/): docs/spec.md §8's multicast-off variables,
# exported so that the scripts' children inherit them. The values are detcomm.envelope.MULTICAST_OFF_ENV's
# (tests/test_envelope_route.py holds this file to that constant).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
