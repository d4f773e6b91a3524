"""The Adam math on flat shards against torch.optim.Adam/AdamW, single process."""

from __future__ import annotations

import itertools

import pytest
import torch

from fp8shard.optim.fused_step import adam_


def _run_reference(params, grads_per_step, adam_w, **hp):
    ref = [p.clone().requires_grad_(True) for p in params]
    cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    opt = cls(ref, foreach=False, **hp)
    for grads in grads_per_step:
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ref]


@pytest.mark.parametrize("adam_w", [True, False])
def test_flat_adam_is_bit_identical_to_torch(adam_w):
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 13), (5,), (3, 4, 2)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    steps = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    hp = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    expected = _run_reference(params, steps, adam_w, **hp)

    # Our version works on one flat shard split at arbitrary points, not per parameter.
    flat = torch.cat([p.reshape(-1) for p in params])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    cuts = [0, 10, 11, 50, flat.numel()]
    for t, grads in enumerate(steps, start=1):
        g = torch.cat([x.reshape(-1) for x in grads])
        sl = [slice(a, b) for a, b in itertools.pairwise(cuts)]
        adam_([flat[s] for s in sl], [g[s] for s in sl], [m[s] for s in sl], [v[s] for s in sl],
              step=t, lr=hp["lr"], beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1,
              decoupled_weight_decay=adam_w)
    assert torch.equal(flat, torch.cat([p.reshape(-1) for p in expected]))


def test_bf16_states_track_fp32_states():
    gen = torch.Generator().manual_seed(1)
    p32 = torch.randn(1000, generator=gen)
    p16 = p32.clone()
    m32, v32 = torch.zeros(1000), torch.zeros(1000)
    m16, v16 = torch.zeros(1000, dtype=torch.bfloat16), torch.zeros(1000, dtype=torch.bfloat16)
    for t in range(1, 6):
        g = torch.randn(1000, generator=gen)
        kw = dict(step=t, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        adam_([p32], [g], [m32], [v32], **kw)
        adam_([p16], [g], [m16], [v16], **kw)
    assert m16.dtype == torch.bfloat16
    assert not torch.equal(p16, p32)  # the states really were rounded
    torch.testing.assert_close(p16, p32, rtol=0, atol=2e-3)


def test_step_must_count_from_one():
    with pytest.raises(ValueError, match="step"):
        adam_([torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)], step=0,
              lr=1.0, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.0)


@pytest.mark.parametrize("decoupled", [True, False])
def test_fused_kernel_agrees_with_the_reference_path(decoupled):
    torch.manual_seed(0)
    p0, m0, v0 = torch.randn(1000), torch.zeros(1000), torch.zeros(1000)
    runs = {}
    for fused in (False, True):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        for step in range(1, 4):
            g = torch.randn(1000, generator=torch.Generator().manual_seed(step))
            adam_([p], [g], [m], [v], step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=0.1, decoupled_weight_decay=decoupled, fused=fused)
        runs[fused] = (p, m, v)
    for a, b in zip(runs[False], runs[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert not torch.equal(runs[True][0], p0)
