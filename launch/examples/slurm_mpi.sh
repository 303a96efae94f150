#!/usr/bin/env bash
# Slurm + MPI, several nodes: one rank per GPU, the MPI bootstrap maps MPI's ranks to torch.distributed's
# (mpi4py: rank/size, local rank by a shared-memory split, rank 0's address broadcast over MPI).
#
#   sbatch launch/examples/slurm_mpi.sh
#
#SBATCH --job-name=detcomm-probe
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=00:15:00
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
# detcomm-launch computes the ranks' environment (envelope + multicast off) and forwards it to every node
# (-x for Open MPI, -genv for MPICH); --nproc is the whole job's rank count, the hosts come from Slurm's
# allocation (Open MPI and MPICH read it themselves).
exec detcomm-launch --launcher mpi --nproc "$SLURM_NTASKS" --numerics rl-bitwise \
  -m detcomm.probe model "$@"
# Equivalent without detcomm-launch (e.g. srun --mpi=pmix): export the variables of
# detcomm.envelope_environment("rl-bitwise") and NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# NVSHMEM_DISABLE_NVLS=1, then:  srun python -m detcomm.launch.mpi_bootstrap -m detcomm.probe model
