"""Bad checkpoints and mismatched models: a clear error naming the problem, nothing loaded.

Single process: a tiny FP8 GPT + DistributedFusedAdam without a process group.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from fp8shard.checkpoint import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from fp8shard.fp8 import Float8Tensor
from tests.checkpoint import cases


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A 2-step checkpoint of the FP8 model, and digests of what it holds."""
    root = tmp_path_factory.mktemp("ck")
    model, opt = cases.build()
    cases.train(model, opt, 0, 2)
    path = save_checkpoint(root / "step_2", model, opt, step=2)
    return path, {"model": cases.model_digests(model), "optim": cases.optimizer_digest(opt)}


@pytest.fixture
def fresh():
    model, opt = cases.build(seed=7)
    before = (cases.model_digests(model), cases.optimizer_digest(opt))
    yield model, opt
    # Every failing load must leave model and optimizer exactly as they were.
    assert (cases.model_digests(model), cases.optimizer_digest(opt)) == before


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_round_trip_restores_everything_bit_exactly(saved, tmp_path):
    path, want = saved
    model, opt = cases.build(seed=7)
    assert cases.model_digests(model) != want["model"]
    info = load_checkpoint(path, model, opt)
    assert cases.model_digests(model) == want["model"]  # FP8 bytes, scales, amax histories
    assert cases.optimizer_digest(opt) == want["optim"]  # master, moments, step, weight scales
    assert info.step == 2 and info.world_size == 1 and info.rng_restored


def test_missing_directory(fresh, tmp_path):
    model, opt = fresh
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as e:
        load_checkpoint(tmp_path / "nope", model, opt)
    assert str(tmp_path / "nope") in str(e.value)
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path, model, opt)  # exists, but holds nothing


def test_truncated_shard(saved, fresh, tmp_path):
    ck = _copy(saved[0], tmp_path / "step_2")
    shard = ck / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointFormatError, match=r"__0_0\.distcp has \d+ bytes.*truncated"):
        load_checkpoint(ck, *fresh)


def test_corrupted_shard(saved, fresh, tmp_path):
    ck = _copy(saved[0], tmp_path / "step_2")
    shard = ck / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match=r"__0_0\.distcp is corrupted"):
        load_checkpoint(ck, *fresh)


def test_missing_metadata_is_incomplete(saved, fresh, tmp_path):
    ck = _copy(saved[0], tmp_path / "step_2")
    (ck / ".metadata").unlink()
    with pytest.raises(CheckpointFormatError, match=r"\.metadata is missing"):
        load_checkpoint(ck, *fresh)
    (ck / "manifest.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
        load_checkpoint(ck, *fresh)


def test_newer_format_version(saved, fresh, tmp_path):
    ck = _copy(saved[0], tmp_path / "step_2")
    m = json.loads((ck / "manifest.json").read_text())
    assert m["version"] == 1  # per-tensor FP8 weights: what every release reads
    m["version"] = 3
    (ck / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointFormatError, match=r"format version 3.*reads versions up to 2.*upgrade"):
        load_checkpoint(ck, *fresh)


def test_other_model_shape_names_parameter_and_shapes(saved):
    from fp8shard.models import GPT, GPTConfig
    from fp8shard.optim import DistributedFusedAdam

    cfg = GPTConfig(vocab_size=cases.VOCAB, max_position_embeddings=cases.SEQ, num_layers=2,
                    hidden_size=32, ffn_hidden_size=48, num_attention_heads=2)
    model = GPT(cfg)
    opt = DistributedFusedAdam(model.parameters())
    before = cases.model_digests(model)
    with pytest.raises(CheckpointMismatchError) as e:
        load_checkpoint(saved[0], model, opt)
    msg = str(e.value)
    assert "'blocks.0.mlp.fc1.weight': the checkpoint has shape (64, 32), the model has (48, 32)" in msg
    assert "nothing was loaded" in msg
    assert cases.model_digests(model) == before


def test_other_model_keys(saved):
    from fp8shard.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=cases.VOCAB, max_position_embeddings=cases.SEQ, num_layers=3,
                    hidden_size=32, ffn_hidden_size=64, num_attention_heads=2)
    with pytest.raises(CheckpointMismatchError, match=r"lacks \d+ entries of the model: 'blocks\.2\."):
        load_checkpoint(saved[0], GPT(cfg))


