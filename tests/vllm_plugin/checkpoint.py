"""Tiny checkpoints for the vLLM tests, built locally (no hub): ``python checkpoint.py llama|mixtral DIR``.

A real transformers config class, weights drawn from one seed, written with ``save_pretrained``, and a local
word-level tokenizer (ids 3..1023 are the words ``w3`` ... ``w1023``). Sizes: vLLM's CPU attention takes head
size 32; 8 query and 4 KV heads so TP = 1, 2 and 4 divide both; K <= 512 everywhere, below the K >= 2048 at which
vLLM's oneDNN GEMM takes its separate M = 1 path (docs/vllm.md).
"""

from __future__ import annotations

import sys

import torch


def main(kind: str, directory: str) -> None:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    common = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=512, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, **common)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        raise SystemExit(f"unknown checkpoint kind {kind!r}: llama or mixtral")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    model.to(torch.float32).save_pretrained(directory)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 1024)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(directory)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
