"""The training loop: micro-batches, accumulation, clipping, the LR schedule, validation.

One optimizer step reads top to bottom:

    lr for this step (warmup + cosine)
    for each micro-batch of this rank's share of the global batch:
        forward under bf16 autocast (+ fp8_autocast), backward of loss / accumulation steps
        (all but the last micro-batch under no_sync: gradients only accumulate)
    clip the global gradient norm, optimizer step, zero the gradients
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fp8shard as fs
from fp8shard.train.builders import (
    build_model,
    build_optimizer,
    build_recipe,
    count_fp8_linears,
    memory_by_category,
    params_dtype,
)
from fp8shard.train.config import Config, to_yaml
from fp8shard.train.data import BatchLoader, TokenData, load_data, val_batches
from fp8shard.train.distributed import DistEnv, all_reduce_max, all_reduce_sum
from fp8shard.train.metrics import RunRecorder, bytes_per_param, format_summary, peak_memory, wire_bytes


def lr_at(cfg: Config, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr.

    The schedule lasts ``sched.max_steps`` (0: ``trainer.max_steps``); a warmup longer than that
    is cut to it (short test runs keep the default warmup).
    """
    o, s = cfg.model.optim, cfg.model.optim.sched
    total = s.max_steps or cfg.trainer.max_steps
    warmup = min(s.warmup_steps, total)
    if step < warmup:
        return o.lr * (step + 1) / warmup
    if s.name == "constant":
        return o.lr
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return s.min_lr + 0.5 * (o.lr - s.min_lr) * (1.0 + math.cos(math.pi * progress))


