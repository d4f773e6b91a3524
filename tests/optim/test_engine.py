"""The engine interface ([Note: engine]): both engines implement it, the core drives either.

* ``FlatEngine`` and ``FSDP2Engine`` satisfy the ``Engine`` protocol, and both optimizers are the
  core (``ShardedAdam``) with an engine: neither defines a step, clipping or checkpoint of its own.
* A third, minimal engine written here (one process, no sharding, dense fp32 masters) is enough
  for the core to train: its update is ``torch.optim.AdamW``'s bit for bit, and a skipped step
  (no gradient, or a non-finite one) changes nothing. So the protocol is all the core needs.
* ``step()`` calls the flat engine in its three phases, in order.
* Through either engine the core gives the same losses (2 ranks, gloo), and breaking an engine
  method (the gathers, or the gradient statistics) changes them.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from fp8shard.optim import DistributedFusedAdam
from fp8shard.optim.collectives import CommCounter, Group
from fp8shard.optim.core import ShardedAdam
from fp8shard.optim.engine import Engine
from fp8shard.optim.flat import FlatEngine
from fp8shard.optim.fp8_weights import Fp8WeightScaler
from fp8shard.optim.fsdp2 import FSDP2Adam, FSDP2Engine
from fp8shard.optim.fused_step import ReferenceKernel
from fp8shard.optim.step_kernel import StepGrads
from tests.conftest import pools_fixture
from tests.optim.dist_cases import TINY_BUCKET_MB, TinyMixed, batch

dist_pools = pools_fixture("gloo")

ENGINE_METHODS = ("begin_step", "finish_grad_reduction", "launch_gathers", "wait_gathers", "reset_grads",
                  "no_sync", "sharded_states", "load_sharded_states", "memory_report", "close_comm_window")


# ---------------------------------------------------------------------------- a minimal engine
class DenseKernel(ReferenceKernel):
    def __init__(self, params: list[nn.Parameter], masters: list[torch.Tensor], runs, scaler) -> None:
        zeros = [torch.zeros_like(m) for m in masters]
        super().__init__(masters, zeros, [z.clone() for z in zeros], runs, scaler, torch.device("cpu"))
        self.params = params

    def grad_shards(self) -> list[torch.Tensor]:
        return [torch.zeros_like(m) if p.grad is None else p.grad.reshape(-1).float()
                for p, m in zip(self.params, self.masters, strict=True)]

    def local_amax(self) -> torch.Tensor:
        return torch.zeros(0)

    def cast(self, scales: torch.Tensor | None, grads: StepGrads) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            p.data.copy_(m.view(p.shape))


class DenseEngine:
    """Every parameter whole on one process: what the protocol asks, and nothing more."""

    def __init__(self, params: list[nn.Parameter], group_of: dict[int, int], num_groups: int) -> None:
        self.params = params
        self.comm = CommCounter()
        self.group = Group(None, self.comm)
        self.fp8 = Fp8WeightScaler({}, "current", None, torch.device("cpu"))
        masters = [p.detach().float().clone().reshape(-1) for p in params]
        runs: list[list[tuple[int, int, int]]] = [[] for _ in range(num_groups)]
        for i, m in enumerate(masters):
            runs[group_of[i]].append((i, 0, m.numel()))
        self.kernel = DenseKernel(params, masters, runs, self.fp8)

    def begin_step(self) -> None:
        pass

    def finish_grad_reduction(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def launch_gathers(self, scale_inv: torch.Tensor | None, apply: torch.Tensor | None = None) -> None:
        pass

    def wait_gathers(self) -> None:
        pass

    def reset_grads(self) -> None:
        pass

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def sharded_states(self) -> dict:
        k = self.kernel
        return {i: [{"offset": 0, "numel": m.numel(), "master": m, "exp_avg": k.exp_avgs[i],
                     "exp_avg_sq": k.exp_avg_sqs[i]}] for i, m in enumerate(k.masters)}

    def load_sharded_states(self, state: dict) -> None:
        for i, (e,) in state.items():
            for name, dst in (("master", self.kernel.masters), ("exp_avg", self.kernel.exp_avgs),
                              ("exp_avg_sq", self.kernel.exp_avg_sqs)):
                dst[i].copy_(e[name])

    def memory_report(self) -> dict[str, int]:
        return {"master": sum(m.numel() * 4 for m in self.kernel.masters)}

    def close_comm_window(self) -> dict[str, int]:
        return self.comm.close_window()


class DenseAdam(ShardedAdam):
    def __init__(self, params, lr: float, weight_decay: float) -> None:
        super().__init__(params, dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay),
                         adam_w_mode=True)
        self.engine = DenseEngine(self._params, self._group_of, len(self.param_groups))


def _dense_problem() -> tuple[nn.Module, list[dict]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    other = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return model, [{"params": decay}, {"params": other, "weight_decay": 0.0, "lr": 3e-3}]


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
    return model(x).square().mean()


# ---------------------------------------------------------------------------- the protocol
def test_the_engines_satisfy_the_protocol():
    model = TinyMixed()
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=TINY_BUCKET_MB)
    assert isinstance(opt.engine, FlatEngine) and isinstance(opt.engine, Engine)
    dense = DenseAdam(_dense_problem()[1], lr=1e-2, weight_decay=0.1)
    assert isinstance(dense.engine, Engine)
    assert not isinstance(object(), Engine)
    for cls in (FlatEngine, FSDP2Engine, DenseEngine):
        for name in ENGINE_METHODS:
            assert callable(getattr(cls, name, None)), (cls.__name__, name)


def test_the_optimizers_are_the_core_and_an_engine():
    """The step, its phases, clipping, zero_grad and the sharded checkpoint are written once."""
    shared = ("step", "_finish_grad_reduction", "_update_and_cast", "clip_grad_norm", "zero_grad",
              "no_sync", "sharded_state_dict", "load_sharded_state_dict", "memory_report", "comm_report")
    for cls in (DistributedFusedAdam, FSDP2Adam):
        assert issubclass(cls, ShardedAdam)
        for name in shared:
            # (torch.optim wraps each subclass's step for its hooks: look through the wrapper)
            fn = inspect.unwrap(getattr(cls, name))
            assert fn.__qualname__ == f"ShardedAdam.{name}", f"{cls.__name__} defines its own {name}"


def fsdp2_engine_is_an_engine() -> bool:
    """On every rank (2, gloo): an FSDP2Adam's engine satisfies the protocol."""
    from tests.fsdp2 import cases

    model = cases.shard(cases.make_model())
    opt = cases.make_opt(model, "fsdp2")
    return isinstance(opt.engine, FSDP2Engine) and isinstance(opt.engine, Engine)


