"""fp8shard against its peers on one GPT workload, side by side in one run.

    python benchmarks/compare_peers.py [--quick] [--out FILE.json]          # CPU, gloo, 2 ranks
    python benchmarks/compare_peers.py --gpu [--size 125m|1b] [--out FILE.json]   # one CUDA GPU
    python benchmarks/compare_peers.py --gpu --compile --size 125m \
        --systems reference-bf16,torchao-float8,fp8shard-fp8,fp8shard-bf16

Systems (same model shapes, initial values, tokens, steps and seed):
  fp8shard-fp8    FP8 compute + FP8 parameters + DistributedFusedAdam
  fp8shard-bf16   bf16 parameters + DistributedFusedAdam (FP32 master)
  fp8shard-fsdp2  fp8shard-fp8 on the FSDP2 engine (fully_shard_model without resharding after
                  the forward, FSDP2Adam), eager
  ddp-adamw       torch DistributedDataParallel + torch.optim.AdamW, fp32 params, bf16 autocast
  zero-adamw      torch ZeroRedundancyOptimizer(AdamW) + DDP, fp32 params, bf16 autocast
  torchao-fsdp2   torchao float8 training + FSDP2 fully_shard (emulated on CPU); FP8 all-gather
                  where the backend allows it (gloo has no float8: off there, said in the output)
  reference-bf16  what most users would run instead (world size 1): a plain nanoGPT-style GPT
                  of the same shapes (benchmarks/nanogpt_ref.py), fp32 parameters,
                  torch.autocast(bf16), torch.optim.AdamW(fused=True on CUDA), the whole model
                  under torch.compile (on CPU only with --compile)
  torchao-float8  that same reference after torchao.float8.convert_to_float8_training
                  (tensorwise dynamic scaling, the recipe's default and its single-GPU setting),
                  compiled as the reference, world size 1 (no FSDP). --torchao-filter: auto
                  (default on GPU: torchao's own filter for tensorwise, which skips the tied
                  lm_head by name and layers too small to gain) or all (every block Linear;
                  the default on CPU, where auto converts nothing at the test sizes); the row's
                  note says how many Linears were converted
  --recipe        fp8shard-fp8's activation scaling: delayed (the training default, NeMo's) or
                  current (per-tensor amax of each cast, as torchao's tensorwise recipe)
  --compile       adds "<system>+compile" after each fp8shard system chosen: the same model
                  compiled in place as ``trainer.compile=true`` does, with --compile-scope
                  (default auto: one graph at world size 1, one graph per region above; see
                  fp8shard.train.builders.compile_model) and --compile-mode (reduce-overhead:
                  CUDA graphs), so eager and compiled fp8shard run side by side in one call
  --size          GPU shapes: 1b (default: 24 x 2048, FFN 8192, 16 heads, vocab 32768, seq
                  2048, 8 sequences) or 125m (12 x 768, FFN 3072, 12 heads, vocab 50304, seq
                  1024, 16 sequences)

Every system computes its loss inside the model's forward (``model(idx, targets)``): fp8shard's
GPT with its chunked output layer + cross-entropy ([Note: chunked loss]), the reference with
nanoGPT's ``F.cross_entropy`` of the full logits.

Measured by this harness in the same way for every system:
  step_ms        median wall time of the timed steps (after warm-up)
  vs_reference   reference-bf16's step_ms over this row's (> 1: faster than the compiled
                 reference), when reference-bf16 is among the systems
  peak_rss_mb    CPU: peak resident memory of the rank (a fresh process per system);
                 GPU: torch.cuda.max_memory_allocated
  bytes/param    persistent tensors (params, grads and grad buffers, optimizer states) found by
                 walking the model and optimizer, each storage counted once, over parameter count
  wire bytes     per step and rank, by collective, counted by wrapping torch.distributed's
                 collectives (and a DDP comm hook): the size of the full buffer each call
                 reduces or gathers (all_reduce: the tensor; all_gather: the output;
                 reduce_scatter: the input; broadcast: the tensor)
  loss           mean training loss of the last 3 steps
  memory phases  GPU: the last step's allocated MB at its start (what persists between steps),
                 the forward's peak, after the forward (+ what is saved for backward), the
                 backward's peak, after backward (+ gradients), and the optimizer step's peak;
                 with --memory-snapshot also what was live at the step's peak, by where it was
                 allocated (accounting.StepMemory, peak_live_blocks)
On CPU the world-size-1 systems (reference-bf16, torchao-float8) run in a 1-rank group on the
whole global batch; the others in 2 ranks, each on half of it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from accounting import (  # benchmarks/
    WIRE_COUNTS,
    StepMemory,
    count_wire_bytes,
    ddp_counting_hook,
    memory_table,
    persistent_bytes,
)

SYSTEMS = ["fp8shard-fp8", "fp8shard-bf16", "ddp-adamw", "zero-adamw", "torchao-fsdp2",
           "reference-bf16", "torchao-float8", "fp8shard-fsdp2"]
SINGLE = ("reference-bf16", "torchao-float8")  # world size 1 by definition
REFERENCE = "reference-bf16"
COMPILED = "+compile"  # suffix of an fp8shard system run compiled in place (--compile)
COMPILABLE = ("fp8shard-fp8", "fp8shard-bf16")  # the FSDP2 engine trains eager (docs/engines.md)

# ----------------------------------------------------------------------------- one system

def _swap_to_torch_linear(model: torch.nn.Module) -> torch.nn.Module:
    """Replace fp8shard.nn.Linear by torch.nn.Linear with the same values (for the peers)."""
    import fp8shard.nn as fsnn

    for name, mod in list(model.named_children()):
        if isinstance(mod, fsnn.Linear):
            lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                  device=mod.weight.device)
            with torch.no_grad():
                lin.weight.copy_(mod.weight)
                if mod.bias is not None:
                    lin.bias.copy_(mod.bias)
            setattr(model, name, lin)
        else:
            _swap_to_torch_linear(mod)
    return model


def _compile_fp8shard(model: torch.nn.Module, recipe: Any, scope: str, backend: str, mode: str) -> str:
    """Compile in place, as the training command's ``trainer.compile=true`` does."""
    from fp8shard.train.builders import compile_model, compile_scope_for

    scope = compile_scope_for(scope, dist.get_world_size())
    n = compile_model(model, recipe, scope, backend, mode)
    how = "" if mode == "default" else f", trainer.compile_mode={mode}"
    return f"compiled in place, trainer.compile_scope={scope}{how} ({n} region(s))"


