"""The flat engine: parameters in contiguous bucket buffers, gradients reduce-scattered per bucket.

``FlatEngine`` ([Note: engine] in engine.py) is the storage and the collectives of
``DistributedFusedAdam``: the regions' buffers ([Note: bucket buffers], laid out by
[Note: shard layout]), the gradient hooks that fill and reduce-scatter the buckets
(``GradSync``, [Note: gradient sync]) and the in-place all-gather of every bucket with the
forward pre-hooks that wait for it (``ParamSync``). No torch class is patched: gradients
arrive through ``Tensor.register_post_accumulate_grad_hook`` and the parameter all-gather is
awaited in ``nn.Module.register_forward_pre_hook``. A bucket is keyed by
``(region index, bucket index)``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from fp8shard._triton import use_triton
from fp8shard.fp8 import DelayedScaling, Float8Tensor
from fp8shard.optim.buffers import RegionBuffers, shard_unit, storage_dtype
from fp8shard.optim.collectives import CommCounter, Group, Handle
from fp8shard.optim.fp8_weights import Fp8WeightScaler, ScalingMode
from fp8shard.optim.fused_step import FusedKernel
from fp8shard.optim.layout import ParamSpec, build_layout
from fp8shard.optim.state_dict import load_sharded_states, sharded_states
from fp8shard.optim.step_kernel import FlatReferenceKernel, StepKernel

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

    [Note: lazy gradient zeroing]
        A new accumulation window does not zero the grad buffers (a write of the whole
        buffer, and a read of it again by the first ``add_``); it marks every parameter's slot
        *stale*. A parameter's first gradient in the window is written over its stale slot
        (``torch.add(grad, 0, out=slot)``: the bits ``zero + grad`` gives, -0.0 included),
        later ones are added; a slot still stale when its bucket launches (a parameter without
        a gradient) is zeroed then. Padding and alignment gaps are zeroed when the region's
        gradient storage is allocated ([Note: gradient regions]) and never written by either,
        and the reduce-scatter leaves them the sum of zeros. What the reduce-scatter reads is
        what zeroing then adding gave, bit for bit.
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
        # Each bucket's (this rank's shard, whole bucket) of the grad buffer and each parameter's
        # slot, made once per allocation of a region's gradients (the hooks run per parameter).
        self._region_keys: dict[int, list[BucketKey]] = {}
        for k in self.order:
            self._region_keys.setdefault(k[0], []).append(k)
        self._region_params: dict[int, list[int]] = {}
        for i, (ri, _) in self.where.items():
            self._region_params.setdefault(ri, []).append(i)
        self._views: dict[BucketKey, tuple[torch.Tensor, torch.Tensor]] = {}
        self._slots: dict[int, torch.Tensor] = {}
        self._shapes = {i: p.shape for i, p in params.items()}
        self.handles: dict[BucketKey, Handle] = {}
        self.missing: dict[BucketKey, set[int]] = {}
        self.reset()  # the gradient storage waits for the first backward ([Note: gradient regions])
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
        self.stale = set(self.where)  # [Note: lazy gradient zeroing]
        self._views.clear()  # nothing in flight reads them any more: [Note: gradient regions]
        self._slots.clear()
        for rb in self.regions:
            rb.grad_buffer = None

    def _ensure(self, ri: int) -> None:
        """Region ``ri``'s gradient storage (allocated if released, its padding zero) and this
        window's views of it, [Note: gradient regions]. What the parameters' slots hold is
        undefined until written ([Note: lazy gradient zeroing])."""
        rb = self.regions[ri]
        if rb.grad_buffer is None:
            rb.grad_buffer = torch.empty(rb.layout.numel, dtype=rb.grad_dtype, device=rb.master.device)
            if rb.grad_gaps is not None:
                rb.grad_buffer.index_fill_(0, rb.grad_gaps, 0)
        grad = rb.grad_buffer
        for k in self._region_keys.get(ri, []):
            self._views[k] = (rb.shard(grad, k[1]), rb.bucket(grad, k[1]))
        for i in self._region_params.get(ri, []):  # shaped as the parameter: its gradient adds as is
            self._slots[i] = rb.grad_slot(i).view(self._shapes[i])

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self.accumulate(index, p)

        return hook

    def accumulate(self, index: int, p: torch.Tensor) -> None:
        # Runs for every parameter in every micro-batch: the host's time here is the step's
        # (docs/performance.md, section 15), so no work beyond the add itself.
        grad = p.grad
        if grad is None:
            return
        if grad.requires_grad:  # a create_graph backward: the bucket keeps values, not a graph
            grad = grad.detach()
        ri, keys = self.where[index]
        if self.handles and any(k in self.handles for k in keys):
            raise RuntimeError(
                f"a second gradient for parameter {index} arrived after its bucket's reduce-scatter "
                "started; accumulate micro-batches inside `with opt.no_sync():` (all but the last), "
                "or call opt.step()/opt.zero_grad() between backward passes"
            )
        slot = self._slots.get(index)
        if slot is None:
            self._ensure(ri)
            slot = self._slots[index]
        if index in self.stale:
            torch.add(grad, 0, out=slot)
            self.stale.discard(index)
        else:
            slot.add_(grad)
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
        if key not in self._views:  # a region no gradient reached: its zeros are reduced
            self._ensure(key[0])
        for i in self.bucket_params[key] & self.stale:  # no gradient this window: zero
            self._slots[i].zero_()
            self.stale.discard(i)
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
        # What ``wait`` hands to ``on_params_ready`` when every gather is waited at once (the
        # step without overlap_param_sync, or the first wait after it): worked out once here,
        # so that such a wait costs no Python per parameter.
        left = {key for key, _, _ in self._gathers}
        self._every_param: list[int] = []
        for key, _, _ in self._gathers:
            left.discard(key)
            self._every_param.extend(i for i in self.bucket_params.get(key, [])
                                     if not any(k in left for k in self.where[i][1]))

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
        if self.pending and len(self.pending) == len(self._gathers):
            for key in [key for key, _, _ in self._gathers]:
                self.pending.pop(key).wait()
            self.on_params_ready(self._every_param)
            return
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


class FlatEngine:
    """Bucket buffers, gradient and parameter sync of one optimizer's parameters on this rank.

    The parameters (flattened over param groups, ``group_of``: index -> param group) become
    views of the buffers here (same Parameter objects; a Float8Tensor keeps its wrapper and
    ``_scale_inv``, its ``_data`` is re-pointed). Arguments: as ``DistributedFusedAdam``'s.
    """

    def __init__(self, params: list[torch.Tensor], group_of: Mapping[int, int], num_groups: int, *,
                 device: torch.device, process_group: dist.ProcessGroup | None, bucket_cap_mb: float,
                 alignment: int, grad_sync_dtype: torch.dtype, state_dtype: torch.dtype,
                 overlap_grad_sync: bool, overlap_param_sync: bool, fp8_weight_scaling: ScalingMode,
                 delayed_scaling: DelayedScaling | None, fused: bool,
                 step_kernel: Literal["auto", "reference", "fused"], region_cap_mb: float = 256.0) -> None:
        self.params = params
        self.overlap_param_sync = overlap_param_sync
        self.comm = CommCounter()
        self.group = Group(process_group, self.comm)
        _check_backend(self.group, device)
        self.regions = _build_regions(params, self.group, device, bucket_cap_mb, alignment,
                                      grad_sync_dtype, state_dtype, region_cap_mb)
        fp8 = {i: p for i, p in enumerate(params) if isinstance(p, Float8Tensor)}
        self.fp8 = Fp8WeightScaler(fp8, fp8_weight_scaling, delayed_scaling, device)
        self._new_scale_inv = torch.zeros(self.fp8.num_slots, device=device)
        self._new_apply: torch.Tensor | None = None
        self._init_master_and_attach()
        params_by_index = dict(enumerate(params))
        self.grad_sync = GradSync(self.regions, params_by_index, self.group, overlap_grad_sync)
        self.param_sync = ParamSync(self.regions, self.group, self._on_params_ready)
        if step_kernel == "auto":  # [Note: step kernel], once
            fused = fused and not self.fp8.tiled and use_triton(self.regions[0].master)
            step_kernel = "fused" if fused else "reference"  # tiled FP8 weights: [Note: tiled weight casts]
        self.kernel: StepKernel = (FusedKernel(self.regions, group_of, self.fp8) if step_kernel == "fused"
                                   else FlatReferenceKernel(self.regions, group_of, num_groups, self.fp8))

    def _init_master_and_attach(self) -> None:
        hp: dict[int, torch.Tensor] = {}
        for i, p in enumerate(self.params):
            if isinstance(p, Float8Tensor):
                # Start the master from the preserved init value, not the FP8 bytes (TE 1121).
                init = p.get_high_precision_init_val()
                value = init if init is not None else p.dequantize(torch.float32)
                p.clear_high_precision_init_val()
            else:
                value = p.detach()
            hp[i] = value.to(self.regions[0].master.device, torch.float32).reshape(-1)
        params_by_index = dict(enumerate(self.params))
        for rb in self.regions:
            rb.init_master(hp)
            rb.attach(params_by_index)
        # (index, parameter, is FP8, where its bytes start in the buffer): ``begin_step`` checks
        # that each parameter still lives there.
        self._homes = [(i, p, isinstance(p, Float8Tensor),
                        (p._data if isinstance(p, Float8Tensor) else p).data_ptr())
                       for i, p in enumerate(self.params)]

    # ------------------------------------------------------------------ the step
    def begin_step(self) -> None:
        for index, p, fp8, ptr in self._homes:  # one pointer read per parameter
            if (p._data if fp8 else p).data_ptr() != ptr:
                raise RuntimeError(
                    f"parameter {index} no longer lives in the optimizer's buffer (its .data "
                    "was replaced, e.g. by model.to() or load_state_dict(assign=True)); copy "
                    "values in place (param.copy_) or build the optimizer afterwards")
        if self.overlap_param_sync and not self.param_sync.modules:
            raise RuntimeError("overlap_param_sync=True needs forward pre-hooks to wait for the "
                               "parameters: pass module=model or call opt.register_module(model)")
        self.param_sync.wait_all()  # the previous step's gathers, if overlap left them in flight

    def finish_grad_reduction(self) -> bool:
        self.grad_sync.finish()
        return self.grad_sync.dirty

    def launch_gathers(self, scale_inv: torch.Tensor | None, apply: torch.Tensor | None = None) -> None:
        """All-gather every bucket in place; wait unless ``overlap_param_sync``. The new scales
        land on the FP8 weights as their buckets arrive (``_on_params_ready``), where ``apply``
        holds (a step skipped on the device gathers the same bytes and keeps the scales)."""
        if scale_inv is not None:
            self._new_scale_inv, self._new_apply = scale_inv, apply
        self.param_sync.launch_all()
        if not self.overlap_param_sync:
            self.param_sync.wait_all()

    def wait_gathers(self) -> None:
        self.param_sync.wait_all()

    def _on_params_ready(self, indices: list[int]) -> None:
        fp8 = {i: self.params[i] for i in indices if isinstance(self.params[i], Float8Tensor)}
        if fp8:  # one batched copy for all of them (a launch per parameter would cost host time)
            self.fp8.set_scale_inv(fp8, self._new_scale_inv, self._new_apply)

    def reset_grads(self) -> None:
        if self.grad_sync.dirty or self.grad_sync.handles:
            self.grad_sync.reset()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes in here only accumulate into the buckets; the next one outside syncs."""
        before = self.grad_sync.enabled
        self.grad_sync.enabled = False
        try:
            yield
        finally:
            self.grad_sync.enabled = before

    # ------------------------------------------------------------------ checkpoints, accounting
    def sharded_states(self) -> dict[int, list[dict[str, Any]]]:
        return sharded_states(self.regions)

    def load_sharded_states(self, state: dict[int, list[dict[str, Any]]]) -> None:
        load_sharded_states(self.regions, state)

    def memory_report(self) -> dict[str, int]:
        """The buffers' storage by category (the weights included: parameters are views of it)."""
        out = dict.fromkeys(("fp8_weights", "other_weights", "grad_buffers", "master",
                             "optimizer_states", "padding"), 0)
        for rb in self.regions:
            for k, v in rb.nbytes().items():
                out[k] += v
        return out

    def close_comm_window(self) -> dict[str, int]:
        return self.comm.close_window()


