"""The simulated device (aed/simulated_memory.py) against a real GPU: run `pytest tests/test_cuda_oom.py`
on a machine with CUDA. Each shape's training step runs for real (peak: max_memory_allocated) and
on fake CPU tensors (peak: live storages rounded to the allocator's 512-byte blocks, plus the
cuBLAS workspace the allocator also holds). The simulation runs the CPU's attention kernels and
CPU autocast's op lists, so it is an estimate: it must not under-estimate by more than 10%."""

import pytest
import torch

from aed.model import AED, AEDConfig
from aed.simulated_memory import CUBLAS_WORKSPACE, CUDA_BLOCK, SimulatedDevice
from aed.oomptimizer import TrainingStep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SMALL = dict(n_mels=80, vocab_size=1024, pad_id=1, enc_d_model=256, enc_layers=4, enc_heads=4,
             subsampling_channels=64, dec_d_model=256, dec_layers=4, dec_heads=4, dec_max_len=512)
SHAPES = [(16, 501, 40), (4, 2001, 120), (8, 801, 400)]  # (B, frames, tokens): short, long, long transcript


def steps(device, granularity=1):
    torch.manual_seed(0)
    model = AED(AEDConfig(**SMALL)).train()
    if device != "cpu":  # fake parameters cannot move
        model = model.to(device)
    step = TrainingStep(model, torch.optim.AdamW(model.parameters()), "bf16", granularity=granularity)
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
