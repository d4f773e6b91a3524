"""From a folder of text to a model people can use: prepare -> train -> export -> transformers,
generate, evaluate, TensorBoard. One small run (in this process) serves every test."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml

from fp8shard import evaluate as evaluate_cli
from fp8shard import export as export_cli
from fp8shard import generate as generate_cli
from fp8shard.checkpoint import read_model_state
from fp8shard.data.prepared import prepare
from fp8shard.data.tokenizer import BPETokenizer
from fp8shard.models import GPT, GPTConfig
from fp8shard.pretrained import open_pretrained
from fp8shard.train.config import ConfigError
from fp8shard.train.metrics import read_metrics
from tests.use.common import train, write_corpus

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A prepared BPE corpus and a 4-step FP8 run on it with checkpoints and TensorBoard events."""
    root = tmp_path_factory.mktemp("use")
    prep = prepare([write_corpus(root / "corpus")], root / "data", vocab_size=320)
    run_dir = root / "runs" / "text"
    trainer = train(run_dir, f"data.path={prep.out}", f"trainer.max_steps={STEPS}",
                    "checkpoint.every_n_steps=2", "exp_manager.create_tensorboard_logger=true")
    return prep, run_dir, trainer


def test_the_run_reads_the_prepared_tokens_and_reports_bits_per_byte(run):
    prep, run_dir, trainer = run
    data = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]
    assert data["source"] == "tokens" and data["tokenizer"] == str(prep.out / "tokenizer.json")
    assert data["vocab_size"] == 320 and trainer.model.wte.weight.shape[0] == 320
    # The tokenizer travels with the run directory.
    assert (run_dir / "tokenizer.json").read_bytes() == (prep.out / "tokenizer.json").read_bytes()
    # Bits per byte: the validation loss in bits over the bytes the validation targets stand for.
    summary = json.loads((run_dir / "summary.json").read_text())
    tok = BPETokenizer(prep.out / "tokenizer.json")
    n = 2 * 8  # limit_val_batches x global_batch_size windows of 32 tokens
    targets = trainer.data.val[1:n * 32 + 1]
    n_bytes = len(tok.decode([t for t in targets if t != tok.eot_id]).encode())
    want = summary["val_loss"] * len(targets) / (n_bytes * math.log(2))
    assert summary["val_bpb"] == pytest.approx(want, rel=1e-9)
    vals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    factor = want / summary["val_loss"]
    assert vals and all(r["val_bpb"] == pytest.approx(r["val_loss"] * factor) for r in vals)


def test_open_pretrained_rebuilds_config_and_tokenizer(run):
    _, run_dir, trainer = run
    pre = open_pretrained(run_dir)
    assert pre.checkpoint.name == f"step_{STEPS:08d}" and pre.step == STEPS and pre.run_dir == run_dir
    assert pre.gpt_config == trainer.model.config
    assert pre.tokenizer is not None and pre.tokenizer.path == run_dir / "tokenizer.json"
    assert open_pretrained(run_dir / "checkpoints" / "step_00000002").step == 2


