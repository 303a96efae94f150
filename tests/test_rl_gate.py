"""detcomm.rl's exactness gate and contract: a one-ulp change of one logprob is refused naming the request, the
position, both values and the ulp distance (an independent integer oracle of the ulp distance); every field of a
real engine's contract, changed alone, is refused with its name; engines that differ in what fixes the arithmetic
(dtype, V, layout, the fold layout's W) have contracts that differ in exactly those fields, and the tree layout at
W = 1 and 2 has one contract (W is not in it: its bits do not follow W); the NVRTC version and options (cupy's,
a stand-in module) are fields, None on the CPU or without cupy, each refused by name when changed."""

from __future__ import annotations

import struct

import pytest
import torch

pytest.importorskip("transformers")

from detcomm.errors import ContractMismatch, LogprobMismatch
from detcomm.hf import write_tiny_checkpoint
from detcomm.rl.contract import Contract
from detcomm.rl.gate import check_contract, check_logprobs, ulp_distance


def _ulps_oracle(a: float, b: float) -> int:
    """Count the fp32 values strictly after min(a, b) up to max(a, b) by stepping (the definition)."""
    def key(x: float) -> int:
        (i,) = struct.unpack("<i", struct.pack("<f", x))
        return i if i >= 0 else -(i & 0x7FFFFFFF) - 1
    return abs(key(a) - key(b))


def _next_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.tensor(float("inf")))


def test_ulp_distance_against_oracle() -> None:
    vals = torch.tensor([-3.5, -1e-38, -0.0, 0.0, 1e-45, 1.0, 7.25, -7.25], dtype=torch.float32)
    got = ulp_distance(vals[:, None].expand(8, 8), vals[None, :].expand(8, 8))
    for i in range(8):
        for j in range(8):
            assert int(got[i, j]) == _ulps_oracle(float(vals[i]), float(vals[j]))
    assert int(ulp_distance(torch.tensor([1.0]), _next_up(torch.tensor([1.0])))[0]) == 1


def test_one_ulp_logprob_refused_with_position() -> None:
    g = torch.Generator().manual_seed(0)
    rollout = [-torch.rand(n, generator=g) * 5 for n in (4, 7, 3)]
    trainer = [t.clone() for t in rollout]
    check_logprobs(trainer, rollout, starts=[10, 6, 9])  # equal bits: nothing raised
    trainer[1][5] = _next_up(trainer[1][5])
    with pytest.raises(LogprobMismatch) as e:
        check_logprobs(trainer, rollout, starts=[10, 6, 9])
    msg = str(e.value)
    assert "request 1, response token 5 (sequence position 11)" in msg
    assert repr(float(trainer[1][5])) in msg and repr(float(rollout[1][5])) in msg and "1 ulp apart" in msg
    trainer[1][5] = rollout[1][5]
    trainer[0][0] = -0.0  # signed zeros are different bits
    rollout[0][0] = 0.0
    with pytest.raises(LogprobMismatch, match="request 0, response token 0: .* 1 ulp apart"):
        check_logprobs(trainer, rollout)


def job_contracts(rank: int, w: int, directory: str) -> list[dict]:
    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm
    from detcomm.rl.contract import contract

    torch.set_num_threads(1)
    out = []
    for dtype, layout, v in ((torch.float32, "virtual", 8), (torch.bfloat16, "virtual", 8),
                             (torch.float32, "virtual", 4), (torch.float32, "fold", None)):
        detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
        detcomm.init(numerics="rl-bitwise")
        try:
            lm = TPCausalLM(load_causal_lm(directory, dtype=dtype), ServingConfig(t_pad=64, max_context=64),
                            layout=layout, virtual_shards=v, shard_fold="tree" if layout == "virtual" else "order")
            out.append(contract(lm).fields)
        finally:
            detcomm.shutdown()
    return out


