"""A GRPO-style RL loop over two process groups: a rollout engine at W_s ranks, a trainer at W_t ranks.

The two sides run in separate local clusters (``detcomm._spawn.LocalCluster``); this process drives them and moves
the data between them in memory: prompts to the rollout, its tokens and sampling-time logprobs to the trainer, the
trainer's whole weights (``detcomm.rl.reshard.gather_full``) back to the rollout ranks, which cut their shards
(``load_full``). Why two groups rather than one process per rank holding both: docs/rl.md "Arrangement".

Per step: rollout (``detcomm.rl.rollout.sample``, G samples per prompt), trainer recompute with autograd, the gate
(``detcomm.rl.gate``: contract before the first step, every logprob bitwise), the GRPO loss (group-normalized
advantages, PPO-clipped ratio), backward + AdamW, weight sync. The worker-side functions keep their engine or
trainer in this module's ``_SIDE`` between calls (one per process).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import LogprobMismatch
from .gate import check_contract, check_logprobs

__all__ = ["StepReport", "GRPOLoop", "reward_low_ids"]

_SIDE: dict[str, Any] = {}


def start_side(rank: int, world: int, directory: str, role: str, t_pad: int, max_context: int,
               layout: str, virtual_shards: int | None, lr: float, dtype: str, device: str) -> dict[str, Any]:
    """Worker job: ``detcomm.init`` and the side's engine (``role`` "rollout") or trainer ("trainer", "control":
    an engine without autograd, the negative control's recompute). ``device`` "cpu", or "cuda" (rank r on GPU
    r mod the GPU count; ranks sharing a GPU stage the gloo collectives through host memory). Returns the
    contract's fields."""
    import detcomm
    from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm

    from .contract import contract
    from .trainer import Trainer

    torch.set_num_threads(1)
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    detcomm.init(numerics="rl-bitwise", device=device)
    fold = "tree" if layout == "virtual" else "order"
    serving = ServingConfig(t_pad=t_pad, max_context=max_context)  # paged attention: Triton on CUDA, torch elsewhere
    lm = TPCausalLM(load_causal_lm(directory, dtype=getattr(torch, dtype)), serving,
                    layout=layout, virtual_shards=virtual_shards, shard_fold=fold)
    _SIDE.update(lm=lm, trainer=Trainer(lm, lr=lr) if role == "trainer" else None)
    return contract(lm).fields


def stop_side(rank: int, world: int) -> None:
    """Worker job: drop the side and ``detcomm.shutdown``."""
    import detcomm

    _SIDE.clear()
    detcomm.shutdown()


def rollout_job(rank: int, world: int, prompts: list[list[int]], max_new_tokens: int, seed: int) -> Any:
    """Worker job: sampled continuations (T = 1) and their sampling-time logprobs, and the seconds it took."""
    from .rollout import sample

    t0 = time.perf_counter()
    out = sample(_SIDE["lm"], prompts, max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    return out, time.perf_counter() - t0


def train_job(rank: int, world: int, sequences: list[list[int]], starts: list[int], old: list[torch.Tensor],
              advantages: list[float] | None, clip: float) -> dict[str, Any]:
    """Worker job: recompute, gate, GRPO loss, backward, AdamW; then gather the whole weights (rank 0 returns
    them). A refused gate returns its message (nothing trained); ``advantages`` None: the gate only."""
    from .trainer import teacher_forced

    t0 = time.perf_counter()
    trainer = _SIDE["trainer"]
    lm = _SIDE["lm"]
    new = teacher_forced(lm, sequences, starts, grad=trainer is not None)
    delta = max(float((n.detach().cpu() - o).abs().max()) for n, o in zip(new, old))
    try:
        check_logprobs(new, old, starts=starts)
    except LogprobMismatch as e:
        return {"refused": str(e), "delta": delta}
    if advantages is None:
        return {"delta": delta}
    assert trainer is not None, "the control side has no trainer: its gate must refuse"
    terms = []
    for n, o, a in zip(new, old, advantages):
        ratio = torch.exp(n - o.to(n.device))  # exactly 1 here: the gate held
        terms.append(-torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a).mean())
    loss = torch.stack(terms).mean()
    trainer.step(loss)
    full = trainer.full_weights()
    return {"delta": delta, "loss": float(loss.detach()), "seconds": time.perf_counter() - t0,
            "full": full if rank == 0 else None}


def sync_job(rank: int, world: int, full: dict[str, torch.Tensor]) -> None:
    """Worker job: cut the trainer's whole weights into this rollout rank's shards, in place."""
    from .reshard import load_full

    load_full(_SIDE["lm"], full)