def _torchao_filter(kind: str):
    """torchao's module filter: ``auto`` = its own filter for the tensorwise recipe (skips the
    tied lm_head by name and shapes too small to gain), ``all`` = every Linear but lm_head."""
    if kind == "auto":
        from torchao.float8 import _auto_filter_for_recipe

        return _auto_filter_for_recipe("tensorwise", filter_fqns=["lm_head"])
    return lambda mod, fqn: fqn != "lm_head" and all(d % 16 == 0 for d in mod.weight.shape)


def _build_single(system: str, cfg: dict, device: torch.device, gpt: torch.nn.Module
                  ) -> tuple[torch.nn.Module, Any, Any, str]:
    """reference-bf16 / torchao-float8: nanoGPT-style model, fp32 params, autocast, AdamW, compiled."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from nanogpt_ref import RefGPT

    model = RefGPT.from_gpt(gpt, device)  # built on the device, values copied from gpt
    notes = []
    if system == "torchao-float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        kind = cfg.get("torchao_filter") or ("auto" if device.type == "cuda" else "all")
        total = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        convert_to_float8_training(model, config=Float8LinearConfig(emulate=device.type != "cuda"),
                                   module_filter_fn=_torchao_filter(kind))
        done = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        notes.append(f"tensorwise, {done} of {total} Linears in float8 (filter {kind}; the tied "
                     f"lm_head stays bf16){', emulated' if device.type != 'cuda' else ''}")
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0, fused=fused)
    notes.append(f"fp32 params, bf16 autocast, AdamW(fused={fused})")
    if cfg["compile_peers"]:
        model.compile(backend=cfg.get("compile_backend", "inductor"))
        notes.append("whole model compiled")
    else:
        notes.append("eager (CPU without --compile)")
    autocast = functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)
    return model, opt, autocast, "; ".join(notes)


class Fp8Context:
    """fp8shard-fp8's forward context factory, and its amax update after each backward.

    Calling it gives ``fp8_autocast``; ``after_backward()`` is the training command's
    ``AmaxSync.step()`` under delayed scaling (one packed amax all-reduce over every rank,
    [Note: amax reduction]), nothing under current scaling.
    """

    def __init__(self, model: torch.nn.Module, recipe: Any) -> None:
        import fp8shard as fs

        self.recipe = recipe
        self.sync = fs.nn.AmaxSync(model) if isinstance(recipe, fs.DelayedScaling) else None

    def __call__(self) -> Any:
        import fp8shard as fs

        return fs.fp8_autocast(enabled=True, recipe=self.recipe)

    def after_backward(self) -> None:
        if self.sync is not None:
            self.sync.step()


def after_backward(ctx: Any) -> None:
    """What a system runs after each backward (fp8shard-fp8: the amax update), else nothing."""
    hook = getattr(ctx, "after_backward", None)
    if hook is not None:
        hook()


LAYERS_SEP = "@"  # "<fp8shard FP8 system>@all|auto": one row per FP8 layer policy, side by side


def _split_layers(system: str) -> tuple[str, str | None]:
    """("fp8shard-fp8+compile", "auto") from "fp8shard-fp8+compile@auto"; (system, None) without."""
    name, sep, policy = system.partition(LAYERS_SEP)
    return (name, policy) if sep else (system, None)


def _select_fp8_layers(model: torch.nn.Module, cfg: dict, device: torch.device) -> str:
    """The training command's model.fp8_layers on an fp8shard model ([Note: FP8 layer filter])."""
    import fp8shard as fs
    from fp8shard.nn.gemm_filter import MIN_FP8_WEIGHT_ELEMENTS

    policy, least = cfg.get("fp8_layers", "auto"), cfg.get("fp8_min_weights") or MIN_FP8_WEIGHT_ELEMENTS
    n, total = fs.nn.select_fp8_layers(model, policy, device, min_weights=least)
    return f"FP8 compute in {n}/{total} layers (fp8_layers={policy}, threshold {least} weights)"


