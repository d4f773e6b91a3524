"""A decoder-only transformer in the Megatron/GPT style.

Fused QKV projection, ``scaled_dot_product_attention`` with a causal mask, pre-norm blocks
(LayerNorm or RMSNorm), a GELU or SwiGLU MLP, learned or rotary positions, optional tied
embeddings and Megatron's scaled init (output projections of each block use
``std / sqrt(2 * num_layers)``).

The four projections of every block are :class:`fp8shard.nn.Linear`; embeddings, norms and
the output layer are plain torch modules. This file holds no FP8 or distributed logic: what
those Linears compute in is decided by the caller (``fp8_autocast``, ``fp8_model_init``).

Large models are built the nanochat way::

    with torch.device("meta"):
        model = GPT(config)          # shapes only, no memory
    model.to_empty(device="cuda")    # allocate
    model.init_weights()             # initialize
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8shard.models.loss import linear_cross_entropy
from fp8shard.models.shape import TransformerShape
from fp8shard.nn import Linear
from fp8shard.nn.linear import dequantize_weights


@dataclasses.dataclass
class GPTConfig(TransformerShape):
    """Shape and flavour of the model (the fields of :class:`TransformerShape`), its vocabulary,
    position table and numerics. Names follow NeMo's megatron_gpt_config.yaml."""

    vocab_size: int = 256
    """Number of token ids (embedding rows)."""
    max_position_embeddings: int = 128
    """Longest sequence the model accepts (learned position table size, rotary cache length)."""
    rotary_base: float = 10000.0
    """Base of the rotary frequencies."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of the norms."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the output layer + cross-entropy ([Note: chunked loss]): None picks
    it from the vocabulary size (at most 2**26 logits at a time), 0 computes all logits at once
    (the plain path)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (no bias)."""

    def __init__(self, dim: int, eps: float, device: torch.device | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(cfg: GPTConfig) -> nn.Module:
    if cfg.normalization == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, bias=cfg.bias)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); cos/sin: (T, D/2). Rotate the two halves of the head dim.
    x1, x2 = x.float().chunk(2, dim=-1)
    y = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return y.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with a fused QKV projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        shapes = cfg.projection_shapes()
        self.qkv = Linear(*reversed(shapes["qkv"]), bias=cfg.bias)
        self.proj = Linear(*reversed(shapes["proj"]), bias=cfg.bias)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                weights: Sequence[torch.Tensor | None] = (None, None),
                cache: LayerCache | None = None) -> torch.Tensor:
        """``weights``: Wᵀ of qkv and proj dequantized, or None ([Note: grouped dequantize]).
        ``cache``: this layer's keys and values of the tokens before ``x`` ([Note: KV cache])."""
        b, t, c = x.shape
        h, d = self.cfg.num_attention_heads, self.cfg.head_dim
        # (B, T, 3C) -> 3 x (B, H, T, D)
        q, k, v = _linear(self.qkv, x, weights[0]).view(b, t, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        if rotary is not None:
            q, k = _apply_rotary(q, *rotary), _apply_rotary(k, *rotary)
        p = self.cfg.attention_dropout if self.training else 0.0
        if cache is None or cache.length == 0:
            if cache is not None:
                cache.append(k, v)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:  # token i of x sits at position start + i and sees every key up to it
            start = cache.length
            k, v = cache.append(k, v)
            mask = None
            if t > 1:
                mask = (torch.arange(start + t, device=x.device)[None, :]
                        <= torch.arange(start, start + t, device=x.device)[:, None])
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return _linear(self.proj, y.transpose(1, 2).reshape(b, t, c), weights[1])


class LayerCache:
    """One layer's keys and values of the tokens seen so far, (B, H, max_len, D) each, filled
    from the start, in the dtype the layer computes them in ([Note: KV cache])."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' keys and values; return every key and value so far."""
        if self.k is None or self.v is None:  # made on first use, in the dtype computed
            b, h, _, d = k.shape
            self.k = k.new_empty(b, h, self.max_len, d)
            self.v = v.new_empty(b, h, self.max_len, d)
        end = self.length + k.shape[2]
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Every layer's keys and values for incremental decoding: ``GPT.forward(idx, cache=...)``
    takes the next tokens only.

    [Note: KV cache]
        Sampling asks for the next token's logits after every token. Without a cache each call
        runs the whole context again (quadratic in its length); with one, a call runs only the
        new tokens, their queries attending the cached keys and values of the tokens before
        (positions continue from ``length``: the learned table's rows, the rotary tables'). Up to
        ``max_position_embeddings`` tokens; past that the model has no positions left, and the
        sampler (``fp8shard.generate.sample``) goes back to running the last window whole. The
        logits equal the uncached model's up to the float rounding of the different shapes
        (tested). The cache holds ``2 * layers * batch * max_len * hidden`` elements of the
        dtype the attention computes in, allocated at the first call.
    """

    def __init__(self, config: GPTConfig, max_len: int | None = None) -> None:
        self.max_len = max_len or config.max_position_embeddings
        self.layers = [LayerCache(self.max_len) for _ in range(config.num_layers)]

    @property
    def length(self) -> int:
        """Tokens seen so far (the position of the next one)."""
        return self.layers[0].length if self.layers else 0


def _linear(layer: nn.Module, x: torch.Tensor, dequantized_t: torch.Tensor | None) -> torch.Tensor:
    """``layer(x)``, given its dequantized Wᵀ when there is one ([Note: grouped dequantize]); a
    layer swapped for another Linear class (``nn.Linear``, torchao's) is called as it expects."""
    return layer(x) if dequantized_t is None else layer(x, dequantized_t)


class MLP(nn.Module):
    """GELU MLP, or SwiGLU with one fused (gate, up) projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        shapes = cfg.projection_shapes()
        self.fc1 = Linear(*reversed(shapes["fc1"]), bias=cfg.bias)
        self.fc2 = Linear(*reversed(shapes["fc2"]), bias=cfg.bias)

    def forward(self, x: torch.Tensor, weights: Sequence[torch.Tensor | None] = (None, None)) -> torch.Tensor:
        """``weights``: Wᵀ of fc1 and fc2 dequantized, or None ([Note: grouped dequantize])."""
        h = _linear(self.fc1, x, weights[0])
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return _linear(self.fc2, h, weights[1])


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = _norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = _norm(cfg)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                cache: LayerCache | None = None) -> torch.Tensor:
        # The block's FP8-stored weights that compute in bf16, in one kernel under compile.
        w = dequantize_weights((self.attn.qkv, self.attn.proj, self.mlp.fc1, self.mlp.fc2))
        x = x + self.dropout(self.attn(self.norm1(x), rotary, w[:2], cache))
        return x + self.dropout(self.mlp(self.norm2(x), w[2:]))


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx, targets=None)`` -> logits, or the mean loss."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = cfg = config
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = (
            nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            if cfg.position_embedding_type == "learned_absolute" else None
        )
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_norm = _norm(cfg)
        self.output = (
            None if cfg.share_embeddings_and_output_weights
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        # Rotary tables are derived, not learned: non-persistent buffers, (T, D/2) fp32.
        n = cfg.max_position_embeddings
        half = cfg.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(n, half, dtype=torch.float32), persistent=False)
        self.register_buffer("rope_sin", torch.empty(n, half, dtype=torch.float32), persistent=False)
        if self.wte.weight.device.type != "meta":
            self.init_weights()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize every parameter and buffer (call after ``to_empty`` for meta-built models).

        Normal(0, std) for embeddings and projections; block output projections (attn.proj,
        mlp.fc2) use std / sqrt(2 * num_layers); biases 0; norm gains 1.
        """
        cfg = self.config
        std = cfg.init_method_std
        out_std = std / math.sqrt(2.0 * cfg.num_layers)
        nn.init.normal_(self.wte.weight, std=std)
        if self.wpe is not None:
            nn.init.normal_(self.wpe.weight, std=std)
        if self.output is not None:
            nn.init.normal_(self.output.weight, std=std)
        for block in self.blocks:
            for lin, s in ((block.attn.qkv, std), (block.attn.proj, out_std),
                           (block.mlp.fc1, std), (block.mlp.fc2, out_std)):
                nn.init.normal_(lin.weight, std=s)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
        for m in self.modules():
            if isinstance(m, (nn.LayerNorm, RMSNorm)):
                m.reset_parameters()
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the derived (non-persistent) buffers: the rotary cos/sin tables."""
        cfg = self.config
        dev = self.rope_cos.device
        inv_freq = cfg.rotary_base ** (-torch.arange(0, cfg.head_dim, 2, device=dev).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.max_position_embeddings, device=dev).float(), inv_freq)
        self.rope_cos.copy_(angles.cos())
        self.rope_sin.copy_(angles.sin())

    def linear_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(name, weight) of the block projections, the ones that may live in FP8."""
        return [(n, p) for n, p in self.named_parameters()
                if n.startswith("blocks.") and n.endswith("weight") and p.dim() == 2]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ forward
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """idx: (B, T) int64. Returns logits (B, T, V), or the mean cross-entropy with targets.
        ``cache``: ``idx`` continues the tokens the cache holds (and is added to it), [Note: KV
        cache].

        Three parts, each a method so that it can be compiled as a region of its own
        (``compile_regions``): ``embed``, the blocks, ``head``.
        """
        if cache is None:
            x, rotary = self.embed(idx)
            for block in self.blocks:
                x = block(x, rotary)
            return self.head(x, targets)
        start = cache.length
        x, rotary = self.embed(idx, start, limit=cache.max_len)
        for block, layer in zip(self.blocks, cache.layers, strict=True):
            x = block(x, rotary, layer)
        return self.head(x, targets)

    def embed(self, idx: torch.Tensor, start: int = 0, limit: int | None = None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Token (+ learned position) embeddings of idx (B, T) at positions ``start`` onwards; the
        rotary tables if any."""
        cfg = self.config
        t = idx.shape[1]
        end = start + t
        if end > cfg.max_position_embeddings:
            raise ValueError(f"sequence of {end} tokens is longer than max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        if limit is not None and end > limit:
            raise ValueError(f"the KV cache holds {limit} positions, {end} tokens do not fit: "
                             "make it with a larger max_len")
        x = self.wte(idx)
        if self.wpe is not None:
            return x + self.wpe(torch.arange(start, end, device=idx.device)), None
        return x, (self.rope_cos[start:end], self.rope_sin[start:end])

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and output layer: logits (B, T, V), or with targets the mean cross-entropy,
        computed chunk by chunk without the logits of all tokens ([Note: chunked loss] in
        models/loss.py; ``config.loss_chunk_tokens=0``: the plain path)."""
        x = self.final_norm(x)
        w_out = self.wte.weight if self.output is None else self.output.weight
        if targets is None:
            return F.linear(x, w_out)
        chunk = self.config.loss_chunk_tokens
        if chunk == 0:
            logits = F.linear(x, w_out)
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return linear_cross_entropy(x, w_out, targets, chunk_tokens=chunk)

    def compile_regions(self, **compile_kwargs: Any) -> int:
        """``torch.compile`` the whole model in place as regions: ``embed``, each block, ``head``
        (with the loss); returns how many regions ([Note: compile regions]).

        [Note: compile regions]
            A compiled region is one autograd node: its parameters' gradients all arrive when its
            backward ends. One graph per region keeps the gradients of each block arriving as the
            backward leaves that block (what gradient hooks, e.g. a reduce-scatter per bucket,
            overlap with), while everything the forward runs is compiled. The blocks share one
            compiled graph (their parameters are graph inputs), so compiling costs one block
            whatever the depth. In place: the module tree and the state-dict keys stay the
            eager model's; ``embed`` and ``head`` become compiled bound methods of this model
            (instance attributes, which ``state_dict`` and ``named_parameters`` do not see).
        """
        for block in self.blocks:
            block.compile(**compile_kwargs)
        for name in ("embed", "head"):
            fn = torch.compile(getattr(type(self), name), **compile_kwargs)
            setattr(self, name, types.MethodType(fn, self))
        return len(self.blocks) + 2