def test_export_hf_loads_in_transformers_with_our_logits(run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")  # in the dev extra: never skipped in CI
    _, run_dir, _ = run
    out = tmp_path / "hf"
    assert export_cli.main([str(run_dir), "--to", "hf", "--out", str(out)]) == 0
    assert "master weights in fp32" in capsys.readouterr().out
    # JSON and safetensors only: nothing pickled.
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                    "tokenizer_config.json"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    pre = open_pretrained(run_dir)
    text = "The king and the queen speak of love, and the lord will weep."
    ids = pre.tokenizer.encode(text)
    assert hf_tok(text)["input_ids"] == ids and hf_tok.decode(ids) == text
    ours = pre.model()  # fp32, from the FP32 masters: what the export holds
    x = torch.tensor([ids + ids[:32 - len(ids)]])
    with torch.no_grad():
        diff = (ours(x) - hf(x).logits).abs().max().item()
    assert diff < 1e-3, diff  # observed ~1e-6 (fp32, different op order)


def test_export_safetensors_keeps_the_fp32_masters_and_the_config(run, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    _, run_dir, _ = run
    assert export_cli.main([str(run_dir), "--to", "safetensors", "--out", str(tmp_path / "st")]) == 0
    path = tmp_path / "st" / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["fp8shard.source"] == "master" and meta["fp8shard.dtype"] == "float32"
    got = load_file(str(path))
    masters = read_model_state(run_dir / "checkpoints", source="master", dtype=torch.float32)
    assert sorted(got) == sorted(masters) and all(torch.equal(got[n], masters[n]) for n in got)
    model = GPT(GPTConfig(**json.loads(meta["fp8shard.gpt_config"])))
    model.load_state_dict(got)
    assert (tmp_path / "st" / "tokenizer.json").exists()
    assert export_cli.main([str(run_dir), "--to", "safetensors", "--out", str(tmp_path / "bf"),
                            "--dtype", "bf16", "--source", "weights"]) == 0
    bf = load_file(str(tmp_path / "bf" / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in bf.values())


def test_hf_export_names_the_architecture_gpt2_lacks(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "llama"
    train(run_dir, "model.normalization=rmsnorm", "model.activation=swiglu", "trainer.max_steps=1",
          "checkpoint.every_n_steps=1", "data.num_train_tokens=20000", "data.num_val_tokens=5000")
    assert export_cli.main([str(run_dir), "--to", "hf", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("python -m fp8shard.export: error: --to hf writes GPT2LMHeadModel")
    assert "model.normalization=rmsnorm (GPT2LMHeadModel has LayerNorm)" in err[0]
    assert "model.activation=swiglu" in err[0] and "--to safetensors" in err[0]
    assert not (tmp_path / "x").exists()
    # The generated corpus has no text: safetensors without a tokenizer; generation takes ids.
    assert export_cli.main([str(run_dir), "--to", "safetensors", "--out", str(tmp_path / "y")]) == 0
    assert "no tokenizer" in capsys.readouterr().out
    assert generate_cli.main([str(run_dir), "--prompt", "hi"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err
    assert generate_cli.main([str(run_dir), "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]) == 0
    assert len(capsys.readouterr().out.split()) == 7


def _generate(run_dir, capsys, *args):
    assert generate_cli.main([str(run_dir), "--prompt", "The king", "--max-new-tokens", "12", *args]) == 0
    return capsys.readouterr().out


def test_generate_is_deterministic_with_a_seed(run, capsys):
    _, run_dir, _ = run
    a = _generate(run_dir, capsys, "--seed", "3")
    assert a.startswith("The king") and a == _generate(run_dir, capsys, "--seed", "3")
    others = {_generate(run_dir, capsys, "--seed", str(s), "--temperature", "1.5", "--top-k", "0")
              for s in range(3)}
    assert len(others) > 1
    greedy = _generate(run_dir, capsys, "--temperature", "0", "--seed", "1")
    assert greedy == _generate(run_dir, capsys, "--temperature", "0", "--seed", "2")
    pre = open_pretrained(run_dir)
    model = pre.model()
    ids = pre.tokenizer.encode("The king")
    out = generate_cli.sample(model, ids, 5, temperature=0.0)
    with torch.no_grad():  # greedy: each token is the argmax after the ones before
        for i in range(len(ids), len(out)):
            assert out[i] == int(model(torch.tensor([out[:i]]))[0, -1].argmax())
    assert _generate(run_dir, capsys, "--precision", "trained", "--seed", "3").startswith("The king")


def test_evaluate_prints_the_runs_validation_loss_again(run, tmp_path, capsys):
    prep, run_dir, _ = run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert evaluate_cli.main([str(run_dir), "--json", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    got = json.loads((tmp_path / "e.json").read_text())
    assert got["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)  # one rank: the same numbers
    assert got["bits_per_byte"] == pytest.approx(summary["val_bpb"], rel=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(summary["val_loss"]), rel=1e-6)
    assert f"loss {summary['val_loss']:.4f} nats/token" in out and "bits/byte" in out
    # Another file: text is tokenized with the run's tokenizer; a prepared file must share it.
    text = tmp_path / "more.txt"
    text.write_text("The queen will speak, and the king will weep.\n" * 40)
    assert evaluate_cli.main([str(run_dir), "--data", str(text), "--precision", "fp32"]) == 0
    assert "windows" in capsys.readouterr().out
    other = prepare([text], tmp_path / "other", vocab_size=270)
    assert evaluate_cli.main([str(run_dir), "--data", str(other.out)]) == 2
    assert "not with the run's tokenizer" in capsys.readouterr().err
    assert evaluate_cli.main([str(run_dir), "--data", str(prep.out), "--max-windows", "4"]) == 0


def test_tensorboard_events_hold_the_logged_scalars(run):
    pytest.importorskip("tensorboard")  # in the dev extra: never skipped in CI
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir, _ = run
    assert list(run_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    records = read_metrics(run_dir / "metrics.jsonl")
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in records]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    tags = set(acc.Tags()["scalars"])
    assert {"train/lr", "perf/tokens_per_s", "train/grad_norm", "faults/skipped_steps", "val/loss",
            "val/bits_per_byte"} <= tags
    comm = [t for t in tags if t.startswith("comm/")]
    assert comm and acc.Scalars(comm[0])[-1].step == STEPS


def test_tensorboard_missing_is_one_clear_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else
                        real(name, *a))
    with pytest.raises(ConfigError, match=r"needs the `tensorboard` package: pip install tensorboard"):
        train(tmp_path / "r", "exp_manager.create_tensorboard_logger=true", "trainer.max_steps=1",
              "data.num_train_tokens=20000", "data.num_val_tokens=5000")


def test_commands_have_help(capsys):
    for cli, words in ((export_cli, "--to"), (generate_cli, "--max-new-tokens"), (evaluate_cli, "--data")):
        with pytest.raises(SystemExit) as e:
            cli.main(["--help"])
        assert e.value.code == 0 and words in capsys.readouterr().out


def test_token_ids_beyond_the_tokenizer_are_never_sampled(run):
    _, run_dir, _ = run
    pre = open_pretrained(run_dir)
    model = pre.model()
    out = generate_cli.sample(model, [5], 50, temperature=2.0, top_k=None, vocab_limit=100, seed=0)
    assert max(out[1:]) < 100 and np.all(np.asarray(out) >= 0)


def test_a_byte_level_run_exports_a_tokenizer_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    corpus = write_corpus(tmp_path / "corpus", files=1)
    run_dir = tmp_path / "runs" / "bytes"
    train(run_dir, f"data.path={corpus / 'part0.txt'}", "trainer.max_steps=1", "checkpoint.every_n_steps=1")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val_bpb"] == pytest.approx(summary["val_loss"] / math.log(2))  # one byte per token
    assert export_cli.main([str(run_dir), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "H\u00e9llo \u2014 the king\u2019s crown"
    assert tok(text)["input_ids"] == list(text.encode()) and tok.decode(list(text.encode())) == text
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    x = torch.tensor([list(text.encode())])
    with torch.no_grad():
        assert (open_pretrained(run_dir).model()(x) - hf(x).logits).abs().max().item() < 1e-3
