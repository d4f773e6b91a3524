"""How much memory a run will take, estimated from its config before anything is allocated.

[Note: memory budget]
    Every size key (widths, depth, sequence length, batch sizes, vocabulary, corpus sizes,
    amax history) has its upper bound here: the bytes the run would allocate, estimated from
    the config alone, must fit the machine. The estimate counts, per rank:

    - parameters and optimizer: the weights (1 byte per FP8 weight, else the parameters' dtype),
      the gradient buffers, the FP32 master weights and the Adam moments (divided by the world
      size under distributed_fused_adam), and the FP32 copy of the initial weights that model
      construction holds while the optimizer starts;
    - activations saved for backward: per layer about ``b*s*(12*h + 3*ffn)`` elements of the
      compute dtype for micro batch ``b`` and sequence ``s``, plus the ``b*heads*s*s`` attention
      scores on CPU (the math kernel materializes them; the GPU kernels do not);
    - logits: ``b*s*vocab``, in fp32 for the loss plus their gradient;
    - the token windows of one optimizer step (this rank's share of the global batch, int64);
    - the data held in host memory (the generated corpus while it is generated, or a text file
      and its token ids; a token file is read window by window, never loaded whole).

    CPU runs compare the sum over this machine's ranks (``LOCAL_WORLD_SIZE``) with its physical
    memory (``os.sysconf``), or the memory limit of its container (its cgroup's, v1 or v2) where
    that is smaller; GPU runs compare each rank's device bytes with its GPU's memory
    (``torch.cuda.mem_get_info``) and the host bytes with that same host limit. It is an
    estimate (allocator overheads, temporaries and the framework itself come on top), meant to
    turn a config that cannot fit -- a typo'd width, a batch of a million -- into one line naming
    the keys before minutes of start-up end in the OOM killer; a run that fits the estimate can
    still run out of memory.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from fp8shard.train.config import Config, ConfigError

GIB = 2**30

# What each part grows with, for the message.
_KEYS = {
    "parameters and optimizer": "model.hidden_size, model.ffn_hidden_size, model.num_layers, data.vocab_size",
    "activations": "model.micro_batch_size, model.encoder_seq_length, model.hidden_size, model.num_layers",
    "attention scores": "model.micro_batch_size, model.encoder_seq_length, model.num_attention_heads",
    "logits": "model.micro_batch_size, model.encoder_seq_length, data.vocab_size",
    "step batch": "model.global_batch_size, model.encoder_seq_length",
    "fp8 amax history": "model.fp8_amax_history_len, model.num_layers",
    "position tables": "model.max_position_embeddings, model.encoder_seq_length",
    "data": "data.num_train_tokens, data.num_val_tokens (or the size of data.path)",
}


@dataclasses.dataclass
class Estimate:
    """Bytes per rank by part; ``device`` on the accelerator (the host for CPU runs), ``host`` in RAM."""

    device: dict[str, int]
    host: dict[str, int]

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def param_counts(cfg: Config, vocab_size: int) -> tuple[int, int]:
    """(elements of the block projection matrices, elements of every other parameter)."""
    m = cfg.model
    h, n = m.hidden_size, m.num_layers
    shapes = m.projection_shapes().values()
    matrices = n * sum(out * inp for out, inp in shapes)
    biases = n * sum(out for out, _ in shapes) if m.bias else 0
    norm = h * (2 if m.normalization == "layernorm" and m.bias else 1)
    positions = (m.max_position_embeddings or m.encoder_seq_length) * h
    other = (biases + (2 * n + 1) * norm + vocab_size * h
             + (positions if m.position_embedding_type == "learned_absolute" else 0)
             + (0 if m.share_embeddings_and_output_weights else vocab_size * h))
    return matrices, other


def _data_bytes(cfg: Config) -> int:
    d = cfg.data
    if d.source == "markov":
        # Generated as (length, chains) then copied chain after chain: about three copies of
        # the larger stream while it is made, and both streams kept.
        item = 2 if d.vocab_size <= 65536 else 4
        classes = d.markov_classes * (2 * d.markov_spread + 1) * 8 * 3
        table = max(d.markov_order - 1, 1) * d.vocab_size * 8 + d.vocab_size * 8
        streams = d.num_train_tokens + d.num_val_tokens + 2 * max(d.num_train_tokens, d.num_val_tokens)
        return item * streams + classes + table
    size = _file_size(d.path)
    if d.source == "text":
        # bytes: the file as uint8; with a tokenizer: the text, Python's list of ids (about
        # 40 bytes per id, an id per ~4 bytes of text) and the uint32 array.
        return size if d.tokenizer is None else size * 16
    return 0  # tokens: read window by window (pread), never loaded whole


def _file_size(path: str | None) -> int:
    try:
        return os.stat(path).st_size if path else 0
    except OSError:
        return 0


def estimate(cfg: Config, world_size: int, vocab_size: int, on_gpu: bool) -> Estimate:
    """The bytes one rank of ``cfg`` will hold (see [Note: memory budget])."""
    m, o, t = cfg.model, cfg.model.optim, cfg.trainer
    from fp8shard.train.builders import params_dtype  # torch-importing module, imported late

    matrices, other = param_counts(cfg, vocab_size)
    total = matrices + other
    pdt = params_dtype(cfg).itemsize
    if o.name == "distributed_fused_adam":
        weights = matrices * (1 if m.fp8_params else pdt) + other * pdt
        grads = total * (2 if o.grad_sync_dtype == "bf16" else 4)
        state = 2 if o.state_dtype == "bf16" else 4
        sharded = -(-total * (4 + 2 * state + 4) // world_size)  # master, m, v, fp32 grad shard
    else:
        weights = total * pdt
        grads = total * pdt * (2 if world_size > 1 else 1)  # .grad and DDP's buckets
        sharded = total * 4 * 2  # Adam's m and v
    init_copy = total * 4  # the fp32 init model / the FP8 weights' init values
    elem = 2 if t.precision == "bf16-mixed" else 4
    b, s = m.micro_batch_size, m.encoder_seq_length
    fc1 = m.projection_shapes()["fc1"][0]
    device = {
        "parameters and optimizer": weights + grads + sharded + (0 if on_gpu else init_copy),
        "activations": m.num_layers * b * s * (12 * m.hidden_size + 3 * fc1) * elem,
        "attention scores": 0 if on_gpu else m.num_layers * b * m.num_attention_heads * s * s * (elem + 1),
        "logits": b * s * vocab_size * (4 + 4 + elem),
        "step batch": (m.global_batch_size // max(world_size, 1)) * (s + 1) * 8 * 3,
        "fp8 amax history": m.num_layers * 4 * 3 * m.fp8_amax_history_len * 4 * 2 if m.fp8 else 0,
        "position tables": (m.max_position_embeddings or s) * (m.hidden_size // m.num_attention_heads) * 4,
    }
    host = {"data": _data_bytes(cfg)}
    if on_gpu:
        host["parameters and optimizer"] = init_copy
    return Estimate(device, host)


def physical_memory() -> int | None:
    """Bytes of RAM of this machine (``os.sysconf``), or None where it cannot be read."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


