"""transformers ``from_pretrained(tp_plan="auto")`` on the "detcomm" backend, unmodified: a Llama causal LM generates
greedily, and a request's logits are bit-identical alone and in a batch with other requests, at W = 3 (1-D TP
mesh) and on a (2, 2) mesh at W = 4 (TP x FSDP2, ``DistributedConfig(tp_size=2, fsdp_size=2)``).

What is made batch-invariant, and how:

* Local matmuls exact. Every linear weight is sparse, each nonzero a signed power of two. A column-parallel row
  (q, k, v, gate, up, lm_head) has two nonzeros; a row-parallel row (o_proj, down_proj) has one in each third of
  its input columns, so each TP rank's partial sum has one term at W = 3 and at most two at TP = 2. A product by
  a power of two is exact and a sum of two exact terms rounds once, so every local output is the same bits
  whatever GEMM kernel runs it (CPU GEMMs pick other kernels for one row than for three: a decode step alone
  is a matrix-vector product, batched it is not, and random weights change bits there with no collective).
* The rest is transformers' own per-row compute (embedding, RMSNorm, RoPE, eager attention, softmax, SiLU): one
  thread (``torch.set_num_threads(1)``), fp32, equal-length prompts (no padding, so each request's attention
  shapes are the same alone and batched), and every per-rank width a multiple of 32 floats, so no element
  falls into a vector loop's scalar tail in one batch and not in another.
* What is left is the row-parallel all-reduce (``dist.all_reduce`` on the TP group), three fp32 terms per
  element at W = 3. Its bits on detcomm are the fold's (the numpy oracle, tests/oracle.py, of the partials each
  rank recorded). gloo's ring all-reduce cuts a buffer into segments (at least 2W) by its byte size, so the rank
  order in which an element is summed moves with the buffer's length, i.e. with the batch: the negative control.

At TP = 2 an all-reduce sums two terms, which commute, so no backend's order shows (gloo gives identical logits
too); the (2, 2) mesh test proves the stack runs on the backend and that each TP reduction is the oracle's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

import oracle
from datagen import to_bits

pytest.importorskip("transformers")

H, F, V, HEADS, HEAD_DIM, LAYERS = 192, 384, 384, 6, 32, 2  # per-rank widths at TP = 2 and 3: multiples of 32
PROMPT, NEW = 8, 6  # prompt length (every request's), generated tokens
# Batches that hold request 0 (A), by request index: A first, A in the middle of five, A last.
BATCHES = ([0, 1, 2], [1, 0, 2, 3, 4], [1, 2, 0])


def _colwise(rows: int, cols: int, salt: int) -> torch.Tensor:
    """Two signed powers of two per row, half the columns apart."""
    w = torch.zeros(rows, cols)
    for j in range(rows):
        c = (7 * j + salt) % cols
        w[j, c] = (-1.0) ** (j + salt) * 2.0 ** ((j + salt) % 3 - 1)
        w[j, (c + cols // 2) % cols] = (-1.0) ** (j // 2) * 2.0 ** ((j // 3 + salt) % 3 - 1)
    return w


def _rowwise(rows: int, cols: int, salt: int) -> torch.Tensor:
    """One signed power of two per row in each third of the columns: one term per TP rank at TP = 3; at TP = 2
    the middle third's term sits in the first or the second half by row, so each half holds at most two."""
    w = torch.zeros(rows, cols)
    t = cols // 3
    for j in range(rows):
        for q in range(3):
            off = (5 * j + 3 * q + salt) % (t // 2) + (t // 2 if q == 1 and j % 2 else 0)
            w[j, q * t + off] = (-1.0) ** (j + q) * 2.0 ** ((j + q + salt) % 3 - 1)
    return w


def write_checkpoint(directory: str) -> str:
    """A 2-layer Llama (6 heads, 6 KV heads: every head count divides by 2 and 3) with the weights above and a
    random embedding, written by ``save_pretrained`` (call it before any process group exists)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
                                   tie_word_embeddings=False, max_position_embeddings=64)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for name, mod in model.named_modules():
                if isinstance(mod, torch.nn.Linear):
                    make = _rowwise if name.endswith(("o_proj", "down_proj")) else _colwise
                    mod.weight.copy_(make(mod.out_features, mod.in_features, sum(map(ord, name)) % 11))
            model.model.embed_tokens.weight.normal_()
    model.save_pretrained(directory)
    return directory


def _init(rank: int, w: int, store: str, backend: str) -> None:
    """Make ``backend`` the default group (the cluster starts on gloo), and set the variables torchrun would."""
    import torch.distributed as dist

    import detcomm.dist_backend  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(w))
    if dist.get_backend() != backend:
        dist.destroy_process_group()
        dist.init_process_group(backend, store=dist.FileStore(store, w), rank=rank, world_size=w)


@contextmanager
def _recorded_all_reduces() -> Iterator[list[dict[str, Any]]]:
    """Every ``dist.all_reduce`` the model makes inside: the group's ranks, this rank's input bits and the
    result's bits. The call itself goes to the group unchanged (transformers' row-parallel layers call
    ``dist.all_reduce``). Calls from detcomm's own modules (the backend's communicator: its self-check verdicts,
    made once at the group's first reduction) go through unrecorded."""
    import sys

    import torch.distributed as dist

    calls: list[dict[str, Any]] = []
    real = dist.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if str(sys._getframe(1).f_globals.get("__name__", "")).startswith("detcomm."):
            return real(tensor, *args, **kwargs)
        before = to_bits(tensor).copy()  # to_bits shares the tensor's memory, which the call overwrites
        out = real(tensor, *args, **kwargs)
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        calls.append({"ranks": tuple(dist.get_process_group_ranks(group or dist.group.WORLD)),
                      "input": before, "output": to_bits(tensor).copy()})
        return out

    dist.all_reduce = spy
    try:
        yield calls
    finally:
        dist.all_reduce = real


