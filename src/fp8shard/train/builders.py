"""Build what a run trains: the GPT (FP8 weights or not), the optimizer, the FP8 recipe.

All FP8 and distributed decisions of the training command live here, so the model file stays
plain. [Note: FP8 init] says how FP8 weights get their initial values.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import fp8shard as fs
from fp8shard.fp8 import Float8Tensor, gemm
from fp8shard.models import GPT, GPTConfig
from fp8shard.nn.gemm_filter import select_fp8_layers
from fp8shard.train.config import Config
from fp8shard.train.distributed import DistEnv, all_reduce_max

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cpu_threads(setting: int | str) -> int:
    """``trainer.num_threads``: auto takes OMP_NUM_THREADS, else the CPUs this process may use
    shared out over the ranks on this node (torchrun sets OMP_NUM_THREADS=1 only for 2+ ranks)."""
    if setting != "auto":
        return int(setting)
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def configure_compute(cfg: Config, env: DistEnv) -> dict[str, Any]:
    """Set the CPU thread count, switch the Triton kernels (``trainer.triton``) and settle how FP8
    GEMMs run, the same way on every rank.

    With ``model.fp8_gemm=auto`` on CPU each rank measures both paths once
    ([Note: CPU GEMM choice]); if any rank finds ``torch._scaled_mm`` slower, all use the
    emulated path, so the ranks compute alike. Returns what the run reports.
    """
    info: dict[str, Any] = {}
    if env.device.type == "cpu":
        info["num_threads"] = cpu_threads(cfg.trainer.num_threads)
        torch.set_num_threads(info["num_threads"])
    gemm.set_fp8_gemm(cfg.model.fp8_gemm)
    fs.set_triton(cfg.trainer.triton)
    if not cfg.model.fp8:
        return info
    info["fp8_gemm"] = cfg.model.fp8_gemm
    path = gemm.resolved_gemm_path(env.device.type)
    if cfg.model.fp8_gemm == "auto" and env.device.type == "cpu":
        info["fp8_gemm_timings_ms"] = {k: round(float(v), 3) for k, v in gemm.cpu_gemm_choice().items()
                                       if k.endswith("_ms")}
        emulated_somewhere = all_reduce_max([float(path == "emulated")], env)[0] > 0
        path = "emulated" if emulated_somewhere else "scaled_mm"
        gemm.set_fp8_gemm(path)
    info["fp8_gemm_path"] = path
    return info


# [Note: resumed GEMM path]
#     On the CPU, model.fp8_gemm=auto times torch._scaled_mm against the emulated product once per
#     process (fp8/gemm.py); the two round alike but sum in another order, so the losses differ in
#     their last bits. Where the two timings are close (a CPU with an FP8 oneDNN kernel: 0.37
#     against 0.33 ms on one 2-core VM) a busy machine can flip the choice between a run and its
#     resumption, which then no longer continues bit for bit (seen on torch 2.11 under the test
#     suite's load). So a checkpoint records the path its run used (``Trainer.save``), and a
#     resumed CPU run with fp8_gemm=auto takes that path; an explicit setting wins.
def keep_checkpoint_gemm_path(cfg: Config, env: DistEnv, compute: dict[str, Any], saved: Any) -> list[str]:
    """[Note: resumed GEMM path]: switch this process to the FP8 GEMM path ``saved`` in the
    checkpoint (``{"device", "path"}``) where the run is on the CPU with ``model.fp8_gemm=auto``
    and measured the other one; updates ``compute`` and returns the note to print (or none)."""
    here = compute.get("fp8_gemm_path")
    if (not isinstance(saved, dict) or here is None or cfg.model.fp8_gemm != "auto"
            or env.device.type != "cpu" or saved.get("device") != "cpu"
            or saved.get("path") not in ("scaled_mm", "emulated") or saved["path"] == here):
        return []
    gemm.set_fp8_gemm(saved["path"])
    compute["fp8_gemm_path"] = saved["path"]
    compute["fp8_gemm_from_checkpoint"] = True
    return [f"note: FP8 GEMMs {saved['path']} as in the checkpoint (this process measured {here} as the "
            "faster): a run goes on with the path it began with, so it resumes bit for bit; set "
            "model.fp8_gemm=scaled_mm or emulated to choose"]


def describe_compute(info: dict[str, Any]) -> str:
    """One phrase for the run's first line, e.g. ``FP8 GEMMs emulated (auto: ...), 1 thread``."""
    parts = []
    if "fp8_gemm_path" in info:
        why = ""
        if info.get("fp8_gemm_from_checkpoint"):
            why = " (auto: kept from the checkpoint)"
        elif "fp8_gemm_timings_ms" in info:
            t = info["fp8_gemm_timings_ms"]
            why = f" (auto: _scaled_mm {t['scaled_mm_ms']:.2f} ms vs emulated {t['emulated_ms']:.2f} ms)"
        elif info["fp8_gemm"] != "auto":
            why = f" (model.fp8_gemm={info['fp8_gemm']})"
        parts.append(f"FP8 GEMMs {info['fp8_gemm_path']}{why}")
    if "num_threads" in info:
        parts.append(f"{info['num_threads']} CPU thread(s) per rank")
    return ", ".join(parts)


