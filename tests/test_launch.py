"""detcomm-launch: the ranks' environment, MPI variable mapping, and whole-group tear-down on failure.

The integration tests start real ranks (torchrun, and a real mpiexec when one and mpi4py are installed) and
time how long the group takes to go down after one rank raises while the others are blocked in a gloo
collective: without tear-down they would wait for the process group's timeout (minutes).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from detcomm.launch.backends import LaunchError, MpiExec, Target, find_mpiexec, mpiexec_command, torchrun_command
from detcomm.launch.cli import build_parser, plan
from detcomm.launch.environment import DEFAULT_NUMERICS, MULTICAST_OFF, choose_numerics, launch_environment
from detcomm.launch.relay import failure_report, normalize
from detcomm.mpi_env import RankFacts, rank_facts_from_environment, torch_distributed_variables

ROOT = Path(__file__).resolve().parents[1]
HAVE_MPI = shutil.which("mpiexec") is not None
try:
    import mpi4py  # noqa: F401

    HAVE_MPI4PY = True
except ImportError:
    HAVE_MPI4PY = False
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="no mpiexec on PATH (apt-get install openmpi-bin)")
needs_mpi4py = pytest.mark.skipif(not (HAVE_MPI and HAVE_MPI4PY), reason="needs mpiexec and mpi4py")

# Rank 1 raises after the group exists; the others block in a collective that can never complete.
FAILING_JOB = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.all_reduce(torch.ones(4))   # never completes: rank 1 is gone
    time.sleep(600)
    """
)

# Every rank writes what it sees of the launcher's environment.
ENV_JOB = textwrap.dedent(
    """
    import json, os, sys
    names = sys.argv[2:]
    with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"]), "w") as f:
        json.dump({k: os.environ.get(k) for k in names}, f)
    """
)

