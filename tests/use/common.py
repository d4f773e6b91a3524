"""Helpers of the tests of using a trained run: a small text corpus, in-process training runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fp8shard.train.config import load_config
from fp8shard.train.distributed import DistEnv
from fp8shard.train.loop import Trainer

CPU = DistEnv(0, 1, 0, torch.device("cpu"), None)

# A tiny GPT of GPT-2's architecture (the defaults: learned positions, LayerNorm, GELU, tied, biases).
TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2", "model.ffn_hidden_size=128",
    "model.encoder_seq_length=32", "model.micro_batch_size=4", "model.global_batch_size=8",
    "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "trainer.val_check_interval=2",
    "exp_manager.plots=false", "model.optim.sched.warmup_steps=2",
]

WORDS = ("the king queen lord lady sword crown night day love death honour tongue heart eye blood "
         "speak come go give take hear see know think stay fly weep smile fair foul sweet bitter "
         "and but or if when while thou thee thy my our their his her").split()


def write_corpus(folder: Path, files: int = 3, words_per_file: int = 6000, seed: int = 0) -> Path:
    """``files`` text files of seeded pseudo-verse (a few hundred kB in all) under ``folder``."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        lines, line = [], []
        for w in rng.choice(len(WORDS), size=words_per_file):
            line.append(WORDS[w])
            if len(line) >= 6 + int(rng.integers(0, 4)):
                lines.append(" ".join(line).capitalize() + rng.choice([",", ";", ".", "!", "?"]))
                line = []
        (folder / f"part{f}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def run_args(run_dir: Path, *overrides: str) -> list[str]:
    return [*TINY, *overrides, f"exp_manager.exp_dir={run_dir.parent}", f"exp_manager.name={run_dir.name}"]


def train(run_dir: Path, *overrides: str) -> Trainer:
    """The training command in this process (one rank)."""
    trainer = Trainer(load_config(run_args(run_dir, *overrides), world_size=1), CPU)
    try:
        trainer.fit()
    finally:
        if trainer.lock is not None:  # the run directory is free again, as after the command;
            trainer.lock.release()    # the data stays open for the tests to read
    return trainer