def params_dtype(cfg: Config) -> torch.dtype:
    """The dtype of the non-FP8 parameters; see ``model.params_dtype``."""
    name = cfg.model.params_dtype
    if name == "auto":
        zero = cfg.model.optim.name == "distributed_fused_adam" and cfg.trainer.precision == "bf16-mixed"
        name = "bf16" if zero else "fp32"
    return _DTYPES[name]


def gpt_config(cfg: Config, vocab_size: int) -> GPTConfig:
    m = cfg.model
    return GPTConfig(  # the shape is model.*'s TransformerShape fields, declared once
        vocab_size=vocab_size,
        max_position_embeddings=m.max_position_embeddings or m.encoder_seq_length,
        **m.shape_kwargs(),
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_model(cfg: Config, vocab_size: int, device: torch.device) -> GPT:
    """The GPT, initialized from ``model.seed`` identically on every rank.

    [Note: FP8 init]
        The high-precision model is built on the meta device, materialized and initialized in
        fp32 (nanochat's three steps). With ``fp8_params`` a second GPT is built on the meta
        device inside ``fp8_model_init`` and materialized; every FP8 weight is then quantized
        from the fp32 init value (its first scale comes from that value's amax) and keeps that
        value as its high-precision init value, from which DistributedFusedAdam starts its FP32
        master (TransformerEngine 1121); the other parameters are copied.
        So a run with FP8 weights and one without start from the same initial values.
    """
    gcfg = gpt_config(cfg, vocab_size)
    torch.manual_seed(cfg.model.seed)
    with torch.device("meta"):
        hp = GPT(gcfg)  # shapes only
    hp.to_empty(device=device)  # allocate
    hp.init_weights()  # initialize (fp32)
    dtype = params_dtype(cfg)
    if not cfg.model.fp8_params:
        for p in hp.parameters():
            p.data = p.data.to(dtype)
        return _select_layers(hp, cfg, device)
    recipe = cfg.model.fp8_recipe if cfg.model.fp8_recipe in ("rowwise", "blockwise") else None
    with fs.fp8_model_init(enabled=True, preserve_high_precision_init_val=True, recipe=recipe), \
            torch.device("meta"), _default_dtype(dtype):
        model = GPT(gcfg)  # shapes only; the projection weights are Float8Tensors
    model.to_empty(device=device)  # allocate
    model.init_buffers()  # derived buffers; the parameters come from ``hp`` right below
    with torch.no_grad():
        for (name, p), (hp_name, src) in zip(model.named_parameters(), hp.named_parameters(), strict=True):
            assert name == hp_name, (name, hp_name)
            if isinstance(p, Float8Tensor):
                p.quantize_(src)
                p.set_high_precision_init_val(src)
            else:
                p.copy_(src)
    return _select_layers(model, cfg, device)


def _select_layers(model: GPT, cfg: Config, device: torch.device) -> GPT:
    """``model.fp8_layers`` applied to an FP8 run's layers ([Note: FP8 layer filter])."""
    if cfg.model.fp8:
        select_fp8_layers(model, cfg.model.fp8_layers, device)
    return model


COMPILE_SCOPES = ("model", "graph", "blocks")
COMPILE_MODES = ("default", "reduce-overhead")


def compile_enabled(setting: bool | str, device: torch.device, strategy: str = "flat") -> bool:
    """``trainer.compile``: true/false as given; ``auto`` compiles flat-engine runs on CUDA only
    (the compiled model is the fast path on the GPU; on CPU compiling costs more than it saves;
    the FSDP2 engine does not compile yet, docs/engines.md)."""
    if setting == "auto":
        return device.type == "cuda" and strategy == "flat"
    return bool(setting)


def compile_scope_for(setting: str, world_size: int) -> str:
    """``trainer.compile_scope``: as given, or for ``auto`` ``graph`` on one process (no gradient
    reduce-scatter to overlap, so nothing is lost by one graph and the fusion across regions is
    won) and ``model`` (regions whose gradients arrive block by block) on several."""
    if setting != "auto":
        return setting
    return "graph" if world_size == 1 else "model"


def compile_model(model: GPT, recipe: fs.DelayedScaling | fs.CurrentScaling | None,
                  scope: str = "model", backend: str = "inductor", mode: str = "default") -> int:
    """``trainer.compile``: ``torch.compile`` the model in place; returns the number of compiled
    regions (graphs per step, before recompilations).

    [Note: compile scope]
        ``trainer.compile_scope`` says what is compiled:

        * ``auto`` (default): ``graph`` on one process, ``model`` on several
          (``compile_scope_for``).
        * ``model``: the whole model as regions (``GPT.compile_regions``, [Note:
          compile regions]): the embeddings, each block, and the final norm + output layer +
          loss, one graph each. A compiled region is one autograd node whose parameter
          gradients all arrive when its backward ends, so DistributedFusedAdam's gradient hooks
          fire region by region and the bucket reduce-scatters overlap the backward of the
          regions below, as in eager. The blocks share one graph (compile time is one block's
          whatever the depth; a recompilation stays inside one region). Nothing runs eagerly
          but the loop over the blocks and the hooks.
        * ``graph``: ``Module.compile()`` of the whole GPT: one graph, one autograd node. Every
          gradient arrives after the whole backward, so every reduce-scatter starts then: the
          same buckets and bytes as eager, no overlap. Fusion across region boundaries is the
          gain; for one GPU, where nothing is communicated.
        * ``blocks``: each block only (before issue 16); embeddings, head and loss eager.

        Every scope works in place: the module tree, ``named_parameters`` and the state-dict
        keys stay those of the eager model (no ``_orig_mod.`` prefix), so checkpoints,
        DistributedFusedAdam and DDP see the same model. ``fp8_autocast`` and ``AmaxSync.step()``
        stay outside the graphs ([Note: amax reduction]); with delayed scaling the layers' amax
        state is made first (``prepare_delayed_scaling``), so no graph break at the first step;
        the informed first call costs one recompilation ([Note: informed first call]).
        With ``overlap_param_sync`` the parameter all-gathers are awaited before the forward
        (``Trainer._forward_ctx``), not module by module: the optimizer's forward pre-hooks sit
        on modules inside the compiled regions, where a pending gather would be traced into the
        graph. Overlapping the gathers with a compiled forward needs region-level waits.
    ``backend`` (``trainer.compile_backend``) is Inductor by default; ``aot_eager`` or ``eager``
    trace the same graphs without generating code (tests, debugging). ``mode``
    (``trainer.compile_mode``) ``reduce-overhead`` replays each graph as a CUDA graph; the caller
    then marks the start of every forward (``torch.compiler.cudagraph_mark_step_begin``).
    """
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope {scope!r}: choose one of {', '.join(COMPILE_SCOPES)}")
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}: choose one of {', '.join(COMPILE_MODES)}")
    if recipe is not None:
        fs.nn.prepare_delayed_scaling(model, recipe)
    kwargs: dict[str, Any] = {"backend": backend}
    if mode != "default":
        kwargs["mode"] = mode
    if scope == "graph":
        model.compile(**kwargs)
        return 1
    if scope == "model":
        return model.compile_regions(**kwargs)
    for block in model.blocks:
        block.compile(**kwargs)
    return len(model.blocks)


