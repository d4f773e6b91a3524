"""The output layer and the cross-entropy in one pass over chunks of tokens.

[Note: chunked loss]
    ``F.cross_entropy(F.linear(x, W).float(), targets)`` materializes the logits of every token
    (N x V: 16 k tokens x 50 k vocab is 1.6 GB in bf16, 3.3 GB in fp32) and autograd keeps
    them, or their fp32 softmax, until the backward; with the fp32 copies of the eager path the
    head and the loss held about 8 GB of the 125M GPT's 16 GB peak (issue 16).

    ``linear_cross_entropy`` walks the tokens in chunks of ``rows`` and, for each chunk,
    computes the logits, their log-softmax and the loss, then at once the gradient of the
    mean loss with respect to those logits, ``(softmax - onehot) / count``, and from it the
    chunk's share of ``dL/dx`` and ``dL/dW`` (the two GEMMs the backward of the output layer
    would run). Only those two gradients are kept for the backward, which multiplies them by
    the incoming gradient of the loss. So at most one chunk of logits exists at a time, no
    GEMM is run twice (a recomputing backward would pay a fourth N x C x V GEMM), and the
    backward of the head is one multiply.

    Numerics are the plain path's: the chunk's logits come from the same ``F.linear`` (same
    dtype under autocast), their fp32 log-softmax gives the loss and, through ``exp``, the
    softmax of the gradient, which is cast to the logits' dtype before the GEMMs, as the
    ``.float()`` of the plain path does in its backward. What differs: the order of the fp32
    sums (the loss over chunks; ``dW`` as a sum of per-chunk GEMMs, accumulated in fp32, where
    the plain path rounds one GEMM over all tokens to the weight's dtype) and, when the incoming
    gradient is not 1 (``loss / k`` for k micro-batches), where it is applied: to ``dx`` and
    ``dW`` after the GEMMs here, to the logits' gradient before them there (one rounding apart
    in bf16). tests/train/test_loss.py states the tolerances.

    Under ``torch.compile`` the chunk loop unrolls (the shapes are static) and the gradient is
    one pointwise expression of the logits (the one-hot as a comparison with the column index,
    not a scatter into an fp32 buffer), which Inductor fuses with the log-softmax into a kernel
    that writes the 16-bit gradient: no fp32 chunk is ever in memory. (With the scatter, the
    H100 kept every chunk's fp32 buffer alive at once: 13 x 246 MB at 125M, the whole fp32
    logits, 2026-12-07.) The target's log-probability is there a reduction over the chunk's
    rows (``where(onehot, logp, 0).sum(1)``: one non-zero term, the gather's value) read in the
    log-softmax's kernel, not a gather (the pick's value, with one kernel fewer reading the
    chunk). What kept every chunk alive at the step's peak on the GPU (13 bf16 gradient chunks,
    1.6 GB, at 125M; 7 of [2048, 32768], 0.9 GB, at 1.3B; H200, 2026-12-07, read in Inductor's
    code of that run) was the end of the loop: dx was joined with ``torch.cat``, which Inductor
    made a buffer that every chunk's dx GEMM writes into, and those GEMMs went after it, to the
    end; and the dW sum became one kernel after the last chunk reading every chunk's 16-bit dW.
    So dx is written into its rows by an opaque op (``write_rows_``; the partitioner keeps the
    small per-chunk products for the backward and joins them there) and each chunk's dW is
    added to the fp32 accumulator by another (``accumulate_mm_``; on CUDA the GEMM adds in fp32
    itself, cuBLAS with beta = 1), which Inductor runs in the chunk's place (tested on the CPU's
    Inductor: each chunk's accumulation before the next chunk's GEMMs). Eagerly the chunk makes
    four passes over its fp32 logits (log-softmax, exp, scatter + scale, cast), fewer than the
    plain path's forward and backward; both forms give the same bits. Without gradients
    (validation) only the loss is computed, chunk by chunk.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

LOGITS_PER_CHUNK = 2**26
"""Default chunk: at most this many logits (256 MB in fp32) at a time."""


def chunk_rows(num_tokens: int, vocab_size: int, chunk_tokens: int | None = None) -> int:
    """Tokens per chunk: ``chunk_tokens`` if given, else as many as keep a chunk's logits under
    ``LOGITS_PER_CHUNK``, a multiple of 64 (whole GEMM tiles), at least 64."""
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        return min(chunk_tokens, max(num_tokens, 1))
    rows = max(64, (LOGITS_PER_CHUNK // max(vocab_size, 1)) // 64 * 64)
    return min(rows, max(num_tokens, 1))


def _chunked(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int,
             ignore_index: int, need_dx: bool, need_dw: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(mean loss, dL/dx, dL/dW) over chunks of ``rows`` tokens; see [Note: chunked loss]."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):  # cast once what autocast would cast for each GEMM
        dt = torch.get_autocast_dtype(dev)
        x, weight = x.to(dt), weight.to(dt)
    with torch.autocast(dev, enabled=False):
        return _chunks(x, weight, targets, rows, ignore_index, need_dx, need_dw)


def _chunks(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int,
            ignore_index: int, need_dx: bool, need_dw: bool
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    valid = targets != ignore_index
    count = valid.sum().to(torch.float32)  # all ignored: 0/0 = nan, as F.cross_entropy
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    # dx is written chunk by chunk into one buffer made first (not joined after the last chunk:
    # Inductor's join is a buffer that every chunk's GEMM writes into, which on the GPU moved
    # those GEMMs, and so every chunk's gradient, after the last chunk; [Note: chunked loss])
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else None
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
    for s in range(0, x.shape[0], rows):
        xc, tc, vc = x[s:s + rows], targets[s:s + rows], valid[s:s + rows]
        logits = F.linear(xc, weight)  # the plain path's values and dtype
        dtype = logits.dtype
        # The plain path's log-softmax (of the fp32 logits), read from the logits directly
        logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        del logits
        tsafe = torch.where(vc, tc, 0).unsqueeze(1)
        compiling = torch.compiler.is_compiling()
        if compiling:
            # The target's log-probability as a row reduction of the chunk's own kernel, not a
            # gather that a later kernel may do for every chunk at once (keeping every chunk's
            # logits alive until then): the same value, one non-zero term ([Note: chunked loss])
            hit = (torch.arange(logp.shape[1], device=logp.device) == tsafe) & vc.unsqueeze(1)
            picked = torch.where(hit, logp, 0.0).sum(1)
        else:
            picked = torch.where(vc, logp.gather(1, tsafe).squeeze(1), 0.0)
        total = total - picked.sum()
        if not (need_dx or need_dw):
            continue
        # dL/dlogits = (softmax - onehot) / count on valid rows
        coef = vc.unsqueeze(1).to(torch.float32) / count
        if compiling:
            # One pointwise expression: Inductor writes the 16-bit gradient straight from the
            # logits and their row statistics, with no fp32 chunk in memory ([Note: chunked loss])
            g = ((logp.exp() - hit.to(torch.float32)) * coef).to(dtype)
        else:  # in place: one fp32 chunk alive, the same bits (p + -1.0 is p - 1.0; p + -0.0 is p)
            p = logp.exp_()
            p.scatter_add_(1, tsafe, -vc.unsqueeze(1).to(p.dtype))
            g = p.mul_(coef).to(dtype)
            del p
        del logp
        if need_dx:
            assert dx is not None
            _write_rows(dx, s, torch.mm(g, weight))
        if need_dw:
            assert dw is not None
            dw = _accumulate_dw(dw, g, xc)
    return total / count, dx, dw


@torch.library.custom_op("fp8shard::write_rows_", mutates_args=("out",))
def _write_rows(out: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    """``out[start:start + len(rows)] = rows``, as one opaque op that runs where the chunk is
    ([Note: chunked loss])."""
    out.narrow(0, start, rows.shape[0]).copy_(rows)


@_write_rows.register_fake
def _(out: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    return None


@torch.library.custom_op("fp8shard::accumulate_mm_", mutates_args=("acc",))
def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` for a 16-bit GEMM into an fp32 accumulator, as one opaque op: under
    compile, the sum of the chunks' dW otherwise becomes one kernel after the last chunk, which
    keeps every chunk's dW (or the gradients it is made from) alive until then ([Note: chunked
    loss]). On CUDA the GEMM adds into ``acc`` in fp32 itself (cuBLAS, beta = 1, torch >= 2.8:
    no 16-bit product, one rounding fewer); elsewhere the 16-bit product is added (the CPU's
    eager bits)."""
    if a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(torch.mm(a, b))