def test_optimizer_kind_mismatch(saved):
    model, _ = cases.build(seed=3)
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointMismatchError, match=r"optimizer is distributed_fused_adam, this one is "
                                                      r"torch\.optim\.AdamW"):
        load_checkpoint(saved[0], model, adamw)


def test_metadata_pickle_with_code_is_refused(saved, fresh, tmp_path):
    ck = _copy(saved[0], tmp_path / "step_2")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ck / ".metadata").write_bytes(pickle.dumps(Evil()))
    m = json.loads((ck / "manifest.json").read_text())  # make the file set consistent again
    import hashlib

    m["files"][".metadata"] = {"size": (ck / ".metadata").stat().st_size,
                               "sha256": hashlib.sha256((ck / ".metadata").read_bytes()).hexdigest()}
    (ck / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointFormatError, match=r"refers to (posix|os|nt)\.system.*refused"):
        load_checkpoint(ck, *fresh)
    assert not marker.exists()


def test_extra_must_be_json(tmp_path):
    model, opt = cases.build()
    with pytest.raises(CheckpointError, match="JSON-serializable"):
        save_checkpoint(tmp_path / "step_0", model, opt, extra={"bad": object()})
    assert not any(tmp_path.iterdir()) or not (tmp_path / "step_0").exists()


def test_fp8_checkpoint_into_high_precision_model_and_back(saved, tmp_path):
    """Converted, not refused: FP8 bytes dequantize into bf16 weights; bf16 weights quantize
    into FP8 ones; the FP32 master and Adam states load exactly either way."""
    path, _ = saved
    hp_model, hp_opt = cases.build(seed=5, fp8=False)
    load_checkpoint(path, hp_model, hp_opt)
    fp8_model, fp8_opt = cases.build(seed=6)
    load_checkpoint(path, fp8_model, fp8_opt)
    for (n, hp), (_, f8) in zip(hp_model.named_parameters(), fp8_model.named_parameters(), strict=True):
        if isinstance(f8, Float8Tensor):
            assert not isinstance(hp, Float8Tensor)
            assert torch.equal(hp.detach(), f8.dequantize(hp.dtype)), n
        else:
            assert torch.equal(hp.detach(), f8.detach()), n
    masters = {i: s["master"] for i, s in cases.optimizer_full(fp8_opt).items() if i >= 0}
    for i, s in cases.optimizer_full(hp_opt).items():
        if i >= 0:
            assert torch.equal(s["master"], masters[i])
    # ... and back: the high-precision checkpoint into an FP8 model quantizes each weight.
    hp_path = save_checkpoint(tmp_path / "hp" / "step_2", hp_model, hp_opt, step=2)
    back, back_opt = cases.build(seed=8)
    load_checkpoint(hp_path, back, back_opt)
    for (n, hp), (_, f8) in zip(hp_model.named_parameters(), back.named_parameters(), strict=True):
        if isinstance(f8, Float8Tensor):
            expect = Float8Tensor.quantize(hp.detach())
            assert torch.equal(f8.uint8_view(), expect.uint8_view()), n
            assert torch.equal(f8.scale_inv, expect.scale_inv), n
    back_masters = {i: s["master"] for i, s in cases.optimizer_full(back_opt).items() if i >= 0}
    assert all(torch.equal(back_masters[i], masters[i]) for i in masters)


def test_listing_skips_unreadable_manifests(saved, tmp_path):
    """A manifest that is a FIFO (reading it would block) or far too large is never read whole:
    such a directory is not a complete checkpoint, and the genuine one beside it is found."""
    root = tmp_path / "root"
    root.mkdir()
    _copy(saved[0], root / "step_00000002")
    fifo = _copy(saved[0], root / "step_00000003")
    (fifo / "manifest.json").unlink()
    os.mkfifo(fifo / "manifest.json")
    big = _copy(saved[0], root / "step_00000004")
    with open(big / "manifest.json", "r+b") as f:
        f.truncate(300 << 20)  # sparse
    assert list_checkpoints(root) == [root / "step_00000002"]
    with pytest.raises(CheckpointFormatError, match=r"manifest\.json is not a regular file"):
        read_manifest(fifo)