def reward_low_ids(tokens: Sequence[int], vocab: int) -> float:
    """A toy reward: the fraction of response tokens in the lower half of the vocabulary."""
    return sum(t < vocab // 2 for t in tokens) / len(tokens)


@dataclass
class StepReport:
    """One RL step: the largest |trainer - rollout| logprob (0.0 when the gate held), the mean reward, the loss,
    rollout and train tokens per second; ``refused``: the gate's message when it refused the step."""

    step: int
    delta: float
    reward: float
    loss: float | None
    rollout_tps: float
    train_tps: float
    refused: str | None = None


class GRPOLoop:
    """The loop's driver. ``rollout`` and ``trainer``: ``detcomm._spawn.LocalCluster``s (W_s and W_t ranks), both
    started here on the checkpoint ``directory`` in ``dtype`` on ``device`` ("cpu" or "cuda"). ``control=True``: the negative control, the trainer side
    an engine in the fold layout at W_t (its contract differs, which is reported, and its gate must refuse)."""

    def __init__(self, directory: str, *, rollout: Any, trainer: Any, t_pad: int = 64, max_context: int = 64,
                 virtual_shards: int = 8, lr: float = 1e-3, clip: float = 0.2, control: bool = False,
                 dtype: str = "float32", device: str = "cpu",
                 reward: Callable[[Sequence[int], int], float] = reward_low_ids) -> None:
        self.rollout, self.trainer, self.clip, self.reward = rollout, trainer, clip, reward
        self.control = control
        self.contracts = {
            "rollout": rollout.run(start_side, directory, "rollout", t_pad, max_context, "virtual", virtual_shards, lr,
                                   dtype, device)[0],
            "trainer": trainer.run(start_side, directory, "control" if control else "trainer", t_pad, max_context,
                                   "fold" if control else "virtual", None if control else virtual_shards, lr, dtype,
                                   device)[0],
        }
        self.vocab = int(self.contracts["rollout"]["config.vocab_size"])
        self.steps = 0

    def check_contract(self) -> None:
        """The gate's first half (``detcomm.rl.gate.check_contract``): ContractMismatch naming the fields."""
        from .contract import Contract

        check_contract(Contract(self.contracts["trainer"]), Contract(self.contracts["rollout"]))

    def check(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int) -> float:
        """Roll the prompts out and recompute them on the trainer, without training: the gate alone (after a sync:
        the engine's logprobs equal the trainer's again). Returns the largest |delta logprob|; raises
        LogprobMismatch when the gate refuses."""
        batch = [list(p) for p in prompts]
        out, _ = self.rollout.run(rollout_job, batch, max_new_tokens, 10_000 + self.steps)[0]
        res = self.trainer.run(train_job, [p + t for p, (t, _) in zip(batch, out)], [len(p) for p in batch],
                               [lp for _, lp in out], None, self.clip)[0]
        if "refused" in res:
            raise LogprobMismatch(res["refused"])
        return float(res["delta"])

    def step(self, prompts: Sequence[Sequence[int]], *, group: int, max_new_tokens: int,
             sync: bool = True) -> StepReport:
        """One RL step on ``group`` samples of each prompt. Raises LogprobMismatch when the gate refuses (the
        negative control returns its report instead). ``sync=False`` leaves the engine's weights as they were (the
        weight sync's negative control: the next step's gate refuses)."""
        batch = [list(p) for p in prompts for _ in range(group)]
        out, secs = self.rollout.run(rollout_job, batch, max_new_tokens, self.steps)[0]
        rewards = [self.reward(t, self.vocab) for t, _ in out]
        adv = []
        for g in range(len(prompts)):  # group-normalized advantages (GRPO)
            r = torch.tensor(rewards[g * group : (g + 1) * group], dtype=torch.float64)
            adv += ((r - r.mean()) / (r.std(unbiased=False) + 1e-6)).tolist()
        seqs = [p + t for p, (t, _) in zip(batch, out)]
        starts = [len(p) for p in batch]
        res = self.trainer.run(train_job, seqs, starts, [lp for _, lp in out], adv, self.clip)[0]
        self.steps += 1
        n_new = sum(len(t) for t, _ in out)
        report = StepReport(self.steps, res["delta"], sum(rewards) / len(rewards), res.get("loss"), n_new / secs,
                            sum(len(s) for s in seqs) / res["seconds"] if "seconds" in res else 0.0,
                            res.get("refused"))
        if report.refused is not None:
            if self.control:
                return report
            raise LogprobMismatch(report.refused)
        if sync:
            self.rollout.run(sync_job, res["full"])
        return report

    def close(self) -> None:
        """Shut both sides down (the clusters stay up)."""
        self.rollout.run(stop_side)
        self.trainer.run(stop_side)
