"""Bad library calls, table-driven (the training command's bad input: ``test_bad_input.py``).

Every ``API_CASES`` case calls the library and asserts the error type, a message naming the
argument, and the tensors and optimizer state unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import fp8shard as fs
from fp8shard.optim import DistributedFusedAdam
from fp8shard.optim.fsdp2 import FSDP2Adam
from tests.optim.dist_cases import TinyMixed, batch
from tests.reliability.common import tensor_digest, weights_and_state_digest


@dataclasses.dataclass
class ApiCase:
    id: str
    call: Callable[[Any], Any]
    """call(objects): the bad call; objects has x, f8 (a Float8Tensor), model and opt (a
    DistributedFusedAdam whose model has had a backward, so gradients are waiting)."""
    error: type[Exception]
    expect: str
    """A substring of the error message (it names the argument)."""


def _opt(**kw: Any) -> Callable[[Any], Any]:
    return lambda o: DistributedFusedAdam(o.model.parameters(), **kw)


def _set_group(key: str, value: Any) -> Callable[[Any], Any]:
    def call(o: Any) -> None:
        before = o.opt.param_groups[0][key]
        o.opt.param_groups[0][key] = value
        try:
            o.opt.step()
        finally:
            o.opt.param_groups[0][key] = before

    return call


NAN, INF = math.nan, math.inf
API_CASES = [
    ApiCase("quantize-scale-zero", lambda o: fs.Float8Tensor.quantize(o.x, "E4M3", scale=0.0), ValueError,
            "scale must be finite and > 0, got 0.0"),
    ApiCase("quantize-scale-negative", lambda o: fs.Float8Tensor.quantize(o.x, "E4M3", scale=-1), ValueError,
            "scale must be finite and > 0, got -1.0"),
    ApiCase("quantize-scale-nan", lambda o: fs.Float8Tensor.quantize(o.x, "E4M3", scale=NAN), ValueError,
            "scale must be finite and > 0, got nan"),
    ApiCase("quantize-scale-inf-tensor",
            lambda o: fs.Float8Tensor.quantize(o.x, "E4M3", scale=torch.tensor(INF)),
            ValueError, "scale must be finite and > 0, got inf"),
    ApiCase("quantize_-scale-zero-tensor", lambda o: o.f8.quantize_(o.x, torch.tensor(0.0)), ValueError,
            "scale must be finite and > 0, got 0.0"),
    ApiCase("quantize_-scale-negative-tensor", lambda o: o.f8.quantize_(o.x, torch.tensor(-2.0)), ValueError,
            "scale must be finite and > 0, got -2.0"),
    ApiCase("quantize_-scale-nan-tensor", lambda o: o.f8.quantize_(o.x, torch.tensor(NAN)), ValueError,
            "scale must be finite and > 0, got nan"),
    ApiCase("quantize_-scale-python-zero", lambda o: o.f8.quantize_(o.x, 0.0), ValueError,
            "scale must be finite and > 0, got 0.0"),
    ApiCase("quantize_-scale-not-a-number", lambda o: o.f8.quantize_(o.x, "1.0"), TypeError,
            "scale must be a float or a tensor, got str"),
    ApiCase("clip-negative", lambda o: o.opt.clip_grad_norm(-1.0), ValueError,
            "clip_grad_norm: max_norm must be >= 0 (inf: no clipping), got -1.0"),
    ApiCase("clip-nan", lambda o: o.opt.clip_grad_norm(NAN), ValueError, "max_norm must be >= 0"),
    ApiCase("clip-negative-cpu-tensor", lambda o: o.opt.clip_grad_norm(torch.tensor(-0.5)), ValueError,
            "max_norm must be >= 0"),
    ApiCase("clip-not-a-number", lambda o: o.opt.clip_grad_norm("1"), TypeError, "max_norm must be a number"),
    ApiCase("adam-lr-nan", _opt(lr=NAN), ValueError, "lr must be a finite number >= 0, got nan"),
    ApiCase("adam-eps-inf", _opt(eps=INF), ValueError, "eps must be a finite number >= 0, got inf"),
    ApiCase("adam-eps-negative", _opt(eps=-1e-8), ValueError, "eps must be a finite number >= 0"),
    ApiCase("adam-weight-decay-nan", _opt(weight_decay=NAN), ValueError,
            "weight_decay must be a finite number"),
    ApiCase("adam-beta-one", _opt(betas=(0.9, 1.0)), ValueError, "betas must be two numbers in [0, 1)"),
    ApiCase("adam-beta-nan", _opt(betas=(NAN, 0.9)), ValueError, "betas must be two numbers in [0, 1)"),
    ApiCase("adam-bucket-cap-nan", _opt(bucket_cap_mb=NAN), ValueError,
            "bucket_cap_mb must be a finite number > 0"),
    ApiCase("adam-alignment-zero", _opt(alignment=0), ValueError, "alignment must be an int >= 1"),
    ApiCase("step-with-lr-set-to-nan", _set_group("lr", NAN), ValueError, "check the LR schedule"),
    ApiCase("step-with-weight-decay-set-to-inf", _set_group("weight_decay", INF), ValueError,
            "weight_decay must be a finite number >= 0, got inf"),
    ApiCase("fsdp2adam-on-unsharded-params", lambda o: FSDP2Adam(o.model.parameters()), ValueError,
            "is not sharded by FSDP2; call fully_shard_model(model, mesh)"),
    ApiCase("fp8-slice-written-in-place", lambda o: o.f8[0:2].mul_(2.0), RuntimeError,
            "on a slice of a Float8Tensor would re-quantize the slice"),
]


@dataclasses.dataclass
class _Objects:
    x: torch.Tensor
    f8: fs.Float8Tensor
    model: torch.nn.Module
    opt: DistributedFusedAdam


def _objects() -> _Objects:
    torch.manual_seed(0)
    x = torch.randn(16, 16)
    model = TinyMixed()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, grad_sync_dtype=torch.float32)
    model(batch(1, 0)).square().mean().backward()  # gradients wait in the buckets
    return _Objects(x, fs.Float8Tensor.quantize(x, "E4M3"), model, opt)


def _state(o: _Objects) -> tuple[str, str, list[str]]:
    grads = [tensor_digest(rb.grad_buffer) for rb in o.opt.engine.regions]
    return tensor_digest(o.f8), weights_and_state_digest(o.model, o.opt), grads


def test_enough_cases():
    assert len(API_CASES) >= 15 and len({c.id for c in API_CASES}) == len(API_CASES)


@pytest.mark.parametrize("case", API_CASES, ids=[c.id for c in API_CASES])
def test_bad_api_call(case):
    o = _objects()
    before = _state(o)
    with pytest.raises(case.error) as info:
        case.call(o)
    assert case.expect in str(info.value), str(info.value)
    assert len(str(info.value).splitlines()) == 1
    assert _state(o) == before  # nothing changed: bytes, scale, weights, master, moments, step, gradients
    o.opt.step()  # and the optimizer still works afterwards
    assert not o.opt.last_step_skipped and o.opt.state_dict()["step"] == 1


def test_step_before_any_backward_is_a_no_op():
    # [Note: step without gradients]: as torch.optim skips parameters whose .grad is None.
    model = TinyMixed()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    before = weights_and_state_digest(model, opt)
    opt.step()
    assert opt.last_step_skipped and opt.state_dict()["step"] == 0
    assert weights_and_state_digest(model, opt) == before  # no weight decay applied
    model(batch(1, 0)).square().mean().backward()
    opt.step()
    opt.step()  # again without a backward in between: nothing more
    assert opt.state_dict()["step"] == 1 and opt.last_step_skipped
