"""The reference GPT of benchmarks/compare_peers.py: what most users would train instead of us.

A plain nanoGPT-style model with exactly the shapes of ``fp8shard.models.GPT`` in its default
flavour (LayerNorm with bias, GELU(tanh) MLP, learned positions, tied embeddings, a fused QKV
projection whose output is laid out (q | k | v) x heads x head_dim as fp8shard's, and
``F.scaled_dot_product_attention``), written with ``torch.nn`` only. It is trained in fp32
parameters under ``torch.autocast(bf16)`` with ``torch.optim.AdamW(fused=True)`` and the whole
model under ``torch.compile``; the loss is ``F.cross_entropy`` of the full logits inside the
forward, as nanoGPT's (Inductor fuses it when compiled).

``RefGPT.from_gpt(gpt)`` copies an fp8shard GPT's values, so both start from the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, eps: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, n_embd: int, ffn: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, ffn)
        self.c_proj = nn.Linear(ffn, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=eps)
        self.attn = SelfAttention(n_embd, n_head, eps)
        self.ln_2 = nn.LayerNorm(n_embd, eps=eps)
        self.mlp = MLP(n_embd, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RefGPT(nn.Module):
    """nanoGPT's GPT with fp8shard's shapes; ``forward(idx, targets)`` -> mean cross-entropy."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 ffn: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(Block(n_embd, n_head, ffn, eps) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(n_embd, eps=eps),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        tr = self.transformer
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = tr.wte(idx) + tr.wpe(pos)
        for block in tr.h:
            x = block(x)
        logits = self.lm_head(tr.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    @classmethod
    def from_gpt(cls, gpt: nn.Module, device: torch.device | str | None = None) -> RefGPT:
        """A reference model on ``device`` (default: gpt's) holding the values of ``gpt`` (an
        fp8shard GPT of the default flavour)."""
        c = gpt.config
        flavour = (c.normalization, c.activation, c.position_embedding_type, c.bias,
                   c.share_embeddings_and_output_weights)
        if flavour != ("layernorm", "gelu", "learned_absolute", True, True):
            raise ValueError("the reference has fp8shard's default flavour only (LayerNorm, GELU, "
                             "learned positions, biases, tied embeddings)")
        with torch.device(device if device is not None else gpt.wte.weight.device):
            ref = cls(c.vocab_size, c.max_position_embeddings, c.num_layers, c.num_attention_heads,
                      c.hidden_size, c.ffn_hidden_size, c.layernorm_epsilon)
        names = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
                 "final_norm.weight": "transformer.ln_f.weight", "final_norm.bias": "transformer.ln_f.bias"}
        for i in range(c.num_layers):
            for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2"), ("attn.qkv", "attn.c_attn"),
                                 ("attn.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"),
                                 ("mlp.fc2", "mlp.c_proj")):
                for p in ("weight", "bias"):
                    names[f"blocks.{i}.{ours}.{p}"] = f"transformer.h.{i}.{theirs}.{p}"
        src = dict(gpt.named_parameters())
        dst = dict(ref.named_parameters())
        if set(src) != set(names) or set(dst) != set(names.values()):
            raise ValueError("parameter names do not map one to one")
        with torch.no_grad():
            for ours, theirs in names.items():
                dst[theirs].copy_(src[ours])
        return ref
