"""What a training run reports: the progress line, metrics.jsonl and TensorBoard.

    progress = Progress(device, world_size, cfg, feature_frame_s, peak_flops, step, flops)
    progress.add(model, micro, result, flops)             # every step: sums stay on the device
    with progress.paused():                               # validation: not training time
        ...
    values, line = progress.report(step, lr, shapes)      # every log_every steps (syncs the ranks)
    run_log.write(values, step)

Training compute (`StepFlops`): FLOPs per step, counted by torch on the real step, and the
device's matmul peak, for the MFU the progress line reports.

    step_flops = StepFlops()
    result, flops = step_flops.run(lambda: train_step(model, micro, ...), micro)
    mfu = flops_per_second / matmul_peak(device, precision)

`CountFlops` counts the FLOPs of matmuls, convolutions and attention in the forward and backward
pass (2 per multiply-add) with torch's own formulas (`torch.utils.flop_counter`): the "model FLOPs"
of MFU and of compute-budget studies. Elementwise work (norms, activations, the optimizer) is not
counted. torch has formulas for CUDA's fused attention kernels but not for the one our encoder's
SDPA runs on a CPU (`_scaled_dot_product_flash_attention_for_cpu`): `CPU_ATTENTION` adds it with
torch's attention formulas, so a CPU and a GPU count the same step alike.

Counting dispatches every op through Python (docs/REPORT.md, "FLOP accounting"), so a step is
counted the first time its micro-batch shapes occur and looked up afterwards. Padded lengths
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

import functools
import json
import logging
import os
import time
from contextlib import contextmanager

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper
from torch.utils.tensorboard import SummaryWriter

from aed.train_distributed import all_reduce
from aed.train_setup import AMP_DTYPES, count_ctc_skipped


log = logging.getLogger(__name__)

# Sums kept on the device between progress lines (no host sync per step), in this order.
TOTALS = ("loss", "targets", "audio_s", "padded_frames", "frames", "padded_tokens", "tokens", "utterances",
          "ctc_skipped")


class Progress:
    """The sums and clocks behind the progress line. Counters cover the window since the last
    line (rates, padding, loss) or the whole run (FLOPs, skipped audio, the ETA). Time spent
    `paused()` (validation) is kept out of step times, rates and the ETA."""

    def __init__(self, device: torch.device, world_size: int, cfg, feature_frame_s: float, peak_flops: float,
                 step: int, total_flops: float):
        self.device, self.world_size, self.peak_flops = device, world_size, peak_flops
        self.feature_frame_s = feature_frame_s  # seconds per 10 ms feature frame: audio seconds from lengths
        self.max_steps, self.budget_flops = cfg.max_steps, cfg.budget_flops
        self.totals = torch.zeros(len(TOTALS), device=device)
        self.total_flops = total_flops  # all ranks, the whole run including what it resumed from
        self.run_flops = self.window_flops = 0.0  # since this process started / since the last line
        self.skipped_audio = 0  # utterances whose audio could not be read, on this rank, this process
        self.data_wait_s = 0.0  # seconds this rank waited for the DataLoader's batches in the window
        self.start_step, self.window_steps = step, 0
        self.paused_s = 0.0
        self.t_start = self.t_window = time.time()
        self.paused_at_window = 0.0
        self.grad_norm = None

    @contextmanager
    def paused(self):
        t0 = time.time()
        try:
            yield
        finally:
            self.paused_s += time.time() - t0

    def add(self, model, batches: list, result, flops: float) -> None:
        """One optimizer step over `batches` (host-side), its StepResult and its FLOPs on all ranks."""
        self.totals += torch.tensor([0.0, 0.0,
                                     sum(float(b.feat_lens.sum()) * self.feature_frame_s for b in batches),
                                     sum(b.feats.shape[0] * b.feats.shape[1] for b in batches),
                                     sum(int(b.feat_lens.sum()) for b in batches),
                                     sum(b.tokens.numel() for b in batches),
                                     sum(int(b.token_lens.sum()) for b in batches),
                                     sum(len(b) for b in batches),
                                     count_ctc_skipped(model, batches)], device=self.device)
        self.totals[0] += result.loss
        self.totals[1] += result.count
        self.grad_norm = result.grad_norm
        self.total_flops += flops
        self.run_flops += flops
        self.window_flops += flops
        self.window_steps += 1

    def budget_spent(self) -> bool:
        return self.budget_flops is not None and self.total_flops >= self.budget_flops

    def report(self, step: int, lr: float, flop_shapes: int) -> tuple[dict, str]:
        """(metrics for RunLog, the progress line) of the window since the last report, then a new
        window. flop_shapes: batch shapes whose FLOPs were counted so far (each a slower step).
        Every rank must call it: it all-reduces the sums."""
        t = dict(zip(TOTALS, all_reduce(self.totals).tolist()))
        skipped = int(all_reduce(torch.tensor(float(self.skipped_audio), device=self.device)).item())
        now = time.time()
        dt = now - self.t_window - (self.paused_s - self.paused_at_window)  # training time of the window
        trained = now - self.t_start - self.paused_s
        eta = trained / (step - self.start_step) * (self.max_steps - step)
        if self.budget_flops:  # whichever comes first, the last step or the spent budget
            eta = min(eta, trained / self.run_flops * max(self.budget_flops - self.total_flops, 0.0))
        mem = torch.cuda.max_memory_allocated(self.device) / 1e9 if self.device.type == "cuda" else rss_gb()
        steps = self.window_steps
        values = {"train/loss": t["loss"] / max(t["targets"], 1), "train/lr": lr,
                  "train/grad_norm": self.grad_norm.item(),
                  "train/batch_size": t["utterances"] / steps / self.world_size,  # per rank and step
                  "train/audio_padding": 100 * (1 - t["frames"] / t["padded_frames"]),
                  "train/text_padding": 100 * (1 - t["tokens"] / t["padded_tokens"]) if t["padded_tokens"] else 0.0,
                  "train/audio_s_per_s": t["audio_s"] / dt, "train/tokens_per_s": t["tokens"] / dt,
                  "train/step_time": dt / steps, "train/memory_gb": mem, "train/skipped_audio": skipped,
                  "train/data_wait": 100 * self.data_wait_s / dt,  # % of rank 0's training time spent waiting for data
                  "train/ctc_skipped": int(t["ctc_skipped"]),  # utterances left out of the CTC loss
                  "train/flops": self.total_flops, "train/flops_per_s": self.window_flops / dt,  # all ranks
                  # model FLOPs over the matmul peak measured at start (matmul_peak), not a data sheet's
                  "train/mfu": self.window_flops / dt / self.world_size / self.peak_flops,
                  "train/flop_shapes": flop_shapes}
        line = (f"step {step} | loss {values['train/loss']:.3f} | lr {lr:.2e} | "
                f"gnorm {values['train/grad_norm']:.2f} | bs {values['train/batch_size']:.1f} | "
                f"pad audio {values['train/audio_padding']:.1f}% text {values['train/text_padding']:.1f}% | "
                f"{values['train/audio_s_per_s']:.1f} audio s/s | {values['train/tokens_per_s']:.0f} tok/s | "
                f"{values['train/step_time']:.2f} s/step | data wait {values['train/data_wait']:.0f}% | "
                f"{self.total_flops:.3g} FLOPs | "
                f"{values['train/flops_per_s'] / 1e9:.2f} GFLOP/s | "
                f"MFU {100 * values['train/mfu']:.1f}% of the measured peak | "
                f"mem {mem:.2f} GB | eta {eta / 60:.1f} min"
                + (f" | {int(t['ctc_skipped'])} utts too short for CTC" if t["ctc_skipped"] else ""))
        self.totals.zero_()
        self.window_flops, self.window_steps, self.data_wait_s = 0.0, 0, 0.0
        self.t_window, self.paused_at_window = time.time(), self.paused_s
        return values, line


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


class RunLog:
    """metrics.jsonl and TensorBoard scalars/text in the run directory, written by rank 0 only.

    A run resumed at step s replays the steps after s that its killed predecessor had already
    logged: their rows are dropped from metrics.jsonl, and TensorBoard purges their events."""

    def __init__(self, run_dir: str, master: bool, resumed_step: int = 0):
        self.writer = self.file = None
        if not master:
            return
        path = os.path.join(run_dir, "metrics.jsonl")
        if resumed_step and os.path.exists(path):
            with open(path) as f:
                rows = f.readlines()
            kept = [r for r in rows if r.strip() and json.loads(r).get("step", 0) <= resumed_step]
            if len(kept) < len(rows):
                log.info("metrics.jsonl: dropped %d rows logged after step %d (replayed now)",
                         len(rows) - len(kept), resumed_step)
                with open(path + ".tmp", "w") as f:
                    f.writelines(kept)
                os.replace(path + ".tmp", path)
        self.writer = SummaryWriter(run_dir, purge_step=resumed_step + 1 if resumed_step else None)
        self.file = open(path, "a")

    def write(self, values: dict, step: int) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        for k, v in values.items():
            if isinstance(v, list):
                self.writer.add_text(k, "  \n".join(v), step)
            elif isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file is not None:
            self.writer.close()
            self.file.close()


aten = torch.ops.aten


def _attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)  # (B, H, T, d) shapes: q k^T and weights x v


def _attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


CPU_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu: _attention,  # formulas of shapes
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward}
# torch's formulas and the CPU attention's, each called with the op's tensors and output
FORMULAS = {**flop_registry, **{op: shape_wrapper(f) for op, f in CPU_ATTENTION.items()}}


class CountFlops(TorchDispatchMode):
    """`with CountFlops() as c: step()` -> `c.flops`, the FLOPs of the ops `step` ran that have a
    formula in `FORMULAS`: the sum torch's FlopCounterMode gives. That one also keeps a table per
    module and, for every op without a formula, re-enters itself to try a decomposition that few
    ops have: most of what counting costs on a small model's CPU step (docs/REPORT.md, "FLOP
    accounting"). `c.recomputed` is the part activation checkpointing ran again: forward ops during
    the backward pass, the only ones there that run with autograd on (the backward's own run
    without). Model FLOPs, what MFU counts, are `flops - recomputed`."""

    def __init__(self):
        super().__init__()
        self.flops = self.recomputed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        formula = FORMULAS.get(func._overloadpacket)
        if formula is None and composite(func):  # e.g. aten.linear under inference_mode: count its addmm
            with self:
                return func.decompose(*args, **kwargs)
        out = func(*args, **kwargs)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            self.flops += flops
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:  # recomputed in backward
                self.recomputed += flops
        return out


@functools.cache
def composite(func) -> bool:
    """Whether `func` is made of other ops. Autograd runs those ops instead of `func`, so only where
    autograd is off (inference_mode) does `func` itself reach CountFlops."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


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
    """Model FLOPs of training steps (what activation checkpointing recomputes left out), counted on
    the real step once per `shape_key`, and predicted by a fit of `shape_terms` once one predicts
    shapes it was not fitted on within `tolerance`."""

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
        with CountFlops() as counter:
            result = step()
        if counter.recomputed and not self.cache:
            log.info("FLOPs: activation checkpointing recomputes %.1f%% of the step's FLOPs; FLOPs and MFU count "
                     "the model's alone", 100 * counter.recomputed / counter.flops)
        self.cache[key] = counter.flops - counter.recomputed
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
