"""Adam / AdamW on flat FP32 shards. A pure function: no process group, no parameters.

The arithmetic follows ``torch.optim.Adam`` (single-tensor path) operation by operation, so on
the same inputs the master shard comes out bit-identical to the reference optimizer
(tests/optim/test_adam.py checks this):

    AdamW: p *= 1 - lr * wd                 Adam + L2: g = g + wd * p
    m.lerp_(g, 1 - beta1);  v = v * beta2 + (1 - beta2) * g * g
    p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

The elementwise ops make the result independent of how the elements are split into tensors,
which is what lets the optimizer run it on arbitrary slices of its buckets.
"""

from __future__ import annotations

import torch


def adam_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool = True,
    fused: bool | None = None,
) -> None:
    """One Adam(W) update in place on fp32 ``params`` (``step`` counts from 1).

    ``grads`` are fp32 and are not modified. ``exp_avgs``/``exp_avg_sqs`` may be fp32 or a
    16-bit dtype; 16-bit states are updated in fp32 and rounded back once per step.
    ``fused`` (default: on CUDA with fp32 states) runs PyTorch's fused Adam(W) kernel, one pass
    over params, grads and states instead of about ten; it agrees with the reference formulas
    to rounding, not bit for bit, so the CPU default stays on the reference path.
    """
    if not params:
        return
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    if fused is None:
        fused = params[0].is_cuda and exp_avgs[0].dtype == torch.float32
    if fused:
        kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
        steps = [torch.tensor(float(step), device=params[0].device) for _ in params]
        kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
               weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    if weight_decay != 0:
        if decoupled_weight_decay:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    low_precision = exp_avgs[0].dtype != torch.float32
    m = [t.float() for t in exp_avgs] if low_precision else exp_avgs
    v = [t.float() for t in exp_avg_sqs] if low_precision else exp_avg_sqs
    torch._foreach_lerp_(m, grads, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, m, denom, value=-step_size)
    if low_precision:
        torch._foreach_copy_(exp_avgs, m)
        torch._foreach_copy_(exp_avg_sqs, v)
