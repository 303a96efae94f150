"""Peak host memory per rank while ``detcomm.hf.load`` loads a checkpoint, sliced or whole (docs/performance.md,
"Sliced loading: host memory per rank").

    python -m detcomm.hf.memory --write /tmp/llama-1b --config llama-1b      # a bf16 checkpoint, once
    detcomm-launch --nproc 4 --numerics rl-bitwise -m detcomm.hf.memory --model /tmp/llama-1b [--full-load]

Each rank first builds the model once on the meta device (so that importing transformers' modeling code is not
counted) and returns the heap's free pages to the system (glibc ``malloc_trim``: otherwise the load would reuse
pages already counted), then reads its resident set size (``/proc/self/statm``) just before the load and its high-water mark
(``getrusage(RUSAGE_SELF).ru_maxrss``) just after it: the difference is the most memory the load added at any
moment (an over-estimate only if the process had peaked higher before the load, e.g. while importing). Pages of
the memory-mapped safetensors files count while they are mapped. Rank 0 prints every rank's figure and its ratio
to the checkpoint's bytes; ``--json`` writes them. Collective (run on every rank).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import sys
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MEMORY_CONFIGS", "write_checkpoint", "main"]

# Llama shapes for the measurement (bf16): the 1B one is Llama-3.2-1B's (tied embeddings, 1.24e9 parameters,
# 2.5 GB); the 200M one is CI's (112e6 parameters, 225 MB: big enough that a rank's import-time peak does not
# hide the load's).
MEMORY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama-200m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False),
}


def write_checkpoint(name: str, directory: str, *, seed: int = 0) -> str:
    """A bf16 Llama checkpoint of ``MEMORY_CONFIGS[name]`` with seeded random weights, written with
    ``save_pretrained``. Local; run it before any process group exists (transformers saves on rank 0 only)."""
    import transformers

    if name not in MEMORY_CONFIGS:
        raise ValueError(f"unknown config {name!r}; known: {', '.join(MEMORY_CONFIGS)}")
    config = transformers.LlamaConfig(**MEMORY_CONFIGS[name], initializer_range=0.02)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m detcomm.hf.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", metavar="DIR", help="checkpoint directory to load")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--full-load", action="store_true", help="today's path: from_pretrained of the whole model, then cut")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes every rank's figures")
    p.add_argument("--write", metavar="DIR", help="no load: write a checkpoint of --config into DIR")
    p.add_argument("--config", choices=sorted(MEMORY_CONFIGS), default="llama-1b")
    ns = p.parse_args(argv)
    if ns.write:
        print(write_checkpoint(ns.config, ns.write))
        return 0
    if not ns.model:
        p.error("--model DIR (or --write DIR) is required")
    import torch.distributed as dist
    import transformers

    import detcomm
    from detcomm.hf import Checkpoint, ServingConfig, load

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    from detcomm.hf import checkpoint_config, meta_model

    dtype = getattr(torch, ns.dtype)
    detcomm.init()
    rank = dist.get_rank()
    try:
        meta_model(checkpoint_config(ns.model, dtype=dtype), dtype=dtype)  # the modeling code's imports: not the load's
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the heap's free pages back, so the load's must be new ones
        before = _rss_bytes()
        lm = load(ns.model, dtype=dtype, serving=ServingConfig(t_pad=64, max_context=64),
                  sliced=not ns.full_load)
        peak = _peak_bytes() - before
        held = sum(t.numel() * t.element_size() for t in [*lm.model.parameters(), *lm.model.buffers()])
        rows = [torch.zeros(3, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, torch.tensor([float(peak), float(held), float(before)], dtype=torch.float64))
    finally:
        detcomm.shutdown()
    size = Checkpoint(ns.model).nbytes()
    if rank == 0:
        how = "whole (from_pretrained, then cut)" if ns.full_load else "sliced"
        print(f"{ns.model}: {size / 2**20:.0f} MiB of safetensors, W={len(rows)}, load {how}")
        print("rank  peak added at load (MiB)  / checkpoint  shard held (MiB)  RSS before (MiB)")
        for r, (pk, hd, bf) in enumerate(x.tolist() for x in rows):
            print(f"{r:4d}  {pk / 2**20:24.0f}  {pk / size:12.3f}  {hd / 2**20:16.0f}  {bf / 2**20:16.0f}")
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump({"model": ns.model, "checkpoint_bytes": size, "world_size": len(rows),
                           "load": "full" if ns.full_load else "sliced",
                           "ranks": [{"peak_added_bytes": int(pk), "held_bytes": int(hd), "rss_before_bytes": int(bf)}
                                     for pk, hd, bf in (x.tolist() for x in rows)]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
