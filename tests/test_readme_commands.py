"""Every shell command the README shows runs as written.

The README's fenced ``bash`` blocks are of two kinds: the two set-up commands, which ``.ci/run`` checks verbatim
and runs on a clean machine, and the tour's commands, which call the checkout's ``.venv`` and so run from any
venv CI made there. ``python tests/test_readme_commands.py`` (a step of ``.ci/run``) runs each tour block with
bash from the repository root and fails on the first that exits non-zero, so a README command that stops working
fails CI. The tests below keep that split honest (a block of another kind fails them) and hold the probes to the
README's negative control: ``--route native`` under a bitwise envelope is refused before any rank joins a group,
with the command the README shows.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```$", re.S | re.M)
_CI_COMMAND = re.compile(r"^(readme_main|readme_tests)=(.*)$", re.M)
VENV = ".venv/bin/"


def shell_blocks(readme: str) -> list[str]:
    """The text of every fenced bash/sh/shell/console block, in order."""
    return [m.group(1) for m in _FENCE.finditer(readme)]


def setup_commands(ci_run: str) -> list[str]:
    """The README set-up commands ``.ci/run`` checks and runs (its ``readme_main=`` and ``readme_tests=`` lines,
    unquoted as bash would)."""
    found = [shlex.split(value)[0] for _, value in _CI_COMMAND.findall(ci_run)]
    assert len(found) == 2, f".ci/run should define readme_main and readme_tests, found {len(found)}"
    return found


def _command_lines(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def tour_blocks(readme: str, ci_run: str) -> list[str]:
    """The README's shell blocks other than the set-up one, each of which CI runs.

    Raises:
        ValueError: a block mixes set-up commands with others, a tour line does not call the checkout's
            ``.venv`` (CI could not run it as written), or a set-up command of ``.ci/run`` is missing.
    """
    setup = setup_commands(ci_run)
    seen: set[str] = set()
    tour = []
    for block in shell_blocks(readme):
        lines = _command_lines(block)
        ours = [line for line in lines if line in setup]
        if ours:
            if len(ours) != len(lines):
                raise ValueError(f"a README block mixes the set-up commands with others:\n{block}")
            seen.update(ours)
            continue
        for line in lines:
            if VENV not in line:
                raise ValueError(f"README command {line!r} does not call the checkout's {VENV}: CI runs every "
                                 f"README command from that venv, so write it as {VENV}<tool>")
        tour.append(block)
    missing = [c for c in setup if c not in seen]
    if missing:
        raise ValueError(f"README.md lacks the set-up command .ci/run runs: {missing}")
    return tour


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _ci_run() -> str:
    return (ROOT / ".ci" / "run").read_text()


def test_every_readme_block_is_a_setup_command_or_run_by_ci() -> None:
    tour = tour_blocks(_readme(), _ci_run())
    assert len(tour) >= 4, tour
    joined = "\n".join(tour)
    assert f"{VENV}detcomm demo" in joined and "--route native --expect-divergence" in joined, joined


def test_a_block_ci_could_not_run_is_refused() -> None:
    """Negative controls: a block outside the venv, a mixed block and a lost set-up command all fail."""
    readme, ci = _readme(), _ci_run()
    with pytest.raises(ValueError, match="does not call the checkout"):
        tour_blocks(readme + "\n```bash\ndetcomm-launch --nproc 4 -m detcomm.probe model\n```\n", ci)
    main_job = setup_commands(ci)[0]
    with pytest.raises(ValueError, match="mixes the set-up commands"):
        tour_blocks(readme + f"\n```bash\n{main_job}\n{VENV}detcomm demo --nproc 2\n```\n", ci)
    with pytest.raises(ValueError, match="lacks the set-up command"):
        tour_blocks(readme.replace(main_job + "\n", ""), ci)
    # An edited set-up command is no set-up command any more: the block mixes, and is refused.
    with pytest.raises(ValueError, match="mixes the set-up commands"):
        tour_blocks(readme.replace(main_job, main_job.replace("--nproc 4", "--nproc 3")), ci)


def test_probe_refuses_native_under_a_bitwise_envelope_with_the_readme_command() -> None:
    from detcomm.probe.envelope import probe_numerics

    # The launcher's export (its default envelope) and no export at all both resolve to rl-bitwise.
    for env in ({"DETCOMM_NUMERICS": "rl-bitwise"}, {}):
        with pytest.raises(ValueError, match="--numerics auto") as caught:
            probe_numerics(None, route="native", command="model", env=env)
        fix = str(caught.value).split("numerics auto: ", 1)[1].replace("--nproc N", "--nproc 4")
        assert f"{VENV}{fix}" in _readme(), fix
    with pytest.raises(ValueError, match="from --numerics rl-bitwise"):
        probe_numerics("rl-bitwise", route="native", command="model", env={})
    # What the README runs, and what stays allowed: the probe's own flag wins over the export.
    assert probe_numerics(None, route="native", command="model", env={"DETCOMM_NUMERICS": "auto"}) == "auto"
    assert probe_numerics("auto", route="native", command="model", env={"DETCOMM_NUMERICS": "rl-bitwise"}) == "auto"
    assert probe_numerics(None, route="gather_fold", command="hf", env={}) == "rl-bitwise"
    assert probe_numerics(None, route=None, command="collectives", env={"DETCOMM_NUMERICS": "auto"}) == "auto"


def test_launcher_refuses_the_old_negative_control_before_the_group_starts() -> None:
    """The README's former command (no --numerics: the launcher exports rl-bitwise) fails on every rank at W=3
    with the fix, not with a route refusal from inside the group."""
    env = {k: v for k, v in os.environ.items() if k != "DETCOMM_NUMERICS"}
    proc = subprocess.run([sys.executable, "-m", "detcomm.launch", "--nproc", "3", "-m", "detcomm.probe", "model",
                           "--route", "native", "--expect-divergence"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "ValueError: --route native makes no bitwise claim" in out, out
    assert "detcomm-launch --nproc N --numerics auto -m detcomm.probe model --route native" in out, out


def test_the_runner_fails_on_a_failing_command(capsys: pytest.CaptureFixture[str]) -> None:
    """The CI step's verdict: a README whose tour has one failing command (the second of a block) exits 1, and one
    whose commands succeed exits 0 (both through the checkout's .venv, as CI runs them)."""
    setup = "```bash\n" + "\n".join(setup_commands(_ci_run())) + "\n```\n"
    ok = f"```bash\n{VENV}python -c pass\n```\n"
    failing = f"```bash\n{VENV}python -c pass\n{VENV}python -c 'raise SystemExit(3)'\n{VENV}python -c pass\n```\n"
    assert main(setup + ok) == 0
    assert main(setup + ok + failing) == 1
    assert "FAILED (exit 3): README command 2/2" in capsys.readouterr().err


def main(readme: str | None = None) -> int:
    """Run every README tour block from the repository root (CI: after the venv with the package exists)."""
    env = {k: v for k, v in os.environ.items() if k != "DETCOMM_NUMERICS"}  # the launcher's own default, as a user
    blocks = tour_blocks(_readme() if readme is None else readme, _ci_run())
    for i, block in enumerate(blocks, 1):
        print(f"=== README command {i}/{len(blocks)}:\n{block}", flush=True)
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env, timeout=1800)
        if proc.returncode != 0:
            print(f"=== FAILED (exit {proc.returncode}): README command {i}/{len(blocks)} as written:\n{block}",
                  file=sys.stderr)
            return 1
    print(f"=== every README command ran ({len(blocks)} blocks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
