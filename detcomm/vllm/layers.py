"""vLLM's parallel layers with detcomm's reductions, registered out of tree (``PluggableLayer.register_oot``).

vLLM instantiates a ``PluggableLayer`` through ``__new__``, which looks the class name up in its out-of-tree
registry: registering these classes under vLLM's names makes every model vLLM builds use them, unmodified.

Layout "fold" (the default) keeps vLLM's GEMMs and weights untouched and changes only the sum:

* ``RowParallelLinear`` (o_proj, down_proj, a MoE block's shared-expert down_proj, ...): the partial products
  vLLM computes (rank 0's with the bias, as vLLM adds it) are summed by detcomm's all-reduce at a site named after
  the layer (vLLM's ``prefix``), instead of ``tensor_model_parallel_all_reduce``;
* ``VocabParallelEmbedding``: the masked lookup's all-reduce, likewise (one rank owns each row: the sum is exact,
  detcomm makes the signed zeros canonical as well).

Layout "tree" (``DETCOMM_VLLM_LAYOUT=tree``: TP-size invariance, docs/spec.md §9.1) also fixes every shape a GEMM
sees, whatever the TP size W:

* a row-parallel layer splits its K inputs into V fixed virtual shards (``DETCOMM_VLLM_VIRTUAL_SHARDS``, default
  8): one fp32 GEMM [T, K/V] x [K/V, N] per shard (on fixed tiles of ROW_TILE rows, so a row's bits do not
  follow the batch either), this rank's V/W partials folded by the fixed balanced tree and
  the W subtree roots by detcomm's tree site; the bias is added after the sum (the same at every W);
* column-parallel layers (QKV, gate_up, ...) and the LM head compute their output columns in fixed blocks (one
  GEMM per block of width gcd(output_i / V)), so no GEMM's N follows W.
The tree layout runs its own fp32 GEMMs (``torch.matmul``) instead of vLLM's prepacked oneDNN handles, and serves
unquantized models only.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from vllm.model_executor.custom_op import PluggableLayer
from vllm.model_executor.layers import linear as _linear
from vllm.model_executor.layers import vocab_parallel_embedding as _vocab

from ..numerics.tree import tree_fold
from . import settings as _settings
from . import tp

__all__ = ["register_layers", "REGISTERED"]

REGISTERED: dict[str, type] = {}


# The tree layout's GEMMs run on fixed tiles of this many rows (the last one zero-padded): a CPU GEMM takes
# other code paths for M < 4 (measured with torch 2.13's CPU matmul: rows of a 1-3-row product differ from the
# same rows inside a larger one), so a decode step of one request would differ from the same row in a batch.
ROW_TILE = 16


def tiled_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for a 2-D ``x`` of any row count, every row computed inside a [ROW_TILE, K] x [K, N] product
    (one batched GEMM over the tiles), so a row's bits do not depend on how many rows share the call."""
    t, k = x.shape
    tiles = -(-t // ROW_TILE)
    xp = x.new_zeros(tiles * ROW_TILE, k)
    xp[:t] = x
    return torch.bmm(xp.view(tiles, ROW_TILE, k), w.expand(tiles, *w.shape)).reshape(tiles * ROW_TILE, -1)[:t]


def _site_group(layer: Any, what: str) -> tp.TPGroup:
    g = tp.current()
    if g is None:
        raise RuntimeError(f"detcomm: vLLM built {what} {layer.prefix!r} at TP size {layer.tp_size} but its TP group "
                           "has no detcomm communicator: the platform plugin is not active (docs/vllm.md 'Checking "
                           "it is on')")
    return g


class _TreeLinearMethod(_linear.UnquantizedLinearMethod):
    """The tree layout's GEMMs: keeps the weight (vLLM's CPU method would pack it and drop it) and precomputes the
    fixed fp32 blocks the layer computes with."""

    def __init__(self, *, rows_of: str, parts: int) -> None:
        super().__init__()
        self.rows_of, self.parts = rows_of, parts  # "k": split K into `parts` shards; "n": N into column blocks

    def process_weights_after_loading(self, layer: Any) -> None:
        w = layer.weight.data  # [N_rank, K_rank]
        if self.rows_of == "k":
            kv = w.shape[1] // self.parts
            layer.detcomm_blocks = [w[:, j * kv:(j + 1) * kv].to(torch.float32).t().contiguous()
                                    for j in range(self.parts)]
        else:
            b = self.parts
            layer.detcomm_blocks = [w[j:j + b].t().contiguous() for j in range(0, w.shape[0], b)]

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        assert self.rows_of == "n", "row-parallel tree layers compute in their own forward"
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.cat([tiled_matmul(x2, w) for w in layer.detcomm_blocks], dim=-1).reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


def _require_unquantized(layer: Any) -> None:
    if type(layer.quant_method) is not _linear.UnquantizedLinearMethod:
        raise ValueError(f"detcomm: DETCOMM_VLLM_LAYOUT=tree serves unquantized models; {layer.prefix!r} uses "
                         f"{type(layer.quant_method).__name__}: unset DETCOMM_VLLM_LAYOUT (the fold layout keeps "
                         "vLLM's kernels, quantized ones included)")


class RowParallelLinear(_linear.RowParallelLinear):
    """vLLM's row-parallel layer; the sum of the TP partials is detcomm's (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        s = _settings.read()
        self.detcomm_site: str | None = None
        reduce = bool(self.reduce_results)  # vLLM sets it in __init__ (untyped for mypy)
        self.detcomm_tree = s.layout == "tree" and reduce
        self.detcomm_reduce = reduce and self.tp_size > 1
        if self.detcomm_tree:
            _require_unquantized(self)
            v, k, w = s.virtual_shards, self.input_size, self.tp_size
            if v % w or k % v:
                raise ValueError(f"detcomm: {self.prefix!r}: the tree layout's {v} virtual shards must tile K={k} and "
                                 f"divide by the TP size {w}; set DETCOMM_VLLM_VIRTUAL_SHARDS to a power of two "
                                 f"that divides {k} and is a multiple of {w}")
            self.detcomm_v = v
            self.quant_method = _TreeLinearMethod(rows_of="k", parts=v // w)
        if self.detcomm_reduce:
            g = _site_group(self, "the row-parallel layer")
            self.detcomm_site = self.prefix
            g.declare(self.prefix, dtype=self.params_dtype, shape=(self.output_size,),
                      virtual_shards=self.detcomm_v if self.detcomm_tree else None)
            # vLLM's forward must not all-reduce as well: its own call would run after detcomm's.
            setattr(self, "reduce_results", False)  # noqa: B010  (vLLM's attribute, untyped for mypy)

    def forward(self, input_: torch.Tensor) -> Any:
        if self.detcomm_tree:
            return self._tree_forward(input_)
        out = super().forward(input_)
        if self.detcomm_site is None:
            return out
        if self.return_bias:
            y, b = out
            return torch.ops.detcomm.vllm_all_reduce(y, self.detcomm_site), b
        return torch.ops.detcomm.vllm_all_reduce(out, self.detcomm_site)

    def _tree_forward(self, input_: torch.Tensor) -> Any:
        if not self.input_is_parallel:
            input_ = input_.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        shape = input_.shape
        x = input_.reshape(-1, shape[-1]).to(torch.float32)
        kv = self.input_size // self.detcomm_v
        # One fp32 GEMM of one shape per virtual shard, whatever W and the row count.
        parts = torch.stack([tiled_matmul(x[:, j * kv:(j + 1) * kv].contiguous(), w)
                             for j, w in enumerate(self.detcomm_blocks)])
        if self.detcomm_site is not None:
            y = torch.ops.detcomm.vllm_all_reduce(parts, self.detcomm_site)
        else:  # TP = 1: the whole tree is local
            y = tree_fold(parts, self.params_dtype)
        y = y.reshape(*shape[:-1], self.output_size)
        if self.bias is not None and not self.skip_bias_add:
            y = y + self.bias
        if not self.return_bias:
            return y
        return y, (self.bias if self.skip_bias_add else None)


def _column_block(layer: Any, v: int) -> int:
    """The tree layout's column block width: gcd over the layer's logical outputs of output_i / V, so every
    rank's part of every output is whole blocks and the width does not depend on W."""
    sizes = _logical_outputs(layer)
    if any(n % v for n in sizes):
        raise ValueError(f"detcomm: {layer.prefix!r}: the tree layout's {v} column blocks must tile each output "
                         f"{sizes}; set DETCOMM_VLLM_VIRTUAL_SHARDS to a power of two dividing all of them")
    return math.gcd(*(n // v for n in sizes))


def _logical_outputs(layer: Any) -> list[int]:
    if isinstance(layer, _linear.QKVParallelLinear):
        if layer.num_kv_head_replicas != 1:
            raise ValueError(f"detcomm: {layer.prefix!r}: the tree layout needs the TP size to divide the KV heads "
                             f"({layer.total_num_kv_heads}); KV heads replicated over ranks change the GEMM shapes")
        q = layer.total_num_heads * layer.head_size
        kv = layer.total_num_kv_heads * layer.head_size
        vv = layer.total_num_kv_heads * getattr(layer, "v_head_size", layer.head_size)
        return [q, kv, vv]
    return list(getattr(layer, "output_sizes", [layer.output_size]))


def _blocked(base: type) -> type:
    class Blocked(base):  # type: ignore[misc,valid-type]
        __doc__ = f"vLLM's {base.__name__}; in the tree layout its output columns in fixed blocks."

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            s = _settings.read()
            if s.layout == "tree":
                _require_unquantized(self)
                self.quant_method = _TreeLinearMethod(rows_of="n", parts=_column_block(self, s.virtual_shards))

    Blocked.__name__ = Blocked.__qualname__ = base.__name__
    return Blocked


class VocabParallelEmbedding(_vocab.VocabParallelEmbedding):
    """vLLM's vocabulary-parallel embedding; the lookup's all-reduce is detcomm's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.detcomm_site: str | None = None
        # A layer on a group of its own (parallel_group) keeps it: that group's communicator is not the TP one.
        reduce = bool(self.reduce_results)  # vLLM sets it in __init__ (untyped for mypy)
        if reduce and self.tp_size > 1 and getattr(self, "parallel_group", None) is None:
            g = _site_group(self, "the vocabulary-parallel embedding")
            # vLLM's embedding does not keep its prefix: read it from the call (a model that passes none gets a
            # name in declaration order, the same on every rank).
            prefix = (inspect.signature(_vocab.VocabParallelEmbedding.__init__).bind(self, *args, **kwargs)
                      .arguments.get("prefix") or f"vocab_parallel_embedding.{len(g.sites)}")
            self.detcomm_site = prefix
            g.declare(prefix, dtype=self.params_dtype, shape=(self.embedding_dim,))
            setattr(self, "reduce_results", False)  # noqa: B010  (vLLM's attribute, untyped for mypy)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        out = super().forward(input_)
        if self.detcomm_site is None:
            return out
        return torch.ops.detcomm.vllm_all_reduce(out, self.detcomm_site)


def register_layers(settings: _settings.Settings) -> None:
    """Register the plugin's layers with vLLM (idempotent: vLLM may load the plugin more than once)."""
    if REGISTERED:
        return
    classes: dict[str, type] = {"RowParallelLinear": RowParallelLinear,
                                "VocabParallelEmbedding": VocabParallelEmbedding}
    if settings.layout == "tree":
        for base in (_linear.ColumnParallelLinear, _linear.MergedColumnParallelLinear, _linear.QKVParallelLinear):
            classes[base.__name__] = _blocked(base)
    for name, cls in classes.items():
        PluggableLayer.register_oot(cls, name=name)
        REGISTERED[name] = cls
