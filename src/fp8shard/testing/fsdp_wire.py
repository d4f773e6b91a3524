"""Bytes on the wire of FSDP2's collectives, for tests and benchmarks.

``count_fsdp_wire(model)`` -> ``WireCount``: keys ``all_gather.params.<dtype>`` (the gathered
buffers; ``uint8`` for FP8 bytes) and ``reduce_scatter.grads.<dtype>``. The implementation
lives with the engine (``fp8shard.optim.fsdp2_comm``), which reports the same counts in
``FSDP2Adam.comm_report()``.
"""

from fp8shard.optim.fsdp2_comm import WireCount, count_fsdp_wire

__all__ = ["WireCount", "count_fsdp_wire"]
