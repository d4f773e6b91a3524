"""What every rank runs in the distributed optimizer tests (module-level, so workers can import it).

The reference is ``torch.optim.AdamW`` (or Adam) in this process on the gradients averaged over
all ranks: every rank evaluates every rank's batch at the current weights (a functional copy of
the model with the FP8 weights dequantized), so no rank needs another rank's data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from fp8shard.fp8 import Float8Tensor, Fp8Format, cast_to_fp8, scale_from_amax
from fp8shard.optim import DistributedFusedAdam

E4M3_MAX = Fp8Format.E4M3.max
TINY_BUCKET_MB = 96 * 4 / 2**20  # 96 fp32 elements: parameters straddle buckets


class Gamma(nn.Module):
    """A bf16 per-feature scale (a norm's weight)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.float()


class BfLinear(nn.Module):
    """A bf16 weight (and optional fp32 bias) used in fp32 compute."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(w.to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.float(), self.bias)


class TinyMixed(nn.Module):
    """FP8 weights (one 7x13, one with a preserved init value), fp32 biases, bf16 weights, and
    two parameters (fp32 and FP8) that never get a gradient."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1234)

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * 0.3

        self.fc1 = nn.Linear(13, 7)
        self.fc1.weight = nn.Parameter(Float8Tensor.quantize(rnd(7, 13)))
        self.fc1.bias = nn.Parameter(rnd(7))
        self.gamma = Gamma(7)
        self.fc2 = nn.Linear(7, width, bias=False)
        w2 = rnd(width, 7)
        self.fc2.weight = nn.Parameter(Float8Tensor.quantize(w2))
        self.fc2.weight.set_high_precision_init_val(w2)  # as fp8_model_init(preserve...) would
        self.head = BfLinear(rnd(3, width))
        self.unused = nn.Parameter(rnd(5, 3))
        self.unused_fp8 = nn.Parameter(Float8Tensor.quantize(rnd(4, 4)))

    def forward(self, x: torch.Tensor, skip_gamma: bool = False) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h if skip_gamma else self.gamma(h)))
        return self.head(h)


def batch(step: int, rank: int, micro: int = 0, rows: int = 4) -> torch.Tensor:
    """Rows ``micro * rows ...`` of this rank's data: 3 micro-batches of 4 rows are 1 of 12."""
    out = []
    for i in range(micro * rows, (micro + 1) * rows):
        g = torch.Generator().manual_seed(1_000_000 * step + 1000 * rank + i)
        out.append(torch.randn(13, generator=g))
    return torch.stack(out)


def hp_value(p: torch.Tensor) -> torch.Tensor:
    return p.dequantize(torch.float32) if isinstance(p, Float8Tensor) else p.detach().float()


def grads_at(model: nn.Module, x: torch.Tensor, scale: float = 1.0,
             skip_gamma: bool = False) -> dict[str, torch.Tensor]:
    """d(loss)/d(param) at the model's current weights, in each parameter's nominal dtype."""
    names = [n for n, _ in model.named_parameters()]
    values = {n: (p.dequantize() if isinstance(p, Float8Tensor) else p.detach().clone()).requires_grad_()
              for n, p in model.named_parameters()}
    loss = functional_call(model, values, (x,), {"skip_gamma": skip_gamma}).square().mean() * scale
    gs = torch.autograd.grad(loss, [values[n] for n in names], allow_unused=True)
    return {n: torch.zeros_like(values[n]) if g is None else g for n, g in zip(names, gs, strict=True)}


