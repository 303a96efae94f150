#!/usr/bin/env python3
"""Mutation check of the workspace's failure guards (a developer tool; not shipped in the package).

Each guard that keeps a workspace failure from taking healthy ranks down (no trap, abortable spins, the busy
word, the per-call descriptor, ...) has a test. This tool proves that the test depends on the guard: for every
entry of MUTATIONS below it copies the tree to a temporary directory, replaces the exact code that implements
the guard with a disabled version (the smallest edit that removes it), and runs the entry's tests there. Each
test must pass on the unmutated tree and fail (or, for a guard against a hang, run past its limit) on the
mutant. A mutant whose tests still pass "survived": its test does not check the guard.

    PYTHONPATH=. python tests/mutations.py --cpu-only         # CPU machine (nvcc on PATH for the csrc entries)
    PYTHONPATH=. python tests/mutations.py --gpu-only --jobs 6  # the accelerator (one GPU is enough)
    python tests/mutations.py --only 8 --only 1b              # some items (or entry keys)
    python tests/mutations.py --check                         # only check the snippets and that each mutant builds

Exit status: 0 when every selected mutant was caught; 1 when one survived, a baseline test did not pass, or a
test was skipped or not found; 2 when a snippet is not found exactly once (the code moved: re-anchor the entry
below; nothing is run) or, with --check, a mutant does not build.

Editing the table: `snippet` is matched literally (whitespace included) and must occur exactly once in `file`;
`mutant` replaces it. Keep snippets to the line(s) that carry the guard, so unrelated edits around them do not
break the anchor. Python mutants reuse the compiled kernels (the kernel cache key is the source text), so only
csrc/ mutants pay for an NVRTC build.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from detcomm.envelope import MULTICAST_OFF_ENV

ROOT = Path(__file__).resolve().parents[1]

FAILURES = "tests/gpu/test_workspace_failures.py"
GUARDS = "tests/test_robust_guards.py"
CSRC_TESTS = "tests/test_workspace_csrc.py"
GUARD_MODES = "tests/test_robust_guard_modes.py"
# The failure tests run a barrier kernel ([one_shot]) and the one-store kernel ([one_store]); each mutant names the one
# whose guard it removes.
DEADLINE_TEST = f"{FAILURES}::test_deadline_ends_the_kernel_without_a_trap_one_record_per_rank[one_shot]"
ABORT_TEST = f"{FAILURES}::test_abort_releases_a_spinning_kernel_and_tells_the_peer[one_shot]"
DEADLINE_ONE_STORE = DEADLINE_TEST.replace("[one_shot]", "[one_store]")
ABORT_ONE_STORE = ABORT_TEST.replace("[one_shot]", "[one_store]")
REPLAY_TEST = f"{FAILURES}::test_graph_replay_beside_an_eager_call_fails_the_workspace[one_shot]"
MISMATCH_TEST = f"{FAILURES}::test_different_calls_raise_on_every_rank[one_shot]"
INIT_TEST = f"{FAILURES}::test_init_sets_the_deadline_and_checks_every_variant_before_first_use"
VARIANTS_TEST = f"{GUARDS}::test_selfchecks_run_every_variant_a_site_can_reach[W2]"


@dataclass(frozen=True)
class Mutation:
    key: str  # unique name of the entry (--only accepts it)
    item: str  # the guard's item in the robustness list (docs/robustness.md)
    mechanism: str  # what the snippet implements
    file: str  # repository-relative path
    snippet: str  # the exact code of the guard: must occur exactly once in file
    mutant: str  # its replacement: the guard removed or disabled
    tests: tuple[str, ...]  # pytest node ids: each must pass unmutated and fail on the mutant
    gpu: bool  # the tests need a CUDA device
    limit_s: float  # wall-clock limit of one mutant's run (all its tests)
    hang_ok: bool = False  # a guard against a hang: a mutant run that passes limit_s counts as caught


M = Mutation
# (snippet, mutant) pairs that more than one entry applies (one entry per CPU or GPU test set).
_TRAP = ("#ifdef DETCOMM_TRAP_ON_FAILURE\n  __trap();", "#if 1  // mutant: every failure traps\n  __trap();")
_TIMEOUT = ('kw: dict[str, Any] = {} if timeout_s is None else {"timeout_s": timeout_s}',
            "kw: dict[str, Any] = {}  # mutant: timeout_s stops at the process group")
_LOOP = ('        calls.update(getattr(bound, "variants", {}))',
         "        pass  # mutant: only the route's default call is checked")
MUTATIONS: tuple[Mutation, ...] = (
    # 1: a failure writes its record and returns; the host raises and refuses; __trap only in the debug build.
    M("1-trap-ptx", "1", "a failing barrier returns; __trap() only in the debug build", "csrc/detcomm_common.cuh",
      *_TRAP,
      (f"{CSRC_TESTS}::test_ptx_has_no_fma_and_no_ftz[one_shot.cu]",), gpu=False, limit_s=120),
    M("1-trap", "1", "a failing barrier returns; __trap() only in the debug build", "csrc/detcomm_common.cuh",
      *_TRAP,
      (DEADLINE_TEST,), gpu=True, limit_s=150),
    M("1-raise", "1", "the host reads the record and raises WorkspaceFailed", "detcomm/workspace/workspace.py",
      "        if self._ctrl.ptr and self._ctrl.tagged():",
      "        if False:  # mutant: the failure record is never read",
      (DEADLINE_TEST,), gpu=True, limit_s=150),
    M("1-refuse", "1", "a failed workspace refuses every later call", "detcomm/workspace/collectives.py",
      "        if self._dead is not None or self._ctrl.tagged():\n            self.check()",
      "        if False:  # mutant: later calls are not refused\n            self.check()",
      (DEADLINE_TEST,), gpu=True, limit_s=150),
    # 1b: every spin polls the host's abort word; abort() tells the peers.
    M("1b-spin", "1b", "every spin (barrier or one-store) polls the host's abort word", "csrc/detcomm_common.cuh",
      "if (poll_host && *(const volatile u32*)(g.ctrl + DETCOMM_HOST_ABORT_WORD) != 0u) {",
      "if (false) {  // mutant: the host's abort word is never polled",
      (ABORT_TEST, ABORT_ONE_STORE), gpu=True, limit_s=150, hang_ok=True),
    M("1b-peers", "1b", "abort() writes the abort word into every rank's header", "detcomm/workspace/workspace.py",
      "                for base in self._sig_ptrs:",
      "                for base in []:  # mutant: the peers are never told",
      (ABORT_TEST,), gpu=True, limit_s=150, hang_ok=True),
    # 2: init(timeout_s=) reaches the workspace.
    M("2-timeout", "2", "init(timeout_s=) is passed to Workspace.create", "detcomm/route_impls/ipc_fold.py",
      *_TIMEOUT,
      (f"{GUARDS}::test_init_timeout_reaches_the_workspace",), gpu=False, limit_s=120),
    M("2-timeout-gpu", "2", "init(timeout_s=) is passed to Workspace.create", "detcomm/route_impls/ipc_fold.py",
      *_TIMEOUT,
      (INIT_TEST,), gpu=True, limit_s=180),
    # 3: one kernel per rank at a time, graph replays included.
    M("3-busy", "3", "device busy word: a second kernel on a rank fails the workspace", "csrc/detcomm_common.cuh",
      "if (atomicCAS(own + busy_index(blockIdx.x), 0u, g.call | 0x80000000u) != 0u) {",
      "if (false) {  // mutant: a second kernel of this rank is not detected",
      (REPLAY_TEST, REPLAY_TEST.replace("[one_shot]", "[one_store]")), gpu=True, limit_s=150, hang_ok=True),
    M("3-host", "3", "host in-flight guard: a call from another stream raises", "detcomm/workspace/launch.py",
      "last != stream and not self.capturing and",
      "False and",  # mutant: the guard's condition never holds (no host-side in-flight guard)
      ("tests/gpu/test_workspace_inprocess.py::test_second_stream_while_in_flight_raises",), gpu=True, limit_s=150,
      hang_ok=True),
    # 4: the self-checks run every kernel variant a site can reach.
    M("4-loop", "4", "the self-checks run every variant the bound route exposes", "detcomm/selfcheck.py",
      *_LOOP,
      (VARIANTS_TEST,), gpu=False, limit_s=180),
    M("4-bind", "4", "ipc_fold exposes every variant the workspace lists", "detcomm/route_impls/ipc_fold.py",
      "        return Bound(bound.route, bound.site, bound.call, forced, in_place=in_place)",
      "        return Bound(bound.route, bound.site, bound.call, in_place=in_place)  # mutant: no forced variants",
      (VARIANTS_TEST,), gpu=False, limit_s=180),
    M("4-loop-gpu", "4", "the self-checks run every variant the bound route exposes", "detcomm/selfcheck.py",
      *_LOOP,
      (INIT_TEST,), gpu=True, limit_s=180),
    # 5: one module per dtype, refused alone; the CUDA fold leaf falls back to the portable leaf.
    M("5-want", "5", "each dtype's module holds only its own kernels", "csrc/detcomm_common.cuh",
      "#define DETCOMM_WANT(DT) (DETCOMM_DTYPE == (DT))",
      "#define DETCOMM_WANT(DT) 1  // mutant: every module holds every dtype",
      (f"{CSRC_TESTS}::test_each_dtype_is_its_own_module_and_is_refused_alone",
       f"{CSRC_TESTS}::test_dtype_module_holds_only_its_kernels"), gpu=False, limit_s=180),
    M("5-modules", "5", "each dtype is compiled as its own module, refused alone", "detcomm/workspace/kernels.py",
      "nvrtc_options(world_size, arch, module=module, build=build, trap=trap)",
      "nvrtc_options(world_size, arch, module=None, build=build, trap=trap)",  # mutant: one unit for all
      (f"{CSRC_TESTS}::test_each_dtype_is_its_own_module_and_is_refused_alone",), gpu=False, limit_s=180),
    M("5-leaf", "5", "a refused dtype folds with the portable leaf", "detcomm/numerics/cuda_leaf.py",
      "    if ks is None or not ks.available(module):",
      "    if ks is None:  # mutant: a refused dtype's kernel is launched anyway",
      (f"{FAILURES}::test_cuda_fold_leaf_is_capturable_and_falls_back",), gpu=True, limit_s=150),
    # 6: an overlapping out/x pair is refused before any communication.
    M("6-comm", "6", "the communicator refuses a partially overlapping out", "detcomm/calls.py",
      "        if a < b + rows * self.x_row_bytes and b < a + osh[0] * self.out_row_bytes:",
      "        if False:  # mutant: partial overlap accepted",
      ("tests/test_api_calls.py::test_out_inplace_avg_async[W2-float32]",), gpu=False, limit_s=180),
    M("6-workspace", "6", "the workspace refuses any overlap of out and x", "detcomm/workspace/collectives.py",
      "        if x0 < o1 and o0 < x1:\n            raise ValueError(f\"out [{o0:#x}, {o1:#x}) overlaps x [",
      "        if False:\n            raise ValueError(f\"out [{o0:#x}, {o1:#x}) overlaps x [",
      (f"{GUARDS}::test_workspace_refuses_overlapping_out_and_x",), gpu=False, limit_s=120),
    # 7: one record per rank, written by the first failing thread.
    M("7-claim", "7", "the first failing thread of a rank claims its one record", "csrc/detcomm_common.cuh",
      "const bool reporter = atomicCAS(own + DETCOMM_CLAIM_INDEX, 0u, 1u) == 0u;",
      "const bool reporter = true;  // mutant: every failing thread writes the record",
      (DEADLINE_TEST,), gpu=True, limit_s=150),
    # 8: peers compare the per-call descriptor at the start barrier, whatever host-side checking says.
    M("8-desc", "8", "peers' call descriptors are compared at the start barrier", "csrc/detcomm_common.cuh",
      "if (pd[0] != g.what || pd[1] != g.call || pd[2] != (u32)g.count || pd[3] != (u32)(g.count >> 32)) {",
      "if (false) {  // mutant: descriptors are not compared",
      (MISMATCH_TEST,), gpu=True, limit_s=150),
    # 9: a barrier passes only on this use's epoch, never on an earlier use's flag.
    M("9-epoch", "9", "a flag counts only when it equals this use's epoch", "csrc/detcomm_common.cuh",
      "  return seen == epoch;",
      "  return seen != 0u;  // mutant: an earlier use's flag passes",
      (f"{FAILURES}::test_slow_rank_never_lets_a_flag_be_consumed_early[2]",), gpu=True, limit_s=180, hang_ok=True),
    # 10: no end barrier: a use of parity p works in copy p of the slots, descriptors and flags.
    M("10-parity", "10", "a use works in the slot, descriptor and flag copies of its START epoch's parity",
      "csrc/detcomm_common.cuh",
      "  return epoch & 1u;",
      "  return 0u;  // mutant: one copy of everything, a peer one use ahead overwrites what this rank still reads",
      (f"{FAILURES}::test_fast_rank_ahead_never_overwrites_a_slot_in_use[2]",), gpu=True, limit_s=240, hang_ok=True),
    # Guards shared by every kernel's spins (csrc/detcomm_common.cuh): the deadline and the look at the abort word
    # before waiting, for the barrier kernels and the one-store kernel alike.
    M("1-deadline", "1", "a spin gives up at the deadline and records it", "csrc/detcomm_common.cuh",
      "  if (waited > g.timeout_ns) {",
      "  if (false) {  // mutant: a spin never gives up",
      (DEADLINE_TEST, DEADLINE_ONE_STORE), gpu=True, limit_s=150, hang_ok=True),
    M("1-entry", "1", "a kernel refuses to wait in a workspace a peer already failed", "csrc/detcomm_common.cuh",
      "  if (ab == 0u) return false;",
      "  return false;  // mutant: no look at the abort word before waiting",
      (DEADLINE_TEST, DEADLINE_ONE_STORE), gpu=True, limit_s=150),
    # The call guard (detcomm/route_impls/guard.py): the separate header of host-memory groups, and the header inside
    # every route's message on device groups (forced on gloo by the test, the same torch ops).
    M("g-header", "call", "the separate call header is compared before the call's data moves",
      "detcomm/route_impls/guard.py",
      '        """Collective: raise ``CollectiveMismatch`` on every rank unless every rank makes this same call."""\n'
      "        exchange(",
      '        """Collective: raise ``CollectiveMismatch`` on every rank unless every rank makes this same call."""\n'
      "        return  # mutant: the header is never exchanged\n        exchange(",
      (f"{GUARD_MODES}::test_every_route_raises_on_a_mismatched_call[W3-header]",
       "tests/test_robust_calls.py::test_mismatched_calls_raise_on_every_rank_on_every_route"), gpu=False, limit_s=300),
    M("g-message", "call", "the headers inside a call's messages are compared before the call returns",
      "detcomm/route_impls/guard.py",
      "        _mismatch(self.native, got, ints, readable)",
      "        pass  # mutant: the in-message headers are never compared",
      (f"{GUARD_MODES}::test_every_route_raises_on_a_mismatched_call[W3-in_message]",), gpu=False, limit_s=300),
    # The one-store kernel's own descriptors (csrc/one_store_common.cuh).
    M("8-desc-one_store", "8", "peers' one-store call descriptors are compared", "csrc/one_store_common.cuh",
      "  if (v.x != mine.x || v.y != mine.y || v.z != mine.z || v.w != mine.w) {",
      "  if (false) {  // mutant: descriptors are never compared",
      (MISMATCH_TEST.replace("[one_shot]", "[one_store]"),), gpu=True, limit_s=150, hang_ok=True),
)


# --- anchoring ---------------------------------------------------------------------------------------------
def anchor_problems(root: Path, entries: list[Mutation]) -> list[str]:
    """Why each entry cannot be applied to the tree at `root` (empty: all snippets occur exactly once)."""
    keys = [m.key for m in MUTATIONS]
    problems = [f"duplicate entry key {k!r}" for k in sorted(set(keys)) if keys.count(k) > 1]
    for m in entries:
        path = root / m.file
        if m.snippet == m.mutant:
            problems.append(f"[{m.key}] the mutant equals the snippet")
        if not path.is_file():
            problems.append(f"[{m.key}] {m.file}: no such file")
            continue
        text = path.read_text()
        count = text.count(m.snippet)
        if count == 1:
            continue
        first = m.snippet.splitlines()[0].strip()
        if count == 0:
            lines = [line.strip() for line in text.splitlines()]
            near = difflib.get_close_matches(first, lines, n=3, cutoff=0.5)
            hint = ("; nearest lines now: " + " | ".join(f"{text.splitlines()[lines.index(n)].strip()!r} "
                                                         f"(line {lines.index(n) + 1})" for n in near)
                    if near else "; nothing similar is left in the file")
            problems.append(f"[{m.key}] item {m.item} ({m.mechanism}): snippet not found in {m.file}: {first!r}{hint}")
        else:
            at = [text[:i].count("\n") + 1 for i in _find_all(text, m.snippet)]
            problems.append(f"[{m.key}] item {m.item}: snippet occurs {count} times in {m.file} (lines {at}): "
                            f"{first!r}; lengthen it until it is unique")
    return problems


def _find_all(text: str, needle: str) -> list[int]:
    out, i = [], text.find(needle)
    while i >= 0:
        out.append(i)
        i = text.find(needle, i + 1)
    return out


# --- trees -------------------------------------------------------------------------------------------------
_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", "build", ".xfer", ".whl", "out"}


def _tree_files(root: Path) -> list[str]:
    """The files of the working tree: git's view (tracked plus untracked-not-ignored) when `root` is a checkout's
    top level, else every file outside caches (a copy without .git, as the accelerator receives it)."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        if Path(top).resolve() == root.resolve():
            out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                 capture_output=True, check=True).stdout.decode()
            return sorted(f for f in set(out.split("\0")) if f and (root / f).is_file())
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
        files += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if not f.endswith(".pyc")]
    return sorted(files)


