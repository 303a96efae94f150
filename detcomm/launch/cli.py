"""``detcomm-launch``: start W ranks under torchrun or mpiexec with the envelope's environment applied.

    detcomm-launch --nproc 4 [--numerics rl-bitwise] [--backend torchrun|mpi] (-m MODULE | SCRIPT) [ARGS...]

The launcher builds the ranks' environment (launch.environment), then replaces itself with torchrun or
mpiexec (exec: signals reach the real launcher directly and its exit status is ours, so a failing rank gives
a non-zero exit without a wrapper that could lose it).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence

from .backends import (
    LaunchError,
    Target,
    find_mpiexec,
    have_mpi4py,
    mpiexec_command,
    source_pythonpath,
    torchrun_command,
)
from .environment import launch_environment, launch_variables
from .mpi_bootstrap import free_port

__all__ = ["build_parser", "plan", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="detcomm-launch",
        description="Start W detcomm ranks under torchrun or MPI with the numerics envelope's environment "
        "(NCCL_ALGO/NCCL_PROTO/NVIDIA_TF32_OVERRIDE under a bitwise envelope, DETCOMM_NUMERICS) and the "
        "multicast-off variables set before any rank starts. One failing rank takes the whole group down "
        "with a non-zero exit.",
    )
    p.add_argument("--nproc", type=int, required=True,
                   help="ranks to start: per node under torchrun (W on one node), in total under mpi (mpiexec -n)")
    p.add_argument("--numerics", default="auto", help="numerics envelope: auto (default) or rl-bitwise")
    p.add_argument("--backend", choices=("torchrun", "mpi"), default="torchrun", help="how ranks are started")
    p.add_argument(
        "--torchrun-args", default="", metavar="ARGS",
        help="extra torch.distributed.run arguments, one shell-quoted string (e.g. multi-node rendezvous)",
    )
    p.add_argument(
        "--mpiexec-args", default="", metavar="ARGS",
        help="extra mpiexec arguments, one shell-quoted string (e.g. '--hostfile hosts')",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command and the variables set, start nothing")
    p.add_argument("-m", "--module", action="store_true", help="run TARGET as a module (python -m TARGET)")
    p.add_argument("target", help="script path, or module name with -m")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the target")
    return p


def plan(ns: argparse.Namespace, *, base_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str], list[str]]:
    """The command to exec, its environment, and notes for the user (pure apart from locating mpiexec).

    Raises:
        ValueError: bad options (unknown envelope, non-positive --nproc).
        LaunchError: the MPI backend is missing from this machine.
    """
    if ns.nproc < 1:
        raise ValueError(f"--nproc must be a positive integer, got {ns.nproc}")
    env = launch_environment(ns.numerics, base=base_env)
    target = Target(ns.target, tuple(ns.args), module=ns.module)
    notes: list[str] = []
    env["PYTHONPATH"] = source_pythonpath(env)
    if ns.backend == "torchrun":
        return torchrun_command(ns.nproc, target, extra=shlex.split(ns.torchrun_args)), env, notes

    mpi = find_mpiexec(path=env.get("PATH"))
    forward = {k: env[k] for k in launch_variables(ns.numerics)}
    forward["PYTHONPATH"] = env["PYTHONPATH"]
    if not have_mpi4py():
        # No MPI broadcast without mpi4py: fix the rendezvous here, which is only right on one node.
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))
        forward.update(MASTER_ADDR=env["MASTER_ADDR"], MASTER_PORT=env["MASTER_PORT"])
        notes.append(
            "mpi4py is not installed: ranks map the launcher's rank variables, rendezvous at "
            f"{env['MASTER_ADDR']}:{env['MASTER_PORT']} (single node only), and tear-down relies on mpiexec "
            "ending the job when a rank exits non-zero; pip install mpi4py for MPI_Abort and multi-node jobs"
        )
    cmd = mpiexec_command(mpi, ns.nproc, target, forward=forward, extra=shlex.split(ns.mpiexec_args))
    return cmd, env, notes


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``detcomm-launch``; on success it does not return (exec)."""
    ns = build_parser().parse_args(argv)
    try:
        cmd, env, notes = plan(ns)
    except (ValueError, LaunchError) as exc:
        print(f"detcomm-launch: error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"detcomm-launch: note: {note}", file=sys.stderr)
    if ns.dry_run:
        changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
        for k in sorted(changed):
            print(f"{k}={changed[k]}")
        print(shlex.join(cmd))
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)
    return 0  # unreachable: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
