"""Running the real vLLM engine for tests/vllm_plugin: the environment, one engine run, the audit records."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# One rank per core, in order: vLLM's CPU workers refuse to guess a binding at TP >= 2 on this machine's topology.
CORES = os.cpu_count() or 1


def bind(tp: int) -> str:
    return "|".join(str(r % CORES) for r in range(tp))


# vLLM's CPU all-reduce paths: "auto" is vLLM's own choice (its shared-memory kernel where it has one), and
# "torch.distributed" forces its gloo fallback through the test-only general plugin in torch_distributed_path/.
VLLM_PATHS = ("auto", "torch.distributed")


def vllm_env(*, tp: int, plugin: bool, audit: Path | None = None, layout: str | None = None,
             vllm_path: str = "auto") -> dict[str, str]:
    if vllm_path not in VLLM_PATHS:
        raise ValueError(f"vllm_path {vllm_path!r}: one of {VLLM_PATHS}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DETCOMM_", "VLLM_"))}
    if vllm_path == "torch.distributed":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "torch_distributed_path"),
                                                          env.get("PYTHONPATH")]))
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=bind(tp), VLLM_LOGGING_LEVEL="INFO",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if plugin:
        env["DETCOMM_VLLM"] = "1"
    if audit is not None:
        env["DETCOMM_VLLM_AUDIT"] = str(audit)
    if layout is not None:
        env["DETCOMM_VLLM_LAYOUT"] = layout
    return env


def serve(model: Path, out: Path, env: dict[str, str], *, tp: int, timeout: float = 600) -> dict:
    """Run tests/vllm_plugin/serve.py (an unmodified vLLM script) in a fresh process; its result."""
    p = subprocess.run([sys.executable, str(HERE / "serve.py"), "--model", str(model), "--tp", str(tp),
                        "--out", str(out)], env=env, cwd=str(out.parent), capture_output=True, text=True,
                       timeout=timeout)
    log = out.with_suffix(".log")
    log.write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise AssertionError(f"vLLM at TP={tp} exited {p.returncode}; log {log}:\n{(p.stdout + p.stderr)[-6000:]}")
    result = json.loads(out.read_text())
    result["log"] = p.stdout + p.stderr
    return result


def audit_records(directory: Path, tp: int) -> list[list[dict]]:
    """Every rank's audit records, in call order."""
    ranks = []
    for r in range(tp):
        recs = []
        with open(directory / f"rank{r}.pkl", "rb") as f:
            while True:
                try:
                    recs.append(pickle.load(f))
                except EOFError:
                    break
        ranks.append(recs)
    return ranks


