"""[Note: KV cache] (models/gpt.py): incremental decoding gives the whole-context model's logits,
and the sampler gives the same tokens with and without it, before and past the model's window."""

from __future__ import annotations

import pytest
import torch

import fp8shard as fs
from fp8shard import generate
from fp8shard.models import GPT, GPTConfig, KVCache
from fp8shard.testing import sqnr_db

FLAVOURS = {
    "learned-layernorm-gelu": dict(),
    "rope-rmsnorm-swiglu": dict(position_embedding_type="rope", normalization="rmsnorm", activation="swiglu",
                                bias=False, share_embeddings_and_output_weights=False),
}


def _model(flavour: str, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=50,
                    max_position_embeddings=16, **{**FLAVOURS[flavour], **kw})
    return GPT(cfg).eval()


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_cached_calls_give_the_whole_contexts_logits(flavour):
    """A prompt of 5, then one token at a time, then 3 at once, then one: every call's logits are
    those of the model run on the whole context up to that token (fp32, float rounding)."""
    model = _model(flavour)
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(model.config)
        got = [model(idx[:, :5], cache=cache)]
        for t in range(5, 9):
            got.append(model(idx[:, t:t + 1], cache=cache))
        got.append(model(idx[:, 9:12], cache=cache))  # several new tokens: a causal mask with an offset
        got.append(model(idx[:, 12:16], cache=cache))
    assert cache.length == 16
    torch.testing.assert_close(torch.cat(got, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="longer than max_position_embeddings"):
        model(idx[:, :1], cache=cache)
    small = KVCache(model.config, max_len=4)
    with pytest.raises(ValueError, match="the KV cache holds 4 positions, 5 tokens do not fit"):
        model(idx[:, :5], cache=small)


@pytest.mark.parametrize("flavour", list(FLAVOURS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampling_with_the_cache_is_sampling_without_it(flavour, temperature):
    """30 new tokens after a prompt of 4 with a window of 16: the cached calls up to the window,
    then the window run whole; the same tokens as running the whole context every time."""
    model = _model(flavour)
    kw = dict(temperature=temperature, top_k=None if temperature else 5, seed=3)
    with_cache = generate.sample(model, [1, 2, 3, 4], 30, **kw)
    without = generate.sample(model, [1, 2, 3, 4], 30, use_cache=False, **kw)
    assert len(with_cache) == 34 and with_cache == without
    assert generate.sample(model, list(range(16)), 3, **kw) == \
        generate.sample(model, list(range(16)), 3, use_cache=False, **kw)  # a prompt of the whole window


def test_the_cache_takes_the_dtype_computed_and_fp8_weights():
    """Under bf16 autocast the keys and values are kept in bf16; a model with FP8 weights computing
    in FP8 (current scaling: each call scales only its own tokens) stays close to its whole-context
    logits."""
    model = _model("learned-layernorm-gelu")
    idx = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = KVCache(model.config)
        inc = torch.cat([model(idx[:, :6], cache=cache)] + [model(idx[:, t:t + 1], cache=cache)
                                                             for t in range(6, 12)], dim=1)
        full = model(idx)
    assert cache.layers[0].k.dtype == torch.bfloat16
    assert sqnr_db(full.float(), inc.float()) > 30
    torch.manual_seed(0)
    with fs.fp8_model_init():
        lp = GPT(model.config).eval()
    lp.load_state_dict(model.state_dict())
    with torch.no_grad(), fs.fp8_autocast(recipe=fs.CurrentScaling()):
        cache = KVCache(lp.config)
        inc = torch.cat([lp(idx[:, :6], cache=cache)] + [lp(idx[:, t:t + 1], cache=cache)
                                                          for t in range(6, 12)], dim=1)
        full = lp(idx)
    assert sqnr_db(model(idx).detach(), inc) > 20 and sqnr_db(full, inc) > 20
