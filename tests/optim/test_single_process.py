"""DistributedFusedAdam in one process (no process group): API, param groups, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8shard.fp8 import Float8Tensor
from fp8shard.optim import DistributedFusedAdam
from tests.optim.dist_cases import TinyMixed, batch, grads_at, hp_value, param_groups


def test_param_groups_and_lr_schedule_match_torch_adamw_exactly():
    model = TinyMixed()
    model.fc2.weight.clear_high_precision_init_val()  # both start from the dequantized weight
    ref_params = {id(p): hp_value(p).clone().requires_grad_() for p in model.parameters()}
    ref_groups = [{**g, "params": [ref_params[id(p)] for p in g["params"]]} for g in param_groups(model)]
    ref = torch.optim.AdamW(ref_groups, lr=1e-2, weight_decay=0.1, foreach=False)
    opt = DistributedFusedAdam(param_groups(model), lr=1e-2, weight_decay=0.1, grad_sync_dtype=torch.float32,
                               bucket_cap_mb=64 * 4 / 2**20, alignment=1)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (ref, opt)]
    by_id = {id(p): p for p in model.parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for step in range(1, 4):
        x = batch(step, 0)
        grads = grads_at(model, x)
        model(x).square().mean().backward()
        assert all(p.grad is None for p in model.parameters())  # moved into the buckets, freed
        opt.step()
        for pid, rp in ref_params.items():
            rp.grad = grads[names[pid]].float()
        ref.step()
        for s in scheds:
            s.step()
        assert opt.param_groups[1]["lr"] == ref.param_groups[1]["lr"] == 5e-3 * 0.5**step
        sd = opt.state_dict()
        for i, p in enumerate(pp for g in opt.param_groups for pp in g["params"]):
            assert torch.equal(sd["state"][i]["master"], ref_params[id(by_id[id(p)])].detach())
    assert sd["step"] == 3 and opt.comm_report()["reduce_scatter.grads"] > 0


def test_zero_grad_discards_accumulated_gradients():
    model, twin = TinyMixed(), TinyMixed()
    kw = dict(lr=1e-2, grad_sync_dtype=torch.float32)
    opt = DistributedFusedAdam(model.parameters(), **kw)
    opt_twin = DistributedFusedAdam(twin.parameters(), **kw)
    model(batch(1, 0)).square().mean().backward()
    opt.zero_grad()  # drop those gradients
    model(batch(2, 0)).square().mean().backward()
    twin(batch(2, 0)).square().mean().backward()
    opt.step()
    opt_twin.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        if isinstance(a, Float8Tensor):
            assert torch.equal(a.uint8_view(), b.uint8_view())
        else:
            assert torch.equal(a, b)


def test_a_second_backward_without_no_sync_is_an_error():
    model = TinyMixed()
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=1e-4)
    model(batch(1, 0)).square().mean().backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        model(batch(2, 0)).square().mean().backward()
    opt.zero_grad()


def test_bad_hyperparameters_are_named():
    with pytest.raises(ValueError, match="lr must be"):
        DistributedFusedAdam(TinyMixed().parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        DistributedFusedAdam(TinyMixed().parameters(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="weight_decay"):
        DistributedFusedAdam(TinyMixed().parameters(), weight_decay=-0.1)
    opt = DistributedFusedAdam(TinyMixed().parameters())
    opt.param_groups[0]["lr"] = -1e-3  # e.g. a broken schedule
    with pytest.raises(ValueError, match=r"lr must be.*LR schedule"):
        opt.step()


def test_mixed_devices_are_refused():
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, device="meta"))]
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\).*model.to"):
        DistributedFusedAdam(params)


def test_frozen_and_duplicate_parameters_are_refused():
    frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
    with pytest.raises(ValueError, match="requires_grad=False"):
        DistributedFusedAdam([frozen])


def test_changing_the_parameters_after_construction_is_refused():
    model = TinyMixed()
    opt = DistributedFusedAdam(model.parameters())
    with pytest.raises(RuntimeError, match=r"add_param_group.*constructor"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    opt.param_groups[0]["params"].append(nn.Parameter(torch.zeros(2)))
    with pytest.raises(RuntimeError, match=r"parameter list changed.*new optimizer"):
        opt.step()
    opt.param_groups[0]["params"].pop()
    model.fc1.bias.data = torch.zeros(7)  # no longer a view of the optimizer's buffer
    with pytest.raises(RuntimeError, match="no longer lives in the optimizer's buffer"):
        opt.step()


def test_process_group_needs_initialized_distributed():
    with pytest.raises(ValueError, match="init_process_group"):
        DistributedFusedAdam(TinyMixed().parameters(), process_group=object())


def test_overlap_param_sync_needs_a_module():
    model = TinyMixed()
    opt = DistributedFusedAdam(model.parameters(), overlap_param_sync=True)
    model(batch(1, 0)).square().mean().backward()
    with pytest.raises(RuntimeError, match="register_module"):
        opt.step()
    with pytest.raises(ValueError, match="owns none"):
        opt.register_module(nn.Linear(2, 2))
    opt.register_module(model)
    opt.step()
    assert opt.engine.param_sync.pending  # in flight until the next forward
    model(batch(2, 0))
    assert not opt.engine.param_sync.pending


def test_master_starts_from_the_preserved_init_value():
    model = TinyMixed()
    init = model.fc2.weight.get_high_precision_init_val().clone()
    assert not torch.equal(init, model.fc2.weight.dequantize())  # FP8 lost precision
    opt = DistributedFusedAdam(model.parameters())
    index = [id(p) for p in model.parameters()].index(id(model.fc2.weight))
    assert torch.equal(opt.state_dict()["state"][index]["master"], init)
    assert model.fc2.weight.get_high_precision_init_val() is None
