"""The GPT: shapes, causality, flavours, scaled init, meta-device build."""

from __future__ import annotations

import math

import pytest
import torch

import fp8shard as fs
from fp8shard.models import GPT, GPTConfig

SMALL = dict(vocab_size=50, max_position_embeddings=16, num_layers=2, hidden_size=32,
             ffn_hidden_size=64, num_attention_heads=4)

FLAVOURS = [
    {},
    {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding_type": "rope", "bias": False},
    {"share_embeddings_and_output_weights": False},
]


@pytest.mark.parametrize("flavour", FLAVOURS, ids=["gpt2", "llama", "untied"])
def test_forward_shapes_loss_and_backward(flavour):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, **flavour))
    idx = torch.randint(0, 50, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 50)
    loss = model(idx, torch.randint(0, 50, (3, 16)))
    assert abs(loss.item() - math.log(50)) < 0.5  # near-uniform predictions at init
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("flavour", FLAVOURS, ids=["gpt2", "llama", "untied"])
def test_causal_future_tokens_do_not_change_past_logits(flavour):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, **flavour))
    a = torch.randint(0, 50, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 50
    la, lb = model(a), model(b)
    assert torch.allclose(la[0, :10], lb[0, :10], atol=1e-6)
    assert not torch.allclose(la[0, 10:], lb[0, 10:])


def test_projections_are_fp8shard_linears_and_the_rest_is_plain():
    model = GPT(GPTConfig(**SMALL))
    fp8_layers = [n for n, m in model.named_modules() if isinstance(m, fs.nn.Linear)]
    names = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    assert fp8_layers == [f"blocks.{i}.{p}" for i in range(2) for p in names]
    assert model.output is None  # tied: logits use the embedding
    assert len(model.linear_weights()) == 8


def test_scaled_init():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, max_position_embeddings=16, num_layers=8, hidden_size=256,
                    ffn_hidden_size=1024, num_attention_heads=4)
    model = GPT(cfg)
    b = model.blocks[0]
    assert b.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert b.mlp.fc2.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert b.attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert torch.all(b.attn.qkv.bias == 0) and torch.all(b.norm1.weight == 1)


def test_meta_build_materialize_init_equals_a_direct_build():
    cfg = GPTConfig(**SMALL, position_embedding_type="rope")
    direct = GPT(cfg)
    torch.manual_seed(1)
    direct.init_weights()
    with torch.device("meta"):
        lazy = GPT(cfg)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    torch.manual_seed(1)
    lazy.init_weights()
    for (n, a), (_, b) in zip(direct.state_dict().items(), lazy.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert torch.equal(direct.rope_cos, lazy.rope_cos)
    idx = torch.randint(0, 50, (2, 16))
    assert torch.equal(direct(idx), lazy(idx))


def test_fp8_weights_and_fp8_compute_stay_close_to_high_precision():
    from fp8shard.testing import sqnr_db

    torch.manual_seed(0)
    hp = GPT(GPTConfig(**SMALL))
    with fs.fp8_model_init():
        lp = GPT(GPTConfig(**SMALL))
    lp.load_state_dict(hp.state_dict())
    assert isinstance(lp.blocks[0].attn.qkv.weight, fs.Float8Tensor)
    idx = torch.randint(0, 50, (2, 16))
    with fs.fp8_autocast(recipe=fs.CurrentScaling()):
        out = lp(idx)
    assert sqnr_db(hp(idx), out) > 20


def test_too_long_sequence_and_bad_shapes_are_refused():
    model = GPT(GPTConfig(**SMALL))
    with pytest.raises(ValueError, match="longer than max_position_embeddings"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible by num_attention_heads"):
        GPTConfig(hidden_size=30, num_attention_heads=4)