CGROUP_ROOT = "/sys/fs/cgroup"


def cgroup_memory_limit(root: str | None = None, proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes this process's control group may use (a container's memory limit), or None where
    none is set or none can be read.

    cgroup v2: ``memory.max`` of the process's group (``0::/PATH`` in ``/proc/self/cgroup``) and
    of every group above it; cgroup v1: ``memory.limit_in_bytes`` of its ``memory`` group and
    those above. The smallest limit on the way up holds. "max", and v1's "no limit" (a value
    near 2**63), are no limit. Where the group's own directory is not mounted (a container sees
    its group as the root), the root's files are read.
    """
    root = CGROUP_ROOT if root is None else root
    try:
        with open(proc_cgroup) as fh:
            lines = fh.read().splitlines()
    except OSError:
        lines = []
    groups: list[tuple[str, str]] = []  # (mount point, group path)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            groups.append((root, path))
        elif "memory" in controllers.split(","):
            groups.append((os.path.join(root, "memory"), path))
    limits = []
    for mount, path in groups or [(root, "/")]:
        name = "memory.max" if mount == root else "memory.limit_in_bytes"
        rel = path.strip("/")
        dirs = []
        while True:
            dirs.append(os.path.join(mount, rel) if rel else mount)
            if not rel:
                break
            rel = os.path.dirname(rel)
        for d in dirs:
            try:
                with open(os.path.join(d, name)) as fh:
                    text = fh.read().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < 2**62:
                limits.append(int(text))
    return min(limits) if limits else None


def memory_limit() -> tuple[int | None, str]:
    """The memory a CPU run may use: the machine's RAM or its control group's limit, whichever
    is smaller, and where that figure comes from (for the message)."""
    ram, limit = physical_memory(), cgroup_memory_limit()
    if limit is not None and (ram is None or limit < ram):
        return limit, "memory limit of this container (cgroup)"
    return ram, "RAM (os.sysconf)"


def gpu_memory(local_rank: int) -> int | None:
    """Bytes of this rank's GPU (``torch.cuda.mem_get_info``), or None without CUDA."""
    import torch

    try:
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info(local_rank % torch.cuda.device_count())[1])
    except (RuntimeError, AssertionError):
        return None


