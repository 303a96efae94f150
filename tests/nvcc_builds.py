"""nvcc builds for the CPU kernel checks (tests/test_workspace_csrc.py): each built once, several side by side.

Why: those checks are most of the CPU suite's time, and much of it was the same compile twice (the W = 2 modules
serve the dtype-module test, the register tests and the entry-point test) or one nvcc at a time while the
other core idled (nvcc is single-threaded; pytest runs one test at a time; CI has 2 cores). A build is keyed by
exactly what it compiles (source text, options in order, output kind), so asking again returns the first
result, and a test submits all of its builds before it reads one, so they run side by side. Nothing about a
build changes: the same nvcc command line a test would have run, in a directory of its own.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# nvcc's flag for each output kind. "cubin" builds also keep their intermediate files (--keep): the PTX nvcc
# generated on the way is the one `-ptx` writes, so one build answers both; and print ptxas's resource usage
# (-Xptxas -v: the register checks read it; it changes no code).
_KIND_FLAGS = {"obj": ["-c"], "ptx": ["-ptx"], "cubin": ["-Xptxas", "-v", "-cubin"], "preprocess": ["-E"]}
_SUFFIX = {"obj": ".o", "ptx": ".ptx", "cubin": ".cubin", "preprocess": ".i"}


@dataclass(frozen=True)
class Build:
    """One nvcc run: its exit status, its stderr, its output (b"" when it failed) and, for a cubin, its PTX."""

    returncode: int
    stderr: str
    output: bytes
    ptx: str = ""

    def errors(self) -> str:
        """stderr without ptxas's -v report (what the same build without -v prints)."""
        lines = self.stderr.splitlines()
        return "\n".join(line for line in lines if not (line.startswith("ptxas info") or line.startswith("    ")))


def _workers() -> int:
    """The cores this process may use, at most 4 (each nvcc of a whole module holds about 1 GB)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(4, n))


class Builds:
    """The session's nvcc builds. ``submit`` starts one (or finds it started) and returns its future; ``get``
    waits for it. ``source`` is a path to a .cu file or the text of a translation unit."""

    def __init__(self, nvcc: str, workdir: Path, *, workers: int | None = None) -> None:
        self.nvcc = nvcc
        self.workdir = workdir
        self._pool = ThreadPoolExecutor(max_workers=workers or _workers(), thread_name_prefix="nvcc")
        self._futures: dict[str, Future[Build]] = {}
        self._lock = threading.Lock()

    def submit(self, source: Path | str, options: Sequence[str], kind: str) -> Future[Build]:
        if kind not in _KIND_FLAGS:
            raise ValueError(f"kind must be one of {sorted(_KIND_FLAGS)}, got {kind!r}")
        text = source.read_text() if isinstance(source, Path) else source
        name = source.stem if isinstance(source, Path) else "unit"
        key = hashlib.sha256(repr((str(source) if isinstance(source, Path) else text, tuple(options), kind)).encode()
                             ).hexdigest()[:24]
        with self._lock:
            fut = self._futures.get(key)
            if fut is None:
                fut = self._futures[key] = self._pool.submit(self._run, key, source, text, name, tuple(options), kind)
            return fut

    def get(self, source: Path | str, options: Sequence[str], kind: str) -> Build:
        return self.submit(source, options, kind).result()

    def _run(self, key: str, source: Path | str, text: str, name: str, options: tuple[str, ...], kind: str) -> Build:
        d = self.workdir / key
        d.mkdir(parents=True, exist_ok=True)
        if isinstance(source, Path):
            src = source  # compiled where it lies: its own #include "..." lines resolve from its directory
        else:
            src = d / f"{name}.cu"
            src.write_text(text)
        out = d / f"{name}{_SUFFIX[kind]}"
        keep = ["--keep", "--keep-dir", str(d)] if kind == "cubin" else []
        p = subprocess.run([self.nvcc, *options, *_KIND_FLAGS[kind], *keep, str(src), "-o", str(out)],
                           capture_output=True, text=True)
        ok = p.returncode == 0 and out.is_file()
        ptx = d / f"{src.stem}.ptx"
        return Build(p.returncode, p.stderr, out.read_bytes() if ok else b"",
                     ptx.read_text() if kind == "cubin" and ok and ptx.is_file() else "")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
