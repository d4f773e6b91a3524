"""The chunked output layer + cross-entropy ([Note: chunked loss]) against the plain path.

Tolerances. fp32: the loss to a relative 1e-6 and both gradients to 1e-5 of their largest
element: only the order of fp32 sums differs. bf16 (autocast, or bf16 tensors): the loss to a
relative 1e-6; the gradients to 2**-6 of their largest element: the plain path rounds dW (one
GEMM over all tokens) to bf16 where the chunks accumulate in fp32, and a loss scale is applied
before the bf16 cast there, after it here. Compiled (aot_eager) equals eager to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8shard.models import GPT, GPTConfig
from fp8shard.models.loss import LOGITS_PER_CHUNK, chunk_rows, linear_cross_entropy

N, C, V = 150, 32, 97  # 150 tokens: chunks of 64 leave a ragged last one


def _plain(x, w, t):
    return F.cross_entropy(F.linear(x, w).float().flatten(0, -2), t.flatten())


def _case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g).to(dtype).requires_grad_()
    w = (0.3 * torch.randn(V, C, generator=g)).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[[3, 77]] = -100  # ignored tokens
    return x, w, t


def _loss_and_grads(fn, x, w, t, scale, autocast):
    x.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(x, w, t)
    (loss * scale).backward()
    return loss.detach(), x.grad.clone(), w.grad.clone()


def _close(got, want, rel):
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err <= rel, f"max error {err:.3g} of the largest element, allowed {rel:.3g}"


@pytest.mark.parametrize(("dtype", "autocast", "rel"), [(torch.float32, False, 1e-5),
                                                        (torch.float32, True, 2**-6),
                                                        (torch.bfloat16, False, 2**-6)],
                         ids=["fp32", "autocast-bf16", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_chunked_matches_plain_loss_and_gradients(dtype, autocast, rel, scale):
    x, w, t = _case(dtype)
    want = _loss_and_grads(_plain, x, w, t, scale, autocast)
    got = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_tokens=64), x, w, t, scale, autocast)
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-6)
    assert got[1].dtype == x.dtype and got[2].dtype == w.dtype
    _close(got[1], want[1], rel)
    _close(got[2], want[2], rel)


def test_chunk_size_does_not_change_the_result():
    x, w, t = _case(torch.float32, seed=1)
    ref = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_tokens=N), x, w, t, 1.0, False)
    for rows in (1, 7, 64):
        fn = lambda *a, r=rows: linear_cross_entropy(*a, chunk_tokens=r)
        got = _loss_and_grads(fn, x, w, t, 1.0, False)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_compiled_matches_eager():
    x, w, t = _case(torch.float32, seed=2)
    fn = lambda *a: linear_cross_entropy(*a, chunk_tokens=64)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for autocast in (False, True):
        want = _loss_and_grads(fn, x, w, t, 0.5, autocast)
        got = _loss_and_grads(compiled, x, w, t, 0.5, autocast)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_without_gradients_only_the_loss():
    x, w, t = _case(torch.float32, seed=3)
    with torch.no_grad():
        got = linear_cross_entropy(x, w, t, chunk_tokens=64)
        assert got.item() == pytest.approx(_plain(x, w, t).item(), rel=1e-6)
    assert linear_cross_entropy(x.detach(), w.detach(), t).grad_fn is None


def test_every_target_ignored_gives_nan_as_cross_entropy():
    x, w, _ = _case(torch.float32)
    t = torch.full((N,), -100)
    assert torch.isnan(_plain(x, w, t)) and torch.isnan(linear_cross_entropy(x, w, t))


def test_automatic_chunk_bounds_the_logits_per_chunk():
    assert chunk_rows(16384, 50304) == 1280 and 1280 * 50304 <= LOGITS_PER_CHUNK
    assert chunk_rows(16384, 32768) == 2048
    assert chunk_rows(100, 256) == 100  # everything in one chunk
    assert chunk_rows(16384, 10**9) == 64  # at least 64 tokens
    with pytest.raises(ValueError):
        chunk_rows(10, 10, 0)


def _saved_bytes(fn) -> int:
    """Bytes autograd keeps for the backward (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_gpt_chunked_head_matches_plain_and_keeps_no_logits():
    """The GPT's loss path: the same loss and parameter gradients as ``loss_chunk_tokens=0``
    (fp32), and no tensor the size of the logits kept for the backward."""
    cfg = dict(vocab_size=2048, max_position_embeddings=64, num_layers=1, hidden_size=32,
               ffn_hidden_size=64, num_attention_heads=2)
    models = []
    for chunk in (0, 32):
        torch.manual_seed(0)
        models.append(GPT(GPTConfig(**cfg, loss_chunk_tokens=chunk)))
    idx = torch.randint(0, 2048, (4, 65), generator=torch.Generator().manual_seed(0))
    x, y = idx[:, :-1], idx[:, 1:]
    losses = []
    for m in models:
        loss = m(x, y)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    # What the head and loss keep for the backward (the blocks are the same in both).
    h = torch.randn(4, 64, 32, requires_grad=True)
    plain = _saved_bytes(lambda: models[0].head(h, y))
    chunked = _saved_bytes(lambda: models[1].head(h, y))
    logits_fp32 = 4 * 64 * 2048 * 4
    assert plain >= logits_fp32  # the plain path keeps the logits (and their log-softmax)
    dx_dw_norm = 4 * 64 * 32 * 4 + 2048 * 32 * 4 + 2 * 4 * 64 * 32 * 4  # dx, dW, the norm's input
    assert chunked <= dx_dw_norm < logits_fp32 / 4


@pytest.mark.gpu
def test_cuda_125m_head_matches_plain_in_a_fraction_of_the_memory():
    """The 125M GPT's head on the GPU (8192 tokens x 768 x vocab 50304, fp32 weight, bf16
    autocast): chunked eager and chunked Inductor-compiled against the plain eager path, and the
    peak memory of a forward + backward (the plain path holds about 5 GB of logits there)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(8192, 768, device=dev, generator=g, requires_grad=True)
    w = (0.02 * torch.randn(50304, 768, device=dev, generator=g)).requires_grad_()
    t = torch.randint(0, 50304, (8192,), device=dev, generator=g)

    def run(fn):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(x, w, t)
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), x.grad.clone(), w.grad.clone(), torch.cuda.max_memory_allocated() - base

    chunked = lambda *a: linear_cross_entropy(*a)
    want = run(_plain)
    got = run(chunked)
    run(torch.compile(chunked))  # compile (and warm up) outside the measured call
    compiled = run(torch.compile(chunked))
    for r in (got, compiled):
        assert r[0].item() == pytest.approx(want[0].item(), rel=1e-5)
        _close(r[1], want[1], 2**-6)
        _close(r[2], want[2], 2**-6)
    assert got[3] < want[3] / 3, (got[3], want[3])
    # Compiled, no fp32 chunk is in memory ([Note: chunked loss]): it holds no more than the
    # eager chunk-at-a-time path. (With the gradient made by a scatter into an fp32 buffer,
    # Inductor kept every chunk's buffer alive: 1.87 GB against 5.07 GB eager-plain, H200,
    # torch 2.11, 2026-12-04.)
    assert compiled[3] <= 1.25 * got[3], (compiled[3], got[3])


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_compiled_gradient_form_gives_the_eager_bits(autocast):
    """Under compile the logits' gradient is a pointwise one-hot (no scatter into an fp32
    buffer, [Note: chunked loss]); run by ATen kernels (aot_eager) it gives eager's bits,
    ignored tokens and a ragged last chunk included."""
    x, w, t = _case(torch.float32, seed=4)
    t[140:] = -100
    fn = lambda *a: linear_cross_entropy(*a, chunk_tokens=64)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    want = _loss_and_grads(fn, x, w, t, 1.0, autocast)
    got = _loss_and_grads(compiled, x, w, t, 1.0, autocast)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_inductor_keeps_no_fp32_chunk_of_logits():
    """The Inductor graph of the chunked loss allocates no fp32 buffer of a chunk's logits."""
    from torch._inductor.utils import run_and_get_code

    x, w, t = _case(torch.float32, seed=5)
    fn = torch.compile(lambda a, b, c: linear_cross_entropy(a, b, c, chunk_tokens=64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, codes = run_and_get_code(fn, x, w, t)
    code = "\n".join(codes)
    assert "empty_strided_cpu((64, 97), (97, 1), torch.bfloat16)" in code  # a chunk's logits
    assert "(64, 97), (97, 1), torch.float32" not in code


def test_compiled_target_pick_is_a_row_reduction_not_a_gather():
    """Under compile the target's log-probability is a reduction over each row of the chunk
    (read where the log-softmax reads), not a gather: a gather's reads can be fused into one
    late kernel for all chunks, which keeps every chunk's logits alive until it runs
    ([Note: chunked loss]). The forward graph Inductor receives has no gather, and a reduction
    over the rows of every chunk (the pick; log-softmax stays one op in this graph)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    x, w, t = _case(torch.float32, seed=6)
    fn = torch.compile(lambda a, b, c: linear_cross_entropy(a, b, c, chunk_tokens=64),
                       backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fn(x, w, t).backward()
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert not [s for s in targets if "gather" in s]
    chunks = -(-N // 64)
    row_sums = [n for n in graphs[0].graph.nodes if n.op == "call_function"
                and str(n.target) == "aten.sum.dim_IntList" and list(n.args[1]) == [1]
                and tuple(n.meta["val"].shape) == (n.args[0].meta["val"].shape[0],)]
    assert len(row_sums) == chunks


def test_compiled_chunks_free_their_gradient_before_the_next_chunk():
    """Inductor's forward of the chunked loss runs each chunk's dW accumulation (one opaque op
    into the fp32 accumulator) before the next chunk's logits GEMM, and joins no dx in the
    forward: a join there was a buffer every chunk's dx GEMM wrote into, which on the GPU moved
    those GEMMs, and so every chunk's 16-bit gradient, after the last chunk ([Note: chunked loss])."""
    from torch._inductor.utils import run_and_get_code

    x, w, t = _case(torch.float32, seed=7)
    fn = torch.compile(lambda a, b, c: linear_cross_entropy(a, b, c, chunk_tokens=32))

    def step():
        x.grad = w.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(x, w, t)
        loss.backward()

    _, codes = run_and_get_code(step)
    forward = codes[0][codes[0].find("def call"):]
    calls = [line.strip() for line in forward.splitlines() if not line.strip().startswith("#")]
    events = ["acc" if c.startswith("torch.ops.fp8shard.accumulate_mm_") else "mm" for c in calls
              if c.startswith(("torch.ops.fp8shard.accumulate_mm_", "extern_kernels.mm("))]
    chunks = -(-N // 32)
    # (The partitioner may leave the last chunk's accumulation to the backward: one chunk kept.)
    assert events.count("acc") >= chunks - 1 and events.count("mm") == 2 * chunks, events
    # Chunk k's accumulation comes before chunk k + 1's GEMMs: at most 2k GEMMs before it.
    accs = [i for i, e in enumerate(events) if e == "acc"]
    assert all(events[:i].count("mm") <= 2 * (k + 1) for k, i in enumerate(accs)), events
    assert "write_rows_" not in forward and "cat" not in forward


def test_accumulate_mm_on_cpu_is_the_eager_sum():
    from fp8shard.models.loss import _accumulate_mm

    g = torch.Generator().manual_seed(8)
    acc = torch.randn(40, 24, generator=g)
    a = torch.randn(40, 56, generator=g).bfloat16()
    b = torch.randn(56, 24, generator=g).bfloat16()
    want = acc + torch.mm(a, b)
    _accumulate_mm(acc, a, b)
    assert torch.equal(acc, want)


@pytest.mark.gpu
def test_accumulate_mm_on_cuda_adds_in_fp32():
    """On CUDA the chunk's dW GEMM adds into the fp32 accumulator itself: no 16-bit product, so
    it is closer to an fp64 sum than adding the bf16-rounded product (and the path is not a
    silent fallback)."""
    from fp8shard.models.loss import _accumulate_mm

    g = torch.Generator(device="cuda").manual_seed(9)
    acc = torch.randn(256, 128, device="cuda", generator=g)
    a = torch.randn(256, 512, device="cuda", generator=g).bfloat16()
    b = torch.randn(512, 128, device="cuda", generator=g).bfloat16()
    exact = acc.double() + a.double() @ b.double()
    rounded = acc + torch.mm(a, b)
    _accumulate_mm(acc, a, b)
    err_fp32 = (acc.double() - exact).abs().max().item()
    err_bf16 = (rounded.double() - exact).abs().max().item()
    assert err_fp32 < err_bf16 / 8, (err_fp32, err_bf16)