def compile_blocks(model: GPT, recipe: fs.DelayedScaling | fs.CurrentScaling | None) -> int:
    """``compile_model(model, recipe, "blocks")``: every transformer block compiled in place."""
    return compile_model(model, recipe, "blocks")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (projections, embeddings), none on biases and norm gains."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(cfg: Config, model: nn.Module, env: DistEnv) -> tuple[torch.optim.Optimizer, nn.Module]:
    """(optimizer, the module to call forward on): DistributedFusedAdam on the bare model, or
    torch AdamW on the model wrapped in DDP when there are several ranks."""
    o = cfg.model.optim
    betas = (o.betas[0], o.betas[1])
    if cfg.trainer.strategy == "fsdp2":  # [Note: FSDP2 engine]: FSDP2 owns the weights' storage
        from fp8shard.optim.fsdp2 import FSDP2Adam, default_mesh, fully_shard_model

        fully_shard_model(model, default_mesh(cfg.trainer.hsdp_replicate))
        opt = FSDP2Adam(param_groups(model, o.weight_decay), lr=o.lr, betas=betas, eps=o.eps,
                        weight_decay=o.weight_decay, state_dtype=_DTYPES[o.state_dtype], module=model,
                        count_comm=True)
        return opt, model
    groups = param_groups(model, o.weight_decay)
    if o.name == "distributed_fused_adam":
        from fp8shard.optim import DistributedFusedAdam

        opt = DistributedFusedAdam(
            groups, lr=o.lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay,
            process_group=env.group, bucket_cap_mb=o.bucket_cap_mb,
            grad_sync_dtype=_DTYPES[o.grad_sync_dtype], overlap_grad_sync=o.overlap_grad_sync,
            state_dtype=_DTYPES[o.state_dtype], overlap_param_sync=o.overlap_param_sync,
            module=model if o.overlap_param_sync else None, fused=o.fused,
        )
        return opt, model
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay)
    if env.world_size == 1:
        return opt, model
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[env.device] if env.device.type == "cuda" else None,
        bucket_cap_mb=o.bucket_cap_mb, gradient_as_bucket_view=True,
    )
    return opt, ddp


