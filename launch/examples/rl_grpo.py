# detcomm GRPO example: python launch/examples/rl_grpo.py [--steps 3] [--rollout-world 4] [--trainer-world 2]
#   [--dtype bfloat16] [--device cuda] [--colocated] [--control]
# A rollout engine at W_s ranks and a trainer at W_t ranks (two local gloo clusters on this machine), a tiny Llama
# built locally: per step, sampled rollouts, the trainer's recompute with autograd, the exactness gate, the GRPO
# loss, AdamW and the weight sync. --control: the trainer side in the fold layout (the gate must refuse).
import argparse
import tempfile

from detcomm._spawn import LocalCluster
from detcomm.errors import ContractMismatch
from detcomm.hf import write_tiny_checkpoint
from detcomm.rl.colocate import run_job
from detcomm.rl.loop import GRPOLoop

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="detcomm's GRPO example (docs/rl.md)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rollout-world", type=int, default=4)
    ap.add_argument("--trainer-world", type=int, default=2)
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (GRPO's group)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: the ranks share the GPUs")
    ap.add_argument("--colocated", action="store_true",
                    help="one group of --rollout-world ranks, each also a rank of a --trainer-world trainer group")
    ap.add_argument("--control", action="store_true", help="negative control: the trainer in the fold layout")
    args = ap.parse_args()
    prompts = [[5, 77, 300, 2, 999, 41], [12, 640, 8], [400, 401, 402, 403]]
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_tiny_checkpoint("llama-tiny", tmp, seed=3)
        if args.colocated:  # detcomm.rl.colocate: both sides in the same processes
            group = LocalCluster(args.rollout_world)
            try:
                batch = [p for p in prompts for _ in range(args.group)]
                steps = group.run(run_job, directory, args.trainer_world, batch, args.steps, args.max_new_tokens,
                                  args.lr, args.dtype)[0]
            finally:
                group.close()
            print(f"colocated: W={args.rollout_world}, trainer TP groups of {args.trainer_world}")
            for i, r in enumerate(steps, 1):
                print(f"step {i}: max |delta logprob| = {r['delta']!r}  reward {r['reward']:.3f}  "
                      f"{r['tps']:.0f} tok/s (rollout + train)")
            raise SystemExit(0)
        rollout, trainer = LocalCluster(args.rollout_world), LocalCluster(args.trainer_world)
        try:
            loop = GRPOLoop(directory, rollout=rollout, trainer=trainer, lr=args.lr, control=args.control,
                            dtype=args.dtype, device=args.device)
            print(f"rollout W={args.rollout_world}, trainer W={args.trainer_world}")
            try:
                loop.check_contract()
                print("contract: equal on both sides")
            except ContractMismatch as e:
                print(f"contract refused: {e}")
                if not args.control:
                    raise
            for _ in range(args.steps):
                r = loop.step(prompts, group=args.group, max_new_tokens=args.max_new_tokens)
                print(f"step {r.step}: max |delta logprob| = {r.delta!r}  reward {r.reward:.3f}  "
                      f"rollout {r.rollout_tps:.0f} tok/s  train {r.train_tps:.0f} tok/s"
                      + (f"\n  gate refused: {r.refused}" if r.refused else ""))
                if r.refused:
                    break
            loop.close()
        finally:
            rollout.close()
            trainer.close()
