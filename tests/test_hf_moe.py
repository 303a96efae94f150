"""Expert-parallel HF MoE blocks (detcomm/hf/moe_block.py) on real spawned gloo ranks, for Mixtral, Qwen2-MoE
(shared expert with its sigmoid gate) and Qwen3-MoE tiny checkpoints:

* the gating is transformers' own router, bit for bit (local);
* a row's block output is bitwise the oracle built from transformers' own modules (its router, its expert
  module on the row padded to one block, its shared expert) and the numpy slot-order fold (tests/moe_oracle.py),
  for every placement (every expert on every rank, and random placements with replicas), row count and row
  offset, at W = 2, 3, 4; and close to transformers' own block output (which sums in another order);
* negative control: the rank-order combine (numerics auto) moves bits between placements/batches at W >= 3.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import moe_oracle  # noqa: E402
from datagen import to_bits  # noqa: E402
from detcomm.hf.checkpoints import MOE_TINY_CONFIGS, write_tiny_checkpoint  # noqa: E402

if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("the oracle calls transformers >= 5's router and expert modules", allow_module_level=True)

T_PAD, BLOCK, N_PROBE = 64, 16, 12
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (label, placement seed or None for every expert on every rank, buffer layout seed)
CONFIGS = (("replicated", None, 0), ("placement-a", 11, 1), ("placement-b", 29, 2))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:  # noqa: ANN001
    return {name: write_tiny_checkpoint(name, str(tmp_path_factory.mktemp(name)), seed=7) for name in MOE_TINY_CONFIGS}


def _probe_rows(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(N_PROBE, hidden, generator=torch.Generator().manual_seed(5)).to(dtype)


def _buffer(probe: torch.Tensor, layout: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """A [T_PAD, H] step buffer: the probe rows at random offsets among random real rows (``rows`` of them),
    random filler after; returns (buffer, rows, the probe rows' offsets)."""
    g = torch.Generator().manual_seed(100 + layout)
    rows = int(torch.randint(N_PROBE, T_PAD + 1, (1,), generator=g)) if layout else N_PROBE
    buf = torch.randn(T_PAD, probe.shape[1], generator=g).to(probe.dtype)
    where = torch.randperm(rows, generator=g)[:N_PROBE]
    buf[where] = probe
    return buf, rows, where


def _moe_block(model):  # type: ignore[no-untyped-def]
    from detcomm.hf.moe_block import moe_block_of

    return moe_block_of(model.model.layers[-1])[1]


def job_blocks(rank: int, w: int, dirs: dict[str, str], numerics: str, orders: tuple[str, ...]) -> dict:
    """Every (family, dtype, config, order): the probe rows' output bits from an EPMoEBlock on this group."""
    import detcomm
    from detcomm.hf import EPConfig, load_causal_lm
    from detcomm.hf.layers import StepRows
    from detcomm.hf.moe_block import EPMoEBlock, num_experts
    from detcomm.moe import Placement

    torch.set_num_threads(1)
    detcomm.init(numerics=numerics)
    out: dict = {}
    try:
        for name, directory in dirs.items():
            for dname, dtype in DTYPES.items():
                model = load_causal_lm(directory, dtype=dtype)
                block, E = _moe_block(model), num_experts(model.config)
                if numerics == "rl-bitwise":  # refused before any step: the rank-order combine, a wrong placement
                    with pytest.raises(ValueError, match="combine_order='rank'.*numerics='auto'"):
                        EPMoEBlock(block, name="refused", family=model.config.model_type,
                                   ep=EPConfig(combine_order="rank"), rank=rank, world=w, step=StepRows())
                    with pytest.raises(ValueError, match=f"the placement is for {E} experts over {w + 1} ranks"):
                        EPMoEBlock(block, name="refused", family=model.config.model_type,
                                   ep=EPConfig(placement=Placement.round_robin(E, w + 1)), rank=rank, world=w,
                                   step=StepRows())
                probe = _probe_rows(model.config.hidden_size, dtype)
                step = StepRows()
                for label, pseed, layout in CONFIGS:
                    placement = None if pseed is None else Placement.random(E, w, seed=pseed, max_replicas=min(2, w))
                    for order in orders:
                        ep = EPMoEBlock(block, name=f"{name}.{dname}.{label}.{order}", family=model.config.model_type,
                                        ep=EPConfig(placement=placement, block=BLOCK, combine_order=order), rank=rank,
                                        world=w, step=step)
                        ep.declare(dtype=dtype, max_rows=T_PAD)
                        buf, rows, where = _buffer(probe, layout)
                        step.rows = rows
                        with torch.no_grad():
                            got = ep(buf)
                        step.rows = None
                        out[(name, dname, label, order)] = to_bits(got[where])
    finally:
        detcomm.shutdown()
    return out


def _reference(directory: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager",
                                                              experts_implementation="eager")
    return model.eval()


@functools.cache
def _oracle(directory: str, dname: str) -> tuple[np.ndarray, torch.Tensor]:
    """From transformers' own modules only: the probe rows' slot-order fold (bits), and transformers' own
    block output for them."""
    dtype = DTYPES[dname]
    model = _reference(directory, dtype)
    block = _moe_block(model)
    probe = _probe_rows(model.config.hidden_size, dtype)
    buf = torch.zeros(T_PAD, probe.shape[1], dtype=dtype)
    buf[:N_PROBE] = probe
    with torch.no_grad():
        _, weights, ids = block.gate(buf)  # transformers' router on the fixed-width buffer
        weights, ids = weights[:N_PROBE], ids[:N_PROBE]
        ys = torch.zeros(N_PROBE, ids.shape[1], probe.shape[1], dtype=dtype)
        for t in range(N_PROBE):
            for j, e in enumerate(ids[t].tolist()):
                x = torch.zeros(BLOCK, probe.shape[1], dtype=dtype)
                x[0] = probe[t]
                one = torch.ones(BLOCK, 1, dtype=torch.float32)
                ys[t, j] = block.experts(x, torch.full((BLOCK, 1), e), one)[0]  # zeros + 1.0 * y: y exactly
        shared = None
        if hasattr(block, "shared_expert"):
            shared = (torch.sigmoid(block.shared_expert_gate(buf)) * block.shared_expert(buf))[:N_PROBE]
        own = block(probe[None])[0]
    wdt = "float32" if weights.dtype == torch.float32 else dname
    exp = moe_oracle.combine_oracle(to_bits(ys.reshape(-1, probe.shape[1])).reshape(N_PROBE, ids.shape[1], -1),
                                    to_bits(weights), ids.numpy(), to_bits(probe), dname, weight_dtype=wdt,
                                    shared_bits=None if shared is None else to_bits(shared))
    return exp, own


def _merged(per_rank: list[dict]) -> dict:
    for res in per_rank[1:]:
        for key, bits in res.items():
            assert np.array_equal(bits, per_rank[0][key]), f"{key}: ranks disagree"
    return per_rank[0]


@pytest.mark.slow
def test_ep_blocks_match_the_oracle_for_every_placement(cluster, checkpoints) -> None:  # noqa: ANN001
    got = _merged(cluster.run(job_blocks, checkpoints, "rl-bitwise", ("slot",), timeout_s=600))
    for name, directory in checkpoints.items():
        for dname in DTYPES:
            exp, own = _oracle(directory, dname)
            for label, _, _ in CONFIGS:
                bits = got[(name, dname, label, "slot")]
                bad = np.nonzero((bits != exp).any(axis=1))[0]
                assert not bad.size, f"{name} {dname} {label}: probe rows {bad.tolist()} differ from the oracle"
            ours = torch.from_numpy(exp.view(np.float32) if dname == "float32" else exp).float()
            if dname == "float32":  # transformers sums in expert order: equal to rounding, not bitwise
                assert torch.allclose(ours, own.float(), rtol=1e-5, atol=1e-6), name


@pytest.mark.slow
def test_rank_order_combine_moves_bits(cluster3plus, checkpoints) -> None:  # noqa: ANN001
    """Negative control: under auto, the engines' rank-order sum of per-rank partials changes probe rows
    between the placements/batches, where the slot-order combine of the same run matches the oracle."""
    moe = {n: d for n, d in checkpoints.items() if n != "mixtral-tiny"}  # top-2: two addends commute
    got = _merged(cluster3plus.run(job_blocks, moe, "auto", ("slot", "rank"), timeout_s=600))
    moved = 0
    for name, directory in moe.items():
        for dname in DTYPES:
            exp, _ = _oracle(directory, dname)
            for label, _, _ in CONFIGS:
                assert np.array_equal(got[(name, dname, label, "slot")], exp)
            a, b, c = (got[(name, dname, label, "rank")] for label, _, _ in CONFIGS)
            moved += int((a != b).any(axis=1).sum() + (a != c).any(axis=1).sum())
    assert moved > 0, "the rank-order combine moved nothing: the test cannot tell the orders apart"


@pytest.mark.parametrize("name", sorted(MOE_TINY_CONFIGS))
@pytest.mark.parametrize("dname", sorted(DTYPES))
def test_gating_is_transformers_router(name: str, dname: str, checkpoints) -> None:  # noqa: ANN001
    """``route`` gives transformers' router's expert ids and weights bit for bit; flipping the
    renormalisation (the negative control) changes the weights."""
    from detcomm.hf.moe_block import route, router_spec

    dtype = DTYPES[dname]
    model = _reference(checkpoints[name], dtype)
    block = _moe_block(model)
    top_k, renorm, wdt = router_spec(block, model.config.model_type, dtype)
    x = torch.randn(T_PAD, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        _, want_w, want_ids = block.gate(x)
        ids, w = route(x, block.gate.weight, top_k=top_k, renormalize=renorm, weights_dtype=wdt)
        _, flipped = route(x, block.gate.weight, top_k=top_k, renormalize=not renorm, weights_dtype=wdt)
    assert torch.equal(ids, want_ids) and w.dtype == want_w.dtype
    assert np.array_equal(to_bits(w), to_bits(want_w))
    assert not np.array_equal(to_bits(flipped), to_bits(want_w))


def test_wrong_expert_parallel_settings_refused() -> None:
    from detcomm.hf import EPConfig
    from detcomm.hf.checkpoints import tiny_config
    from detcomm.hf.layers import StepRows
    from detcomm.hf.shard import shard_model
    from detcomm.moe import Placement

    dense = transformers.AutoModelForCausalLM.from_config(tiny_config("llama-tiny"))
    with pytest.raises(ValueError, match="'llama' has none: leave ep out"):
        shard_model(dense, rank=0, world=1, step=StepRows(), ep=EPConfig())
    moe = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3-moe-tiny"))
    for bad, text in ((EPConfig(block=0), "block must be a positive int"),
                      (EPConfig(combine_order="expert"), "combine_order must be one of")):
        with pytest.raises(ValueError, match=text):
            shard_model(moe, rank=0, world=1, step=StepRows(), ep=bad)
    with pytest.raises(TypeError, match="placement must be a detcomm.moe.Placement"):
        shard_model(moe, rank=0, world=1, step=StepRows(), ep=EPConfig(placement=((0,),) * 8))  # type: ignore[arg-type]
    assert Placement.replicated(3, 2).hosts == ((0, 1), (0, 1), (0, 1))
