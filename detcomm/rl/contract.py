"""What fixes the arithmetic of a TPCausalLM's logprobs, as a digest both sides of an RL loop compare.

``contract(lm)`` lists the fields (``Contract.fields``): the layout, V and its fold order, the fixed block
count, the dtype, the step geometry (T_pad rows per GEMM, the paged attention's KV block size: every shape the
arithmetic sees; not max_context or num_blocks, which the paged attention's bits do not follow), the numerics
envelope and every switch, the attention impl (torch or triton: their bits differ), the
model's configuration, the detcomm, torch and transformers versions, the GPU kernels' sources, the device's
compute capability, and the NVRTC version and options they are compiled with (cupy's; None on the CPU or
without cupy, where no NVRTC kernel runs), and on CUDA triton's version and the Triton kernels' sources with the
shard GEMMs' tile configuration; W only where the layout is not TP-size invariant (the fold and shard-order layouts' sums
follow W). ``digest`` is a SHA-256 of them; the gate (``detcomm.rl.gate.check_contract``) compares the fields
and names every one that differs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import detcomm

__all__ = ["Contract", "contract"]


@dataclass(frozen=True)
class Contract:
    """The fields (name -> value, JSON-able) and their digest."""

    fields: dict[str, Any]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fields, sort_keys=True).encode()).hexdigest()

    def differences(self, other: Contract) -> list[str]:
        """``name: ours != theirs`` for every field that differs (sorted by name)."""
        names = sorted(set(self.fields) | set(other.fields))
        return [f"{n}: {self.fields.get(n)!r} != {other.fields.get(n)!r}" for n in names
                if self.fields.get(n) != other.fields.get(n)]


def _kernel_sources() -> str:
    """SHA-256 of the workspace kernels' CUDA sources (csrc/*.cu, *.cuh), which every build compiles."""
    from ..workspace.kernels import _kernel_source_dir

    h = hashlib.sha256()
    for path in sorted(_kernel_source_dir().glob("*.cu*")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _triton(device: torch.device) -> tuple[str | None, str | None]:
    """(triton's version, SHA-256 of the Triton kernels' sources and the shard GEMMs' tile configuration) on CUDA,
    where the paged attention (``attention_triton``) and the virtual layout's shard GEMMs (``shard_gemm``) are
    Triton kernels whose bits follow both; (None, None) elsewhere. The sources are read, not imported (importing
    them needs triton)."""
    if device.type != "cuda":
        return None, None
    import importlib.metadata
    import importlib.util

    from ..numerics import shard_gemm

    try:
        version: str | None = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        version = None
    h = hashlib.sha256()
    for name in ("attention_triton", "shard_gemm"):
        spec = importlib.util.find_spec(f"detcomm.numerics.{name}")
        assert spec is not None and spec.origin is not None, name
        h.update(name.encode() + b"\0" + Path(spec.origin).read_bytes())
    h.update(json.dumps(shard_gemm.CONFIG, sort_keys=True).encode())
    return version, h.hexdigest()


def _nvrtc(device: torch.device, capability: list[int] | None) -> tuple[list[int] | None, list[str] | None]:
    """(NVRTC version, compile options) of the kernels on ``device``: the version is the installed cupy/CUDA's
    (``cupy.cuda.nvrtc.getVersion()``; part of the kernel cache's key, not fixed by the sources or the detcomm
    version); the options are ``detcomm.workspace.kernels.nvrtc_options`` for the device's architecture, the
    canonical build, less ``-DDETCOMM_W`` (the norm kernel builds at W = 1, the workspace's at the group's W,
    which the invariant layouts' bits do not follow). (None, None) on the CPU or without cupy."""
    if device.type != "cuda" or capability is None:
        return None, None
    try:
        from cupy.cuda import nvrtc
    except ImportError:  # no cupy: detcomm runs no NVRTC kernel here (the torch compositions)
        return None, None
    from ..workspace.kernels import nvrtc_options

    major, minor = capability
    options = [o for o in nvrtc_options(1, f"sm_{major}{minor}") if not o.startswith("-DDETCOMM_W=")]
    return [int(x) for x in nvrtc.getVersion()], options


def contract(lm: Any) -> Contract:
    """The arithmetic contract of ``lm`` (a ``detcomm.hf.TPCausalLM``) on this rank. Local."""
    import transformers

    s, cfg = lm.shards, lm.cfg
    resolved = detcomm.get_communicator().resolved
    invariant = s.layout == "full_k" or (s.layout == "virtual" and s.shard_fold == "tree")
    fields: dict[str, Any] = {
        "layout": s.layout, "virtual_shards": s.virtual_shards, "shard_fold": s.shard_fold, "blocks": s.blocks,
        "fused_boundaries": bool(lm.fuse), "dtype": str(lm.dtype).removeprefix("torch."),
        "t_pad": cfg.t_pad, "block_size": cfg.block_size,
        "numerics": resolved.numerics,
        "attention": lm.attention_impl,
        "detcomm": detcomm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "device": lm.device.type,
        # the GPU kernels' builds: what the NVRTC cache key holds (their sources, the options, the NVRTC version)
        # and the architecture they are compiled for
        "kernel_sources": _kernel_sources(),
        "device_capability": (list(torch.cuda.get_device_capability(lm.device)) if lm.device.type == "cuda"
                              else None),
    }
    fields["nvrtc_version"], fields["nvrtc_options"] = _nvrtc(lm.device, fields["device_capability"])
    fields["triton"], fields["triton_kernels"] = _triton(lm.device)
    fields.update({f"switch.{k}": getattr(resolved.switches, k) for k in type(resolved.switches).names()})
    config = json.loads(lm.config.to_json_string(use_diff=False))
    for k, v in config.items():
        if k not in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):  # not arithmetic (dtype: above)
            fields[f"config.{k}"] = v
    if not invariant:  # the sums follow W (docs/spec.md §9.1)
        fields["world"] = s.world
    return Contract(fields)
