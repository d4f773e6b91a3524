"""The training command, ``python -m fp8shard.train`` (see docs/training.md)."""

from fp8shard.train.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config"]
