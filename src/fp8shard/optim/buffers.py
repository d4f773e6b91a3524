"""The tensors behind one region of the layout: parameter bytes, gradients, master, Adam states.

[Note: bucket buffers]
    Per region (one storage dtype), all sized by ``RegionLayout`` ([Note: shard layout]):
      param_buffer  (numel,)        the parameters themselves: every parameter's ``.data`` (or, for
                                    a Float8Tensor, its ``_data``) is a view of its range, so the
                                    in-place all-gather of a bucket *is* the weight update.
                                    FP8 regions hold ``uint8`` (gloo has no float8 dtype).
      grad_buffer   (numel,)        gradients in ``grad_sync_dtype``; each bucket is reduce-scattered
                                    in place, so after the sync rank r's shard holds the mean.
                                    Its storage exists only from the backward's first gradient
                                    in the region to the end of the step ([Note: gradient regions]).
      master        (shard_numel,)  fp32, this rank's shards of all buckets, concatenated.
      exp_avg, exp_avg_sq           like master, in ``state_dtype``.
    Padding is zero everywhere and stays zero (zero grad, zero master, zero bytes); the gradient
    padding is zeroed again each time the gradient storage is allocated.

[Note: gradient regions]
    A gradient buffer that lived between steps would sit beside the forward's activations at
    their peak (at 1.3B: 2.6 GB of 35 GB, the backward's start), though nothing reads it there.
    So the gradient storage of a region is allocated when the backward first writes a gradient
    into the region and released when the gradients are consumed, after the
    step or at ``zero_grad`` (``grad_buffer`` is None then, and every view the engine made of
    it is dropped with it; they are made again for each allocation). ``GradSync`` owns that
    lifetime (flat.py: ``_ensure``, ``reset``). Regions are capped
    (``region_cap_mb``, [Note: shard layout]) so that the backward allocates them one after
    another as it reaches their parameters, not all at its first gradient; the step runs its
    kernels once per region, so the cap trades a few launches for that granularity. On the GPU
    the caching allocator serves the same blocks again each step (no cudaMalloc in steady state).
"""

from __future__ import annotations

import torch

from fp8shard.fp8 import Float8Tensor, Fp8Format
from fp8shard.optim.layout import RegionLayout, ShardPiece

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def storage_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype a parameter's bytes are stored in (the float8 dtype for a Float8Tensor)."""
    return p._data.dtype if isinstance(p, Float8Tensor) else p.dtype


def shard_unit(p: torch.Tensor) -> int:
    """Elements of ``p`` no shard boundary may cut ([Note: shard layout]): a row of a rowwise
    FP8 weight, a band of ``n`` rows of a blockwise one (all of it when shorter), else 1."""
    if not isinstance(p, Float8Tensor) or p.block is None:
        return 1
    rows, cols = p.shape
    return max(1, min(p.block[0], rows) * cols)


