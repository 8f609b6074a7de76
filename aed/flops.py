"""Training compute: FLOPs per step, counted by torch on the real step, and the device's matmul peak.

    step_flops = StepFlops()
    result, flops = step_flops.run(lambda: train_step(model, micro, ...), micro)
    mfu = flops_per_second / matmul_peak(device, precision)

`torch.utils.flop_counter.FlopCounterMode` counts the FLOPs of matmuls, convolutions and
attention in the forward and backward pass (2 per multiply-add): the "model FLOPs" of MFU and of
compute-budget studies. Elementwise work (norms, activations, the optimizer) is not counted.
torch counts CUDA's fused attention kernels but not the one our encoder's SDPA runs on a CPU
(`_scaled_dot_product_flash_attention_for_cpu`): `CPU_ATTENTION` adds it with torch's own
attention formulas, so a CPU and a GPU count the same step alike.

Counting dispatches every op through Python (a tiny CPU step ran 2.7x slower counted), so a step
is counted the first time its micro-batch shapes occur and looked up afterwards. The count is a
function of the padded shapes except where a model indexes by lengths or masks: the AED projects
only real target tokens onto the vocabulary, the transducer builds each sample's joint at its own
lengths, and BEST-RQ's heads read only masked frames. A later batch of the same shape reuses the
first one's count, off by the difference in those (for the tiny configs, a few percent).
"""

import time

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from aed.training import AMP_DTYPES

aten = torch.ops.aten


def _attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)  # (B, H, T, d) shapes: q k^T and weights x v


def _attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


CPU_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu: _attention,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward}


def shape_key(batches: list) -> tuple:
    """What a step's FLOPs depend on: every micro-batch's padded feature and token shapes."""
    return tuple((tuple(b.feats.shape), tuple(b.tokens.shape)) for b in batches)


class StepFlops:
    """FLOPs of training steps, counted on the real step once per `shape_key`."""

    def __init__(self):
        self.cache = {}

    def run(self, step, batches: list):
        """Run `step()` (the training step over `batches`) -> (its result, its FLOPs on this rank)."""
        key = shape_key(batches)
        if key in self.cache:
            return step(), self.cache[key]
        with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
            result = step()
        self.cache[key] = counter.get_total_flops()
        return result, self.cache[key]


def matmul_peak(device, precision: str, seconds: float = 0.3) -> float:
    """Dense matmul FLOP/s of `device` in the training precision, measured: the denominator of MFU.

    Square matrices (4096 on CUDA, 512 on CPU), timed for about `seconds` after one warm-up. Measured
    rather than taken from a data sheet, so MFU means the same on every machine, CPUs included; a
    loaded machine measures a lower peak (and trains slower) alike."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = 4096 if cuda else 512
    dtype = AMP_DTYPES[precision] or torch.float32
    with torch.random.fork_rng(devices=[device] if cuda else []):  # a resumed run's random stream stays exact
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    a @ b
    sync()
    reps, t0 = 0, time.perf_counter()
    while True:
        a @ b
        reps += 1
        sync()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return 2 * n**3 * reps / elapsed
