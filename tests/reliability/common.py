"""Helpers of the reliability tests: in-process runs of the training command, digests."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from fp8shard.fp8 import Float8Tensor
from tests.train.helpers import TINY

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
