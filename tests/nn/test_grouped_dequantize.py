"""[Note: grouped dequantize] (nn/linear.py): under torch.compile a block's FP8-stored weights that
compute in bf16 are dequantized in one op, recomputed in the backward from the bytes, with the
per-layer path's bits; eagerly nothing changes."""

from __future__ import annotations

import functools

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.compile_fx import select_decomp_table

import fp8shard as fs
import fp8shard.models.gpt as gpt_module
from fp8shard.models import GPT, GPTConfig
from fp8shard.nn import Linear
from fp8shard.nn.linear import dequantize_weights

CFG = dict(vocab_size=320, max_position_embeddings=32, num_layers=2, hidden_size=64, ffn_hidden_size=256,
           num_attention_heads=4)
WEIGHT_SHAPES = {(192, 64), (64, 64), (256, 64), (64, 256)}  # qkv, proj, fc1, fc2 (and transposes)
WEIGHT_SHAPES |= {s[::-1] for s in WEIGHT_SHAPES}
BLOCK_NUMEL = 64 * 192 + 64 * 64 + 2 * 64 * 256  # the group's flat buffer


def _model(fp8_compute: bool = False) -> GPT:
    torch.manual_seed(0)
    with fs.fp8_model_init():
        model = GPT(GPTConfig(**CFG))
    for m in model.modules():
        if isinstance(m, Linear):
            m.fp8_compute = fp8_compute
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 320, (2, 24), generator=g), torch.randint(0, 320, (2, 24), generator=g)


class _Graphs:
    """A backend that keeps the forward and backward graphs as Inductor receives them (its
    decompositions, its min-cut partitioner) and runs them as they are (aot_eager's arithmetic)."""

    def __init__(self) -> None:
        self.fw: list[torch.fx.GraphModule] = []
        self.bw: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        def keep(into: list) -> object:
            def compiler(g: torch.fx.GraphModule, _inputs: list) -> object:
                into.append(g)
                return make_boxed_func(g.forward)
            return compiler

        return aot_autograd(fw_compiler=keep(self.fw), bw_compiler=keep(self.bw),
                            decompositions=select_decomp_table(),
                            partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                           compiler="inductor"))(gm, example_inputs)


def _cats_of_fp8(g: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The ``cat`` nodes whose inputs are computed from float8 tensors (the grouped dequantize)."""
    def from_fp8(n: object, depth: int = 0) -> bool:
        if not isinstance(n, torch.fx.Node) or depth > 6:
            return False
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return True
        return any(from_fp8(a, depth + 1) for a in n.all_input_nodes)

    return [n for n in g.graph.nodes if n.target == torch.ops.aten.cat.default
            and all(from_fp8(a) for a in n.args[0])]


def _saved(fw: torch.fx.GraphModule) -> list[torch.Tensor]:
    out = next(n for n in fw.graph.nodes if n.op == "output")
    return [a.meta["val"] for a in out.args[0] if isinstance(a, torch.fx.Node)
            and isinstance(a.meta.get("val"), torch.Tensor)]


@pytest.mark.parametrize("autocast", [True, False])
def test_compiled_blocks_dequantize_once_and_keep_the_per_layer_bits(autocast, monkeypatch):
    """One grouped dequantize per block in the forward graph and again in the backward graph
    (recomputed from the bytes: the forward saves no 16-bit weight, flat or shaped), and the
    loss and every gradient equal those of the same compiled model with the per-layer path
    (``_LinearFromFp8Weight``) bit for bit."""
    x, y = _batch()

    def run(group: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], _Graphs]:
        if not group:
            monkeypatch.setattr(gpt_module, "dequantize_weights", lambda layers: [None] * len(layers))
        torch._dynamo.reset()
        model, graphs = _model(), _Graphs()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast), fs.fp8_autocast():
            loss = torch.compile(model, backend=graphs, fullgraph=True)(x, y)
        loss.backward()
        return loss.detach(), {k: p.grad for k, p in model.named_parameters()}, graphs

    loss, grads, graphs = run(group=True)
    ref_loss, ref_grads, ref_graphs = run(group=False)
    assert len(graphs.fw) == len(graphs.bw) == 1
    assert len(_cats_of_fp8(graphs.fw[0])) == len(_cats_of_fp8(graphs.bw[0])) == CFG["num_layers"]
    assert not _cats_of_fp8(ref_graphs.fw[0])
    for t in _saved(graphs.fw[0]):
        weightlike = tuple(t.shape) in WEIGHT_SHAPES or t.numel() == BLOCK_NUMEL
        assert not (t.is_floating_point() and t.element_size() > 1 and weightlike), \
            f"the forward keeps a 16-bit copy of weights for the backward: {t.shape} {t.dtype}"
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        assert torch.equal(grads[k], ref_grads[k]), k
    fp8 = [k for k, p in _model().named_parameters() if isinstance(p, fs.Float8Tensor)]
    assert len(fp8) == 4 * CFG["num_layers"] and all(grads[k].abs().sum() > 0 for k in fp8)


def test_layers_computing_in_fp8_are_not_grouped_and_eager_calls_never_are():
    model = _model(fp8_compute=True)
    blk = model.blocks[0]
    layers = (blk.attn.qkv, blk.attn.proj, blk.mlp.fc1, blk.mlp.fc2)
    assert dequantize_weights(layers) == [None] * 4  # eager
    seen = []

    def grab(*_a: object) -> torch.Tensor:
        with fs.fp8_autocast():
            seen.append([w is None for w in dequantize_weights(layers)])
        return torch.zeros(())

    torch.compile(grab, backend="eager")()
    assert seen == [[True] * 4]  # all four compute in FP8: nothing to dequantize
    blk.mlp.fc1.fp8_compute = blk.mlp.fc2.fp8_compute = False
    seen.clear()
    torch._dynamo.reset()
    torch.compile(grab, backend="eager")()
    assert seen == [[True, True, False, False]]


def test_compiled_inductor_gpt_with_grouped_weights_trains_like_eager():
    """The whole GPT under Inductor (CPU) with the grouped dequantize: loss and gradients close to
    the eager per-layer path's (Inductor's CPU kernels may round the rest differently)."""
    x, y = _batch()
    eager = _model()
    with torch.autocast("cpu", torch.bfloat16), fs.fp8_autocast():
        ref = eager(x, y)
    ref.backward()
    model = _model()
    step = torch.compile(model)
    with torch.autocast("cpu", torch.bfloat16), fs.fp8_autocast():
        loss = step(x, y)
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-2, atol=1e-2)
    for (k, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=5e-2, atol=5e-3, msg=k)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpt_with_its_linears_swapped_for_torch_nn_linear_runs(compiled):
    """The blocks pass a dequantized weight only to a layer that takes one: a GPT whose Linears
    were swapped for torch.nn.Linear (as the DDP and torchao peers do) runs as before."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    for block in model.blocks:
        for parent, name in ((block.attn, "qkv"), (block.attn, "proj"),
                             (block.mlp, "fc1"), (block.mlp, "fc2")):
            old = getattr(parent, name)
            new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
            setattr(parent, name, new)
    idx, tgt = _batch()
    run = torch.compile(model, backend="aot_eager") if compiled else model
    loss = run(idx, tgt)
    loss.backward()
    assert torch.isfinite(loss) and model.blocks[0].attn.qkv.weight.grad is not None


