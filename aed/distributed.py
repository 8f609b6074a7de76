"""torchrun-only distributed helpers: the one place that reads RANK / LOCAL_RANK / WORLD_SIZE.

Works unchanged for a single process (no torchrun): world size 1, no process group unless asked
for one (FSDP, whose every layer call is a collective, needs one even on one rank).
"""

import os

import torch
import torch.distributed as dist


def init_distributed(group_of_one: bool = False) -> tuple[int, int, int, torch.device]:
    """(rank, local_rank, world_size, device); NCCL on GPUs, gloo on CPU. group_of_one: a process
    group also for a single process (an in-memory store: no torchrun needed); one that exists already,
    left by an earlier run in the same program, is kept."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world_size > 1:
        dist.init_process_group(backend)
    elif group_of_one and not is_distributed():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return rank, local_rank, world_size, device


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def peer_lost(e: BaseException) -> bool:
    """Whether `e` is a collective failing because another rank is gone (exited, killed, unreachable)
    rather than a fault of this rank: c10d's typed errors (NCCL), and gloo's TCP transport errors,
    which reach Python as plain RuntimeErrors, through DDP's gradient hooks in backward too."""
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo/transport/" in str(e))


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce (a no-op without a process group); returns `t`."""
    if is_distributed():
        dist.all_reduce(t, op=op)
    return t


def all_gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order (a list of one without a process group)."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_objects(obj) -> list | None:
    """Every rank's `obj` in rank order on rank 0, None elsewhere (large states: no all-gather)."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def cleanup() -> None:
    if is_distributed():
        dist.destroy_process_group()
