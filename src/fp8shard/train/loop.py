"""The training loop: micro-batches, accumulation, clipping, the LR schedule, validation.

One optimizer step reads top to bottom:

    lr for this step (warmup + cosine)
    for each micro-batch of this rank's share of the global batch:
        forward under bf16 autocast (+ fp8_autocast), backward of loss / accumulation steps
        (all but the last micro-batch under no_sync: gradients only accumulate)
    clip the global gradient norm, optimizer step, zero the gradients
    every checkpoint.every_n_steps steps (and after the last): a sharded checkpoint

Checkpoints ([Note: checkpoint space], docs/checkpoint.md) hold, besides the model and optimizer,
everything that makes a resumed run the same run: the data position (consumed samples), the LR
schedule (a function of the step and ``model.optim.sched.max_steps``), every rank's RNG states,
the partial loss window of the log and the skipped-step count. Non-finite steps are skipped
([Note: skipped steps]) and a timed-out collective becomes an error naming the phase of the
step ([Note: collective timeouts]), both in faults.py, as do a failed checkpoint save ([Note:
storage faults]) and a restart after a rank died ([Note: elastic restart]); saturated FP8 casts
are reported by layer once per step ([Note: overflow check] in nn/overflow.py). Validation leaves the training
state untouched (see ``_delayed_scaling_untouched``), so the validation a run stopped early
does at its last step changes nothing. Choosing and checking the checkpoint to resume from is
resume.py's; the run directory's lock and its clearing for trainer.overwrite are rundir.py's.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fp8shard as fs
from fp8shard.checkpoint import (
    CheckpointSaveError,
    checkpoint_path,
    list_checkpoints,
    save_checkpoint,
)
from fp8shard.data.prepared import save_run_tokenizer, val_bpb_factor
from fp8shard.nn.gemm_filter import count_fp8_layers
from fp8shard.nn.overflow import OverflowMonitor
from fp8shard.train.budget import check_memory
from fp8shard.train.builders import (
    build_model,
    build_optimizer,
    build_recipe,
    compile_enabled,
    compile_model,
    compile_scope_for,
    configure_compute,
    describe_compute,
    keep_checkpoint_gemm_path,
    lr_at,
    memory_by_category,
    params_dtype,
)
from fp8shard.train.config import Config, ConfigError, to_dict, to_yaml
from fp8shard.train.data import BatchLoader, TokenData, TokenSlice, load_data, val_batches
from fp8shard.train.distributed import DistEnv, all_reduce_max, all_reduce_sum
from fp8shard.train.faults import FaultHooks, TrainingFailure, is_peer_lost, is_timeout
from fp8shard.train.metrics import RunRecorder, bytes_per_param, format_summary, peak_memory, wire_bytes
from fp8shard.train.resume import load_resume_checkpoint, newest_checkpoint_state, resume_candidates
from fp8shard.train.rundir import delete_earlier_run, lock_run_dir, remove_partial_files


@contextlib.contextmanager
def _delayed_scaling_untouched(model: nn.Module) -> Any:
    """Run evaluation forwards without moving the FP8 layers' delayed-scaling state.

    The training steps' amaxes are all reduced by then (``amax_sync.step()`` after each
    backward, [Note: amax reduction]); the state is saved, and restored after the block. The
    evaluation reduces its amaxes after each forward (``Trainer.validate``): its later batches
    use scales from its earlier ones, and the overflow check sees them; then they are dropped.
    """
    saved = [(m, name, buf.clone()) for m in model.modules()
             for name, buf in m.named_buffers(recurse=False) if name in ("fp8_amax_history", "fp8_scale")]
    try:
        yield
    finally:
        for m, name, value in saved:
            getattr(m, name).copy_(value)


class Trainer:
    """Everything one run holds; ``fit()`` trains and returns the summary; ``close()`` releases
    the run directory (its lock, [Note: run directory lock]) -- the process's exit does too."""

    def __init__(self, cfg: Config, env: DistEnv, faults: FaultHooks | None = None) -> None:
        self.cfg, self.env = cfg, env
        self.faults = faults if faults is not None else FaultHooks()  # tests inject through it
        self.run_dir = Path(cfg.exp_manager.exp_dir) / cfg.exp_manager.name
        self.ckpt_root = self.run_dir / "checkpoints"
        self.step = 0
        # [Note: run directory lock]: before anything is read or written
        self.lock = lock_run_dir(self.run_dir, env.is_main, env.group)
        try:
            self._start()
        except BaseException:
            # A refused start leaves nothing behind: the lock file and the directories it made go
            # (and nothing else is touched: leftovers of earlier runs stay as they were).
            self.close(remove_created=True)
            raise

    def close(self, remove_created: bool = False) -> None:
        """Release the run directory (rank 0): remove what an interrupted save or write left
        (``remove_created``, a refused start: only this process's own temporary files, and the
        directories taking the lock created), then the lock. Idempotent."""
        if self.env.is_main:  # first, while the lock is still held: nothing else writes here
            remove_partial_files(self.run_dir, self.ckpt_root, own_only=remove_created)
        if self.lock is not None:
            self.lock.release(remove_created=remove_created)
        data = getattr(self, "data", None)
        if data is not None:
            for tokens in (data.train, data.val):
                if isinstance(tokens, TokenSlice):
                    tokens.file.close()

    def _start(self) -> None:
        cfg, env = self.cfg, self.env
        t, m = cfg.trainer, cfg.model
        candidates = resume_candidates(cfg, self.ckpt_root)
        self.compute = configure_compute(cfg, env)
        self.data: TokenData = load_data(cfg.data, m.encoder_seq_length)
        self.bpb_factor = val_bpb_factor(cfg, self.data.val, env.world_size)  # text runs: bits per byte
        check_memory(cfg, env.world_size, vocab_size=self.data.vocab_size)  # the vocabulary is known now
        self.model = build_model(cfg, self.data.vocab_size, env.device)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        computing, linears = count_fp8_layers(self.model)  # [Note: FP8 layer filter]
        self.fp8_layers = (computing if m.fp8 else 0, linears)
        self.opt, self.forward_module = build_optimizer(cfg, self.model, env)
        self.recipe = build_recipe(cfg)
        # [Note: amax reduction]: one packed MAX all-reduce of the delayed-scaling amaxes after
        # each micro-batch's backward, over the data-parallel group.
        delayed = m.fp8 and isinstance(self.recipe, fs.DelayedScaling)
        self.amax_sync = fs.nn.AmaxSync(self.model, env.group) if delayed else None
        torch.manual_seed(m.seed + 1 + env.rank)  # dropout streams differ per rank
        self.loader = BatchLoader(self.data.train, m.encoder_seq_length, m.global_batch_size,
                                  m.micro_batch_size, env.rank, env.world_size, cfg.data.seed, env.device)
        self.is_dfa = cfg.model.optim.name == "distributed_fused_adam"
        self.memory: dict[str, int] = {}
        self.comm: dict[str, int] = {}
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.save_errors = 0  # failed checkpoint saves (checkpoint.on_save_error=continue)
        # Saturated FP8 casts under delayed scaling, found at the amax reduction ([Note: overflow check]).
        factor = t.fp8_overflow_factor
        self.overflow = OverflowMonitor(self.model, factor) if delayed and factor > 0 else None
        self.phase, self.phase_step = "start-up", 0  # where a timed-out collective happened
        self._timed: tuple[int, float] = (0, 0.0)
        # Per-rank sum of step losses and number of steps since the last log record: saved in
        # checkpoints, so a resumed run logs the same mean losses as an uninterrupted one.
        self.window: list[float] = [0.0, 0]
        notes: list[str] = []
        self.resumed_from = self._resume(candidates, notes) if candidates else None
        self.compiled = compile_enabled(t.compile, env.device, t.strategy)
        if self.compiled:  # in place: the module tree and state-dict keys stay ([Note: compile scope])
            self.compile_scope = compile_scope_for(t.compile_scope, env.world_size)
            compile_model(self.model, self.recipe if m.fp8 else None, self.compile_scope, t.compile_backend,
                          t.compile_mode)
        self.cuda_graphs = self.compiled and t.compile_mode == "reduce-overhead"
        # [Note: compiled first call] (after any resume: a loaded history needs no first call)
        self.eager_first_call = (self.compiled and self.amax_sync is not None
                                 and self.amax_sync.first_call_pending())
        if t.overwrite and env.is_main:  # every check has passed: the earlier run's files go now
            notes.extend(delete_earlier_run(self.run_dir, self.ckpt_root))
        # Resuming in the same run directory keeps metrics.jsonl up to the checkpoint's step.
        inside = self.resumed_from is not None and \
            self.resumed_from.parent.resolve() == self.ckpt_root.resolve()
        self.rec = RunRecorder(self.run_dir, env.is_main, t.max_steps,
                               keep_until=self.step if inside else None,
                               tensorboard=cfg.exp_manager.create_tensorboard_logger)
        self.rec.write_config(to_yaml(cfg))
        if env.is_main:
            save_run_tokenizer(cfg, self.run_dir)  # [Note: prepared tokens]
        for note in notes:
            self.rec.say(note)

    # ------------------------------------------------------------------ checkpoints
    def _data_tokens(self) -> dict[str, int]:
        return {"train": len(self.data.train), "val": len(self.data.val)}

    def _resume(self, candidates: list[Path], notes: list[str]) -> Path:
        """Load the first loadable candidate (a damaged newest one falls back to the previous) and
        continue from it: step, counters, data position, log window, RNG streams."""
        tokens = self._data_tokens() if self.cfg.data.source != "markov" else None
        path, info = load_resume_checkpoint(candidates, self.model, self.opt, self.cfg, tokens,
                                            self.env.group, notes)
        extra = info.extra  # what save() wrote; a checkpoint saved elsewhere may lack some of it
        self.step = int(extra.get("step", info.step or 0))
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        self.save_errors = int(extra.get("checkpoint_save_errors", 0))
        if self.overflow is not None:
            self.overflow.overflows = int(extra.get("fp8_overflows", 0))
            self.overflow.nonfinite = int(extra.get("fp8_nonfinite_amaxes", 0))
            self.overflow.saturated = int(extra.get("fp8_saturated", 0))
        if "data" in extra:
            try:
                self.loader.load_state_dict(extra["data"])
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"trainer.resume: {path}: {e}") from None
        else:
            self.loader.consumed_samples = self.step * self.cfg.model.global_batch_size
        window = extra.get("log_window", {"loss_sums": [0.0] * info.world_size, "steps": 0})
        if info.world_size == self.env.world_size:
            self.window = [window["loss_sums"][self.env.rank], window["steps"]]
        else:  # the same mean over a different number of ranks
            total = sum(window["loss_sums"]) * self.env.world_size / info.world_size
            self.window = [total if self.env.is_main else 0.0, window["steps"]]
        notes.extend(keep_checkpoint_gemm_path(self.cfg, self.env, self.compute, extra.get("fp8_gemm")))
        if not info.rng_restored:  # another world size: fresh streams, still per rank and step
            torch.manual_seed(self.cfg.model.seed + 1 + self.env.rank + 1_000_003 * self.step)
        notes.append(f"resumed from {path} at step {self.step} (saved by {info.world_size} rank(s))")
        if extra.get("lr_schedule") != self._schedule_state():
            notes.append(f"note: the LR schedule differs from the checkpoint's "
                         f"({extra.get('lr_schedule')} -> {self._schedule_state()}); the continued "
                         "run follows the new one")
        return path

    def _schedule_state(self) -> dict[str, Any]:
        s = self.cfg.model.optim.sched
        return {"name": s.name, "lr": self.cfg.model.optim.lr, "min_lr": s.min_lr,
                "warmup_steps": s.warmup_steps, "max_steps": s.max_steps or self.cfg.trainer.max_steps}

    def save(self) -> Path:
        """A checkpoint of this step (collective; atomic; keeps checkpoint.keep_last)."""
        sums = [self.window[0]]
        if self.env.group is not None:
            sums = [0.0] * self.env.world_size
            dist.all_gather_object(sums, self.window[0], group=self.env.group)
        extra = {"step": self.step, "data": self.loader.state_dict(), "lr_schedule": self._schedule_state(),
                 "log_window": {"loss_sums": sums, "steps": self.window[1]},
                 "skipped_steps": self.skipped_steps, **self._fault_counts(), "config": to_dict(self.cfg),
                 "data_tokens": self._data_tokens(),
                 "fp8_gemm": {"device": self.env.device.type, "path": self.compute.get("fp8_gemm_path")}}
        with self.faults.save_fault(self.step, self.env.rank):  # a test's injected save failure
            return save_checkpoint(checkpoint_path(self.ckpt_root, self.step), self.model, self.opt,
                                   step=self.step, extra=extra, keep_last=self.cfg.checkpoint.keep_last,
                                   process_group=self.env.group)

    def _fault_counts(self) -> dict[str, int]:
        """Counters of metrics.jsonl, summary.json and checkpoints besides ``skipped_steps``."""
        mon = self.overflow
        return {"fp8_overflows": mon.overflows if mon else 0, "fp8_saturated": mon.saturated if mon else 0,
                "fp8_nonfinite_amaxes": mon.nonfinite if mon else 0,
                "checkpoint_save_errors": self.save_errors}

    def _save_failed(self, e: CheckpointSaveError) -> None:
        """A save failed ([Note: storage faults]): check the newest complete checkpoint, then stop
        or, with checkpoint.on_save_error=continue, say so and train on."""
        self.save_errors += 1
        state = newest_checkpoint_state(self.ckpt_root, self.env.is_main)
        if self.env.group is not None:
            dist.barrier(group=self.env.group)  # rank 0 has checked before any rank goes on or exits
        mode = self.cfg.checkpoint.on_save_error
        last = self.step >= self.cfg.trainer.max_steps
        if mode == "stop" or last:
            why = "checkpoint.on_save_error=stop" if mode == "stop" else "it was the save after the last step"
            raise TrainingFailure(f"{e}; {state}; stopping ({why})")
        if self.env.is_main:
            print(f"fp8shard.train: warning: {e}; {state}; training continues "
                  f"(checkpoint.on_save_error=continue, {self.save_errors} failed save(s) so far)",
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ contexts
    def _forward_ctx(self) -> contextlib.ExitStack:
        if self.compiled and self.is_dfa and self.cfg.model.optim.overlap_param_sync:
            # [Note: compile scope]: the parameter all-gathers are awaited here, eagerly, so the
            # forward pre-hooks inside the compiled regions find nothing pending (a pending
            # gather there would be traced into the graph and recompile it region by region).
            self.opt.wait_param_sync()  # type: ignore[attr-defined]
        if self.cuda_graphs:  # a new forward: the CUDA graphs may reuse the last one's outputs
            torch.compiler.cudagraph_mark_step_begin()
        stack = contextlib.ExitStack()
        if self.cfg.trainer.precision == "bf16-mixed":
            stack.enter_context(torch.autocast(self.env.device.type, dtype=torch.bfloat16))
        if self.cfg.model.fp8:
            stack.enter_context(fs.fp8_autocast(enabled=True, recipe=self.recipe))
        return stack

    def _first_call_stance(self) -> Any:
        """[Note: compiled first call]
            A compiled model is traced at its first call and again whenever a guard fails. Two
            things would cost a whole extra compilation of the model (about 30 s for the 125M
            GPT in FP8 on an H100, more with depth, for a graph used once): under delayed scaling,
            the informed first call ([Note: informed first call]) takes another branch than
            every later forward; validation runs without grad and in eval mode. So the first
            training forward of a run whose layers have not made their first call (a fresh
            run, not one resumed with a history) runs eagerly (``force_eager``), once, and
            validation runs what is compiled for it, eagerly where nothing is
            (``eager_on_recompile``): the run compiles the training graph once.
        """
        if not self.eager_first_call:
            return contextlib.nullcontext()
        self.eager_first_call = False
        return torch.compiler.set_stance("force_eager")

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
        self.phase_step = self.step + 1
        self.faults.maybe_stall(self.step + 1, self.env.rank)
        inject_nan = self.faults.nan_at(self.step + 1, self.env.rank)
        micro = self.loader.next_batches()
        loss_sum = torch.zeros((), device=self.env.device)
        self.phase = "forward/backward (gradient reduce-scatter, FP8 amax all-reduce)"
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else self._no_sync():
                with self._forward_ctx(), self._first_call_stance():
                    loss = self.forward_module(x, y)
                if inject_nan:  # a test's injected non-finite loss, hence gradients
                    loss = loss * float("nan")
                (loss / len(micro)).backward()
            if self.amax_sync is not None:  # this micro-batch's amaxes -> the next one's scales
                self.amax_sync.step()
            loss_sum += loss.detach()
        # A test's injected kill: a rank dies mid-step, its peers wait in a collective.
        self.faults.maybe_kill(self.step + 1, self.env.rank, self.cfg.trainer.max_steps)
        self.phase = "gradient clipping (gradient reduce-scatter, gradient-norm all-reduce)"
        clip = self.cfg.trainer.gradient_clip_val or math.inf
        if self.is_dfa:
            norm = self.opt.clip_grad_norm(clip)  # type: ignore[attr-defined]
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        skipped = False
        self.phase = "optimizer step (weight amax all-reduce, parameter all-gather)"
        if self.is_dfa:
            self.opt.step()
            skipped = bool(self.opt.last_step_skipped)  # type: ignore[attr-defined]
        elif torch.isfinite(norm):
            self.opt.step()
        else:
            skipped = True  # the baseline skips non-finite steps too
        if not self.memory:  # the first step of this process (also after resuming)
            self._measure_resources()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return float(loss_sum) / len(micro), float(norm), skipped

    def _report_overflows(self, where: str) -> None:
        """Say which FP8 casts saturated since the last poll ([Note: overflow check]); one host sync."""
        if self.overflow is None:
            return
        events = self.overflow.poll()
        for o in events[:4]:
            self.rec.say(f"warning: {where}: {o.message()}")
        if len(events) > 4:
            self.rec.say(f"warning: {where}: ... and {len(events) - 4} more FP8 operands")
        note = self.overflow.note_for(events)  # what an overflow is, in plain words, once
        if note is not None:
            self.rec.say(f"note: {note}")

    def _measure_resources(self) -> None:
        self.memory = memory_by_category(self.opt, self.model)
        if self.is_dfa:
            self.comm = dict(self.opt.comm_report())  # type: ignore[attr-defined]
        elif self.env.world_size > 1:
            grads = sum(p.numel() * p.element_size() for p in self.model.parameters())
            self.comm = {"all_reduce.grads": grads}  # DDP: see [Note: comm bytes]
        if self.cfg.model.fp8 and isinstance(self.recipe, fs.DelayedScaling) and self.env.world_size > 1:
            # AmaxSync MAX-reduces [n_layers, 3] fp32 amaxes once per backward (micro-batch) of
            # the layers computing in FP8 ([Note: FP8 layer filter]).
            n = self.fp8_layers[0] * 3 * 4 * self.loader.accumulation_steps
            self.comm["all_reduce.fp8_activation_amax"] = n

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate(self) -> float:
        """Mean loss over the fixed validation windows (the same set at any world size).

        The FP8 layers' delayed-scaling state is restored afterwards, so validating changes
        nothing in the training that follows (``_delayed_scaling_untouched``).
        """
        cfg, env, m = self.cfg, self.env, self.cfg.model
        n = cfg.trainer.limit_val_batches * m.global_batch_size
        total = count = 0.0
        stance = (torch.compiler.set_stance("eager_on_recompile") if self.compiled
                  else contextlib.nullcontext())
        with _delayed_scaling_untouched(self.model), stance:  # [Note: compiled first call]
            self.model.eval()
            # [Note: validation split]: the same number of forwards on every rank; a rank past
            # the end of its share runs a padding forward that does not count.
            for x, y, padding in val_batches(self.data.val, m.encoder_seq_length, n, m.micro_batch_size,
                                             env.rank, env.world_size, env.device):
                with self._forward_ctx():
                    loss = self.model(x, y)
                if self.amax_sync is not None:  # every rank runs the same number of forwards
                    self.amax_sync.step()
                if not padding:
                    total += float(loss) * y.numel()
                    count += y.numel()
            self.model.train()
        self._report_overflows(f"validation after step {self.step}")
        total, count = all_reduce_sum([total, count], env)
        return total / count if count else float("nan")

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict[str, Any]:
        cfg, env, rec = self.cfg, self.env, self.rec
        t = cfg.trainer
        rec.say(f"fp8shard.train: {self.num_params:,} params, {env.world_size} rank(s) on {env.device.type}, "
                f"data {self.data.description}, run dir {self.run_dir}"
                + (f"; {describe_compute(self.compute)}" if self.compute else "")
                + (f"; FP8 compute in {self.fp8_layers[0]} of {self.fp8_layers[1]} linear layers "
                   f"(model.fp8_layers={cfg.model.fp8_layers})" if cfg.model.fp8 else ""))
        window_start, first_step = time.perf_counter(), self.step
        timed_tokens, timed_s = 0, 0.0
        last_loss, val_loss = float("nan"), float("nan")
        if self.overflow is not None:
            self.overflow.open()
        if self.step >= t.max_steps:
            rec.say(f"already at step {self.step} >= trainer.max_steps={t.max_steps}: nothing to train")
            val_loss = self.validate()
        try:
            while self.step < t.max_steps:
                window_start, timed_tokens, timed_s, last_loss, val_loss = self._one_step(
                    first_step, window_start, timed_tokens, timed_s, last_loss, val_loss)
        except RuntimeError as e:
            if isinstance(e, TrainingFailure) or self.env.backend is None:
                raise
            if is_peer_lost(e):  # a rank died: torchrun restarts the job (--max-restarts) or ends it
                raise TrainingFailure(
                    f"a collective in {self.phase} at step {self.phase_step} failed: another rank is gone "
                    f"({str(e).splitlines()[0][:200]})", every_rank=True) from None
            if not is_timeout(e):
                raise
            raise TrainingFailure(
                f"a collective in {self.phase} at step {self.phase_step} timed out after "
                f"{t.collective_timeout_s:g}s (trainer.collective_timeout_s): a rank stopped "
                f"participating ({str(e).splitlines()[0][:200]})", every_rank=True) from None
        finally:
            rec.close()
            if self.overflow is not None:
                self.overflow.close()
        self.phase = "the summary (loss and memory all-reduce)"
        summary = self._summary(last_loss, val_loss, timed_tokens / timed_s if timed_s else float("nan"))
        summary["skipped_steps"] = self.skipped_steps
        summary.update(self._fault_counts())
        if self.compiled:  # graphs this process traced ([Note: compiled first call])
            from torch._dynamo.utils import counters
            summary["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
        path = rec.write_summary(summary)
        rec.say(format_summary(summary))
        rec.say(f"summary: {path}")
        return summary

    def _one_step(self, first_step: int, window_start: float, timed_tokens: int, timed_s: float,
                  last_loss: float, val_loss: float) -> tuple[float, int, float, float, float]:
        """One step of ``fit``, its log record, validation and checkpoint; returns fit's running
        figures (window start, timed tokens and seconds, last mean loss, last validation loss)."""
        cfg, rec, t = self.cfg, self.rec, self.cfg.trainer
        every = cfg.checkpoint.every_n_steps
        loss, norm, skipped = self.train_step()
        self._report_overflows(f"step {self.step}")
        self.skipped_steps += skipped
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        self.window[0] += loss
        self.window[1] += 1
        step = self.step
        log_now = step % t.log_every_n_steps == 0 or step == t.max_steps
        val_now = step % t.val_check_interval == 0 or step == t.max_steps
        if log_now or val_now:
            self.phase = "logging and validation (loss all-reduce)"
            last_loss, val_loss = self._log(step, norm, skipped, val_now, val_loss, window_start)
            if step - first_step > t.log_every_n_steps or step == t.max_steps:
                timed_tokens += self._timed[0]  # the first window holds start-up costs
                timed_s += self._timed[1]
            window_start = time.perf_counter()
        if self.consecutive_skips >= t.max_consecutive_skips:
            self._stop_skipping()
        if every and (step % every == 0 or step == t.max_steps):
            self.phase = "checkpoint save (gathers and barriers)"
            start = time.perf_counter()
            try:
                path = self.save()
            except CheckpointSaveError as e:  # disk full, permission denied: [Note: storage faults]
                self._save_failed(e)
            else:
                rec.sync()  # metrics.jsonl on disk up to this checkpoint
                rec.say(f"checkpoint: {path} ({time.perf_counter() - start:.2f}s)")
            window_start += time.perf_counter() - start  # saving is not training throughput
        return window_start, timed_tokens, timed_s, last_loss, val_loss

    def _stop_skipping(self) -> None:
        """Too many non-finite steps in a row: stop, keeping the checkpoints ([Note: skipped steps])."""
        n, last = self.consecutive_skips, self.step
        kept = list_checkpoints(self.ckpt_root)
        where = f"the newest checkpoint {kept[0]} is kept" if kept else "no checkpoint was written"
        raise TrainingFailure(
            f"{n} steps in a row (steps {last - n + 1}-{last}) were skipped because the loss or the "
            f"gradients were not finite (trainer.max_consecutive_skips="
            f"{self.cfg.trainer.max_consecutive_skips}); stopping; {where}")

    def _log(self, step: int, norm: float, skipped: bool, val_now: bool, val_loss: float,
             window_start: float) -> tuple[float, float]:
        """Write the record of ``step`` (mean loss over the window since the last record, and a
        validation loss when due); returns (that mean loss, the latest validation loss)."""
        cfg, env, rec = self.cfg, self.env, self.rec
        tokens_per_step = cfg.model.global_batch_size * cfg.model.encoder_seq_length
        window_loss, window_steps = self.window
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - window_start
        mean_loss = all_reduce_sum([window_loss / window_steps], env)[0] / env.world_size
        rate = window_steps * tokens_per_step / elapsed
        self._timed = (int(window_steps * tokens_per_step), elapsed)
        record: dict[str, Any] = {
            "step": step, "loss": mean_loss, "lr": lr_at(cfg, step - 1), "tokens_per_s": rate,
            "grad_norm": norm, "skipped": skipped, "skipped_steps": self.skipped_steps,
            **self._fault_counts(),
            "consumed_samples": self.loader.consumed_samples,
            "tokens": step * tokens_per_step, "elapsed_s": time.perf_counter() - rec.start,
            "world_size": env.world_size,
        }
        extra = f" | skipped (non-finite), {self.skipped_steps} so far" if skipped else ""
        if val_now:
            val_loss = self.validate()
            record["val_loss"] = val_loss
            extra = f" | val {val_loss:.4f}"
            if self.bpb_factor is not None:
                record["val_bpb"] = val_loss * self.bpb_factor
                extra += f" ({record['val_bpb']:.3f} bits/byte)"
        rec.log(record)
        rec.progress(step, mean_loss, rate, record["lr"], extra)
        self.window = [0.0, 0]
        return mean_loss, val_loss

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
            "val_bpb": None if self.bpb_factor is None else val_loss * self.bpb_factor,
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
                    "fp8_recipe": m.fp8_recipe, "fp8_layers": m.fp8_layers,
                    "fp8_compute_layers": list(self.fp8_layers), "fp8_margin": m.fp8_margin,
                    "fp8_amax_history_len": m.fp8_amax_history_len,
                    "fp8_amax_compute_algo": m.fp8_amax_compute_algo},
            "compute": self.compute,
            "data": self.data.description,
            "global_batch_size": m.global_batch_size,
            "micro_batch_size": m.micro_batch_size,
            "seq_len": m.encoder_seq_length,
            "accumulation_steps": self.loader.accumulation_steps,
            "data_state": self.loader.state_dict(),
            "resumed_from": None if self.resumed_from is None else str(self.resumed_from),
            "checkpoints": [p.name for p in list_checkpoints(self.ckpt_root)],
        }
