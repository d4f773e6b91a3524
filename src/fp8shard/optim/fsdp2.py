"""The FSDP2 engine: ``fully_shard`` owns the FP8 weights' storage, ``FSDP2Adam`` updates them.

[Note: FSDP2 engine]
    The other engine to ``DistributedFusedAdam``'s flat buckets (docs/engines.md). FSDP2 shards
    every parameter on dim 0 over the mesh's shard dimension; a Float8Tensor weight's shard is
    a Float8Tensor (1 byte per element + the scale), gathered as ``uint8`` bytes before each
    forward and backward ([Note: FSDP2 extension]) and freed after. FSDP2 reduce-scatters the
    gradients (in the parameters' dtype: bf16) onto the same shards. ``FSDP2Engine`` holds, per
    local shard, the fp32 master and the Adam moments ([Note: engine]); ``FSDP2Adam`` is the
    core (``ShardedAdam``) on it, so the step is the flat engine's on the same numbers:

        fp32 gradient shard -> one 8-byte all-reduce (norm, non-finite, any gradient)
        Adam(W) on the fp32 master shard                 (``adam_``, op for op)
        amax per FP8 parameter -> ONE packed all-reduce(MAX) -> scales  [Note: weight scaling]
        cast the master shard straight into the local FP8 bytes; non-FP8 shards get master.to(dtype)

    Rowwise and blockwise weights ([Note: FSDP2 tiled weights]): the amax of each of the local
    shard's tiles, which are whole on this rank, so they stay out of the all-reduce; the cast
    writes the local bytes and the new grid rows go onto the local shard, to be gathered with
    the bytes at the next forward.

    There is no all-gather in ``step()``: FSDP2 gathers the new bytes at the next forward.
    With HSDP (a 2-D mesh: replicate x shard) the shards are replicated over the first
    dimension and FSDP2 all-reduces the gradients over it, so the replicas compute identical
    updates; the optimizer's all-reduces run over the shard dimension only.

    Checkpoints: the engine's ``sharded_states()`` has the form of the flat engine's (per
    parameter, pieces of the flattened parameter with their offsets), so the two engines write
    and read the same DCP checkpoints at any world size ([Note: checkpoint space]).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fp8shard._triton import use_triton
from fp8shard.fp8 import DelayedScaling, Float8Tensor
from fp8shard.fp8.fsdp import check_tiled_sharding, fitting_shard_worlds
from fp8shard.fp8.quantizer import ScalingMode, WeightQuantizers
from fp8shard.optim.collectives import CommCounter, Group
from fp8shard.optim.core import ShardedAdam
from fp8shard.optim.fused_step import (
    DEFAULT_BLOCK,
    OUT_AMAX,
    OUT_AMAX_CAST,
    OUT_PARAM,
    AdamScalars,
    ReferenceKernel,
    Run,
    TileTable,
    adam_tiles_,
    build_tile_table,
    cast_tiles_,
    sumsq_in_place,
)
from fp8shard.optim.layout import ShardPiece
from fp8shard.optim.step_kernel import StepGrads

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
    mesh = default_mesh() if mesh is None else mesh
    tiled = {n: p for n, p in model.named_parameters() if isinstance(p, Float8Tensor) and p.block is not None}
    if tiled:  # cut into whole tiles, or refused before anything is sharded ([Note: FSDP2 tiled weights])
        fits = sorted(set.intersection(*(set(fitting_shard_worlds([tuple(p.shape)], p.block))
                                         for p in tiled.values())))
        for n, p in tiled.items():
            check_tiled_sharding(tuple(p.shape), p.block, mesh.size(mesh.ndim - 1), repr(n), fits)
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


class FSDP2Kernel(ReferenceKernel):
    """The reference step kernel on FSDP2's local shards: one flat master, exp_avg, exp_avg_sq
    per parameter; the gradient shards as fp32 (zeros where a parameter got none); the stats of
    each FP8 parameter and the cast straight into its local FP8 bytes through its quantizer
    ([Note: weight scaling]), ``master.to(dtype)`` elsewhere."""

    def __init__(self, params: list[torch.Tensor], masters: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], runs: list[list[Run]], scaler: WeightQuantizers,
                 device: torch.device) -> None:
        super().__init__(masters, exp_avgs, exp_avg_sqs, runs, scaler, device)
        self.params = params

    def grad_shards(self) -> list[torch.Tensor]:
        return [torch.zeros_like(m) if p.grad is None else local_shard(p.grad).reshape(-1).float()
                for p, m in zip(self.params, self.masters, strict=True)]

    def local_amax(self) -> torch.Tensor:
        """Each FP8 weight's ``local_stats`` of its local shard (per tensor: one row, one slot;
        rowwise or blockwise: its local tiles, one slot each)."""
        amax = torch.zeros(self.fp8.num_slots, dtype=torch.float32, device=self.device)
        for i, (start, k) in self.fp8.span.items():
            if self.masters[i].numel():  # an empty shard (fewer rows than ranks) has amax 0
                stats = self.fp8.quantizer(i).local_stats(self.fp8.as_tiles(i, self.masters[i]), "weight")
                amax[start:start + k] = stats.reshape(-1)
        return amax

    def cast(self, scales: torch.Tensor | None, grads: StepGrads) -> None:
        for i, p in enumerate(self.params):
            local = local_shard(p)  # read every step: FSDP2 may re-pad (replace) it at lazy init
            if not local.numel():
                continue
            if isinstance(local, Float8Tensor):
                assert scales is not None
                start, k = self.fp8.span[i]
                grid = scales[start:start + k].view(local.scale_inv.shape)  # 0-d, or the local grid
                self.fp8.quantizer(i).cast_scaled(self.masters[i].view(local.shape), grid,
                                                  local.fp8_format, "weight", out=local._data)
            else:
                local.copy_(self.masters[i].view(local.shape).to(local.dtype))


class _LocalUnit:
    """One parameter's local shard in the form the fused step's kernels take a region
    (``RegionBuffers``' fields): its master and moments, this step's gradient shard and its
    bytes (``uint8`` for FP8), all flat views."""

    def __init__(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 grad: torch.Tensor | None, local: torch.Tensor) -> None:
        self.master, self.exp_avg, self.exp_avg_sq, self.grad_buffer = master, exp_avg, exp_avg_sq, grad
        self.is_fp8 = isinstance(local, Float8Tensor)
        self.fmt = local.fp8_format if self.is_fp8 else None
        # .view, never .reshape: the kernels write these, so a copy would lose the update
        self.param_buffer = local._data.view(torch.uint8).view(-1) if self.is_fp8 else local.view(-1)


class FSDP2FusedKernel:
    """The fused step ([Note: fused step]) on FSDP2's local shards: kernel 1 (Adam(W), the tile
    amaxes and, with delayed scaling, the FP8 bytes) and kernel 2 (the cast, current scaling)
    run per parameter on its local shard, reading the bf16 gradient shard in place (no fp32
    copy); clipping is a coefficient kernel 1 applies as it reads; both take the step's skip flag
    on the device ([Note: skip on the device] in core.py). Triton where it serves, else
    the same tile ops in PyTorch (``adam_tiles_``' reference path: what the CPU tests run, bit
    for bit the ``FSDP2Kernel``'s numbers). Per-tensor FP8 weights only (the fused step's cast;
    rowwise and blockwise weights take ``FSDP2Kernel``)."""

    def __init__(self, params: list[torch.Tensor], masters: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], group_of: Mapping[int, int], scaler: WeightQuantizers,
                 device: torch.device, block: int = DEFAULT_BLOCK) -> None:
        if scaler.tiled:
            raise ValueError("step_kernel='fused' casts per-tensor FP8 weights only; these are rowwise or "
                             "blockwise: use step_kernel='reference' or 'auto'")
        self.params, self.masters, self.exp_avgs, self.exp_avg_sqs = params, masters, exp_avgs, exp_avg_sqs
        self.fp8, self.device = scaler, device
        self.triton = use_triton(masters[0]) if masters else False
        self.tables: list[TileTable] = [
            build_tile_table([ShardPiece(i, 0, 0, 0, 0, m.numel())], group_of, scaler.slot, block, device)
            for i, m in enumerate(masters)]
        # Every FP8 parameter's tile amaxes in one buffer, so the slot amax is one scatter.
        fp8_tiles = [(i, t.num_tiles) for i, t in enumerate(self.tables) if i in scaler.slot]
        self._partial = torch.zeros(sum(n for _, n in fp8_tiles), dtype=torch.float32, device=device)
        self._partial_slot = (torch.cat([self.tables[i].slot for i, _ in fp8_tiles]) if fp8_tiles
                              else torch.zeros(0, dtype=torch.int64, device=device))
        self.partials: dict[int, torch.Tensor] = {}
        start = 0
        for i, n in fp8_tiles:
            self.partials[i] = self._partial[start:start + n]
            start += n
        self._no_grad: dict[int, torch.Tensor] = {}  # zeros for a parameter that got no gradient

    decides_on_device = True  # both tile ops take grads.apply ([Note: skip on the device])

    def grad_shards(self) -> list[torch.Tensor]:
        out = []
        for i, p in enumerate(self.params):
            if p.grad is None:
                if i not in self._no_grad:
                    self._no_grad[i] = torch.zeros_like(self.masters[i])
                out.append(self._no_grad[i])
            else:
                out.append(local_shard(p.grad).reshape(-1))
        return out

    def grad_sumsq(self, shards: list[torch.Tensor]) -> torch.Tensor:
        return sumsq_in_place(shards, self.device)

    def clip_(self, grads: StepGrads, coef: torch.Tensor) -> None:
        grads.coef = coef if grads.coef is None else grads.coef * coef

    def _unit(self, i: int, grad: torch.Tensor | None = None) -> _LocalUnit:
        # the local shard is read every step: FSDP2 may replace it (re-pad) at lazy init
        return _LocalUnit(self.masters[i], self.exp_avgs[i], self.exp_avg_sqs[i], grad,
                          local_shard(self.params[i]))

    def update(self, grads: StepGrads, hps: Sequence[AdamScalars]) -> None:
        known = self.fp8.known_scales()
        for i, table in enumerate(self.tables):
            if not table.num_tiles:
                continue
            fp8 = i in self.fp8.slot
            mode = (OUT_AMAX if known is None else OUT_AMAX_CAST) if fp8 else OUT_PARAM
            adam_tiles_(self._unit(i, grads.shards[i]), table, hps, out_mode=mode,  # type: ignore[arg-type]
                        grad_scale=grads.coef, scale=known, partial_amax=self.partials.get(i),
                        triton=self.triton, apply=grads.apply)

    def local_amax(self) -> torch.Tensor:
        out = torch.zeros(self.fp8.num_slots, dtype=torch.float32, device=self.device)
        return out.scatter_reduce_(0, self._partial_slot, self._partial, reduce="amax")

    def cast(self, scales: torch.Tensor | None, grads: StepGrads) -> None:
        """Kernel 2 on every FP8 shard (current scaling; delayed scaling cast in kernel 1)."""
        if self.fp8.known_scales() is not None or not self.partials:
            return
        assert scales is not None
        for i in self.partials:
            if self.tables[i].num_tiles:
                cast_tiles_(self._unit(i), self.tables[i], scales, triton=self.triton,  # type: ignore[arg-type]
                            apply=grads.apply)


class FSDP2WeightScales(WeightQuantizers):
    """``WeightQuantizers`` on FSDP2's local shards ([Note: FSDP2 tiled weights]).

    A per-tensor weight has one slot, whose stats every rank's shard contributes to (MAX-reduced,
    [Note: weight scaling]). A rowwise or blockwise weight's slots are the tiles of this rank's
    shard: FSDP2 cuts it on tile rows, so each tile is whole on one rank and its stats are final
    there -- no all-reduce (they follow the per-tensor slots, so ``reduced_slots`` counts only
    those), and the scales travel as the grid rows FSDP2 gathers beside the bytes. A checkpoint
    holds the whole grid, as the flat engine's does: ``state`` gathers it from the shard ranks,
    ``load_state`` keeps this rank's rows. ``rows``: index -> (first row of the local shard,
    rows of the weight).
    """

    def __init__(self, params: dict[int, Float8Tensor], mode: ScalingMode, recipe: DelayedScaling | None,
                 device: torch.device, group: Group, rows: Mapping[int, tuple[int, int]]) -> None:
        super().__init__(params, mode, recipe, device)
        self.reduced_slots = sum(1 for p in params.values() if p.block is None)
        self.group = group
        # tiled weight -> (its first grid row here, its grid rows in all)
        self._grid_rows = {i: (rows[i][0] // p.block[0], -(-rows[i][1] // p.block[0]))
                           for i, p in self.tiled.items()}

    def state(self, index: int) -> dict[str, torch.Tensor]:
        st = super().state(index)
        if index in self._grid_rows:  # every shard rank's grid rows, in order (even shards)
            mine = st["scale"].contiguous()
            full = mine.new_empty((self.group.world_size * mine.shape[0], mine.shape[1]))
            self.group.all_gather(full, mine, kind="all_gather.fp8_scale_grid")
            st["scale"] = full[:self._grid_rows[index][1]]
        return st

    def load_state(self, index: int, sd: dict[str, torch.Tensor]) -> None:
        if index in self._grid_rows:
            first, total = self._grid_rows[index]
            local = self.span[index][1] // max(self._geometry[index][2], 1)
            grid = sd["scale"].reshape(total, -1)
            sd = {**sd, "scale": grid[first:first + local]}
        super().load_state(index, sd)


class FSDP2Engine:
    """The FSDP2 engine ([Note: engine], [Note: FSDP2 engine]): FSDP2 owns the local shards and
    moves their bytes; this holds, per local shard, the fp32 master and Adam moments.

    ``params`` (DTensors of one mesh, flattened over param groups; ``group_of``: index -> param
    group); ``module``: the fully_shard-ed model, for ``no_sync`` and, with ``count_comm``, to
    count FSDP2's all-gathers and reduce-scatters.
    """

    def __init__(self, params: list[torch.Tensor], group_of: Mapping[int, int], num_groups: int, *,
                 device: torch.device, state_dtype: torch.dtype, fp8_weight_scaling: ScalingMode,
                 delayed_scaling: DelayedScaling | None, module: nn.Module | None, count_comm: bool,
                 step_kernel: str = "auto") -> None:
        if step_kernel not in ("auto", "reference", "fused"):
            raise ValueError(f"step_kernel must be 'auto', 'reference' or 'fused', got {step_kernel!r}")
        if not state_dtype.is_floating_point:
            raise ValueError(f"state_dtype must be floating point, got {state_dtype}")
        _check_sharded(params)
        if count_comm and module is None:
            raise ValueError("FSDP2Adam(count_comm=True) counts the model's FSDP2 collectives: pass "
                             "module=model as well")
        self.params = params
        self.module = module
        self._wire = None
        if count_comm:
            from fp8shard.optim.fsdp2_comm import count_fsdp_wire

            self._wire = count_fsdp_wire(module)
        self.comm = CommCounter()
        self.group = Group(_shard_group(params[0]), self.comm)
        _check_fp8_shards(params, Group(self.group.pg if self.group.distributed else None, CommCounter()))
        self.master: list[torch.Tensor] = []
        self.exp_avg: list[torch.Tensor] = []
        self.exp_avg_sq: list[torch.Tensor] = []
        for p in params:
            local = local_shard(p)
            if isinstance(local, Float8Tensor):
                init = local.get_high_precision_init_val()  # start from it, not the bytes (TE 1121)
                value = init if init is not None else local.dequantize(torch.float32)
                local.clear_high_precision_init_val()
            else:
                value = local.detach()
            self.master.append(value.to(device, torch.float32, copy=True).reshape(-1))
            self.exp_avg.append(torch.zeros(local.numel(), dtype=state_dtype, device=device))
            self.exp_avg_sq.append(torch.zeros(local.numel(), dtype=state_dtype, device=device))
        fp8 = {i: t for i, t in ((i, local_shard(p)) for i, p in enumerate(params))
               if isinstance(t, Float8Tensor)}
        self.fp8 = FSDP2WeightScales(fp8, fp8_weight_scaling, delayed_scaling, device, self.group,
                                     {i: (shard_rows(params[i])[0], params[i].shape[0]) for i in fp8})
        runs: list[list[Run]] = [[] for _ in range(num_groups)]
        for i, m in enumerate(self.master):
            if m.numel():
                runs[group_of[i]].append((i, 0, m.numel()))
        if step_kernel == "auto":  # [Note: step kernel], once: as the flat engine decides
            fused = bool(self.master) and not self.fp8.tiled and use_triton(self.master[0])
            step_kernel = "fused" if fused else "reference"
        self.kernel: FSDP2Kernel | FSDP2FusedKernel = (
            FSDP2FusedKernel(params, self.master, self.exp_avg, self.exp_avg_sq, group_of, self.fp8, device)
            if step_kernel == "fused" else
            FSDP2Kernel(params, self.master, self.exp_avg, self.exp_avg_sq, runs, self.fp8, device))

    # ------------------------------------------------------------------ the step
    def begin_step(self) -> None:
        """Nothing in flight between steps (FSDP2 gathers at each forward)."""

    def finish_grad_reduction(self) -> bool:
        """FSDP2 reduce-scattered the gradients in backward; whether any parameter got one."""
        return any(p.grad is not None for p in self.params)

    def launch_gathers(self, scale_inv: torch.Tensor | None, apply: torch.Tensor | None = None) -> None:
        """The new scales (or scale grid rows) onto the local FP8 shards (where ``apply`` holds);
        FSDP2 gathers the bytes (and grid rows) at the next forward."""
        if self.fp8.slot:
            assert scale_inv is not None
            self.fp8.set_scale_inv({i: local_shard(self.params[i]) for i in self.fp8.slot}, scale_inv, apply)

    def wait_gathers(self) -> None:
        """Nothing in flight after ``step()``."""

    def reset_grads(self) -> None:
        """The gradients are the parameters' ``.grad`` (the optimizer's ``zero_grad`` drops them)."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes in here keep their unsharded gradients (no reduce-scatter); the next
        one outside reduces the sum (FSDP2's ``set_requires_gradient_sync``). Needs ``module``."""
        if self.module is None or not hasattr(self.module, "set_requires_gradient_sync"):
            raise RuntimeError("FSDP2Adam.no_sync needs the fully_shard-ed model: pass "
                               "FSDP2Adam(..., module=model)")
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    # ------------------------------------------------------------------ checkpoints, accounting
    def sharded_states(self) -> dict[int, list[dict[str, Any]]]:
        """This rank's shard of each parameter as one piece of the flattened parameter."""
        state: dict[int, list[dict[str, Any]]] = {}
        for i, p in enumerate(self.params):
            start, _ = shard_rows(p)
            numel = self.master[i].numel()
            if numel:
                row = math.prod(p.shape[1:])
                state[i] = [{"offset": start * row, "numel": numel, "master": self.master[i],
                             "exp_avg": self.exp_avg[i], "exp_avg_sq": self.exp_avg_sq[i]}]
        return state

    def load_sharded_states(self, state: dict[int, list[dict[str, Any]]]) -> None:
        for i, p in enumerate(self.params):
            numel = self.master[i].numel()
            if not numel:
                continue
            lo = shard_rows(p)[0] * math.prod(p.shape[1:])
            covered = 0
            for e in state.get(i, []):
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

    def memory_report(self) -> dict[str, int]:
        """The local weight shards (FP8: 1 byte per element), gradient shards, master, states."""
        out = dict.fromkeys(("fp8_weights", "other_weights", "grad_buffers", "master",
                             "optimizer_states", "padding"), 0)
        for i, p in enumerate(self.params):
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
        return out

    def close_comm_window(self) -> dict[str, int]:
        """The optimizer's all-reduces and, with ``count_comm``, FSDP2's parameter all-gathers
        (``all_gather.params.uint8`` for FP8 bytes) and gradient reduce-scatters since the
        previous step (optim/fsdp2_comm.py)."""
        done = self.comm.close_window()
        if self._wire is not None:
            done.update(self._wire.close_window())
        return done


def _check_sharded(params: list[torch.Tensor]) -> None:
    from torch.distributed.tensor import DTensor

    for i, p in enumerate(params):
        if not isinstance(p, DTensor):
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is not sharded by FSDP2; call "
                             "fully_shard_model(model, mesh) before building FSDP2Adam")
    # Equal meshes, not the same object: FSDP2 may give a module's parameters equal copies of
    # the mesh it was called with (seen with torch 2.13 for the third layer of a stack).
    if any(p.device_mesh != params[0].device_mesh for p in params[1:]):
        raise ValueError("FSDP2Adam needs every parameter on one device mesh; shard the whole "
                         "model with one fully_shard_model(model, mesh) call")


