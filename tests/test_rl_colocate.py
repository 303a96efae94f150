"""detcomm.rl.colocate on W = 4 real spawned gloo ranks: each rank is a rollout rank (W_s = 4) and a rank of a
trainer TP group of W_t = 2 (DP 2) or W_t = 1 (DP 4), two detcomm communicators per process (three with the DP
group's). 3 RL steps: every logprob equal before each step and after the last sync (largest |delta| exactly 0).
Negative control: a step without the sync leaves the rollout engine on the old weights and the next gate refuses
on every rank, naming the replica, the request and the ulp distance."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from detcomm.hf import write_tiny_checkpoint

PROMPTS = [[5, 77, 300, 2, 999, 41], [12, 640, 8], [400, 401, 402, 403], [9, 9, 9]] * 2
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 0.25, -0.25, 1.0, -1.0]


def job_colocated(rank: int, w: int, directory: str, trainer_world: int) -> dict:
    import detcomm
    from detcomm.errors import LogprobMismatch
    from detcomm.rl.colocate import Colocated

    torch.set_num_threads(1)
    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    detcomm.init(numerics="rl-bitwise")
    try:
        c = Colocated(directory, trainer_world=trainer_world, lr=1e-2)
        deltas = [c.step(PROMPTS, ADVANTAGES, max_new_tokens=6, seed=s) for s in range(3)]
        deltas.append(c.step(PROMPTS, None, max_new_tokens=6, seed=9))  # after the last sync: the gate alone
        c.step(PROMPTS, ADVANTAGES, max_new_tokens=6, seed=10, sync=False)
        try:
            c.step(PROMPTS, None, max_new_tokens=6, seed=11)
            refused = None
        except LogprobMismatch as e:
            refused = str(e)
        return {"deltas": deltas, "refused": refused, "tp": c.tp_comm.world_size, "dp": c.dp}
    finally:
        detcomm.shutdown()


@pytest.mark.slow
def test_colocated_rollout_and_trainer(tmp_path, cluster4) -> None:  # noqa: ANN001
    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    for trainer_world in (2, 1):
        ranks = cluster4.run(job_colocated, directory, trainer_world)
        for r in ranks:
            assert (r["tp"], r["dp"]) == (trainer_world, 4 // trainer_world)
            assert r["deltas"] == [0.0] * 4, r["deltas"]
            assert r["refused"] is not None and "ulp apart" in r["refused"], r["refused"]
            assert r["refused"].startswith("DP replica 0: request 0, response token ")
