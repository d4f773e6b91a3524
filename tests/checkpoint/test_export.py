"""Weights only: loading for evaluation or fine-tuning, importing high-precision state dicts into
an FP8 model, exporting one consolidated safetensors file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8shard.checkpoint import (
    CheckpointMismatchError,
    export_safetensors,
    import_hf_state_dict,
    load_model_weights,
    read_model_state,
    save_checkpoint,
)
from fp8shard.fp8 import Float8Tensor
from fp8shard.optim import DistributedFusedAdam
from tests.checkpoint import cases


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model trained 2 steps, its checkpoint, and its FP32 masters by parameter name."""
    model, opt = cases.build()
    cases.train(model, opt, 0, 2)
    path = save_checkpoint(tmp_path_factory.mktemp("ck") / "step_2", model, opt, step=2)
    return model, path, cases.masters_by_name(model, opt)


def _hp_state_dict(seed: int = 11) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model, _ = cases.build(seed=seed, fp8=False)
    return {n: (p.detach().float() * 1.5) for n, p in model.named_parameters()}


def test_load_model_weights_then_fine_tune_starts_from_the_master(trained):
    model, path, masters = trained
    fresh = cases.build(seed=4)[0]  # its optimizer is thrown away: weights only
    info = load_model_weights(path, fresh)
    assert info.step == 2
    assert cases.model_digests(fresh) == cases.model_digests(model)  # bytes, scales, histories
    fp8_names = [n for n, p in fresh.named_parameters() if isinstance(p, Float8Tensor)]
    assert fp8_names
    for n in fp8_names:
        hp = dict(fresh.named_parameters())[n].get_high_precision_init_val()
        assert torch.equal(hp.reshape(-1), masters[n])
    # An optimizer built now starts its FP32 master from the saved master, not from the bytes.
    new = cases.masters_by_name(fresh, DistributedFusedAdam(fresh.parameters()))
    assert all(torch.equal(new[n], masters[n]) for n in fp8_names)


def test_load_model_weights_into_a_high_precision_model(trained):
    model, path, _ = trained
    hp = cases.build(seed=4, fp8=False)[0]
    load_model_weights(path, hp)
    for (n, a), (_, b) in zip(model.named_parameters(), hp.named_parameters(), strict=True):
        want = a.dequantize(b.dtype) if isinstance(a, Float8Tensor) else a.detach()
        assert not isinstance(b, Float8Tensor) and torch.equal(b.detach(), want), n


def test_import_hf_state_dict_quantizes_fp8_weights(tmp_path):
    sd = _hp_state_dict()
    hf = {f"model.{k}": v for k, v in sd.items()}  # Hugging Face-style prefix
    model = cases.build(seed=3)[0]
    loaded = import_hf_state_dict(model, hf)
    assert sorted(loaded) == sorted(sd)
    for n, p in model.named_parameters():
        if isinstance(p, Float8Tensor):
            q = Float8Tensor.quantize(sd[n])
            assert torch.equal(p.uint8_view(), q.uint8_view()) and torch.equal(p.scale_inv, q.scale_inv), n
            assert torch.equal(p.get_high_precision_init_val(), sd[n])  # master will start exactly here
        else:
            assert torch.equal(p.detach(), sd[n].to(p.dtype)), n
    new = cases.masters_by_name(model, DistributedFusedAdam(model.parameters()))
    for n, p in model.named_parameters():
        if isinstance(p, Float8Tensor):
            assert torch.equal(new[n], sd[n].reshape(-1)), n


def test_import_from_a_safetensors_file(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    sd = _hp_state_dict()
    safetensors.save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    model = cases.build(seed=3)[0]
    import_hf_state_dict(model, tmp_path)  # a Hugging Face model directory
    w = model.blocks[0].mlp.fc1.weight
    assert torch.equal(w.uint8_view(), Float8Tensor.quantize(sd["blocks.0.mlp.fc1.weight"]).uint8_view())


def test_import_errors_name_the_problem_and_load_nothing():
    sd = _hp_state_dict()
    model = cases.build(seed=3)[0]
    before = cases.model_digests(model)
    bad = dict(sd, **{"blocks.1.attn.proj.weight": torch.zeros(32, 31)})
    with pytest.raises(CheckpointMismatchError, match=r"'blocks\.1\.attn\.proj\.weight': the state dict has "
                                                      r"shape \(32, 31\), the model has \(32, 32\)"):
        import_hf_state_dict(model, bad)
    with pytest.raises(CheckpointMismatchError, match=r"entries the model lacks: 'lm_head\.bias'.*key_map"):
        import_hf_state_dict(model, dict(sd, **{"lm_head.bias": torch.zeros(3)}))
    assert cases.model_digests(model) == before
    renamed = {f"h.{k}": v for k, v in sd.items()}
    import_hf_state_dict(model, renamed, key_map=lambda k: k.removeprefix("h."))
    assert cases.model_digests(model) != before


def test_export_safetensors(trained, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    model, path, masters = trained
    out = export_safetensors(path, None, tmp_path / "out" / "model.safetensors")
    got = safetensors.load_file(str(out))
    params = dict(model.named_parameters())
    assert sorted(got) == sorted(params)  # parameters only: no amax histories
    for n, p in params.items():
        want = p.dequantize(torch.bfloat16) if isinstance(p, Float8Tensor) else p.detach().to(torch.bfloat16)
        assert got[n].dtype == torch.bfloat16 and torch.equal(got[n], want), n
    # The same file from the live model; and the FP32 masters on request.
    live = safetensors.load_file(str(export_safetensors(None, model, tmp_path / "live.safetensors")))
    assert all(torch.equal(live[n], got[n]) for n in got)
    hp = safetensors.load_file(str(export_safetensors(path, None, tmp_path / "m.safetensors",
                                                      source="master", dtype=torch.float32)))
    for n in params:
        assert torch.equal(hp[n].reshape(-1), masters[n]), n
    assert not any(Path(tmp_path / "out").glob(".*tmp*"))


def test_masters_are_never_rounded_unless_a_dtype_says_so(trained, tmp_path):
    """``source="master"`` without a dtype keeps the FP32 masters (it used to round them to bf16)."""
    safetensors = pytest.importorskip("safetensors.torch")
    _, path, masters = trained
    sd = read_model_state(path, source="master")
    assert all(t.dtype == torch.float32 and torch.equal(t.reshape(-1), masters[n]) for n, t in sd.items())
    out = export_safetensors(path, None, tmp_path / "m.safetensors", source="master")
    got = safetensors.load_file(str(out))
    assert all(got[n].dtype == torch.float32 and torch.equal(got[n].reshape(-1), masters[n]) for n in masters)
    bf = safetensors.load_file(str(export_safetensors(path, None, tmp_path / "b.safetensors", source="master",
                                                      dtype=torch.bfloat16)))
    assert all(t.dtype == torch.bfloat16 for t in bf.values())