def make_base(root: Path, dest: Path) -> None:
    for rel in _tree_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    # The kernel sources are found as the package detcomm.csrc when it is importable. An editable install of
    # detcomm maps that name to its own checkout, which would compile the unmutated csrc/: a package inside the
    # copy shadows it (PYTHONPATH comes first), so the copy's csrc/ is what every test compiles.
    link = dest / "detcomm" / "csrc"
    if (dest / "csrc" / "__init__.py").is_file() and not link.exists():
        link.symlink_to(Path("..") / "csrc", target_is_directory=True)


def _env(tree: Path) -> dict[str, str]:
    # COLUMNS: pytest cuts its summary lines ("FAILED node - why") to the terminal's width.
    env = dict(os.environ, **MULTICAST_OFF_ENV, PYTHONDONTWRITEBYTECODE="1", COLUMNS="400")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    return env


def preflight(tree: Path) -> str | None:
    """None when the copy imports its own detcomm and compiles its own csrc/; else what is wrong."""
    code = ("import detcomm, detcomm.workspace.kernels as k; "
            "print(__import__('pathlib').Path(detcomm.__file__).resolve()); print(k.CSRC.resolve())")
    p = subprocess.run([sys.executable, "-c", code], cwd=tree, env=_env(tree), capture_output=True, text=True,
                       timeout=120)
    if p.returncode:
        return f"the copied tree does not import: {p.stderr.strip()[-800:]}"
    real = tree.resolve()
    for line in p.stdout.split():
        if real not in Path(line).parents:
            return f"the copied tree resolves {line}, outside the copy {real}: the mutants would not be tested"
    return None