def _build_regions(params: list[torch.Tensor], group: Group, device: torch.device, bucket_cap_mb: float,
                   alignment: int, grad_dtype: torch.dtype, state_dtype: torch.dtype,
                   region_cap_mb: float = 256.0) -> list[RegionBuffers]:
    if not grad_dtype.is_floating_point or not state_dtype.is_floating_point:
        raise ValueError(f"grad_sync_dtype and state_dtype must be floating point, got "
                         f"{grad_dtype} and {state_dtype}")
    if not (isinstance(bucket_cap_mb, (int, float)) and 0 < bucket_cap_mb < math.inf):
        raise ValueError(f"bucket_cap_mb must be a finite number > 0, got {bucket_cap_mb!r}")
    if isinstance(region_cap_mb, bool) or not (isinstance(region_cap_mb, (int, float)) and region_cap_mb > 0):
        raise ValueError(f"region_cap_mb must be a number > 0 (math.inf: one region per storage dtype), "
                         f"got {region_cap_mb!r}")
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be an int >= 1 (elements), got {alignment!r}")
    # Backward visits parameters roughly in reverse registration order: [Note: shard layout].
    order = reversed(list(enumerate(params)))
    specs = [ParamSpec(i, p.numel(), storage_dtype(p), shard_unit(p)) for i, p in order]
    elem = torch.empty(0, dtype=grad_dtype).element_size()
    region_numel = None if region_cap_mb == math.inf else max(1, int(region_cap_mb * 2**20 / elem))
    layouts = build_layout(specs, group.world_size, int(bucket_cap_mb * 2**20 / elem), alignment,
                           region_numel)
    return [RegionBuffers(lay, group.rank, device, grad_dtype, state_dtype) for lay in layouts]


def _check_backend(group: Group, device: torch.device) -> None:
    backend = getattr(group, "backend", None)
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"the process group uses NCCL but the parameters are on {device}; move the "
                         "model to this rank's GPU first, or use a gloo group for CPU training")
