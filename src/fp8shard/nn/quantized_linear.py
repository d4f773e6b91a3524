"""The three GEMMs of ``fs.nn.Linear`` through any quantizer ([Note: quantizer]).

One ``autograd.Function`` for every recipe a ``Quantizer`` describes; the operands follow
[Note: three GEMMs], each cast along its own contraction dim:

    forward  y  [T, out] = gemm(x [T, in],    W  [out, in])    x: rows,  W: rows
    dgrad    dx [T, in]  = gemm(dy [T, out],  Wᵀ [in, out])    dy: rows, W: cols
    wgrad    dW [out, in] = gemm(dyᵀ [out, T], xᵀ [in, T])     dy: cols, x: cols

``quantize(.., rows, cols)`` makes the operands of x (and Wᵀ) in the forward, so the backward
keeps xᵀ and Wᵀ as FP8 bytes with their scales (1 byte per element plus one fp32 per tile),
never the high-precision x. Activations and gradients are current-scaled.

Today rowwise and blockwise recipes run here; per-tensor current and delayed scaling run in
``nn/linear.py``'s ``_Fp8LinearFn`` (delayed scaling keeps per-layer amax state there).
``TensorwiseQuantizer`` through this function gives the same bytes and results as that path
for current scaling (tested), so moving it here is a one-line change.
"""

from __future__ import annotations

import torch

from fp8shard.fp8.formats import Fp8Format
from fp8shard.fp8.quantizer import Fp8Operand, Quantizer, TensorwiseQuantizer, parse_recipe, quantizer_for
from fp8shard.fp8.scaling import Recipe
from fp8shard.fp8.tensor import Float8Tensor


def _pack(op: Fp8Operand | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (None, None) if op is None else (op.data, op.scale_inv)


class _QuantizedLinearFn(torch.autograd.Function):
    """x [.., in], W [out, in], b [out] or None -> x·Wᵀ + b, three GEMMs through ``quantizer``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                quantizer: Quantizer, fwd_fmt: Fp8Format, bwd_fmt: Fp8Format) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])  # [T, in]
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x_op, xt_op = quantizer.quantize(x2d, fwd_fmt, "activation", rows=True, cols=need_wgrad)
        ctx.fp8_weight = None
        if isinstance(weight, Float8Tensor):
            _check_fp8_weight(quantizer)
            # A stored FP8 weight is its own per-tensor operand ([Note: weight scaling]).
            w_op, wt_op = Fp8Operand(weight._data, weight._scale_inv, None), None
            ctx.fp8_weight = weight if need_dgrad else None
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
            if ctx.fp8_weight is not None:
                wt_op = Fp8Operand(ctx.fp8_weight.fp8_transpose(), ctx.fp8_weight._scale_inv, None)
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


def _check_fp8_weight(quantizer: Quantizer) -> None:
    if not isinstance(quantizer, TensorwiseQuantizer):
        raise NotImplementedError(
            f"fs.nn.Linear: the {quantizer.name} recipe with an FP8-stored weight (fp8_model_init, "
            "model.fp8_params=true) is not supported yet: the stored Float8Tensor carries one "
            f"per-tensor scale, not {quantizer.name} scales. Build the model without "
            "fp8_model_init (training command: model.fp8_params=false), or use a per-tensor "
            "recipe (delayed, current)")


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     recipe: Recipe | str) -> torch.Tensor:
    """``x·Wᵀ + b`` with the three GEMMs in FP8 under ``recipe`` (current scaling per cast)."""
    recipe = parse_recipe(recipe)
    fmt = recipe.fp8_format
    return _QuantizedLinearFn.apply(x, weight, bias, quantizer_for(recipe), fmt.fwd, fmt.bwd)
