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
is counted the first time its micro-batch shapes occur and looked up afterwards. Padded lengths
vary from batch to batch, so most shapes are new; but for fixed weights a step's FLOPs are a sum of
a few shape terms (`shape_terms`: per frame and per token work, attention over frames and over
tokens, cross-attention), so once enough shapes are counted, a least-squares fit of those terms
predicts the rest. It takes over only when it predicts counted shapes it was not fitted on within
`tolerance`, else more shapes are counted first. The count is a function of the padded shapes
except where a model indexes by lengths or masks: the AED projects only real target tokens onto
the vocabulary, the transducer builds each sample's joint at its own lengths, and BEST-RQ's heads
read only masked frames. A batch of a counted shape reuses the first one's count, and the fit
averages over them, off by the difference in those (for the tiny configs, a few percent).
"""

import logging
import time

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from aed.training import AMP_DTYPES

aten = torch.ops.aten
log = logging.getLogger(__name__)


def _attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)  # (B, H, T, d) shapes: q k^T and weights x v


def _attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


CPU_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu: _attention,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward}


def shape_key(batches: list) -> tuple:
    """What a step's FLOPs depend on: every micro-batch's padded feature and token shapes."""
    return tuple((tuple(b.feats.shape), tuple(b.tokens.shape)) for b in batches)


def shape_terms(batches: list) -> np.ndarray:
    """B T, B T^2, B U, B U T, B U^2 summed over the micro-batches (T feature frames, U tokens)."""
    terms = np.zeros(5)
    for b in batches:
        n, t, u = b.feats.shape[0], b.feats.shape[1], b.tokens.shape[-1]
        terms += n * np.array([t, t * t, u, u * t, u * u], dtype=np.float64)
    return terms


class StepFlops:
    """FLOPs of training steps, counted on the real step once per `shape_key`, and predicted by a
    fit of `shape_terms` once one predicts shapes it was not fitted on within `tolerance`."""

    def __init__(self, exact: int = 16, tolerance: float = 0.02):
        self.exact, self.tolerance = exact, tolerance  # shapes counted before the first try of the fit
        self.cache = {}  # shape key -> counted FLOPs
        self.counted = []  # (shape_terms, FLOPs) of every counted shape
        self.coef = None  # the fit, once it predicts well enough

    def run(self, step, batches: list):
        """Run `step()` (the training step over `batches`) -> (its result, its FLOPs on this rank)."""
        key = shape_key(batches)
        if key in self.cache:
            return step(), self.cache[key]
        if self.coef is not None:
            return step(), float(shape_terms(batches) @ self.coef)
        with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
            result = step()
        self.cache[key] = counter.get_total_flops()
        self.counted.append((shape_terms(batches), self.cache[key]))
        if len(self.counted) >= self.exact:
            self._try_fit()
        return result, self.cache[key]

    def _try_fit(self) -> None:
        """Fit on the first three quarters of the counted shapes (least relative error), check on
        the last quarter; if every check is within tolerance, refit on all and predict from now on,
        else count 8 more shapes before the next try."""
        x = np.array([t for t, _ in self.counted])
        y = np.array([f for _, f in self.counted], dtype=np.float64)
        fit = len(y) * 3 // 4

        def solve(rows):
            return np.linalg.lstsq(x[rows] / y[rows, None], np.ones(len(rows)), rcond=None)[0]

        error = np.abs(x[fit:] @ solve(np.arange(fit)) / y[fit:] - 1).max()
        if error <= self.tolerance:
            self.coef = solve(np.arange(len(y)))
            log.info("FLOPs: a fit of %d counted batch shapes predicts the rest (largest error on %d held out: "
                     "%.2f%%)", len(y), len(y) - fit, 100 * error)
        else:
            self.exact = len(y) + 8


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
