"""What every rank runs in the FSDP2 engine tests (module-level, so the workers can import it).

The model is a small GPT with FP8 weights built as ``python -m fp8shard.train`` builds it
(``build_model``: fp32 init, quantized, high-precision init value preserved; bf16 elsewhere).
Every rank draws the same global batch and takes its own rows, so the flat engine and FSDP2
see the same data at any world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import fp8shard as fs
from fp8shard.fp8 import Float8Tensor
from fp8shard.models import GPT
from fp8shard.optim import DistributedFusedAdam
from fp8shard.optim.fsdp2 import FSDP2Adam, default_mesh, fully_shard_model, local_shard, shard_rows
from fp8shard.testing.fsdp_wire import count_fsdp_wire
from fp8shard.train.builders import build_model, param_groups
from fp8shard.train.config import load_config

VOCAB, SEQ, GLOBAL_BATCH = 64, 16, 8
OVERRIDES = ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64",
             "model.num_attention_heads=2", "model.encoder_seq_length=16", "model.fp8=true",
             "model.fp8_params=true", "trainer.precision=bf16-mixed", "model.params_dtype=bf16",
             "model.fp8_layers=all"]  # on a GPU too: these layers are far below the FP8 filter's sizes


def device() -> torch.device:
    """This rank's device: its GPU under NCCL (the @gpu tests), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pin_gemm() -> None:
    """One FP8 GEMM path on every rank and run: on CPU ``auto`` picks by a timing per process."""
    if device().type == "cpu":
        from fp8shard.fp8 import gemm

        gemm.set_fp8_gemm("emulated")


# Rowwise and blockwise FP8 weights ([Note: FSDP2 tiled weights]): blockwise needs each rank's
# rows in whole 128-row bands, so its model is wider (qkv 768, proj and fc2 256, fc1 512 rows).
TILED = {"rowwise": ["model.fp8_recipe=rowwise"],
         "blockwise": ["model.fp8_recipe=blockwise", "model.hidden_size=256", "model.ffn_hidden_size=512"]}


def make_model(params_dtype: str = "bf16", recipe: str | None = None) -> GPT:
    cfg = load_config([*OVERRIDES, f"model.params_dtype={params_dtype}", *TILED.get(recipe or "", [])],
                      validate_cfg=False)
    return build_model(cfg, VOCAB, device())


def autocast_recipe(recipe: str | None) -> fs.fp8.Recipe:
    """The recipe the layers compute in: the weights' own for rowwise and blockwise ones."""
    tiled = {"rowwise": fs.RowwiseScaling, "blockwise": fs.BlockwiseScaling}
    return tiled.get(recipe or "", fs.DelayedScaling)()


def make_opt(model: torch.nn.Module, engine: str, lr: float = 1e-2,
             grad_dtype: torch.dtype = torch.bfloat16, scaling: str = "current") -> torch.optim.Optimizer:
    groups = param_groups(model, 0.1)
    if engine == "flat":
        return DistributedFusedAdam(groups, lr=lr, weight_decay=0.1, grad_sync_dtype=grad_dtype,
                                    fp8_weight_scaling=scaling)
    kernel = engine.partition("/")[2] or "auto"  # "fsdp2/fused", "fsdp2/reference": the step kernel
    return FSDP2Adam(groups, lr=lr, weight_decay=0.1, fp8_weight_scaling=scaling, step_kernel=kernel)


