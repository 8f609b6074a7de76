"""The OOMptimizer: the largest batch size of every 2D bucket, found by running real training steps
(`optimize`), or from a memory model fitted to a dozen of them (`MemoryModel`, first below).

Peak training memory as a low-order function of the batch shape, fitted to measured steps.

    model = MemoryModel.fit([(B, T, U, peak_bytes), ...])   # measured or simulated steps
    model.predict(B, T, U)                                  # bytes
    model.max_batch_size(T, U, limit)                       # largest B that fits

Why: checking every batch of an epoch against a memory limit takes one step per batch, and a
simulated 1B-parameter step takes tens of seconds (aed/memory_measure.py). For fixed weights,
precision and optimizer, what a step keeps alive at its peak is the weights, gradients and optimizer
state (and an EMA of the weights, with ema_decay: a constant) plus, per utterance, activations that
are sums of a few shape terms:

    T      encoder activations per frame (convolutions, feed-forward, attention outputs)
    T^2    encoder attention scores and the relative-position bias (B x H x T' x T')
    U      decoder activations per token and the B x U x V logits (V fixed)
    U T    decoder cross-attention (B x H x U x T')
    U^2    decoder self-attention (B x H x U x U)
    k U T  a transducer's joint (k x T' x U x V), built k = min(B, chunk) utterances at a time

so peak(B, T, U) = c + B (a1 T + a2 T^2 + a3 U + a4 U T + a5 U^2) + min(B, k) a6 U T, fitted by
least squares on relative error with non-negative a (an active set: a term whose coefficient comes
out negative is dropped). T counts feature frames, U tokens. The fit is an estimate: report its
error on shapes it was not fitted on (`relative_errors`) before trusting it.

The search.

    step = TrainingStep.of(setup)                      # aed/train_setup.py: the run's model and optimizer
    shapes = setup.bucket_shapes(bins)                 # bucket bounds, with what augment's edges may add
    rows = optimize(step, shapes, limit)               # one row per bucket: batch_size, peak, ...
    peaks = preflight(step, shapes, batch_sizes, budget)   # train.py's check before step 0
    total, budget, limit = memory_limit(device, margin=0.1, fraction=0.9)   # oom.py's budget and limit

The cumulative-duration heuristic (train.max_duration) gives every bucket the same seconds of
audio, but memory is not linear in duration (attention is quadratic in frames; the decoder and its
vocab-sized logits grow with tokens), so most buckets run far below the limit to keep the worst
one safe. Measuring every bucket instead gave the paper a 3.4x larger mean batch (5x with 2D
buckets). For each bucket, from the largest to the smallest:

1. An artificial batch at the bucket's upper bounds: random features of num_frames(d) frames and
   random tokens of its token bound U (1D bins: U = the bin's max tokens/s x d, from bins.max_tps
   or --max-tps; filter the data with train.max_tps to match, or outliers may not fit).
2. One full training step, the very function train.py runs (`aed.train_setup.train_step`: zero_grad,
   SpecAugment, forward, loss, backward, clip, AdamW step), for the config's objective (aed, rnnt
   or ssl; ssl's 1D bins get 2-token batches, as it reads no text) and precision, with its peak
   memory measured: on CUDA by the allocator under set_per_process_memory_fraction, on CPU by
   tracking live tensor storages (aed/memory_measure.py). No formula: every number comes from running the step.
3. Double the batch while it fits, then bisect between the largest fit and the smallest failure
   until they are within `threshold` (5%). The next bucket starts from 2x this answer.

`fit_memory_model` + `optimize_with_model` instead fit peak memory as a low-order function of
(B, T, U) to a dozen steps (`MemoryModel` above), for steps too slow to bisect every bucket with
(a 1B-parameter step on simulated memory, aed/memory_measure.py). A bucket at least as large as
another in both duration and tokens never gets a larger batch (`make_monotone`). oom.py
(aed/cli_oom.py) is the command line around this.
"""

import logging
import math
import sys
import time

import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_map