def test_the_fsdp2_engine_satisfies_the_protocol(dist_pools):
    assert dist_pools(2).run(fsdp2_engine_is_an_engine) == [True, True]


# ---------------------------------------------------------------------------- the core on any engine
def test_the_core_on_a_minimal_engine_is_torch_adamw():
    model, groups = _dense_problem()
    ref_model, ref_groups = _dense_problem()
    opt = DenseAdam(groups, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_groups, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(4):
        for m, o in ((model, opt), (ref_model, ref)):
            _loss(m, step).backward()
            o.step()
            o.zero_grad()
        assert not opt.last_step_skipped
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(p, q), step
    assert opt.sharded_state_dict()["step"] == 4
    assert opt.comm_report() == {"all_reduce.grad_stats": 8}


def test_the_core_skips_a_step_without_or_with_bad_gradients():
    model, groups = _dense_problem()
    opt = DenseAdam(groups, lr=1e-2, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # no backward: nothing to apply ([Note: step without gradients])
    assert opt.last_step_skipped
    _loss(model, 0).backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    assert not torch.isfinite(opt.clip_grad_norm(1.0))
    opt.step()
    assert opt.last_step_skipped
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert opt.sharded_state_dict()["step"] == 0


def test_step_calls_the_flat_engine_in_three_phases(monkeypatch):
    torch.manual_seed(0)
    model = TinyMixed()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY_BUCKET_MB)
    calls: list[str] = []
    for name in ("begin_step", "finish_grad_reduction", "launch_gathers", "reset_grads", "close_comm_window"):
        real = getattr(opt.engine, name)

        def spy(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(opt.engine, name, spy)
    model(batch(1, 0)).square().mean().backward()
    opt.step()
    assert calls == ["begin_step", "finish_grad_reduction", "launch_gathers", "reset_grads",
                     "close_comm_window"]
    calls.clear()
    opt.step()  # no gradient: phase 1 only, and nothing to gather
    assert calls == ["begin_step", "finish_grad_reduction", "reset_grads", "close_comm_window"]
    assert opt.last_step_skipped


# ---------------------------------------------------------------------------- either engine, 2 ranks
def losses_with_engine(engine: str, steps: int, broken: str = "") -> list[float]:
    """On every rank: the losses of ``steps`` steps through ``engine``, with one of its methods
    broken (``broken``: 'launch_gathers' does nothing; 'finish_grad_reduction' says no gradient)."""
    from tests.fsdp2 import cases

    cases.pin_gemm()
    torch.manual_seed(0)
    model = cases.make_model("fp32")
    if engine == "fsdp2":
        cases.shard(model)
    opt = cases.make_opt(model, engine, grad_dtype=torch.float32)
    if broken == "launch_gathers":
        opt.engine.launch_gathers = lambda scale_inv: None
    elif broken == "finish_grad_reduction":
        real = opt.engine.finish_grad_reduction
        opt.engine.finish_grad_reduction = lambda: real() and False
    return cases.train_steps(model, opt, range(steps))


@pytest.mark.parametrize("broken", ["launch_gathers", "finish_grad_reduction"])
def test_either_engine_gives_the_same_losses_and_a_broken_method_shows(dist_pools, broken):
    pool = dist_pools(2)
    flat = pool.run(losses_with_engine, "flat", 4)[0]
    fsdp2 = pool.run(losses_with_engine, "fsdp2", 4)[0]
    assert fsdp2 == flat
    assert flat[-1] < flat[0]
    for engine in ("flat", "fsdp2"):
        bad = pool.run(losses_with_engine, engine, 4, broken)[0]
        if broken == "launch_gathers" and engine == "fsdp2":
            # FSDP2 gathers at the next forward by itself: only the scales are stale
            assert bad != fsdp2
        else:
            assert bad != flat, engine