def shard(model: GPT, replicate: int = 1) -> GPT:
    return fully_shard_model(model, default_mesh(replicate))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s global batch (the same global batch at any world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    tokens = (start + 3 * torch.arange(SEQ + 1)) % VOCAB  # learnable: each token predicts the next
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = GLOBAL_BATCH // world
    mine = tokens[rank * rows:(rank + 1) * rows].to(device())
    return mine[:, :-1], mine[:, 1:]


def train_steps(model: GPT, opt: torch.optim.Optimizer, steps: range, clip: float = 0.0,
                recipe_name: str | None = None) -> list[float]:
    """Losses (averaged over ranks) of ``steps``; every step one forward, backward and update."""
    losses = []
    recipe = autocast_recipe(recipe_name)
    for step in steps:
        x, y = batch(step)
        with fs.fp8_autocast(enabled=True, recipe=recipe), torch.autocast(x.device.type, torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        if clip:
            opt.clip_grad_norm(clip)
        opt.step()
        opt.zero_grad()
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def run_losses(engine: str, steps: int, replicate: int = 1, clip: float = 0.0, params_dtype: str = "bf16",
               scaling: str = "current", recipe: str | None = None) -> list[float]:
    """``params_dtype=fp32``: fp32 gradients, reduced in fp32 by both engines. ``recipe``:
    rowwise or blockwise FP8 weights (None: per tensor)."""
    pin_gemm()
    torch.manual_seed(0)
    return run_with_digest(engine, steps, replicate, clip, params_dtype, scaling, recipe)[0]


def run_with_digest(engine: str, steps: int, replicate: int = 1, clip: float = 0.0,
                    params_dtype: str = "bf16", scaling: str = "current",
                    recipe: str | None = None,
                    fp8_compute: bool = True) -> tuple[list[float], dict[str, str]]:
    """``run_losses``' losses and the model-space digest after them (``model_space_digest``);
    ``engine``: flat, fsdp2, or fsdp2/KERNEL (FSDP2Adam's ``step_kernel``). ``fp8_compute=False``:
    every layer computes in bf16 from its FP8-stored weight ([Note: FP8 layer filter])."""
    pin_gemm()
    torch.manual_seed(0)
    model = make_model(params_dtype, recipe)
    for layer in model.modules():
        if isinstance(layer, fs.nn.Linear):
            layer.fp8_compute = fp8_compute
    if engine.startswith("fsdp2"):
        shard(model, replicate)
    opt = make_opt(model, engine, grad_dtype=torch.float32 if params_dtype == "fp32" else torch.bfloat16,
                   scaling=scaling)
    losses = train_steps(model, opt, range(steps), clip, recipe)
    return losses, model_space_digest(model, opt)


def step_kernel_name(engine: str = "fsdp2", recipe: str | None = None) -> str:
    """The class of the step kernel FSDP2Adam picks for ``engine`` (fsdp2 or fsdp2/KERNEL)."""
    model = make_model("bf16", recipe)
    shard(model)
    return type(make_opt(model, engine).engine.kernel).__name__


def fp8_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if isinstance(local_shard(p), Float8Tensor))


def memory_per_fp8_elem(steps: int = 2) -> dict[str, float]:
    """Persistent bytes per FP8 weight element on this rank, after a backward (gradients held)."""
    model = shard(make_model())
    opt = make_opt(model, "fsdp2")
    train_steps(model, opt, range(steps))
    x, y = batch(steps)
    with fs.fp8_autocast(enabled=True, recipe=fs.DelayedScaling()), torch.autocast("cpu", torch.bfloat16):
        model(x, y).backward()  # the gradient shards exist until the next step
    parts = {"weights": 0, "grads": 0, "master": 0, "states": 0}
    for i, p in enumerate(opt._params):
        local = local_shard(p)
        if isinstance(local, Float8Tensor):
            grad = local_shard(p.grad)
            parts["weights"] += local.numel() * local.fp8_data.element_size()
            parts["grads"] += grad.numel() * grad.element_size()
            parts["master"] += opt.engine.master[i].numel() * opt.engine.master[i].element_size()
            parts["states"] += 2 * opt.engine.exp_avg[i].numel() * opt.engine.exp_avg[i].element_size()
    n = fp8_numel(model)
    out = {k: v / n for k, v in parts.items()}
    out["world"] = dist.get_world_size()
    out["report_fp8_weights"] = opt.memory_report()["fp8_weights"] / n
    # What stays allocated of the unsharded weights between steps: FSDP2 frees the gathered
    # bytes after backward (storage resized to 0).
    out["unsharded_bytes"] = sum(
        fp.all_gather_outputs[0].untyped_storage().nbytes()
        for g in _param_groups(model) for fp in g.fsdp_params if fp.all_gather_outputs)
    return out


def _param_groups(model: torch.nn.Module) -> list:
    """FSDP2's parameter groups (torch 2.13: a list per module; earlier: one or None)."""
    out = []
    for m in model.modules():
        if hasattr(m, "_get_fsdp_state"):
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                one = getattr(state, "_fsdp_param_group", None)
                groups = [one] if one is not None else []
            out.extend(groups)
    return out


# (in, out) of each layer: blockwise weights need 256-row multiples to cut into whole 128-row
# bands over 2 ranks.
STACK_DIMS = {None: [(64, 128), (128, 64), (64, 64)], "rowwise": [(64, 128), (128, 64), (64, 64)],
              "blockwise": [(256, 512), (512, 256), (256, 256)]}


class Fp8Stack(torch.nn.Module):
    """FP8 weights only (no bias, no norm): every gathered byte is an FP8 weight's (or its scales')."""

    def __init__(self, recipe: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        with fs.fp8_model_init(enabled=True, recipe=recipe), torch.device(device()):
            self.layers = torch.nn.ModuleList([fs.nn.Linear(i, o, bias=False) for i, o in STACK_DIMS[recipe]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def gather_input_bytes(local: Float8Tensor, outer_size: torch.Size, world: int) -> int:
    """What FSDP2 all-gathers for one FP8 weight: every rank's ``fsdp_pre_all_gather`` inputs
    (bytes, and for a tiled weight its grid rows), as padded, in bytes."""
    class Mesh:  # what the hook reads of a device mesh
        def size(self) -> int:
            return world

    inputs, _ = local.fsdp_pre_all_gather(Mesh(), outer_size, None, None, None)
    return world * sum(t.numel() * t.element_size() for t in inputs)


def wire_bytes(steps: int = 3, reshard_after_forward: bool = False, recipe: str | None = None) -> dict:
    """All-gather bytes per FP8 weight element per gather, counted on the wire; with the count
    expected from the hooks' inputs, and how the local shards are stored."""
    model = Fp8Stack(recipe)
    fully_shard_model(model, default_mesh(), reshard_after_forward=reshard_after_forward)
    count = count_fsdp_wire(model)
    opt = FSDP2Adam(model.parameters(), lr=1e-3, module=model, count_comm=True)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(32, STACK_DIMS[recipe][0][0], generator=g).to(device())
        with fs.fp8_autocast(enabled=True, recipe=autocast_recipe(recipe)):
            model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    n = fp8_numel(model)
    gathers = count.calls_total("all_gather.params")
    locals_ = [local_shard(p) for p in model.parameters()]
    expected = sum(gather_input_bytes(t, p.shape, dist.get_world_size())
                   for t, p in zip(locals_, model.parameters(), strict=True))
    flat_views = [fp._sharded_param_data for grp in _param_groups(model) for fp in grp.fsdp_params]
    storages = {t.fp8_data.untyped_storage().data_ptr() for t in locals_}
    return {"bytes_per_elem_per_step": count.total("all_gather.params") / (n * steps),
            "expected_per_elem": expected / n,
            "gathers": gathers, "keys": sorted(count.bytes),
            "reduce_scatter_bytes_per_elem_per_step": count.total("reduce_scatter.grads") / (n * steps),
            "report": opt.comm_report(), "n": n,
            "blocks": [t.block for t in locals_], "grids": [tuple(t.scale_inv.shape) for t in locals_],
            # FSDP2's flat view of each shard stays FP8 over the same bytes (no dequantized copy)
            "flat_views_fp8": len(flat_views) == len(locals_) and all(
                isinstance(v, Float8Tensor) and v.fp8_data.untyped_storage().data_ptr() in storages
                for v in flat_views)}


def hsdp_shards_agree(steps: int = 3) -> bool:
    """HSDP (replicate x shard): after training, the two replicas of each shard hold the same
    bytes and master (checked by comparing with the replica partner through the replicate group)."""
    model = shard(make_model(), replicate=2)
    opt = make_opt(model, "fsdp2")
    train_steps(model, opt, range(steps))
    rep_group = next(iter(model.parameters())).device_mesh.get_group(0)  # the replicate dimension
    ok = True
    for i, p in enumerate(opt._params):
        local = local_shard(p)
        mine = local.uint8_view().float() if isinstance(local, Float8Tensor) else local.float()
        both = [torch.empty_like(mine.reshape(-1)) for _ in range(2)]
        dist.all_gather(both, mine.reshape(-1).contiguous(), group=rep_group)
        m2 = [torch.empty_like(opt.engine.master[i]) for _ in range(2)]
        dist.all_gather(m2, opt.engine.master[i], group=rep_group)
        ok = ok and torch.equal(both[0], both[1]) and torch.equal(m2[0], m2[1])
    return ok


def direct_fully_shard_refused(out_features: int, recipe: str) -> str:
    """A tiled FP8 weight sharded by torch's fully_shard itself (not fully_shard_model): the
    error FSDP2Adam raises on this rank, or "" if it takes the model."""
    from fp8shard.optim.fsdp2 import _fully_shard

    with fs.fp8_model_init(recipe=recipe):
        model = torch.nn.Sequential(fs.nn.Linear(256, out_features, bias=False))
    _fully_shard()(model, mesh=default_mesh())
    try:
        FSDP2Adam(model.parameters(), lr=1e-3)
    except ValueError as e:
        return str(e)
    return ""


# ---------------------------------------------------------------------------- checkpoints
def _full(pieces: list[tuple[int, torch.Tensor]], numel: int) -> torch.Tensor:
    """A flattened tensor from every rank's (offset, values) pieces."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [(o, t.detach().clone()) for o, t in pieces])
    out = torch.full((numel,), float("nan"))
    for part in everyone:
        for o, t in part:
            out[o:o + t.numel()] = t.float().reshape(-1)
    return out


def model_space_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """sha256 of every parameter's full master, moments, FP8 bytes and scale, and of each
    non-FP8 weight: the same for both engines at any world size when the states are equal."""
    ssd = opt.sharded_state_dict()
    by_id = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for i, p in enumerate(opt._params):
        name, numel = by_id[id(p)], p.numel()
        for k in ("master", "exp_avg", "exp_avg_sq"):
            full = _full([(int(e["offset"]), e[k]) for e in ssd["state"].get(i, [])], numel)
            out[f"{name}/{k}"] = _sha(full)
        grid = None
        if hasattr(p, "device_mesh"):
            start, rows = shard_rows(p)
            local = local_shard(p)
            row = p.numel() // p.shape[0] if p.dim() else 1
            values = local.uint8_view() if isinstance(local, Float8Tensor) else local.detach()
            full = _full([(start * row, values.float())] if rows else [], numel)
            if isinstance(local, Float8Tensor) and local.block is not None:  # the grid rows of each rank
                g = local.scale_inv
                br, gc = local.block[0], g.shape[1]
                grid = _full([(start // br * gc, g)], -(-p.shape[0] // br) * gc)
        else:
            values = p.uint8_view() if isinstance(p, Float8Tensor) else p.detach()
            full = values.float().reshape(-1)
            if isinstance(p, Float8Tensor) and p.block is not None:
                grid = p.scale_inv.reshape(-1)
        out[f"{name}/weight"] = _sha(full)
        if grid is not None:
            out[f"{name}/scale_inv_grid"] = _sha(grid)
        if i in ssd["fp8"]:
            out[f"{name}/scale"] = _sha(ssd["fp8"][i]["scale"].reshape(-1))
    return out


def _sha(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def build(engine: str, params_dtype: str = "bf16", recipe: str | None = None
          ) -> tuple[GPT, torch.optim.Optimizer]:
    """``engine``: flat, fsdp2, or hsdp (2 replicas); ``recipe``: rowwise or blockwise weights."""
    pin_gemm()
    torch.manual_seed(0)
    model = make_model(params_dtype, recipe)
    if engine in ("fsdp2", "hsdp"):
        shard(model, replicate=2 if engine == "hsdp" else 1)
    return model, make_opt(model, "flat" if engine == "flat" else "fsdp2")


def save_after(engine: str, path: str, steps: int, more: int, recipe: str | None = None
               ) -> tuple[dict[str, str], list[float]]:
    """Train ``steps``, save a checkpoint (its digest), train ``more`` (their losses)."""
    from fp8shard.checkpoint import save_checkpoint

    model, opt = build(engine, recipe=recipe)
    train_steps(model, opt, range(steps), recipe_name=recipe)
    save_checkpoint(path, model, opt, step=steps)
    digest = model_space_digest(model, opt)
    return digest, train_steps(model, opt, range(steps, steps + more), recipe_name=recipe)


def load_and_continue(engine: str, path: str, more: int, recipe: str | None = None
                      ) -> tuple[dict[str, str], list[float], int]:
    """Load the checkpoint into a fresh model and optimizer of ``engine``; (digest, losses, step)."""
    from fp8shard.checkpoint import load_checkpoint

    model, opt = build(engine, recipe=recipe)
    info = load_checkpoint(path, model, opt)
    digest = model_space_digest(model, opt)
    losses = train_steps(model, opt, range(info.step, info.step + more), recipe_name=recipe)
    return digest, losses, info.world_size


def skip_digests(on_device: bool, scaling: str = "current") -> tuple[list[dict[str, str]], list[bool], int]:
    """The FSDP2 engine's fused kernel with the skip decision on the device or on the host
    (``FSDP2FusedKernel.decides_on_device``): five steps, the third with a NaN gradient; the
    model-space digest after each step, whether each was skipped, and the step count."""
    from fp8shard.optim.fsdp2 import FSDP2FusedKernel

    before = FSDP2FusedKernel.decides_on_device
    FSDP2FusedKernel.decides_on_device = on_device
    try:
        pin_gemm()
        torch.manual_seed(0)
        model = shard(make_model())
        opt = make_opt(model, "fsdp2/fused", scaling=scaling)
        digests, skipped = [], []
        for step in range(5):
            x, y = batch(step)
            recipe = autocast_recipe(None)
            with fs.fp8_autocast(enabled=True, recipe=recipe), torch.autocast("cpu", torch.bfloat16):
                loss = model(x, y)
            (loss * (float("nan") if step == 2 else 1.0)).backward()
            opt.step()
            skipped.append(bool(opt.last_step_skipped))
            opt.zero_grad()
            digests.append(model_space_digest(model, opt))
        return digests, skipped, int(opt.sharded_state_dict()["step"])
    finally:
        FSDP2FusedKernel.decides_on_device = before
