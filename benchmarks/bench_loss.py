"""The output layer + cross-entropy: plain (all logits at once) against chunked ([Note: chunked loss]).

    python benchmarks/bench_loss.py [--tokens 4096 --hidden 256 --vocab 32768] [--compile] [--out F]
    python benchmarks/bench_loss.py --gpu --tokens 16384 --hidden 768 --vocab 50304 --compile

One forward + backward of ``loss(final_norm(h) @ W^T, targets)`` per variant, as the GPT's
``head`` computes it (``GPT.head``; LayerNorm, tied weight, bf16 autocast by default). Measured:
  peak_mb   memory above what was allocated before the step. CUDA: torch.cuda.max_memory_allocated;
            CPU: the peak resident set of a fresh process per variant (VmHWM; ru_maxrss would
            carry the parent's peak across fork + exec) minus its resident set before the step
  saved_mb  what autograd keeps between forward and backward (saved tensors, each storage once)
  ms        median wall time of --reps steps after one warm-up (CPU figures are for the record)
  loss, max |dW| difference to the plain variant
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

VARIANTS = ["plain", "chunked"]


def _rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (VmRSS) or its peak so far (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_variant(name: str, a: argparse.Namespace) -> dict:
    from fp8shard.models import GPT, GPTConfig

    device = torch.device("cuda" if a.gpu else "cpu")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=a.vocab, max_position_embeddings=16, num_layers=1, hidden_size=a.hidden,
                    ffn_hidden_size=4 * a.hidden, num_attention_heads=1,
                    loss_chunk_tokens=0 if name == "plain" else a.chunk_tokens)
    model = GPT(cfg).to(device)
    dtype = torch.bfloat16 if a.params_bf16 else torch.float32
    model.to(dtype)
    head = torch.compile(type(model).head) if a.compile else type(model).head
    h = torch.randn(a.tokens // 1024 or 1, min(a.tokens, 1024), a.hidden, device=device, dtype=dtype,
                    requires_grad=True)
    y = torch.randint(0, a.vocab, h.shape[:2], device=device)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        h.grad = None
        model.wte.weight.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not a.no_autocast):
            loss = head(model, h, y)
        loss.backward()
        return loss.detach(), model.wte.weight.grad

    step()  # warm-up (and compilation)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    if a.gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_bytes()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, dw = step()
    if a.gpu:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _rss_bytes("VmHWM") - before
    times = []
    for _ in range(a.reps):
        if a.gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if a.gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if a.grad_file:
        torch.save(dw.float().cpu(), a.grad_file)
    return {"variant": name, "peak_mb": peak / 2**20, "saved_mb": sum(storages.values()) / 2**20,
            "ms": statistics.median(times) * 1e3, "loss": loss.item(), "dw": dw.float().cpu()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunk-tokens", type=int, default=None, help="default: automatic (chunk_rows)")
    ap.add_argument("--params-bf16", action="store_true", help="bf16 weights and input (fp8shard's DFA)")
    ap.add_argument("--no-autocast", action="store_true")
    ap.add_argument("--compile", action="store_true", help="the head compiled (Inductor)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one variant
    ap.add_argument("--grad-file", default=None, help=argparse.SUPPRESS)  # internal: dW goes here
    a = ap.parse_args(argv)
    if a.one:
        row = run_variant(a.one, a)
        row.pop("dw")
        print(json.dumps(row))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for v in a.variants.split(","):
            if a.gpu:
                rows.append(run_variant(v, a))
                torch.cuda.empty_cache()
                continue
            # CPU: a fresh process per variant, so its peak resident set is its own
            grad_file = os.path.join(tmp, f"{v}.pt")
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--one", v,
                   "--grad-file", grad_file]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(dict(json.loads(proc.stdout.strip().splitlines()[-1]), dw=torch.load(grad_file)))
    ref = next((r["dw"] for r in rows if r["variant"] == "plain"), None)
    for r in rows:
        dw = r.pop("dw")
        if ref is not None:
            r["max_abs_dw_diff"] = (dw - ref).abs().max().item()
    dev = torch.cuda.get_device_name() if a.gpu else f"CPU x{os.cpu_count()}"
    print(f"bench_loss: {dev}, torch {torch.__version__}, {a.tokens} tokens x hidden {a.hidden} x vocab "
          f"{a.vocab}, {'bf16' if a.params_bf16 else 'fp32'} params, autocast "
          f"{'off' if a.no_autocast else 'bf16'}, {'compiled' if a.compile else 'eager'}; fp32 logits "
          f"would be {a.tokens * a.vocab * 4 / 2**20:.0f} MB")
    print(f"{'variant':<10}{'peak MB':>10}{'saved MB':>10}{'ms':>10}{'loss':>10}{'max|dW diff|':>14}")
    for r in rows:
        print(f"{r['variant']:<10}{r['peak_mb']:>10.1f}{r['saved_mb']:>10.1f}{r['ms']:>10.2f}"
              f"{r['loss']:>10.4f}{r.get('max_abs_dw_diff', 0.0):>14.3g}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k not in ("one", "return_grad")},
                       "device": dev, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