def build_recipe(cfg: Config) -> fs.fp8.Recipe:
    m = cfg.model
    fmt = fs.RecipeFormat.HYBRID if m.fp8_hybrid else fs.RecipeFormat.E4M3
    if m.fp8_recipe in ("current", "tensorwise"):
        return fs.CurrentScaling(fp8_format=fmt)
    if m.fp8_recipe == "rowwise":
        return fs.RowwiseScaling(fp8_format=fmt)
    if m.fp8_recipe == "blockwise":
        return fs.BlockwiseScaling(fp8_format=fmt)
    return fs.DelayedScaling(margin=m.fp8_margin, fp8_format=fmt, amax_history_len=m.fp8_amax_history_len,
                             amax_compute_algo=m.fp8_amax_compute_algo)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor's elements take (FP8 bytes for a Float8Tensor)."""
    if isinstance(t, Float8Tensor):
        return t.numel() * t.fp8_data.element_size()
    return t.numel() * t.element_size()


def memory_by_category(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, int]:
    """Persistent bytes on this rank: weights, grads, master, optimizer_states (, padding).

    DistributedFusedAdam reports its buffers itself; for torch AdamW the figures are summed
    from the tensors: weights = the parameters (fp32 in the baseline, which are also the
    master copy, so master = 0), grads = ``param.grad`` (DDP's bucket views), optimizer states
    = AdamW's ``exp_avg``/``exp_avg_sq``/``step``. Call after a step, before ``zero_grad``.
    """
    report = getattr(opt, "memory_report", None)
    if report is not None:
        r = report()
        return {"weights": r.get("fp8_weights", 0) + r.get("other_weights", 0),
                "grads": r.get("grad_buffers", 0), "master": r.get("master", 0),
                "optimizer_states": r.get("optimizer_states", 0), "padding": r.get("padding", 0)}
    params = list(model.parameters())
    states = sum(tensor_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return {"weights": sum(tensor_bytes(p) for p in params),
            "grads": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
            "master": 0, "optimizer_states": states, "padding": 0}


def lr_at(cfg: Config, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr.

    The schedule lasts ``sched.max_steps`` (0: ``trainer.max_steps``); a warmup longer than that
    is cut to it (short test runs keep the default warmup).
    """
    o, s = cfg.model.optim, cfg.model.optim.sched
    total = s.max_steps or cfg.trainer.max_steps
    warmup = min(s.warmup_steps, total)
    if step < warmup:
        return o.lr * (step + 1) / warmup
    if s.name == "constant":
        return o.lr
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return s.min_lr + 0.5 * (o.lr - s.min_lr) * (1.0 + math.cos(math.pi * progress))
