"""The training command on the CPU with the fused Adam step's Triton kernels run by Triton's
interpreter, to compare its loss curve with the PyTorch path's (no GPU needed).

    FP8SHARD_TRITON=1 python benchmarks/train_interpreted_adam.py [key=value ...]   # kernels
    FP8SHARD_TRITON=0 python benchmarks/train_interpreted_adam.py [key=value ...]   # PyTorch path

Arguments are the training command's (``python -m fp8shard.train``). Only the optimizer's fused
step is interpreted (``optim/triton_adam.py``, about 10 s per step for a 125 k-parameter model
on 2 cores); the FP8 casts of the layers take their reference path as on any CPU run. The
interpreter's fp32 -> bf16 / FP8 conversions are given the GPU's rounding, as in the tests
(``tests/triton_interp.py``). Needs the ``interp`` extra (``triton==3.9.0``).
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv: list[str]) -> int:
    from tests.triton_interp import gpu_like_conversions
    from triton.runtime import interpreter

    interpreter._convert_float = gpu_like_conversions(interpreter._convert_float)
    from fp8shard._triton import triton_enabled
    from fp8shard.optim import distributed_fused_adam, fused_step

    for mod in (fused_step, distributed_fused_adam):  # serve CPU tensors, as use_triton does CUDA ones
        mod.use_triton = lambda *tensors: triton_enabled()  # type: ignore[attr-defined]
    from fp8shard.train.__main__ import main as train_main

    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
