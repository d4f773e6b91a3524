"""Float8Tensor: FP8 bytes plus a scale, acting as a high-precision tensor.

[Note: Float8Tensor]
    A Float8Tensor holds ``_data`` (a ``torch.float8_*`` tensor, one byte per element) and
    ``_scale_inv`` (fp32); its value is ``_data.float() * _scale_inv`` in the nominal ``dtype``
    it reports (fp32, bf16 or fp16). ``_block`` says what one scale covers: None, one 0-d
    scale for the whole tensor (per-tensor recipes); ``(1, cols)`` for a rowwise weight
    (``_scale_inv`` [rows, 1]); ``(n, n)`` for a blockwise one ([ceil(rows/n), ceil(cols/n)]),
    the scale of each tile multiplying its bytes ([Note: quantizer]). Such tiled weights are
    2-D. The ops that keep a tiled tensor FP8 are those that keep its scale grid: ``detach``,
    ``alias``, ``clone``, ``copy_``, ``.to()``, ``empty_like`` and views to its own shape, and
    those that keep whole tiles, which FSDP2's sharding uses ([Note: FP8 tiled slices]: dim-0
    slices cut on tile rows, ``new_zeros`` with its columns, a flat ``view(-1)`` that remembers
    ``tile_shape``); transposes, reshapes to another shape, other ``as_strided``, slices and
    ``new_zeros`` would put bytes under another tile's scale, so they run on the dequantized
    value (plain tensor out), like any op not listed. Wrappers that share bytes (``detach``, views,
    ``nn.Parameter``) share the same ``_scale_inv`` tensor and the same ``_Fp8Meta``, so a change
    of bytes or scale through one is seen by all. Op semantics live in ``fp8shard.fp8.ops``:
    view-like ops stay FP8, in-place ops dequantize -> apply -> re-quantize into the same bytes,
    every other op runs on the dequantized value. The transposed copy of the bytes that the
    backward GEMM needs is cached in the meta and dropped whenever the bytes change.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from fp8shard.fp8.formats import Fp8Format
from fp8shard.fp8.fused import quantize_current, quantize_with_scale
from fp8shard.fp8.quantizer import cast_from_fp8
from fp8shard.fp8.tiled import mul_tiles, quantize_tiles, weight_block

_NOMINAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class _Fp8Meta:
    """State shared by every wrapper of the same bytes: a generation count and caches."""

    __slots__ = ("generation", "transposes")

    def __init__(self) -> None:
        self.generation = 0
        self.transposes: dict[tuple, tuple[int, int, torch.Tensor]] = {}

    def bytes_changed(self) -> None:
        self.generation += 1
        self.transposes.clear()


def _check_scale(scale: Any, x: torch.Tensor, check_device_value: bool = True) -> torch.Tensor:
    """``scale`` as an fp32 0-d tensor on ``x``'s device, refused unless finite and > 0.

    [Note: scale checks]
        A scale of 0, a negative one or a non-finite one would store NaN bytes or a negative
        or infinite ``scale_inv``, and every later use of the tensor would be silently wrong, so
        the public entries refuse it with a ValueError naming ``scale``. A Python number and a
        CPU tensor are checked on the host for free. Reading a CUDA tensor's value costs a host
        sync: ``Float8Tensor.quantize`` (construction, off the hot path) pays it;
        ``quantize_`` (in-place re-quantization, called every step by training code) does not
        (``check_device_value=False``) -- a CUDA scale there is the caller's to keep valid, as
        the scaling recipes do ([Note: scale]: a zero or non-finite amax keeps the previous scale).
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.Tensor)):
        raise TypeError(f"scale must be a float or a tensor, got {type(scale).__name__}")
    if isinstance(scale, (int, float)):
        _check_scale_value(float(scale))
        return torch.tensor(float(scale), dtype=torch.float32, device=x.device)
    if scale.numel() != 1:
        raise ValueError(f"scale must hold one value (per-tensor scaling), got shape {tuple(scale.shape)}")
    if scale.device != x.device:
        raise ValueError(
            f"scale is on {scale.device} but the tensor is on {x.device}; move the scale with "
            f"scale.to({str(x.device)!r})"
        )
    if scale.device.type == "cpu" or (check_device_value and scale.device.type != "meta"):
        _check_scale_value(float(scale))
    return scale.reshape(()).float()


