"""``detcomm-launch``: start W ranks under torchrun or mpiexec with the envelope's environment applied.

    detcomm-launch --nproc 4 [--numerics rl-bitwise] [--launcher torchrun|mpi] (-m MODULE | SCRIPT) [ARGS...]

The launcher builds the ranks' environment (launch.environment), runs torchrun or mpiexec as its child
(launch.relay: one ``[rankN]:`` tag per rank line, the first rank that failed named last with how it ended)
and exits with the child's status, so a failing rank gives a non-zero exit; SIGINT / SIGTERM / SIGHUP to
the launcher's pid are forwarded to the job, and a launcher killed outright takes the job with it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from typing import NamedTuple

from .backends import (
    TORCHRUN_LINE_PREFIX,
    LaunchError,
    Target,
    find_mpiexec,
    have_mpi4py,
    mpiexec_command,
    torchrun_command,
)
from .environment import DEFAULT_NUMERICS, NUMERICS_ENV, choose_numerics, launch_environment, launch_variables
from .mpi_bootstrap import free_port

__all__ = ["Plan", "build_parser", "plan", "main"]


class Plan(NamedTuple):
    """What to run: the command, its environment, notes for the user, and how its output tags ranks."""

    cmd: list[str]
    env: dict[str, str]
    notes: list[str]
    flavor: str  # torchrun | openmpi | hydra (detcomm.launch.relay)

# --backend means the torch.distributed backend (gloo, nccl) in every detcomm command; the ranks' detcomm.init()
# picks it (NCCL where there is a GPU), so the launcher takes none, and says so to whoever passes one.
_BACKEND_MOVED = ("--backend names the torch.distributed backend (gloo or nccl) in detcomm's commands; the "
                  "ranks' detcomm.init() picks it (NCCL with GPUs, else gloo). How ranks are started is "
                  "--launcher torchrun|mpi")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="detcomm-launch",
        description="Start W detcomm ranks under torchrun or MPI with the numerics envelope's environment "
        "(NCCL_ALGO/NCCL_PROTO/NVIDIA_TF32_OVERRIDE under a bitwise envelope, DETCOMM_NUMERICS) and the "
        "multicast-off variables set before any rank starts. One failing rank takes the whole group down "
        "with a non-zero exit, and the first rank that failed is named last, with its error or signal. The ranks import detcomm from the interpreter's "
        "own path: install the package (pip install -e .) or export PYTHONPATH yourself.",
    )
    p.add_argument("--nproc", type=int, required=True,
                   help="ranks to start: per node under torchrun (W on one node), in total under mpi (mpiexec -n)")
    p.add_argument("--numerics", default=None,
                   help=f"numerics envelope (default: ${NUMERICS_ENV} when exported, else {DEFAULT_NUMERICS}); "
                   f"a value that contradicts an exported ${NUMERICS_ENV} is an error")
    p.add_argument("--launcher", choices=("torchrun", "mpi"), default="torchrun",
                   help="how ranks are started (default torchrun)")
    p.add_argument("--backend", help=argparse.SUPPRESS)
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


def plan(ns: argparse.Namespace, *, base_env: dict[str, str] | None = None) -> Plan:
    """The command to run and its environment (pure apart from locating mpiexec).

    Raises:
        ValueError: bad options (unknown envelope, --numerics contradicting an exported DETCOMM_NUMERICS,
            non-positive --nproc, a --backend).
        LaunchError: the MPI launcher is missing from this machine.
    """
    if ns.backend is not None:
        raise ValueError(f"detcomm-launch takes no --backend ({ns.backend!r}): {_BACKEND_MOVED}")
    if ns.nproc < 1:
        raise ValueError(f"--nproc must be a positive integer, got {ns.nproc}")
    base = dict(os.environ if base_env is None else base_env)
    numerics = choose_numerics(ns.numerics, env=base)
    env = launch_environment(numerics, base=base)
    target = Target(ns.target, tuple(ns.args), module=ns.module)
    notes: list[str] = []
    if ns.launcher == "torchrun":
        env.update(TORCHRUN_LINE_PREFIX)
        return Plan(torchrun_command(ns.nproc, target, extra=shlex.split(ns.torchrun_args)), env, notes, "torchrun")

    mpi = find_mpiexec(path=env.get("PATH"))
    forward = {k: env[k] for k in launch_variables(numerics)}
    if env.get("PYTHONPATH"):
        forward["PYTHONPATH"] = env["PYTHONPATH"]  # the user's own: remote nodes see only what is forwarded
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
    return Plan(cmd, env, notes, mpi.flavor)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``detcomm-launch``: runs the ranks and returns their launcher's exit status."""
    ns = build_parser().parse_args(argv)
    try:
        cmd, env, notes, flavor = plan(ns)
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
    from .relay import run

    return run(cmd, env, flavor=flavor)


if __name__ == "__main__":
    sys.exit(main())
