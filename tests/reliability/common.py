"""Helpers of the reliability tests: in-process runs of the training command, torchrun runs,
digests, and every tensor of a checkpoint."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from fp8shard.checkpoint.io import single_process_quiet
from fp8shard.checkpoint.planner import PiecesLoadPlanner, SafeFileSystemReader, read_dcp_metadata
from fp8shard.fp8 import Float8Tensor
from fp8shard.testing.faults import Faults
from fp8shard.testing.faults import command as fault_command
from tests.train.helpers import TINY, cpu_env, kill_pids, process_tree

# TINY, cut further: 2 steps of a tiny model on a small corpus take about a second in-process.
SMALL = [*TINY, "data.num_train_tokens=40000", "data.num_val_tokens=10000", "trainer.limit_val_batches=1",
         "trainer.max_steps=2", "trainer.log_every_n_steps=1"]


def run_args(run_dir: Path, *overrides: str) -> list[str]:
    return [*SMALL, *overrides, f"exp_manager.exp_dir={run_dir.parent}", f"exp_manager.name={run_dir.name}"]


def tensor_digest(t: torch.Tensor) -> str:
    if isinstance(t, Float8Tensor):
        return tensor_digest(t.uint8_view()) + tensor_digest(t.scale_inv.reshape(1))
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def weights_and_state_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """The parameters (FP8 bytes and scales) and the optimizer's whole state (master, moments, step)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}={tensor_digest(p)}".encode())
    sd = opt.state_dict()
    for i, st in sorted(sd["state"].items()):
        for k, v in sorted(st.items()):
            for kk, vv in (sorted(v.items()) if isinstance(v, dict) else [("", v)]):
                val = tensor_digest(vv) if torch.is_tensor(vv) else repr(vv)
                h.update(f"{i}/{k}/{kk}={val}".encode())
    h.update(repr(sd.get("step")).encode())
    return h.hexdigest()[:16]


def tree_digest(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``root`` ({} when it does not exist)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def torchrun(run_dir: Path, overrides: list[str], env: dict[str, str] | None = None, nproc: int = 2,
             max_restarts: int = 0, timeout: float = 120, faults: Faults | None = None
             ) -> subprocess.CompletedProcess:
    """``torchrun --standalone --max-restarts K --nproc-per-node N -m fp8shard.train`` writing to
    ``run_dir``, in a session of its own (a timeout kills torchrun and every rank); not checked.
    ``faults``: through ``-m fp8shard.testing.faults --faults JSON`` instead."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                f"--max-restarts={max_restarts}"]
    head = fault_command(faults, launcher) if faults is not None else [*launcher, "-m", "fp8shard.train"]
    cmd = [*head, *overrides, f"exp_manager.exp_dir={run_dir.parent}", f"exp_manager.name={run_dir.name}"]
    full_env = cpu_env(**(env or {}))
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                          start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(p.pid)  # torchrun starts its ranks in sessions of their own
            out, err = p.communicate()
            tail = f"{out[-3000:]}\n{err[-3000:]}"
            raise AssertionError(f"torchrun timed out after {timeout}s:\n{tail}") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (found through /proc), deepest first."""
    kill_pids(process_tree(pid))


def checkpoint_tensors(ck: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model incl. FP8 bytes and scales, optimizer, RNG), read whole."""
    md = read_dcp_metadata(ck)
    out = {k: torch.empty(list(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    with single_process_quiet():
        dcp.load(out, storage_reader=SafeFileSystemReader(ck), planner=PiecesLoadPlanner({}), no_dist=True)
    return out


def differing_tensors(ck_a: Path, ck_b: Path) -> list[str]:
    """Keys whose tensors differ (bitwise) between two checkpoints. Python's and NumPy's global
    RNG states are left out: seeded by the OS at start-up and unused by training, they differ
    between any two processes unless a checkpoint restored them."""
    ta, tb = checkpoint_tensors(ck_a), checkpoint_tensors(ck_b)
    assert ta.keys() == tb.keys()
    keys = [k for k in ta if not k.rsplit("/", 1)[1].startswith(("python_", "numpy_"))]
    assert any(":fp8_bytes" in k for k in keys) and any(k.startswith("rng/0/torch_cpu") for k in keys)
    return [k for k in keys if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
