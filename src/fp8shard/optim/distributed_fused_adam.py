"""``DistributedFusedAdam``: ZeRO-style sharded AdamW whose FP8 weights are gathered as FP8 bytes.

The optimizer of the flat engine: ``ShardedAdam`` (core.py: the three phases of ``step()``,
clipping, the skip decision, the checkpoint scalars) on a ``FlatEngine`` (flat.py: bucket
buffers, gradient hooks and reduce-scatters, the in-place all-gathers; [Note: engine]). The
arithmetic is the step kernel the engine picks once ([Note: step kernel] in step_kernel.py):
the reference (PyTorch ops) or the fused step of fused_step.py (the Triton tile kernels,
[Note: fused step]) where Triton serves and ``fused``.

Besides the sharded checkpoint of both engines, this optimizer has a model-space
``state_dict()`` (state_dict.py: full per-parameter tensors on every rank).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from fp8shard.fp8 import DelayedScaling
from fp8shard.optim.core import ShardedAdam
from fp8shard.optim.flat import FlatEngine
from fp8shard.optim.fp8_weights import ScalingMode
from fp8shard.optim.fused_step import FusedKernel
from fp8shard.optim.state_dict import full_states, load_full_states


class DistributedFusedAdam(ShardedAdam):
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
        region_cap_mb: the largest region of the buffers, in MiB of ``grad_sync_dtype`` gradients
            (``math.inf``: one per storage dtype). A region's gradient storage is allocated when
            the backward first reaches it and released after the step, [Note: gradient regions].
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

    engine: FlatEngine

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
        region_cap_mb: float = 256.0,
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
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
                         adam_w_mode=adam_w_mode)
        self.overlap_param_sync = overlap_param_sync
        self.state_dtype = state_dtype
        self.fused = fused
        self.engine = FlatEngine(
            self._params, self._group_of, len(self.param_groups), device=self.device,
            process_group=process_group, bucket_cap_mb=bucket_cap_mb, alignment=alignment,
            grad_sync_dtype=grad_sync_dtype, state_dtype=state_dtype,
            overlap_grad_sync=overlap_grad_sync, overlap_param_sync=overlap_param_sync,
            fp8_weight_scaling=fp8_weight_scaling, delayed_scaling=delayed_scaling, fused=fused,
            step_kernel=step_kernel, region_cap_mb=region_cap_mb)
        if module is not None:
            self.register_module(module)

    @property
    def _fused(self) -> FusedKernel | None:
        """The fused kernel (its tile tables) when this optimizer steps with it, else None."""
        kernel = self.engine.kernel
        return kernel if isinstance(kernel, FusedKernel) else None

    def _use_fused(self) -> bool:
        """Whether this optimizer steps with the fused kernel (for tests and benchmarks)."""
        return self._fused is not None

    def register_module(self, module: nn.Module) -> None:
        """Wait for a module's parameter all-gathers in its forward pre-hook (overlap_param_sync)."""
        if self.engine.param_sync.register_module(module, self._index_of) == 0:
            raise ValueError("register_module: the module owns none of this optimizer's parameters")

    # ================================================================== checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Model-space state: full per-parameter tensors on every rank. [Note: checkpoint space]"""
        engine = self.engine
        engine.wait_gathers()
        shapes = {i: p.shape for i, p in enumerate(self._params)}
        state = full_states(engine.regions, shapes, engine.group)
        for i in engine.fp8.slot:
            state[i]["fp8"] = engine.fp8.state(i)
        return {"format": "fp8shard.model_space.v1", "step": self._step,
                "param_groups": self._groups_for_save(), "state": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` written at any world size; the weights come from the model's
        own checkpoint (``model.load_state_dict``), which writes into the same bytes."""
        engine = self.engine
        engine.wait_gathers()
        shapes = {i: p.shape for i, p in enumerate(self._params)}
        load_full_states(engine.regions, shapes, state_dict["state"])
        for i in engine.fp8.slot:
            if "fp8" in state_dict["state"][i]:  # else: keep the scale the weight's bytes came with
                engine.fp8.load_state(i, state_dict["state"][i]["fp8"])
        self._load_scalars(state_dict)
