"""``ShardedAdam``: the optimizer on top of an engine, shared by both engines.

``step()`` reads in three phases (the data flow of docs/design.md, section 1):

    1. finish the gradient reduction  -> ``StepGrads``: this rank's shards of the averaged
       (``_finish_grad_reduction``)      gradient and one small all-reduce of their statistics
                                         (sum of squares, non-finite, any gradient at all)
    2. update and cast                -> Adam(W) on the fp32 master shard; amax per FP8 parameter,
       (``_update_and_cast``)            ONE packed all-reduce(MAX), scales [Note: weight scaling];
                                         this rank's shard of the parameters' bytes
    3. launch the gathers             -> the engine hands the new bytes and scales to the weights
       (``engine.launch_gathers``)       (flat: all-gathers; FSDP2: at the next forward)

Where the shards live and how bytes move is the engine's ([Note: engine] in engine.py); the
arithmetic is the engine's step kernel, chosen once at construction ([Note: step kernel]).
Here: the hyperparameters and their checks, the step count, the skip decision, clipping, and
the scalars of a checkpoint. ``DistributedFusedAdam`` and ``FSDP2Adam`` are this class with
their engine.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from fp8shard.optim.engine import Engine
from fp8shard.optim.fused_step import AdamScalars
from fp8shard.optim.step_kernel import StepGrads

_HPARAMS = ("lr", "betas", "eps", "weight_decay")


class ShardedAdam(torch.optim.Optimizer):
    """AdamW (or Adam + L2) with fp32 master weights and states sharded by an engine.

    Subclasses build their engine in their constructor and pass it to ``_attach``; param groups
    may override lr, betas, eps and weight_decay. The parameter list is fixed at construction
    (the engine lays out its storage once).
    """

    engine: Engine

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 defaults: dict[str, Any], *, adam_w_mode: bool) -> None:
        self._frozen = False
        super().__init__(params, defaults)
        self._frozen = True
        self.adam_w_mode = adam_w_mode
        self._last_skipped = False
        self._steps = 0
        self._pending: StepGrads | None = None  # a step decided on the device, not yet read
        self._params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self.device = _check_params(self._params)
        self._group_of = {self._index_of[id(p)]: g for g, grp in enumerate(self.param_groups)
                          for p in grp["params"]}
        self._last_comm: dict[str, int] = {}
        self._grads: StepGrads | None = None  # this window's reduced gradient, made on first use

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_frozen", False):
            raise RuntimeError(
                f"{type(self).__name__} lays out its shards at construction, so add_param_group is "
                "not supported afterwards; pass every param group to the constructor")
        super().add_param_group(param_group)
        _check_hparams(self.param_groups[-1])

    # ================================================================== the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_unchanged()
        self._settle()
        self.engine.begin_step()
        grads = self._finish_grad_reduction()
        # [Note: step without gradients]: nothing to apply, so nothing changes (torch.optim skips
        # parameters whose .grad is None; here the shards are shared, so it is all or nothing).
        if self.engine.kernel.decides_on_device:  # [Note: skip on the device]
            self._steps += 1
            self.engine.launch_gathers(self._update_and_cast(grads), grads.apply)
            grads.shards = []  # the decision is all that waits: the gradients go with the step
            self._pending = grads
        else:
            self._last_skipped = _host_skip(grads)
            if not self._last_skipped:
                self._steps += 1
                self.engine.launch_gathers(self._update_and_cast(grads))
        self._grads = None
        self.engine.reset_grads()  # the gradients are consumed; next backward starts from zero
        self._last_comm = self.engine.close_comm_window()
        return loss

    # [Note: skip on the device]
    #     Whether a step applies (a finite gradient norm, some gradient at all: [Note: step
    #     without gradients]) is known on the device only after the backward. Reading it on the
    #     host mid-``step()`` makes the host wait for the whole backward before it launches the
    #     step's kernels. So with a kernel that ``decides_on_device`` (``FusedKernel``,
    #     ``FSDP2FusedKernel``) the step never reads it: the flag (``StepGrads.apply``) goes to
    #     the kernels, which write nothing where it is False; the scaling state and the weights'
    #     scales are kept by ``torch.where`` on it; the gathers move the unchanged bytes. The
    #     host counts the step and learns the decision later (a copy to pinned memory made with
    #     the flag): at the next ``step()``, or when ``last_step_skipped``, the step count or a
    #     checkpoint is read (``_settle``), by then long finished; a skipped step is then taken
    #     back from the count before any later step uses it. A skipped step leaves every byte of
    #     master, moments, weights, scales and amax history as it was, on either path (tested;
    #     a GPU test forbids any host sync in ``clip_grad_norm`` and ``step()``). Other kernels
    #     read the flag on the host first. Measured: no 125M step got faster for it on an H100
    #     (docs/performance.md, section 12); it takes one host sync out of every step.

    def _settle(self) -> None:
        """Read the decision of a step taken on the device ([Note: skip on the device])."""
        grads, self._pending = self._pending, None
        if grads is not None:
            self._last_skipped = _host_skip(grads)
            if self._last_skipped:
                self._steps -= 1

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``step()`` changed nothing (a non-finite gradient, or no gradient at
        all). On CUDA with the fused step this waits for that step's decision (a host sync)."""
        self._settle()
        return self._last_skipped

    @property
    def _step(self) -> int:
        """Steps applied so far (the bias correction's t of the last one)."""
        self._settle()
        return self._steps

    @_step.setter
    def _step(self, value: int) -> None:
        self._settle()
        self._steps = value

    def _finish_grad_reduction(self) -> StepGrads:
        """Phase 1: finish the gradient reduction and take this rank's shards with their global
        statistics (made once per accumulation window: ``clip_grad_norm`` and ``step`` share it).

        One pass over the shards and one 8-byte all-reduce: the sum of squares (an inf or NaN
        anywhere makes it non-finite on every rank; so does a square that overflows fp32,
        |g| > 1e19) and the number of ranks that received a gradient.

        [Note: step without gradients]
            ``step()`` with no gradient accumulated on any rank since the last ``step()`` or
            ``zero_grad()`` (no backward ran) is a no-op: no weight, master, moment or the step
            count changes, and ``last_step_skipped`` is True. Applying it would decay the weights
            (AdamW's decoupled decay does not need a gradient) and advance the bias correction.
            torch.optim does the same per parameter: it skips those whose ``.grad`` is None. The
            decision is global (the count rides on the all-reduce above), so ranks stay in step:
            a rank without a gradient while others have one takes part with zeros, as in backward.
        """
        if self._grads is None:
            engine = self.engine
            any_here = engine.finish_grad_reduction()
            shards = engine.kernel.grad_shards()
            local = torch.zeros(2, dtype=torch.float32, device=self.device)
            local[0] = engine.kernel.grad_sumsq(shards)
            local[1].fill_(float(any_here))  # a fill kernel: assigning a number would copy from the host
            engine.group.all_reduce(local, "sum", kind="all_reduce.grad_stats")
            apply = (local[0] < math.inf) & (local[1] > 0)  # a sum of squares: finite iff < inf
            ready = None
            stats = local
            if local.is_cuda:  # read on the host later, without waiting ([Note: skip on the device])
                stats = torch.empty(2, dtype=torch.float32, pin_memory=True)
                stats.copy_(local, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            self._grads = StepGrads(shards, local[0], apply, stats, ready)
        return self._grads

    def _update_and_cast(self, grads: StepGrads) -> torch.Tensor | None:
        """Phase 2: Adam(W) on the master shard, then this rank's shard of every parameter's bytes
        (FP8: amax, ONE packed all-reduce(MAX), scales; [Note: weight scaling]). Returns the FP8
        parameters' new ``scale_inv`` per slot (None without FP8 parameters)."""
        kernel, fp8 = self.engine.kernel, self.engine.fp8
        kernel.update(grads, self._hyperparams())
        scales = scale_inv = None
        if fp8.num_slots:
            amax = kernel.local_amax()
            if fp8.reduced_slots:  # FSDP2: tiles whole on this rank stay out ([Note: FSDP2 tiled weights])
                self.engine.group.all_reduce(amax[:fp8.reduced_slots], "max", kind="all_reduce.amax")
            scales = fp8.cast_scales(amax, grads.apply if kernel.decides_on_device else None)
            scale_inv = scales.reciprocal()
        kernel.cast(scales, grads)
        return scale_inv

    def _hyperparams(self) -> list[AdamScalars]:
        """This step's hyperparameters, one per param group (read at every step: LR schedules)."""
        return [AdamScalars(self._step, float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]),
                            float(g["eps"]), float(g["weight_decay"]), self.adam_w_mode)
                for g in self.param_groups]

    # ================================================================== gradients
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes in here only accumulate; the next one outside reduces the sum."""
        with self.engine.no_sync():
            yield

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale the averaged gradients so their global L2 norm is at most ``max_norm``.

        Call after backward, before ``step()``. Returns the norm before clipping (as
        ``torch.nn.utils.clip_grad_norm_`` does); a non-finite norm clips nothing and makes
        ``step()`` skip. ``max_norm`` is a number >= 0 (``inf``: measure only, clip nothing); a
        negative one would turn descent into ascent and NaN would poison every gradient, so both
        raise ValueError before anything changes. A CPU tensor is read as a number; a CUDA
        tensor is taken as it is (checking its value would cost a host sync per step).
        """
        if isinstance(max_norm, torch.Tensor):
            if max_norm.numel() != 1:
                raise ValueError(f"clip_grad_norm: max_norm must be one number, got shape "
                                 f"{tuple(max_norm.shape)}")
            if max_norm.device.type == "cpu":
                max_norm = float(max_norm)
        if not isinstance(max_norm, torch.Tensor):
            if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
                raise TypeError(f"clip_grad_norm: max_norm must be a number, got "
                                f"{type(max_norm).__name__}")
            if not max_norm >= 0:
                raise ValueError(f"clip_grad_norm: max_norm must be >= 0 (inf: no clipping), got "
                                 f"{max_norm}: a negative or NaN bound would flip or poison the gradients")
        grads = self._finish_grad_reduction()
        total = grads.sumsq.sqrt()
        kernel = self.engine.kernel
        # A kernel deciding on the device records the coefficient, never applied to a step that
        # skips; the others scale now, so only a finite norm may reach them (a host read).
        if kernel.decides_on_device or math.isfinite(_host_stats(grads)[0]):
            kernel.clip_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop any accumulated gradients (``param.grad`` and what the engine holds)."""
        for p in self._params:
            p.grad = None
        self._grads = None
        self.engine.reset_grads()

    @property
    def fp8_amax_history_len(self) -> int | None:
        """Length of the FP8 weights' amax history (delayed weight scaling), else None."""
        return self.engine.fp8.amax_history_len

    def wait_param_sync(self) -> None:
        """Finish every in-flight parameter gather (only the flat engine with overlap_param_sync
        leaves any after ``step()``)."""
        self.engine.wait_gathers()

    # ================================================================== checkpoints
    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's pieces (views), each with its offset in the flattened global parameter, in
        the same form from either engine ([Note: checkpoint space])."""
        fp8 = self.engine.fp8
        return {"format": "fp8shard.sharded.v1", "step": self._step,
                "param_groups": self._groups_for_save(),
                "world_size": self.engine.group.world_size, "rank": self.engine.group.rank,
                "shapes": {i: tuple(p.shape) for i, p in enumerate(self._params)},
                "state": self.engine.sharded_states(),
                "fp8": {i: fp8.state(i) for i in fp8.slot}}

    def load_sharded_state_dict(self, sharded: dict[str, Any]) -> None:
        """Load pieces in the form of ``sharded_state_dict()['state']``, split any way (any world
        size, either engine), as long as they cover what this rank owns; plus step, param groups
        and ``fp8``."""
        self.engine.wait_gathers()
        self.engine.load_sharded_states(sharded["state"])
        for i, st in sharded.get("fp8", {}).items():
            self.engine.fp8.load_state(i, st)
        self._load_scalars(sharded)

    def _load_scalars(self, state_dict: dict[str, Any]) -> None:
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the checkpoint's param groups do not match this optimizer's (sizes "
                             f"{[len(g['params']) for g in saved_groups]} vs "
                             f"{[len(g['params']) for g in self.param_groups]})")
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items() if k != "params"})
            _check_hparams(group)
        self._step = int(state_dict["step"])

    def _groups_for_save(self) -> list[dict[str, Any]]:
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [self._index_of[id(p)] for p in g["params"]]} for g in self.param_groups]

    # ================================================================== accounting
    def memory_report(self) -> dict[str, int]:
        """Bytes on this rank by category, and their ``total``.

        Categories: fp8_weights, other_weights, grad_buffers, master, optimizer_states, padding
        (the flat engine: its buffers' storage, the weights included, with ``grad_buffers`` held
        only from the backward to the step, [Note: gradient regions]; FSDP2: the local shards).
        """
        out = self.engine.memory_report()
        out["total"] = sum(out.values())
        return out

    def comm_report(self) -> dict[str, int]:
        """Bytes per collective kind in the last step (from the end of the previous ``step()``,
        so it includes the gradient reduce-scatters of the backward before it).

        Sizes are full buffers per rank (see fp8shard/optim/collectives.py); a ring moves
        ``(N - 1) / N`` of them over each rank's link.
        """
        return dict(self._last_comm)

    # ================================================================== checks
    def _check_unchanged(self) -> None:
        now = [id(p) for g in self.param_groups for p in g["params"]]
        if now != [id(p) for p in self._params]:
            raise RuntimeError(
                f"the optimizer's parameter list changed after construction; {type(self).__name__} "
                "lays out its shards once: build a new optimizer for the new parameters")
        for g in self.param_groups:
            _check_hparams(g)


def _host_stats(grads: StepGrads) -> tuple[float, float]:
    """(sum of squares, ranks with a gradient) read on the host: on CUDA this waits for their
    copy (and what was queued before it), not for what was queued after."""
    if grads.ready is not None:
        grads.ready.synchronize()
    sumsq, ranks = grads.stats.tolist()
    return sumsq, ranks


def _host_skip(grads: StepGrads) -> bool:
    """``not grads.apply``, read on the host: a non-finite sum of squares (an inf or NaN on any
    rank, or a square past fp32), or no rank with a gradient ([Note: step without gradients])."""
    sumsq, ranks = _host_stats(grads)
    return not math.isfinite(sumsq) or ranks == 0


def _check_hparams(group: dict[str, Any]) -> None:
    lr, betas, eps, wd = (group[k] for k in _HPARAMS)
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}; check the LR schedule")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not (isinstance(eps, (int, float)) and 0.0 <= eps < math.inf):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not (isinstance(wd, (int, float)) and 0.0 <= wd < math.inf):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {wd!r}")


def _check_params(params: list[torch.Tensor]) -> torch.device:
    """All parameters trainable, floating point, distinct and on one device; returns it."""
    if len({id(p) for p in params}) != len(params):
        raise ValueError("a parameter appears twice in the optimizer's param groups; pass each once")
    for i, p in enumerate(params):
        if not p.requires_grad:
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) has requires_grad=False; "
                             "leave frozen parameters out of the optimizer")
        if not p.dtype.is_floating_point:
            raise ValueError(f"parameter {i} has dtype {p.dtype}; only floating-point parameters train")
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise ValueError(f"parameters are on several devices ({', '.join(devices)}); the optimizer "
                         "keeps one set of buckets per process: move the model to one device "
                         "(model.to(device)) before building the optimizer")
    return params[0].device