def apply(tree: Path, m: Mutation) -> None:
    path = tree / m.file
    text = path.read_text()
    assert text.count(m.snippet) == 1, m.key  # checked on the source tree before copying
    path.write_text(text.replace(m.snippet, m.mutant))


def mutant_builds(tree: Path, m: Mutation) -> str | None:
    """None when the mutant compiles (Python: always checked; csrc/: where nvcc is on PATH), else the first error. A
    mutant that does not build would make its tests fail for the wrong reason."""
    if m.file.endswith(".py"):
        try:
            compile((tree / m.file).read_text(), m.file, "exec")
        except SyntaxError as e:
            return f"{m.file}:{e.lineno}: SyntaxError: {e.msg}"
        return None
    nvcc = shutil.which("nvcc")
    if nvcc is None or not m.file.startswith("csrc/"):
        return None
    cu = m.file if m.file.endswith(".cu") else "csrc/one_shot.cu"
    with tempfile.TemporaryDirectory() as tmp:
        from detcomm.workspace.kernels import constant_options  # noqa: PLC0415

        p = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-DDETCOMM_W=2", *constant_options(), "-c", cu, "-o",
                            f"{tmp}/k.o"], cwd=tree, capture_output=True, text=True)
    if p.returncode == 0:
        return None
    return next((line for line in p.stderr.splitlines() if "error" in line), p.stderr.strip()[:200])


