"""The three GEMMs of ``fs.nn.Linear`` through any quantizer ([Note: quantizer]).

One ``autograd.Function`` for every recipe a ``Quantizer`` describes; the operands follow
[Note: three GEMMs], each cast along its own contraction dim:

    forward  y  [T, out] = gemm(x [T, in],    W  [out, in])    x: rows,  W: rows
    dgrad    dx [T, in]  = gemm(dy [T, out],  Wᵀ [in, out])    dy: rows, W: cols
    wgrad    dW [out, in] = gemm(dyᵀ [out, T], xᵀ [in, T])     dy: cols, x: cols

``quantize(.., rows, cols)`` makes the operands of x (and Wᵀ) in the forward, so the backward
keeps xᵀ and Wᵀ as FP8 bytes with their scales (1 byte per element plus one fp32 per tile),
never the high-precision x. Activations and gradients are current-scaled.

[Note: tiled FP8 weights]
    A weight stored as a rowwise or blockwise ``Float8Tensor`` (``fp8_model_init(recipe=...)``,
    ``model.fp8_params=true``) enters the forward GEMM as it is: its bytes and its scale grid,
    no re-quantization. dgrad needs the operand Wᵀ, scaled along W's rows: a 128x128 block of
    Wᵀ is the transpose of a block of W, so blockwise takes the cached transposed bytes
    (``fp8_transpose()``) and the transposed scale grid, exactly; rowwise scales run along the
    wrong axis for Wᵀ, so Wᵀ is re-quantized per row of Wᵀ (per column of W) from the
    dequantized weight in the forward (one more rounding of a value already in FP8, for dgrad
    only; the backward keeps those bytes, not the weight). The layer's recipe must match the
    weight's: a per-tensor weight under a tiled recipe, or the other way, is refused.

Today rowwise and blockwise recipes run here; per-tensor current and delayed scaling run in
``nn/linear.py``'s ``_Fp8LinearFn`` (delayed scaling keeps per-layer amax state there).
``TensorwiseQuantizer`` through this function gives the same bytes and results as that path
for current scaling (tested), so moving it here is a one-line change.
"""

from __future__ import annotations

import torch

from fp8shard.fp8.formats import Fp8Format
from fp8shard.fp8.quantizer import (
    Fp8Operand,
    Quantizer,
    TensorwiseQuantizer,
    parse_recipe,
    quantizer_for,
)
from fp8shard.fp8.scaling import Recipe
from fp8shard.fp8.tensor import Float8Tensor
from fp8shard.fp8.tiled import RowwiseQuantizer


def forward_needs_grads(ctx, x: torch.Tensor, weight: torch.Tensor) -> tuple[bool, bool]:
    """(dgrad, wgrad): whether an FP8 linear Function's forward must keep what the backward needs
    for dx and for dW. Under ``torch.compile`` from ``requires_grad`` (a superset of
    ``ctx.needs_input_grad``, so nothing is missing): reading ``ctx.needs_input_grad`` inside
    the forward breaks torch 2.11's tracing of the Function (seen on the GPU: an
    ``AssertionError`` in Dynamo's ``overwrite_tensor_vt_proxy``, with a Float8Tensor weight)."""
    if torch.compiler.is_compiling():
        return x.requires_grad, weight.requires_grad
    return ctx.needs_input_grad[0], ctx.needs_input_grad[1]


