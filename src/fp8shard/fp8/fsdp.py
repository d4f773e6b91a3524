"""Float8Tensor under FSDP2 (``fully_shard``): the all-gather moves FP8 bytes, never bf16.

[Note: FSDP2 extension]
    FSDP2 shards each parameter on dim 0 and keeps this rank's rows as the local tensor of a
    DTensor; for a Float8Tensor weight that local tensor is itself a Float8Tensor (the ops it
    needs to stay FP8 -- ``split``, ``slice``, ``new_zeros``, ``new_empty`` -- are in
    ``fp8/ops.py``), so a rank holds 1 byte per element of its shard plus the fp32 scale.
    Before an all-gather FSDP2 asks the local tensor for its all-gather inputs
    (``fsdp_pre_all_gather``): we hand it the padded shard's bytes as ``uint8`` (gloo has no
    float8 dtype; NCCL takes uint8 as well) and the scale as metadata. The scale is the same on
    every rank ([Note: weight scaling]: the optimizer derives it from the global amax), so it is
    not gathered. After the all-gather FSDP2 hands back the gathered ``uint8`` buffer
    (``fsdp_post_all_gather``) and we wrap it as the unsharded Float8Tensor: no copy, no
    high-precision round trip. On later all-gathers FSDP2 passes the unsharded tensor it got the
    first time as ``out``: the bytes are already in its storage, only the scale is refreshed and
    the cached transpose dropped.

    Torch versions: torch >= 2.5 (2.11 and 2.13 included) call
    ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` and expect the
    inputs padded to the padded shard size on ranks with fewer rows; torch 2.4 called it with
    ``mesh`` alone. ``fsdp_pre_all_gather`` below takes the later arguments as optional, so it
    serves both: FSDP2 counts the parameters of the bound method (1 or 5) to decide which form
    to call, and the padded size is derived from the bytes' storage when ``outer_size`` is
    absent. ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)`` is the same in
    every version that has the extension.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from fp8shard.fp8.formats import Fp8Format

if TYPE_CHECKING:
    from fp8shard.fp8.tensor import Float8Tensor


def _padded_rows(t: Float8Tensor, mesh: Any, outer_size: torch.Size | None) -> int:
    """Rows of the padded shard FSDP2 all-gathers: ``ceil(global rows / shard world size)``."""
    if outer_size is not None and len(outer_size) > 0:
        return math.ceil(outer_size[0] / mesh.size())
    # torch 2.4's one-argument call: the shard is a narrow of the padded buffer FSDP2 allocated.
    row = max(1, math.prod(t.shape[1:]))
    return t._data.untyped_storage().nbytes() // row


def pre_all_gather(t: Float8Tensor, mesh: Any, outer_size: torch.Size | None = None
                   ) -> tuple[tuple[torch.Tensor, ...], tuple[Any, ...]]:
    """(all-gather inputs, metadata): the padded shard's bytes as ``uint8`` and the scale."""
    data = t._data
    rows = _padded_rows(t, mesh, outer_size)
    padded_shape = (rows, *data.shape[1:])
    if tuple(data.shape) != padded_shape:
        # This rank's shard is shorter than the padded size (uneven sharding, the last ranks).
        # FSDP2 keeps it as a narrow of a padded buffer: view the whole buffer when it is there
        # (no copy), else pad a copy (the padding is never read after the gather).
        stride = torch._prims_common.make_contiguous_strides_for(padded_shape)
        need = data.storage_offset() + math.prod(padded_shape)
        if data.is_contiguous() and data.untyped_storage().nbytes() >= need:
            data = data.as_strided(padded_shape, stride, data.storage_offset())
        else:
            padded = data.new_zeros(padded_shape)
            padded[:data.shape[0]].copy_(data)
            data = padded
    return (data.view(torch.uint8),), (t._scale_inv, t._fp8_format)


def post_all_gather(t: Float8Tensor, outputs: tuple[torch.Tensor, ...], metadata: tuple[Any, ...],
                    param_dtype: torch.dtype, out: Float8Tensor | None = None
                    ) -> tuple[Float8Tensor, tuple[torch.Tensor, ...]] | None:
    """The unsharded Float8Tensor over the gathered bytes (first call), or refresh ``out``."""
    from fp8shard.fp8.tensor import Float8Tensor

    (gathered,) = outputs
    scale_inv, fmt = metadata
    fmt = Fp8Format.parse(fmt)
    if out is not None:
        # The gathered bytes already sit in out's storage (FSDP2 re-allocates the same buffer).
        # A new scale tensor, not copy_: the backward of the forward that used the old one may
        # have saved it (the re-gather before backward would bump its version).
        out._scale_inv = scale_inv.detach().clone()
        out.mark_bytes_changed()  # drops the cached transpose of the previous bytes
        return None
    data = gathered.view(fmt.torch_dtype)  # 1-D [padded rows x row] bytes, no copy
    dtype = param_dtype if param_dtype is not None and param_dtype.is_floating_point else t.dtype
    # A scale tensor of its own: the unsharded weight outlives this step's local scale updates
    # only through the copy above, so the GEMMs always read the scale that came with the bytes.
    unsharded = Float8Tensor(data, scale_inv.detach().clone(), fmt, dtype)
    return unsharded, (data,)