def build_problems(root: Path, entries: list[Mutation]) -> list[str]:
    """Each mutant applied alone to a scratch copy of its file (and of csrc/): the ones that do not build."""
    out = []
    for m in entries:
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp)
            shutil.copytree(root / "csrc", tree / "csrc")
            (tree / m.file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / m.file, tree / m.file)
            apply(tree, m)
            broken = mutant_builds(tree, m)
        if broken is not None:
            out.append(f"[{m.key}] the mutant does not build: {broken}")
    return out


# --- running -----------------------------------------------------------------------------------------------
@dataclass
class Run:
    outcomes: dict[str, str]  # node -> PASSED / FAILED / ERROR / SKIPPED / TIMEOUT / MISSING
    why: dict[str, str]  # node -> first line of its failure
    seconds: float
    log: str


_RESULT = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_SUMMARY = re.compile(r"^(FAILED|ERROR|SKIPPED) (?:\[\d+\] )?(\S+::\S+)(?: - (.*))?$")


def run_pytest(tree: Path, nodes: list[str], limit_s: float) -> Run:
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfEs", "--tb=short", "-p", "no:cacheprovider", *nodes]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=_env(tree), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=limit_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run's own session: pytest and every process its tests started
        log, _ = proc.communicate()
        timed_out = True
    seconds = time.monotonic() - t0
    (tree / "mutations.log").write_text(log)  # kept with --keep
    outcomes: dict[str, str] = {}
    why: dict[str, str] = {}
    for line in log.splitlines():
        r = _RESULT.match(line)
        if r and r.group(1) in nodes:
            outcomes[r.group(1)] = r.group(2)
        s = _SUMMARY.match(line)
        if s and s.group(2) in nodes:
            outcomes[s.group(2)] = s.group(1)
            why[s.group(2)] = (s.group(3) or "").strip()
    for node in nodes:
        if node not in outcomes:
            outcomes[node] = "TIMEOUT" if timed_out else ("MISSING" if "not found" in log else "ERROR")
            if not timed_out:
                why.setdefault(node, log.strip().splitlines()[-1] if log.strip() else "no output")
    return Run(outcomes, why, seconds, log)


