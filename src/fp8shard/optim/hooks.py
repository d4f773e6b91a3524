"""Tensor and module hooks: gradients into buckets, and waits for gathered parameters.

No torch class is patched: gradients arrive through ``Tensor.register_post_accumulate_grad_hook``
and the parameter all-gather is awaited in ``nn.Module.register_forward_pre_hook``.

A bucket is keyed by ``(region index, bucket index)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fp8shard.optim.buffers import RegionBuffers
from fp8shard.optim.collectives import Group, Handle

BucketKey = tuple[int, int]


def param_buckets(regions: list[RegionBuffers]) -> dict[int, tuple[int, list[BucketKey]]]:
    """param index -> (region index, keys of the buckets its elements fall in)."""
    out = {}
    for ri, rb in enumerate(regions):
        for pr in rb.layout.params:
            out[pr.index] = (ri, [(ri, b) for b in rb.layout.buckets_of(pr)])
    return out


class GradSync:
    """Copies gradients into the grad buffers and reduce-scatters complete buckets.

    [Note: gradient sync]
        The hook adds ``param.grad`` into the parameter's slot of the grad buffer (cast to
        ``grad_sync_dtype``) and frees ``param.grad``. Outside ``no_sync`` it counts arrivals:
        when every parameter touching a bucket has arrived and ``overlap`` is on, the bucket's
        reduce-scatter (AVG, in place) starts while backward goes on. ``finish()`` launches what
        is left (parameters without a gradient count as zero) and waits. Micro-batches under
        ``no_sync`` only accumulate; their sum is synced with the last one, so k micro-batches
        of a mean loss give k times the gradient of one: scale the loss by 1/k as usual.

        Collectives must be issued in the same order on every rank (NCCL matches them by
        order), yet which bucket completes first can differ between ranks (a parameter unused
        on one rank only). So buckets launch in one fixed order, the order backward is expected
        to complete them; a bucket that completes early waits for the ones before it.
    """

    def __init__(self, regions: list[RegionBuffers], params: dict[int, torch.Tensor],
                 group: Group, overlap: bool) -> None:
        self.regions = regions
        self.group = group
        self.overlap = overlap
        self.enabled = True  # False inside no_sync()
        self.where = param_buckets(regions)
        self.bucket_params: dict[BucketKey, set[int]] = {}
        for i, (_, keys) in self.where.items():
            for k in keys:
                self.bucket_params.setdefault(k, set()).add(i)
        # Expected completion order: a bucket is done when its lowest-index (last in backward)
        # parameter arrives. Ties (several regions) break by key: the same on every rank.
        self.order = sorted(self.bucket_params, key=lambda k: (-min(self.bucket_params[k]), k))
        # Each bucket's (this rank's shard, whole bucket) of the grad buffer, which never moves.
        self._views = {k: (regions[k[0]].shard(regions[k[0]].grad_buffer, k[1]),
                           regions[k[0]].bucket(regions[k[0]].grad_buffer, k[1])) for k in self.order}
        self.handles: dict[BucketKey, Handle] = {}
        self.missing: dict[BucketKey, set[int]] = {}
        self.reset()
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in params.items()
        ]

    def reset(self) -> None:
        """Start a new accumulation window: empty buffers, nothing arrived or in flight."""
        for h in self.handles.values():
            h.wait()
        self.handles.clear()
        self._next = 0  # position in self.order of the next bucket to launch
        self.dirty = False  # whether any gradient was added since the last reset
        self.missing = {k: set(v) for k, v in self.bucket_params.items()}
        for rb in self.regions:
            rb.grad_buffer.zero_()

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self.accumulate(index, p)

        return hook

    def accumulate(self, index: int, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        ri, keys = self.where[index]
        launched = [k for k in keys if k in self.handles]
        if launched:
            raise RuntimeError(
                f"a second gradient for parameter {index} arrived after its bucket's reduce-scatter "
                "started; accumulate micro-batches inside `with opt.no_sync():` (all but the last), "
                "or call opt.step()/opt.zero_grad() between backward passes"
            )
        self.regions[ri].grad_slot(index).add_(p.grad.detach().reshape(-1))
        self.dirty = True
        p.grad = None  # the bucket holds it now; see [Note: gradient sync]
        if not self.enabled:
            return
        for k in keys:
            self.missing[k].discard(index)
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch complete buckets, in ``self.order``, up to the first incomplete one."""
        while self._next < len(self.order) and not self.missing[self.order[self._next]]:
            self._launch(self.order[self._next])

    def _launch(self, key: BucketKey) -> None:
        self._next += 1
        shard, bucket = self._views[key]
        self.handles[key] = self.group.reduce_scatter_avg(shard, bucket, kind="reduce_scatter.grads")

    def finish(self) -> None:
        """Launch every bucket not yet launched (in order), then wait for all of them."""
        while self._next < len(self.order):
            self._launch(self.order[self._next])
        for h in self.handles.values():
            h.wait()

    def remove(self) -> None:
        for h in self._hook_handles:
            h.remove()


class ParamSync:
    """In-flight parameter all-gathers and the module pre-hooks that wait for them.

    ``on_params_ready(indices)`` runs once the parameters' every bucket has arrived, with all
    the parameters one wait completed (the optimizer sets their FP8 scales there in one batched
    copy, so bytes and scale change together).
    """

    def __init__(self, regions: list[RegionBuffers], group: Group,
                 on_params_ready: Callable[[list[int]], None]) -> None:
        self.regions = regions
        self.group = group
        self.on_params_ready = on_params_ready
        self.where = param_buckets(regions)
        self.bucket_params: dict[BucketKey, list[int]] = {}
        for i, (_, keys) in self.where.items():
            for k in keys:
                self.bucket_params.setdefault(k, []).append(i)
        # (bucket, its view of the parameter buffer, collective kind), in launch order.
        self._gathers = [((ri, b.index), rb.bucket(rb.param_buffer, b.index),
                          "all_gather.params." + str(rb.dtype).removeprefix("torch."))
                         for ri, rb in enumerate(regions) for b in rb.layout.buckets]
        self.pending: dict[BucketKey, Handle] = {}
        self.modules: list[RemovableHandle] = []

    def launch_all(self) -> None:
        for key, bucket, kind in self._gathers:
            self.pending[key] = self.group.all_gather_inplace(bucket, kind=kind)

    def wait(self, keys: Iterable[BucketKey]) -> None:
        ready: list[int] = []
        for key in keys:
            h = self.pending.pop(key, None)
            if h is None:
                continue
            h.wait()
            ready.extend(i for i in self.bucket_params[key]
                         if not any(k in self.pending for k in self.where[i][1]))
        if ready:
            self.on_params_ready(ready)

    def wait_all(self) -> None:
        self.wait(list(self.pending))

    def register_module(self, module: nn.Module, index_of: dict[int, int]) -> int:
        """Pre-hooks on every submodule that directly owns optimized parameters; returns count."""
        count = 0
        for m in module.modules():
            keys: list[BucketKey] = []
            for p in m.parameters(recurse=False):
                i = index_of.get(id(p))
                if i is not None:
                    keys.extend(k for k in self.where[i][1] if k not in keys)
            if keys:
                self.modules.append(m.register_forward_pre_hook(self._make_pre_hook(keys)))
                count += 1
        return count

    def _make_pre_hook(self, keys: list[BucketKey]) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: object) -> None:
            if self.pending:
                self.wait(keys)

        return pre_hook
