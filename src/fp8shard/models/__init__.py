"""Models built from fp8shard layers."""

from fp8shard.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
