"""Kernel switches are configuration with defaults: ``trainer.triton``, ``model.optim.fused`` and
``trainer.compile_backend`` reach the library calls they name (docs/training.md, "Kernel
switches"); no environment variable is read."""

from __future__ import annotations

import pytest
import torch

import fp8shard
from fp8shard.train import loop
from fp8shard.train.builders import build_model, build_optimizer, compile_scope_for, configure_compute
from fp8shard.train.config import ConfigError, load_config
from fp8shard.train.distributed import DistEnv
from tests.reliability.common import run_args

CPU = DistEnv(0, 1, 0, torch.device("cpu"), None)


def test_the_switches_default_to_on_inductor(tmp_path):
    cfg = load_config(run_args(tmp_path / "run"), world_size=1)
    assert cfg.trainer.triton is True and cfg.model.optim.fused is True
    assert cfg.trainer.compile_backend == "inductor"
    fp8shard.set_triton(False)
    configure_compute(cfg, CPU)
    assert fp8shard.get_triton() is True
    opt, _ = build_optimizer(cfg, build_model(cfg, 256, CPU.device), CPU)
    assert opt.fused is True


def test_trainer_triton_and_optim_fused_reach_the_library(tmp_path):
    cfg = load_config(run_args(tmp_path / "run", "trainer.triton=false", "model.optim.fused=false"),
                      world_size=1)
    configure_compute(cfg, CPU)
    assert fp8shard.get_triton() is False
    opt, _ = build_optimizer(cfg, build_model(cfg, 256, CPU.device), CPU)
    assert opt.fused is False and not opt._use_fused()


def test_trainer_compile_backend_reaches_torch_compile(tmp_path, monkeypatch):
    calls = []

    def recording_compile(model, recipe, scope, backend, mode):
        calls.append((scope, backend, mode))
        return 0

    monkeypatch.setattr(loop, "compile_model", recording_compile)
    cfg = load_config(run_args(tmp_path / "run", "trainer.compile=true", "trainer.compile_backend=eager",
                               "trainer.compile_scope=blocks"), world_size=1)
    trainer = loop.Trainer(cfg, CPU)
    trainer.close()
    assert calls == [("blocks", "eager", "default")]
    # The default scope: one graph on one process (nothing to overlap), regions on several.
    cfg = load_config(run_args(tmp_path / "run2", "trainer.compile=true", "trainer.compile_backend=eager"),
                      world_size=1)
    assert cfg.trainer.compile_scope == "auto" and cfg.trainer.compile_mode == "default"
    trainer = loop.Trainer(cfg, CPU)
    trainer.close()
    assert calls[-1] == ("graph", "eager", "default") and trainer.compile_scope == "graph"
    assert compile_scope_for("auto", 2) == "model" and compile_scope_for("blocks", 1) == "blocks"


def test_cuda_graphs_are_refused_where_they_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"compile_mode=reduce-overhead replays CUDA graphs and needs a "
                                          r"GPU; set trainer\.compile_mode=default on CPU"):
        load_config(run_args(tmp_path / "run", "trainer.compile_mode=reduce-overhead"), world_size=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"compiled flat-engine run; set trainer\.compile=true"):
        load_config(run_args(tmp_path / "run", "trainer.compile_mode=reduce-overhead",
                              "trainer.compile=false"), world_size=1)
    with pytest.raises(ConfigError, match=r"compile_mode: 'max' is not one of: default, reduce-overhead"):
        load_config(["trainer.compile_mode=max"], world_size=1)


def test_a_bad_switch_value_names_the_key_and_its_choices():
    with pytest.raises(ConfigError, match=r"trainer\.compile_backend: 'cudagraph' is not one of: inductor, "
                                          r"aot_eager, eager"):
        load_config(["trainer.compile_backend=cudagraph"], world_size=1)
    with pytest.raises(ConfigError, match=r"model\.optim\.fused: expected true or false"):
        load_config(["model.optim.fused=maybe"], world_size=1)


def test_trainer_compile_defaults_to_auto_compiled_on_cuda_only(tmp_path, monkeypatch):
    """Issue 16: the fast path is the default on the GPU; a CPU run stays eager."""
    from fp8shard.train.builders import compile_enabled

    cfg = load_config(run_args(tmp_path / "run"), world_size=1)
    assert cfg.trainer.compile == "auto"
    assert compile_enabled("auto", torch.device("cuda", 0)) is True
    assert compile_enabled("auto", torch.device("cpu")) is False
    assert compile_enabled(True, torch.device("cpu")) is True
    assert compile_enabled(False, torch.device("cuda", 0)) is False
    assert compile_enabled("auto", torch.device("cuda", 0), "fsdp2") is False  # not compiled yet
    calls = []
    monkeypatch.setattr(loop, "compile_model", lambda *a: calls.append(a) or 0)
    loop.Trainer(cfg, CPU).close()  # auto on CPU: not compiled
    assert calls == []
    with pytest.raises(ConfigError, match=r"trainer\.compile: expected bool \| auto"):
        load_config(["trainer.compile=sometimes"], world_size=1)
