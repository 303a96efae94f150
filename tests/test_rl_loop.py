"""The GRPO loop end to end (the CI test of docs/rl.md): a rollout engine at W_s = 4, a trainer at W_t = 1 and 2,
3 RL steps each (sampled rollout, trainer recompute, gate, loss, AdamW, weight sync): every logprob equal before
each step (the gate held: largest |delta| exactly 0) and after the last sync. Negative controls: a step without
the sync leaves the engine on the old weights and the gate refuses the next recompute; the trainer side in the
fold layout at W_t = 2 has another contract (refused, naming the fields) and its logprobs differ (refused)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from detcomm.errors import ContractMismatch, LogprobMismatch
from detcomm.hf import write_tiny_checkpoint
from detcomm.rl.loop import GRPOLoop

PROMPTS = [[5, 77, 300, 2, 999, 41], [12, 640, 8]]


def job_fresh(rank: int, w: int) -> None:
    """Shut down a communicator an earlier job on the shared cluster may have left (the loop's sides init their own)."""
    import detcomm

    detcomm.shutdown()


@pytest.mark.slow
def test_grpo_loop_exact_across_widths(tmp_path, cluster2, cluster4) -> None:  # noqa: ANN001
    from clusters import get_cluster

    directory = write_tiny_checkpoint("llama-tiny", str(tmp_path), seed=3)
    for c in (get_cluster(1), cluster2, cluster4):
        c.run(job_fresh)
    for trainer in (get_cluster(1), cluster2):
        loop = GRPOLoop(directory, rollout=cluster4, trainer=trainer, lr=1e-2)
        try:
            loop.check_contract()
            for _ in range(3):
                report = loop.step(PROMPTS, group=4, max_new_tokens=8)
                assert report.refused is None and report.delta == 0.0, report
            assert loop.check(PROMPTS, max_new_tokens=8) == 0.0  # after the last sync
            if trainer is cluster2:  # the sync's negative control: the engine keeps the old weights
                loop.step(PROMPTS, group=4, max_new_tokens=8, sync=False)
                with pytest.raises(LogprobMismatch, match=r"request \d+, response token \d+ .* ulp apart"):
                    loop.check(PROMPTS, max_new_tokens=8)
        finally:
            loop.close()
    control = GRPOLoop(directory, rollout=cluster4, trainer=cluster2, control=True)
    try:
        with pytest.raises(ContractMismatch, match="layout: 'fold' != 'virtual'.* world: 2 != None"):
            control.check_contract()
        report = control.step(PROMPTS, group=2, max_new_tokens=4)
        assert report.refused is not None and "ulp apart" in report.refused and report.delta > 0.0
    finally:
        control.close()
