"""OOMptimizer: the largest batch size of every 2D bucket, found by running real training steps.

    python oom.py --config configs/canary-1b-flash.yaml --bins bins.json -o batch_sizes.json   # GPU: 90%
    python oom.py --config configs/tiny.yaml --bins bins.json --memory-budget 4GB -o batch_sizes.json
    python train.py configs/canary-1b-flash.yaml train.bins=bins.json train.batch_sizes=batch_sizes.json
    python oom.py --config configs/canary-1b.yaml --bins bins.json --simulate-memory 80GiB --memory-model -o bs.json
    python oom.py --config run.yaml --manifest train.jsonl --out buckets.yaml [--simulate-memory 80GiB --memory-model]
    python train.py run.yaml buckets.yaml

One command from manifests to a training config (--out): without --bins, bins are estimated from
--manifest (default: the config's train.manifests) with the training tokenizer and prompt, the
config's train.num_buckets / sub_buckets / bin_method, leaving out what exceeds model.dec_max_len
(aed/manifest_bins.py, as tools/estimate_bins.py); each duration bin's TPS filter (bins.max_tps,
outliers past 4 standard deviations) bounds the search's token counts and is written as
train.max_tps, so training drops the same outliers; the batch sizes go to -o (default: next to
--out) and --out is a YAML fragment (train.batch_sizes, train.max_tps, train.manifests when
--manifest is given) that train.py merges over the config when given after it.

--simulate-memory sizes a CUDA device of that size on a CPU: the same step on fake tensors
(aed/simulated_memory.py). A 1B-parameter fake step takes 15-90 s, so --memory-model fits peak
memory as a low-order function of (B, T, U) to --fit-steps steps (aed/memory_model.py), takes every
bucket's size from it and measures --verify buckets at their answer.

The cumulative-duration heuristic (train.max_duration) gives every bucket the same seconds of
audio, but memory is not linear in duration (attention is quadratic in frames; the decoder and its
vocab-sized logits grow with tokens), so most buckets run far below the limit to keep the worst
one safe. Measuring every bucket instead gave the paper a 3.4x larger mean batch (5x with 2D
buckets). For each bucket, from the largest to the smallest:

1. An artificial batch at the bucket's upper bounds: random features of num_frames(d) frames and
   random tokens of its token bound U (1D bins: U = the bin's max tokens/s x d, from bins.max_tps
   or --max-tps; filter the data with train.max_tps to match, or outliers may not fit).
2. One full training step, the very function train.py runs (`aed.training.train_step`: zero_grad,
   SpecAugment, forward, loss, backward, clip, AdamW step), for the config's objective (aed,
   rnnt or ssl; ssl's 1D bins get 2-token batches, as it reads no text) and precision, with its peak memory measured: on CUDA by the
   allocator under set_per_process_memory_fraction, on CPU by tracking live tensor storages
   (aed/memory.py). No formula: every number comes from running the step.
3. Double the batch while it fits, then bisect between the largest fit and the smallest failure
   until they are within --threshold (5%). The next bucket starts from 2x this answer.

Steps must fit the budget minus a safety margin (10%) for what an artificial step does not see:
allocator fragmentation, pinned loader buffers, validation decoding. --ddp adds DDP's gradient
buckets (one more copy of the gradients). A bucket at least as large as another in both duration
and tokens never gets a larger batch: violations (measurement noise) are lowered and reported.
Writes `sampler.save_batch_sizes`'s format and prints a table. `preflight()` is train.py's check
before step 0: the worst-case batch of every bucket runs once, with an actionable error.
"""

import argparse
import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from typing import NamedTuple

import torch
import yaml
from torch.utils._pytree import tree_map

from aed.audio import FeatureConfig, SpecAugment, num_frames
from aed.config import ConfigError, load_train_config, resolve_model
from aed.data import Batch
from aed.manifest_bins import bins_from_manifests
from aed.memory import OutOfMemory, format_bytes, parse_bytes, peak_memory
from aed.memory_model import MemoryModel
from aed.ssl import BestRQ
from aed.transducer import TransducerASR
from aed.simulated_memory import CUDA_BLOCK, SimulatedDevice, allocated_limit
from aed.tokenizer import Tokenizer
from aed.training import (AMP_DTYPES, build_model, build_optimizer, count_targets, new_tokens, resolve_precision,
                          train_step)
