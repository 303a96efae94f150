"""The "detcomm" torch.distributed backend with W processes sharing ONE GPU (W = 2 and 3 on cuda:0).

NCCL refuses two ranks on one GPU, so the group's CUDA traffic goes through host memory on gloo and its float
SUM sites take the CUDA-IPC workspace (docs/trainers.md, "Ranks sharing one GPU"). Checked on every rank, each
against the numpy fold oracle (tests/oracle.py) of the ranks' inputs, bf16 unless said:

* the transport is "host" and the route table says so; a plain all_reduce and reduce_scatter_tensor; both sites on
  ipc_fold;
* a CUDA graph capturing the workspace-routed all_reduce (after the eager warm-up), replayed with new values;
  capturing a host-staged call (an AVG all_reduce on gather_fold, an all_gather) raises CaptureThroughHost at once;
* DDP, one step, bf16, bucket caps 25 MB and 0.0002 MB (identical, and the oracle's);
* (W = 3) FSDP2 fully_shard, one step, bf16 reduce dtype (AVG: the host-staged a2a_fold);
* (W = 3) a DTensor SequenceParallel / ColwiseParallel / RowwiseParallel block (tests/test_trainer_tp.py's exact
  local products), output and input gradient;
* (W = 3, transformers installed) transformers ``from_pretrained(tp_plan="auto")`` on a tiny Llama built from a
  config (tests/test_trainer_hf.py's checkpoint): request A's logits identical alone and batched, every
  row-parallel all-reduce the oracle's.

Local compute is made exact where another rank's result is derived (sparse signed powers of two, one token per
rank), and each rank's own local gradients are exchanged on a gloo group (data movement), so the only cross-rank
arithmetic is the reduction under test. Negative controls: at W = 3 the reversed rank order's fold differs from
the oracle on the same inputs (each check can fail), and gloo's own all_reduce (CUDA tensors) misses the oracle.
Each rank dumps every thread's stack and exits if it has not finished within its deadline.

    python -m pytest -q -m gpu tests/gpu/test_trainers_shared_gpu.py
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
DEADLINE_S = 200

_SCRIPT = textwrap.dedent("""
    import faulthandler, os, sys
    import numpy as np
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_main(rank, world, out_dir, tests, ckpt, deadline):
        faulthandler.dump_traceback_later(deadline, exit=True)  # a hang prints every thread's stack, then exits
        from detcomm.envelope import MULTICAST_OFF_ENV
        os.environ.update(MULTICAST_OFF_ENV)
        os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world))  # every rank on cuda:0
        sys.path.insert(0, tests)
        import oracle
        from datagen import ill_bits, to_bits, to_torch
        import detcomm.dist_backend as db
        log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
        def step(what):
            print(what, file=log, flush=True)
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
        dev = torch.device("cuda", 0)
        dist.init_process_group("detcomm", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
        pg = dist.group.WORLD
        gloo = dist.new_group(backend="gloo")
        results = []
        def check(what, ok):
            results.append((what, ok if isinstance(ok, str) else bool(ok)))
        def same(t, want):
            return np.array_equal(to_bits(t).reshape(-1), np.asarray(want).reshape(-1))
        def everyone(obj):  # every rank's obj, in rank order (object all-gather on gloo: data movement)
            out = [None] * world
            dist.all_gather_object(out, obj, group=gloo)
            return out
        order_shows = world >= 3  # two terms commute: the reversed order is a control from W = 3 on

        step("plain all_reduce and reduce_scatter_tensor, bf16")
        bits = [ill_bits(37, 96, "bfloat16", seed=1, rank=r) for r in range(world)]
        want = oracle.fold_oracle(bits, "bfloat16")
        x = to_torch(bits[rank], "bfloat16").to(dev)
        dist.all_reduce(x)
        check("all_reduce", same(x, want))
        check("transport is host", pg.cuda_transport().startswith("host:"))
        flat = to_torch(bits[rank], "bfloat16").to(dev).view(-1)
        n = flat.numel() // world
        rs = torch.empty(n, dtype=torch.bfloat16, device=dev)
        dist.reduce_scatter_tensor(rs, flat)
        check("reduce_scatter", same(rs, want.reshape(-1)[rank * n:(rank + 1) * n]))
        table = pg.routes("cuda")
        route = {e.site.name: e.decision.route.value for e in table.entries}
        check("ipc_fold all_reduce", route.get("torch.all_reduce.sum.bfloat16.3552") == "ipc_fold" or str(table))
        check("ipc_fold reduce_scatter", route.get(f"torch.reduce_scatter.sum.bfloat16.{n}") == "ipc_fold" or str(table))
        check("table names the transport", "CUDA transport: host" in str(table))
        if order_shows:
            check("control: reversed order", not np.array_equal(oracle.fold_oracle(bits[::-1], "bfloat16"), want))
            b32 = [ill_bits(64, 1024, "float32", seed=9, rank=r) for r in range(world)]  # large: gloo's ring
            xg = to_torch(b32[rank], "float32").to(dev)
            try:
                dist.all_reduce(xg, group=gloo)  # gloo stages CUDA tensors itself
            except RuntimeError:
                xg = to_torch(b32[rank], "float32")
                dist.all_reduce(xg, group=gloo)
            check("control: gloo misses the oracle", not same(xg, oracle.fold_oracle(b32, "float32")))

        step("CUDA graph: the workspace-routed all_reduce, replayed with new values")
        static = to_torch(bits[rank], "bfloat16").to(dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(static)  # warm-up (the site exists already; a capture needs it on this stream too)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                dist.all_reduce(static)
            for seed in (2, 3):
                b = [ill_bits(37, 96, "bfloat16", seed=seed, rank=r) for r in range(world)]
                static.copy_(to_torch(b[rank], "bfloat16").to(dev))
                g.replay()
                torch.cuda.synchronize()
                check(f"graph replay {seed}", same(static, oracle.fold_oracle(b, "bfloat16")))
        except Exception as e:
            check("graph replay", f"{type(e).__name__}: {e}")
        del g
        torch.cuda.synchronize()

        step("capture of host-staged calls is refused at once")
        y = to_torch(bits[rank], "bfloat16").to(dev)
        dist.all_reduce(y, op=dist.ReduceOp.AVG)  # warm-up: AVG takes gather_fold, through the host
        gathered = torch.empty(world * y.numel(), dtype=y.dtype, device=dev)
        dist.all_gather_into_tensor(gathered, y.view(-1))
        torch.cuda.synchronize()
        for what, call in (("avg", lambda: dist.all_reduce(y, op=dist.ReduceOp.AVG)),
                           ("all_gather", lambda: dist.all_gather_into_tensor(gathered, y.view(-1)))):
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g):
                    call()
                check(f"refused {what}", "captured a host-staged call")
            except Exception as e:
                check(f"refused {what}", isinstance(e, db.CaptureThroughHost) or f"{type(e).__name__}: {e}")
            del g
            torch.cuda.synchronize()
        # The group still works after the refusals. Fresh inputs: y holds an average already, and averaging it
        # again is not idempotent on this payload (W times its largest values overflows fp32).
        y = to_torch(bits[rank], "bfloat16").to(dev)
        dist.all_reduce(y, op=dist.ReduceOp.AVG)
        check("avg after the refusals", same(y, oracle.avg_oracle(bits, "bfloat16")))

        # Sparse signed powers of two, at most two nonzeros per row of w1 and per column of w2, no biases, one
        # token per rank: every local product and gradient is exact whatever kernel runs it.
        H, F = 16, 24
        def sparse_mlp(dtype):
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(H, F, bias=False), torch.nn.ReLU(), torch.nn.Linear(F, H, bias=False))
            w1, w2 = torch.zeros(F, H), torch.zeros(H, F)
            for j in range(F):
                w1[j, (3 * j) % H] = (-1.0) ** j * 2.0 ** (j % 5 - 2)
                w1[j, (3 * j + 7) % H] = (-1.0) ** (j // 2) * 2.0 ** (j % 3 - 1)
                w2[(5 * j) % H, j] = (-1.0) ** (j // 3) * 2.0 ** (j % 4 - 2)
            with torch.no_grad():
                m[0].weight.copy_(w1)
                m[2].weight.copy_(w2)
            return m.to(dev, dtype)
        def batch(q, dtype):
            # Ranks 1 and 2 hold the same token at 2^12 times rank 0's scale, with opposite targets: their gradients
            # are +-2^24 times one gradient (exactly: powers of two, one ReLU mask) and cancel, so the fold's order
            # shows in the low bits (rank 0's gradient rounds inside (g0 + g1) + g2 and not inside (g2 + g1) + g0):
            # the reversed-order controls can fail. Other ranks draw their own token.
            gen = torch.Generator().manual_seed(300 + (1 if q == 2 else q))
            x, t = torch.randn(1, H, generator=gen), torch.randn(1, H, generator=gen)
            if q in (1, 2):
                x, t = x * 2.0 ** 12, t * (2.0 ** 12 if q == 1 else -(2.0 ** 12))
            return x.to(dev, dtype), t.to(dev, dtype)
        def local_grads(dtype):  # this rank's gradients without communication, then every rank's
            m = sparse_mlp(dtype)
            x, t = batch(rank, dtype)
            (m(x).float() * t.float()).sum().backward()
            return everyone([to_bits(p.grad) for p in m.parameters()])
        def f32_bits(b, dtype):
            return oracle.widen(b, dtype).view(np.uint32)

        step("DDP, bf16, two bucket caps")
        from torch.nn.parallel import DistributedDataParallel as DDP
        grads = local_grads(torch.bfloat16)
        def ddp_oracle(i, order):  # the reducer multiplies by fp32(1 / W) into the bucket, then SUM
            with np.errstate(all="ignore"):
                pre = [oracle.round_fp32_bits((oracle.widen(grads[q][i], "bfloat16") * np.float32(1.0 / world))
                                              .astype(np.float32).view(np.uint32), "bfloat16") for q in order]
            return oracle.fold_oracle(pre, "bfloat16")
        wants = [ddp_oracle(i, range(world)) for i in range(2)]
        got = []
        for cap in (25.0, 0.0002):
            ddp = DDP(sparse_mlp(torch.bfloat16), device_ids=[0], bucket_cap_mb=cap)
            x, t = batch(rank, torch.bfloat16)
            (ddp(x).float() * t.float()).sum().backward()
            torch.cuda.synchronize()
            got.append([to_bits(p.grad) for p in ddp.module.parameters()])
            check(f"ddp cap {cap}", all(np.array_equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(got[-1], wants)))
        check("ddp caps identical", all(np.array_equal(a, b) for a, b in zip(*got)))
        if order_shows:
            check("control: ddp reversed order", any(not np.array_equal(ddp_oracle(i, range(world)[::-1]), wants[i])
                                                     for i in range(2)))

        if world >= 3:
            step("FSDP2 fully_shard, bf16 reduce dtype")
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp",))
            grads = local_grads(torch.float32)
            def fsdp_oracle(i, order):  # cast to bf16, AVG (docs/spec.md §1.1), cast back to fp32
                b = [oracle.round_fp32_bits(grads[q][i], "bfloat16") for q in order]
                return f32_bits(oracle.avg_oracle(b, "bfloat16"), "bfloat16")
            m = sparse_mlp(torch.float32)
            for mod in (m[0], m[2], m):
                fully_shard(mod, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
            x, t = batch(rank, torch.float32)
            (m(x) * t).sum().backward()
            full = [to_bits(p.grad.full_tensor()) for p in m.parameters()]
            wants = [fsdp_oracle(i, range(world)) for i in range(2)]
            check("fsdp2 bf16 reduce", all(np.array_equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(full, wants)))
            check("control: fsdp2 reversed order", any(not np.array_equal(fsdp_oracle(i, range(world)[::-1]), wants[i])
                                                       for i in range(2)))

            step("DTensor SequenceParallel / Colwise / Rowwise block")
            from torch.distributed.tensor.parallel import parallelize_module
            import test_trainer_tp as tp
            tmesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
            model = parallelize_module(tp.Block().to(dev), tmesh, tp._tp_plan())
            x, gy = (v.to(dev) for v in tp._data(0))
            y, gx = tp._run_block(model, x, gy, rank, world)
            want_y, want_gx = tp._oracle(x, gy, world)  # on x's device: the same per-row norm kernel as the ranks'
            check("tp output", np.array_equal(y, np.split(want_y, world, axis=1)[rank]))
            check("tp input grad", np.array_equal(gx, np.split(want_gx, world, axis=1)[rank]))
            check("control: tp reversed order", not np.array_equal(tp._oracle(x, gy, world, reverse=True)[0], want_y))

        if world >= 3 and ckpt:
            step("transformers tp_plan='auto', tiny Llama")
            import transformers
            import test_trainer_hf as hf
            model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, tp_plan="auto", dtype=torch.float32,
                                                                      attn_implementation="eager")
            calls, real = [], dist.all_reduce
            def spy(tensor, *args, **kwargs):
                if str(sys._getframe(1).f_globals.get("__name__", "")).startswith("detcomm."):
                    return real(tensor, *args, **kwargs)
                before = to_bits(tensor).copy()
                out = real(tensor, *args, **kwargs)
                calls.append((before, to_bits(tensor).copy()))
                return out
            ids = torch.randint(0, hf.V, (5, hf.PROMPT), generator=torch.Generator().manual_seed(5)).to(dev)
            gen = dict(max_new_tokens=hf.NEW, do_sample=False, output_logits=True, return_dict_in_generate=True,
                       pad_token_id=0, eos_token_id=None)
            runs = []
            dist.all_reduce = spy
            try:
                with torch.no_grad():
                    for rows in ([0], *hf.BATCHES):
                        out = model.generate(ids[rows], attention_mask=torch.ones_like(ids[rows]), **gen)
                        at = rows.index(0)
                        runs.append(to_bits(torch.stack(out.logits)[:, at].contiguous()))
            finally:
                dist.all_reduce = real
            check("hf logits alone == batched", all(np.array_equal(r, runs[0]) for r in runs[1:]))
            every = everyone([c[0] for c in calls])
            check("hf calls", len(calls) == 2 * hf.LAYERS * hf.NEW * (1 + len(hf.BATCHES)) or f"{len(calls)} calls")
            misses = sum(int((out != oracle.fold_oracle([e[k] for e in every], "float32")).sum())
                         for k, (_, out) in enumerate(calls))
            check("hf all-reduces == oracle", misses == 0 or f"{misses} elements differ")
            check("control: hf reversed order", any(
                not np.array_equal(oracle.fold_oracle([e[k] for e in every][::-1], "float32"), out)
                for k, (_, out) in enumerate(calls)))

        torch.cuda.synchronize()
        step("done")
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(repr(results))
        dist.destroy_process_group()

    if __name__ == "__main__":
        world = int(sys.argv[2])
        mp.start_processes(rank_main, args=(world, sys.argv[1], sys.argv[3], sys.argv[4], int(sys.argv[5])),
                           nprocs=world, join=True, start_method="spawn")
""")


def _checkpoint(tmp_path) -> str:  # type: ignore[no-untyped-def]
    """tests/test_trainer_hf.py's tiny Llama (a config, no hub), written before any process group exists; "" without
    transformers."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return ""
    sys.path.insert(0, TESTS)
    from test_trainer_hf import write_checkpoint

    return write_checkpoint(str(tmp_path / "llama"))


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_ranks_sharing_one_gpu(tmp_path, world: int) -> None:  # noqa: ANN001
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    ckpt = _checkpoint(tmp_path) if world >= 3 else ""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(world), TESTS, ckpt, str(DEADLINE_S)],
                          capture_output=True, text=True, timeout=DEADLINE_S + 60, env=env, cwd=REPO)
    for r in range(world):
        path = tmp_path / f"rank{r}.txt"
        log = (tmp_path / f"rank{r}.log").read_text() if (tmp_path / f"rank{r}.log").exists() else ""
        assert path.exists(), f"rank {r} stopped after: {log[-500:]}\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}"
        results = eval(path.read_text())  # noqa: S307 - our own repr of (str, bool | str) pairs
        assert all(ok is True for _, ok in results), [(w, ok) for w, ok in results if ok is not True]
        kinds = {what for what, _ in results}
        expected = {"all_reduce", "reduce_scatter", "transport is host", "ipc_fold all_reduce", "graph replay 2",
                    "graph replay 3", "refused avg", "refused all_gather", "ddp cap 25.0", "ddp caps identical"}
        if world >= 3:
            expected |= {"control: reversed order", "control: gloo misses the oracle", "fsdp2 bf16 reduce",
                         "tp output", "tp input grad", "control: tp reversed order", "control: ddp reversed order"}
            if ckpt:
                expected |= {"hf logits alone == batched", "hf all-reduces == oracle", "control: hf reversed order"}
        assert kinds >= expected, sorted(expected - kinds)