from aed.data_audio import SpecAugment
from aed.data_batch import Batch
from aed.memory_measure import OutOfMemory, allocated_limit, device_memory, format_bytes, parse_bytes, peak_memory
from aed.train_distributed import Process
from aed.train_setup import count_targets, train_step


TERMS = ("B*T", "B*T^2", "B*U", "B*U*T", "B*U^2", "k*U*T")


def _features(B, T, U, chunk):
    k = min(B, chunk) if chunk else 0
    return [1.0, B * T, B * T * T, B * U, B * U * T, B * U * U, k * U * T]


class MemoryModel:
    def __init__(self, coef, chunk: int = 0):
        self.coef = list(coef)  # constant, then one per TERMS entry
        self.chunk = chunk  # transducer chunk size (0: no joint term)

    @classmethod
    def fit(cls, samples, chunk: int = 0) -> "MemoryModel":
        """samples: [(B, T, U, peak bytes)]; chunk: the transducer's chunk size, 0 for an AED."""
        X = np.array([_features(B, T, U, chunk) for B, T, U, _ in samples], dtype=np.float64)
        y = np.array([p for *_, p in samples], dtype=np.float64)
        w = 1.0 / y  # relative error: small and large steps count alike
        scale = np.abs(X).max(0)
        scale[scale == 0] = 1.0
        active = [j for j in range(X.shape[1]) if chunk or j != len(TERMS)]
        while True:
            sol, *_ = np.linalg.lstsq((X[:, active] / scale[active]) * w[:, None], y * w, rcond=None)
            negative = [j for j, c in zip(active, sol) if j > 0 and c < 0]
            if not negative:
                break
            active.remove(min(negative, key=lambda j: sol[active.index(j)]))
        coef = np.zeros(X.shape[1])
        coef[active] = sol / scale[active]
        return cls(coef, chunk)

    def predict(self, B, T, U) -> float:
        return float(np.dot(self.coef, _features(B, T, U, self.chunk)))

    def max_batch_size(self, T, U, limit: float) -> int:
        """Largest B with predict(B, T, U) <= limit (0 if none); predict grows with B."""
        if self.predict(1, T, U) > limit:
            return 0
        lo, hi = 1, 2
        while self.predict(hi, T, U) <= limit:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.predict(mid, T, U) <= limit else (lo, mid)
        return lo

    def relative_errors(self, samples) -> list:
        """(predicted - measured) / measured for each (B, T, U, peak): negative = under-estimate."""
        return [self.predict(B, T, U) / p - 1 for B, T, U, p in samples]

    def to_dict(self) -> dict:
        return {"constant": self.coef[0], **dict(zip(TERMS, self.coef[1:])), "chunk": self.chunk}

    @classmethod
    def from_dict(cls, d: dict, where: str = "memory model") -> "MemoryModel":
        """The model `to_dict` wrote; `where` names the source in errors."""
        missing = sorted({"constant", *TERMS} - set(d))
        if missing:
            raise ValueError(f"{where}: missing coefficient(s) {missing}")
        return cls([float(d["constant"]), *(float(d[t]) for t in TERMS)], int(d.get("chunk", 0)))

    def __repr__(self):
        terms = " + ".join(f"{c:.3g} {n}" for n, c in zip(TERMS, self.coef[1:]) if c)
        return f"MemoryModel({self.coef[0] / 2**30:.2f} GiB + {terms} bytes)"


log = logging.getLogger(__name__)


class MemoryBudgetError(RuntimeError):
    pass


def artificial_batch(batch_size: int, frames: int, tokens: int, n_mels: int, vocab_size: int, device) -> Batch:
    """A batch at a bucket's bounds, made on the device: feats (B, T, F) of random values, T
    valid frames each; tokens (B, U) of random ids below vocab_size, all valid, a 1-token prompt."""
    B, T, U = batch_size, frames, tokens
    return Batch(feats=torch.randn(B, T, n_mels, device=device),  # (B, T, F)
                 feat_lens=torch.full((B,), T, device=device),
                 tokens=torch.randint(0, vocab_size, (B, U), device=device),  # (B, U)
                 token_lens=torch.full((B,), U, device=device),
                 prompt_lens=torch.ones(B, dtype=torch.long, device=device),
                 where=[f"<artificial {T} frames, {U} tokens>"] * B, indices=list(range(B)), errors=[])


