"""Sliced loading: build a transformers causal LM on the meta device, cut it (``detcomm.hf.shard``), then read
only this rank's slices from the checkpoint's safetensors files.

``meta_model`` builds the model through transformers' own ``from_config`` under accelerate's
``init_empty_weights`` (parameters on the meta device, buffers such as the rotary tables computed as usual).
``shard_model`` runs on that skeleton unchanged and records where each cut parameter lies (``Shards.cuts``);
``fill`` then reads, one tensor at a time through ``safetensors.safe_open(...).get_slice`` (memory-mapped: only
the slice's bytes are read), the rows or columns of every cut parameter, the hosted experts of every
expert-parallel block and every replicated tensor (norms, routers, shared experts), and casts each to the model
dtype, as ``from_pretrained`` does, into memory of its own. A rank's host memory at load is therefore its shard,
the replicated tensors and the mapped pages of the one slice being copied (each file is opened per tensor and its
mapping dropped after the copy);
docs/performance.md ("Sliced loading") has the figures. The parameters have the bits of ``from_pretrained``
followed by ``shard_model`` (tests/test_hf_sliced.py compares every one on every rank).

Checkpoint keys are transformers' module names (what ``save_pretrained`` writes): single-file
(``model.safetensors``) or sharded (``model.safetensors.index.json``); tied embeddings read the embedding for
the LM head; experts are per-expert tensors (``experts.E.gate_proj/up_proj/down_proj``, Mixtral's
``block_sparse_moe.experts.E.w1/w3/w2``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from .moe_block import EPMoEBlock
from .shard import Cut, Shards

__all__ = ["Checkpoint", "meta_model", "fill"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class Checkpoint:
    """The safetensors tensors of a local checkpoint directory, read slice by slice. Local."""

    def __init__(self, directory: str) -> None:
        from safetensors import safe_open

        self.directory = directory
        index = os.path.join(directory, _INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self.files: dict[str, str] = dict(json.load(f)["weight_map"])
        elif os.path.isfile(os.path.join(directory, _SINGLE)):
            with safe_open(os.path.join(directory, _SINGLE), framework="pt") as f:
                self.files = {k: _SINGLE for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        else:
            raise ValueError(f"{directory}: no {_SINGLE} or {_INDEX}: sliced loading reads safetensors checkpoints; "
                             "pass sliced=False to load other formats through from_pretrained")

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def nbytes(self) -> int:
        """The bytes of the checkpoint's safetensors files."""
        return sum(os.path.getsize(os.path.join(self.directory, f)) for f in set(self.files.values()))

    def read(self, key: str, *, dtype: torch.dtype, cut: Cut | None = None) -> torch.Tensor:
        """Tensor ``key`` (its ``cut`` rows or columns; rows past its end are zeros) in ``dtype``."""
        from safetensors import safe_open

        if key not in self.files:
            raise ValueError(f"{self.directory}: the checkpoint has no tensor {key!r}; sliced loading reads transformers' "
                             "module names (what save_pretrained writes); pass sliced=False to load it through "
                             "from_pretrained")
        with safe_open(os.path.join(self.directory, self.files[key]), framework="pt") as f:
            part = f.get_slice(key)
            if cut is None:
                t = part[:]
            elif cut.dim == 1:
                t = part[:, cut.start : cut.stop]
            else:
                rows = part.get_shape()[0]
                t = part[cut.start : min(cut.stop, rows)]
                if cut.stop > rows:  # the padded vocabulary shard of the last ranks
                    t = torch.cat([t, t.new_zeros(cut.stop - max(rows, cut.start), *t.shape[1:])])
        # A copy in this process's memory: safetensors' tensors point into the file's (private, copy-on-write)
        # mapping, which would keep one mapping of the whole file alive per parameter, and let a rewrite of the
        # file in place change a parameter's bits under the server.
        return t.to(dtype, copy=True)


def meta_model(config: Any, *, dtype: torch.dtype) -> nn.Module:
    """transformers' ``AutoModelForCausalLM.from_config`` (eager attention, ``dtype``) with its parameters on the
    meta device and its buffers computed. Local."""
    import transformers
    from accelerate import init_empty_weights  # type: ignore[import-untyped]

    from .checkpoints import _dtype_kwarg

    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                              **{_dtype_kwarg(): dtype})
    return model.eval()


def _expert_keys(ckpt: Checkpoint, block: EPMoEBlock) -> tuple[str, tuple[str, str, str]]:
    """(router key, (gate, up, down) key patterns with {e}) of a sparse block in the checkpoint."""
    prefix = block.name
    if f"{prefix}.gate.weight" not in ckpt and ".mlp" in prefix:  # Mixtral's checkpoint name for its block
        prefix = prefix.replace(".mlp", ".block_sparse_moe")
    if f"{prefix}.experts.0.w1.weight" in ckpt:
        names = ("w1", "w3", "w2")
    else:
        names = ("gate_proj", "up_proj", "down_proj")
    return f"{prefix}.gate.weight", tuple(f"{prefix}.experts.{{e}}.{n}.weight" for n in names)  # type: ignore[return-value]


def _expert_params(ckpt: Checkpoint, block: EPMoEBlock, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The block's router and its hosted experts' stacked [gate; up] and down weights (EPMoEBlock's layout)."""
    router, (gate, up, down) = _expert_keys(ckpt, block)
    out = {"router": ckpt.read(router, dtype=dtype)}
    if not block.hosted:  # a rank that hosts none of the block's experts holds empty stacks
        out["gate_up"] = torch.zeros(0, 0, block.hidden, dtype=dtype)
        out["down"] = torch.zeros(0, block.hidden, 0, dtype=dtype)
        return out
    out["gate_up"] = torch.stack([torch.cat([ckpt.read(gate.format(e=e), dtype=dtype),
                                             ckpt.read(up.format(e=e), dtype=dtype)]) for e in block.hosted])
    out["down"] = torch.stack([ckpt.read(down.format(e=e), dtype=dtype) for e in block.hosted])
    return out


def fill(model: nn.Module, shards: Shards, ckpt: Checkpoint, *, dtype: torch.dtype) -> None:
    """Give every meta parameter of ``model`` (cut by ``shard_model`` on the meta device, fold layout) its
    values from ``ckpt``: cut parameters their slice, expert-parallel blocks their hosted experts, the rest
    whole. Local."""
    config: Any = model.config
    head = shards.head_sites["gather"].rsplit(".", 1)[0]
    tied_head = f"{head}.weight" if getattr(config, "tie_word_embeddings", False) else None
    experts: dict[str, torch.Tensor] = {}
    for block in shards.moe_blocks:
        experts.update({f"{block.name}.{k}": v for k, v in _expert_params(ckpt, block, dtype).items()})
    for name, param in list(model.named_parameters()):
        if name in experts:
            value = experts.pop(name)
        else:
            key = f"{shards.embed_site}.weight" if name == tied_head else name
            value = ckpt.read(key, dtype=dtype, cut=shards.cuts.get(name))
        if value.shape != param.shape:
            raise ValueError(f"{ckpt.directory}: {name} is {tuple(value.shape)} in this rank's slice of the checkpoint "
                             f"but {tuple(param.shape)} in the model its config.json describes: the weights do not "
                             "belong to that config")
        owner, attr = name.rsplit(".", 1)
        model.get_submodule(owner)._parameters[attr] = nn.Parameter(value, requires_grad=param.requires_grad)
