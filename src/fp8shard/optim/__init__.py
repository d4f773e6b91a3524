"""The distributed optimizer: sharded FP32 master and Adam states, FP8 weights gathered as bytes.

See docs/optimizer.md, docs/engines.md and [Note: engine] in engine.py.
"""

from fp8shard.optim.distributed_fused_adam import DistributedFusedAdam

__all__ = ["DistributedFusedAdam"]