@_accumulate_mm.register_fake
def _(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    return None


def _accumulate_dw(dw: torch.Tensor, g: torch.Tensor, xc: torch.Tensor) -> torch.Tensor:
    """``dw += g.t() @ xc`` with ``dw`` fp32 ([Note: chunked loss])."""
    if g.dtype == dw.dtype:
        return dw.addmm_(g.t(), xc)
    if torch.compiler.is_compiling() or g.is_cuda:  # eager CUDA too: the compiled path's numerics
        _accumulate_mm(dw, g.t(), xc)
        return dw
    return dw.add_(torch.mm(g.t(), xc))


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients in the forward; the backward scales them ([Note: chunked loss])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int,
                ignore_index: int, need_dx: bool, need_dw: bool) -> torch.Tensor:
        loss, dx, dw = _chunked(x, weight, targets, rows, ignore_index, need_dx, need_dw)
        ctx.need = (need_dx, need_dw)
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.save_for_backward(*(t for t in (dx, dw) if t is not None))
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = list(ctx.saved_tensors)
        need_dx, need_dw = ctx.need
        x_dtype, w_dtype = ctx.dtypes
        dx = (saved.pop(0).to(x_dtype) * grad).to(x_dtype) if need_dx else None
        dw = (saved.pop(0) * grad).to(w_dtype) if need_dw else None
        return dx, dw, None, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk_tokens: int | None = None, ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy(F.linear(x, weight).float().flatten(0, -2), targets.flatten())`` (mean
    over the targets that are not ``ignore_index``) without materializing the logits of all
    tokens at once. x: (..., C); weight: (V, C); targets: x's leading shape, int64.

    ``chunk_tokens``: tokens per chunk (None: automatic, see ``chunk_rows``). Differentiable in
    x and weight; works eagerly and under ``torch.compile``. See [Note: chunked loss].
    """
    x2 = x.reshape(-1, x.shape[-1])
    t = targets.reshape(-1)
    if t.shape[0] != x2.shape[0]:
        raise ValueError(f"targets hold {t.shape[0]} tokens, x {x2.shape[0]}")
    rows = chunk_rows(x2.shape[0], weight.shape[0], chunk_tokens)
    need_dx = torch.is_grad_enabled() and x2.requires_grad
    need_dw = torch.is_grad_enabled() and weight.requires_grad
    if not (need_dx or need_dw):
        return _chunked(x2, weight, t, rows, ignore_index, False, False)[0]
    return _LinearCrossEntropy.apply(x2, weight, t, rows, ignore_index, need_dx, need_dw)
