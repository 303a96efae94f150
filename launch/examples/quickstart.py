# detcomm quickstart: run with  detcomm-launch --nproc 4 launch/examples/quickstart.py  (CPU or GPUs)
import torch

import detcomm

comm = detcomm.init(numerics="rl-bitwise")  # the default group, from detcomm-launch's (torchrun's) environment
rank, world, device = comm.rank, comm.world_size, comm.device
hidden, vocab_shard = 4096, 8000
gen = torch.Generator().manual_seed(rank)

# A call site is declared once; its route is decided here, from static facts, never from the batch.
o_proj = detcomm.site("layers.o_proj", collective="all_reduce", dtype=torch.bfloat16,
                      shape=(hidden,), max_rows=2048)
x = torch.randn(8, hidden, generator=gen).to(device, torch.bfloat16)  # this rank's partial sums, 8 rows
y = detcomm.all_reduce(x, site=o_proj)  # the canonical fold: same bits on every rank

# The same rows inside a bigger batch, at another offset: bit for bit the same result.
batch = torch.cat([torch.randn(5, hidden, generator=gen).to(device, torch.bfloat16), x])
assert torch.equal(detcomm.all_reduce(batch, site=o_proj)[5:], y)

# Vocabulary-parallel argmax: each rank holds vocab_shard logits of every row.
logits_shard = torch.randn(8, vocab_shard, generator=gen).to(device)
ids = detcomm.argmax(logits_shard, site="lm_head.argmax", vocab_start=rank * vocab_shard)
if rank == 0:
    print(detcomm.routes())
    print(f"W={world}: 8 rows reduced alone and inside a batch of 13 -> identical bits; token ids {ids.tolist()}")
detcomm.shutdown()
