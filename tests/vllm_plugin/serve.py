"""An unmodified vLLM script (it never imports detcomm): the plugin is on or off by the environment alone.

    python tests/vllm_plugin/serve.py --model DIR --tp N --out result.json

Generates the same 8 requests alone (one request per ``generate``), packed twice among 8 other requests in two
orders and rerun (the first packing again), greedy with the top-2 logprobs, and writes the token ids and the
logprobs' fp32 bits (``float.hex``) per request and per phase. The driver needs ``if __name__ == "__main__"``:
vLLM's CPU workers are spawned processes that import this file.
"""

from __future__ import annotations

import argparse
import json
import time


def requests(n: int, *, salt: int) -> list[dict[str, list[int]]]:
    # Token ids of the tiny checkpoints' word-level vocabulary (3..1023); lengths 5..19, so prefill rows differ.
    return [{"prompt_token_ids": [1] + [3 + (37 * i + 11 * j + salt * 101) % 1000 for j in range(5 + 2 * i)]}
            for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=6)
    a = p.parse_args()
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=a.model, tensor_parallel_size=a.tp, dtype="float32", max_model_len=128, seed=0,
              max_num_batched_tokens=128, max_num_seqs=16, enable_prefix_caching=False)
    started = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, logprobs=2)

    def run(prompts: list[dict[str, list[int]]]) -> list[dict[str, object]]:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return [{"ids": list(o.outputs[0].token_ids),
                 "lp": [[float(v.logprob).hex() for _, v in sorted(step.items())] for step in o.outputs[0].logprobs]}
                for o in outs]

    mine = requests(8, salt=0)
    t1 = time.perf_counter()
    alone = [run([r])[0] for r in mine]
    fillers = requests(8, salt=1)
    packed = run(mine + fillers)[:8]
    order = [fillers[3], mine[5], fillers[0], mine[2], mine[7], fillers[6], mine[0], mine[1], fillers[1], mine[3],
             mine[4], fillers[2], mine[6]]
    got = run(order)
    where = {id(r): k for k, r in enumerate(order)}
    packed2 = [got[where[id(r)]] for r in mine]
    rerun = run(mine + fillers)[:8]
    generated = time.perf_counter() - t1
    with open(a.out, "w") as f:
        json.dump({"tp": a.tp, "start_s": started, "generate_s": generated, "alone": alone, "packed": packed,
                   "packed2": packed2, "rerun": rerun}, f)
    print(f"tp={a.tp} start {started:.1f} s, generate {generated:.2f} s")


if __name__ == "__main__":
    main()