def _pack(op: Fp8Operand | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (None, None) if op is None else (op.data, op.scale_inv)


class _QuantizedLinearFn(torch.autograd.Function):
    """x [.., in], W [out, in], b [out] or None -> x·Wᵀ + b, three GEMMs through ``quantizer``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                quantizer: Quantizer, fwd_fmt: Fp8Format, bwd_fmt: Fp8Format) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])  # [T, in]
        need_dgrad, need_wgrad = forward_needs_grads(ctx, x, weight)
        x_op, xt_op = quantizer.quantize(x2d, fwd_fmt, "activation", rows=True, cols=need_wgrad)
        ctx.fp8_weight = None
        if isinstance(weight, Float8Tensor):
            _check_fp8_weight(quantizer, weight)
            # A stored FP8 weight is its own operand ([Note: tiled FP8 weights]).
            w_op, wt_op = Fp8Operand(weight._data, weight._scale_inv, weight.block), None
            if need_dgrad and isinstance(quantizer, RowwiseQuantizer):
                _, wt_op = quantizer.quantize(weight.dequantize(torch.float32), fwd_fmt, "weight",
                                              rows=False, cols=True)
            elif need_dgrad and torch.compiler.is_compiling():
                # [Note: compile] No Python transpose cache in a graph: Wᵀ traced from the bytes.
                wt_op = _transposed(weight._data.t().contiguous(), weight)
            elif need_dgrad:
                ctx.fp8_weight = weight
        else:
            w_op, wt_op = quantizer.quantize(weight, fwd_fmt, "weight", rows=True, cols=need_dgrad)
        assert x_op is not None and w_op is not None
        y = quantizer.gemm(x_op, w_op, x.dtype, bias)  # [T, out]
        ctx.save_for_backward(*_pack(xt_op), *_pack(wt_op))
        ctx.xt_block = None if xt_op is None else xt_op.block
        ctx.wt_block = None if wt_op is None else wt_op.block
        ctx.quantizer, ctx.bwd_fmt = quantizer, bwd_fmt
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xt_data, xt_scale_inv, wt_data, wt_scale_inv = ctx.saved_tensors
        q: Quantizer = ctx.quantizer
        dy2d = dy.reshape(-1, dy.shape[-1])  # [T, out]
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy_op, dyt_op = q.quantize(dy2d, ctx.bwd_fmt, "activation", rows=need_dgrad, cols=need_wgrad)
        dx = dw = db = None
        if need_dgrad:
            if ctx.fp8_weight is not None:  # per tensor, or blockwise: the cached transposed bytes
                wt_op = _transposed(ctx.fp8_weight.fp8_transpose(), ctx.fp8_weight)
            else:
                wt_op = Fp8Operand(wt_data, wt_scale_inv, ctx.wt_block)
            dx = q.gemm(dy_op, wt_op, ctx.x_dtype).reshape(ctx.x_shape)  # type: ignore[arg-type]
        if need_wgrad:
            xt_op = Fp8Operand(xt_data, xt_scale_inv, ctx.xt_block)
            dw = q.gemm(dyt_op, xt_op, ctx.w_dtype)  # type: ignore[arg-type]  # [out, in]
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            # From dy, not its FP8 bytes; a 16-bit sum accumulates in fp32 and rounds once.
            same = dy2d.dtype == ctx.b_dtype
            db = dy2d.sum(0) if same else dy2d.sum(0, dtype=torch.float32).to(ctx.b_dtype)
        return dx, dw, db, None, None, None


def _transposed(data_t: torch.Tensor, w: Float8Tensor) -> Fp8Operand:
    """Wᵀ of a per-tensor or blockwise stored weight: its transposed bytes and scale grid."""
    return Fp8Operand(data_t, w._scale_inv if w.block is None else w._scale_inv.t().contiguous(), w.block)


def _check_fp8_weight(quantizer: Quantizer, weight: Float8Tensor) -> None:
    want = None if isinstance(quantizer, TensorwiseQuantizer) else quantizer.block("weight", weight.shape)
    if weight.block != want:
        have = "per-tensor" if weight.block is None else f"{weight.block} tiles"
        raise ValueError(
            f"fs.nn.Linear: the {quantizer.name} recipe needs its FP8-stored weight scaled "
            f"{'per tensor' if want is None else f'in {want} tiles'}, this one has {have} scales "
            "([Note: tiled FP8 weights]); build the model inside fp8_model_init(recipe=...) with "
            "the recipe it computes under (training command: the same model.fp8_recipe)")


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     recipe: Recipe | str) -> torch.Tensor:
    """``x·Wᵀ + b`` with the three GEMMs in FP8 under ``recipe`` (current scaling per cast)."""
    recipe = parse_recipe(recipe)
    fmt = recipe.fp8_format
    return _QuantizedLinearFn.apply(x, weight, bias, quantizer_for(recipe), fmt.fwd, fmt.bwd)
