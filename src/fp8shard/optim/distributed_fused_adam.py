"""``DistributedFusedAdam``: ZeRO-style sharded AdamW whose FP8 weights are gathered as FP8 bytes.

``step()`` reads in three phases (the data flow of docs/design.md, section 1):

    1. finish the gradient reduction  -> ``StepGrads``: this rank's shards of the averaged
       (``_finish_grad_reduction``)      gradient and one small all-reduce of their statistics
                                         (sum of squares, non-finite, any gradient at all)
    2. update and cast                -> Adam(W) on the fp32 master shard; amax per FP8 parameter,
       (``_update_and_cast``)            ONE packed all-reduce(MAX), scales [Note: weight scaling];
                                         this rank's shard of the parameters' bytes
    3. launch the gathers             -> the in-place all-gather of every bucket (FP8 as uint8),
       (``_launch_gathers``)             waited for here or by forward pre-hooks

The arithmetic of phases 1 and 2 is the *step kernel*, chosen once at construction
([Note: step kernel] in step_kernel.py): the reference (PyTorch ops) or the fused step of
fused_step.py (the Triton tile kernels, [Note: fused step]) where Triton serves and ``fused``.
``clip_grad_norm`` works on the same ``StepGrads`` and returns what it computed.

The other pieces live in their own modules: layout (pure arithmetic), buffers (the tensors), hooks
(gradient and forward hooks), collectives (the only torch.distributed caller), adam (the math),
fp8_weights (amax, scale, cast) and state_dict (model-space checkpoints).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from fp8shard._triton import use_triton
from fp8shard.fp8 import DelayedScaling, Float8Tensor
from fp8shard.optim.buffers import RegionBuffers, shard_unit, storage_dtype
from fp8shard.optim.collectives import CommCounter, Group
from fp8shard.optim.fp8_weights import Fp8WeightScaler, ScalingMode
from fp8shard.optim.fused_step import AdamScalars, FusedKernel
from fp8shard.optim.hooks import GradSync, ParamSync
from fp8shard.optim.layout import ParamSpec, build_layout
from fp8shard.optim.state_dict import (
    full_states,
    load_full_states,
    load_sharded_states,
    sharded_states,
)
from fp8shard.optim.step_kernel import ReferenceKernel, StepGrads, StepKernel

_HPARAMS = ("lr", "betas", "eps", "weight_decay")


class DistributedFusedAdam(torch.optim.Optimizer):
    """AdamW (or Adam + L2) with FP32 master weights and states sharded over a process group.

    Use it on a plain ``nn.Module`` (no DDP): gradient hooks average gradients over the group.
    Parameters become views of the optimizer's bucket buffers at construction (same Parameter
    objects; a Float8Tensor keeps its wrapper and ``_scale_inv``, its ``_data`` is re-pointed).

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW``; param groups may override
            lr, betas, eps and weight_decay (e.g. no decay for norms and biases).
        adam_w_mode: True: decoupled weight decay (AdamW); False: L2 added to the gradient (Adam).
        process_group: the data-parallel group (default: the world; none initialized: one process).
        bucket_cap_mb: bucket size in MiB of ``grad_sync_dtype`` gradients.
        alignment: parameters start, and shards split, at multiples of this many elements.
        grad_sync_dtype: dtype of the gradient buffers and of the reduce-scatter (bf16 default).
        state_dtype: dtype of exp_avg/exp_avg_sq (fp32 default; bf16 halves their memory).
        overlap_grad_sync: start each bucket's reduce-scatter as soon as its gradients are in.
        overlap_param_sync: let ``step()`` return with the all-gathers in flight; forward
            pre-hooks (``module=`` or ``register_module``) wait for each module's buckets.
        fp8_weight_scaling: 'current' (scale from this step's global amax) or 'delayed'
            (Transformer Engine's amax history, configured by ``delayed_scaling``).
        module: the model, to register forward pre-hooks for ``overlap_param_sync``.
        fused: take the fused Triton step ([Note: fused step]) where Triton serves (CUDA,
            ``fp8shard.get_triton()``); False: the PyTorch path always (to compare, or to debug).
        step_kernel: 'auto' (the default: as ``fused`` and Triton say), or force 'reference'
            (PyTorch ops) or 'fused' (the fused step's orchestration; its PyTorch reference ops
            where Triton does not serve, e.g. to test it on the CPU). [Note: step kernel]
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
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        alignment: int = 16,
        grad_sync_dtype: torch.dtype = torch.bfloat16,
        state_dtype: torch.dtype = torch.float32,
        overlap_grad_sync: bool = True,
        overlap_param_sync: bool = False,
        fp8_weight_scaling: ScalingMode = "current",
        delayed_scaling: DelayedScaling | None = None,
        module: nn.Module | None = None,
        fused: bool = True,
        step_kernel: Literal["auto", "reference", "fused"] = "auto",
    ) -> None:
        if not isinstance(fused, bool):
            raise ValueError(f"fused must be True or False, got {fused!r}")
        if step_kernel not in ("auto", "reference", "fused"):
            raise ValueError(f"step_kernel must be 'auto', 'reference' or 'fused', got {step_kernel!r}")
        self._frozen = False
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._frozen = True
        self.adam_w_mode = adam_w_mode
        self.overlap_param_sync = overlap_param_sync
        self.last_step_skipped = False
        self._step = 0
        self._params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self.device = _check_params(self._params)
        self._comm = CommCounter()
        self._last_comm: dict[str, int] = {}
        self.group = Group(process_group, self._comm)
        _check_backend(self.group, self.device)
        self.state_dtype = state_dtype
        self.regions = self._build_regions(bucket_cap_mb, alignment, grad_sync_dtype, state_dtype)
        fp8 = {i: p for i, p in enumerate(self._params) if isinstance(p, Float8Tensor)}
        self.fp8 = Fp8WeightScaler(fp8, fp8_weight_scaling, delayed_scaling, self.device)
        self._new_scale_inv = torch.zeros(self.fp8.num_slots, device=self.device)
        self._init_master_and_attach()
        params_by_index = dict(enumerate(self._params))
        self.grad_sync = GradSync(self.regions, params_by_index, self.group, overlap_grad_sync)
        self.param_sync = ParamSync(self.regions, self.group, self._on_params_ready)
        self.fused = fused
        self.kernel = self._choose_kernel(step_kernel)  # [Note: step kernel], once
        self._grads: StepGrads | None = None  # this window's reduced gradient, made on first use
        if module is not None:
            self.register_module(module)

    # ================================================================== construction
    def _build_regions(self, bucket_cap_mb: float, alignment: int, grad_dtype: torch.dtype,
                       state_dtype: torch.dtype) -> list[RegionBuffers]:
        if not grad_dtype.is_floating_point or not state_dtype.is_floating_point:
            raise ValueError(f"grad_sync_dtype and state_dtype must be floating point, got "
                             f"{grad_dtype} and {state_dtype}")
        if not (isinstance(bucket_cap_mb, (int, float)) and 0 < bucket_cap_mb < math.inf):
            raise ValueError(f"bucket_cap_mb must be a finite number > 0, got {bucket_cap_mb!r}")
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
            raise ValueError(f"alignment must be an int >= 1 (elements), got {alignment!r}")
        # Backward visits parameters roughly in reverse registration order: [Note: shard layout].
        order = reversed(list(enumerate(self._params)))
        specs = [ParamSpec(i, p.numel(), storage_dtype(p), shard_unit(p)) for i, p in order]
        elem = torch.empty(0, dtype=grad_dtype).element_size()
        layouts = build_layout(specs, self.group.world_size, int(bucket_cap_mb * 2**20 / elem), alignment)
        return [RegionBuffers(lay, self.group.rank, self.device, grad_dtype, state_dtype) for lay in layouts]

    def _init_master_and_attach(self) -> None:
        hp: dict[int, torch.Tensor] = {}
        for i, p in enumerate(self._params):
            if isinstance(p, Float8Tensor):
                # Start the master from the preserved init value, not the FP8 bytes (TE 1121).
                init = p.get_high_precision_init_val()
                value = init if init is not None else p.dequantize(torch.float32)
                p.clear_high_precision_init_val()
            else:
                value = p.detach()
            hp[i] = value.to(self.device, torch.float32).reshape(-1)
        params_by_index = dict(enumerate(self._params))
        for rb in self.regions:
            rb.init_master(hp)
            rb.attach(params_by_index)

    def _choose_kernel(self, choice: str) -> StepKernel:
        if choice == "auto":
            fused = self.fused and not self.fp8.tiled and use_triton(self.regions[0].master)
            choice = "fused" if fused else "reference"  # tiled FP8 weights: [Note: tiled weight casts]
        group_of = {self._index_of[id(p)]: g for g, grp in enumerate(self.param_groups)
                    for p in grp["params"]}
        if choice == "fused":
            return FusedKernel(self.regions, group_of, self.fp8)
        return ReferenceKernel(self.regions, group_of, len(self.param_groups), self.fp8)

    @property
    def _fused(self) -> FusedKernel | None:
        """The fused kernel (its tile tables) when this optimizer steps with it, else None."""
        return self.kernel if isinstance(self.kernel, FusedKernel) else None

    def _use_fused(self) -> bool:
        """Whether this optimizer steps with the fused kernel (for tests and benchmarks)."""
        return self._fused is not None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_frozen", False):
            raise RuntimeError(
                "DistributedFusedAdam lays out its buckets at construction, so add_param_group is "
                "not supported afterwards; pass every param group to the constructor")
        super().add_param_group(param_group)
        _check_hparams(self.param_groups[-1])

    def register_module(self, module: nn.Module) -> None:
        """Wait for a module's parameter all-gathers in its forward pre-hook (overlap_param_sync)."""
        if self.param_sync.register_module(module, self._index_of) == 0:
            raise ValueError("register_module: the module owns none of this optimizer's parameters")

    # ================================================================== the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_unchanged()
        if self.overlap_param_sync and not self.param_sync.modules:
            raise RuntimeError("overlap_param_sync=True needs forward pre-hooks to wait for the "
                               "parameters: pass module=model or call opt.register_module(model)")
        self.param_sync.wait_all()  # the previous step's gathers, if overlap left them in flight
        grads = self._finish_grad_reduction()
        # [Note: step without gradients]: nothing to apply, so nothing changes (torch.optim skips
        # parameters whose .grad is None; here the buckets are shared, so it is all or nothing).
        self.last_step_skipped = grads.nonfinite or not grads.any_grad
        if not self.last_step_skipped:
            self._step += 1
            self._update_and_cast(grads)
            self._launch_gathers()
        self._grads = None
        self.grad_sync.reset()  # the buffers are consumed; next backward starts from zero
        self._last_comm = self._comm.close_window()
        return loss

    def _finish_grad_reduction(self) -> StepGrads:
        """Phase 1: wait for the gradient reduce-scatters and take this rank's shards with their
        global statistics (made once per accumulation window: ``clip_grad_norm`` and ``step``
        share it).

        One pass over the shards and one 8-byte all-reduce: the sum of squares (an inf or NaN
        anywhere makes it non-finite on every rank; so does a square that overflows fp32,
        |g| > 1e19) and the number of ranks that received a gradient.

        [Note: step without gradients]
            ``step()`` with no gradient accumulated on any rank since the last ``step()`` or
            ``zero_grad()`` (no backward ran) is a no-op: no weight, master, moment or the step
            count changes, and ``last_step_skipped`` is True. Applying it would decay the weights
            (AdamW's decoupled decay does not need a gradient) and advance the bias correction.
            torch.optim does the same per parameter: it skips those whose ``.grad`` is None. The
            decision is global (the count rides on the all-reduce above), so ranks stay in step:
            a rank without a gradient while others have one takes part with zeros, as in backward.
        """
        if self._grads is None:
            self.grad_sync.finish()
            shards = self.kernel.grad_shards()
            local = torch.zeros(2, dtype=torch.float32, device=self.device)
            local[0] = self.kernel.grad_sumsq(shards)
            local[1] = float(self.grad_sync.dirty)
            self.group.all_reduce(local, "sum", kind="all_reduce.grad_stats")
            sumsq, ranks_with_grads = local.tolist()  # one host sync for both
            self._grads = StepGrads(shards, local[0], not math.isfinite(sumsq), ranks_with_grads > 0)
        return self._grads

    def _update_and_cast(self, grads: StepGrads) -> None:
        """Phase 2: Adam(W) on the master shard, then this rank's shard of every parameter's bytes
        (FP8: amax, ONE packed all-reduce(MAX), scales; [Note: weight scaling])."""
        self.kernel.update(grads, self._hyperparams())
        scales = self._new_scale_inv  # no FP8 parameter: unused
        if self.fp8.num_slots:
            amax = self.kernel.local_amax()
            self.group.all_reduce(amax, "max", kind="all_reduce.amax")
            scales = self.fp8.cast_scales(amax)
            self._new_scale_inv = scales.reciprocal()
        self.kernel.cast(scales)

    def _hyperparams(self) -> list[AdamScalars]:
        """This step's hyperparameters, one per param group (read at every step: LR schedules)."""
        return [AdamScalars(self._step, float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]),
                            float(g["eps"]), float(g["weight_decay"]), self.adam_w_mode)
                for g in self.param_groups]

    def _launch_gathers(self) -> None:
        """Phase 3: all-gather every bucket in place; wait unless ``overlap_param_sync``."""
        self.param_sync.launch_all()
        if not self.overlap_param_sync:
            self.param_sync.wait_all()

    def _on_params_ready(self, indices: list[int]) -> None:
        fp8 = {i: self._params[i] for i in indices if isinstance(self._params[i], Float8Tensor)}
        if fp8:  # one batched copy for all of them (a launch per parameter would cost host time)
            self.fp8.set_scale_inv(fp8, self._new_scale_inv)

    # ================================================================== gradients
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes in here only accumulate into the buckets; the next one outside syncs."""
        before = self.grad_sync.enabled
        self.grad_sync.enabled = False
        try:
            yield
        finally:
            self.grad_sync.enabled = before

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale the averaged gradients so their global L2 norm is at most ``max_norm``.

        Call after backward, before ``step()``. Returns the norm before clipping (as
        ``torch.nn.utils.clip_grad_norm_`` does); a non-finite norm clips nothing and makes
        ``step()`` skip. ``max_norm`` is a number >= 0 (``inf``: measure only, clip nothing); a
        negative one would turn descent into ascent and NaN would poison every gradient, so both
        raise ValueError before anything changes. A CPU tensor is read as a number; a CUDA
        tensor is taken as it is (checking its value would cost a host sync per step).
        """
        if isinstance(max_norm, torch.Tensor):
            if max_norm.numel() != 1:
                raise ValueError(f"clip_grad_norm: max_norm must be one number, got shape "
                                 f"{tuple(max_norm.shape)}")
            if max_norm.device.type == "cpu":
                max_norm = float(max_norm)
        if not isinstance(max_norm, torch.Tensor):
            if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
                raise TypeError(f"clip_grad_norm: max_norm must be a number, got "
                                f"{type(max_norm).__name__}")
            if not max_norm >= 0:
                raise ValueError(f"clip_grad_norm: max_norm must be >= 0 (inf: no clipping), got "
                                 f"{max_norm}: a negative or NaN bound would flip or poison the gradients")
        grads = self._finish_grad_reduction()
        total = grads.sumsq.sqrt()
        if not grads.nonfinite:
            self.kernel.clip_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop any accumulated gradients (the bucket buffers) and ``param.grad``."""
        for p in self._params:
            p.grad = None
        if self.grad_sync.dirty or self._grads is not None:
            self._grads = None
            self.grad_sync.reset()

    @property
    def fp8_amax_history_len(self) -> int | None:
        """Length of the FP8 weights' amax history (delayed weight scaling), else None."""
        history = self.fp8.history
        return None if history is None else history.history.shape[0]

    # ================================================================== parameters in flight
    def wait_param_sync(self) -> None:
        """Finish every in-flight parameter all-gather (only needed with overlap_param_sync)."""
        self.param_sync.wait_all()

    # ================================================================== checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Model-space state: full per-parameter tensors on every rank. [Note: checkpoint space]"""
        self.param_sync.wait_all()
        shapes = {i: p.shape for i, p in enumerate(self._params)}
        state = full_states(self.regions, shapes, self.group)
        for i in self.fp8.slot:
            state[i]["fp8"] = self.fp8.state(i)
        return {"format": "fp8shard.model_space.v1", "step": self._step,
                "param_groups": self._groups_for_save(), "state": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` written at any world size; the weights come from the model's
        own checkpoint (``model.load_state_dict``), which writes into the same bytes."""
        self.param_sync.wait_all()
        shapes = {i: p.shape for i, p in enumerate(self._params)}
        load_full_states(self.regions, shapes, state_dict["state"])
        for i in self.fp8.slot:
            if "fp8" in state_dict["state"][i]:  # else: keep the scale the weight's bytes came with
                self.fp8.load_state(i, state_dict["state"][i]["fp8"])
        self._load_scalars(state_dict)

    def _load_scalars(self, state_dict: dict[str, Any]) -> None:
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the checkpoint's param groups do not match this optimizer's (sizes "
                             f"{[len(g['params']) for g in saved_groups]} vs "
                             f"{[len(g['params']) for g in self.param_groups]})")
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items() if k != "params"})
            _check_hparams(group)
        self._step = int(state_dict["step"])

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's pieces (views), each with its offset in the flattened global parameter."""
        return {"format": "fp8shard.sharded.v1", "step": self._step,
                "param_groups": self._groups_for_save(),
                "world_size": self.group.world_size, "rank": self.group.rank,
                "shapes": {i: tuple(p.shape) for i, p in enumerate(self._params)},
                "state": sharded_states(self.regions),
                "fp8": {i: self.fp8.state(i) for i in self.fp8.slot}}

    def load_sharded_state_dict(self, sharded: dict[str, Any]) -> None:
        """Load pieces in the form of ``sharded_state_dict()['state']``, split any way (any world
        size), as long as they cover what this rank owns; plus step, param groups and ``fp8``."""
        self.param_sync.wait_all()
        load_sharded_states(self.regions, sharded["state"])
        for i, st in sharded.get("fp8", {}).items():
            self.fp8.load_state(i, st)
        self._load_scalars(sharded)

    def _groups_for_save(self) -> list[dict[str, Any]]:
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [self._index_of[id(p)] for p in g["params"]]} for g in self.param_groups]

    # ================================================================== accounting
    def memory_report(self) -> dict[str, int]:
        """Persistent bytes on this rank by category, and their ``total``.

        Categories: fp8_weights, other_weights, grad_buffers, master, optimizer_states, padding.
        The total equals the storage size of the optimizer's buffers (the weights included:
        parameters are views of them).
        """
        out = dict.fromkeys(("fp8_weights", "other_weights", "grad_buffers", "master",
                             "optimizer_states", "padding"), 0)
        for rb in self.regions:
            for k, v in rb.nbytes().items():
                out[k] += v
        out["total"] = sum(out.values())
        return out

    def comm_report(self) -> dict[str, int]:
        """Bytes per collective kind in the last step (from the end of the previous ``step()``,
        so it includes the gradient reduce-scatters of the backward before it).

        Sizes are full buffers per rank (see fp8shard/optim/collectives.py); a ring moves
        ``(N - 1) / N`` of them over each rank's link.
        """
        return dict(self._last_comm)

    # ================================================================== checks
    def _check_unchanged(self) -> None:
        now = [id(p) for g in self.param_groups for p in g["params"]]
        if now != [id(p) for p in self._params]:
            raise RuntimeError(
                "the optimizer's parameter list changed after construction; DistributedFusedAdam "
                "lays out its buckets once: build a new optimizer for the new parameters")
        for g in self.param_groups:
            _check_hparams(g)
        for rb in self.regions:
            ptr = rb.param_buffer.untyped_storage().data_ptr()
            for pr in rb.layout.params:
                p = self._params[pr.index]
                data = p._data if isinstance(p, Float8Tensor) else p.data
                if data.untyped_storage().data_ptr() != ptr:
                    raise RuntimeError(
                        f"parameter {pr.index} no longer lives in the optimizer's buffer (its .data "
                        "was replaced, e.g. by model.to() or load_state_dict(assign=True)); copy "
                        "values in place (param.copy_) or build the optimizer afterwards")


def _check_hparams(group: dict[str, Any]) -> None:
    lr, betas, eps, wd = (group[k] for k in _HPARAMS)
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}; check the LR schedule")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not (isinstance(eps, (int, float)) and 0.0 <= eps < math.inf):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not (isinstance(wd, (int, float)) and 0.0 <= wd < math.inf):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {wd!r}")


def _check_backend(group: Group, device: torch.device) -> None:
    backend = getattr(group, "backend", None)
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"the process group uses NCCL but the parameters are on {device}; move the "
                         "model to this rank's GPU first, or use a gloo group for CPU training")


def _check_params(params: list[torch.Tensor]) -> torch.device:
    """All parameters trainable, floating point, distinct and on one device; returns it."""
    if len({id(p) for p in params}) != len(params):
        raise ValueError("a parameter appears twice in the optimizer's param groups; pass each once")
    for i, p in enumerate(params):
        if not p.requires_grad:
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) has requires_grad=False; "
                             "leave frozen parameters out of the optimizer")
        if not p.dtype.is_floating_point:
            raise ValueError(f"parameter {i} has dtype {p.dtype}; only floating-point parameters train")
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise ValueError(f"parameters are on several devices ({', '.join(devices)}); the optimizer "
                         "keeps one set of buckets per process: move the model to one device "
                         "(model.to(device)) before building the optimizer")
    return params[0].device