def _check_scale_value(s: float) -> None:
    if not (s > 0 and s != float("inf")):
        raise ValueError(f"scale must be finite and > 0, got {s}")


class Float8Tensor(torch.Tensor):
    """FP8 bytes + an fp32 scale that PyTorch code can use as a ``dtype`` tensor.

    Build one with :meth:`quantize`; read it back with :meth:`dequantize`. See
    [Note: Float8Tensor] and [Note: scale].
    """

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _fp8_format: Fp8Format
    _meta: _Fp8Meta
    _block: tuple[int, int] | None

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        fp8_format: Fp8Format,
        dtype: torch.dtype,
        requires_grad: bool = False,
        meta: _Fp8Meta | None = None,
        block: tuple[int, int] | None = None,
    ) -> Float8Tensor:
        # The wrapper's storage offset is always 0, whatever ``_data``'s: the bytes may be
        # re-pointed into a bucket buffer later (DistributedFusedAdam), and torch.compile
        # rebuilds the wrapper from fake bytes through ``__tensor_unflatten__``; an offset that
        # followed the bytes would then differ from the live wrapper's and fail the compile.
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=0,
            dtype=dtype,
            device=data.device,
            requires_grad=requires_grad,
        )
        self._data = data
        self._scale_inv = scale_inv
        self._fp8_format = fp8_format
        self._meta = meta if meta is not None else _Fp8Meta()
        self._block = None if block is None else (int(block[0]), int(block[1]))
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    # ------------------------------------------------------------------ construction
    @classmethod
    def quantize(
        cls,
        x: torch.Tensor,
        fp8_format: Fp8Format | str = Fp8Format.E4M3,
        scale: torch.Tensor | float | None = None,
        recipe: object = None,
    ) -> Float8Tensor:
        """Quantize ``x``; with ``scale=None`` the scale comes from ``amax(x)`` (current scaling).

        The result reports ``x.dtype`` and ``x.shape`` and stores one byte per element.
        ``recipe`` (a recipe or its name): rowwise or blockwise give the 2-D ``x`` one scale
        per row or per block, from that tile's amax ([Note: Float8Tensor]); a per-tensor recipe
        or None, one scale.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Float8Tensor.quantize takes a tensor, got {type(x).__name__}")
        if isinstance(x, Float8Tensor):
            x = x.dequantize()
        if x.dtype not in _NOMINAL_DTYPES:
            raise TypeError(
                f"cannot quantize a {x.dtype} tensor to FP8: give a floating-point tensor "
                f"(float32, bfloat16 or float16), e.g. x.float()"
            )
        fmt = Fp8Format.parse(fp8_format)
        block = None if recipe is None else weight_block(recipe, x.shape)
        if block is not None:
            if scale is not None:
                raise ValueError("Float8Tensor.quantize: a rowwise or blockwise tensor takes its scales "
                                 "from its tiles' amaxes; pass scale=None")
            data, scale_inv = quantize_tiles(x, fmt, block)
            return cls(data, scale_inv, fmt, x.dtype, block=block)
        # [Note: fused cast]: one Triton pass (two for current scaling) on CUDA, else eager.
        if scale is None:
            cast = quantize_current(x.detach(), fmt)
        else:
            cast = quantize_with_scale(x.detach(), _check_scale(scale, x), fmt)
        return cls(cast.data, cast.scale_inv, fmt, x.dtype)

    def _rewrap(self, data: torch.Tensor, share: bool = True, tile_shape: Any = "same") -> Float8Tensor:
        """A wrapper of ``data`` with this tensor's scale (shared when ``share``). A tiled tensor
        viewed flat keeps the 2-D shape its grid tiles (``tile_shape``; default: this one's when
        ``data`` has this tensor's shape)."""
        scale_inv = self._scale_inv if share else self._scale_inv.clone()
        meta = self._meta if share else None
        out = Float8Tensor(data, scale_inv, self._fp8_format, self.dtype, meta=meta, block=self._block)
        if tile_shape == "same":
            tile_shape = self.__dict__.get("_tile_shape") if data.shape == self._data.shape else None
        if tile_shape is not None:
            out.__dict__["_tile_shape"] = tuple(tile_shape)
        return out

    # ------------------------------------------------------------------ reading
    def dequantize(self, dtype: torch.dtype | None = None,  # type: ignore[override]
                   scale_first: bool = False) -> torch.Tensor:
        """The value as a plain tensor of ``dtype`` (default: the nominal dtype).
        ``scale_first``: the same bits from ``scale_inv * bytes``, an expression a compiler does
        not merge with the default one ([Note: dequantize again] in nn/linear.py)."""
        if self._block is not None:
            data = self._data.view(self.tile_shape)  # a flat view: its grid's 2-D shape
            value = mul_tiles(data, self._scale_inv.float(), self._block, scale_first)
            return value.view(self.shape).to(dtype or self.dtype)
        return cast_from_fp8(self._data, self._scale_inv, dtype or self.dtype, scale_first)

    @property
    def scale_inv(self) -> torch.Tensor:
        """fp32: value = fp8 bytes as float x scale_inv; 0-d, or one per tile (``block``)."""
        return self._scale_inv

    @property
    def block(self) -> tuple[int, int] | None:
        """The tile one scale covers, or None for one scale over the whole tensor."""
        return self._block

    @property
    def tile_shape(self) -> torch.Size:
        """The 2-D shape the scale grid tiles: this tensor's, or for a tiled tensor viewed flat
        (FSDP2 keeps its shard so) the shape it was viewed from ([Note: FP8 tiled slices])."""
        return torch.Size(self.__dict__.get("_tile_shape", self.shape))

    @property
    def scale(self) -> torch.Tensor:
        return self._scale_inv.reciprocal()

    @property
    def fp8_format(self) -> Fp8Format:
        return self._fp8_format

    @property
    def fp8_data(self) -> torch.Tensor:
        """The raw float8 bytes (shares storage with this tensor)."""
        return self._data

    def uint8_view(self) -> torch.Tensor:
        """The bytes as ``uint8`` (same storage), the form collectives move (gloo has no float8)."""
        return self._data.view(torch.uint8)

    def fp8_transpose(self) -> torch.Tensor:
        """Contiguous float8 bytes of ``self.t()`` (2-D), cached until the bytes change."""
        if self._data.dim() != 2:
            raise ValueError(f"fp8_transpose needs a 2-D tensor, got {self._data.dim()}-D")
        d = self._data
        key = (tuple(d.shape), d.stride(), d.storage_offset(), d.untyped_storage().data_ptr())
        hit = self._meta.transposes.get(key)
        if hit is not None and hit[0] == self._meta.generation and hit[1] == d._version:
            return hit[2]
        t = d.t().contiguous()
        self._meta.transposes[key] = (self._meta.generation, d._version, t)
        return t

    # ------------------------------------------------------------------ high-precision init value
    def get_high_precision_init_val(self) -> torch.Tensor | None:
        """The high-precision value this weight was initialized from, if it was preserved.

        ``fp8_model_init(preserve_high_precision_init_val=True)`` keeps it (on CPU) so an
        optimizer can start its FP32 master from it instead of from the FP8 bytes.
        """
        return self.__dict__.get("_hp_init_val")

    def set_high_precision_init_val(self, value: torch.Tensor) -> None:
        self.__dict__["_hp_init_val"] = value.detach().to("cpu", copy=True)

    def clear_high_precision_init_val(self) -> None:
        self.__dict__.pop("_hp_init_val", None)

    # ------------------------------------------------------------------ writing
    def mark_bytes_changed(self) -> None:
        """Call after writing ``_data`` or ``_scale_inv`` from outside (e.g. a collective)."""
        self._meta.bytes_changed()

    def quantize_(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> Float8Tensor:
        """Overwrite the bytes and scale in place from high-precision ``x``.

        ``scale=None``: current scaling from ``amax(x)``, keeping the previous scale when that
        amax is zero or non-finite. A given ``scale`` (a number or a one-element tensor) must be
        finite and > 0, else ValueError and nothing changes; a CUDA tensor's value is not
        checked ([Note: scale checks]). The tensor object, its storage and its scale tensor stay.
        A tiled tensor (rowwise, blockwise) takes every tile's scale from that tile's amax.
        """
        if self._block is not None:
            if scale is not None:
                raise ValueError("quantize_ of a rowwise or blockwise Float8Tensor takes its scales from "
                                 "its tiles' amaxes; pass scale=None")
            data, scale_inv = quantize_tiles(x.reshape(self.tile_shape), self._fp8_format, self._block)
            self._data.copy_(data.view(self._data.shape))
            self._scale_inv.copy_(scale_inv)
            self._meta.bytes_changed()
            return self
        if scale is None:  # [Note: fused cast]
            cast = quantize_current(x, self._fp8_format, prev_scale_inv=self._scale_inv, out=self._data)
        else:  # refused before any byte changes ([Note: scale checks]; no host sync for CUDA scales)
            scale = _check_scale(scale, x, check_device_value=False)
            cast = quantize_with_scale(x, scale, self._fp8_format, out=self._data)
        self._scale_inv.copy_(cast.scale_inv)
        self._meta.bytes_changed()
        return self

    # ------------------------------------------------------------------ FSDP2 ([Note: FSDP2 extension])
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any = None, outer_stride: Any = None,
                            module: Any = None, mp_policy: Any = None) -> tuple[tuple, tuple]:
        """FSDP2's all-gather inputs: this shard's FP8 bytes as ``uint8``; the scale as metadata."""
        from fp8shard.fp8.fsdp import pre_all_gather

        return pre_all_gather(self, mesh, outer_size)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple, metadata: Any, param_dtype: torch.dtype,
                             *, out: Float8Tensor | None = None) -> Any:
        """The unsharded Float8Tensor over the gathered bytes (or ``out`` refreshed in place)."""
        from fp8shard.fp8.fsdp import post_all_gather

        return post_all_gather(self, all_gather_outputs, metadata, param_dtype, out)

    # ------------------------------------------------------------------ python protocol
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        head = (f"Float8Tensor(fp8_format={self._fp8_format.name}, dtype={self.dtype}, "
                f"shape={tuple(self.shape)}, device={self.device}")
        if _has_no_values(self._data) or _has_no_values(self._scale_inv):
            # [Note: compile] torch.compile formats its fake inputs (torch 2.11 does so while
            # compiling, logging or not): reading a value there fails the whole compilation.
            return head + ")"
        if self._block is not None:
            return (f"{head}, block={self._block}, scale_inv shape={tuple(self._scale_inv.shape)}, "
                    f"value={self.dequantize()!r})")
        return f"{head}, scale_inv={self._scale_inv.item():.6g}, value={self.dequantize()!r})"

    def __deepcopy__(self, memo: dict) -> Float8Tensor:
        if id(self) in memo:
            return memo[id(self)]
        new = Float8Tensor(
            self._data.clone(), self._scale_inv.clone(), self._fp8_format, self.dtype,
            requires_grad=self.requires_grad, block=self._block,
        )
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k not in ("_data", "_scale_inv", "_fp8_format", "_meta", "_block"):
                setattr(new, k, copy.deepcopy(v, memo))
        return new

    def __reduce_ex__(self, protocol: int) -> tuple:
        # torch.save / pickle: bytes, scale and format travel; torch.load(weights_only=True)
        # accepts the rebuild function because it is registered as a safe global below. The
        # bytes travel as uint8: plain pickle of a float8 tensor fails in torch 2.13.
        return (
            _rebuild_float8_tensor,
            (self.uint8_view(), self._scale_inv, self._fp8_format.value, self.dtype, self.requires_grad,
             self._block),
        )

    # torch.compile support: the inner tensors and the constant metadata.
    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["_data", "_scale_inv"], (self._fp8_format, self.dtype, self._block)

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: tuple, outer_size: Any, outer_stride: Any) -> Float8Tensor:
        fmt, dtype, block = ctx
        return Float8Tensor(inner["_data"], inner["_scale_inv"], fmt, dtype, block=block)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from fp8shard.fp8.ops import dispatch

        return dispatch(func, args, kwargs or {})


def _has_no_values(t: torch.Tensor) -> bool:
    """A tensor being traced (fake or functional) or on the meta device: no values to read."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t) or torch._is_functional_tensor(t)


def _rebuild_float8_tensor(
    data: torch.Tensor, scale_inv: torch.Tensor, fmt_value: str, dtype: torch.dtype, requires_grad: bool,
    block: tuple[int, int] | None = None,
) -> Float8Tensor:
    fmt = Fp8Format(fmt_value)
    return Float8Tensor(data.view(fmt.torch_dtype), scale_inv, fmt, dtype, requires_grad=requires_grad,
                        block=block)


torch.serialization.add_safe_globals([_rebuild_float8_tensor])