class RegionBuffers:
    """Buffers of one region for one rank; see [Note: bucket buffers]."""

    def __init__(self, layout: RegionLayout, rank: int, device: torch.device,
                 grad_dtype: torch.dtype, state_dtype: torch.dtype) -> None:
        self.layout = layout
        self.rank = rank
        self.dtype: torch.dtype = layout.key  # type: ignore[assignment]
        self.is_fp8 = self.dtype in FP8_DTYPES
        self.fmt: Fp8Format | None = Fp8Format.parse(self.dtype) if self.is_fp8 else None  # once
        buf_dtype = torch.uint8 if self.is_fp8 else self.dtype
        self.param_buffer = torch.zeros(layout.numel, dtype=buf_dtype, device=device)
        self.grad_dtype = grad_dtype
        # None while released: GradSync owns its lifetime ([Note: gradient regions]).
        self.grad_buffer: torch.Tensor | None = torch.zeros(layout.numel, dtype=grad_dtype, device=device)
        self.grad_gaps = _gaps(layout, device)  # elements no parameter covers: zeroed on allocation
        n = layout.shard_numel
        self.master = torch.zeros(n, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros(n, dtype=state_dtype, device=device)
        self.exp_avg_sq = torch.zeros(n, dtype=state_dtype, device=device)
        self.pieces: list[ShardPiece] = layout.pieces(rank)
        self.ranges = {r.index: r for r in layout.params}

    # ---------------------------------------------------------------- views
    def bucket(self, buf: torch.Tensor, b: int) -> torch.Tensor:
        bk = self.layout.buckets[b]
        return buf[bk.start:bk.end]

    def shard(self, buf: torch.Tensor, b: int) -> torch.Tensor:
        """This rank's shard of bucket ``b`` in a full-size buffer (param or grad)."""
        bk = self.layout.buckets[b]
        start = bk.shard_start(self.rank)
        return buf[start:start + bk.shard_numel]

    def local(self, buf: torch.Tensor, b: int) -> torch.Tensor:
        """Bucket ``b``'s part of a shard-size buffer (master, exp_avg, exp_avg_sq)."""
        off = self.layout.local_bucket_offset(b)
        return buf[off:off + self.layout.buckets[b].shard_numel]

    def grad_slot(self, index: int) -> torch.Tensor:
        r = self.ranges[index]
        return self.grad_buffer[r.start:r.end]

    def grad_shard_fp32(self) -> torch.Tensor:
        """This rank's (reduced) gradient shards, concatenated like ``master``, as fp32."""
        parts = [self.shard(self.grad_buffer, b.index) for b in self.layout.buckets]
        return torch.cat(parts).float() if parts else self.master.new_zeros(0)

    # ---------------------------------------------------------------- parameters
    def attach(self, params: dict[int, torch.Tensor]) -> None:
        """Copy each parameter into its range and make the parameter a view of it.

        A Float8Tensor keeps its wrapper object and ``_scale_inv``; only ``_data`` is re-pointed
        (the wrapper's shape is unchanged; its bytes become contiguous). Other parameters get a
        new ``.data``. Autograd and modules keep referring to the same Parameter objects.
        """
        for r in self.layout.params:
            p = params[r.index]
            dst = self.param_buffer[r.start:r.end]
            if self.is_fp8:
                dst.copy_(p.uint8_view().reshape(-1))
                p._data = dst.view(p._data.dtype).view(p.shape)
                p.mark_bytes_changed()
            else:
                dst.copy_(p.detach().reshape(-1))
                p.data = dst.view(p.shape)

    def init_master(self, hp_values: dict[int, torch.Tensor]) -> None:
        """Fill the master shard from each parameter's high-precision value (flattened fp32)."""
        for pc in self.pieces:
            src = hp_values[pc.param_index]
            self.master[pc.local_offset:pc.local_offset + pc.numel].copy_(
                src[pc.param_offset:pc.param_offset + pc.numel])

    def write_param_shards(self, lp_shard: torch.Tensor) -> None:
        """Copy a shard-size tensor (already in the buffer's dtype) into this rank's shards."""
        for b in self.layout.buckets:
            self.shard(self.param_buffer, b.index).copy_(self.local(lp_shard, b.index))

    # ---------------------------------------------------------------- accounting
    def nbytes(self) -> dict[str, int]:
        """Bytes by category; they add up to the buffers' storage sizes between the backward and
        the step (``grad_buffers`` is allocated only then, [Note: gradient regions])."""
        lay = self.layout
        p_elem, g_elem = self.param_buffer.element_size(), self.grad_dtype.itemsize
        owned = sum(pc.numel for pc in self.pieces)
        shard_pad = lay.shard_numel - owned
        s_elem = self.exp_avg.element_size()
        return {
            "fp8_weights" if self.is_fp8 else "other_weights": lay.param_numel * p_elem,
            "grad_buffers": lay.param_numel * g_elem,
            "master": owned * 4,
            "optimizer_states": owned * 2 * s_elem,
            "padding": lay.padding_numel * (p_elem + g_elem) + shard_pad * (4 + 2 * s_elem),
        }

    def tensors(self) -> list[torch.Tensor]:
        """The buffers' tensors (the gradients only while allocated)."""
        grads = [] if self.grad_buffer is None else [self.grad_buffer]
        return [self.param_buffer, *grads, self.master, self.exp_avg, self.exp_avg_sq]


def _gaps(layout: RegionLayout, device: torch.device) -> torch.Tensor | None:
    """Indices of the region's elements outside every parameter (alignment gaps, tail padding)."""
    parts, cursor = [], 0
    for r in sorted(layout.params, key=lambda r: r.start):
        if r.start > cursor:
            parts.append(torch.arange(cursor, r.start))
        cursor = max(cursor, r.end)
    if layout.numel > cursor:
        parts.append(torch.arange(cursor, layout.numel))
    return torch.cat(parts).to(device) if parts else None