class TrainingStep:
    """train.py's training step (aed.train_setup.train_step) on an artificial batch at a bucket's
    bounds, and its peak memory. text_vocab_size bounds the random target ids: the tokenizer's
    real ids (a transducer's blank comes right after them); default: the model's vocabulary.
    `model` may also be a real DistributedDataParallel module: on a GPU the allocator counts its
    buckets, on the CPU the tracker does from the first op that writes into them (every backward).
    `ema`: the run's aed.train_setup.ExponentialMovingAverage, whose fp32 copy of the weights (this
    rank's shards under FSDP) is held through every step, like AdamW's moments."""

    def __init__(self, model, optimizer, precision: str = "fp32", spec_augment=None, ddp: bool = False,
                 text_vocab_size: int | None = None, granularity: int = 1, ema=None):
        self.model, self.optimizer, self.precision, self.ema = model, optimizer, precision, ema
        self.granularity = granularity  # CPU tracker's allocation rounding (simulating CUDA: 512)
        self.device = next(model.parameters()).device
        self.module = getattr(model, "module", model)  # the AED itself, under a real DDP wrapper too
        self.vocab_size = text_vocab_size or self.module.cfg.vocab_size
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=precision == "fp16")
        self.spec_augment = spec_augment if spec_augment is not None else SpecAugment()  # in its own mode (ssl: off)
        # DDP holds its gradient buckets, one more copy of every gradient, for the whole run.
        ddp_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) if ddp else 0
        self.ddp_buckets = torch.empty(ddp_bytes, dtype=torch.uint8, device=self.device)

    @classmethod
    def of(cls, setup, ddp: bool = False, granularity: int = 1, ema=None) -> "TrainingStep":
        """The step of a run's `aed.train_setup.TrainingSetup` (and its EMA, if it keeps one)."""
        return cls(setup.model, setup.optimizer, setup.precision, setup.spec_augment, ddp, setup.tokenizer.vocab_size,
                   granularity, ema)

    def run(self, batch_size: int, frames: int, tokens: int) -> None:
        batch = artificial_batch(batch_size, frames, tokens, self.module.cfg.n_mels, self.vocab_size, self.device)
        train_step(self.model, [batch], self.optimizer, self.scaler, self.spec_augment, self.precision,
                   clip_grad=1.0, num_targets=count_targets(self.module, [batch]))  # the clip value costs no memory

    def warm_up(self, frames: int, tokens: int) -> None:
        """AdamW creates its state in its first step; later steps carry it through forward and
        backward, so measure those."""
        if not self.optimizer.state:
            self.run(1, frames, tokens)

    def peak(self, batch_size: int, frames: int, tokens: int, limit=None) -> int:
        """Peak bytes of one step at this batch shape; raises OutOfMemory past `limit`."""
        # The last step's gradients die at the zero_grad that starts the next one, before its peak.
        # Free them here: a reference in `existing` would keep them alive through the step.
        self.optimizer.zero_grad(set_to_none=True)
        state = [v for s in self.optimizer.state.values() for v in s.values()]
        ema = [] if self.ema is None else list(self.ema.weights.values())
        existing = [*self.model.parameters(), *self.model.buffers(), *state, *ema, self.ddp_buckets]
        if isinstance(self.model, FSDPModule) and self.device.type != "cuda":
            # A step stopped halfway leaves FSDP's layers gathered and its gradients unreduced, and
            # the next step fails: run it whole, then compare (the search overshoots 2x at most).
            # On CUDA a real OOM does the same: size FSDP on simulated memory (oom.py --simulate-memory).
            peak = peak_memory(lambda: self.run(batch_size, frames, tokens), self.device, None, existing,
                               self.granularity)
            if limit is not None and peak > limit:
                raise OutOfMemory(peak, limit)
            return peak
        return peak_memory(lambda: self.run(batch_size, frames, tokens), self.device, limit, existing,
                           self.granularity)


