"""Colocated rollout and trainer (verl's hybrid engine): every rank of the default group is a rollout rank
(W_s = W) and a rank of a trainer TP group of W_t ranks, data-parallel over the W / W_t groups.

Two detcomm communicators live in each process: the default one (the rollout engine) and the trainer TP group's
(``detcomm.init(group=...)``); a third, the rank's DP group, sums the replicas' gradients. The engine's sites are
names, which resolve to the module-default communicator, so the trainer's engine is built and run (forward and
backward) inside ``detcomm.use(tp_comm)``, which makes that communicator the default for the block. Per step
(``Colocated.step``: ``sample``, then ``train``): the rollout on all W ranks, each DP replica's share of the
sequences recomputed and gated (one verdict for the whole group), the loss's backward, the gradients summed over
the replicas at a detcomm site (one canonical fold), AdamW, and the weight sync in memory: each TP group gathers
its whole tensors and every rank cuts its rollout shards from them (``detcomm.rl.reshard``). ``run_job``: the
loop as a ``LocalCluster`` job (launch/examples/rl_grpo.py --colocated).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import detcomm

from ..errors import LogprobMismatch
from .gate import check_logprobs

__all__ = ["Colocated", "run_job"]


class Colocated:
    """Both sides in this process. Construct on every rank of the default group (after ``detcomm.init``), with
    the same arguments: ``directory`` a checkpoint, ``trainer_world`` W_t (dividing W). Collective."""

    def __init__(self, directory: str, *, trainer_world: int, t_pad: int = 64, max_context: int = 64,
                 virtual_shards: int = 8, lr: float = 1e-3, dtype: torch.dtype = torch.float32) -> None:
        from detcomm.hf import ServingConfig, TPCausalLM, load_causal_lm

        from .trainer import Trainer

        rank, world = dist.get_rank(), dist.get_world_size()
        if trainer_world < 1 or world % trainer_world:
            raise ValueError(f"trainer_world={trainer_world} must divide the group's W={world}")
        self.dp = world // trainer_world
        # TP groups of consecutive ranks, DP groups across them; every rank creates every group (collective).
        tp = [dist.new_group(list(range(d * trainer_world, (d + 1) * trainer_world))) for d in range(self.dp)]
        dp = [dist.new_group(list(range(t, world, trainer_world))) for t in range(trainer_world)]
        self.replica = rank // trainer_world
        self.tp_group, self.dp_group = tp[self.replica], dp[rank % trainer_world]
        numerics = detcomm.get_communicator().resolved.numerics
        self.tp_comm = detcomm.init(numerics=numerics, group=self.tp_group)
        self.dp_comm = detcomm.init(numerics=numerics, group=self.dp_group)
        layout: dict[str, Any] = dict(layout="virtual", virtual_shards=virtual_shards, shard_fold="tree")
        serving = ServingConfig(t_pad=t_pad, max_context=max_context)
        self.rollout = TPCausalLM(load_causal_lm(directory, dtype=dtype), serving, **layout)
        with detcomm.use(self.tp_comm):
            self.lm = TPCausalLM(load_causal_lm(directory, dtype=dtype), serving, **layout)
            self.trainer = Trainer(self.lm, lr=lr)
        numel = sum(t.numel() for t in self.trainer.params)
        self.grad_site = detcomm.site("rl.dp.grads", collective="all_reduce", dtype=torch.float32, shape=(numel,),
                                      max_rows=1, group=self.dp_group)

    def sample(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
               seed: int) -> list[tuple[list[int], torch.Tensor]]:
        """The rollout on all ranks (``detcomm.rl.rollout.sample``, T = 1). Collective."""
        from .rollout import sample

        return sample(self.rollout, prompts, max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)

    def step(self, prompts: Sequence[Sequence[int]], advantages: Sequence[float] | None, *, max_new_tokens: int,
             seed: int, sync: bool = True) -> float:
        """``sample`` then ``train``. Collective."""
        return self.train(prompts, self.sample(prompts, max_new_tokens=max_new_tokens, seed=seed), advantages,
                          sync=sync)

    def train(self, prompts: Sequence[Sequence[int]], outs: Sequence[tuple[list[int], torch.Tensor]],
              advantages: Sequence[float] | None, *, sync: bool = True) -> float:
        """Recompute and gate each replica's share of the rollout ``outs`` of ``prompts``, then (``advantages``
        given: one per prompt) a policy-gradient step over all of them and, ``sync``, the weight sync. Returns the
        largest |delta logprob| over the group; raises LogprobMismatch on every rank when any replica's gate
        refuses. Collective."""
        from .reshard import gather_full, load_full
        from .trainer import teacher_forced

        mine = list(range(self.replica, len(prompts), self.dp))  # this replica's share
        seqs = [list(prompts[i]) + outs[i][0] for i in mine]
        starts = [len(prompts[i]) for i in mine]
        old = [outs[i][1] for i in mine]
        with detcomm.use(self.tp_comm):
            new = teacher_forced(self.lm, seqs, starts, grad=advantages is not None)
        delta = max((float((n.detach().cpu() - o).abs().max()) for n, o in zip(new, old)), default=0.0)
        refused = None
        try:
            check_logprobs(new, old, starts=starts)
        except LogprobMismatch as e:
            refused = f"DP replica {self.replica}: {e}"
        verdicts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, (delta, refused))  # one verdict for the group
        delta = max(v[0] for v in verdicts)
        for _, r in verdicts:
            if r is not None:
                raise LogprobMismatch(r)
        if advantages is None:
            return delta
        # The policy gradient of the mean over all prompts: each replica's share of the sum, summed over the
        # replicas below (ratio = exp(new - old) is exactly 1: the gate held).
        loss = -torch.stack([(torch.exp(n - o.to(n.device)) * advantages[i]).sum() / len(n)
                             for n, o, i in zip(new, old, mine)]).sum() / len(prompts)
        with detcomm.use(self.tp_comm):
            self.trainer.backward(loss)
        params = self.trainer.params
        grads = [t.grad for t in params]
        assert all(g is not None for g in grads), "a trained tensor got no gradient"
        flat = torch.cat([g.to(torch.float32).flatten() for g in grads if g is not None])[None]
        summed = detcomm.all_reduce(flat, site=self.grad_site)[0]
        at = 0
        for t in params:
            t.grad = summed[at : at + t.numel()].view_as(t).to(t.dtype)
            at += t.numel()
        self.trainer.opt.step()
        if sync:
            with detcomm.use(self.tp_comm):
                full = gather_full(self.lm, group=self.tp_group)
            load_full(self.rollout, full)
        return delta


def run_job(rank: int, world: int, directory: str, trainer_world: int, prompts: list[list[int]], steps: int,
            max_new_tokens: int, lr: float, dtype: str) -> list[dict[str, float]]:
    """A ``LocalCluster`` job (every rank): ``steps`` policy-gradient steps of a ``Colocated`` pair on
    ``prompts`` (toy reward: the share of response tokens in the lower half of the vocabulary, advantages
    centred over the batch). Returns per step the largest |delta logprob| and the step's tokens/s."""
    import time

    from .loop import reward_low_ids

    torch.set_num_threads(1)
    detcomm.init(numerics="rl-bitwise")
    try:
        c = Colocated(directory, trainer_world=trainer_world, lr=lr, dtype=getattr(torch, dtype))
        vocab = c.rollout.config.vocab_size
        out = []
        for s in range(steps):
            t0 = time.perf_counter()
            outs = c.sample(prompts, max_new_tokens=max_new_tokens, seed=s)
            rewards = [reward_low_ids(t, vocab) for t, _ in outs]
            mean = sum(rewards) / len(rewards)
            delta = c.train(prompts, outs, [r - mean for r in rewards])
            out.append({"delta": delta, "reward": mean,
                        "tps": len(prompts) * max_new_tokens / (time.perf_counter() - t0)})
        return out
    finally:
        detcomm.shutdown()