def job_generate(rank: int, w: int, store: str, backend: str, ckpt: str, mesh: str) -> dict[str, Any]:
    """Load with transformers' TP plan on a default ``backend`` group, generate for request A alone and in each
    batch of ``BATCHES``; return A's logit bits and tokens per run, and the recorded all-reduces."""
    import torch.distributed as dist
    import transformers

    _init(rank, w, store, backend)
    kwargs: dict[str, Any] = dict(dtype=torch.float32, attn_implementation="eager")
    if mesh == "tp":
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, tp_plan="auto", **kwargs)
    else:
        from transformers.distributed import DistributedConfig

        model = transformers.AutoModelForCausalLM.from_pretrained(
            ckpt, distributed_config=DistributedConfig(tp_plan="auto", tp_size=2, fsdp_size=2), **kwargs)
    tp_group = model._device_mesh.get_group("tp")
    ids = torch.randint(0, V, (5, PROMPT), generator=torch.Generator().manual_seed(5))
    gen = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True,
               pad_token_id=0, eos_token_id=None)
    runs = []
    with torch.no_grad(), _recorded_all_reduces() as calls:
        for rows in ([0], *BATCHES):
            out = model.generate(ids[rows], attention_mask=torch.ones_like(ids[rows]), **gen)
            at = rows.index(0)
            runs.append({"logits": to_bits(torch.stack(out.logits)[:, at].contiguous()),
                         "tokens": out.sequences[at].tolist()})
    return {"tp_backend": dist.get_backend(tp_group), "tp_size": dist.get_world_size(tp_group), "runs": runs,
            "calls": calls}


