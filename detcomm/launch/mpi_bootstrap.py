"""What each rank runs under mpiexec: MPI rank facts -> torch.distributed variables, then the target.

    mpiexec -n 4 python -m detcomm.launch.mpi_bootstrap [-m] TARGET [ARGS...]

Runs TARGET (a module with -m, otherwise a script path) in this process exactly as ``python [-m] TARGET ARGS``
would, after setting RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT so that
``detcomm.init()`` / ``torch.distributed.init_process_group("env://")`` find the group. detcomm-launch
starts it; a batch script may start it directly (launch/examples/slurm_mpi.sh).

With mpi4py (preferred) the facts come from MPI itself and rank 0's rendezvous address is broadcast over MPI,
so multi-node jobs need no extra configuration; an uncaught exception (or a non-zero SystemExit) on any rank
records how that rank ended (detcomm.launch.rank) and calls MPI_Abort, which makes mpiexec kill every rank at once: ranks blocked
in a gloo or NCCL collective would otherwise wait for the dead peer until their timeout.
Without mpi4py the launcher's variables are mapped instead (see ``detcomm.mpi_env``).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Sequence

from detcomm.mpi_env import RankFacts, rank_facts_from_environment, torch_distributed_variables

from . import rank as _rank
from .environment import MULTICAST_OFF
from .lifetime import die_with_parent

__all__ = ["main", "free_port"]


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    # Bound and released at once: the window before the rendezvous store binds it is tiny, and asking the
    # kernel beats guessing a fixed port that a second job on the same node would collide with.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _facts_from_mpi4py(comm: object) -> tuple[RankFacts, str, int]:
    from mpi4py import MPI

    assert isinstance(comm, MPI.Comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    nodes = comm.allreduce(1 if local_rank == 0 else 0)
    rendezvous = None
    if rank == 0:
        # One node: loopback always works and never leaves the host. Several: rank 0's host name, which
        # the other nodes resolve the way they resolve each other for MPI itself.
        addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if nodes == 1 else socket.getfqdn())
        port = int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else free_port()
        rendezvous = (addr, port)
    addr, port = comm.bcast(rendezvous, root=0)
    return RankFacts(rank, size, local_rank, local_size, "mpi4py"), addr, port


def _facts_from_environment() -> tuple[RankFacts, str, int]:
    facts = rank_facts_from_environment(os.environ)
    if facts is None:
        raise ValueError(
            "detcomm.launch.mpi_bootstrap found neither mpi4py nor an MPI launcher's rank variables: start it under "
            "mpiexec (detcomm-launch --backend mpi does), and pip install mpi4py"
        )
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise ValueError(
            f"without mpi4py ({facts.source} variables found) the rendezvous address cannot be broadcast: set "
            "MASTER_ADDR and MASTER_PORT for every rank, or pip install mpi4py"
        )
    return facts, addr, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    """Bootstrap one MPI rank and run the target in this process; returns the exit status on success."""
    # The rank dies with the MPI process that started it (mpiexec or its node daemon): one killed outright
    # stops nothing itself (detcomm.launch.lifetime).
    die_with_parent(signal.SIGKILL, parent=os.getppid())
    module, target, args = _rank.parse(sys.argv[1:] if argv is None else argv, prog="detcomm.launch.mpi_bootstrap")
    try:
        from mpi4py import MPI
    except ImportError:
        MPI = None  # type: ignore[assignment]
    if MPI is not None:
        comm = MPI.COMM_WORLD
        facts, addr, port = _facts_from_mpi4py(comm)
    else:
        comm = None
        facts, addr, port = _facts_from_environment()

    os.environ.update(torch_distributed_variables(facts, master_addr=addr, master_port=port))
    # Again here, not only in the launcher: mpiexec forwards only what it is told to other nodes.
    os.environ.update(MULTICAST_OFF)
    # mpiexec tags output per read, not per line (Open MPI --tag-output, Hydra -prepend-rank): with
    # PYTHONUNBUFFERED, print() reaches the pipe in pieces and lines of different ranks get cut and mixed.
    # Line buffering hands each whole line over in one write and still shows every line at once.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)

    # The error is recorded before MPI_Abort: the abort kills every rank at once, this one included.
    status = _rank.run(facts.rank, facts.world_size, module, target, args)
    if status and comm is not None:
        comm.Abort(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
