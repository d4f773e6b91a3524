"""What a training step keeps and moves, counted the same way for every system of compare_peers.py.

wire bytes: torch.distributed's collectives wrapped while ``count_wire_bytes()`` is open (and
DDP's all-reduce sent through them by ``ddp_counting_hook``), each call counted as the full
buffer it reduces or gathers, accumulated per collective in ``WIRE_COUNTS``. persistent bytes:
every distinct storage reachable from the parameters, their gradients and the optimizer state
(``persistent_bytes``).
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------- wire bytes
WIRE_COUNTS: dict[str, int] = {}
_WRAPPED = {
    "all_reduce": lambda a, k: _first_tensor(a, k, "tensor"),
    "all_gather_into_tensor": lambda a, k: _first_tensor(a, k, "output_tensor"),
    "reduce_scatter_tensor": lambda a, k: _nth(a, k, 1, "input"),
    "broadcast": lambda a, k: _first_tensor(a, k, "tensor"),
    "all_gather": lambda a, k: _nth(a, k, 1, "tensor"),
    # torch >= 2.12 names (FSDP2 and fp8shard call these when they exist)
    "all_gather_single": lambda a, k: _first_tensor(a, k, "output_tensor"),
    "reduce_scatter_single": lambda a, k: _nth(a, k, 1, "input"),
}


def _first_tensor(args: tuple, kwargs: dict, name: str) -> torch.Tensor:
    return args[0] if args else kwargs[name]


def _nth(args: tuple, kwargs: dict, i: int, name: str) -> torch.Tensor:
    return args[i] if len(args) > i else kwargs[name]


def _nbytes(t: Any) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    if hasattr(t, "_local_tensor"):
        t = t._local_tensor
    return t.numel() * t.element_size()


@contextlib.contextmanager
def count_wire_bytes():
    """Wrap torch.distributed's collectives; ``WIRE_COUNTS[name]`` accumulates full-buffer bytes."""
    originals = {name: getattr(dist, name) for name in _WRAPPED if hasattr(dist, name)}

    def wrap(name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            buf = _WRAPPED[name](args, kwargs)
            if name == "all_gather":  # list output, input tensor: count the output list
                buf = args[0] if args else kwargs["tensor_list"]
            WIRE_COUNTS[name] = WIRE_COUNTS.get(name, 0) + _nbytes(buf)
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def ddp_counting_hook(state, bucket):  # no annotations: DDP checks them against GradBucket
    """DDP's default all-reduce (average), sent through the counted ``dist.all_reduce``."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


# ----------------------------------------------------------------------------- persistent bytes

def persistent_bytes(model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes of every distinct storage reachable from params, grads and optimizer state."""
    from fp8shard import Float8Tensor

    seen: set[tuple[int, int]] = set()

    def storages(t: Any) -> list[torch.Tensor]:
        if t is None or not isinstance(t, torch.Tensor):
            return []
        if hasattr(t, "_local_tensor"):  # DTensor (FSDP2)
            return storages(t._local_tensor)
        if isinstance(t, Float8Tensor):
            return [t.fp8_data, t.scale_inv]
        if type(t).__name__ == "WeightWithDynamicFloat8CastTensor":
            return storages(t._tensor)
        return [t]

    def count(ts: list[torch.Tensor]) -> int:
        total = 0
        for x in ts:
            if x.device.type == "meta":
                continue
            s = x.untyped_storage()
            key = (s.data_ptr(), s.nbytes())
            if key not in seen and s.nbytes() > 0:
                seen.add(key)
                total += s.nbytes()
        return total

    out = {"weights": 0, "grads": 0, "optimizer": 0}
    params = list(model.parameters())
    out["weights"] = count([s for p in params for s in storages(p)])
    if hasattr(optimizer, "memory_report"):  # fp8shard: buffers the optimizer owns
        rep = optimizer.memory_report()
        out["grads"] = int(rep.get("grad_buffers", 0))
        out["optimizer"] = int(sum(v for k, v in rep.items()
                                   if k in ("master", "optimizer_states", "exp_avg", "exp_avg_sq")))
        return out
    out["grads"] = count([s for p in params for s in storages(p.grad)])
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps one
    states = [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    out["optimizer"] = count([s for v in states for s in storages(v)])
    return out


# ----------------------------------------------------------------------------- what is live at the peak
def _where(frames: list[dict]) -> str:
    """The frame that says what an allocation is for: the innermost one in fp8shard, the
    benchmarks or Inductor's generated code (with its source line), else the innermost."""
    import linecache

    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in ("fp8shard", "benchmarks", "torchinductor", "nanogpt")):
            src = linecache.getline(name, f.get("line", 0)).strip()
            where = f"{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
            return where + (f" | {src[:90]}" if src else "")
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return "(no frames)"


_INDUCTOR_ALLOC = re.compile(r"empty_strided_\w+\(\((?P<shape>[^)]*)\), \([^)]*\), torch\.(?P<dtype>\w+)\)")


def _kind(where: str) -> str:
    """An allocation's shape and dtype where Inductor's generated line says them (``(1280, 50304)
    float32``), else where it was made: the blocks of one kind made on many lines add up."""
    m = _INDUCTOR_ALLOC.search(where)
    return f"({m['shape']}) {m['dtype']}" if m else where


def _ranked(at_peak: list[tuple[int, str]], key, top: int) -> list[dict[str, Any]]:
    groups: dict[str, list[int]] = {}
    for size, where in at_peak:
        g = groups.setdefault(key(where), [0, 0])
        g[0] += size
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"mb": b / 2**20, "blocks": n, "where": w} for w, (b, n) in ranked]