from sampler import Bins, save_batch_sizes

log = logging.getLogger("oom")


class MemoryBudgetError(RuntimeError):
    pass


def bucket_shapes(bins: Bins, features: FeatureConfig, dec_max_len: int, max_tps=None) -> list:
    """(duration bound s, feature frames T, token bound U) of every bucket, duration-major like
    bins.buckets(). 1D bins get U = max_tps x d (max_tps: a number, one per bin, or bins.max_tps)."""
    tps = max_tps if max_tps is not None else bins.max_tps
    if bins.tokens is None and tps is None:
        raise ValueError("1D bins without max_tps: pass the max tokens per second (--max-tps)")
    tps = [float(tps)] * len(bins.durations) if isinstance(tps, (int, float)) else tps
    shapes = []
    for i, d in enumerate(bins.durations):
        for t in bins.tokens[i] if bins.tokens else [math.ceil(tps[i] * d)]:
            if t > dec_max_len:  # train.py drops longer utterances, so no batch reaches t
                log.info("bucket (%.2f s, %d tokens): token bound capped at dec_max_len=%d", d, t, dec_max_len)
            frames = num_frames(round(d * features.sample_rate), features.hop_length)
            shapes.append((d, frames, max(2, min(int(t), dec_max_len))))  # >= 2: one input, one target
    return shapes


def artificial_batch(batch_size: int, frames: int, tokens: int, n_mels: int, vocab_size: int, device) -> Batch:
    """A batch at a bucket's bounds, made on the device: feats (B, T, F) of random values, T
    valid frames each; tokens (B, U) of random ids below vocab_size, all valid, a 1-token prompt."""
    B, T, U = batch_size, frames, tokens
    return Batch(feats=torch.randn(B, T, n_mels, device=device),  # (B, T, F)
                 feat_lens=torch.full((B,), T, device=device),
                 tokens=torch.randint(0, vocab_size, (B, U), device=device),  # (B, U)
                 token_lens=torch.full((B,), U, device=device),
                 prompt_lens=torch.ones(B, dtype=torch.long, device=device),
                 paths=[f"<artificial {T} frames, {U} tokens>"] * B, indices=list(range(B)), errors=[])