def _build(system: str, cfg: dict, device: torch.device) -> tuple[torch.nn.Module, Any, Any, str]:
    """(model, optimizer, forward-context factory, note) for one system."""
    import fp8shard as fs
    from fp8shard.models import GPT, GPTConfig
    from fp8shard.optim import DistributedFusedAdam

    gcfg = GPTConfig(**cfg["model"], loss_chunk_tokens=cfg.get("loss_chunk_tokens"))
    lr, note = cfg["lr"], ""
    torch.manual_seed(cfg["seed"])
    system, policy = _split_layers(system)
    if policy:  # "fp8shard-fp8+compile@auto": this row's model.fp8_layers
        cfg = {**cfg, "fp8_layers": policy}
    compiled = system.endswith(COMPILED)
    system = system.removesuffix(COMPILED)
    scope = cfg.get("compile_scope", "auto")
    backend = cfg.get("compile_backend", "inductor")
    mode = cfg.get("compile_mode", "default")
    if system in SINGLE:  # built on the CPU as the others, so all start from the same values
        return _build_single(system, cfg, device, GPT(gcfg))
    if system == "fp8shard-fp8":
        with fs.fp8_model_init(enabled=True, preserve_high_precision_init_val=True):
            model = GPT(gcfg).to(device)
        model.to(torch.bfloat16)
        opt = DistributedFusedAdam(model.parameters(), lr=lr, weight_decay=0.0)
        recipe = fs.DelayedScaling() if cfg.get("recipe", "delayed") == "delayed" else fs.CurrentScaling()
        note = f"{cfg.get('recipe', 'delayed')} scaling; " + _select_fp8_layers(model, cfg, device)
        note += "; " + _compile_fp8shard(model, recipe, scope, backend, mode) if compiled else ""
        return model, opt, Fp8Context(model, recipe), note
    if system == "fp8shard-fsdp2":  # the same FP8 weights and optimizer math on FSDP2 (eager)
        from fp8shard.optim.fsdp2 import FSDP2Adam, default_mesh, fully_shard_model

        with fs.fp8_model_init(enabled=True, preserve_high_precision_init_val=True):
            model = GPT(gcfg).to(device)
        model.to(torch.bfloat16)
        # Gathered weights kept from the forward to the backward (ZeRO-2-like), as the flat engine
        # keeps them: one all-gather per step, so the two engines move the same bytes.
        fully_shard_model(model, default_mesh(), reshard_after_forward=False)
        opt = FSDP2Adam(model.parameters(), lr=lr, weight_decay=0.0)
        recipe = fs.DelayedScaling() if cfg.get("recipe", "delayed") == "delayed" else fs.CurrentScaling()
        note = (f"{cfg.get('recipe', 'delayed')} scaling; FSDP2 engine; "
                + _select_fp8_layers(model, cfg, device))
        return model, opt, Fp8Context(model, recipe), note
    if system == "fp8shard-bf16":
        model = GPT(gcfg).to(device).to(torch.bfloat16)
        opt = DistributedFusedAdam(model.parameters(), lr=lr, weight_decay=0.0)
        note = _compile_fp8shard(model, None, scope, backend, mode) if compiled else note
        return model, opt, contextlib.nullcontext, note
    autocast = functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)
    if system in ("ddp-adamw", "zero-adamw"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = _swap_to_torch_linear(GPT(gcfg)).to(device)
        # gradient_as_bucket_view: the grads are DDP's buckets, so the walk below counts them
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  gradient_as_bucket_view=True)
        ddp.register_comm_hook(None, ddp_counting_hook)
        if system == "ddp-adamw":
            opt = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=0.0)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                          lr=lr, weight_decay=0.0)
        return ddp, opt, autocast, note
    if system == "torchao-fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        fp8_gather = device.type == "cuda"
        note = ("FP8 all-gather on, blocks compiled" if fp8_gather else
                "FP8 all-gather off: gloo has no float8 dtype; emulated FP8 compute on CPU")
        model = _swap_to_torch_linear(GPT(gcfg)).to(device)
        config = Float8LinearConfig(emulate=device.type != "cuda",
                                    enable_fsdp_float8_all_gather=fp8_gather)
        convert_to_float8_training(
            model, config=config,
            module_filter_fn=lambda m, fqn: "lm_head" not in fqn and "output" not in fqn)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            if device.type == "cuda":  # torchao's fast path is compiled (torchtitan: per block)
                block.compile()
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        if fp8_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            opt.register_step_post_hook(lambda *a: precompute_float8_dynamic_scale_for_fsdp(model))
        return model, opt, contextlib.nullcontext, note
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")


