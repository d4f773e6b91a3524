"""Importing fp8shard does not import Dynamo (about a second of a process's start: the
command-line tools, any script that imports the package; a training run loads it later, when
it builds the model on the meta device); the functions marked for it are marked as torch's own
decorator marks them."""

from __future__ import annotations

import subprocess
import sys

import torch

from fp8shard.fp8 import gemm


def test_importing_the_package_and_the_training_command_leaves_dynamo_unloaded():
    code = ("import sys, fp8shard, fp8shard.train.__main__, fp8shard.report, fp8shard.export; "
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_constant_under_compile_marks_a_function_as_torch_does():
    def ours() -> int:
        return 1

    def theirs() -> int:
        return 1

    assert gemm._constant_under_compile(ours) is ours
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) == {"_dynamo_marked_constant": True}
    assert all(getattr(f, "_dynamo_marked_constant", False)
               for f in (gemm._report_once, gemm._cuda_fp8_capable, gemm._cpu_auto_path))
