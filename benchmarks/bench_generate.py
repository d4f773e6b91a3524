"""How much faster sampling runs with the KV cache than running the whole context every token.

    python benchmarks/bench_generate.py [--tokens 100,400] [--threads 2] [--out FILE.json]

``fp8shard.generate.sample`` on a GPT of the 125M preset's shapes (12 x 768, vocab 50304, 1024
positions; random weights: the cost does not depend on them), fp32 on the CPU, from a prompt of
8 tokens, temperature 0.8 and top-k 50, once with the cache ([Note: KV cache]) and once without
(``use_cache=False``). Prints the seconds of each and their ratio per length, and checks that
both sampled the same tokens. ``--small`` takes a 2-layer model of width 64 (for the tests).
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

import torch

from timing import write_json


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from fp8shard import generate
    from fp8shard.models import GPT, GPTConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[100, 400])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a 2-layer model of width 64")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = (dict(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=2, vocab_size=256,
                  max_position_embeddings=64) if args.small else
             dict(num_layers=12, hidden_size=768, ffn_hidden_size=3072, num_attention_heads=12,
                  vocab_size=50304, max_position_embeddings=1024))
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape)).eval()
    res: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                           "threads": args.threads, "model": shape, "rows": []}
    print("| new tokens | with the KV cache, s | without, s | speed-up | same tokens |")
    print("|---|---|---|---|---|")
    for n in args.tokens:
        secs, outs = {}, {}
        for cache in (True, False):
            t = time.perf_counter()
            outs[cache] = generate.sample(model, list(range(1, 9)), n, temperature=0.8, top_k=50,
                                          use_cache=cache)
            secs[cache] = time.perf_counter() - t
        row = {"new_tokens": n, "cache_s": secs[True], "no_cache_s": secs[False],
               "speedup": secs[False] / secs[True], "same_tokens": outs[True] == outs[False]}
        res["rows"].append(row)
        print(f"| {n} | {row['cache_s']:.2f} | {row['no_cache_s']:.2f} | {row['speedup']:.1f}x | "
              f"{row['same_tokens']} |", flush=True)
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