def _saved_weight_copies(device: str, layers: int) -> tuple[list[tuple], int]:
    """Train steps of a ``layers``-deep GPT whose Linears compute in bf16 from FP8 weights, the
    whole model under Inductor (the training command's compile): every tensor the compiled
    forward saves for the backward that is a 16-bit copy of a weight (its shape, flat or
    transposed); and the number of FP8 weights."""
    cfg = dict(CFG, num_layers=layers)
    torch.manual_seed(0)
    with fs.fp8_model_init():
        model = GPT(GPTConfig(**cfg)).to(device)
    for m in model.modules():
        if isinstance(m, Linear):
            m.fp8_compute = False
    x, y = (t.to(device) for t in _batch())
    saved: list[tuple] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        weightlike = tuple(t.shape) in WEIGHT_SHAPES or t.numel() == BLOCK_NUMEL
        if t.is_floating_point() and t.element_size() > 1 and weightlike:
            saved.append((tuple(t.shape), t.dtype))
        return t

    torch._dynamo.reset()
    step = torch.compile(model)
    for _ in range(2):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast(device, torch.bfloat16), fs.fp8_autocast():
                loss = step(x, y)
        loss.backward()
    return saved, sum(isinstance(p, fs.Float8Tensor) for p in model.parameters())


def test_the_deep_compiled_gpt_saves_no_16_bit_weight_copy():
    """Through Inductor itself, the whole model one graph: the backward recomputes the dequantized
    weights (the checkpoint's ops must be recomputed, not only preferred), on the CPU. Four blocks
    (the GPU twin below takes the 125M preset's 12; Inductor on the CPU compiles 12 in ~3x the time)."""
    saved, n = _saved_weight_copies("cpu", 4)
    assert n == 16 and saved == [], f"16-bit weight copies saved for the backward: {saved}"


@pytest.mark.gpu
def test_the_deep_compiled_gpt_saves_no_16_bit_weight_copy_on_the_gpu():
    """The same on CUDA, where a plain checkpoint left the partitioner free to keep the copies
    (the 125M command's FP8 peak was above bf16's by them, H100, torch 2.11)."""
    saved, n = _saved_weight_copies("cuda", 12)
    assert n == 48 and saved == [], f"16-bit weight copies saved for the backward: {saved}"
