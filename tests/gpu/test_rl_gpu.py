"""detcomm.rl's GRPO loop on a GPU host: a rollout engine at W_s = 4 and a trainer at W_t = 2, their ranks sharing
the GPUs (gloo, rank r on cuda:r mod the GPU count; sharing ranks stage the native collectives through host memory
and the workspace serves the tree sites), fp32 and bf16, 3 RL steps: every logprob equal before each step and
after the last sync (largest |delta| exactly 0). Negative control: the trainer side in the fold layout at W_t = 2
is refused by the contract and by the gate. Prints each step's rollout and train tokens/s (run with -s).

    python -m pytest -q -s -m gpu tests/gpu/test_rl_gpu.py
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from detcomm.errors import ContractMismatch
from detcomm.hf import write_tiny_checkpoint
from detcomm.rl.loop import GRPOLoop

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 77, 300, 2, 999, 41], [12, 640, 8], [400, 401, 402, 403]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpo_loop_exact_on_gpu(dtype: str, tmp_path) -> None:  # noqa: ANN001
    from clusters import get_cluster

    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    rollout, trainer = get_cluster(4), get_cluster(2)
    loop = GRPOLoop(directory, rollout=rollout, trainer=trainer, lr=1e-2, dtype=dtype, device="cuda")
    try:
        assert loop.contracts["rollout"]["device"] == "cuda"
        loop.check_contract()
        for _ in range(3):
            r = loop.step(PROMPTS, group=4, max_new_tokens=8)
            print(f"{dtype} step {r.step}: delta {r.delta!r}, rollout {r.rollout_tps:.0f} tok/s, "
                  f"train {r.train_tps:.0f} tok/s")
            assert r.refused is None and r.delta == 0.0, r
        assert loop.check(PROMPTS, max_new_tokens=8) == 0.0
    finally:
        loop.close()
    control = GRPOLoop(directory, rollout=rollout, trainer=trainer, control=True, dtype=dtype, device="cuda")
    try:
        with pytest.raises(ContractMismatch, match="layout: 'fold' != 'virtual'"):
            control.check_contract()
        report = control.step(PROMPTS, group=2, max_new_tokens=4)
        assert report.refused is not None and report.delta > 0.0
    finally:
        control.close()