class TrainingStep:
    """train.py's training step (aed.training.train_step) on an artificial batch at a bucket's
    bounds, and its peak memory. text_vocab_size bounds the random target ids: the tokenizer's
    real ids (a transducer's blank comes right after them); default: the model's vocabulary."""

    def __init__(self, model, optimizer, precision: str = "fp32", spec_augment=None, ddp: bool = False,
                 text_vocab_size: int | None = None, granularity: int = 1):
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.granularity = granularity  # CPU tracker's allocation rounding (simulating CUDA: 512)
        self.device = next(model.parameters()).device
        self.vocab_size = text_vocab_size or model.cfg.vocab_size
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=precision == "fp16")
        self.spec_augment = spec_augment if spec_augment is not None else SpecAugment()  # in its own mode (ssl: off)
        # DDP holds its gradient buckets, one more copy of every gradient, for the whole run.
        ddp_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) if ddp else 0
        self.ddp_buckets = torch.empty(ddp_bytes, dtype=torch.uint8, device=self.device)

    def run(self, batch_size: int, frames: int, tokens: int) -> None:
        batch = artificial_batch(batch_size, frames, tokens, self.model.cfg.n_mels, self.vocab_size, self.device)
        train_step(self.model, [batch], self.optimizer, self.scaler, self.spec_augment, self.precision,
                   clip_grad=1.0, num_targets=count_targets(self.model, [batch]))  # the clip value costs no memory

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
        existing = [*self.model.parameters(), *self.model.buffers(), *state, self.ddp_buckets]
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
    """A MemoryModel (aed/memory_model.py) of this step, fitted to `fit_steps` measured steps.

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


def preflight(model, optimizer, bins: Bins, batch_sizes: list, budget: int, features=FeatureConfig(),
              precision: str = "fp32", spec_augment=None, ddp: bool = False, max_tps=None,
              text_vocab_size: int | None = None) -> list:
    """train.py's check before step 0: one step at every bucket's bounds and batch size.

    batch_sizes: flat or nested like bins.tokens (e.g. `sampler.sizes`). Returns each bucket's
    peak bytes; raises MemoryBudgetError naming every bucket whose step needs more than `budget`.
    Weights, optimizer state, RNG states and train/eval mode are restored afterwards, so training
    continues as if this never ran. On CPU a step is stopped at 2x the budget (not to exhaust RAM).
    """
    nested = isinstance(batch_sizes[0], (list, tuple))
    sizes = [s for row in batch_sizes for s in row] if nested else list(batch_sizes)
    shapes = bucket_shapes(bins, features, model.cfg.dec_max_len, max_tps)
    if len(sizes) != len(shapes):
        raise ValueError(f"preflight: {len(sizes)} batch sizes for {len(shapes)} buckets")
    step = TrainingStep(model, optimizer, precision, spec_augment, ddp, text_vocab_size)
    saved = tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x,
                     {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    was_training = model.training
    peaks, failures = [], []
    with torch.random.fork_rng(devices=[step.device] if step.device.type == "cuda" else []):
        model.train()
        step.warm_up(*shapes[0][1:])
        for b, ((d, frames, tokens), n) in enumerate(zip(shapes, sizes)):
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
    model.train(was_training)
    if failures:
        raise MemoryBudgetError(
            f"{len(failures)} of {len(shapes)} buckets do not fit the memory budget:\n  " + "\n  ".join(failures)
            + "\nrerun oom.py for this model, precision and budget, or lower these buckets' batch sizes "
            "(train.batch_sizes / train.max_duration), or use precision=bf16 / activation_checkpointing")
    return peaks


# --- command line -----------------------------------------------------------------------------


class TrainingSetup(NamedTuple):
    model: torch.nn.Module  # in train mode, on the device
    optimizer: torch.optim.Optimizer
    features: FeatureConfig
    spec_augment: SpecAugment
    precision: str  # resolved: fp32, bf16 or fp16
    text_vocab_size: int  # the tokenizer's real ids


def load_training_setup(path: str, device: torch.device, precision: str | None = None,
                        overrides: list[str] = (), simulated: bool = False) -> TrainingSetup:
    """What decides a training step's memory, built from a train.py config exactly as train.py
    builds it: the model of its objective (vocabulary from its tokenizer), the optimizer with
    train.py's parameter groups, features, SpecAugment and precision (`precision` overrides).
    simulated: built inside aed.simulated_memory.SimulatedDevice, standing in for a CUDA device,
    so `auto` precision resolves as it would there (bf16)."""
    try:
        cfg = load_train_config(path, overrides)
        tokenizer = Tokenizer.load(cfg.train.tokenizer)
        cfg = resolve_model(cfg, tokenizer)
        precision = resolve_precision(precision or cfg.precision, torch.device("cuda") if simulated else device)
        added_tokens = new_tokens(cfg, tokenizer.vocab_size)
    except (ConfigError, OSError, ValueError) as e:
        raise SystemExit(f"{path}: {e}") from None
    model = build_model(cfg, tokenizer.vocab_size, added_tokens).train()
    if not simulated:  # fake parameters cannot move (and are on the CPU already)
        model = model.to(device)
    return TrainingSetup(model, build_optimizer(model, cfg.optim), cfg.features,
                         SpecAugment(cfg.spec_augment).train(cfg.objective != "ssl"), precision, tokenizer.vocab_size)


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def print_table(rows: list, changes: dict) -> None:
    print(f"{'bucket':>6} {'<= s':>7} {'<= tok':>6} {'frames':>6} {'batch':>6} {'peak':>10} {'trials':>6} "
          f"{'time s':>7}  note")
    for r in rows:
        note = f"lowered from {changes[r['bucket']]} (monotone)" if r["bucket"] in changes else ""
        if r.get("predicted") is not None:  # --memory-model
            note = f"predicted {format_bytes(r['predicted'])}" + (f" ({100 * r['error']:+.1f}%)" if "error" in r else "")
        peak = format_bytes(r["peak"]) if r["peak"] is not None else "-"
        print(f"{r['bucket']:>6} {r['duration']:>7.2f} {r['tokens']:>6} {r['frames']:>6} {r['batch_size']:>6} "
              f"{peak:>10} {r['trials']:>6} {r['seconds']:>7.1f}  {note}")


def manifest_bins(config: str, manifests: list | None, sample: int | None) -> tuple:
    """(bins, the manifests) estimated as train.py's data would be tokenized: the config's
    tokenizer, prompt, bucket counts, bin method and dec_max_len; manifests default to its
    train.manifests."""
    try:
        cfg = load_train_config(config)
        if not manifests:
            manifests = [m if isinstance(m, str) else m.get("path") for m in cfg.train.manifests]
            if None in manifests:
                raise ConfigError("train.manifests has tar shards: give their source manifests with --manifest")
        bins, meta = bins_from_manifests(manifests, Tokenizer.load(cfg.train.tokenizer), cfg.train.num_buckets,
                                         cfg.train.sub_buckets, cfg.train.bin_method, sample, cfg.seed,
                                         max_tokens=cfg.model.dec_max_len)
    except (ConfigError, OSError, ValueError) as e:
        raise SystemExit(f"oom.py: {config}: {e}") from None
    log.info("bins: %d buckets from %d of %d lines of %s (skipped: %s)", bins.num_buckets, meta["used"],
             meta["lines"], ", ".join(manifests), meta["skipped"] or "none")
    return bins, manifests


def write_fragment(path: str, batch_sizes: str, max_tps, manifests: list | None, about: str) -> None:
    """The YAML fragment train.py merges over its config: `python train.py CONFIG.yaml path`."""
    train = {"batch_sizes": batch_sizes}
    if max_tps is not None:
        train["max_tps"] = max_tps
    if manifests:
        train["manifests"] = manifests
    header = f"# {about}\n# python train.py CONFIG.yaml {path}   (this file's keys override the config's)\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(header + yaml.safe_dump({"train": train}, default_flow_style=None, sort_keys=False))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="oom.py", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="train.py YAML (model, features, optim, precision sections)")
    p.add_argument("--bins", help="bins.json from tools/estimate_bins.py (or a run dir's bins.json); default: "
                   "estimated from --manifest or the config's train.manifests")
    p.add_argument("--manifest", action="append", help="without --bins: estimate bins from this manifest (repeat)")
    p.add_argument("--sample", type=int, default=None, help="without --bins: estimate from this many lines")
    p.add_argument("-o", "--output", help="batch sizes JSON for train.batch_sizes (default: next to --out)")
    p.add_argument("--out", help="YAML fragment for train.py (train.batch_sizes, train.max_tps, train.manifests)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--memory-budget", help="memory the training may use, e.g. 20GB (CPU: live tensor bytes)")
    budget.add_argument("--memory-fraction", type=float, default=0.9,
                        help="budget as a fraction of the device's memory (CPU: of the RAM)")
    budget.add_argument("--simulate-memory", metavar="SIZE",
                        help="simulate a CUDA device of this size (e.g. 80GB) with fake tensors on the CPU "
                        "(aed/simulated_memory.py); the margin covers what the simulation does not model")
    p.add_argument("--margin", type=float, default=0.1, help="safety margin: steps must fit budget x (1 - margin)")
    p.add_argument("--memory-model", action="store_true",
                   help="fit a memory model to --fit-steps steps and take every bucket's size from it "
                   "(aed/memory_model.py), instead of bisecting every bucket with steps")
    p.add_argument("--fit-steps", type=int, default=12, help="--memory-model: steps to fit on")
    p.add_argument("--verify", type=int, default=4, help="--memory-model: buckets measured at their answer")
    p.add_argument("--dtype", choices=list(AMP_DTYPES), default=None, help="precision (default: the config's)")
    p.add_argument("--ddp", action="store_true", help="add DDP's gradient bucket memory (multi-GPU training)")
    p.add_argument("--threshold", type=float, default=0.05, help="stop when fit and failure are this close")
    p.add_argument("--start-batch-size", type=int, default=16, help="first trial of the largest bucket")
    p.add_argument("--max-tps", type=float, default=None,
                   help="1D bins: tokens/s that bound each bucket's tokens (default: bins.max_tps)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if not (args.output or args.out):
        p.error("give -o (batch sizes JSON) or --out (a YAML fragment for train.py), or both")
    if args.bins and args.manifest:
        p.error("--manifest estimates bins: give it or --bins, not both")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    output = args.output or os.path.splitext(args.out)[0] + ".batch_sizes.json"
    bins, manifests = (None, None) if args.bins else manifest_bins(args.config, args.manifest, args.sample)

    simulated = args.simulate_memory is not None
    device = torch.device("cpu" if simulated else args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with SimulatedDevice() if simulated else nullcontext():  # the model must be built on fake tensors
        setup = load_training_setup(args.config, device, args.dtype, simulated=simulated)
        model, features, precision = setup.model, setup.features, setup.precision
        try:
            bins = bins or Bins.load(args.bins)
            max_tps = 0.0 if isinstance(model, BestRQ) and args.max_tps is None else args.max_tps  # no tokens
            shapes = bucket_shapes(bins, features, model.cfg.dec_max_len, max_tps)
            total = parse_bytes(args.simulate_memory) if simulated else device_memory(device)
            budget_bytes = parse_bytes(args.memory_budget) if args.memory_budget else int(args.memory_fraction * total)
        except (OSError, ValueError) as e:
            raise SystemExit(f"oom.py: {e}") from None
        if simulated:  # tensors may fill what the CUDA context, cuBLAS and the margin leave
            budget_bytes, limit = total, allocated_limit(total, args.margin)
        else:
            limit = int(budget_bytes * (1 - args.margin))
        if device.type == "cuda":  # real OOMs at the limit, like a GPU that is this size
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        log.info("model %.1fM parameters, %s%s, %s%s; budget %s -> limit %s (margin %.0f%%); %d buckets",
                 sum(p.numel() for p in model.parameters()) / 1e6, device, " (simulated CUDA)" if simulated else "",
                 precision, " + DDP buckets" if args.ddp else "", format_bytes(budget_bytes), format_bytes(limit),
                 100 * args.margin, len(shapes))

        t0 = time.time()
        step = TrainingStep(model, setup.optimizer, precision, setup.spec_augment, args.ddp, setup.text_vocab_size,
                            granularity=CUDA_BLOCK if simulated else 1)
        try:
            if args.memory_model:
                chunk = model.chunk_size if isinstance(model, TransducerASR) else 0
                memory_model, samples = fit_memory_model(step, shapes, limit, args.fit_steps, chunk)
                fit_errors = memory_model.relative_errors(samples)
                log.info("%s; fit error on its %d steps: max |%.1f%%|", memory_model, len(samples),
                         100 * max(map(abs, fit_errors)))
                rows = optimize_with_model(step, memory_model, shapes, limit, args.verify)
            else:
                rows = optimize(step, shapes, limit, args.start_batch_size, args.threshold)
        except MemoryBudgetError as e:
            raise SystemExit(f"oom.py: {e}") from None
    sizes, changes = make_monotone(shapes, [r["batch_size"] for r in rows])
    for b, old, new in changes:
        log.warning("bucket %d: batch size %d lowered to %d, the size of a smaller bucket (monotone)", b, old, new)
        rows[b]["batch_size"] = new
    it = iter(sizes)
    save_batch_sizes(output, bins, [[next(it) for _ in range(k)] for k in bins.shape])
    where = (f"limit {format_bytes(limit)} ({precision}{', DDP' if args.ddp else ''}"
             f"{', simulated CUDA' if simulated else ''})")
    if args.out:
        write_fragment(args.out, output, args.max_tps if args.max_tps is not None else bins.max_tps,
                       args.manifest and manifests, f"oom.py: batch sizes for {args.config}, {where}")
    print_table(rows, {b: old for b, old, _ in changes})
    print(f"{len(rows)} buckets, {sum(r['trials'] for r in rows)} trials in {time.time() - t0:.0f} s; {where} -> "
          f"{output}{' and ' + args.out if args.out else ''}")


if __name__ == "__main__":
    main()
