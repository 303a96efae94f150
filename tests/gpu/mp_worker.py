"""Body of one rank in the W-processes-on-one-GPU tests (spawned; results travel back as exceptions)."""

from __future__ import annotations

import os
import traceback

import numpy as np

from detcomm.envelope import MULTICAST_OFF_ENV as MULTICAST_OFF  # torch-free: set before torch loads


def run_rank(rank: int, world: int, init_file: str, cases: list, log_dir: str, one_gpu_each: bool = False) -> None:
    os.environ.update(MULTICAST_OFF)
    import torch
    import torch.distributed as dist
    from payloads import first_mismatch, from_tensor, ill_conditioned, random_bits, to_tensor

    from detcomm.workspace import Workspace, WorkspaceUnavailable
    from oracle import fold_oracle

    log = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dev = f"cuda:{rank if one_gpu_each else 0}"
    torch.cuda.set_device(dev)
    failures: list[str] = []
    try:
        # A configuration that differs across ranks must fail arming on EVERY rank, with the reason.
        try:
            Workspace.create(None, device=dev, capacity_bytes=4096 * (1 + (rank == world - 1)), max_rows_armed=8)
            failures.append("mismatched configuration armed a workspace")
        except WorkspaceUnavailable as e:
            if "differs" not in str(e):
                failures.append(f"unexpected reason: {e}")

        trailing, cap_rows = 24, 37
        ws = Workspace.create(None, device=dev, capacity_bytes=cap_rows * trailing * 4, max_rows_armed=cap_rows,
                              timeout_s=120.0)
        for i, (op, dtype, rows, kind, algo) in enumerate(cases):
            rng = np.random.default_rng(1000 + i)  # same seed on every rank: each can build the oracle
            gen = ill_conditioned if kind == "ill" else random_bits
            bits = gen(rng, world, (rows, trailing), dtype)
            x = to_tensor(bits[rank], dtype, dev)
            if op == "all_reduce":
                got, want = from_tensor(ws.all_reduce(x, algo=algo)), fold_oracle(bits, dtype)
            elif op == "reduce_scatter":
                shard = rows // world
                got, want = from_tensor(ws.reduce_scatter(x)), fold_oracle(bits, dtype)[rank * shard:(rank + 1) * shard]
            elif op == "all_gather":
                got, want = from_tensor(ws.all_gather(x)), np.concatenate(bits)
            elif op == "graph":
                static = torch.empty_like(x)
                s = torch.cuda.Stream()
                g = torch.cuda.CUDAGraph()
                ws.all_reduce(static.copy_(x), algo=algo)  # warm-up
                torch.cuda.synchronize()
                with torch.cuda.graph(g, stream=s):
                    out = ws.all_reduce(static, algo=algo)
                bits = gen(np.random.default_rng(2000 + i), world, (rows, trailing), dtype)  # new values
                static.copy_(to_tensor(bits[rank], dtype, dev))
                torch.cuda.synchronize()
                g.replay()
                torch.cuda.synchronize()
                got, want = from_tensor(out), fold_oracle(bits, dtype)
            else:
                raise ValueError(op)
            ok = np.array_equal(got, want)
            print(f"case {i} {op} {dtype} rows={rows} {kind} {algo}: {'ok' if ok else first_mismatch(got, want)}", file=log, flush=True)
            if not ok:
                failures.append(f"case {i} {op} {dtype} rows={rows} {kind} {algo}: {first_mismatch(got, want)}")
        ws.close()
        # close() released the IPC handles and buffers: arming again on the same group works.
        ws = Workspace.create(None, device=dev, capacity_bytes=4096, max_rows_armed=8, timeout_s=120.0)
        bits = ill_conditioned(np.random.default_rng(99), world, (3, trailing), "float32")
        got = from_tensor(ws.all_reduce(to_tensor(bits[rank], "float32", dev)))
        if not np.array_equal(got, fold_oracle(bits, "float32")):
            failures.append("after close and re-create: " + first_mismatch(got, fold_oracle(bits, "float32")))
        ws.close()
    except Exception:
        failures.append(traceback.format_exc())
    finally:
        log.close()
        dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}: " + " | ".join(failures))
