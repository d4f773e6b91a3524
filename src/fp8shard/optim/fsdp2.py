"""The FSDP2 engine: ``fully_shard`` owns the FP8 weights' storage, ``FSDP2Adam`` updates them.

[Note: FSDP2 engine]
    The other engine to ``DistributedFusedAdam``'s flat buckets (docs/engines.md). FSDP2 shards
    every parameter on dim 0 over the mesh's shard dimension; a Float8Tensor weight's shard is
    a Float8Tensor (1 byte per element + the scale), gathered as ``uint8`` bytes before each
    forward and backward ([Note: FSDP2 extension]) and freed after. FSDP2 reduce-scatters the
    gradients (in the parameters' dtype: bf16) onto the same shards. ``FSDP2Adam`` holds, per
    local shard, the fp32 master and the Adam moments, and runs the same step as the flat
    engine on the same numbers:

        fp32 gradient shard -> one 8-byte all-reduce (norm, non-finite, any gradient)
        Adam(W) on the fp32 master shard                 (optim/adam.py, op for op)
        amax per FP8 parameter -> ONE packed all-reduce(MAX) -> scales  [Note: weight scaling]
        cast the master shard straight into the local FP8 bytes; non-FP8 shards get master.to(dtype)

    There is no all-gather in ``step()``: FSDP2 gathers the new bytes at the next forward.
    With HSDP (a 2-D mesh: replicate x shard) the shards are replicated over the first
    dimension and FSDP2 all-reduces the gradients over it, so the replicas compute identical
    updates; the optimizer's all-reduces run over the shard dimension only.

    Checkpoints: ``sharded_state_dict()`` has the form of ``DistributedFusedAdam``'s (per
    parameter, pieces of the flattened parameter with their offsets), so the two engines write
    and read the same DCP checkpoints at any world size ([Note: checkpoint space]).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fp8shard.fp8 import DelayedScaling, Float8Tensor, cast_to_fp8
from fp8shard.optim.adam import adam_
from fp8shard.optim.collectives import CommCounter
from fp8shard.optim.distributed_fused_adam import _check_hparams, _check_params
from fp8shard.optim.fp8_weights import Fp8WeightScaler, ScalingMode

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")


def _fully_shard() -> Callable[..., Any]:
    """``fully_shard`` of this torch: public since 2.6 (2.11, 2.13), ``_composable`` before."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover - torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def default_mesh(replicate: int = 1) -> Any:
    """A device mesh over the world: 1-D (``replicate=1``, FSDP) or ``replicate x shard`` (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("the FSDP2 engine needs an initialized process group (launch with torchrun, "
                           "or call dist.init_process_group first); one process trains with the flat "
                           "engine (DistributedFusedAdam, trainer.strategy=flat)")
    world = dist.get_world_size()
    if replicate < 1 or world % replicate:
        raise ValueError(f"HSDP replicate size {replicate} must be >= 1 and divide the world size {world}")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if replicate == 1:
        return init_device_mesh(device, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))


def fully_shard_model(model: nn.Module, mesh: Any = None, *, reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` each block of every ``nn.ModuleList`` in ``model``, then the model.

    ``mesh``: a 1-D device mesh (FSDP) or a 2-D one (HSDP: replicate x shard); default: the
    world, 1-D. Float8Tensor weights stay FP8 ([Note: FSDP2 extension]); the high-precision
    init value a weight preserved (``fp8_model_init``) is cut to this rank's rows, so
    ``FSDP2Adam`` starts its master from it as ``DistributedFusedAdam`` does. Returns ``model``.
    """
    if any(isinstance(p, Float8Tensor) and p.block is not None for p in model.parameters()):
        raise ValueError("FSDP2 shards per-tensor FP8 weights only; these are rowwise or blockwise: "
                         "train them with DistributedFusedAdam (trainer.strategy=flat)")
    mesh = default_mesh() if mesh is None else mesh
    hp_init = {n: p.get_high_precision_init_val() for n, p in model.named_parameters()
               if isinstance(p, Float8Tensor)}
    fully_shard = _fully_shard()
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for n, p in model.named_parameters():
        hp = hp_init.get(n)
        if hp is not None:
            start, rows = shard_rows(p)
            local_shard(p).set_high_precision_init_val(hp[start:start + rows])
    return model