# Every rank writes its own pid and its parent's (the torchrun agent), then waits to be stopped.
WAITING_JOB = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    with open(os.path.join(sys.argv[1], ".pids%d" % dist.get_rank()), "w") as f:
        f.write("%d %d" % (os.getpid(), os.getppid()))
    os.replace(os.path.join(sys.argv[1], ".pids%d" % dist.get_rank()), os.path.join(sys.argv[1], "pids%d" % dist.get_rank()))
    while True:
        time.sleep(0.1)
    """
)

ENV_NAMES = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "DETCOMM_NUMERICS", "NCCL_ALGO", "NCCL_PROTO", "NVIDIA_TF32_OVERRIDE", *MULTICAST_OFF]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra)
    # Prove the launcher sets the multicast-off variables itself, whatever the caller's environment holds.
    for k in MULTICAST_OFF:
        env.pop(k, None)
    return env


def _launch(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "detcomm.launch", *args], cwd=ROOT, env=env or _env(), capture_output=True,
                          text=True, timeout=timeout)
    return proc, time.monotonic() - t0


# -- MPI variable mapping (unit) ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "env, want",
    [
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, RankFacts(5, 8, 1, 4, "Open MPI")),
        ({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"}, RankFacts(2, 3, 2, 3, "MPICH/Hydra")),
        ({"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "0",
          "MV2_COMM_WORLD_LOCAL_SIZE": "1"}, RankFacts(0, 2, 0, 1, "MVAPICH2")),
        ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "8(x2)"},
         RankFacts(9, 16, 1, 8, "Slurm")),
    ],
    ids=["openmpi", "hydra", "mvapich2", "slurm"],
)
def test_rank_facts_from_each_launcher(env: dict[str, str], want: RankFacts) -> None:
    assert rank_facts_from_environment(env) == want


def test_rank_facts_prefers_open_mpi_over_slurm_and_none_without_launcher() -> None:
    both = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    assert rank_facts_from_environment(both).source == "Open MPI"
    assert rank_facts_from_environment({"HOME": "/root"}) is None


@pytest.mark.parametrize(
    "env, match",
    [
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "MPI_LOCALRANKID"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "2,1"}, "per-node"),
        ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, "not an integer"),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, "outside"),
    ],
    ids=["hydra-no-local", "slurm-ragged", "malformed", "rank-out-of-range"],
)
def test_rank_facts_refuse_incomplete_or_bad_variables(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rank_facts_from_environment(env)


def test_torch_distributed_variables() -> None:
    got = torch_distributed_variables(RankFacts(3, 4, 1, 2, "x"), master_addr="node0", master_port=29500)
    assert got == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    with pytest.raises(ValueError):
        torch_distributed_variables(RankFacts(0, 1, 0, 1, "x"), master_addr="h", master_port=0)


# -- environment and command lines (unit) ---------------------------------------------------------------------

def test_launch_environment_applies_envelope_and_forces_multicast_off() -> None:
    env = launch_environment("rl-bitwise", base={"NCCL_NVLS_ENABLE": "1", "PATH": "/bin"})
    assert env["NCCL_NVLS_ENABLE"] == "0"  # a caller's opt-in does not survive the launcher
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert (env["NCCL_ALGO"], env["NCCL_PROTO"], env["NVIDIA_TF32_OVERRIDE"]) == ("Ring", "Simple", "0")
    assert env["DETCOMM_NUMERICS"] == "rl-bitwise" and env["PATH"] == "/bin"
    auto = launch_environment("auto", base={})
    assert "NCCL_ALGO" not in auto and auto["NCCL_NVLS_ENABLE"] == "0"
    with pytest.raises(ValueError, match="unknown numerics envelope"):
        launch_environment("bitwise-please", base={})


def test_exported_numerics_wins_over_the_default_and_a_contradicting_flag_is_an_error() -> None:
    assert DEFAULT_NUMERICS == "rl-bitwise"
    assert choose_numerics(None, env={}) == DEFAULT_NUMERICS
    assert choose_numerics(None, env={"DETCOMM_NUMERICS": "auto"}) == "auto"
    assert choose_numerics("auto", env={}) == "auto"
    assert choose_numerics("rl-bitwise", env={"DETCOMM_NUMERICS": "rl-bitwise"}) == "rl-bitwise"
    with pytest.raises(ValueError, match="contradicts DETCOMM_NUMERICS=rl-bitwise"):
        choose_numerics("auto", env={"DETCOMM_NUMERICS": "rl-bitwise"})
    with pytest.raises(ValueError, match="DETCOMM_NUMERICS='bitwise' .* is not a numerics envelope"):
        choose_numerics(None, env={"DETCOMM_NUMERICS": "bitwise"})
    # The launcher: no flag keeps the exported envelope; the ranks' environment carries it.
    ns = build_parser().parse_args(["--nproc", "2", "x.py"])
    assert plan(ns, base_env={"DETCOMM_NUMERICS": "auto"}).env["DETCOMM_NUMERICS"] == "auto"
    bitwise = plan(ns, base_env={"DETCOMM_NUMERICS": "rl-bitwise"}).env
    assert (bitwise["DETCOMM_NUMERICS"], bitwise["NCCL_ALGO"]) == ("rl-bitwise", "Ring")
    assert plan(ns, base_env={}).env["DETCOMM_NUMERICS"] == DEFAULT_NUMERICS
    with pytest.raises(ValueError, match="contradicts"):
        plan(build_parser().parse_args(["--nproc", "2", "--numerics", "auto", "x.py"]),
             base_env={"DETCOMM_NUMERICS": "rl-bitwise"})


def test_launcher_leaves_pythonpath_alone_and_refuses_backend() -> None:
    ns = build_parser().parse_args(["--nproc", "2", "x.py"])
    assert "PYTHONPATH" not in plan(ns, base_env={}).env
    assert plan(ns, base_env={"PYTHONPATH": "/mine"}).env["PYTHONPATH"] == "/mine"
    with pytest.raises(ValueError, match=r"--launcher torchrun\|mpi"):
        plan(build_parser().parse_args(["--nproc", "2", "--backend", "mpi", "x.py"]), base_env={})


def test_output_tags_become_one_rank_prefix() -> None:
    assert normalize("[rank1]:[rank1]: Traceback (most recent call last):", "torchrun") == "[rank1]: Traceback (most recent call last):"
    assert normalize("[rank0]:hello", "torchrun") == "[rank0]: hello"
    assert normalize("[rank0]:  File x", "torchrun") == "[rank0]:   File x"
    assert normalize("[rank0]:[rank0]:   File x", "torchrun") == "[rank0]:   File x"
    assert normalize("[1,2]<stdout>: hello", "openmpi") == "[rank2]: hello"
    assert normalize("[1,0]<stderr>:[rank0]: boom", "openmpi") == "[rank0]: boom"
    assert normalize("[3] hi", "hydra") == "[rank3]: hi"
    assert normalize("W1130 torch/distributed/elastic: closing", "torchrun") == "W1130 torch/distributed/elastic: closing"


def _record(folder: Path, rank: int, t: float, error: str | None, status: int = 1) -> None:
    (folder / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": 3, "time": t,
                                                         "status": status if error else 0, "error": error}))


def test_failure_report_puts_the_first_failure_last(tmp_path: Path) -> None:
    _record(tmp_path, 0, 2.0, "Traceback\nRuntimeError: Connection closed by peer\n")
    _record(tmp_path, 2, 1.0, "Traceback (most recent call last):\n  File x\nValueError: the root cause\n")
    lines = failure_report(tmp_path, 1)
    assert lines[0] == "detcomm-launch: after rank 2 failed: rank 0 raised RuntimeError: Connection closed by peer"
    assert lines[1].startswith("detcomm-launch: rank 2 of 3 failed first; the whole group was stopped (status 1)")
    assert lines[2:] == ["[rank2]: Traceback (most recent call last):", "[rank2]:   File x", "[rank2]: ValueError: the root cause"]
    empty = tmp_path / "none"
    empty.mkdir()
    assert "no rank recorded an error" in failure_report(empty, 3)[0]
    (empty / "failures.json").write_text(json.dumps({"1": -9}))
    assert failure_report(empty, 137)[0].startswith("detcomm-launch: rank 1 failed first: it was killed by signal SIGKILL")


def test_failure_report_names_the_rank_that_died_not_its_survivors(tmp_path: Path) -> None:
    # Rank 1 was SIGKILLed (no record of its own: the torchrun agent saw -9); its peers raised afterwards.
    _record(tmp_path, 0, 5.0, "Traceback\nRuntimeError: Connection reset by peer\n")
    _record(tmp_path, 2, 5.1, "Traceback\nRuntimeError: Connection reset by peer\n")
    (tmp_path / "failures.json").write_text(json.dumps({"0": 1, "1": -9, "2": 1}))
    lines = failure_report(tmp_path, 137)
    assert lines[-1].startswith("detcomm-launch: rank 1 of 3 failed first: it was killed by signal SIGKILL"), lines
    assert "after rank 1 failed: rank 0 raised RuntimeError: Connection reset by peer; rank 2 raised" in lines[0]
    # Open MPI's own line, when mpiexec ran the ranks, names the rank the same way.
    (tmp_path / "failures.json").unlink()
    assert failure_report(tmp_path, 137, exits={1: -9})[-1].startswith("detcomm-launch: rank 1 of 3 failed first: it was killed")
    # A fatal signal with a faulthandler dump: its time orders it, its stack is printed last.
    (tmp_path / "rank1.fault").write_text("Fatal Python error: Aborted\n\nThread 0x1 (most recent call first):\n  File x\n")
    os.utime(tmp_path / "rank1.fault", (4.0, 4.0))
    lines = failure_report(tmp_path, 134, exits={1: -6})
    assert "rank 1 of 3 failed first: it died of signal SIGABRT" in lines[1], lines
    assert lines[2] == "[rank1]: Fatal Python error: Aborted" and lines[-1] == "[rank1]:   File x"
    os.utime(tmp_path / "rank1.fault", (6.0, 6.0))  # negative control: a later fault is a consequence
    assert "rank 0 of 3 failed first" in failure_report(tmp_path, 134, exits={1: -6})[1]


def test_failure_report_names_a_rank_that_ran_and_left_no_record(tmp_path: Path) -> None:
    # mpiexec may abort the job for a survivor's MPI_Abort before it says that rank 1 was killed: rank 1 ran
    # (its fault file exists), left no record and no status; the survivors' tear-down SIGTERM left theirs.
    for r in range(3):
        (tmp_path / f"rank{r}.fault").write_text("")
    _record(tmp_path, 0, 5.0, "Traceback\nRuntimeError: Connection reset by peer\n")
    (tmp_path / "rank2.term").write_text("Current thread 0x1 (most recent call first):\n  File y\n")
    os.utime(tmp_path / "rank2.term", (5.2, 5.2))
    lines = failure_report(tmp_path, 1)
    assert lines[-1].startswith("detcomm-launch: rank 1 of 3 failed first: it ended without a record: killed by "
                                "SIGKILL"), lines
    assert "rank 0 raised RuntimeError: Connection reset by peer; rank 2 was stopped by signal SIGTERM" in lines[0]
    _record(tmp_path, 1, 6.0, "Traceback\nValueError: later\n")  # negative control: a later error is no cause
    assert "rank 0 of 3 failed first" in failure_report(tmp_path, 1)[1]


def test_failure_report_names_a_rank_that_left_early_with_status_0(tmp_path: Path) -> None:
    _record(tmp_path, 1, 3.0, None)
    _record(tmp_path, 0, 3.5, "Traceback\nRuntimeError: Connection closed by peer\n")
    lines = failure_report(tmp_path, 1, exits={0: 1})
    assert lines[-1].startswith("detcomm-launch: rank 1 of 3 ended first: it exited with status 0 while the other "
                                "ranks still ran"), lines
    _record(tmp_path, 1, 4.0, None)  # finishing after a peer failed is no cause
    assert "rank 0 of 3 failed first" in failure_report(tmp_path, 1, exits={0: 1})[0]


def test_failure_report_names_a_rank_that_left_through_os_exit(tmp_path: Path) -> None:
    # Rank 1's wrapper recorded its os._exit(0) (returned false); the survivors' errors came later.
    (tmp_path / "rank1.json").write_text(json.dumps({"rank": 1, "world_size": 3, "time": 3.0, "status": 0,
                                                     "error": None, "returned": False}))
    _record(tmp_path, 0, 3.5, "Traceback\nRuntimeError: Connection reset by peer\n")
    _record(tmp_path, 2, 3.6, "Traceback\nRuntimeError: Connection reset by peer\n")
    (tmp_path / "failures.json").write_text(json.dumps({"0": 1, "2": 1}))
    lines = failure_report(tmp_path, 1)
    assert lines[-1].startswith("detcomm-launch: rank 1 of 3 ended first: it exited early (status 0, through "
                                "os._exit: its program did not return)"), lines
    assert "after rank 1 ended: rank 0 raised RuntimeError: Connection reset by peer" in lines[0], lines
    # Negative control: the same exit after a peer's failure is no cause.
    (tmp_path / "rank1.json").write_text(json.dumps({"rank": 1, "world_size": 3, "time": 4.0, "status": 0,
                                                     "error": None, "returned": False}))
    assert "rank 0 of 3 failed first" in failure_report(tmp_path, 1)[1]
    # No record at all (a C-level _exit), yet the torchrun agent did not list it among the failures: status 0.
    (tmp_path / "rank1.json").unlink()
    (tmp_path / "rank1.fault").write_text("")
    assert failure_report(tmp_path, 1)[-1].startswith("detcomm-launch: rank 1 of 3 failed first: it exited early "
                                                      "(status 0 without a record"), failure_report(tmp_path, 1)
    (tmp_path / "failures.json").unlink()  # without the agent's list the status is unknown
    assert "killed by SIGKILL" in failure_report(tmp_path, 1)[-1]



def test_failure_report_knows_the_world_size_when_no_rank_wrote_an_end_record(tmp_path: Path) -> None:
    # Rank 1 died of SIGABRT and the survivors were stopped by SIGTERM: no end record, only the start records.
    for r in range(3):
        (tmp_path / f"rank{r}.start").write_text(json.dumps({"rank": r, "world_size": 3}))
        (tmp_path / f"rank{r}.fault").write_text("")
    (tmp_path / "rank1.fault").write_text("Fatal Python error: Aborted\n")
    for r in (0, 2):
        (tmp_path / f"rank{r}.term").write_text("Current thread 0x1 (most recent call first):\n")
    (tmp_path / "failures.json").write_text(json.dumps({"1": -6}))
    assert "rank 1 of 3 failed first: it died of signal SIGABRT" in failure_report(tmp_path, 134)[1]
    for r in range(3):  # negative control: without the start records the world size is unknown
        (tmp_path / f"rank{r}.start").unlink()
    assert "rank 1 failed first" in failure_report(tmp_path, 134)[1]


def test_command_lines() -> None:
    t = Target("detcomm.probe", ("model", "--json", "x"), module=True)
    cmd = torchrun_command(3, t, python="py")
    assert cmd[:4] == ["py", "-m", "detcomm.launch.torchrun_agent", "--standalone"]
    assert cmd[-7:] == ["-m", "detcomm.launch.rank", "-m", "detcomm.probe", "model", "--json", "x"]
    assert "--standalone" not in torchrun_command(3, t, extra=["--nnodes", "2"], python="py")
    ompi = mpiexec_command(MpiExec("/usr/bin/mpiexec", "openmpi", ""), 4, t, forward={"A": "1"}, python="py")
    assert ompi[:3] == ["/usr/bin/mpiexec", "-n", "4"] and ["-x", "A"] == ompi[ompi.index("-x"):ompi.index("-x") + 2]
    assert ompi[ompi.index("py"):][:3] == ["py", "-m", "detcomm.launch.mpi_bootstrap"]
    hydra = mpiexec_command(MpiExec("mpiexec", "hydra", ""), 2, Target("s.py"), forward={"A": "1"}, python="py")
    assert ["-genv", "A", "1"] == hydra[hydra.index("-genv"):hydra.index("-genv") + 3] and hydra[-1] == "s.py"
    with pytest.raises(ValueError):
        torchrun_command(0, t)


def test_missing_mpiexec_names_the_packages(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="openmpi-bin"):
        find_mpiexec(path=str(tmp_path))
    ns = build_parser().parse_args(["--nproc", "2", "--launcher", "mpi", "x.py"])
    with pytest.raises(LaunchError, match="mpi4py"):
        plan(ns, base_env={"PATH": str(tmp_path)})
    proc, _ = _launch(["--nproc", "2", "--numerics", "nope", "x.py"])
    assert proc.returncode == 2 and "unknown numerics envelope 'nope'" in proc.stderr


# -- real ranks ----------------------------------------------------------------------------------------------

def _check_env_files(out: Path, world: int, numerics: str) -> None:
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    assert sorted(int(s["RANK"]) for s in seen) == list(range(world))
    for s in seen:
        assert s["WORLD_SIZE"] == str(world) and s["LOCAL_WORLD_SIZE"] == str(world)
        assert s["NCCL_NVLS_ENABLE"] == "0" and s["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert s["NVSHMEM_DISABLE_NVLS"] == "1" and s["DETCOMM_NUMERICS"] == numerics
        assert s["MASTER_ADDR"] and s["MASTER_PORT"]
        if numerics == "rl-bitwise":
            assert (s["NCCL_ALGO"], s["NCCL_PROTO"], s["NVIDIA_TF32_OVERRIDE"]) == ("Ring", "Simple", "0")
    assert sorted(int(s["LOCAL_RANK"]) for s in seen) == list(range(world))


@pytest.mark.parametrize("backend", ["torchrun", pytest.param("mpi", marks=needs_mpi4py)])
def test_children_see_the_environment(backend: str, tmp_path: Path) -> None:
    job = tmp_path / "env_job.py"
    job.write_text(ENV_JOB)
    proc, _ = _launch(["--nproc", "3", "--launcher", backend, "--numerics", "rl-bitwise", str(job), str(tmp_path), *ENV_NAMES])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_env_files(tmp_path, 3, "rl-bitwise")


def _assert_torn_down(proc: subprocess.CompletedProcess, elapsed: float) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    # The failing rank's own error is the last thing printed, once, each line with one [rank1]: tag.
    err = proc.stderr.rstrip("\n").splitlines()
    assert err[-1] == "[rank1]: RuntimeError: deliberate failure on rank 1", out
    assert err[-2] == '[rank1]:     raise RuntimeError("deliberate failure on rank 1")', out
    assert out.count("RuntimeError: deliberate failure on rank 1") == 1, out
    assert "rank 1 of 3 failed first" in out
    # No doubled tags, no torchrun ChildFailedError traceback, no Open MPI output tags.
    assert "[rank1]:[rank1]" not in out and "[rank1]: [rank1]" not in out
    assert "ChildFailedError" not in out and "<stdout>:" not in out and "<stderr>:" not in out, out
    # Ranks blocked in a collective with a dead peer would otherwise wait for the gloo timeout (30 min); starting
    # three ranks alone takes 45 s on a loaded 2-core machine.
    assert elapsed < 150, f"group took {elapsed:.1f} s to go down"


@pytest.mark.slow
def test_torchrun_one_rank_fails_whole_group_down(tmp_path: Path) -> None:
    job = tmp_path / "fail.py"
    job.write_text(FAILING_JOB)
    proc, elapsed = _launch(["--nproc", "3", str(job)])
    _assert_torn_down(proc, elapsed)


@pytest.mark.slow
@needs_mpi4py
def test_mpi_one_rank_fails_whole_group_down(tmp_path: Path) -> None:
    job = tmp_path / "fail.py"
    job.write_text(FAILING_JOB)
    proc, elapsed = _launch(["--nproc", "3", "--launcher", "mpi", str(job)])
    _assert_torn_down(proc, elapsed)


@pytest.mark.slow
@needs_mpi
def test_mpi_without_mpi4py_maps_launcher_variables_and_still_tears_down(tmp_path: Path) -> None:
    # A package that shadows mpi4py and refuses to import: the bootstrap must fall back to Open MPI's
    # OMPI_COMM_WORLD_* variables and the launcher's fixed rendezvous.
    fake = tmp_path / "hide" / "mpi4py"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('mpi4py hidden by the test')\n")
    env = _env(PYTHONPATH=str(tmp_path / "hide"))
    job = tmp_path / "env_job.py"
    job.write_text(ENV_JOB)
    out = tmp_path / "out"
    out.mkdir()
    proc, _ = _launch(["--nproc", "2", "--launcher", "mpi", str(job), str(out), *ENV_NAMES], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mpi4py is not installed" in proc.stderr
    _check_env_files(out, 2, DEFAULT_NUMERICS)

    fail = tmp_path / "fail.py"
    fail.write_text(FAILING_JOB)
    proc, elapsed = _launch(["--nproc", "3", "--launcher", "mpi", str(fail)], env=env)
    _assert_torn_down(proc, elapsed)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended; only its parent's wait remains
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_signal_to_the_launcher_pid_stops_every_rank(sig: signal.Signals, tmp_path: Path) -> None:
    # A supervisor signals only the launcher's pid: SIGINT must be forwarded (exit 128 + 2) and SIGKILL, which
    # nothing can forward, must still take the torchrun agent and every rank down with the launcher.
    job = tmp_path / "wait.py"
    job.write_text(WAITING_JOB)
    log = (tmp_path / "launcher.log").open("w")
    launcher = subprocess.Popen([sys.executable, "-m", "detcomm.launch", "--nproc", "3", str(job), str(tmp_path)],
                                cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 150
        while len(list(tmp_path.glob("pids*"))) < 3:
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "launcher.log").read_text()
            time.sleep(0.2)
        for p in tmp_path.glob("pids*"):
            pids.update(int(x) for x in p.read_text().split())  # each rank and its parent, the agent
        assert len(pids) == 4, pids
        launcher.send_signal(sig)
        status = launcher.wait(timeout=120)
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in pids if not _gone(p)] == [], "processes outlived the launcher"
        assert status == (-sig if sig == signal.SIGKILL else 128 + sig)
    finally:
        for p in pids:  # whatever a failed run left behind, by pid
            if not _gone(p):
                os.kill(p, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        log.close()