@pytest.mark.slow
def test_contract_fields_refused_by_name(tmp_path, cluster2) -> None:  # noqa: ANN001
    from clusters import get_cluster

    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    one = get_cluster(1).run(job_contracts, directory)[0]
    two = cluster2.run(job_contracts, directory)
    assert two[0] == two[1]  # the ranks of one side agree
    base = Contract(one[0])
    assert base.fields["nvrtc_version"] is None and base.fields["nvrtc_options"] is None  # the CPU: no NVRTC kernel
    assert base.fields["triton"] is None and base.fields["triton_kernels"] is None  # nor a Triton kernel
    check_contract(Contract(two[0][0]), base)  # tree layout: W = 2 and W = 1 share the contract
    assert base.digest == Contract(two[0][0]).digest
    for field in base.fields:  # each field changed alone is refused with its name
        changed = dict(base.fields, **{field: ["changed", base.fields[field]]})
        with pytest.raises(ContractMismatch, match=f"in 1 field\\(s\\) .*: {field.replace('.', '[.]')}: "):
            check_contract(Contract(changed), base)
        assert Contract(changed).digest != base.digest
    for fields, names in ((one[1], {"dtype"}), (one[2], {"virtual_shards"}),
                          (one[3], {"layout", "virtual_shards", "shard_fold", "blocks", "world"})):
        diff = Contract(fields).differences(base)
        assert {d.split(":")[0] for d in diff} == names, diff
    fold1, fold2 = Contract(one[3]), Contract(two[0][3])
    assert [d.split(":")[0] for d in fold2.differences(fold1)] == ["world"]  # the fold layout's bits follow W


def test_contract_names_the_nvrtc_build(monkeypatch) -> None:  # noqa: ANN001
    """On CUDA with cupy the contract holds the NVRTC version (cupy's getVersion: a stand-in module here, no GPU
    needed) and the kernels' options for the device's architecture (W's define left out); a changed version or
    option is refused by name. Without cupy, or on the CPU, both are None."""
    import sys
    import types

    from detcomm.rl.contract import _nvrtc
    from detcomm.workspace.kernels import nvrtc_options

    fake = types.ModuleType("cupy.cuda.nvrtc")
    fake.getVersion = lambda: (12, 4)  # type: ignore[attr-defined]
    cuda = types.ModuleType("cupy.cuda")
    cuda.nvrtc = fake  # type: ignore[attr-defined]
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nvrtc", fake)
    version, options = _nvrtc(torch.device("cuda", 0), [9, 0])
    assert version == [12, 4]
    assert options == [o for o in nvrtc_options(4, "sm_90") if not o.startswith("-DDETCOMM_W=")]
    assert "-arch=sm_90" in options and "--fmad=false" in options and len(options) == len(nvrtc_options(1, "sm_90")) - 1
    assert _nvrtc(torch.device("cpu"), None) == (None, None)
    base = Contract({"nvrtc_version": version, "nvrtc_options": options, "dtype": "float32"})
    newer = Contract(dict(base.fields, nvrtc_version=[12, 8]))
    with pytest.raises(ContractMismatch, match=r"in 1 field\(s\) .*: nvrtc_version: \[12, 8\] != \[12, 4\]"):
        check_contract(newer, base)
    fast = Contract(dict(base.fields, nvrtc_options=[*options, "--use_fast_math"]))
    with pytest.raises(ContractMismatch, match=r"in 1 field\(s\) .*: nvrtc_options: "):
        check_contract(fast, base)
    assert len({base.digest, newer.digest, fast.digest}) == 3
    for name in ("cupy", "cupy.cuda", "cupy.cuda.nvrtc"):  # cupy not installed: the import fails
        monkeypatch.setitem(sys.modules, name, None)
    assert _nvrtc(torch.device("cuda", 0), [9, 0]) == (None, None)


def test_contract_names_the_triton_kernels(monkeypatch) -> None:  # noqa: ANN001
    """On CUDA the contract holds the Triton kernels' digest (their sources and the shard GEMMs' tile configuration,
    read without importing triton: no GPU needed) and triton's version; another tile configuration is another digest,
    refused by name. On the CPU both are None."""
    from detcomm.numerics import shard_gemm
    from detcomm.rl.contract import _triton

    assert _triton(torch.device("cpu")) == (None, None)
    version, digest = _triton(torch.device("cuda", 0))
    assert digest is not None and len(digest) == 64
    monkeypatch.setitem(shard_gemm.CONFIG, "BK", shard_gemm.CONFIG["BK"] // 2)
    other = _triton(torch.device("cuda", 0))
    assert other == (version, other[1]) and other[1] != digest
    base = Contract({"triton": version, "triton_kernels": digest, "dtype": "float32"})
    with pytest.raises(ContractMismatch, match=r"in 1 field\(s\) .*: triton_kernels: "):
        check_contract(Contract(dict(base.fields, triton_kernels=other[1])), base)
