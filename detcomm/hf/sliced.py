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

__all__ = ["Checkpoint", "meta_model", "fill", "check_tensors", "expected_tensors", "open_safetensors"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _unreadable(path: str, e: BaseException) -> ValueError:
    """The refusal of a safetensors file that does not open (truncated, corrupt, missing), naming the file."""
    return ValueError(f"{path}: the safetensors file cannot be read ({type(e).__name__}: {e}); a file cut short by an "
                      "interrupted download or copy reads like this: copy or download it again")


def open_safetensors(path: str) -> Any:
    """``safetensors.safe_open(path)`` (a context manager); a file that does not open is refused naming it."""
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: whatever it is, the file is named
        raise _unreadable(path, e) from e


class Checkpoint:
    """The safetensors tensors of a local checkpoint directory, read slice by slice. Local."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        index = os.path.join(directory, _INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.files: dict[str, str] = dict(json.load(f)["weight_map"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e}); it must be JSON with "
                                 "a 'weight_map' of tensor name -> file, as save_pretrained writes it") from e
        elif os.path.isfile(os.path.join(directory, _SINGLE)):
            with open_safetensors(os.path.join(directory, _SINGLE)) as f:
                self.files = {k: _SINGLE for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        else:
            raise ValueError(f"{directory}: no {_SINGLE} or {_INDEX}: sliced loading reads safetensors checkpoints; "
                             "pass sliced=False to load other formats through from_pretrained")
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def nbytes(self) -> int:
        """The bytes of the checkpoint's safetensors files."""
        return sum(os.path.getsize(os.path.join(self.directory, f)) for f in set(self.files.values()))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every stored tensor's full shape, from the files' headers (no tensor data is read); opens every file,
        so a truncated or unreadable one is refused here, naming it, before any slice is read."""
        if self._shapes is None:
            shapes: dict[str, tuple[int, ...]] = {}
            by_file: dict[str, list[str]] = {}
            for key, file in self.files.items():
                by_file.setdefault(file, []).append(key)
            for file, keys in sorted(by_file.items()):
                path = os.path.join(self.directory, file)
                with open_safetensors(path) as f:
                    present = set(f.keys())  # noqa: SIM118 (safe_open has no __iter__)
                    absent = [k for k in keys if k not in present]
                    if absent:
                        raise ValueError(f"{path}: the index ({_INDEX}) places {_names(absent)} in this file, which "
                                         "does not hold them: the index and the files are of different saves")
                    for k in keys:
                        shapes[k] = tuple(f.get_slice(k).get_shape())
            self._shapes = shapes
        return self._shapes

    def read(self, key: str, *, dtype: torch.dtype, cut: Cut | None = None) -> torch.Tensor:
        """Tensor ``key`` (its ``cut`` rows or columns; rows past its end are zeros) in ``dtype``."""
        if key not in self.files:
            raise ValueError(f"{self.directory}: the checkpoint has no tensor {key!r}; sliced loading reads transformers' "
                             "module names (what save_pretrained writes); pass sliced=False to load it through "
                             "from_pretrained")
        path = os.path.join(self.directory, self.files[key])
        with open_safetensors(path) as f:
            try:
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
            except Exception as e:  # noqa: BLE001 - a file changed or cut short since it was opened
                raise ValueError(f"{path}: reading tensor {key!r} failed ({type(e).__name__}: {e}): the file changed "
                                 "or is damaged; copy or download it again") from e
            # A copy in this process's memory: safetensors' tensors point into the file's (private, copy-on-write)
            # mapping, which would keep one mapping of the whole file alive per parameter, and let a rewrite of the
            # file in place change a parameter's bits under the server.
            return t.to(dtype, copy=True)


def _names(keys: list[str], most: int = 8) -> str:
    """``keys`` for a message: the first ``most`` of them and how many more."""
    shown = ", ".join(repr(k) for k in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


def _dtype_kwarg() -> str:
    """transformers' name of from_pretrained's dtype argument (checkpoints.py imports it from here)."""
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56


def meta_model(config: Any, *, dtype: torch.dtype) -> nn.Module:
    """transformers' ``AutoModelForCausalLM.from_config`` (eager attention, ``dtype``) with its parameters on the
    meta device and its buffers computed. Local."""
    import transformers
    from accelerate import init_empty_weights  # type: ignore[import-untyped]

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


def expected_tensors(model: nn.Module, shards: Shards, ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor ``fill`` reads for ``model`` (cut by ``shard_model``, fold layout) and the whole
    (unsharded) shape it must be stored with: the cut parameters' ``Cut.full``, the replicated parameters' own
    shapes, and every expert of every expert-parallel block (hosted on this rank or not, so that every rank
    checks the same tensors). Local."""
    config: Any = model.config
    head = shards.head_sites["gather"].rsplit(".", 1)[0]
    tied_head = f"{head}.weight" if getattr(config, "tie_word_embeddings", False) else None
    want: dict[str, tuple[int, ...]] = {}
    expert_params: set[str] = set()
    for block in shards.moe_blocks:
        router, (gate, up, down) = _expert_keys(ckpt, block)
        n, hidden, ffn = int(block.router.shape[0]), block.hidden, block.expert_ffn
        want[router] = (n, hidden)
        for e in range(n):
            want[gate.format(e=e)] = want[up.format(e=e)] = (ffn, hidden)
            want[down.format(e=e)] = (hidden, ffn)
        expert_params.update(f"{block.name}.{k}" for k in ("router", "gate_up", "down"))
    for name, param in model.named_parameters():
        if name in expert_params:
            continue
        key = f"{shards.embed_site}.weight" if name == tied_head else name
        cut = shards.cuts.get(name)
        want[key] = cut.full if cut is not None and cut.full else tuple(param.shape)
    return want


def check_tensors(model: nn.Module, shards: Shards, ckpt: Checkpoint) -> None:
    """Refuse a checkpoint whose tensors are not the model's: one missing, one the model has no parameter for, or
    one stored with another full shape than the config's unsharded parameter (a rank's slice of a larger tensor
    would load silently). Reads the files' headers only, before any slice is read, and checks every tensor on
    every rank, so every rank reaches the same verdict. Local; raises ValueError naming the tensors."""
    want = expected_tensors(model, shards, ckpt)
    stored = ckpt.shapes()
    missing = sorted(k for k in want if k not in stored)
    unexpected = sorted(k for k in stored if k not in want)
    shaped = sorted(k for k in want if k in stored and stored[k] != want[k])
    problems = []
    if shaped:
        problems.append("stored with another shape than the config's unsharded parameter: " + "; ".join(
            f"{k} is {stored[k]} in the checkpoint, {want[k]} in the model its config.json describes"
            for k in shaped[:8]) + (f" and {len(shaped) - 8} more" if len(shaped) > 8 else ""))
    if missing:
        problems.append(f"missing from the checkpoint: {_names(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {_names(unexpected)}")
    if problems:
        raise ValueError(f"{ckpt.directory}: the checkpoint's tensors do not belong to the model its config.json "
                         f"describes ({'; '.join(problems)}): use the config saved with these weights")


def fill(model: nn.Module, shards: Shards, ckpt: Checkpoint, *, dtype: torch.dtype) -> None:
    """Give every meta parameter of ``model`` (cut by ``shard_model`` on the meta device, fold layout) its
    values from ``ckpt``: cut parameters their slice, expert-parallel blocks their hosted experts, the rest
    whole, after ``check_tensors`` (every tensor's name and full shape). Local."""
    check_tensors(model, shards, ckpt)
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
        # An internal invariant once check_tensors passed (the full shapes are the config's); kept as a refusal
        # because a wrong slice would otherwise load silently.
        if value.shape != param.shape:
            raise ValueError(f"{ckpt.directory}: {name} is {tuple(value.shape)} in this rank's slice of the checkpoint "
                             f"but {tuple(param.shape)} in the model its config.json describes: the weights do not "
                             "belong to that config")
        owner, attr = name.rsplit(".", 1)
        model.get_submodule(owner)._parameters[attr] = nn.Parameter(value, requires_grad=param.requires_grad)