def _oracle_misses(results: list[dict[str, Any]]) -> int:
    """Elements, over every recorded all-reduce of every rank, whose result is not the fold oracle's of the
    group's inputs in rank order (each rank made the same calls in the same order)."""
    n = len(results[0]["calls"])
    assert n > 0 and all(len(r["calls"]) == n for r in results), [len(r["calls"]) for r in results]
    misses = 0
    for k in range(n):
        for r in results:
            ranks = r["calls"][k]["ranks"]
            want = oracle.fold_oracle([results[q]["calls"][k]["input"] for q in ranks], "float32")
            misses += int((r["calls"][k]["output"] != want).sum())
    return misses


def _differing(results: list[dict[str, Any]]) -> list[int]:
    """Per rank: A's logit elements that differ between A alone and A in each batch, summed over the batches."""
    return [sum(int((run["logits"] != r["runs"][0]["logits"]).sum()) for run in r["runs"][1:]) for r in results]


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory):  # type: ignore[no-untyped-def]
    from detcomm._spawn import LocalCluster

    base = tmp_path_factory.mktemp("hf_tp3")
    ckpt = write_checkpoint(str(base / "llama"))
    with LocalCluster(3, pg_timeout_s=60.0) as c:
        yield c, ckpt, str(base)


def test_hf_tp_plan_batch_invariant(cluster3) -> None:  # type: ignore[no-untyped-def]
    """W = 3: A's logits bit-identical alone and in every batch, the same tokens, the same bits on every rank,
    and every row-parallel all-reduce equal to the fold oracle of the ranks' partials."""
    c, ckpt, base = cluster3
    res = c.run(job_generate, os.path.join(base, "store_detcomm"), "detcomm", ckpt, "tp")
    assert all(r["tp_backend"] == "detcomm" and r["tp_size"] == 3 for r in res)
    assert _differing(res) == [0, 0, 0]
    for r in res:
        assert all(run["tokens"] == r["runs"][0]["tokens"] for run in r["runs"])
        assert len(r["runs"][0]["tokens"]) == PROMPT + NEW
        assert all(np.array_equal(run["logits"], res[0]["runs"][0]["logits"]) for run in r["runs"])
    assert len(res[0]["calls"]) == 2 * LAYERS * NEW * (1 + len(BATCHES))  # o_proj and down_proj, every step
    assert _oracle_misses(res) == 0


def test_hf_tp_plan_gloo_moves(cluster3) -> None:  # type: ignore[no-untyped-def]
    """Negative control: the same model and requests on a default gloo group give A other logit bits in a batch
    than alone, and gloo's all-reduces miss the fold oracle; the local compute is the same code."""
    c, ckpt, base = cluster3
    res = c.run(job_generate, os.path.join(base, "store_gloo"), "gloo", ckpt, "tp")
    assert all(r["tp_backend"] == "gloo" for r in res)
    assert all(d > 0 for d in _differing(res)), _differing(res)
    assert _oracle_misses(res) > 0


def test_hf_tp_plan_fsdp_tp_2x2_mesh(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """W = 4, ``DistributedConfig(tp_plan="auto", tp_size=2, fsdp_size=2)``: the (fsdp, tp) mesh on the backend,
    A's logits bit-identical alone and batched on every rank, each TP all-reduce the oracle's."""
    from detcomm._spawn import LocalCluster

    ckpt = write_checkpoint(str(tmp_path / "llama"))
    with LocalCluster(4, pg_timeout_s=60.0) as c:
        res = c.run(job_generate, str(tmp_path / "store"), "detcomm", ckpt, "fsdp_tp")
    assert all(r["tp_backend"] == "detcomm" and r["tp_size"] == 2 for r in res)
    assert [r["calls"][0]["ranks"] for r in res] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert _differing(res) == [0, 0, 0, 0]
    for r in res:
        assert all(run["tokens"] == r["runs"][0]["tokens"] for run in r["runs"])
        assert all(np.array_equal(run["logits"], res[0]["runs"][0]["logits"]) for run in r["runs"])
    assert _oracle_misses(res) == 0