def _batches(cfg: dict, rank: int, world: int, device: torch.device):
    """The same global batches for every system; rank r takes rows r::world."""
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    vocab, seq, gb = cfg["model"]["vocab_size"], cfg["seq_len"], cfg["global_batch"]
    # A learnable stream: token t+1 = (a * token t + noise) mod vocab, so the loss falls.
    for _ in range(cfg["steps"]):
        start = torch.randint(0, vocab, (gb, 1), generator=g)
        flip = (torch.rand(gb, seq, generator=g) < 0.1).long()
        noise = flip * torch.randint(0, vocab, (gb, seq), generator=g)
        idx = (start + torch.arange(seq + 1) * 7 + torch.nn.functional.pad(noise, (1, 0))) % vocab
        idx = idx[rank::world].to(device)
        yield idx[:, :-1], idx[:, 1:]


def step_loss(model: torch.nn.Module, ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean loss, computed inside the model's forward (every system the same way)."""
    with ctx():
        return model(x, y)


def run_system(system: str, cfg: dict) -> dict:
    """Train ``system`` for cfg['steps'] steps on this rank; return its measurements."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if system in SINGLE and world != 1:
        raise ValueError(f"{system} runs at world size 1 (got {world})")
    device = torch.device("cuda", torch.cuda.current_device()) if cfg["gpu"] else torch.device("cpu")
    try:
        model, opt, ctx, note = _build(system, cfg, device)
    except ImportError as e:
        return {"system": system, "available": False, "reason": f"not installed: {e}"}
    n_params = sum(p.numel() for p in model.parameters()) * (world if system == "torchao-fsdp2" else 1)
    if cfg["gpu"]:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    step_memory = StepMemory(bool(cfg.get("memory_snapshot"))) if cfg["gpu"] else None
    WIRE_COUNTS.clear()
    with count_wire_bytes():
        for step, (x, y) in enumerate(_batches(cfg, rank, world, device)):
            if step == cfg["warmup"]:
                WIRE_COUNTS.clear()
            if cfg["gpu"]:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if cfg.get("compile_mode", "default") != "default":  # CUDA graphs: a new step
                torch.compiler.cudagraph_mark_step_begin()
            last = step == cfg["steps"] - 1
            measure = step_memory if last else None  # the last step by phase (docstring)
            if measure:
                measure.begin()
            loss = step_loss(model, ctx, x, y)
            if measure:
                measure.end("forward")
            loss.backward()
            after_backward(ctx)
            if measure:
                measure.end("backward")
            opt.step()
            if measure:
                measure.end("optimizer")
            if last:  # measured while gradients exist
                mem = persistent_bytes(model, opt)
            opt.zero_grad(set_to_none=True)
            if cfg["gpu"]:
                torch.cuda.synchronize()
            if step >= cfg["warmup"]:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    timed = cfg["steps"] - cfg["warmup"]
    total_params = n_params
    if system.startswith("fp8shard") or system == "torchao-fsdp2":
        total_params = sum(p.numel() for p in model.parameters())
        if system == "torchao-fsdp2":
            total_params = sum(p.shape.numel() for p in model.parameters())  # DTensor: global
    peak = (step_memory.peak_bytes() if step_memory is not None
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    loss_t = torch.tensor(statistics.mean(losses[-3:]), device=device)
    stored: dict[str, int] = {}  # parameter elements by storage dtype (float8 for FP8 weights)
    for p in model.parameters():
        key = "float8" if hasattr(p, "fp8_data") else str(p.dtype).removeprefix("torch.")
        stored[key] = stored.get(key, 0) + (p.shape.numel() if system == "torchao-fsdp2" else p.numel())
    return {
        "system": system, "available": True, "note": note,
        "step_ms": statistics.median(times) * 1e3,
        "tokens_per_s": cfg["global_batch"] * cfg["seq_len"] / statistics.median(times),
        "peak_mem_mb": peak / 2**20,
        "mem_phases_mb": step_memory.mb if step_memory is not None else None,
        "live_at_peak": step_memory.live if step_memory is not None else None,
        "bytes_per_param": {k: v / total_params for k, v in mem.items()},
        "bytes_per_param_total": sum(mem.values()) / total_params,
        "wire_bytes_per_step": {k: v // timed for k, v in sorted(WIRE_COUNTS.items())},
        "loss": float(loss_t),
        "params": total_params,
        "param_elems_by_dtype": stored,
    }


# ----------------------------------------------------------------------------- driver

GPU_SIZES = {
    "1b": dict(model=dict(vocab_size=32768, max_position_embeddings=2048, num_layers=24, hidden_size=2048,
                          ffn_hidden_size=8192, num_attention_heads=16), seq_len=2048, global_batch=8),
    "125m": dict(model=dict(vocab_size=50304, max_position_embeddings=1024, num_layers=12, hidden_size=768,
                            ffn_hidden_size=3072, num_attention_heads=12), seq_len=1024, global_batch=16),
}


def _config(args: argparse.Namespace) -> dict:
    size = getattr(args, "size", None)
    common = dict(recipe=getattr(args, "recipe", "delayed"),
                  compile_scope=getattr(args, "compile_scope", "auto"),
                  compile_mode=getattr(args, "compile_mode", "default"),
                  compile_backend=getattr(args, "compile_backend", "inductor"),
                  torchao_filter=getattr(args, "torchao_filter", None),
                  fp8_layers=getattr(args, "fp8_layers", "auto"),
                  fp8_min_weights=getattr(args, "fp8_min_weights", None),
                  loss_chunk_tokens=getattr(args, "loss_chunk_tokens", None),
                  memory_snapshot=getattr(args, "memory_snapshot", False))
    if args.gpu:
        shape = GPU_SIZES[size or "1b"]
        return dict(shape, size=size or "1b", steps=args.steps or 12, warmup=4, lr=3e-4, seed=0, gpu=True,
                    compile_peers=True, **common)
    dims = dict(num_layers=2, hidden_size=64, ffn_hidden_size=256) if args.quick else \
        dict(num_layers=4, hidden_size=128, ffn_hidden_size=512)
    model = dict(vocab_size=256, max_position_embeddings=64, num_attention_heads=4, **dims)
    return dict(model=model, size="quick" if args.quick else "small", seq_len=64, global_batch=8,
                steps=args.steps or (8 if args.quick else 20), warmup=2 if args.quick else 5, lr=1e-3,
                seed=0, gpu=False, compile_peers=bool(getattr(args, "compile", False)), **common)


def _add_ratios(rows: list[dict]) -> None:
    """``vs_reference``: reference-bf16's step time over each row's (> 1: faster)."""
    ref = next((r for r in rows if r["system"] == REFERENCE and r.get("available")), None)
    for r in rows:
        if ref is not None and r.get("available"):
            r["vs_reference"] = ref["step_ms"] / r["step_ms"]


def _print_table(rows: list[dict], header: str) -> None:
    print(header)
    print(f"{'system':<23}{'step ms':>9}{'tok/s':>10}{'vs ref':>8}{'peak MB':>9}{'B/param':>9}"
          f"{'wire B/step':>13}{'loss':>8}  wire by collective / note")
    for r in rows:
        if not r.get("available"):
            print(f"{r['system']:<23}  unavailable: {r['reason']}")
            continue
        wire = sum(r["wire_bytes_per_step"].values())
        detail = ", ".join(f"{k}={v}" for k, v in r["wire_bytes_per_step"].items())
        ratio = f"{r['vs_reference']:.2f}x" if "vs_reference" in r else "-"
        print(f"{r['system']:<23}{r['step_ms']:>9.1f}{r['tokens_per_s']:>10.0f}{ratio:>8}"
              f"{r['peak_mem_mb']:>9.0f}{r['bytes_per_param_total']:>9.2f}{wire:>13}{r['loss']:>8.3f}"
              f"  {detail}"
              + (f" [{r['note']}]" if r.get("note") else ""))
    for line in memory_table(rows):
        print(line)


def _run_gpu(cfg: dict, systems: list[str], on_row: Any = None) -> list[dict]:
    """Every system on GPU 0 at world size 1 (NCCL); ``on_row(rows)`` after each one."""
    import tempfile

    store = tempfile.mktemp(prefix="fp8shard_bench_")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    rows = []
    for s in systems:
        try:
            rows.append(run_system(s, cfg))
        except Exception as e:  # one failing peer must not hide the others' figures
            rows.append({"system": s, "available": False, "reason": f"{type(e).__name__}: {e}"})
        torch._dynamo.reset()  # drop the compiled graphs (and what they hold) of this system
        gc.collect()
        torch.cuda.empty_cache()
        # MFU: 6 * params * tokens/s over the bf16 dense peak measured on the H200 (773 TFLOP/s)
        if rows[-1].get("available"):
            rows[-1]["mfu_vs_bf16_peak"] = 6 * rows[-1]["params"] * rows[-1]["tokens_per_s"] / 773e12
        if on_row is not None:
            on_row(rows)
    dist.destroy_process_group()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smallest size (a few minutes on 2 cores)")
    ap.add_argument("--gpu", action="store_true", help="one CUDA GPU (--size: 1b by default)")
    ap.add_argument("--size", choices=tuple(GPU_SIZES), default=None,
                    help="the GPU model: 1b (default, ~1.3B parameters) or 125m; needs --gpu")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--compile", action="store_true",
                    help="also run each chosen fp8shard system compiled in place ('+compile' rows); "
                         "on CPU also compiles reference-bf16 and torchao-float8 (always on GPU)")
    ap.add_argument("--compile-scope", choices=("auto", "model", "graph", "blocks"), default="auto",
                    help="what '+compile' compiles (trainer.compile_scope; default auto: one graph at "
                         "world size 1, regions above)")
    ap.add_argument("--compile-mode", choices=("default", "reduce-overhead"), default="default",
                    help="'+compile' fp8shard systems: trainer.compile_mode (reduce-overhead: CUDA graphs)")
    ap.add_argument("--compile-backend", choices=("inductor", "aot_eager", "eager"), default="inductor",
                    help="torch.compile backend of the compiled rows (trainer.compile_backend)")
    ap.add_argument("--recipe", choices=("delayed", "current"), default="delayed",
                    help="fp8shard-fp8's scaling recipe (default: delayed, the training default)")
    ap.add_argument("--torchao-filter", choices=("auto", "all"), default=None,
                    help="torchao-float8's Linears in float8: auto (torchao's tensorwise filter; "
                         "default on GPU) or all but lm_head (default on CPU)")
    ap.add_argument("--fp8-layers", choices=("auto", "all"), default="auto",
                    help="fp8shard FP8 systems: which layers compute in FP8 (the training command's "
                         "model.fp8_layers; auto keeps narrow layers in bf16 on a GPU)")
    ap.add_argument("--fp8-min-weights", type=int, default=None,
                    help="the FP8 layer filter's threshold for this run (fs.nn.gemm_filter."
                         "MIN_FP8_WEIGHT_ELEMENTS): e.g. 8388608 to see the 1.3B GPT's 2048x2048 "
                         "layers in bf16 in the @auto row")
    ap.add_argument("--loss-chunk-tokens", type=int, default=None,
                    help="fp8shard's GPTConfig.loss_chunk_tokens (0: the plain output layer + loss)")
    ap.add_argument("--memory-snapshot", action="store_true",
                    help="GPU: record the last step's allocations and print what is live at its peak")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.size and not args.gpu:
        ap.error("--size picks a GPU model: add --gpu (the CPU sizes are the default and --quick)")
    cfg = _config(args)
    systems = [s for s in args.systems.split(",") if s]
    for full in systems:
        s, policy = _split_layers(full)
        if policy is not None and (policy not in ("auto", "all") or (not s.startswith("fp8shard-fp8")
                                   and not s.startswith("fp8shard-fsdp2"))):
            ap.error(f"system {full!r}: NAME{LAYERS_SEP}all|auto takes an fp8shard FP8 system "
                     f"(fp8shard-fp8, fp8shard-fsdp2) and the policy auto or all")
        if s.removesuffix(COMPILED) not in SYSTEMS or (s.endswith(COMPILED) and s.removesuffix(COMPILED)
                                                        not in COMPILABLE):
            ap.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)} "
                     f"({', '.join(COMPILABLE)} also as NAME{COMPILED})")
    if args.compile:  # each compilable fp8shard system, then its compiled twin
        systems = [x for s in systems for x in ([s, s + COMPILED] if s in COMPILABLE else [s])]
    if args.gpu:
        def partial(rows: list[dict]) -> None:  # what a run cut short by a time limit leaves
            if args.out:
                _add_ratios(rows)
                with open(args.out, "w") as f:
                    json.dump({"config": cfg, "world_size": 1, "rows": rows, "partial": True}, f, indent=1)

        rows = _run_gpu(cfg, systems, partial)
        world = 1
    else:
        from fp8shard.testing import DistPool

        world, rows = 2, []
        for s in systems:  # a fresh pool per system, so peak RSS belongs to that system alone
            with DistPool(1 if s in SINGLE else world, backend="gloo") as pool:
                try:
                    rows.append(pool.run(run_system, s, cfg)[0])
                except RuntimeError as e:
                    rows.append({"system": s, "available": False, "reason": str(e).splitlines()[-1]})
    _add_ratios(rows)
    machine = torch.cuda.get_device_name() if args.gpu else f"{platform.machine()} CPU x{os.cpu_count()}"
    header = (f"compare_peers: world size {world} ({'nccl' if args.gpu else 'gloo'}"
              f"{'' if args.gpu else '; reference-bf16, torchao-float8: 1'}), {machine}, "
              f"torch {torch.__version__}, {cfg['steps']} steps ({cfg['warmup']} warm-up), "
              f"size {cfg['size']}: GPT {cfg['model']['num_layers']}x{cfg['model']['hidden_size']}, "
              f"FFN {cfg['model']['ffn_hidden_size']}, vocab {cfg['model']['vocab_size']}, "
              f"seq {cfg['seq_len']}, global batch {cfg['global_batch']}")
    _print_table(rows, header)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"header": header, "config": cfg, "world_size": world, "rows": rows,
                       "python": sys.version.split()[0]}, f, indent=1)
    ok = all(r.get("available") or "not installed" in r.get("reason", "") for r in rows)
    return 0 if ok and all(math.isfinite(r.get("loss", 0.0)) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
