"""The simulated device (aed/memory_measure.py) against a real GPU: run `pytest tests/test_cuda_oom.py`
on a machine with CUDA. Each shape's training step runs for real (peak: max_memory_allocated) and
on fake CPU tensors (peak: live storages rounded to the allocator's 512-byte blocks, plus the
cuBLAS workspace the allocator also holds). The simulation runs the CPU's attention kernels and
CPU autocast's op lists, so it is an estimate: it must not under-estimate by more than 10%."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from aed.memory_measure import CUBLAS_WORKSPACE, CUDA_BLOCK, SimulatedDevice
from aed.memory_oomptimizer import TrainingStep
from aed.model import AED, AEDConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SMALL = dict(n_mels=80, vocab_size=1024, pad_id=1, enc_d_model=256, enc_layers=4, enc_heads=4,
             subsampling_channels=64, dec_d_model=256, dec_layers=4, dec_heads=4, dec_max_len=512)
SHAPES = [(16, 501, 40), (4, 2001, 120), (8, 801, 400)]  # (B, frames, tokens): short, long, long transcript


def steps(device, granularity=1, ddp=False):
    torch.manual_seed(0)
    model = AED(AEDConfig(**SMALL)).train()
    if device != "cpu":  # fake parameters cannot move
        model = model.to(device)
    step = TrainingStep(model, torch.optim.AdamW(model.parameters()), "bf16", ddp=ddp, granularity=granularity)
    step.warm_up(101, 5)
    return step


@pytest.mark.parametrize("shape", SHAPES)
def test_simulated_peak_is_close_to_max_memory_allocated(shape):
    measured = steps("cuda").peak(*shape)
    with SimulatedDevice():
        simulated = steps("cpu", CUDA_BLOCK).peak(*shape) + CUBLAS_WORKSPACE
    error = simulated / measured - 1
    print(f"{shape}: measured {measured / 1e6:.1f} MB, simulated {simulated / 1e6:.1f} MB ({100 * error:+.1f}%)")
    assert error > -0.10, f"under-estimate {100 * error:.1f}%: the simulation would let this step OOM"


def test_a_real_ddp_step_holds_the_simulated_gradient_buckets(tmp_path):
    """What oom.py --ddp and the DDP rows of REPORT's E2 table per GPU size add to a one-device step
    (a constant: one more copy of the gradients), against a real DistributedDataParallel step
    (nccl, world size 1: the buckets do not depend on the world size). DDP's second step, where it
    rebuilds its buckets once, may hold one more copy (measured on an H200): not in the constant."""
    shape = SHAPES[1]
    one_device = steps("cuda")
    single = one_device.peak(*shape)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = TrainingStep(DistributedDataParallel(one_device.model), one_device.optimizer, "bf16")
        ddp.peak(*shape)  # buckets in parameter order; the backward records the order gradients come in
        rebuild = ddp.peak(*shape)  # the second step rebuilds them in that order, once
        measured = ddp.peak(*shape)
    finally:
        dist.destroy_process_group()
    buckets = sum(p.numel() * p.element_size() for p in one_device.model.parameters())
    with SimulatedDevice():
        simulated = steps("cpu", CUDA_BLOCK, ddp=True).peak(*shape) + CUBLAS_WORKSPACE
    error = simulated / measured - 1
    print(f"{shape}: one device {single / 1e6:.1f} MB, DDP {measured / 1e6:.1f} MB (+{(measured - single) / 1e6:.1f}, "
          f"buckets {buckets / 1e6:.1f}; rebuild step {rebuild / 1e6:.1f}), simulated DDP {simulated / 1e6:.1f} MB "
          f"({100 * error:+.1f}%)")
    # DDP's own small tensors are a few % of this small model's 44 MB of buckets (H200: +3-4.5%; canary-1b: exact)
    assert abs(measured - single - buckets) < 0.1 * buckets, "DDP's extra memory is not one copy of the gradients"
    assert rebuild - measured < 1.1 * buckets, "DDP's bucket rebuild held more than one more copy of the gradients"
    assert error > -0.10, f"under-estimate {100 * error:.1f}%: the simulation would let this step OOM"
