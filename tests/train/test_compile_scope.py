"""``trainer.compile_scope`` ([Note: compile scope]): the whole model compiled, gradients still
reduce-scattered while the backward runs.

One process (DistributedFusedAdam's collectives are then counted identity copies), a 3-block
GPT in fp32, buckets small enough for about two per block. Each scope trains 3 steps on the
same tokens as the eager model and must give the eager run's losses and final parameters
(aot_eager: Dynamo + AOT autograd, the graphs and autograd nodes Inductor would get, without
its code generation), the same reduce-scatter calls and bytes, and the same state-dict keys.
Overlap is measured as where, in the backward, each bucket's reduce-scatter was launched:
after how many of the compiled regions' backward nodes had run.
"""

from __future__ import annotations

import pytest
import torch

from fp8shard.models import GPT, GPTConfig
from fp8shard.optim import DistributedFusedAdam
from fp8shard.train.builders import compile_model

CFG = GPTConfig(vocab_size=64, max_position_embeddings=16, num_layers=3, hidden_size=32,
                ffn_hidden_size=64, num_attention_heads=2, loss_chunk_tokens=8)
STEPS = 3


def _compiled_nodes(loss: torch.Tensor) -> list[torch.autograd.graph.Node]:
    """The backward nodes of compiled regions reachable from ``loss``."""
    seen, todo, found = set(), [loss.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in node.name():
            found.append(node)
        todo.extend(n for n, _ in node.next_functions)
    return found


def _train(scope: str | None) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=0.01,
                               grad_sync_dtype=torch.float32)
    regions = compile_model(model, None, scope, backend="aot_eager") if scope else 0
    ran: list[int] = [0]
    positions: list[int] = []  # per reduce-scatter: compiled regions whose backward had run
    launch = opt.engine.grad_sync._launch

    def recording_launch(key):
        positions.append(ran[0])
        launch(key)

    opt.engine.grad_sync._launch = recording_launch
    gen = torch.Generator().manual_seed(1)
    losses, n_nodes = [], 0
    for _ in range(STEPS):
        idx = torch.randint(0, CFG.vocab_size, (2, 16), generator=gen)
        loss = model(idx[:, :-1], idx[:, 1:])
        nodes = _compiled_nodes(loss)
        n_nodes = len(nodes)
        ran[0] = 0
        for node in nodes:
            node.register_hook(lambda *_: ran.__setitem__(0, ran[0] + 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    calls = opt.engine.comm.total_calls["reduce_scatter.grads"]
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "rs_calls": calls, "rs_bytes": opt.engine.comm.total_bytes["reduce_scatter.grads"],
            "positions": positions[-calls // STEPS:], "nodes": n_nodes, "regions": regions,
            "keys": list(model.state_dict())}


@pytest.fixture(scope="module")
def runs():
    return {s: _train(s) for s in (None, "model", "graph", "blocks")}


@pytest.mark.parametrize("scope", ["model", "graph", "blocks"])
def test_every_scope_trains_like_eager(runs, scope):
    eager, got = runs[None], runs[scope]
    assert got["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    for a, b in zip(eager["params"], got["params"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert got["rs_calls"] == eager["rs_calls"] >= 2 * CFG.num_layers * STEPS  # ~2 buckets per block
    assert got["rs_bytes"] == eager["rs_bytes"]
    assert got["keys"] == eager["keys"] and not any("_orig_mod" in k for k in got["keys"])


def test_model_scope_compiles_everything_in_regions_that_overlap_the_backward(runs):
    r = runs["model"]
    assert r["regions"] == r["nodes"] == CFG.num_layers + 2  # embeddings, blocks, head + loss
    # Reduce-scatters start while regions are still to run backward: the head's and the
    # blocks' buckets launch before the last region (the embeddings) has run.
    assert r["positions"] == sorted(r["positions"])
    assert r["positions"][0] <= 2 and r["positions"][-1] == r["nodes"]
    assert sum(p < r["nodes"] for p in r["positions"]) >= CFG.num_layers
    assert len(set(r["positions"])) >= CFG.num_layers


def test_graph_scope_is_one_node_and_launches_after_the_whole_backward(runs):
    r = runs["graph"]
    assert r["regions"] == r["nodes"] == 1
    assert set(r["positions"]) == {1}  # every reduce-scatter after the one backward node


def test_blocks_scope_leaves_embeddings_and_head_eager(runs):
    r = runs["blocks"]
    assert r["regions"] == r["nodes"] == CFG.num_layers
    assert sum(p < r["nodes"] for p in r["positions"]) >= CFG.num_layers - 1


def test_unknown_scope_is_refused():
    with pytest.raises(ValueError, match="compile scope 'layers'"):
        compile_model(GPT(CFG), None, "layers")


def _train_fp8(scope: str | None, steps: int = 2, device: str = "cpu",
               backend: str = "inductor", mode: str = "default",
               bf16_layers: str | None = None) -> tuple[list[float], int]:
    """FP8 weights and GEMMs (delayed scaling) + DistributedFusedAdam, as the training command;
    the layers named ``*.{bf16_layers}`` compute in bf16 ([Note: FP8 layer filter])."""
    import fp8shard as fs

    torch.manual_seed(0)
    with fs.fp8_model_init(enabled=True, preserve_high_precision_init_val=True):
        model = GPT(CFG).to(device)
    model.to(torch.bfloat16)
    if bf16_layers:
        for name, layer in model.named_modules():
            if name.endswith("." + bf16_layers):
                layer.fp8_compute = False
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=0.01)
    recipe = fs.DelayedScaling()
    if scope:
        compile_model(model, recipe, scope, backend=backend, mode=mode)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, CFG.vocab_size, (2, 16), generator=gen).to(device)
        if mode == "reduce-overhead":  # as the Trainer does before every forward
            torch.compiler.cudagraph_mark_step_begin()
        with fs.fp8_autocast(enabled=True, recipe=recipe):
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt.engine.comm.total_calls["reduce_scatter.grads"]


def test_fp8_weights_whole_model_compiled_train_like_eager():
    """The default scope with FP8 weights (the whole GPT as one graph with FP8 weights is
    tests/nn/test_compile_graph.py's)."""
    eager, eager_calls = _train_fp8(None)
    got, calls = _train_fp8("model", backend="aot_eager")
    assert got == pytest.approx(eager, rel=1e-3)  # tests/train/test_compile_train.py's tolerance
    assert calls == eager_calls > 0


def test_fp8_and_bf16_layers_in_one_graph_train_like_eager():
    """Some layers filtered to bf16 compute ([Note: FP8 layer filter]): one graph (aot_eager)
    trains as eager, and differently from all-FP8 (the filter took effect)."""
    eager, _ = _train_fp8(None, steps=3, bf16_layers="fc2")
    got, _ = _train_fp8("graph", steps=3, backend="aot_eager", bf16_layers="fc2")
    assert got == pytest.approx(eager, rel=1e-3)
    assert eager != _train_fp8(None, steps=3)[0]


@pytest.mark.gpu
def test_cuda_inductor_fp8_and_bf16_layers_train_like_eager():
    """The GPU twin: Inductor's one graph with FP8 and filtered bf16 layers, to a relative 1e-2."""
    eager, _ = _train_fp8(None, steps=3, device="cuda", bf16_layers="fc2")
    got, _ = _train_fp8("graph", steps=3, device="cuda", bf16_layers="fc2")
    assert got == pytest.approx(eager, rel=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["model", "graph"])
def test_cuda_inductor_whole_model_fp8_trains_like_eager(scope):
    """On the GPU with Inductor (its FP8 casts are generated code, eager's are Triton kernels):
    the same losses to a relative 1e-2 over 3 steps and the same reduce-scatters."""
    eager, eager_calls = _train_fp8(None, steps=3, device="cuda")
    got, calls = _train_fp8(scope, steps=3, device="cuda")
    assert got == pytest.approx(eager, rel=1e-2)
    assert calls == eager_calls > 0


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["model", "graph"])
def test_cuda_graphs_train_as_the_compiled_model(scope):
    """``trainer.compile_mode=reduce-overhead``: the compiled graphs replayed as CUDA graphs, with
    FP8 weights rewritten in place by the optimizer and the delayed-scaling state updated between
    replays, give the losses of the same compiled model without CUDA graphs (the same kernels)."""
    plain, plain_calls = _train_fp8(scope, steps=5, device="cuda")
    graphs, calls = _train_fp8(scope, steps=5, device="cuda", mode="reduce-overhead")
    assert graphs == pytest.approx(plain, rel=1e-3)
    assert calls == plain_calls > 0
    assert graphs[-1] < graphs[0]  # it trains: stale replays (weights not seen) would not


def test_an_unknown_compile_mode_is_refused():
    with pytest.raises(ValueError, match="compile mode 'max-autotune': choose one of default, reduce"):
        compile_model(GPT(CFG), None, "graph", mode="max-autotune")