class Trainer:
    """Everything one run holds; ``fit()`` trains and returns the summary."""

    def __init__(self, cfg: Config, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        t, m = cfg.trainer, cfg.model
        self.run_dir = Path(cfg.exp_manager.exp_dir) / cfg.exp_manager.name
        self.rec = RunRecorder(self.run_dir, env.is_main, t.max_steps)
        self.rec.write_config(to_yaml(cfg))
        self.data: TokenData = load_data(cfg.data, m.encoder_seq_length)
        self.model = build_model(cfg, self.data.vocab_size, env.device)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.opt, self.forward_module = build_optimizer(cfg, self.model, env)
        self.recipe = build_recipe(cfg)
        torch.manual_seed(m.seed + 1 + env.rank)  # dropout streams differ per rank
        self.loader = BatchLoader(self.data.train, m.encoder_seq_length, m.global_batch_size,
                                  m.micro_batch_size, env.rank, env.world_size, cfg.data.seed, env.device)
        self.is_dfa = cfg.model.optim.name == "distributed_fused_adam"
        self.memory: dict[str, int] = {}
        self.comm: dict[str, int] = {}
        self.step = 0

    # ------------------------------------------------------------------ contexts
    def _forward_ctx(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.cfg.trainer.precision == "bf16-mixed":
            stack.enter_context(torch.autocast(self.env.device.type, dtype=torch.bfloat16))
        if self.cfg.model.fp8:
            stack.enter_context(fs.fp8_autocast(enabled=True, recipe=self.recipe, fp8_group=self.env.group))
        return stack

    def _no_sync(self) -> Any:
        if self.is_dfa:
            return self.opt.no_sync()  # type: ignore[attr-defined]
        if isinstance(self.forward_module, nn.parallel.DistributedDataParallel):
            return self.forward_module.no_sync()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ one step
    def train_step(self) -> tuple[float, float, bool]:
        """One optimizer step; returns (mean local loss, grad norm, skipped)."""
        lr = lr_at(self.cfg, self.step)
        for g in self.opt.param_groups:
            g["lr"] = lr
        micro = self.loader.next_batches()
        loss_sum = torch.zeros((), device=self.env.device)
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else self._no_sync():
                with self._forward_ctx():
                    loss = self.forward_module(x, y)
                (loss / len(micro)).backward()
            loss_sum += loss.detach()
        clip = self.cfg.trainer.gradient_clip_val or math.inf
        if self.is_dfa:
            norm = self.opt.clip_grad_norm(clip)  # type: ignore[attr-defined]
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        skipped = False
        if self.is_dfa:
            self.opt.step()
            skipped = bool(self.opt.last_step_skipped)  # type: ignore[attr-defined]
        elif torch.isfinite(norm):
            self.opt.step()
        else:
            skipped = True  # the baseline skips non-finite steps too
        if self.step == 0:
            self._measure_resources()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return float(loss_sum) / len(micro), float(norm), skipped

    def _measure_resources(self) -> None:
        self.memory = memory_by_category(self.opt, self.model)
        if self.is_dfa:
            self.comm = dict(self.opt.comm_report())  # type: ignore[attr-defined]
        elif self.env.world_size > 1:
            grads = sum(p.numel() * p.element_size() for p in self.model.parameters())
            self.comm = {"all_reduce.grads": grads}  # DDP: see [Note: comm bytes]
        if self.cfg.model.fp8 and isinstance(self.recipe, fs.DelayedScaling) and self.env.world_size > 1:
            # fp8_autocast MAX-reduces [n_layers, 3] fp32 amaxes once per forward (micro-batch).
            n = count_fp8_linears(self.model) * 3 * 4 * self.loader.accumulation_steps
            self.comm["all_reduce.fp8_activation_amax"] = n

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate(self) -> float:
        """Mean loss over the fixed validation windows (the same set at any world size)."""
        cfg, env = self.cfg, self.env
        self.model.eval()
        n = cfg.trainer.limit_val_batches * cfg.model.global_batch_size
        total = count = 0.0
        for x, y in val_batches(self.data.val, cfg.model.encoder_seq_length, n, cfg.model.micro_batch_size,
                                env.rank, env.world_size, env.device):
            with self._forward_ctx():
                loss = self.model(x, y)
            total += float(loss) * y.numel()
            count += y.numel()
        self.model.train()
        total, count = all_reduce_sum([total, count], env)
        return total / max(count, 1.0)

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict[str, Any]:
        cfg, env, rec = self.cfg, self.env, self.rec
        t = cfg.trainer
        tokens_per_step = cfg.model.global_batch_size * cfg.model.encoder_seq_length
        rec.say(f"fp8shard.train: {self.num_params:,} params, {env.world_size} rank(s) on {env.device.type}, "
                f"data {self.data.description}, run dir {self.run_dir}")
        window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
        timed_tokens, timed_s = 0, 0.0
        last_loss, val_loss = float("nan"), float("nan")
        skipped_steps = 0
        for _ in range(t.max_steps):
            loss, norm, skipped = self.train_step()
            skipped_steps += skipped
            window_loss += loss
            window_steps += 1
            step = self.step
            log_now = step % t.log_every_n_steps == 0 or step == t.max_steps
            val_now = step % t.val_check_interval == 0 or step == t.max_steps
            if not (log_now or val_now):
                continue
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - window_start
            mean_loss = all_reduce_sum([window_loss / window_steps], env)[0] / env.world_size
            rate = window_steps * tokens_per_step / elapsed
            if step > t.log_every_n_steps or step == t.max_steps:  # the first window holds start-up costs
                timed_tokens += window_steps * tokens_per_step
                timed_s += elapsed
            last_loss = mean_loss
            record: dict[str, Any] = {
                "step": step, "loss": mean_loss, "lr": lr_at(cfg, step - 1), "tokens_per_s": rate,
                "grad_norm": norm, "skipped": skipped, "skipped_steps": skipped_steps,
                "consumed_samples": self.loader.consumed_samples,
                "tokens": step * tokens_per_step, "elapsed_s": time.perf_counter() - rec.start,
            }
            extra = ""
            if val_now:
                val_loss = self.validate()
                record["val_loss"] = val_loss
                extra = f" | val {val_loss:.4f}"
            rec.log(record)
            rec.progress(step, mean_loss, rate, record["lr"], extra)
            window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
        summary = self._summary(last_loss, val_loss, timed_tokens / timed_s if timed_s else float("nan"))
        summary["skipped_steps"] = skipped_steps
        path = rec.write_summary(summary)
        rec.close()
        rec.say(format_summary(summary))
        rec.say(f"summary: {path}")
        return summary

    def _summary(self, final_loss: float, val_loss: float, tokens_per_s: float) -> dict[str, Any]:
        cfg, env, m = self.cfg, self.env, self.cfg.model
        peak, kind = peak_memory()
        peak = int(all_reduce_max([float(peak)], env)[0])
        floor = self.data.entropy_floor
        return {
            "run_dir": str(self.run_dir),
            "steps": self.step,
            "final_train_loss": final_loss,
            "val_loss": val_loss,
            "entropy_floor": floor,
            "val_gap_to_floor": None if floor is None else val_loss - floor,
            "tokens_per_s": tokens_per_s,
            "tokens_seen": self.step * m.global_batch_size * m.encoder_seq_length,
            "wall_s": time.perf_counter() - self.rec.start,
            "peak_memory_bytes": peak,
            "peak_memory_kind": kind,
            "num_params": self.num_params,
            "memory_bytes_per_rank": self.memory,
            "bytes_per_param": bytes_per_param(self.memory, self.num_params),
            "comm_bytes_per_step": self.comm,
            "wire_bytes_per_step": wire_bytes(self.comm, env.world_size),
            "comm_convention": "full collective buffer per rank; wire = ring: (N-1)/N of reduce-scatter/"
                               "all-gather, 2(N-1)/N of all-reduce",
            "world_size": env.world_size,
            "device": env.device.type,
            "backend": env.backend,
            "optimizer": m.optim.name,
            "precision": cfg.trainer.precision,
            "params_dtype": str(params_dtype(cfg)).removeprefix("torch."),
            "fp8": {"fp8": m.fp8, "fp8_params": m.fp8_params, "fp8_hybrid": m.fp8_hybrid,
                    "fp8_recipe": m.fp8_recipe, "fp8_margin": m.fp8_margin,
                    "fp8_amax_history_len": m.fp8_amax_history_len,
                    "fp8_amax_compute_algo": m.fp8_amax_compute_algo},
            "data": self.data.description,
            "global_batch_size": m.global_batch_size,
            "micro_batch_size": m.micro_batch_size,
            "seq_len": m.encoder_seq_length,
            "accumulation_steps": self.loader.accumulation_steps,
            "data_state": self.loader.state_dict(),
        }
