"""Process-group setup for the training command: one process, or one per rank under torchrun.

The backend follows the device: NCCL with one CUDA device per rank, gloo on CPU. torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK) says how many ranks there are; without it the
command runs as a single process and never initializes a process group.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Where this process runs."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    """'nccl' or 'gloo' when a process group was initialized, else None."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def group(self) -> Any:
        """The data-parallel group (all ranks), or None for a single process."""
        return dist.group.WORLD if self.backend is not None else None


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def use_cuda(accelerator: str) -> bool:
    return accelerator == "gpu" or (accelerator == "auto" and torch.cuda.is_available())


def _check_one_gpu_per_rank(accelerator: str, world_size: int) -> None:
    """NCCL needs a GPU per rank of this node; without one, a clear error before the process group
    (NCCL would only say 'Duplicate GPU detected')."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpus = torch.cuda.device_count()
    if world_size > 1 and gpus < local:
        from fp8shard.train.config import ConfigError

        raise ConfigError(
            f"trainer.accelerator={accelerator}: {local} processes on this node but {gpus} GPU(s) "
            f"visible, and NCCL needs one GPU per rank: launch with torchrun --nproc-per-node={gpus} "
            f"or train on the CPU with trainer.accelerator=cpu (gloo)")


def init_distributed(accelerator: str, timeout_s: float = 600.0) -> DistEnv:
    """Pick the device, then initialize the process group when launched with several ranks."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = launched_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda(accelerator):
        _check_one_gpu_per_rank(accelerator, world_size)
        device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world_size == 1:
        return DistEnv(0, 1, 0, device, None)
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {"timeout": timeout}
    if backend == "nccl":
        kwargs["device_id"] = device
    store = _elastic_store(timeout)
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
    return DistEnv(rank, world_size, local_rank, device, backend)


def _elastic_store(timeout: datetime.timedelta) -> Any:
    """Under torchrun: the launcher's store, its keys prefixed by the attempt; else None.

    [Note: store per attempt]
        torchrun's workers share one TCPStore, hosted by the agent, which outlives a restart
        (``--max-restarts``): the restarted ranks find the previous attempt's keys still there.
        torch 2.13's env:// rendezvous assumes a fresh store per attempt, so the default process
        group's keys (each rank's gloo address among them) are the same in every attempt; a
        restarted rank could read a dead peer's address and fail ("Gloo connectFullMesh failed
        ... Connection refused") or wait until the timeout -- we saw both, depending on which
        rank started first. A prefix per attempt (``TORCHELASTIC_RESTART_COUNT``) keeps the
        attempts apart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"fp8shard/attempt_{attempt}/", store)


def teardown(env: DistEnv, wait: bool = True) -> None:
    """Destroy the process group (no-op on one process); ``wait``: first wait for every rank."""
    if env.backend is not None and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(values: list[float], env: DistEnv) -> list[float]:
    """Sum a few Python floats over all ranks (one collective); identity on one process."""
    if env.backend is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values: list[float], env: DistEnv) -> list[float]:
    if env.backend is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
