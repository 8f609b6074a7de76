"""Data parallelism over the ranks of a torchrun world: `train.strategy` ddp or fsdp, and the one
place that reads RANK / LOCAL_RANK / WORLD_SIZE.

Works unchanged for a single process (no torchrun): world size 1, no process group unless asked
for one (FSDP, whose every layer call is a collective, needs one even on one rank).

    model = shard(model, device, precision)         # fsdp only, before the optimizer is built
    train_model, no_sync = wrap(model, "ddp")        # what the training step runs
    eval_model = full_copy(model, build)             # validation's whole copy, decoding per rank
    exit_worker()                                    # the last call of a finished process

ddp: every rank holds the whole model, its gradients and both AdamW moments (16 bytes per
parameter: ~16 GB for Canary-1B before the first activation), and gradients are all-reduced.
fsdp (PyTorch's FSDP2, `fully_shard`): parameters, gradients and optimizer state are sharded over
the ranks (DTensors, `Shard(0)`); each encoder and decoder layer is one unit whose parameters are
all-gathered for its forward and backward and freed after, and gradients are reduce-scattered.
Static memory per rank falls to 16 bytes x parameters / world size plus one or two layers' worth of
gathered parameters. Both strategies keep the same parameter names (state dict keys), so a
checkpoint of one resumes under the other (aed/train_checkpoint.py, torch.distributed.checkpoint).
"""

import logging
import os
import sys
from contextlib import contextmanager
from typing import NamedTuple, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import _disable_current_modes


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
        if torchrun_restart()[0] and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and rank == 0:
            # The group is set up through torchrun's own store, which its c10d rendezvous (torch 2.14) keeps for
            # every attempt: it still holds the failed attempt's addresses, and a rank that reads one before the
            # new peer replaces it waits for a dead rank until the group's timeout (30 min), silently. Logging
            # is not set up yet: Python prints this to stderr.
            logging.getLogger(__name__).warning(
                "restarted by torchrun with its shared rendezvous store: if this hangs setting up the process "
                "group, launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (tools/slurm.sbatch does)")
        dist.init_process_group(backend)
    elif group_of_one and not is_distributed():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return rank, local_rank, world_size, device


class Process(NamedTuple):
    """This process's place in the run: its rank, the world's size, and the device it trains on."""
    rank: int
    world_size: int
    device: torch.device

    @property
    def master(self) -> bool:
        return self.rank == 0


def torchrun_restart() -> tuple[int, int]:
    """(restarts so far, --max-restarts) of the torchrun that started this process, (0, 0) without one:
    after a worker fails, torchrun stops the others and starts them all again, as restart 1, 2, ..."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))


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


def exit_worker() -> NoReturn:
    """The last call of a process whose work is done (train.py and the other scripts run under
    torchrun): destroy the process group, flush the logs and the standard streams, and end with
    status 0 without the interpreter's finalization. Everything else must be written and closed by then.

    gloo runs each collective on a worker thread of its process group that lets go of the
    collective's tensors only after waking the caller, and torch joins those threads only when the
    last reference to the group goes, which DDP and FSDP hold to the end of the process, past
    destroy_process_group. A thread still letting go of tensors that Python has dropped when the
    interpreter starts finalizing must take the GIL; finalization makes it exit instead, from inside a
    C++ destructor, which is std::terminate: "terminate called without an active exception", and the
    finished rank ends in SIGABRT.
    """
    cleanup()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


STRATEGIES = ("ddp", "fsdp")


def layers(model: nn.Module) -> list[nn.Module]:
    """The units FSDP gathers one at a time: every encoder and decoder layer."""
    units = list(model.encoder.layers)
    if hasattr(model, "decoder"):
        units += list(model.decoder.layers)
    return units


def shard(model: nn.Module, device: torch.device, world_size: int, precision: str,
          reshard_after_forward: bool = True, bf16_params: bool | None = None) -> nn.Module:
    """FSDP2 on each layer, then on the root (embeddings, heads, subsampling: the rest), starting
    from rank 0's weights. On CUDA with bf16, parameters are gathered and computed in bf16 while
    gradients are reduced in fp32; elsewhere everything stays fp32 (bf16_params: True or False
    overrides this, for a simulated CUDA device on the CPU). reshard_after_forward=False keeps each
    layer's gathered parameters from forward to backward: one all-gather less per layer, more memory."""
    with torch.no_grad():  # rank 0's initial weights everywhere, as DDP's constructor does: ranks seed apart
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    with _disable_current_modes():  # the mesh's rank table is real, also inside a simulation (fake tensors)
        mesh = init_device_mesh(device.type, (world_size,))
    bf16 = device.type == "cuda" and precision == "bf16" if bf16_params is None else bf16_params
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for layer in layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


@contextmanager
def _no_gradient_sync(model: FSDPModule):
    """FSDP's counterpart of DDP's no_sync: gradients accumulate unsharded, no reduce-scatter."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def wrap(model: nn.Module, world_size: int):
    """(the module the training step runs, the context manager factory that skips the gradient
    reduction of a non-final micro-batch or None). A sharded model is already its own wrapper."""
    if isinstance(model, FSDPModule):
        return model, lambda: _no_gradient_sync(model)
    if world_size > 1:
        ddp = DistributedDataParallel(model)
        return ddp, ddp.no_sync
    return model, None


def share_rank0_buffers(model: nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank. Each rank updates its own from
    its batches; DDP broadcasts rank 0's before every forward, FSDP never does. DCP writes a buffer
    once, from whichever rank it picks: before a save, every rank holds rank 0's, those the next
    forward uses, so a resumed run continues exactly. Validation sees them too."""
    if isinstance(model, FSDPModule) or world_size() > 1:
        with torch.no_grad():
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)


def full_copy(model: nn.Module, build, into: nn.Module | None = None) -> nn.Module:
    """The model itself, or for a sharded one an unsharded copy with its current weights: `into`
    (a copy made before, updated in place) or one built by `build()`. Every rank must call this
    (it all-gathers). The copy is built without touching the training's random stream."""
    if not isinstance(model, FSDPModule):
        return model
    share_rank0_buffers(model)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if into is None:
        device = next(iter(weights.values())).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
            into = build()  # made on the device: a 1B model's initialisation on the host would take seconds
    into.load_state_dict(weights)
    return into
