"""The configuration: defaults, presets, overrides, and one clear message per mistake."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fp8shard.train.config import (
    DEFAULTS_PATH,
    PRESETS_DIR,
    Config,
    ConfigError,
    help_text,
    iter_keys,
    load_config,
    to_dict,
)

KEYS_SNAPSHOT = Path(__file__).with_name("golden") / "config_keys.txt"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_defaults_yaml_holds_every_key_with_the_schema_default():
    from_yaml = _flat(yaml.safe_load(DEFAULTS_PATH.read_text()))
    from_schema = _flat(to_dict(Config()))
    assert sorted(from_yaml) == sorted(from_schema)
    assert from_yaml == from_schema


def test_keys_match_the_snapshot_so_the_cli_does_not_grow_by_accident():
    # A new key is fine: add it to defaults.yaml, docs/training.md and this snapshot.
    keys = [k for k, _, _ in iter_keys()]
    assert keys == KEYS_SNAPSHOT.read_text().split()


def test_every_key_has_a_doc_and_help_lists_it():
    text = help_text()
    for key, _, doc in iter_keys():
        assert doc, f"{key} has no docstring in config.py"
        assert f"  {key}=" in text
        assert doc in text


def test_overrides_are_parsed_as_yaml_and_coerced():
    cfg = load_config(["model.optim.lr=3e-4", "model.optim.betas=[0.8,0.99]", "trainer.precision=32",
                       "model.fp8=false", "model.fp8_params=false", "trainer.devices=1",
                       "data.path=null"], world_size=1)
    assert cfg.model.optim.lr == pytest.approx(3e-4)
    assert cfg.model.optim.betas == [0.8, 0.99]
    assert cfg.trainer.precision == "32"
    assert cfg.model.fp8 is False and cfg.trainer.devices == 1 and cfg.data.path is None


def test_later_sources_win_preset_then_override(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("model:\n  num_layers: 6\n  optim:\n    lr: 0.001\n")
    cfg = load_config([f"config={preset}", "model.optim.lr=0.002"], world_size=1)
    assert cfg.model.num_layers == 6 and cfg.model.optim.lr == 0.002
    assert cfg.model.hidden_size == Config().model.hidden_size
    cfg = load_config(["--config", str(preset)], world_size=1)
    assert cfg.model.num_layers == 6


def test_gpt_125m_preset_is_a_125m_gpt():
    from fp8shard.models import GPT
    from fp8shard.train.builders import gpt_config

    assert (PRESETS_DIR / "gpt_125m.yaml").exists()
    cfg = load_config(["config=gpt_125m"], world_size=8, validate_cfg=False)
    assert cfg.trainer.accelerator == "gpu" and cfg.model.fp8_params
    assert cfg.model.fp8_recipe == "current"  # the faster recipe on the GPU (docs/benchmarks.md)
    with torch.device("meta"):
        n = GPT(gpt_config(cfg, 50304)).num_params()
    assert 115e6 < n < 135e6, n


BAD = [
    (["model.foo=1"], 1, "unknown key 'model.foo'. .*Valid keys in model: micro_batch_size"),
    (["model.fp8_parms=true"], 1, "Did you mean 'model.fp8_params'"),
    (["trainr.max_steps=3"], 1, "unknown key 'trainr.max_steps'. Did you mean 'trainer'"),
    (["model.num_layers=abc"], 1, "model.num_layers: expected an integer, got 'abc'"),
    (["model.num_layers=2.5"], 1, "model.num_layers: expected an integer, got 2.5"),
    (["model.fp8=maybe"], 1, "model.fp8: expected true or false, got 'maybe'"),
    (["model.optim.lr=fast"], 1, "model.optim.lr: expected a number, got 'fast'"),
    (["model.optim.name=sgd"], 1, "model.optim.name: 'sgd' is not one of: distributed_fused_adam, adamw"),
    (["trainer.accelerator=tpu"], 1, "trainer.accelerator: 'tpu' is not one of: cpu, gpu, auto"),
    (["trainer.precision=16"], 1, "trainer.precision: '16' is not one of: bf16-mixed, 32"),
    (["trainer.devices=many"], 1, "trainer.devices: expected int | auto, got 'many'"),
    (["model=3"], 1, "'model' is a section, not a value; set its keys, e.g. model.micro_batch_size="),
    (["model.optim.lr.x=3"], 1, "'model.optim.lr' is a value, not a section"),
    (["bogus"], 1, "bad argument 'bogus': expected key=value"),
    (["=3"], 1, "the key is empty"),
    (["model.fp8=false"], 1, "model.fp8_params=true needs model.fp8=true"),
    (["model.optim.name=adamw"], 1, "model.fp8_params=true needs model.optim.name=distributed_fused_adam"),
    (["model.global_batch_size=12"], 1,
     r"model.global_batch_size \(12\) must be divisible by model.micro_batch_size \(8\) "
     r"x world size \(1\) = 8"),
    (["model.global_batch_size=24"], 2,
     r"model.global_batch_size \(24\) must be divisible by .* x world size \(2\) = 16"),
    (["trainer.devices=2"], 1, r"trainer.devices=2 but 1 process\(es\) were launched"),
    (["model.hidden_size=130"], 1,
     r"model.hidden_size \(130\) must be divisible by model.num_attention_heads"),
    (["model.position_embedding_type=rope", "model.hidden_size=12", "model.num_attention_heads=4"], 1,
     "rope needs an even head dim"),
    (["model.optim.lr=-1"], 1, "model.optim.lr must be > 0, got -1.0"),
    (["trainer.max_steps=0"], 1, "trainer.max_steps must be > 0"),
    (["model.optim.betas=[0.9]"], 1, r"model.optim.betas must be two numbers in \[0, 1\)"),
    (["model.optim.sched.min_lr=1"], 1, r"model.optim.sched.min_lr \(1.0\) must be <= model.optim.lr"),
    (["model.encoder_seq_length=256", "model.max_position_embeddings=128"], 1,
     r"model.max_position_embeddings \(128\) must be 0 or >= model.encoder_seq_length \(256\)"),
    (["data.source=text"], 1, "data.source=text needs data.path"),
    (["data.source=tokens", "data.path=/no/such/file.bin"], 1, "data.path: no such file '/no/such/file.bin'"),
    (["data.source=markov", "data.tokenizer=tok.json"], 1,
     "data.tokenizer is only used with data.source=text"),
    (["data.markov_spread=200"], 1, "data.markov_spread must be in"),
    (["trainer.resume=/no/such/ckpt"], 1,
     "trainer.resume: '/no/such/ckpt' is neither auto, never, nor an existing checkpoint directory"),
    (["trainer.max_steps=10", "model.optim.sched.max_steps=5"], 1,
     r"model.optim.sched.max_steps \(5\) must be 0 or >= trainer.max_steps \(10\)"),
    (["config=no_such_preset"], 1, r"config: no such file 'no_such_preset' \(shipped presets: gpt_125m"),
]


@pytest.mark.parametrize(("overrides", "world_size", "message"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_config_names_the_key(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides, world_size=world_size)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match=r"trainer\.accelerator=gpu but CUDA is not available"):
        load_config(["trainer.accelerator=gpu"], world_size=1)


def test_the_command_exits_2_with_one_message_and_no_traceback():
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "fp8shard.train", "model.fp8_parms=true"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    expected = "fp8shard.train: error: unknown key 'model.fp8_parms'. Did you mean 'model.fp8_params'?"
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_help_lists_keys_and_exits_0():
    proc = subprocess.run([sys.executable, "-m", "fp8shard.train", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    assert "model.optim.sched.warmup_steps=30" in proc.stdout
    assert "distributed_fused_adam (fp8shard's ZeRO optimizer)" in proc.stdout


def test_schema_fields_are_dataclasses_all_the_way_down():
    # The YAML section tree and the dataclass tree are the same shape.
    for f in dataclasses.fields(Config):
        assert dataclasses.is_dataclass(f.type) or isinstance(f.type, str)


def test_the_transformer_shape_is_declared_once():
    """GPTConfig and the model section share one TransformerShape: neither re-declares a shape
    field, and every shape key reaches the GPT the command builds."""
    import inspect

    from fp8shard.models import GPTConfig, TransformerShape
    from fp8shard.train.builders import gpt_config
    from fp8shard.train.config import ModelConfig

    shape = [f.name for f in dataclasses.fields(TransformerShape)]
    assert "num_layers" in shape and "hidden_size" in shape
    for cls in (GPTConfig, ModelConfig):
        assert issubclass(cls, TransformerShape)
        assert not set(shape) & set(inspect.get_annotations(cls)), cls
    cfg = load_config(["model.num_layers=3", "model.hidden_size=96", "model.num_attention_heads=3",
                       "model.ffn_hidden_size=200", "model.activation=swiglu", "model.normalization=rmsnorm",
                       "model.position_embedding_type=rope", "model.bias=false", "model.hidden_dropout=0.1",
                       "model.share_embeddings_and_output_weights=false"], world_size=1)
    g = gpt_config(cfg, 300)
    assert {k: getattr(g, k) for k in shape} == {k: getattr(cfg.model, k) for k in shape}
    assert (g.num_layers, g.activation, g.bias, g.vocab_size) == (3, "swiglu", False, 300)


@pytest.mark.parametrize("accelerator", ["auto", "gpu"], ids=["auto", "named"])
def test_more_ranks_than_gpus_is_a_clear_error_before_nccl(monkeypatch, accelerator):
    """Two ranks on a node with one GPU: a ConfigError naming the fix, not NCCL's 'Duplicate GPU
    detected' from inside init_process_group (which must not be reached)."""
    from fp8shard.train import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda *a, **k: pytest.fail("init_process_group reached"))
    with pytest.raises(ConfigError, match=r"2 processes on this node but 1 GPU.*--nproc-per-node=1.*"
                                          r"trainer\.accelerator=cpu"):
        distributed.init_distributed(accelerator)
