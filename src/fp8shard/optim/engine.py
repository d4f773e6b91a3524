"""The engine interface: who owns the weights' storage and moves their bytes.

[Note: engine]
    An optimizer of fp8shard is thin: ``ShardedAdam`` (core.py) holds the hyperparameters, the
    step count and the three phases of ``step()``; everything that depends on *where* the
    parameters, gradients, fp32 master and Adam states live is its ``Engine``:

      ``FlatEngine`` (flat.py)     contiguous bucket buffers, gradient reduce-scatter per bucket
                                   from tensor hooks, one in-place all-gather per bucket in
                                   ``step()`` (``DistributedFusedAdam``, [Note: shard layout])
      ``FSDP2Engine`` (fsdp2.py)   torch FSDP2's local shards (``fully_shard``): FSDP2 reduces the
                                   gradients and gathers the FP8 bytes at the next forward
                                   (``FSDP2Adam``, [Note: FSDP2 engine])

    The step through an engine (``ShardedAdam.step``):

      1. ``finish_grad_reduction()``, then the kernel's ``grad_shards`` and ``grad_sumsq``;
         one all-reduce of the statistics over ``group`` (the core's)
      2. ``kernel.update``; ``kernel.local_amax``, one all-reduce(MAX) over ``group``,
         ``fp8.cast_scales``; ``kernel.cast`` writes the new bytes into the local storage
      3. ``launch_gathers(scale_inv)``: the new bytes and scales reach the weights

    The arithmetic is the engine's ``kernel`` ([Note: step kernel]), chosen once when the engine
    is built; a kernel never communicates, the core issues the all-reduces, the engine the
    reduce-scatters and gathers. Checkpoints see ``sharded_states()``: per parameter, pieces of
    the flattened global parameter with their offsets, the same form from either engine
    ([Note: checkpoint space]).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from fp8shard.fp8.quantizer import WeightQuantizers
from fp8shard.optim.collectives import Group
from fp8shard.optim.step_kernel import StepKernel


@runtime_checkable
class Engine(Protocol):
    """Storage, sharding and collectives of an optimizer's parameters; see [Note: engine]."""

    group: Group
    """The ranks that share the parameters' shards; the optimizer's all-reduces run over it."""
    fp8: WeightQuantizers
    """The FP8 weights' quantizers and scales (a slot per per-tensor weight or tile), their state
    for checkpoints."""
    kernel: StepKernel
    """The step's arithmetic on this rank's shards, chosen once at construction."""

    def begin_step(self) -> None:
        """Check the storage is still the engine's; finish what the previous step left in flight."""

    def finish_grad_reduction(self) -> bool:
        """Wait for the gradient reduction; whether this rank received any gradient."""

    def launch_gathers(self, scale_inv: torch.Tensor | None, apply: torch.Tensor | None = None) -> None:
        """Hand the new bytes to the weights, with the FP8 parameters' new ``scale_inv`` per slot;
        ``apply`` (0-d bool, a step decided on the device): where False the weights keep their
        scales ([Note: skip on the device])."""

    def wait_gathers(self) -> None:
        """Finish every in-flight parameter gather (the weights are whole when it returns)."""

    def reset_grads(self) -> None:
        """Start a new accumulation window: drop the gradients the engine holds."""

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside only accumulate; the next one outside reduces the sum."""

    def sharded_states(self) -> dict[int, list[dict[str, Any]]]:
        """This rank's pieces: ``{param: [{'offset', 'numel', 'master', 'exp_avg', 'exp_avg_sq'}]}``."""

    def load_sharded_states(self, state: dict[int, list[dict[str, Any]]]) -> None:
        """Fill this rank's pieces from pieces of any split (either engine, any world size)."""

    def memory_report(self) -> dict[str, int]:
        """Persistent bytes on this rank by category (weights, grads, master, states, padding)."""

    def close_comm_window(self) -> dict[str, int]:
        """Bytes per collective kind since the last call (the optimizer calls it once a step)."""