def search_batch_size(peak_at, start: int, threshold: float) -> tuple:
    """Largest n for which `peak_at(n)` (bytes, or None: does not fit) fits, assuming memory grows
    with n: double from `start` while it fits (halve while it does not), then bisect until the
    largest fit and the smallest failure are within `threshold` of each other (or adjacent).
    Returns (n, its peak, trials); n = 0 when batch size 1 does not fit."""
    fit, fail, best_peak, trials, n = 0, None, None, 0, max(1, start)
    while True:
        trials += 1
        peak = peak_at(n)
        if peak is None:
            fail = n
        else:
            fit, best_peak = n, peak
        if fail is None:
            n *= 2
        elif fit == 0:
            if fail == 1:
                return 0, None, trials
            n = fail // 2
        elif fail - fit <= max(1.0, threshold * fit):
            return fit, best_peak, trials
        else:
            n = (fit + fail) // 2


def make_monotone(shapes: list, sizes: list) -> tuple:
    """A bucket at least as long as another in duration and in tokens gets at most its batch size
    (measurement noise can break this). Returns (sizes, [(bucket, old, new), ...] changes)."""
    fixed = [min(s for (d2, _, t2), s in zip(shapes, sizes) if d2 <= d and t2 <= t) for d, _, t in shapes]
    return fixed, [(b, old, new) for b, (old, new) in enumerate(zip(sizes, fixed)) if old != new]


def optimize(step: TrainingStep, shapes: list, limit: int, start: int = 16, threshold: float = 0.05) -> list:
    """Search every bucket's batch size, largest bucket first; returns one row (dict) per bucket
    in bucket order: duration, frames, tokens, batch_size, peak (bytes), trials, seconds."""
    step.warm_up(*shapes[0][1:])
    rows = [None] * len(shapes)
    for b in reversed(range(len(shapes))):
        d, frames, tokens = shapes[b]
        t_bucket = time.time()

        def peak_at(n):
            t0 = time.time()
            try:
                peak = step.peak(n, frames, tokens, limit)
                outcome = f"fits, peak {format_bytes(peak)}"
            except OutOfMemory as e:
                peak, outcome = None, f"does not fit ({e})"
            log.info("bucket %d/%d (%.2f s, %d tokens) batch %d: %s [%.1f s]", b, len(shapes) - 1, d, tokens, n,
                     outcome, time.time() - t0)
            return peak

        size, peak, trials = search_batch_size(peak_at, start, threshold)
        if size == 0:
            raise MemoryBudgetError(
                f"bucket {b} ({d:.2f} s, {tokens} tokens) does not fit a batch of 1 in {format_bytes(limit)}: raise "
                "the budget, use bf16 or activation_checkpointing, or re-estimate bins without the longest utterances")
        rows[b] = {"bucket": b, "duration": d, "frames": frames, "tokens": tokens, "batch_size": size, "peak": peak,
                   "trials": trials, "seconds": time.time() - t_bucket}
        start = 2 * size
    return rows


