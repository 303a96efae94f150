"""transformers causal LMs (Llama, Mistral, Qwen2, Qwen3; Mixtral, Qwen2-MoE, Qwen3-MoE with expert-parallel
MoE blocks) served tensor-parallel over detcomm.

    import detcomm, detcomm.hf                  # every rank, e.g. under detcomm-launch --nproc 4 --numerics rl-bitwise
    detcomm.init()
    lm = detcomm.hf.load("/path/to/checkpoint", dtype=torch.bfloat16)
    [(tokens, logprobs)] = lm.generate([prompt_ids], max_new_tokens=32)

``load`` builds the model on the meta device and reads each rank's slices from the safetensors files
(``detcomm.hf.sliced``; ``sliced=False``: transformers' ``from_pretrained``, then cut), shards it (``detcomm.hf.shard``:
column-parallel q/k/v/gate/up, row-parallel o_proj/down_proj through detcomm sites named after the modules,
vocabulary-parallel embedding and LM head; sparse MoE blocks expert-parallel, ``detcomm.hf.moe_block``) and wraps it in the fixed-width engine (``detcomm.hf.engine``,
whose docstring says how local compute is made batch-invariant and what that costs). Needs the ``hf`` extra
(``pip install 'detcomm[hf]'``).
"""

from __future__ import annotations

from typing import Any

import torch

from .agree import agreed
from .checkpoints import TINY_CONFIGS, checkpoint_config, load_causal_lm, write_tiny_checkpoint
from .engine import ServingConfig, StepLogits, TPCausalLM
from .moe_block import EPConfig
from .shard import SUPPORTED_FAMILIES, check_divisible, world_sizes
from .sliced import Checkpoint, meta_model

__all__ = ["load", "TPCausalLM", "EPConfig", "ServingConfig", "StepLogits", "SUPPORTED_FAMILIES", "TINY_CONFIGS",
           "check_divisible", "world_sizes", "load_causal_lm", "write_tiny_checkpoint", "Checkpoint", "meta_model"]


def load(directory: str, *, dtype: torch.dtype = torch.bfloat16, serving: ServingConfig | None = None,
         route: str | None = None, ep: EPConfig | None = None, sliced: bool = True) -> TPCausalLM:
    """Load a local checkpoint directory and shard it over the detcomm group. Collective: call on every rank
    after ``detcomm.init``. ``sliced`` (default): the model is built on the meta device and each rank reads
    only its slices from the safetensors files (``detcomm.hf.sliced``; docs/hf.md); False: the whole model
    through ``from_pretrained``, then cut (the same bits, W times the host memory). ``serving``: the step geometry (default ``ServingConfig()``: 64 rows a step, at most 128
    tokens a request, a paged KV cache of 256 blocks of 16 positions shared by the live requests). ``route`` forces the route of the sum sites ("native": no bitwise claim). ``ep``: where
    an MoE model's experts live (``EPConfig(placement=detcomm.moe.Placement...)``; default every expert on
    every rank)."""
    def local() -> tuple[Any, Checkpoint | None]:
        if not sliced:
            return load_causal_lm(directory, dtype=dtype), None
        return meta_model(checkpoint_config(directory, dtype=dtype), dtype=dtype), Checkpoint(directory)

    # Every local step of the load ends in one verdict for the group (detcomm.hf.agree): a rank that cannot read
    # the checkpoint raises, and so does every peer, with the same message, instead of waiting in the first
    # collective. A refused checkpoint raises ValueError on every rank, naming the rank(s), the file or tensor.
    # (The directory is in each rank's own message: ranks may be given different paths.)
    model, checkpoint = agreed("detcomm.hf.load", local)
    return TPCausalLM(model, serving or ServingConfig(), route=route, ep=ep, checkpoint=checkpoint)