def _check_fp8_shards(params: list[torch.Tensor], group: Group) -> None:
    """Every shard rank holds the same kind of local shard of each parameter (plain, per-tensor
    FP8, or tiled FP8), and tiled ones cut into whole tiles. A rowwise or blockwise weight that
    torch's ``fully_shard`` cut through its tiles (``fully_shard_model`` refuses that up front)
    can leave some ranks a plain shard, or a grid of its own: refused here, on every rank alike."""
    locals_ = [local_shard(p) for p in params]
    kinds = torch.tensor([0 if not isinstance(t, Float8Tensor) else 1 if t.block is None else 2
                          for t in locals_], dtype=torch.float32, device=locals_[0].device)  # NCCL: GPU
    both = torch.cat([kinds, -kinds])
    group.all_reduce(both, "max", kind="all_reduce.setup")
    both = both.tolist()
    bad = [i for i in range(len(params)) if both[i] != -both[len(params) + i]]
    if bad:
        i = bad[0]
        raise ValueError(f"parameter {i} (shape {tuple(params[i].shape)}) is an FP8 shard on some ranks "
                         "and a plain one on others: FSDP2 cut a rowwise or blockwise FP8 weight through "
                         "its tiles. Shard the model with fully_shard_model(model, mesh), which refuses "
                         "such shapes and names the fix ([Note: FSDP2 tiled weights])")
    for i, (p, local) in enumerate(zip(params, locals_, strict=True)):  # same kinds everywhere now
        if isinstance(local, Float8Tensor) and local.block is not None:
            shard_world = p.device_mesh.size(p.device_mesh.ndim - 1)
            check_tiled_sharding(tuple(p.shape), local.block, shard_world, f"parameter {i}")