def _fmt(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", GIB), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def _largest(parts: dict[str, int]) -> str:
    name = max(parts, key=lambda k: parts[k])
    return f"{name} {_fmt(parts[name])}, which grows with {_KEYS[name]}"


def check_memory(cfg: Config, world_size: int, vocab_size: int | None = None,
                 env: dict[str, str] | None = None) -> Estimate:
    """Raise ConfigError when ``cfg`` cannot fit this machine ([Note: memory budget]).

    ``vocab_size``: the vocabulary the data gives (before it is read: ``data.vocab_size``, or
    256 bytes for text without a tokenizer, or 0 where only the file tells).
    """
    env = dict(os.environ) if env is None else env
    from fp8shard.train.distributed import use_cuda

    on_gpu = use_cuda(cfg.trainer.accelerator)
    if vocab_size is None:
        d = cfg.data
        vocab_size = 256 if d.source == "text" and d.tokenizer is None else d.vocab_size
    est = estimate(cfg, world_size, vocab_size, on_gpu)
    local = int(env.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    ram, source = memory_limit()
    if on_gpu:
        gpu = gpu_memory(int(env.get("LOCAL_RANK", "0") or 0))
        if gpu is not None and est.device_total > gpu:
            raise ConfigError(
                f"the run needs about {_fmt(est.device_total)} of GPU memory per rank, more than this "
                f"GPU's {_fmt(gpu)} (torch.cuda.mem_get_info); the largest part: {_largest(est.device)}: "
                "make those smaller or use more ranks (docs/reliability.md, 'memory budget')")
        need, parts = est.host_total * local, est.host
    else:
        need = (est.device_total + est.host_total) * local
        parts = {**est.device, **_merge(est.host, est.device)}
    if ram is not None and need > ram:
        ranks = f" ({_fmt(need // local)} per rank x {local} ranks on this machine)" if local > 1 else ""
        raise ConfigError(
            f"the run needs about {_fmt(need)} of memory{ranks}, more than "
            f"this machine's {_fmt(ram)} of {source}; the largest part: {_largest(parts)}: make "
            "those smaller (docs/reliability.md, 'memory budget')")
    return est


def _merge(host: dict[str, int], device: dict[str, int]) -> dict[str, Any]:
    return {k: v + device.get(k, 0) for k, v in host.items()}
