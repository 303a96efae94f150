"""Loading a local transformers checkpoint, and the tiny seeded checkpoints the probe and CI use.

``load_causal_lm`` goes through transformers' own ``AutoModelForCausalLM.from_pretrained`` (eager attention,
the requested dtype) and refuses families ``detcomm.hf`` does not shard. ``write_tiny_checkpoint`` builds a
real config class of a supported family (``TINY_CONFIGS``), draws its weights from a seed, and writes them
with ``save_pretrained``, so the probe loads them back through the same path as a downloaded checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..dtypes import name_of
from .shard import SUPPORTED_FAMILIES
from .sliced import _dtype_kwarg

__all__ = ["TINY_CONFIGS", "MOE_TINY_CONFIGS", "tiny_config", "write_tiny_checkpoint", "load_causal_lm",
           "checkpoint_config", "DTYPE_NAMES"]

# The dtypes a detcomm.hf model runs in (names of detcomm.dtypes' table; from_name gives the torch dtype).
DTYPE_NAMES = ("float32", "bfloat16")

# Small enough for W=4 ranks on two CPU cores; grouped-query attention (24 heads, 12 KV heads) so every W
# in {1, 2, 3, 4, 6, 12} divides both; Mistral's sliding window (48) binds inside the probe's contexts; Qwen2 keeps its
# q/k/v biases; the Qwen models tie the LM head to the embedding, as the small released ones do.
_COMMON: dict[str, Any] = dict(vocab_size=1024, hidden_size=192, intermediate_size=384, num_hidden_layers=2,
                               num_attention_heads=24, num_key_value_heads=12, head_dim=8,
                               max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.05)
_MOE: dict[str, Any] = dict(num_experts_per_tok=4, output_router_logits=False, router_aux_loss_coef=0.0)
# Grouped-query attention with fewer KV heads than ranks (4 attention heads over 2 KV heads, head_dim 48): at W = 4
# each KV head is replicated over 2 ranks (detcomm.hf.shard).
_KV2: dict[str, Any] = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=48)
MOE_TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-tiny": ("MixtralConfig", dict(_MOE, tie_word_embeddings=False, num_local_experts=8,
                                           num_experts_per_tok=2, intermediate_size=96, sliding_window=None)),
    "qwen2-moe-tiny": ("Qwen2MoeConfig", dict(_MOE, tie_word_embeddings=True, num_experts=8, moe_intermediate_size=96,
                                              shared_expert_intermediate_size=192, norm_topk_prob=False,
                                              decoder_sparse_step=1, mlp_only_layers=[0])),
    "qwen3-moe-tiny": ("Qwen3MoeConfig", dict(_MOE, tie_word_embeddings=True, num_experts=8, moe_intermediate_size=96,
                                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
}
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "mistral-tiny": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=48)),
    "qwen2-tiny": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3-tiny": ("Qwen3Config", dict(tie_word_embeddings=True)),
    # MoE (detcomm.hf.moe_block): 8 experts; Mixtral top-2 (renormalized); Qwen2-MoE top-4 unnormalized with
    # its sigmoid-gated shared expert and a dense layer 0; Qwen3-MoE top-4 renormalized (norm_topk_prob).
    **MOE_TINY_CONFIGS,
    "qwen3-kv2-tiny": ("Qwen3Config", dict(_KV2, tie_word_embeddings=True)),
    "qwen2-moe-kv2-tiny": ("Qwen2MoeConfig", dict(MOE_TINY_CONFIGS["qwen2-moe-tiny"][1], **_KV2)),
}


def tiny_config(name: str) -> Any:
    """The transformers config object of a tiny configuration (``TINY_CONFIGS``)."""
    import transformers

    if name not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny config {name!r}; known: {', '.join(TINY_CONFIGS)}")
    cls, extra = TINY_CONFIGS[name]
    return getattr(transformers, cls)(**{**_COMMON, **extra})


def write_tiny_checkpoint(name: str, directory: str, *, seed: int, max_shard_size: str | None = None) -> str:
    """Draw the weights of tiny config ``name`` from ``seed`` (CPU, fp32) and ``save_pretrained`` them into
    ``directory`` (in several safetensors files and an index when ``max_shard_size``, e.g. "200KB", is smaller
    than the model); returns the directory. Local. transformers (5.x) writes only on rank 0 of an initialized
    torch.distributed group, so call it before the group exists (each rank its own copy) or on one rank of
    one node."""
    import torch.distributed as dist
    import transformers

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        raise ValueError("write_tiny_checkpoint on rank != 0 of an initialized process group: transformers would "
                           "write nothing; call it before init_process_group / detcomm.init, or on rank 0 only")

    config = tiny_config(name)
    config._attn_implementation = "eager"
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(directory, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
    return directory


def checkpoint_config(directory: str, *, dtype: torch.dtype) -> Any:
    """The transformers config of a local checkpoint directory, after checking the directory, the dtype and the
    family. Local."""
    import transformers

    if not os.path.isdir(directory):
        raise ValueError(f"{directory!r} is not a directory: pass a local checkpoint directory (config.json and weights)")
    if name_of(dtype) not in DTYPE_NAMES:
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    config = transformers.AutoConfig.from_pretrained(directory)
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ValueError(f"{directory}: model_type {config.model_type!r} is not supported by detcomm.hf; "
                         f"supported: {', '.join(SUPPORTED_FAMILIES)}")
    return config


def load_causal_lm(directory: str, *, dtype: torch.dtype) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(directory)`` in ``dtype`` with eager attention, on the CPU,
    after checking the family: the whole model (``detcomm.hf.sliced`` reads only a rank's slices). Local.

    Refuses (ValueError) what from_pretrained only warns about: a tensor the model has and the checkpoint lacks
    (from_pretrained would give it a fresh random initialisation), one the checkpoint has and the model does not,
    and one of another shape, naming them; and a safetensors file that does not open, naming the file."""
    import transformers

    from .sliced import _INDEX, _SINGLE, Checkpoint, _names

    checkpoint_config(directory, dtype=dtype)
    if os.path.isfile(os.path.join(directory, _INDEX)) or os.path.isfile(os.path.join(directory, _SINGLE)):
        Checkpoint(directory).shapes()  # every file's header: a truncated file is refused naming it
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                                    output_loading_info=True,
                                                                    **{_dtype_kwarg(): dtype})
    model, info = loaded  # (model, loading info): what from_pretrained only warns about, checked here
    problems = []
    for kind, what in (("missing_keys", "missing from the checkpoint (from_pretrained would initialise them at "
                        "random)"), ("unexpected_keys", "in the checkpoint but not in the model"),
                       ("mismatched_keys", "stored with another shape than the model's")):
        keys = sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(kind) or ())
        if keys:
            problems.append(f"{what}: {_names(keys)}")
    if info.get("error_msgs"):
        problems.append("from_pretrained's errors: " + "; ".join(map(str, info["error_msgs"])))
    if problems:
        raise ValueError(f"{directory}: the checkpoint's tensors do not belong to the model its config.json describes "
                         f"({'; '.join(problems)}): use the config saved with these weights")
    return model.eval()