class FSDP2Adam(ShardedAdam):
    """AdamW over FSDP2's local shards, with the flat engine's math and FP8 weight scaling.

    Build it on a model after :func:`fully_shard_model` (its parameters are DTensors). Same
    arguments and meaning as ``DistributedFusedAdam`` where they apply; see [Note: FSDP2 engine].
    ``module``: the fully_shard-ed model, for ``no_sync()`` (gradient accumulation) and, with
    ``count_comm=True``, to count FSDP2's all-gathers and reduce-scatters in ``comm_report()``.
    ``step_kernel``: 'auto' (the fused step where Triton serves and the FP8 weights are per
    tensor, as ``DistributedFusedAdam`` decides), or force 'reference' (``FSDP2Kernel``: PyTorch
    ops on fp32 gradient copies) or 'fused' (``FSDP2FusedKernel``; its PyTorch tile ops off CUDA).
    """

    engine: FSDP2Engine

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
        step_kernel: str = "auto",
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
                         adam_w_mode=adam_w_mode)
        self.state_dtype = state_dtype
        self.module = module  # the fully_shard-ed model, for no_sync
        self.engine = FSDP2Engine(
            self._params, self._group_of, len(self.param_groups), device=self.device,
            state_dtype=state_dtype, fp8_weight_scaling=fp8_weight_scaling,
            delayed_scaling=delayed_scaling, module=module, count_comm=count_comm, step_kernel=step_kernel)