def param_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        if isinstance(p, Float8Tensor):
            h.update(p.uint8_view().contiguous().numpy().tobytes())
            h.update(p.scale_inv.numpy().tobytes())
        else:
            h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_digest(sd: dict) -> str:
    h = hashlib.sha256()
    for i in sorted(sd["state"]):
        for k in ("master", "exp_avg", "exp_avg_sq"):
            h.update(sd["state"][i][k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Case:
    steps: int = 3
    bucket_cap_mb: float = TINY_BUCKET_MB
    alignment: int = 1
    grad_sync_dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    adam_w_mode: bool = True
    overlap_grad_sync: bool = True
    overlap_param_sync: bool = False
    micro: int = 1  # micro-batches per step (no_sync for all but the last)
    rows: int = 4  # rows per micro-batch
    clip: float | None = None
    nan_at_step: int | None = None  # rank 1 gets a NaN loss at this step (1-based)
    exact: bool = False  # compare the master bit for bit (else to a tolerance)
    scaling: str = "current"
    groups: bool = False  # two param groups: no weight decay and another lr for biases/norms
    skip_on_rank0: bool = False  # rank 0 does not use gamma: its buckets complete in another order
    skip_at_step: int | None = None  # no rank uses gamma at this step (its slot holds the last one's)


def _skips_gamma(case: Case, rank: int, step: int) -> bool:
    return (case.skip_on_rank0 and rank == 0) or case.skip_at_step == step


def _is_decayed(name: str) -> bool:
    return name.endswith("weight") and "gamma" not in name


def param_groups(model: nn.Module, hp: dict[str, torch.Tensor] | None = None) -> list[dict]:
    """Weights with decay; biases and norm weights without, at a smaller lr.

    With ``hp`` (name -> tensor), the same groups made of those tensors (for the reference)."""
    named = list(model.named_parameters())
    pick = (lambda n, p: p) if hp is None else (lambda n, p: hp[n])
    return [{"params": [pick(n, p) for n, p in named if _is_decayed(n)]},
            {"params": [pick(n, p) for n, p in named if not _is_decayed(n)], "weight_decay": 0.0, "lr": 5e-3}]


def run_training(case: Case) -> dict:
    """Train ``case.steps`` steps, checking against the reference after each; return digests."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyMixed()
    names = [n for n, _ in model.named_parameters()]  # the optimizer's parameter order
    if case.groups:
        names = [n for n, _ in model.named_parameters() if _is_decayed(n)]
        names += [n for n, _ in model.named_parameters() if not _is_decayed(n)]
    # The reference master starts where ours must: the preserved init value when there is one.
    ref = {}
    for n, p in model.named_parameters():
        init = p.get_high_precision_init_val() if isinstance(p, Float8Tensor) else None
        ref[n] = (init.float() if init is not None else hp_value(p)).clone().requires_grad_()
    assert model.fc2.weight.get_high_precision_init_val() is not None
    ref_cls = torch.optim.AdamW if case.adam_w_mode else torch.optim.Adam
    ref_params = param_groups(model, ref) if case.groups else [ref[n] for n in names]
    ref_opt = ref_cls(ref_params, lr=2e-2, betas=(0.9, 0.99), eps=1e-8,
                      weight_decay=0.05, foreach=False)
    opt = DistributedFusedAdam(
        param_groups(model) if case.groups else model.parameters(),
        lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05,
        adam_w_mode=case.adam_w_mode, bucket_cap_mb=case.bucket_cap_mb, alignment=case.alignment,
        grad_sync_dtype=case.grad_sync_dtype, state_dtype=case.state_dtype,
        overlap_grad_sync=case.overlap_grad_sync, overlap_param_sync=case.overlap_param_sync,
        fp8_weight_scaling=case.scaling, module=model if case.overlap_param_sync else None,
    )
    assert model.fc2.weight.get_high_precision_init_val() is None  # consumed by the optimizer
    fp8_names = [n for n, p in model.named_parameters() if isinstance(p, Float8Tensor)]
    params = dict(model.named_parameters())
    scale = {n: params[n]._scale_inv.float().reciprocal() for n in fp8_names}
    history: dict[str, list[torch.Tensor]] = {n: [] for n in fp8_names}
    skipped = []
    for step in range(1, case.steps + 1):
        # --- ours: k micro-batches, all but the last under no_sync
        for j in range(case.micro):
            bad = case.nan_at_step == step and rank == 1
            factor = (float("nan") if bad else 1.0) / case.micro
            ctx = opt.no_sync() if j < case.micro - 1 else contextlib.nullcontext()
            with ctx:
                out = model(batch(step, rank, j, case.rows), skip_gamma=_skips_gamma(case, rank, step))
                (out.square().mean() * factor).backward()
        if case.overlap_param_sync and step > 1:
            assert not opt.engine.param_sync.pending, "forward pre-hooks should have waited for every bucket"
        # --- reference gradients: every rank's micro-batches at the current weights, summed in
        # the order the buckets accumulate them, then averaged over ranks in fp32.
        avg = {n: torch.zeros_like(ref[n]) for n in names}
        for r in range(ws):
            acc = {n: torch.zeros_like(ref[n], dtype=case.grad_sync_dtype) for n in names}
            for j in range(case.micro):
                bad = case.nan_at_step == step and r == 1
                g = grads_at(model, batch(step, r, j, case.rows), (float("nan") if bad else 1.0) / case.micro,
                             skip_gamma=_skips_gamma(case, r, step))
                for n in names:
                    acc[n] += g[n].to(case.grad_sync_dtype)
            for n in names:
                avg[n] += acc[n].float()
        before = opt.state_dict() if case.nan_at_step == step else None
        digest_before = param_digest(model)
        norm = opt.clip_grad_norm(case.clip) if case.clip is not None else None
        opt.step()
        skipped.append(opt.last_step_skipped)
        if case.nan_at_step == step:
            assert opt.last_step_skipped
            after = opt.state_dict()
            assert after["step"] == before["step"] and state_digest(after) == state_digest(before)
            assert param_digest(model) == digest_before
            continue
        assert not opt.last_step_skipped
        for n in names:
            ref[n].grad = avg[n] / ws
        if case.clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_([ref[n] for n in names], case.clip)
            torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
            assert ref_norm > case.clip  # the test really clips
        ref_opt.step()
        if case.overlap_param_sync:
            assert opt.engine.param_sync.pending  # step() returned with the all-gathers in flight
            opt.wait_param_sync()
        _check_against_reference(opt, model, names, ref, case, scale, history)
    sd = opt.state_dict()
    return {"params": param_digest(model), "state": state_digest(sd), "skipped": skipped,
            "comm": opt.comm_report(), "masters": [sd["state"][i]["master"] for i in range(len(names))]}


def _check_against_reference(opt, model, names, ref, case, scale, history) -> None:
    sd = opt.state_dict()
    for i, n in enumerate(names):
        master = sd["state"][i]["master"]
        if case.exact:
            assert torch.equal(master, ref[n].detach()), f"{n}: master differs from torch.optim"
        else:
            # fp32 sync: only the order of the sum over ranks differs; bf16 sync or bf16 states
            # round the gradient / moments to 8 bits: about 0.4% of each update of size ~lr.
            low = case.grad_sync_dtype != torch.float32 or case.state_dtype != torch.float32
            tol = dict(rtol=1e-2, atol=2e-3) if low else dict(rtol=2e-4, atol=2e-5)
            torch.testing.assert_close(master, ref[n].detach(), **tol, msg=n)
        p = dict(model.named_parameters())[n]
        if isinstance(p, Float8Tensor):
            # [Note: weight scaling]: one scale from the global amax of the new master.
            amax = master.abs().max()
            if case.scaling == "current":
                used = scale_from_amax(amax, E4M3_MAX, scale[n])
                scale[n] = used
            else:  # delayed: this step casts with the scale of the history before it
                used = scale[n]
                history[n].append(amax)
                # AmaxHistory divides by a tensor fmt.max (correctly rounded, unlike float / tensor)
                fmt_max = torch.tensor(E4M3_MAX)
                scale[n] = scale_from_amax(torch.stack(history[n]).max(), fmt_max, scale[n])
            expected = cast_to_fp8(master, used, Fp8Format.E4M3).view(torch.uint8)
            assert torch.equal(p.uint8_view(), expected), f"{n}: FP8 bytes"
            assert torch.equal(p.scale_inv, used.reciprocal()), f"{n}: scale_inv"
            if case.exact:
                ref_used = scale_from_amax(ref[n].detach().abs().max(), E4M3_MAX, used)
                ref_bytes = cast_to_fp8(ref[n].detach(), ref_used, Fp8Format.E4M3).view(torch.uint8)
                if case.scaling == "current":
                    assert torch.equal(p.uint8_view(), ref_bytes)
        else:
            assert torch.equal(p.detach(), master.to(p.dtype)), f"{n}: weight != master"



# --------------------------------------------------------------------------- accounting
def wire_and_memory(alignment: int, fp8: bool = True) -> dict:
    """One step; return what the optimizer reports next to what the test counts itself.

    ``fp8=False``: the baseline of the design table, bf16 weights with fp32 gradients.
    """
    rank = dist.get_rank()
    model = TinyMixed(width=64)
    grad_dtype = torch.bfloat16
    if not fp8:
        grad_dtype = torch.float32
        model.fc1 = BfLinear(model.fc1.weight.dequantize(), model.fc1.bias)
        model.fc2 = BfLinear(model.fc2.weight.dequantize())
        model.unused_fp8 = nn.Parameter(model.unused_fp8.dequantize(torch.bfloat16))
    opt = DistributedFusedAdam(model.parameters(), lr=1e-3, alignment=alignment,
                               grad_sync_dtype=grad_dtype)
    model(batch(1, rank)).square().mean().backward()
    # Storages alive between the backward and the step, gradients included
    # ([Note: gradient regions]: the gradient storage lives from the backward to the step's end).
    params = list(model.parameters())
    storages = {}
    for p in params:
        data = p._data if isinstance(p, Float8Tensor) else p.detach()
        storages[data.untyped_storage().data_ptr()] = data.untyped_storage().nbytes()
    for rb in opt.engine.regions:
        for t in rb.tensors():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    grad_refs = [weakref.ref(rb.grad_buffer) for rb in opt.engine.regions]  # views keep their base
    opt.step()
    grads_after_step = (sum(r() is not None for r in grad_refs)
                        + sum(rb.grad_buffer is not None for rb in opt.engine.regions))
    fp8_numel = sum(p.numel() for p in params if isinstance(p, Float8Tensor))
    by_dtype: dict[torch.dtype, int] = {}
    for p in params:
        if not isinstance(p, Float8Tensor):
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    return {"comm": opt.comm_report(), "memory": opt.memory_report(), "storage_bytes": sum(storages.values()),
            "grad_bytes_after_step": grads_after_step,
            "fp8_numel": fp8_numel, "other_numel": {str(k): v for k, v in by_dtype.items()},
            "numel": sum(p.numel() for p in params)}


# --------------------------------------------------------------------------- checkpoints
def save_after_training(path: str, steps: int) -> str:
    rank = dist.get_rank()
    model = TinyMixed()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1,
                               bucket_cap_mb=TINY_BUCKET_MB, fp8_weight_scaling="delayed")
    for step in range(1, steps + 1):
        model(batch(step, rank)).square().mean().backward()
        opt.step()
    sd = opt.state_dict()
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, opt.sharded_state_dict())
    if rank == 0:
        torch.save({"optim": sd, "model": model.state_dict(), "sharded": pieces}, path)
    dist.barrier()
    return state_digest(sd)


def load_and_resave(path: str) -> dict:
    """Load a checkpoint written at another world size; save it again; reassemble shards."""
    ckpt = torch.load(path, weights_only=False)
    model = TinyMixed()
    opt = DistributedFusedAdam(model.parameters(), lr=0.5, weight_decay=0.0, bucket_cap_mb=TINY_BUCKET_MB,
                               fp8_weight_scaling="delayed")
    model.load_state_dict(ckpt["model"])  # copies into the optimizer's buffers, in place
    opt.load_state_dict(ckpt["optim"])
    sd = opt.state_dict()
    assert sd["param_groups"][0]["lr"] == 1e-2  # hyperparameters come back too
    for i, st in ckpt["optim"]["state"].items():
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["state"][i][k], st[k]), (i, k)
        for k, v in st["fp8"].items() if "fp8" in st else ():
            assert torch.equal(sd["state"][i]["fp8"][k], v), (i, k)
    # Every rank's sharded pieces, put back together, give the full tensors.
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, opt.sharded_state_dict())
    for i, st in sd["state"].items():
        full = torch.full((st["master"].numel(),), float("nan"))
        for shard in pieces:
            for pc in shard["state"].get(i, []):
                full[pc["offset"]:pc["offset"] + pc["numel"]] = pc["master"]
        assert torch.equal(full.view_as(st["master"]), st["master"]), i
    # The pieces each of the saving ranks wrote load just as well (the DCP path builds on this).
    merged = {**ckpt["sharded"][0], "state": {}}
    for shard in ckpt["sharded"]:
        for i, entries in shard["state"].items():
            merged["state"].setdefault(i, []).extend(entries)
    other = DistributedFusedAdam(TinyMixed().parameters(), lr=0.5, bucket_cap_mb=TINY_BUCKET_MB,
                                 fp8_weight_scaling="delayed")
    other.load_sharded_state_dict(merged)
    assert state_digest(other.state_dict()) == state_digest(sd)
    # One more step works from the loaded state (and the step count continued).
    model(batch(9, dist.get_rank())).square().mean().backward()
    opt.step()
    assert opt.state_dict()["step"] == ckpt["optim"]["step"] + 1
    return {"digest": state_digest(sd), "params": param_digest(model)}


# --------------------------------------------------------------------------- bad input
def construct_outside_group() -> str:
    sub = dist.new_group([0, 1])  # every rank must call new_group
    if dist.get_rank() != 2:
        return "member"
    try:
        DistributedFusedAdam(TinyMixed().parameters(), process_group=sub)
    except ValueError as e:
        return str(e)
    return "no error"


# --------------------------------------------------------------------------- with fp8shard.nn
def train_fp8_linears(steps: int) -> str:
    """fs.nn.Linear layers built in fp8_model_init, computing under fp8_autocast."""
    import fp8shard as fs

    rank = dist.get_rank()
    torch.manual_seed(0)
    with fs.fp8_model_init(enabled=True, preserve_high_precision_init_val=True):
        model = nn.Sequential(fs.nn.Linear(13, 32), nn.Tanh(), fs.nn.Linear(32, 16))
    init = model[0].weight.get_high_precision_init_val().clone()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY_BUCKET_MB)
    assert torch.equal(opt.state_dict()["state"][0]["master"], init)  # not the FP8 bytes
    weights = [model[0].weight, model[2].weight]
    amax_sync = fs.nn.AmaxSync(model)  # delayed scaling: activation amaxes over every rank
    for step in range(1, steps + 1):
        with fs.fp8_autocast(enabled=True):
            model(batch(step, rank)).square().mean().backward()
        amax_sync.step()
        stale = [w.fp8_transpose() for w in weights]  # cached for the backward GEMM
        stale = [t.clone() for t in stale]
        opt.step()
        masters = opt.state_dict()["state"]
        for w in weights:
            i = [id(p) for p in model.parameters()].index(id(w))
            master = masters[i]["master"]
            scale = scale_from_amax(master.abs().max(), E4M3_MAX)
            assert torch.equal(w.uint8_view(), cast_to_fp8(master, scale, Fp8Format.E4M3).view(torch.uint8))
            # The transpose cache was dropped with the bytes (TransformerEngine 1596).
            assert torch.equal(w.fp8_transpose().view(torch.uint8), w.uint8_view().t().contiguous())
        assert any(not torch.equal(s, w.fp8_transpose()) for s, w in zip(stale, weights, strict=True))
    return param_digest(model)


# --------------------------------------------------------------------------- collectives
def reduce_scatter_paths() -> tuple[list[float], list[float], dict[str, int]]:
    """AVG and the SUM-then-divide fallback give the same shard; the counter sees both."""
    from fp8shard.optim.collectives import CommCounter, Group

    rank, ws = dist.get_rank(), dist.get_world_size()
    group = Group(None, CommCounter())
    outs = []
    for avg_supported in (True, False):
        group._avg_ok[torch.float32] = avg_supported
        buf = torch.arange(4.0 * ws) * (rank + 1)
        group.reduce_scatter_avg(buf[rank * 4:(rank + 1) * 4], buf, kind="test").wait()
        outs.append(buf[rank * 4:(rank + 1) * 4].tolist())
    return outs[0], outs[1], dict(group.counter.total_bytes)