def verdict(m: Mutation, base: str, mutated: str, broken: str | None) -> tuple[bool, str]:
    if broken is not None:
        return False, "MUTANT DOES NOT BUILD"
    if base != "PASSED":
        return False, f"BASELINE {base}"
    if mutated in ("FAILED", "ERROR"):
        return True, "caught"
    if mutated == "TIMEOUT":
        return (True, "caught (hang)") if m.hang_ok else (False, "TIMED OUT (raise limit_s or set hang_ok)")
    if mutated == "PASSED":
        return False, "SURVIVED"
    return False, f"UNVERIFIED ({mutated})"


def _short(node: str) -> str:
    path, _, name = node.partition("::")
    return f"{Path(path).name}::{name}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    side = ap.add_mutually_exclusive_group()
    side.add_argument("--cpu-only", action="store_true", help="only the entries whose tests need no GPU")
    side.add_argument("--gpu-only", action="store_true", help="only the entries whose tests need a GPU")
    ap.add_argument("--only", action="append", default=[], metavar="ITEM",
                    help="an item (1, 1b, 2, ...) or an entry key (8-desc); repeatable, or comma-separated")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (default 1; the GPU tests tolerate sharing)")
    ap.add_argument("--check", action="store_true", help="only check the snippets (and list the entries)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree to mutate (default: this checkout)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary trees and logs (printed at the end)")
    args = ap.parse_args(argv)
    root = args.root.resolve()

    only = {o.strip() for group in args.only for o in group.split(",") if o.strip()}
    known = {m.item for m in MUTATIONS} | {m.key for m in MUTATIONS}
    if only - known:
        ap.error(f"--only {sorted(only - known)}: unknown; items and keys: {sorted(known)}")
    entries = [m for m in MUTATIONS
               if (not only or m.item in only or m.key in only)
               and not (args.cpu_only and m.gpu) and not (args.gpu_only and not m.gpu)]
    if not entries:
        ap.error("no entry selected")

    problems = anchor_problems(root, entries)
    if args.check and not problems:
        problems = build_problems(root, entries)
    if args.check or problems:
        for m in entries:
            print(f"{m.key:14} item {m.item:3} {'gpu' if m.gpu else 'cpu'}  {m.file}: {m.mechanism}")
        for p in problems:
            print(f"PROBLEM {p}", file=sys.stderr)
        if problems:
            print(f"{len(problems)} problem(s): nothing was run. Re-anchor or fix the entries in {__file__}.",
                  file=sys.stderr)
            return 2
        print(f"all {len(entries)} snippets found exactly once in {root}, and every mutant builds")
        return 0

    work = Path(tempfile.mkdtemp(prefix="detcomm-mutations-"))
    try:
        base = work / "base"
        make_base(root, base)
        why_not = preflight(base)
        if why_not:
            print(f"error: {why_not}", file=sys.stderr)
            return 1
        baseline_nodes = sorted({t for m in entries for t in m.tests})
        limit = {t: max(m.limit_s for m in entries if t in m.tests) for t in baseline_nodes}

        def baseline() -> Run:
            return run_pytest(base, baseline_nodes, sum(limit.values()))

        def mutant(m: Mutation) -> tuple[Run | None, str | None]:
            tree = work / m.key
            shutil.copytree(base, tree, symlinks=True)
            apply(tree, m)
            broken = mutant_builds(tree, m)
            if broken is not None:
                return None, broken
            return run_pytest(tree, list(m.tests), m.limit_s), None

        print(f"{len(entries)} mutants, {len(baseline_nodes)} tests, {args.jobs} at once; trees under {work}",
              flush=True)
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            fut_base = pool.submit(baseline)
            futs = {m.key: pool.submit(mutant, m) for m in entries}
            keys = {fut: key for key, fut in futs.items()}
            for fut in concurrent.futures.as_completed(keys):  # progress as runs end: a killed run keeps these lines
                key = keys[fut]
                run, broken = fut.result()
                state = broken or (", ".join(f"{_short(n)} {o}" for n, o in run.outcomes.items()) if run else "")
                print(f"  [{key}] {state} ({run.seconds:.0f} s)" if run else f"  [{key}] {state}", flush=True)
            base_run = fut_base.result()
        print(f"  [baseline] {sum(o == 'PASSED' for o in base_run.outcomes.values())}/{len(baseline_nodes)} passed "
              f"({base_run.seconds:.0f} s); total {time.monotonic() - t0:.0f} s\n", flush=True)

        rows: list[tuple[str, ...]] = []
        bad = 0
        for m in entries:
            run, broken = futs[m.key].result()
            for node in m.tests:
                mutated = run.outcomes[node] if run else "NOT RUN"
                ok, text = verdict(m, base_run.outcomes[node], mutated, broken)
                bad += not ok
                why = broken or (run.why.get(node, "") if run else "")
                rows.append((m.item, m.key, m.mechanism, _short(node), base_run.outcomes[node], mutated, text,
                             f"{run.seconds:.0f}" if run else "-", why))
        head = ("item", "entry", "mechanism", "test", "unmutated", "mutated", "verdict", "s")
        table: list[tuple[str, ...]] = [head] + [r[:8] for r in rows]
        widths = [min(90, max(len(str(r[i])) for r in table)) for i in range(len(head))]
        for i, r in enumerate(table):
            print("| " + " | ".join(str(c)[:w].ljust(w) for c, w in zip(r, widths)) + " |")
            if i == 0:
                print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        print("\nwhy each mutant's test failed (first line of the failure):")
        for r in rows:
            print(f"  [{r[1]}] {r[3]}: {r[8][:160] or '-'}")
        if any(o != "PASSED" for o in base_run.outcomes.values()):
            print(f"\n--- baseline log (tail) ---\n{base_run.log[-4000:]}")
        print(f"\n{len(rows) - bad} of {len(rows)} mutant/test pairs caught"
              + ("" if not bad else f"; {bad} NOT (see verdicts above)"))
        return 1 if bad else 0
    finally:
        if args.keep:
            print(f"trees and logs kept under {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
