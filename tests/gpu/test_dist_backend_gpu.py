"""The "detcomm" torch.distributed backend on GPUs (NCCL underneath, one rank per GPU).

A folded all_reduce and reduce_scatter_tensor equal the numpy fold oracle (tests/oracle.py) eagerly, with
async_op=True waited on from another stream, and inside a captured CUDA graph replayed with new values (as a
trainer's captured step uses them), in bf16 and fp32. A capture that would be a device's first collective is
refused at once. W = 2 on two GPUs; W = 1 on one GPU still runs the capture path.

Each rank dumps every thread's stack and exits if it has not finished within a deadline, so a hang shows where
it hangs instead of eating the suite's time. Ill-conditioned inputs: another rank order gives other bits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent("""
    import faulthandler, os, sys
    import numpy as np
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_main(rank, world, out_dir, tests):
        # A hang prints every thread's stack, then exits. 150 s: a cold kernel cache compiles the workspace's NVRTC
        # kernels first (measured past 45 s on the H200 on a first run), and a hang is still caught long before
        # the parent's limit.
        faulthandler.dump_traceback_later(150, exit=True)
        from detcomm.envelope import MULTICAST_OFF_ENV
        os.environ.update(MULTICAST_OFF_ENV)
        sys.path.insert(0, tests)
        import oracle
        from datagen import ill_bits, to_bits, to_torch
        import detcomm.dist_backend  # registers "detcomm"
        log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
        def step(what):
            print(what, file=log, flush=True)
        torch.cuda.set_device(rank)
        dist.init_process_group("detcomm", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
        dev = torch.device("cuda", rank)
        results = []
        def check(what, dtype, got, want):
            results.append((what, dtype, bool(np.array_equal(to_bits(got.cpu()), want))))

        step("refuse: capture before any eager collective")
        static = torch.zeros(8, 16, device=dev)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                dist.all_reduce(static)
            results.append(("refused", "", "captured the first collective"))
        except RuntimeError as e:
            results.append(("refused", "", "eagerly" in str(e) or str(e)))
        del g
        torch.cuda.synchronize()

        for dtype in ("bfloat16", "float32"):
            def inputs(seed):
                bits = [ill_bits(37, 96, dtype, seed=seed, rank=r) for r in range(world)]
                return bits, to_torch(bits[rank], dtype).to(dev)
            step(f"{dtype}: eager")
            bits, x = inputs(1)
            dist.all_reduce(x)
            check("eager", dtype, x, oracle.fold_oracle(bits, dtype))
            step(f"{dtype}: async_op on a side stream, waited on from the current stream")
            bits, x = inputs(4)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                work = dist.all_reduce(x, async_op=True)
            work.wait()
            check("async", dtype, x.clone(), oracle.fold_oracle(bits, dtype))  # the clone runs on this stream
            check("async future", dtype, work.get_future().wait()[0], oracle.fold_oracle(bits, dtype))
            torch.cuda.synchronize()

            step(f"{dtype}: warm-up on a side stream")
            s_ar, s_async = torch.empty_like(x), torch.empty_like(x)
            s_rs = torch.empty(37 * 96 // world, device=dev, dtype=x.dtype)  # 37 * 96 divides by 1 and 2
            flat_in = torch.empty(37 * 96, device=dev, dtype=x.dtype)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    s_ar.copy_(x); s_async.copy_(x)
                    dist.all_reduce(s_ar)
                    dist.all_reduce(s_async, async_op=True).wait()
                    dist.reduce_scatter_tensor(s_rs, flat_in)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            step(f"{dtype}: capture")
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g):
                    dist.all_reduce(s_ar)
                    work = dist.all_reduce(s_async, async_op=True)
                    work.wait()
                    dist.reduce_scatter_tensor(s_rs, flat_in)
            except Exception as e:
                results.append(("capture", dtype, f"{type(e).__name__}: {e}"))
                break
            step(f"{dtype}: replays")
            for seed in (2, 3):
                bits, x = inputs(seed)
                s_ar.copy_(x)
                s_async.copy_(x)
                flat_in.copy_(x.view(-1))
                g.replay()
                torch.cuda.synchronize()
                want = oracle.fold_oracle(bits, dtype)
                check(f"replay {seed}", dtype, s_ar, want)
                check(f"replay {seed} async", dtype, s_async, want)
                n = s_rs.numel()
                check(f"replay {seed} reduce_scatter", dtype, s_rs, want.reshape(-1)[rank * n:(rank + 1) * n])
            del g
        torch.cuda.synchronize()
        step("done")
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(repr(results))
        dist.destroy_process_group()

    if __name__ == "__main__":
        world = int(sys.argv[2])
        mp.start_processes(rank_main, args=(world, sys.argv[1], sys.argv[3]), nprocs=world, join=True,
                           start_method="spawn")
""")


@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"W{w}")
def test_folded_collectives_eager_async_and_in_a_cuda_graph(tmp_path, world: int) -> None:  # noqa: ANN001
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, NCCL_DEBUG="WARN",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(world), TESTS], capture_output=True,
                          text=True, timeout=240, env=env, cwd=REPO)
    for r in range(world):
        path = tmp_path / f"rank{r}.txt"
        log = (tmp_path / f"rank{r}.log").read_text() if (tmp_path / f"rank{r}.log").exists() else ""
        assert path.exists(), f"rank {r} stopped after: {log[-500:]}\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}"
        results = eval(path.read_text())  # noqa: S307 - our own repr of (str, str, bool | str) tuples
        assert all(ok is True for _, _, ok in results), results
        kinds = {what for what, _, _ in results}
        assert kinds >= {"refused", "eager", "async", "async future", "replay 2", "replay 2 async", "replay 3 reduce_scatter"}, results
