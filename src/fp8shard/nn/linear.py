"""``fp8shard.nn.Linear``: ``torch.nn.Linear`` whose three GEMMs run in FP8 under ``fp8_autocast``.

[Note: three GEMMs] (y = x·Wᵀ, dx = dy·W, dW = dyᵀ·x) in one ``autograd.Function``; operand
layouts for ``fp8_mm`` (first operand row-major, second column-major):

    forward  y  [T, out] = x_fp8 [T, in]            · (W_fp8 [out, in] row-major).t()
    dgrad    dx [T, in]  = dy_fp8 [T, out]          · (Wᵀ_fp8 [in, out] row-major).t()
    wgrad    dW [out, in] = dyᵀ_fp8 [out, T]        · (xᵀ_fp8 [in, T] row-major).t()

Inputs with leading batch dims are flattened to ``[T, in]``. The casts write the transposed
bytes (xᵀ, Wᵀ, dyᵀ) in the same pass ([Note: fused cast]); the backward keeps the FP8 bytes of
xᵀ (1 byte per element), never the high-precision x. A ``Float8Tensor`` weight goes into the
GEMMs as it is (its bytes and ``scale_inv``); its transposed bytes for dgrad come from
``Float8Tensor.fp8_transpose()``, made once per change of the bytes. Its gradient is a plain
tensor of the weight's nominal dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fp8shard.fp8.formats import Fp8Format
from fp8shard.fp8.fused import quantize_current, quantize_with_scale
from fp8shard.fp8.gemm import fp8_mm
from fp8shard.fp8.quantizer import AmaxHistory, is_tiled, parse_recipe
from fp8shard.fp8.scaling import DelayedScaling
from fp8shard.fp8.tensor import _NOMINAL_DTYPES, Float8Tensor
from fp8shard.nn.autocast import Fp8State, current_fp8_state
from fp8shard.nn.model_init import current_model_init
from fp8shard.nn.quantized_linear import forward_needs_grads, quantized_linear

# [Note: informed first call]
#     Under delayed scaling a cast uses the scale its layer's amax history gave; a layer whose
#     history is still empty has only the initial scale 1 (Transformer Engine's first step), an
#     uninformed cast (about 10 dB of output SQNR lost in benchmarks/bench_linear.py). So while
#     ``Linear._fp8_history_empty`` is set, the call casts as current scaling does (scale from
#     the amax of the tensor being cast, the same bytes: margin not applied) and records those
#     amaxes in history row 0, where the next scale update (``AmaxSync.step()``) turns them into
#     scales. The flag is a Python bool that the first delayed-scaling forward clears, once: under
#     torch.compile one recompilation, no host sync and no per-call data-dependent branch. Its
#     backward casts the output gradient the same way (the choice is made at forward). A loaded
#     state dict with a non-empty history (or non-unit scales) clears it; a dropped delayed-scaling
#     state sets it again. The overflow check ([Note: overflow check]) skips the layer at the
#     update after its first call (``_fp8_unscaled_since_update``): those casts did not use
#     ``fp8_scale`` and cannot have saturated. A layer called twice before the first update
#     casts the second call with the initial scales, as before.

# Slots of a layer's delayed-scaling state: one per GEMM operand.
SLOT_INPUT, SLOT_WEIGHT, SLOT_GRAD_OUTPUT = 0, 1, 2

# torch 2.11's Dynamo (2.12 untested) fails to trace _Fp8LinearFn (an AssertionError in its
# autograd.Function support) once a layer's delayed-scaling buffers were made by a graph break
# inside a compiled call; see Linear._ensure_delayed_state.
_STATE_IN_GRAPH_BREAKS_DYNAMO = torch.torch_version.TorchVersion(torch.__version__) < (2, 13)


def _quantize(t: torch.Tensor, fmt: Fp8Format, scales: torch.Tensor | None, slot: int,
              history: torch.Tensor | None, transpose: bool,
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """FP8 bytes of 2-D ``t``, bytes of ``t.t()`` (row-major) if ``transpose``, ``scale_inv``.

    Current scaling (``scales`` None): scale from amax(t). Delayed: the layer's scale for
    ``slot``. With a ``history`` (delayed, also its informed first call, [Note: informed first
    call]) amax(t) is recorded in ``history[0, slot]``. One fused cast ([Note: fused cast]).
    """
    if scales is None:
        cast = quantize_current(t, fmt, transpose=transpose)  # [Note: scale], current scaling
        if history is not None:  # the informed first call records what it saw
            row = history[0, slot]
            row.copy_(torch.maximum(row, cast.amax))
    else:
        assert history is not None
        cast = quantize_with_scale(t, scales[slot], fmt, transpose=transpose,
                                   amax_out=history[0, slot])
    return cast.data, cast.data_t, cast.scale_inv


def _weight_transpose(weight: Float8Tensor) -> torch.Tensor:
    """Row-major bytes of Wᵀ [in, out] in eager: cached until the bytes change (compile: see
    ``_Fp8LinearFn.forward``)."""
    return weight.fp8_transpose()


class _Fp8LinearFn(torch.autograd.Function):
    """x [.., in], W [out, in], b [out] or None -> x·Wᵀ + b with the three GEMMs of
    [Note: three GEMMs] in FP8; the bias is added in the forward GEMM's epilogue
    ([Note: bias epilogue]) and its gradient is the column sum of dy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                fwd_fmt: Fp8Format, bwd_fmt: Fp8Format,
                scales: torch.Tensor | None, history: torch.Tensor | None) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])  # [T, in]
        # The backward needs x only as xᵀ (wgrad) and W only as Wᵀ (dgrad): the casts write
        # those transposed bytes in the same pass, and only they are kept (1 byte/element).
        need_dgrad, need_wgrad = forward_needs_grads(ctx, x, weight)
        x_fp8, x_t, x_scale_inv = _quantize(x2d, fwd_fmt, scales, SLOT_INPUT, history, need_wgrad)
        if isinstance(weight, Float8Tensor):
            # Stored FP8 weights carry their own scale ([Note: weight scaling]): no new cast.
            w_fp8, w_t, w_scale_inv = weight._data, None, weight._scale_inv
            ctx.fp8_weight = weight
            if torch.compiler.is_compiling():
                # [Note: compile] The eager transpose cache lives in Python and changes every
                # optimizer step: under compile Wᵀ is traced from the bytes (one transpose,
                # 1 B read + 1 B written per element) and the wrapper is not kept on ctx (it
                # would enter the graph a second time, as an input of the backward).
                w_t = w_fp8.t().contiguous() if need_dgrad else None
                ctx.fp8_weight = None
        else:
            w_fp8, w_t, w_scale_inv = _quantize(weight, fwd_fmt, scales, SLOT_WEIGHT, history, need_dgrad)
            ctx.fp8_weight = None
        y = fp8_mm(x_fp8, x_scale_inv, w_fp8.t(), w_scale_inv, x.dtype, bias)  # [T, out]
        ctx.save_for_backward(x_t, x_scale_inv, w_t, w_scale_inv)
        # Not saved tensors: the amax step of a reused layer writes to them between uses.
        ctx.scales, ctx.history, ctx.bwd_fmt = scales, history, bwd_fmt
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_t, x_scale_inv, w_t, w_scale_inv = ctx.saved_tensors  # xᵀ [in, T], Wᵀ [in, out]
        dy2d = dy.reshape(-1, dy.shape[-1])  # [T, out]
        dy_fp8, dy_t, dy_scale_inv = _quantize(dy2d, ctx.bwd_fmt, ctx.scales, SLOT_GRAD_OUTPUT,
                                               ctx.history, ctx.needs_input_grad[1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if ctx.fp8_weight is not None:
                w_t = _weight_transpose(ctx.fp8_weight)
            dx = fp8_mm(dy_fp8, dy_scale_inv, w_t.t(), w_scale_inv, ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            # dyᵀ [out, T] row-major · (xᵀ [in, T] row-major).t(): [T, in] column-major.
            dw = fp8_mm(dy_t, dy_scale_inv, x_t.t(), x_scale_inv, ctx.w_dtype)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            # From dy, not its FP8 bytes; a 16-bit sum accumulates in fp32 and rounds once.
            same = dy2d.dtype == ctx.b_dtype
            db = dy2d.sum(0) if same else dy2d.sum(0, dtype=torch.float32).to(ctx.b_dtype)
        return dx, dw, db, None, None, None, None


class _LinearFromFp8Weight(torch.autograd.Function):
    """``F.linear(x, W, b)`` with W an FP8-stored weight, in high precision (a layer that does
    not compute in FP8, or a call outside ``fp8_autocast``): W is dequantized in the forward
    and again in the backward, so what the backward keeps of it is its FP8 bytes (1 B per
    weight, already stored), not a 16-bit copy per layer. The products are autograd's for
    ``F.linear`` of the dequantized weight, op for op (dx = dy·W, dW = (xᵀ·dy)ᵀ, db = the
    column sum of dy), in the dtype the forward computed in (the autocast's)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Float8Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(x, weight.dequantize(), bias)  # under autocast: in its dtype
        need_dgrad, need_wgrad = forward_needs_grads(ctx, x, weight)
        ctx.dtype, ctx.x_shape, ctx.w_dtype = y.dtype, x.shape, weight.dtype
        ctx.x_dtype, ctx.b_dtype = x.dtype, None if bias is None else bias.dtype
        # x only for dW, the weight only for dx (a frozen weight keeps no x)
        ctx.save_for_backward(x.to(y.dtype) if need_wgrad else None, weight if need_dgrad else None)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1]).to(ctx.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            # [Note: dequantize again] The forward's dequantize written with the product's
            # operands swapped (the same bits): as the same expression, a compiler's
            # common-subexpression pass merges the two, and the graph then keeps the forward's
            # 16-bit copy of every weight for the backward (seen in Inductor's graph, tested)
            # instead of the bytes.
            w = weight.dequantize(scale_first=True).to(ctx.dtype)
            dx = dy2d.mm(w).reshape(*ctx.x_shape[:-1], w.shape[1]).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = x.reshape(-1, x.shape[-1]).t().mm(dy2d).t().to(ctx.w_dtype)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2d.sum(0).to(ctx.b_dtype)
        return dx, dw, db


# [Note: grouped dequantize]
#     Under torch.compile a layer that computes in high precision from an FP8-stored weight
#     (``_LinearFromFp8Weight``) costs one small kernel to dequantize its weight in the forward
#     and one in the backward. In a GPT whose four projections all do so (the 125M GPT under
#     ``model.fp8_layers=auto``) that is 96 launches a step more than the bf16 model, and the
#     step is host-bound there (docs/performance.md, section 10). ``dequantize_weights`` takes
#     the layers of one block and, while compiling, dequantizes their per-tensor FP8 weights
#     together: one ``torch.cat`` of the four dequantized weights, which Inductor lowers to one
#     kernel (a pointwise cat: up to 8 inputs), inside an activation checkpoint whose ops are
#     all MUST_RECOMPUTE, so that the backward recomputes the cat from the bytes instead of
#     keeping the 16-bit copies (2 B per weight). A plain checkpoint is not enough: under
#     compile it only marks its ops PREFER_RECOMPUTE, and on CUDA with torch 2.11 the
#     partitioner kept every block's copies of the 125M GPT (its FP8 peak above bf16's by them,
#     H100). The checkpointed region
#     returns Wᵀ and each layer multiplies by it directly (``Linear.forward(x, dequantized_t=...)``,
#     ``_linear_t``: the addmm / mm that ``F.linear`` runs): given W and calling ``F.linear``,
#     the partitioner saved the transpose made outside the region. Same bits as the per-layer
#     path (tested: no 16-bit weight saved, one cat per block forward and backward), and the
#     weight's gradient reaches the ``Float8Tensor`` through ``_DequantizeGroup``'s identity
#     backward. Eager calls keep the per-layer path (the checkpoint would only add work there).


class _DequantizeGroup(torch.autograd.Function):
    """The per-tensor FP8 weights ``ws`` dequantized to ``dtype``, as one flat buffer split per
    weight ([Note: grouped dequantize]); the gradient of each goes to its weight as is (the
    value of a ``Float8Tensor`` is its dequantized value), in the weight's dtype."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *ws: Float8Tensor) -> tuple[torch.Tensor, ...]:
        ctx.weights = [(w.shape, w.dtype) for w in ws]
        flat = torch.cat([w.dequantize(dtype).reshape(-1) for w in ws])
        return flat.split([w.numel() for w in ws])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (None, *(None if g is None else g.view(s).to(d)
                        for g, (s, d) in zip(grads, ctx.weights, strict=True)))


def _transposed_weights(dtype: torch.dtype, *ws: Float8Tensor) -> list[torch.Tensor]:
    """Wᵀ of each of ``ws`` in ``dtype``: the checkpointed region ([Note: grouped dequantize])."""
    return [v.view(w.shape).t() for v, w in zip(_DequantizeGroup.apply(dtype, *ws), ws, strict=True)]


class _QuietRecompute(logging.Filter):
    """Drops torch's once-per-process warning that a checkpoint given a ``context_fn`` under
    torch.compile must hold no in-place op: the grouped dequantize's region holds none (a cat of
    dequantized weights), and the warning would reach every compiled training run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_QuietRecompute())


def _must_recompute(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def _always_recompute() -> tuple[object, object]:
    """The checkpoint's contexts: every op of the region recomputed in the backward, never saved
    ([Note: grouped dequantize]: a plain checkpoint only prefers recomputation, and the
    partitioner kept the 16-bit weights of the 125M GPT on the GPU)."""
    return create_selective_checkpoint_contexts(_must_recompute)


def _linear_t(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, wt.t(), bias)`` as ATen computes it (``addmm`` / ``mm`` on the rows of x),
    with ``wt`` itself the GEMM's operand: no transpose of the weight outside the checkpointed
    region, which the partitioner would save for the backward."""
    x2 = x.reshape(-1, x.shape[-1])
    y = x2.mm(wt) if bias is None else torch.addmm(bias, x2, wt)
    return y.view(*x.shape[:-1], wt.shape[1])


def _dequantizes(layer: Linear, state: Fp8State | None) -> bool:
    """Whether ``layer`` computes in high precision from a per-tensor FP8-stored weight."""
    w = getattr(layer, "weight", None)
    return (isinstance(layer, Linear) and isinstance(w, Float8Tensor) and w.block is None
            and (state is None or not layer.fp8_compute))


def dequantize_weights(layers: Sequence[Linear]) -> list[torch.Tensor | None]:
    """Wᵀ, dequantized, of each of ``layers`` that computes in high precision from a per-tensor
    FP8-stored weight, computed together while compiling ([Note: grouped dequantize]); None for
    the others, and for all of them eagerly or when fewer than two qualify. Pass each to its
    layer: ``layer(x, dequantized_t=wt)``."""
    out: list[torch.Tensor | None] = [None] * len(layers)
    if not torch.compiler.is_compiling():
        return out
    state = current_fp8_state()
    which = [i for i, layer in enumerate(layers) if _dequantizes(layer, state)]
    if len(which) < 2:
        return out
    weights = [layers[i].weight for i in which]
    # The dtype the GEMM runs in: the autocast's (F.linear would cast the weight to it), else the
    # weights' own; one group per dtype is all a model has.
    dtype = weights[0].dtype
    device_type = weights[0].device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    if any(w.dtype != weights[0].dtype for w in weights):
        return out
    wts = torch.utils.checkpoint.checkpoint(_transposed_weights, dtype, *weights, use_reentrant=False,
                                            preserve_rng_state=False, context_fn=_always_recompute)
    for i, wt in zip(which, wts, strict=True):
        out[i] = wt
    return out


def _check_fp8_weight_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and dtype not in _NOMINAL_DTYPES:
        raise TypeError(
            f"fp8shard.nn.Linear(dtype={dtype}) under fp8_model_init: an FP8 weight needs a "
            f"floating-point nominal dtype (float32, bfloat16 or float16) that its bytes stand "
            f"for; pass dtype=torch.bfloat16 (or leave dtype=None) -- FP8 storage is implied"
        )


class Linear(torch.nn.Linear):
    """Drop-in ``torch.nn.Linear`` (same constructor, init and state-dict keys).

    Under ``fp8_autocast`` its three GEMMs run in FP8 ([Note: three GEMMs]); elsewhere it is
    ``torch.nn.Linear`` (a ``Float8Tensor`` weight is dequantized). Built inside
    ``fp8_model_init`` its weight is stored as an E4M3 ``Float8Tensor``. Under ``DelayedScaling``
    the layer keeps its amax history and scales in buffers ``fp8_amax_history`` [len, 3] and
    ``fp8_scale`` [3] (input, weight, output gradient), created at first use and saved in the
    state dict; ``fs.nn.AmaxSync`` reduces and updates them ([Note: amax reduction] in
    nn/amax_sync.py; [Note: informed first call] for the first call).
    """

    # This layer's recipe, overriding the autocast's (None: the autocast's); a recipe object or
    # name, e.g. ``layer.fp8_recipe = fs.RowwiseScaling()`` ([Note: quantizer]).
    fp8_recipe: object = None
    # False: this layer computes in high precision even under fp8_autocast, its weight still
    # stored in FP8 if it is ([Note: FP8 layer filter], nn/gemm_filter.py).
    fp8_compute: bool = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        init_state = current_model_init()
        if init_state is not None:
            _check_fp8_weight_dtype(dtype)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._amax_state: AmaxHistory | None = None
        self._fp8_history_empty = True  # [Note: informed first call]
        self._fp8_unscaled_since_update = False  # its first call ran since the last amax update
        self._fp8_monitors: tuple = ()  # the open OverflowMonitors watching it ([Note: overflow check])
        self._preserve_hp_init = bool(init_state and init_state.preserve_high_precision_init_val)
        if init_state is not None:
            self._store_weight_as_fp8(init_state.recipe)

    # ------------------------------------------------------------------ FP8 weight storage
    def _store_weight_as_fp8(self, recipe: object) -> None:
        """Replace the high-precision weight by an E4M3 Float8Tensor scaled from its amax (per
        row or block under a rowwise or blockwise ``recipe``)."""
        hp = self.weight.detach()
        fp8 = Float8Tensor.quantize(hp, Fp8Format.E4M3, recipe=recipe)  # first scales: the init amax
        # Parameter() wraps a detached alias, so the init value is attached to the parameter.
        self.weight = torch.nn.Parameter(fp8, requires_grad=self.weight.requires_grad)
        if self._preserve_hp_init and hp.device.type != "meta":
            self.weight.set_high_precision_init_val(hp)

    def reset_parameters(self) -> None:
        """``nn.Linear``'s init; a Float8Tensor weight is re-quantized from the new hp values."""
        weight = self.__dict__.get("_parameters", {}).get("weight")
        if not isinstance(weight, Float8Tensor):
            super().reset_parameters()
            return
        self.weight = torch.nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device=weight.device))
        try:
            super().reset_parameters()  # the same values nn.Linear would draw
            hp = self.weight.detach()
        finally:
            self.weight = weight
        with torch.no_grad():
            weight.quantize_(hp)
        if self._preserve_hp_init:
            weight.set_high_precision_init_val(hp)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, dequantized_t: torch.Tensor | None = None) -> torch.Tensor:
        """``dequantized_t``: Wᵀ of this layer's FP8-stored weight as ``dequantize_weights`` gave
        it ([Note: grouped dequantize]); the layer computes ``F.linear``'s ops with it."""
        if dequantized_t is not None:
            return _linear_t(x, dequantized_t, self.bias)
        state = current_fp8_state()
        if state is None or not self.fp8_compute:
            if isinstance(self.weight, Float8Tensor):
                return _LinearFromFp8Weight.apply(x, self.weight, self.bias)
            return F.linear(x, self.weight, self.bias)
        return self._forward_fp8(x, state)

    def _forward_fp8(self, x: torch.Tensor, state: Fp8State) -> torch.Tensor:
        recipe = state.recipe if self.fp8_recipe is None else parse_recipe(self.fp8_recipe)
        weight = self.weight
        if is_tiled(recipe) or (isinstance(weight, Float8Tensor) and weight.block is not None):
            # rowwise, blockwise: through their quantizer (which checks a stored weight's tiles)
            return quantized_linear(x, weight, self.bias, recipe)
        scales = history = None
        if isinstance(recipe, DelayedScaling):
            self._ensure_delayed_state(recipe)
            history = self.fp8_amax_history
            if self._fp8_history_empty:  # [Note: informed first call]: cast as current scaling
                self._fp8_history_empty = False
                self._fp8_unscaled_since_update = True  # nothing for the overflow check to see
            else:
                scales = self.fp8_scale
        fmt = recipe.fp8_format
        return _Fp8LinearFn.apply(x, self.weight, self.bias, fmt.fwd, fmt.bwd, scales, history)

    # ------------------------------------------------------------------ delayed-scaling state
    def init_delayed_scaling(self, recipe: DelayedScaling) -> None:
        """Create now the delayed-scaling state the first forward under ``recipe`` would create.

        What ``prepare_delayed_scaling`` calls on every layer of a model before it is compiled.
        """
        if not isinstance(recipe, DelayedScaling):
            raise TypeError(f"init_delayed_scaling takes a DelayedScaling recipe, "
                            f"got {type(recipe).__name__}")
        self._ensure_delayed_state(recipe)

    def _ensure_delayed_state(self, recipe: DelayedScaling) -> None:
        if self._amax_state is None or self._amax_state.recipe != recipe:
            if _STATE_IN_GRAPH_BREAKS_DYNAMO and torch.compiler.is_compiling():
                # Not a graph break through _init_delayed_state (what torch 2.13 takes): an
                # exception raised while tracing makes Dynamo run this call's frame eagerly,
                # state made as in eager, and later calls compile. Under fullgraph=True this is
                # the error the caller sees.
                raise RuntimeError(
                    "fs.nn.Linear: this layer's delayed-scaling state does not exist yet and "
                    f"torch {torch.__version__}'s Dynamo cannot compile the layer around its "
                    "creation; call fs.nn.prepare_delayed_scaling(model, recipe) before "
                    "torch.compile (trainer.compile=true does)")
            if torch.compiler.is_compiling():
                # A graph break: the state is made eagerly (buffers made inside a graph and
                # written by its backward cannot be compiled). Disabled here, not by a decorator:
                # torch.compiler.disable imports Dynamo, about a second of importing fp8shard.
                torch.compiler.disable(self._init_delayed_state)(recipe)
            else:
                self._init_delayed_state(recipe)

    def _init_delayed_state(self, recipe: DelayedScaling) -> None:
        """Create (or adapt to a new recipe) the amax history and scales of the three operands.

        Runs eagerly even inside ``torch.compile`` (one graph break and one recompilation, at
        the first call only; ``fullgraph=True`` refuses it): buffers made inside a graph and
        written by its backward cannot be compiled. ``prepare_delayed_scaling(model, recipe)``
        before compiling makes the state beforehand: no break ([Note: compile]).
        """
        device = self.weight.device
        fmt = recipe.fp8_format
        fmt_max = torch.tensor([fmt.fwd.max, fmt.fwd.max, fmt.bwd.max], device=device)
        state = AmaxHistory(3, recipe, fmt_max, device=device)
        old_hist = getattr(self, "fp8_amax_history", None)
        if old_hist is not None and old_hist.shape == state.history.shape:
            state.history, state.scale = old_hist, self.fp8_scale  # loaded or same-length recipe
        else:
            if old_hist is not None:
                state.scale.copy_(self.fp8_scale)  # a new window length keeps the scales only
            self.register_buffer("fp8_amax_history", state.history)
            self.register_buffer("fp8_scale", state.scale)
        self._amax_state = state

    def update_fp8_scales(self) -> None:
        """New scales from the (already reduced) amax window, then roll it ([Note: scale])."""
        state = self._amax_state
        assert state is not None, "update_fp8_scales before any delayed-scaling forward"
        # Point the AmaxHistory at the buffers (Module.to() may have replaced them) and write
        # its results back in place, so tensors captured by a pending backward stay live.
        state.history, state.scale = self.fp8_amax_history, self.fp8_scale
        state.fmt_max = state.fmt_max.to(state.history.device)
        state.update()
        self.fp8_amax_history.copy_(state.history)
        self.fp8_scale.copy_(state.scale)
        state.history, state.scale = self.fp8_amax_history, self.fp8_scale

    # ------------------------------------------------------------------ state dict
    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        self._check_loaded_weight_shape(state_dict.get(prefix + "weight"))
        hist = state_dict.get(prefix + "fp8_amax_history")
        mine = getattr(self, "fp8_amax_history", None)
        if hist is not None and (mine is None or mine.shape != hist.shape):
            # Make room for the saved delayed-scaling state; the recipe is matched at first use.
            self.register_buffer("fp8_amax_history", torch.zeros(hist.shape, device=self.weight.device))
            self.register_buffer("fp8_scale", torch.ones(3, device=self.weight.device))
            self._amax_state = None
        elif hist is None and getattr(self, "fp8_amax_history", None) is not None:
            # Amaxes of other weights would give bogus scales (TransformerEngine 567): start over.
            del self.fp8_amax_history, self.fp8_scale
            self._amax_state = None
            self._fp8_history_empty = True
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        scale = state_dict.get(prefix + "fp8_scale")
        if hist is not None and hist.device.type != "meta":
            # [Note: informed first call]: a loaded history or scale is information, not a start
            # (one host sync per layer, at load time).
            with torch.no_grad():
                informed = bool((hist != 0).any()) or (scale is not None and bool((scale != 1).any()))
            self._fp8_history_empty = not informed

    def _check_loaded_weight_shape(self, weight: torch.Tensor | None) -> None:
        if weight is None or tuple(weight.shape) == tuple(self.weight.shape):
            return
        kind = "FP8 (Float8Tensor)" if isinstance(weight, Float8Tensor) else "high-precision"
        raise ValueError(
            f"cannot load a {kind} weight of shape {tuple(weight.shape)} into fp8shard.nn.Linear("
            f"in_features={self.in_features}, out_features={self.out_features}) whose weight is "
            f"{tuple(self.weight.shape)} [out_features, in_features]: build the layer as Linear("
            f"{weight.shape[-1]}, {weight.shape[0]}) or load the matching checkpoint"
        )

    def extra_repr(self) -> str:
        compute = "" if self.fp8_compute else ", fp8_compute=False"
        return f"{super().extra_repr()}, fp8_weight={isinstance(self.weight, Float8Tensor)}{compute}"


def prepare_delayed_scaling(model: torch.nn.Module, recipe: object) -> int:
    """Give every ``fs.nn.Linear`` of ``model`` its delayed-scaling state for ``recipe`` now.

    A layer makes this state (amax history and scales, buffers of the state dict) at its first
    forward under a ``DelayedScaling`` recipe, outside the graph when compiled: one graph
    break on the first call. Call this before ``torch.compile`` (``fullgraph=True`` needs it)
    to make it beforehand; values are those of a fresh layer (scales 1, empty history, so the
    first call is still an informed one, [Note: informed first call]): the run is the same.
    The amaxes are reduced by ``fs.nn.AmaxSync`` ([Note: amax reduction]), prepared or not. A
    ``CurrentScaling`` (or None) recipe has no state: nothing to do. Returns the number of
    layers prepared.
    """
    if not isinstance(recipe, DelayedScaling):
        return 0
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.fp8_compute]
    for layer in layers:
        layer.init_delayed_scaling(recipe)
    return len(layers)