def peak_live_blocks(snapshot: dict, top: int = 12) -> dict[str, Any]:
    """Replay a ``torch.cuda.memory._snapshot()``'s allocation trace (recorded with
    ``torch.cuda.memory._record_memory_history()``): the moment the memory allocated during the
    recording peaked, and what was live then, grouped by where it was allocated (``_where``,
    "groups") and by shape and dtype ("kinds", ``_kind``), largest first. Blocks allocated
    before the recording started are not in the trace: the peak is over the recording's own
    allocations."""
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for evt in (snapshot.get("device_traces") or [[]])[0]:
        action, addr, size = evt.get("action"), evt.get("addr"), evt.get("size", 0)
        if action == "alloc":
            live[addr] = (size, _where(evt.get("frames") or []))
            now += size
            if now > peak:
                peak, at_peak = now, dict(live)
        elif action == "free_completed" and addr in live:
            now -= live.pop(addr)[0]
    blocks = list(at_peak.values())
    return {"peak_mb": peak / 2**20, "groups": _ranked(blocks, lambda w: w, top),
            "kinds": _ranked(blocks, _kind, top)}


# ----------------------------------------------------------------------------- one step's memory
PHASES = ("start", "peak_forward", "after_forward", "peak_backward", "after_backward", "peak_optimizer")
PHASE_HEADS = ("start", "fwd peak", "fwd end", "bwd peak", "bwd end", "optim")


class StepMemory:
    """The CUDA memory of one training step by phase: allocated at its start (what persists
    between steps), the forward's peak and what is left after it (+ what is saved for
    backward), the backward's peak and what is left after it (+ gradients), the optimizer
    step's peak; with ``snapshot`` also what is live at the step's peak (``peak_live_blocks``).
    Call ``begin()``, then ``end("forward")``, ``end("backward")``, ``end("optimizer")``; the
    peak statistics are reset between phases, ``peak_before`` keeps the run's peak so far."""

    def __init__(self, snapshot: bool = False) -> None:
        self.snapshot = snapshot
        self.mb: dict[str, float] = {}
        self.live: dict[str, Any] | None = None
        self.peak_before = 0

    def begin(self) -> None:
        self.peak_before = torch.cuda.max_memory_allocated()
        self.mb["start"] = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=500_000)

    def end(self, phase: str) -> None:
        self.mb[f"peak_{phase}"] = torch.cuda.max_memory_allocated() / 2**20
        if phase != "optimizer":
            self.mb[f"after_{phase}"] = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
        if phase == "optimizer" and self.snapshot:
            self.live = peak_live_blocks(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)

    def peak_bytes(self) -> int:
        """The run's peak: before this step, or in one of its phases."""
        phase_peak = max((v for k, v in self.mb.items() if k.startswith("peak_")), default=0.0)
        return max(self.peak_before, int(phase_peak * 2**20), torch.cuda.max_memory_allocated())


def memory_table(rows: list[dict]) -> list[str]:
    """compare_peers' rows with ``mem_phases_mb`` (and ``live_at_peak``) as printed lines."""
    lines = []
    phased = [r for r in rows if r.get("available") and r.get("mem_phases_mb")]
    if phased:
        lines.append(f"\n{'memory (MB), last step':<23}" + "".join(f"{h:>9}" for h in PHASE_HEADS))
        lines += [f"{r['system']:<23}" + "".join(f"{r['mem_phases_mb'][k]:>9.0f}" for k in PHASES)
                  for r in phased]
    for r in rows:
        if r.get("live_at_peak"):
            lines.append(f"\n{r['system']}: live at the step's peak ({r['live_at_peak']['peak_mb']:.0f} MB "
                         "allocated during the step)")
            lines += [f"  {g['mb']:9.1f} MB {g['blocks']:5d} blocks  {g['where']}"
                      for g in r["live_at_peak"]["groups"]]
            lines.append("  by shape and dtype:")
            lines += [f"  {g['mb']:9.1f} MB {g['blocks']:5d} blocks  {g['where']}"
                      for g in r["live_at_peak"].get("kinds", [])]
    return lines
