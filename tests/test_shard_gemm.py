"""detcomm.numerics.shard_gemm's Triton kernels on the CPU, under Triton's interpreter: tests/shard_gemm_interp_cases.py
(the fp64 oracle, the bits of a shard / column block whatever the batch count S in 1, 2, 4, 8, the row count and the
block count, and negative controls: a K tile chosen from the batch count, and split-K, must change bits).

The interpreter is chosen when triton is first imported, and any earlier import in this process (torch imports
triton lazily, detcomm's CUDA paths do) would have built the compiled, GPU-only kernels: so the cases run in a fresh
interpreter with TRITON_INTERPRET=1 set from its start. Skipped only where triton is not installed (pip install
triton)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_shard_gemm_kernels_under_the_interpreter() -> None:
    pytest.importorskip("triton", reason="pip install triton: its interpreter runs the kernels on CPU")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                        os.path.join(HERE, "shard_gemm_interp_cases.py")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-2000:]


def test_cpu_shard_weights_model_keeps_todays_bits() -> None:
    # On CPU both shard storages run today's per-shard fp32 torch GEMMs on the same values (bf16 widened exactly).
    import torch

    from detcomm.tp import RowParallelLinear

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 24, generator=g).to(torch.bfloat16)
    x = torch.randn(16, 32, generator=g).to(torch.bfloat16)  # rank 1 of W = 2: K/W = 32 columns
    layers = [RowParallelLinear(weight, site="o", layout="virtual", max_rows=16, virtual_shards=8, rank=1, world=2,
                                shard_weights=sw) for sw in ("fp32", "model")]  # type: ignore[arg-type]
    assert [w.dtype for w in layers[0].weights + layers[1].weights] == [torch.float32] * 4 + [torch.bfloat16] * 4
    a, b = (layer.partials(x, 11) for layer in layers)
    assert a.dtype == b.dtype == torch.float32 and a.shape == (4, 11, 24)
    assert torch.equal(a, b)
    xf = x.to(torch.float32)  # and those bits are the per-shard torch GEMMs'
    assert torch.equal(a[2], torch.matmul(xf[:, 16:24].contiguous(), weight[48:56].to(torch.float32))[:11])


def test_shard_weights_caller_errors() -> None:
    import torch

    from detcomm.tp import RowParallelLinear

    w = torch.zeros(16, 8)
    with pytest.raises(ValueError, match="needs layout='virtual'"):
        RowParallelLinear(w, site="o", layout="fold", max_rows=4, rank=0, world=1, shard_weights="model")
    with pytest.raises(ValueError, match="'fp32' or 'model'"):
        RowParallelLinear(w, site="o", layout="virtual", virtual_shards=2, max_rows=4, rank=0, world=1,
                          shard_weights="bf16")  # type: ignore[arg-type]


def test_kernels_compile_for_sm90_without_a_device() -> None:
    # Ahead-of-time compile (triton's bundled ptxas; no GPU needed): the kernels build at the fixed config, the
    # 2-byte path runs on wgmma tensor cores, the fp32 path is explicit fma.rn.f32 (ieee, no tf32 MMA).
    pytest.importorskip("triton", reason="pip install triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter is on in this process: the cases run it; this test compiles")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from detcomm.numerics import shard_gemm as sg

    shard, block = sg._kernels()
    c = sg.CONFIG
    opts = {"num_warps": c["num_warps"], "num_stages": c["num_stages"], "enable_fp_fusion": False}
    i32 = "i32"
    for ieee, wdt in ((True, "*fp32"), (False, "*bf16")):
        sig = {"x_ptr": "*bf16", "w_ptr": wdt, "out_ptr": "*fp32", **{a: i32 for a in (
            "T", "N", "KV", "stride_xm", "stride_xk", "stride_ws", "stride_wk", "stride_wn", "stride_os", "stride_om")},
            "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "IEEE": "constexpr"}
        ptx = triton.compile(ASTSource(fn=shard, signature=sig, constexprs={"BM": c["BM"], "BN": c["BN"],
                                                                               "BK": c["BK"], "IEEE": ieee}),
                             target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
        assert ("wgmma" in ptx) is (not ieee) and ("fma.rn.f32" in ptx) is ieee, ieee
        sig = {"x_ptr": "*bf16", "w_ptr": wdt, "b_ptr": "*bf16", "y_ptr": "*bf16", **{a: i32 for a in (
            "T", "K", "WIDTH", "TILES", "stride_xm", "stride_xk", "stride_wb", "stride_wk", "stride_wn", "stride_ym")},
            "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "IEEE": "constexpr", "HAS_BIAS": "constexpr"}
        ptx = triton.compile(ASTSource(fn=block, signature=sig, constexprs={"BM": c["BM"], "BN": c["BN"], "BK": c["BK"],
                                                                               "IEEE": ieee, "HAS_BIAS": True}),
                             target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
        assert ("wgmma" in ptx) is (not ieee), ieee