def shard_rows(p: torch.Tensor) -> tuple[int, int]:
    """(first row, rows) of a dim-0-sharded DTensor's local shard, as FSDP2 chunks it."""
    from torch.distributed.tensor import Shard

    local = local_shard(p)
    start = 0
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"FSDP2Adam expects dim-0 sharding, got {placement}")
            chunk = math.ceil(p.shape[0] / p.device_mesh.size(dim))
            start += chunk * p.device_mesh.get_local_rank(dim)
    rows = local.shape[0] if local.dim() else 1
    return (min(start, p.shape[0]) if p.dim() else 0), (rows if local.numel() else 0)


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor itself (FSDP2's storage). ``DTensor.to_local()`` under grad
    mode returns a new view, on which attributes (a preserved init value) would be lost."""
    return p._local_tensor  # type: ignore[attr-defined]


def _shard_group(p: torch.Tensor) -> dist.ProcessGroup:
    mesh = p.device_mesh
    return mesh.get_group(mesh.ndim - 1)


class FSDP2Adam(torch.optim.Optimizer):
    """AdamW over FSDP2's local shards, with the flat engine's math and FP8 weight scaling.

    Build it on a model after :func:`fully_shard_model` (its parameters are DTensors). Same
    arguments and meaning as ``DistributedFusedAdam`` where they apply; see [Note: FSDP2 engine].
    ``module``: the fully_shard-ed model, for ``no_sync()`` (gradient accumulation) and, with
    ``count_comm=True``, to count FSDP2's all-gathers and reduce-scatters in ``comm_report()``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adam_w_mode: bool = True,
        state_dtype: torch.dtype = torch.float32,
        fp8_weight_scaling: ScalingMode = "current",
        delayed_scaling: DelayedScaling | None = None,
        module: nn.Module | None = None,
        count_comm: bool = False,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for g in self.param_groups:
            _check_hparams(g)
        if not state_dtype.is_floating_point:
            raise ValueError(f"state_dtype must be floating point, got {state_dtype}")
        self._params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self.device = _check_params(self._params)
        self._check_sharded()
        self.adam_w_mode = adam_w_mode
        self.state_dtype = state_dtype
        self.module = module  # the fully_shard-ed model, for no_sync
        if count_comm and module is None:
            raise ValueError("FSDP2Adam(count_comm=True) counts the model's FSDP2 collectives: pass "
                             "module=model as well")
        self._wire = None
        if count_comm:
            from fp8shard.optim.fsdp2_comm import count_fsdp_wire

            self._wire = count_fsdp_wire(module)
        self.last_step_skipped = False
        self._step = 0
        self.group = _shard_group(self._params[0])
        self._comm = CommCounter()
        self._last_comm: dict[str, int] = {}
        self.master: list[torch.Tensor] = []
        self.exp_avg: list[torch.Tensor] = []
        self.exp_avg_sq: list[torch.Tensor] = []
        for p in self._params:
            local = local_shard(p)
            if isinstance(local, Float8Tensor):
                init = local.get_high_precision_init_val()  # start from it, not the bytes (TE 1121)
                value = init if init is not None else local.dequantize(torch.float32)
                local.clear_high_precision_init_val()
            else:
                value = local.detach()
            self.master.append(value.to(self.device, torch.float32, copy=True).reshape(-1))
            self.exp_avg.append(torch.zeros(local.numel(), dtype=state_dtype, device=self.device))
            self.exp_avg_sq.append(torch.zeros(local.numel(), dtype=state_dtype, device=self.device))
        locals_ = {i: local_shard(p) for i, p in enumerate(self._params)}
        fp8 = {i: t for i, t in locals_.items() if isinstance(t, Float8Tensor)}
        self.fp8 = Fp8WeightScaler(fp8, fp8_weight_scaling, delayed_scaling, self.device)
        self._grads: list[torch.Tensor] | None = None
        self._stats: tuple[torch.Tensor, bool, bool] | None = None

    def _check_sharded(self) -> None:
        from torch.distributed.tensor import DTensor

        for i, p in enumerate(self._params):
            if not isinstance(p, DTensor):
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is not sharded by FSDP2; call "
                                 "fully_shard_model(model, mesh) before building FSDP2Adam")
        meshes = {id(p.device_mesh) for p in self._params}
        if len(meshes) > 1:
            raise ValueError("FSDP2Adam needs every parameter on one device mesh; shard the whole "
                             "model with one fully_shard_model(model, mesh) call")

    # ================================================================== the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            _check_hparams(g)
        grads = self._local_grads()  # 1. FSDP2 reduce-scattered them in backward
        _, nonfinite, any_grad = self._grad_stats()  # 2. one all-reduce
        self.last_step_skipped = nonfinite or not any_grad  # [Note: step without gradients]
        if not self.last_step_skipped:
            self._step += 1
            self._update_master(grads)  # 3. Adam(W) on the fp32 master shards
            self._write_shards()  # 4. amax all-reduce, scales, cast into the local bytes
        self._grads, self._stats = None, None
        self._last_comm = self._comm.close_window()
        if self._wire is not None:  # FSDP2's gathers and reduce-scatters since the last step
            self._last_comm.update(self._wire.close_window())
        return loss

    def _local_grads(self) -> list[torch.Tensor]:
        """fp32 copies of this rank's gradient shards (zeros where a parameter got none)."""
        if self._grads is None:
            out = []
            for p, m in zip(self._params, self.master, strict=True):
                g = p.grad
                out.append(torch.zeros_like(m) if g is None else local_shard(g).reshape(-1).float())
            self._grads = out
        return self._grads

    def _grad_stats(self) -> tuple[torch.Tensor, bool, bool]:
        """(global sum of squares, non-finite, any rank had a gradient): one all-reduce (as the
        flat engine's ``_grad_stats``; over the shard dimension: replicas hold the same shards)."""
        if self._stats is None:
            grads = self._local_grads()
            local = torch.zeros(2, dtype=torch.float32, device=self.device)
            local[1] = float(any(p.grad is not None for p in self._params))
            for g in grads:
                if g.numel():
                    local[0] += torch.linalg.vector_norm(g).square()
            self._all_reduce(local, dist.ReduceOp.SUM, "all_reduce.grad_stats")
            total, ranks_with_grads = local.tolist()
            self._stats = (local[0], not math.isfinite(total), ranks_with_grads > 0)
        return self._stats

    def _all_reduce(self, t: torch.Tensor, op: Any, kind: str) -> None:
        self._comm.add(kind, t.numel() * t.element_size())
        dist.all_reduce(t, op=op, group=self.group)

    def _update_master(self, grads: list[torch.Tensor]) -> None:
        for group in self.param_groups:
            idx = [i for i in (self._index_of[id(p)] for p in group["params"]) if self.master[i].numel()]
            if not idx:
                continue
            beta1, beta2 = group["betas"]
            adam_([self.master[i] for i in idx], [grads[i] for i in idx],
                  [self.exp_avg[i] for i in idx], [self.exp_avg_sq[i] for i in idx],
                  step=self._step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                  weight_decay=group["weight_decay"], decoupled_weight_decay=self.adam_w_mode)

    def _write_shards(self) -> None:
        """The new master into the local shards: FP8 bytes with the new scales, else master.to(dtype)."""
        scales = None
        if self.fp8.num_slots:
            amax = torch.zeros(self.fp8.num_slots, dtype=torch.float32, device=self.device)
            for i, s in self.fp8.slot.items():
                if self.master[i].numel():  # an empty shard (fewer rows than ranks) has amax 0
                    amax[s] = self.master[i].abs().max()
            self._all_reduce(amax, dist.ReduceOp.MAX, "all_reduce.amax")  # [Note: weight scaling]
            scales = self.fp8.cast_scales(amax)
            scale_inv = scales.reciprocal()
        for i, p in enumerate(self._params):
            local = local_shard(p)  # read every step: FSDP2 may re-pad (replace) it at lazy init
            if isinstance(local, Float8Tensor):
                assert scales is not None
                s = self.fp8.slot[i]
                if local.numel():
                    cast_to_fp8(self.master[i].view(local.shape), scales[s], local.fp8_format,
                                out=local._data)
                local._scale_inv.copy_(scale_inv[s])
                local.mark_bytes_changed()
            elif local.numel():
                local.copy_(self.master[i].view(local.shape).to(local.dtype))

    # ================================================================== gradients
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes in here keep their unsharded gradients (no reduce-scatter); the next
        one outside reduces the sum (FSDP2's ``set_requires_gradient_sync``). Needs ``module=``."""
        if self.module is None or not hasattr(self.module, "set_requires_gradient_sync"):
            raise RuntimeError("FSDP2Adam.no_sync needs the fully_shard-ed model: pass "
                               "FSDP2Adam(..., module=model)")
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale the gradient shards so their global L2 norm is at most ``max_norm``; returns the
        norm before clipping (as ``DistributedFusedAdam.clip_grad_norm``)."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            raise TypeError(f"clip_grad_norm: max_norm must be a number, got {type(max_norm).__name__}")
        if not max_norm >= 0:
            raise ValueError(f"clip_grad_norm: max_norm must be >= 0 (inf: no clipping), got {max_norm}")
        sumsq, nonfinite, _ = self._grad_stats()
        total = sumsq.sqrt()
        if not nonfinite:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_(self._local_grads(), coef)
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            p.grad = None
        self._grads, self._stats = None, None

    @property
    def fp8_amax_history_len(self) -> int | None:
        history = self.fp8.history
        return None if history is None else history.history.shape[0]

    def wait_param_sync(self) -> None:
        """Nothing in flight after ``step()`` (FSDP2 gathers at the next forward)."""

    # ================================================================== checkpoints
    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard of each parameter as one piece of the flattened parameter, in the
        form of ``DistributedFusedAdam.sharded_state_dict()`` ([Note: checkpoint space])."""
        state: dict[int, list[dict[str, Any]]] = {}
        for i, p in enumerate(self._params):
            start, _ = shard_rows(p)
            numel = self.master[i].numel()
            if numel:
                row = math.prod(p.shape[1:])
                state[i] = [{"offset": start * row, "numel": numel, "master": self.master[i],
                             "exp_avg": self.exp_avg[i], "exp_avg_sq": self.exp_avg_sq[i]}]
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        return {"format": "fp8shard.sharded.v1", "step": self._step,
                "param_groups": self._groups_for_save(), "world_size": world, "rank": rank,
                "shapes": {i: tuple(p.shape) for i, p in enumerate(self._params)},
                "state": state, "fp8": {i: self.fp8.state(i) for i in self.fp8.slot}}

    def load_sharded_state_dict(self, sharded: dict[str, Any]) -> None:
        """Load pieces split any way (any world size, either engine) that cover this rank's shards;
        plus step, param groups and the FP8 weight-scaling state."""
        for i, p in enumerate(self._params):
            numel = self.master[i].numel()
            if not numel:
                continue
            lo = shard_rows(p)[0] * math.prod(p.shape[1:])
            covered = 0
            for e in sharded["state"].get(i, []):
                o, n = int(e["offset"]), int(e["numel"])
                s, t = max(lo, o), min(lo + numel, o + n)
                if t <= s:
                    continue
                for name in STATE_NAMES:
                    getattr(self, name)[i][s - lo:t - lo].copy_(e[name].reshape(-1)[s - o:t - o])
                covered += t - s
            if covered != numel:
                raise ValueError(f"parameter {i}: the sharded state covers {covered} of the {numel} "
                                 f"elements [{lo}, {lo + numel}) this rank owns; are pieces missing?")
        for i, st in sharded.get("fp8", {}).items():
            self.fp8.load_state(i, st)
        saved_groups = sharded["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the checkpoint's param groups do not match this optimizer's")
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items() if k != "params"})
            _check_hparams(group)
        self._step = int(sharded["step"])

    def _groups_for_save(self) -> list[dict[str, Any]]:
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [self._index_of[id(p)] for p in g["params"]]} for g in self.param_groups]

    # ================================================================== accounting
    def memory_report(self) -> dict[str, int]:
        """Persistent bytes on this rank by category (the flat engine's categories): the local
        weight shards (FP8: 1 byte per element), gradient shards, master, Adam states."""
        out = dict.fromkeys(("fp8_weights", "other_weights", "grad_buffers", "master",
                             "optimizer_states", "padding"), 0)
        for i, p in enumerate(self._params):
            local = local_shard(p)
            if isinstance(local, Float8Tensor):
                out["fp8_weights"] += local.numel() * local.fp8_data.element_size()
            else:
                out["other_weights"] += local.numel() * local.element_size()
            if p.grad is not None:
                g = local_shard(p.grad)
                out["grad_buffers"] += g.numel() * g.element_size()
            out["master"] += self.master[i].numel() * 4
            out["optimizer_states"] += 2 * self.exp_avg[i].numel() * self.exp_avg[i].element_size()
        out["total"] = sum(out.values())
        return out

    def comm_report(self) -> dict[str, int]:
        """Bytes per collective kind in the last step, per rank: the optimizer's all-reduces and,
        with ``count_comm=True``, FSDP2's parameter all-gathers (``all_gather.params.uint8`` for
        FP8 bytes) and gradient reduce-scatters since the previous step (optim/fsdp2_comm.py)."""
        return dict(self._last_comm)