def fit_memory_model(step: TrainingStep, shapes: list, limit: int, fit_steps: int = 12, chunk: int = 0) -> tuple:
    """A MemoryModel of this step, fitted to `fit_steps` measured steps.

    Two probes on the middle bucket (batch 2 and 6) give the bytes per utterance there; each fit
    step then takes a bucket spread over `shapes` at the batch that would fill 60% or 95% of
    `limit` if memory scaled with seconds of audio, so the fit sees near-limit steps of every
    shape. Returns (model, samples [(B, T, U, peak)]). Steps over the limit are skipped.
    """
    def measure(B, frames, tokens):
        try:
            peak = step.peak(B, frames, tokens)
        except OutOfMemory:  # a real device ran out: nothing to fit on
            return None
        log.info("fit: batch %d, %d frames, %d tokens: peak %s", B, frames, tokens, format_bytes(peak))
        return (B, frames, tokens, peak)

    step.warm_up(*shapes[0][1:])
    d_mid, t_mid, u_mid = shapes[len(shapes) // 2]
    samples = [measure(2, t_mid, u_mid), measure(6, t_mid, u_mid)]
    per_second = (samples[1][3] - samples[0][3]) / (4 * d_mid)  # bytes per second of audio there
    fixed = samples[0][3] - 2 * d_mid * per_second
    seconds = (limit - fixed) / per_second  # a duration heuristic's budget that would fill the limit
    picks = sorted({round(i * (len(shapes) - 1) / max(1, fit_steps - 1)) for i in range(fit_steps)})
    for n, b in enumerate(picks):
        d, frames, tokens = shapes[b]
        samples.append(measure(max(1, math.floor((0.6, 0.95)[n % 2] * seconds / d)), frames, tokens))
    samples = [x for x in samples if x is not None and x[3] <= limit]
    return MemoryModel.fit(samples, chunk), samples


def optimize_with_model(step: TrainingStep, model: MemoryModel, shapes: list, limit: int, verify: int = 4) -> list:
    """Every bucket's batch size from the fitted model; `verify` buckets spread over the list are
    then measured at that size (shapes the fit did not see at that batch). A bucket whose step is
    over the limit is lowered to the model's answer for limit / (measured / predicted). Rows as
    `optimize`'s, with "predicted" and, when verified, "peak" and "error" (relative, measured)."""
    rows = []
    checked = {round(i * (len(shapes) - 1) / max(1, verify - 1)) for i in range(verify)} if verify else set()
    for b, (d, frames, tokens) in enumerate(shapes):
        t0 = time.time()
        size = model.max_batch_size(frames, tokens, limit)
        if size == 0:
            raise MemoryBudgetError(f"bucket {b} ({d:.2f} s, {tokens} tokens) does not fit a batch of 1 in "
                                    f"{format_bytes(limit)} (memory model)")
        row = {"bucket": b, "duration": d, "frames": frames, "tokens": tokens, "batch_size": size,
               "predicted": model.predict(size, frames, tokens), "peak": None, "trials": 0}
        if b in checked:
            peak = step.peak(size, frames, tokens)
            row.update(peak=peak, trials=1, error=row["predicted"] / peak - 1)
            log.info("verify bucket %d (%.2f s, %d tokens) batch %d: predicted %s, measured %s (%+.1f%%)", b, d,
                     tokens, size, format_bytes(row["predicted"]), format_bytes(peak), 100 * row["error"])
            if peak > limit:
                row["batch_size"] = model.max_batch_size(frames, tokens, limit * row["predicted"] / peak)
        row["seconds"] = time.time() - t0
        rows.append(row)
    return rows


def preflight(step: TrainingStep, shapes: list, batch_sizes: list, budget: int) -> list:
    """train.py's check before step 0: one step at every bucket's bounds (`bucket_shapes`) and
    batch size.

    batch_sizes: flat or nested like bins.tokens (e.g. `sampler.sizes`). Returns the peak bytes of
    each bucket that takes batches (size 0: the sampler drops what falls there); raises
    MemoryBudgetError naming every bucket whose step needs more than `budget`.
    Weights, optimizer state, RNG states and train/eval mode are restored afterwards, so training
    continues as if this never ran. On CPU a step is stopped at 2x the budget (not to exhaust RAM).
    """
    nested = isinstance(batch_sizes[0], (list, tuple))
    sizes = [s for row in batch_sizes for s in row] if nested else list(batch_sizes)
    if len(sizes) != len(shapes):
        raise ValueError(f"preflight: {len(sizes)} batch sizes for {len(shapes)} buckets")
    model, optimizer = step.model, step.optimizer
    saved = tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x,
                     {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    modes = {m: m.training for m in model.modules()}  # a frozen encoder stays in eval mode (train_mode)
    peaks, failures = [], []
    with torch.random.fork_rng(devices=[step.device] if step.device.type == "cuda" else []):
        model.train()
        step.warm_up(*shapes[0][1:])
        for b, ((d, frames, tokens), n) in enumerate(zip(shapes, sizes)):
            if n == 0:
                continue
            try:
                peak = step.peak(n, frames, tokens, limit=2 * budget if step.device.type == "cpu" else None)
                need = format_bytes(peak)
            except OutOfMemory as e:  # CPU: stopped at 2x the budget; CUDA: a real OOM
                peak = None
                need = "more than the device's memory" if e.needed is None else f"over {format_bytes(e.needed)}"
            log.info("preflight: bucket %d (%.2f s, %d tokens) at batch %d: peak %s", b, d, tokens, n, need)
            peaks.append(peak)
            if peak is None or peak > budget:
                failures.append(f"bucket {b} ({d:.2f} s, {tokens} tokens) at batch {n} needs {need} > "
                                f"{format_bytes(budget)} budget")
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    optimizer.zero_grad(set_to_none=True)
    for m, training in modes.items():
        m.train(training)
    if failures:
        raise MemoryBudgetError(
            f"{len(failures)} of {len(peaks)} buckets do not fit the memory budget:\n  " + "\n  ".join(failures)
            + "\nrerun oom.py for this model, precision and budget, or lower these buckets' batch sizes "
            "(train.batch_sizes / train.max_duration), or use precision=bf16 / activation_checkpointing")
    return peaks


def preflight_run(setup, data, proc: Process, ema=None) -> None:
    """train.py's memory_budget: the worst batch of every bucket of its data (aed.train_data.TrainingData)
    runs once before step 0 (`preflight`); a bucket that does not fit ends the run, naming it.
    Before the DDP wrap, whose gradient hooks must not fire during the check; an FSDP model runs
    its real, sharded step. The EMA of the weights, if kept, counts as state held through it."""
    cfg = setup.cfg
    try:
        peaks = preflight(TrainingStep.of(setup, ddp=proc.world_size > 1 and cfg.train.strategy == "ddp", ema=ema),
                          setup.bucket_shapes(data.bins, cfg.train.max_tps), data.sampler.sizes,
                          parse_bytes(cfg.memory_budget))
    except MemoryBudgetError as e:
        sys.exit(f"preflight: {e}")
    log.info("preflight: all %d buckets fit %s (largest peak %s)", len(peaks), cfg.memory_budget,
             format_bytes(max(peaks)))
    if proc.device.type == "cuda":  # the progress line's peak memory is the training's, not the check's
        torch.cuda.reset_peak_memory_stats(proc.device)


def memory_limit(device: torch.device, margin: float, budget: str | None = None, fraction: float = 0.9,
                 simulate: str | None = None) -> tuple[int, int, int]:
    """oom.py's (device bytes, budget, limit): the budget is `budget` (e.g. "20GB") or `fraction` of
    the device's memory; steps must fit the limit, the budget less the `margin` kept for what an
    artificial step does not see. A simulated CUDA device of `simulate` bytes is all budget, and its
    tensors may fill what the CUDA context, cuBLAS and the margin leave (`allocated_limit`)."""
    if simulate is not None:
        total = parse_bytes(simulate)
        return total, total, allocated_limit(total, margin)
    total = device_memory(device)
    budget_bytes = parse_bytes(budget) if budget else int(fraction * total)
    return total, budget_bytes, int(budget_bytes * (1 - margin))


def warn_ddp_rebuild(model, budget_bytes: int, margin: float) -> None:
    """DDP's second step rebuilds its gradient buckets in the order the first step's gradients came
    in, and held one more copy of the gradients at its peak on an H200 (docs/REPORT.md, "Simulated
    memory against real memory"), once per run. Sizes for the later steps: say when the margin is
    smaller than that copy."""
    copy = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if margin * budget_bytes < copy:
        log.warning("DDP's second step rebuilds its gradient buckets and may hold one more copy of the gradients "
                    "(%s), once; the %.0f%% margin (%s) does not cover it, so a batch sized to the limit may run out "
                    "of memory on step 2 (--margin %.2f would cover it)", format_bytes(copy), 100 * margin,
                    format_bytes(int(margin * budget_bytes)), math.ceil(100 * copy / budget_bytes) / 100)
