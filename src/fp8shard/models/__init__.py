"""Models built from fp8shard layers."""

from fp8shard.models.gpt import GPT, GPTConfig, KVCache
from fp8shard.models.shape import TransformerShape

__all__ = ["GPT", "GPTConfig", "KVCache", "TransformerShape"]
