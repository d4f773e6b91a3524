"""The transformer's shape and flavour, declared once.

``TransformerShape`` is shared by ``fp8shard.models.GPTConfig`` (which adds the vocabulary, the
position table and numerics) and by the training command's ``model`` section
(``fp8shard.train.config.ModelConfig``, which adds the batch shape, FP8 settings and optimizer):
a field added here is a GPT argument and a ``model.*`` key at once, with the one docstring below.
Names follow NeMo's megatron_gpt_config.yaml.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal


@dataclasses.dataclass
class TransformerShape:
    """Depth, widths and flavour of a decoder-only transformer."""

    num_layers: int = 4
    """Transformer blocks."""
    hidden_size: int = 128
    """Width of the residual stream."""
    ffn_hidden_size: int = 512
    """Inner width of the MLP (per branch for SwiGLU)."""
    num_attention_heads: int = 4
    """Attention heads; must divide hidden_size."""
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    """Pre-norm flavour."""
    activation: Literal["gelu", "swiglu"] = "gelu"
    """MLP non-linearity; swiglu uses a fused (gate, up) projection of 2 x ffn_hidden_size."""
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    """Learned absolute position table or rotary embeddings on q and k."""
    share_embeddings_and_output_weights: bool = True
    """Tie the output layer to the token embedding."""
    bias: bool = True
    """Biases in the projections and norms."""
    init_method_std: float = 0.02
    """Std of the normal init; block output projections use std / sqrt(2 num_layers)."""
    hidden_dropout: float = 0.0
    """Dropout on the residual branches."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """Each block's four projections, ``name -> (out_features, in_features)`` (the FP8 layers;
        SwiGLU's fc1 is the fused gate and up projection)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        fc1 = 2 * f if self.activation == "swiglu" else f
        return {"qkv": (3 * h, h), "proj": (h, h), "fc1": (fc1, h), "fc2": (h, f)}

    def shape_kwargs(self) -> dict[str, Any]:
        """The shape's fields and values (to build another config of the same shape)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(TransformerShape)}
