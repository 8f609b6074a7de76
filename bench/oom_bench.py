"""The OOMptimizer at CPU scale and at the paper's, in modes (`python bench/oom_bench.py MODE --help` lists a
mode's flags):

    e2 (default)   mean batch size under one memory limit, heuristic vs per-bucket sizes: a CPU-scaled
                   model's real steps, or (--scale) the paper's E2 table for a 1B preset from a memory model
    fit            simulated steps of a preset without a GPU (aed/memory_measure.py), a memory model fitted
    validate       the simulator against real CPU steps of small configs
    validate-fsdp  the simulator against a real 2-rank FSDP step (torchrun, gloo)
    validate-cuda  the simulator against a preset's real steps on a CUDA GPU

    python bench/oom_bench.py                                   # CPU-scaled model, 198 MB limit: ~5 min
    python bench/oom_bench.py --d-model 256 --heads 4 --enc-layers 12 --dec-layers 4 \\
        --subsampling-channels 64 --n-mels 128 --vocab-size 5248 --budget 2GB   # 25M parameters: hours on CPU
    python bench/oom_bench.py fit configs/canary-1b.yaml --out canary-1b.model.json     # 18 steps, ~30-60 min
    python bench/oom_bench.py --scale configs/canary-1b.yaml --memory-model canary-1b.model.json \\
        [--confirm 1]                                           # E2 at the paper's scale: ~5 min
    python bench/oom_bench.py fit configs/canary-1b.yaml --strategy fsdp --world-size 8 --out 1b.fsdp8.json
    python bench/oom_bench.py fit configs/canary-1b.yaml --strategy ddp --activation-checkpointing both --out 1b.ddp.ckpt.json
    python bench/oom_bench.py validate --out validation.json                             # real vs simulated
    python bench/oom_bench.py validate-fsdp --out fsdp.json    # real 2-rank FSDP vs simulated, fp32, ~1 min
    python bench/oom_bench.py validate-fsdp --precision fp32 bf16 --out fsdp.json    # and bf16, as on CUDA
    python bench/oom_bench.py validate-cuda configs/canary-1b.yaml --out 1b.cuda.json     # on a GPU: real steps

`e2`, the small-scale table (default), every number from a real step on the CPU. Three ways to give
each bucket its batch size, on the synthetic corpus (common.synthetic_corpus) and the same model,
optimizer and memory limit (budget minus oom.py's 10% margin):
(a) 1D, 30 duration buckets, padded-duration heuristic: n = floor(M / d) with the largest M for
    which no bucket exceeds the limit: just below min over buckets of (oom.py's size + 1) x d,
    then checked by running every bucket's worst-case batch once (aed.memory_oomptimizer.preflight);
(b) the same 1D buckets, sizes from oom.py;
(c) 2D 30x2 buckets, sizes from oom.py.
1D buckets are bounded in tokens by the bin's max tokens/s x d (bins.max_tps, as oom.py does).
The mean batch size is what training sees: examples / batches, with every bucket's occupancy on
the corpus (bins.counts). The paper: (b)/(a) = 3.4x, (c)/(a) = 5x; target here (c)/(a) >= 3x.
Memory is measured on CPU (live tensor bytes, aed/memory_measure.py), every number from a real step. The
search runs ~400 steps, so the default model is Canary-1B's proportions at 1/16 width (d 64, one
attention head per 64 dims as Canary's 8 per 1024, subsampling channels d/4, vocab 5d) with 4+4
layers (Canary-1B: 24+24): 0.7M parameters, chosen so that attention (quadratic in duration),
per-frame and per-token memory keep roughly Canary's proportions. Timings share 2 cores with
other jobs.

`e2 --scale PRESET --memory-model FIT.json`: the paper's E2 table (sec. 4) for a 1B preset on an
80 GiB CUDA device in bf16, simulated (aed/memory_measure.py). The workload is
common.paper_corpus (0.5-40 s, four languages' speech rates, 6% long low-speech segments,
1% long-transcript outliers); examples longer than the decoder (model.dec_max_len) are dropped,
as train.py does. Every batch of one full epoch of the real sampler (one rank) is checked against
the limit (allocated_limit: 80 GiB minus the 10% margin, the CUDA context and cuBLAS) with the
memory model fitted to simulated steps of the preset by `fit`, less the
model's worst under-estimate on the fit's held-out shapes (its errors are in the JSON; `--confirm
K` also runs the K worst batches of every scheme as simulated steps and reports predicted vs
simulated). The paper's schemes:
  A: 1D 30 buckets, no TPS filter, duration heuristic n = floor(M / d), with M (batch_duration)
     the largest value at which no batch of the epoch is over the limit (bisection to 1 s, each
     M checked on its own epoch, since batches regroup when M changes);
  B: A plus the TPS filter (each duration bin's max tokens/s, bins.max_tps: outliers beyond 4
     standard deviations dropped; the paper filters at a fixed 25), M re-tuned the same way;
     its peak-memory reduction is the largest batch's memory at A's M, without vs with the filter;
  C: B with oom.py's per-bucket batch sizes (from the memory model at every bucket's bounds);
  D: C with 2D 30x2 equal-count buckets (the paper's), sizes re-estimated.
Prints a per-bucket table, a per-scheme table next to the paper's numbers, then the JSON line.

`--scale PRESET --memory-model FIT.json --fsdp-memory-model FSDP.json --device-memory 24GiB,48GiB,80GiB`:
the same schemes per device size, DDP against FSDP (one rank of each): DDP is FIT.json's model
plus DDP's gradient buckets (a constant 4 bytes x parameters, exactly what oom.py --ddp adds)
unless FIT.json was fitted with --strategy ddp; FSDP's model is fitted to simulated steps of the
sharded model (`fit --strategy fsdp --world-size 8`). A scheme "does not
fit" a device when one utterance of its largest bucket is over the limit (A's, without the TPS
filter, holds the long-transcript outliers; B-D's hold the filtered data); `fits` says all four
do. JSON line: {preset: {GB: {ddp: {mean_batch, ratios, fits, fits_scheme, ...}, fsdp: {...}}}}.

`fit`: simulated training steps (aed/memory_measure.py: the real train_step on fake CPU tensors,
bf16 autocast, AdamW, SpecAugment, CUDA's 512-byte allocation rounding) of a preset at FIT shapes,
a MemoryModel (aed/memory_oomptimizer.py) fitted to them, and its error on HELD_OUT shapes it did not
see. Batch sizes are picked so the steps are near an 80 GiB device's limit, where the fit matters.
Writes the coefficients, every step and the errors as JSON.

`validate`: the simulator against real CPU steps (aed/memory_measure.py's LiveTensorMemory, the same count
of live tensor storages, exact to the byte against the c10 allocator) for small configs, both
objectives, fp32 and bf16, long transcripts included. Both run on the CPU, so this checks the
fake-tensor execution and the host values; what a CUDA device adds is checked by
tests/test_cuda_oom.py on a GPU.

`fit --strategy fsdp --world-size W`: the same steps on one rank of FSDP over W ranks: the model
sharded as train.py shards it (aed/train_distributed.py, bf16 parameters as on CUDA) over a fake process
group (aed/memory_measure.py `fake_world`). `--strategy ddp` adds DDP's gradient buckets.

`validate-fsdp`: a real FSDP step at world size 2 (torchrun, gloo; fp32, and/or bf16 parameters and
autocast as train.py runs FSDP on CUDA; one world runs every precision asked for) measured on rank 0
with LiveTensorMemory, against the simulated step on a fake world of 2 for the same shapes; rank 0's
process RSS growth over one larger step checks that the tracker sees FSDP's memory (DTensor shards,
storages resized in place) at all.

`validate-cuda` (a CUDA GPU with ~32 GB): a preset's real steps at three shapes, on one device and
under a real DDP wrapper, against the simulated step and the DDP constant the E2 table per GPU size adds.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from common import (add_width_args, epoch_batch, log, paper_corpus, print_json, print_table, proc_status_bytes,
                    random_aed, reset_peak_rss, run_modes, show_library_logs, synthetic_corpus)
from torch.nn.parallel import DistributedDataParallel

from aed.data_audio import FeatureConfig, num_frames
from aed.train_data import bucket_shapes
from aed.memory_measure import (CUBLAS_WORKSPACE, CUDA_BLOCK, LiveTensorMemory, SimulatedDevice, allocated_limit,
                                fake_world, format_bytes, parse_bytes)
from aed.memory_oomptimizer import (MemoryBudgetError, MemoryModel, TrainingStep, make_monotone, optimize,
                                    optimize_with_model, preflight)
from aed.model import AED, AEDConfig, count_parameters
from aed.model_transducer import TransducerASR
from aed.train_config import OptimConfig, load_train_config
from aed.train_distributed import shard
from aed.train_setup import build_optimizer
from bins import estimate_bins
from sampler import BucketingSampler

PAPER = {"C/A": 3.4, "D/A": 5.0, "tps_peak_reduction": 0.20}  # sec. 4, E2


def simulated_step(cfg, strategy: str | None = None, world_size: int = 1, checkpointing: str = "none"):
    """The training step of the memory model fits (`fit`) and their checks
    (--confirm), to be built inside SimulatedDevice() (and for fsdp inside
    fake_world(world_size)): the AEDConfig's model, AdamW with train.py's defaults, bf16 autocast,
    CUDA's 512-byte rounding, optimizer state created. ddp adds its gradient buckets; fsdp shards
    the model as train.py does on CUDA (bf16 parameters, fp32 reductions); checkpointing: train.py's
    activation_checkpointing (none, encoder, decoder, both)."""
    model = AED(cfg).train()
    model.encoder.checkpoint_activations = checkpointing in ("encoder", "both")
    model.decoder.checkpoint_activations = checkpointing in ("decoder", "both")
    if strategy == "fsdp":
        shard(model, torch.device("cpu"), world_size, "bf16", bf16_params=True)
    step = TrainingStep(model, build_optimizer(model, OptimConfig()), "bf16", ddp=strategy == "ddp",
                        granularity=CUDA_BLOCK)
    step.warm_up(101, 10)
    return step


# --- e2 at the paper's scale: every batch of an epoch against a fitted memory model ----------------


def run_epoch(examples: list, bins, seed: int = 0, **batching) -> tuple:
    """One epoch of the training sampler (one rank): its batches as (bucket, batch size, longest
    duration s, most tokens), and the sampler's stats (padding, drops). batching: the sampler's
    max_duration or batch_sizes, and max_tps."""
    sampler = BucketingSampler(examples, bins, rank=0, world_size=1, seed=seed, yield_indices=True, **batching)
    batches = []
    for _ in sampler:
        info = sampler.last_batch_info
        batches.append((info["bucket"], info["size"], info["max_duration"], info["max_tokens"]))
    return batches, sampler.stats


def memory_of(batches: list, peak) -> np.ndarray:
    """peak(batch size, longest duration s, most tokens) of every batch."""
    return np.array([peak(n, d, t) for _, n, d, t in batches], dtype=np.float64)


def largest_batch_duration(examples: list, bins, peak, limit: float, seed: int = 0, resolution: float = 1.0,
                           **filters) -> dict:
    """The duration heuristic's largest batch_duration M at which no batch of the epoch needs more
    than `limit` (peak: as in memory_of). Batches regroup when M changes, so every trial runs its
    own epoch. Doubles M from the longest bin (a batch of 1 there), then bisects until M fits and
    `fails_at` <= M + resolution does not. Returns {max_duration, fails_at, batches, stats, trials}."""
    trials = 0

    def attempt(M):
        nonlocal trials
        trials += 1
        batches, stats = run_epoch(examples, bins, seed, max_duration=M, **filters)
        return bool((memory_of(batches, peak) > limit).any()), batches, stats

    lo = bins.durations[-1]
    over, *best = attempt(lo)
    if over:
        raise ValueError(f"at batch_duration {lo:.2f} s (one utterance of the longest bucket) a batch of the epoch is "
                         "over the limit: no batch_duration fits")
    hi = 2 * lo
    while not (result := attempt(hi))[0]:
        lo, best, hi = hi, result[1:], 2 * hi
    while hi - lo > resolution:
        mid = (lo + hi) / 2
        over, *result = attempt(mid)
        lo, hi, best = (lo, mid, best) if over else (mid, hi, result)
    return {"max_duration": lo, "fails_at": hi, "batches": best[0], "stats": best[1], "trials": trials}


def scheme_summary(batches: list, stats: dict, peak, limit: float, sized: float) -> dict:
    """Memory as a fraction of `limit`; over_limit counts the batches predicted above `sized`."""
    mem = memory_of(batches, peak)
    return {"batches": len(batches), "examples": stats["examples"], "mean_batch": stats["examples"] / len(batches),
            "mean_memory": float(mem.mean() / limit), "max_memory": float(mem.max() / limit),
            "over_limit": int((mem > sized).sum()),
            "audio_padding": stats["audio_padding"], "text_padding": stats["text_padding"], "drops": stats["drops"]}


def per_bucket(batches: list, peak, limit: float, num_buckets: int) -> list:
    """[batches, max memory / limit] of every bucket over the epoch."""
    rows = [[0, 0.0] for _ in range(num_buckets)]
    for (b, _, _, _), m in zip(batches, memory_of(batches, peak) / limit):
        rows[b][0] += 1
        rows[b][1] = max(rows[b][1], float(m))
    return rows


def model_sizes(memory_model: MemoryModel, shapes: list, limit: float) -> list:
    """oom.py --memory-model's per-bucket batch sizes (largest that fits at the bucket's bounds), monotone."""
    rows = optimize_with_model(None, memory_model, shapes, limit, verify=0)
    return make_monotone(shapes, [r["batch_size"] for r in rows])[0]


def strategy_grid(args) -> None:
    """E2's schemes per device size, DDP vs FSDP: {preset: {GB: {ddp: ..., fsdp: ...}}} (module doc)."""
    t_start = time.time()
    cfg = load_train_config(args.scale)
    features, dec_max_len = cfg.features, cfg.model.dec_max_len
    with torch.device("meta"):  # the parameter count, without allocating 1B parameters
        grad_bytes = 4 * count_parameters(AED(AEDConfig.from_yaml(args.scale)))
    fits = {}
    for strategy, path in (("ddp", args.memory_model), ("fsdp", args.fsdp_memory_model)):
        fitted = json.loads(Path(path).read_text())
        model = MemoryModel.from_dict(fitted["model"], where=f"{path}: model")
        buckets = 0 if strategy == "fsdp" or fitted.get("strategy") == "ddp" else grad_bytes
        model.coef[0] += buckets  # DDP's gradient buckets: alive for the whole run (oomptimizer.TrainingStep)
        fits[strategy] = (model, max(0.0, -min(fitted["errors"]["held_out"])), fitted.get("world_size"), buckets)

    def frames(d):
        return num_frames(round(d * features.sample_rate), features.hop_length)

    corpus = paper_corpus(args.synthetic, args.seed)
    examples = [e for e in corpus if e["num_tokens"] <= dec_max_len]
    durs, toks = [e["duration"] for e in examples], [e["num_tokens"] for e in examples]
    bins_1d = estimate_bins(durs, toks, args.buckets, 1)
    bins_2d = estimate_bins(durs, toks, args.buckets, 2, method="equal")
    longest = max(examples, key=lambda e: (e["duration"], e["num_tokens"]))
    d_max, _, u_max = bucket_shapes(bins_2d, features, dec_max_len)[-1]  # the largest bucket's bounds
    result, rows = {}, []
    for gb in args.device_memory.split(","):
        device = parse_bytes(gb)
        limit = allocated_limit(device, args.margin)
        for strategy, (memory_model, under, world, buckets) in fits.items():
            sized = limit * (1 - under)

            def peak(n, d, t):
                return memory_model.predict(n, frames(d), t)

            one = max(peak(1, d_max, u_max), peak(1, longest["duration"], longest["num_tokens"]))
            entry = {"one_utterance_of_largest_bucket": one, "limit_bytes": limit, "sized_bytes": sized,
                     "constant_bytes": memory_model.coef[0], "ddp_buckets_bytes": buckets,
                     "world_size": world if strategy == "fsdp" else None}
            schemes = {  # each scheme on its own: A (no TPS filter) can fail where B-D hold the filtered data
                "A": lambda: largest_batch_duration(examples, bins_1d, peak, sized, args.seed),
                "B": lambda: largest_batch_duration(examples, bins_1d, peak, sized, args.seed, max_tps=bins_1d.max_tps),
                "C": lambda: run_epoch(examples, bins_1d, args.seed, max_tps=bins_1d.max_tps, batch_sizes=model_sizes(
                    memory_model, bucket_shapes(bins_1d, features, dec_max_len), sized)),
                "D": lambda: run_epoch(examples, bins_2d, args.seed, max_tps=bins_2d.max_tps, batch_sizes=model_sizes(
                    memory_model, bucket_shapes(bins_2d, features, dec_max_len), sized))}
            summary, reasons = {}, {}
            for k, scheme in schemes.items():
                try:
                    run = scheme()
                except (ValueError, MemoryBudgetError) as e:  # one utterance of its largest bucket is over the limit
                    reasons[k] = str(e)
                    continue
                run = (run["batches"], run["stats"]) if isinstance(run, dict) else run
                summary[k] = scheme_summary(*run, peak, limit, sized)
            mean = {k: summary[k]["mean_batch"] if k in summary else None for k in schemes}
            entry.update(fits=not reasons, fits_scheme={k: k in summary for k in schemes}, not_fit_reasons=reasons,
                         mean_batch=mean,
                         ratios={f"{k}/A": mean[k] / mean["A"] if mean[k] and mean["A"] else None for k in "BCD"},
                         max_memory={k: v["max_memory"] for k, v in summary.items()},
                         over_limit={k: v["over_limit"] for k, v in summary.items()})
            result.setdefault(gb, {})[strategy] = entry
            log(f"{gb} {strategy}: mean batch {mean}")
            ratio = entry["ratios"]
            rows.append([gb, strategy if strategy == "ddp" else f"fsdp/{world}", format_bytes(memory_model.coef[0]),
                         format_bytes(one)] + [f"{mean[k]:.1f}" if mean[k] else "no fit" for k in "ABCD"]
                        + [f"{ratio[k]:.2f}x" if ratio[k] else "-" for k in ("C/A", "D/A")])
    print(f"\n{args.scale}: mean batch size per rank, schemes A-D (bf16, simulated CUDA, margin {args.margin:.0%})")
    print_table([("device", ">7"), ("strategy", "<8"), ("constant", ">9"), ("B=1 largest", ">11"), ("A", ">6"),
                 ("B", ">6"), ("C", ">6"), ("D", ">6"), ("C/A", ">6"), ("D/A", ">6")], rows)
    log(f"{time.time() - t_start:.0f} s")
    print_json({Path(args.scale).stem: result})


def confirm(preset: AEDConfig, worst: dict, frames) -> list:
    """Runs every scheme's worst predicted batches as simulated steps (simulated_step, the step `fit`
    fits the memory model to): [{scheme, B, T, U, predicted, simulated, error}]."""
    rows = []
    with SimulatedDevice():
        step = simulated_step(preset)
        for scheme, shapes in worst.items():
            for n, d, t, predicted in shapes:
                t0 = time.time()
                simulated = step.peak(n, frames(d), t)
                rows.append({"scheme": scheme, "B": n, "T": frames(d), "U": t, "predicted": predicted,
                             "simulated": simulated, "error": predicted / simulated - 1})
                log(f"confirm {scheme}: batch {n} x {d:.2f} s x {t} tokens: predicted {format_bytes(predicted)}, "
                    f"simulated {format_bytes(simulated)} ({100 * rows[-1]['error']:+.1f}%) [{time.time() - t0:.0f} s]")
    return rows


def scale(args) -> None:
    t_start = time.time()
    cfg = load_train_config(args.scale)
    features, dec_max_len = cfg.features, cfg.model.dec_max_len
    fitted = json.loads(Path(args.memory_model).read_text())
    memory_model = MemoryModel.from_dict(fitted["model"], where=f"{args.memory_model}: model")
    device = parse_bytes(args.device_memory)
    limit = allocated_limit(device, args.margin)
    # Batches are sized to the limit less the model's worst under-estimate on held-out steps, so
    # that what it places at the limit stays under it as a simulated step.
    sized = limit * (1 - max(0.0, -min(fitted["errors"]["held_out"])))

    def frames(d):
        return num_frames(round(d * features.sample_rate), features.hop_length)

    def peak(n, d, t):
        return memory_model.predict(n, frames(d), t)

    corpus = paper_corpus(args.synthetic, args.seed)
    examples = [e for e in corpus if e["num_tokens"] <= dec_max_len]  # train.py drops longer ones
    durs, toks = [e["duration"] for e in examples], [e["num_tokens"] for e in examples]
    log(f"{args.scale}: {memory_model}; limit {format_bytes(limit)} of {format_bytes(device)}, batches sized to "
        f"{format_bytes(sized)}; "
        f"{len(examples)} of {len(corpus)} examples fit dec_max_len={dec_max_len}")
    bins_1d = estimate_bins(durs, toks, args.buckets, 1)
    bins_2d = estimate_bins(durs, toks, args.buckets, 2, method="equal")

    tuned_a = largest_batch_duration(examples, bins_1d, peak, sized, args.seed)
    log(f"A: batch_duration {tuned_a['max_duration']:.1f} s ({tuned_a['trials']} epochs)")
    tuned_b = largest_batch_duration(examples, bins_1d, peak, sized, args.seed, max_tps=bins_1d.max_tps)
    log(f"B: batch_duration {tuned_b['max_duration']:.1f} s ({tuned_b['trials']} epochs)")
    at_a = run_epoch(examples, bins_1d, args.seed, max_duration=tuned_a["max_duration"], max_tps=bins_1d.max_tps)[0]
    tps_peak_reduction = 1 - memory_of(at_a, peak).max() / memory_of(tuned_a["batches"], peak).max()
    sizes_c = model_sizes(memory_model, bucket_shapes(bins_1d, features, dec_max_len), sized)
    sizes_d = model_sizes(memory_model, bucket_shapes(bins_2d, features, dec_max_len), sized)
    runs = {"A": (tuned_a["batches"], tuned_a["stats"]), "B": (tuned_b["batches"], tuned_b["stats"]),
            "C": run_epoch(examples, bins_1d, args.seed, batch_sizes=sizes_c, max_tps=bins_1d.max_tps),
            "D": run_epoch(examples, bins_2d, args.seed, batch_sizes=sizes_d, max_tps=bins_2d.max_tps)}
    summary = {k: scheme_summary(*run, peak, limit, sized) for k, run in runs.items()}
    buckets = {k: per_bucket(run[0], peak, limit, (bins_2d if k == "D" else bins_1d).num_buckets)
               for k, run in runs.items()}
    sizes_1d = {"A": BucketingSampler([], bins_1d, max_duration=tuned_a["max_duration"], rank=0, world_size=1).sizes,
                "B": BucketingSampler([], bins_1d, max_duration=tuned_b["max_duration"], rank=0, world_size=1).sizes,
                "C": sizes_c}

    worst = {k: [(n, d, t, peak(n, d, t)) for n, d, t in
                 sorted({b[1:] for b in batches}, key=lambda s: -peak(*s))[:args.confirm]]
             for k, (batches, _) in runs.items()}
    confirmed = confirm(AEDConfig.from_yaml(args.scale), worst, frames) if args.confirm else []

    print(f"\n{args.scale}: 1D, {bins_1d.num_buckets} buckets; batch size / most memory (% of limit) per bucket")
    columns = [("bucket", ">6"), ("<= s", ">6.2f"), ("max tps", ">7.2f")]
    for k in ("A", "B", "C"):
        columns += [("|", ""), (f"{k}: size", ">7"), ("batches", ">7"), ("max %", ">6.1f")]
    print_table(columns, [[b, d, bins_1d.max_tps[b]] + [x for k in ("A", "B", "C") for x in
                          ("|", sizes_1d[k][b], buckets[k][b][0], 100 * buckets[k][b][1])]
                          for b, (d, _) in enumerate(bins_1d.buckets())])
    print(f"\n2D, {bins_2d.num_buckets} buckets: D")
    print_table([("bucket", ">6"), ("<= s", ">6.2f"), ("<= tok", ">6"), ("|", ""), ("D: size", ">7"),
                 ("batches", ">7"), ("max %", ">6.1f")],
                [[b, d, t, "|", sizes_d[b], buckets["D"][b][0], 100 * buckets["D"][b][1]]
                 for b, (d, t) in enumerate(bins_2d.buckets())])
    print()
    names = {"A": f"A 1D, M={tuned_a['max_duration']:.0f} s", "B": f"B +TPS, M={tuned_b['max_duration']:.0f} s",
             "C": "C +oom.py sizes", "D": "D +2D 30x2"}
    paper = {"A": "1x", "B": "", "C": "3.4x", "D": "5x"}
    a = summary["A"]["mean_batch"]
    print_table([("scheme", "<20"), ("mean batch", ">10.1f"), ("vs A", ">6"), ("paper", ">5"), ("mem mean %", ">10.1f"),
                 ("mem max %", ">9.1f"), ("over", ">4"), ("audio pad %", ">11.1f"), ("text pad %", ">10.1f"),
                 ("dropped", ">7")],
                [[names[k], s["mean_batch"], f"{s['mean_batch'] / a:.2f}x", paper[k], 100 * s["mean_memory"],
                  100 * s["max_memory"], s["over_limit"], 100 * s["audio_padding"], 100 * s["text_padding"],
                  sum(s["drops"].values())] for k, s in summary.items()])

    held_out = fitted["errors"]["held_out"] + [r["error"] for r in confirmed]
    validation = {"median_error": statistics.median(map(abs, held_out)), "max_underestimate": max(0.0, -min(held_out)),
                  "shapes": len(held_out), "held_out_steps": len(fitted["errors"]["held_out"]),
                  "confirmed_steps": len(confirmed),
                  "confirmed_over_limit": sum(r["simulated"] > limit for r in confirmed)}
    print(f"TPS filter at A's batch_duration: peak memory {100 * tps_peak_reduction:.1f}% lower (paper: 20%); "
          f"memory model vs simulated steps it was not fitted on ({len(held_out)}): median |error| "
          f"{100 * validation['median_error']:.1f}%, largest under-estimate "
          f"{100 * validation['max_underestimate']:.1f}%; worst batches over the limit as simulated steps: "
          f"{validation['confirmed_over_limit']} of {len(confirmed)}; {time.time() - t_start:.0f} s")
    print_json({
        "preset": args.scale, "memory_model": args.memory_model, "device_bytes": device, "limit_bytes": limit,
        "sized_bytes": sized,
        "margin": args.margin, "examples": len(examples), "generated": len(corpus), "seed": args.seed,
        "ratios": {k: summary[k[0]]["mean_batch"] / a for k in ("B/A", "C/A", "D/A")}, "paper": PAPER,
        "tps_peak_reduction": tps_peak_reduction,
        "over_limit_batches": {k: s["over_limit"] for k, s in summary.items()},
        "validation": validation, "confirmed": confirmed, "schemes": summary,
        "batch_duration": {"A": tuned_a["max_duration"], "B": tuned_b["max_duration"],
                           "A_fails_at": tuned_a["fails_at"], "B_fails_at": tuned_b["fails_at"]},
        "sizes": {**sizes_1d, "D": sizes_d}, "bins_1d": bins_1d.to_dict(), "bins_2d": bins_2d.to_dict(),
        "seconds": time.time() - t_start})


# --- the small-scale table: every number from a real CPU step ----------------------------------------


def small(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    show_library_logs()
    t_start = time.time()

    ex = synthetic_corpus(args.synthetic, args.seed)
    durs, toks = [e["duration"] for e in ex], [e["num_tokens"] for e in ex]
    bins_1d = estimate_bins(durs, toks, args.buckets, 1)
    bins_2d = estimate_bins(durs, toks, args.buckets, 2, method="equal")  # the paper's 2D bins
    features = FeatureConfig(n_mels=args.n_mels)
    model = random_aed(args, args.enc_layers, args.dec_layers, seed=args.seed, n_mels=args.n_mels,
                       vocab_size=args.vocab_size, dec_max_len=512).train()
    cfg = model.cfg
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = TrainingStep(model, optimizer)
    budget = parse_bytes(args.budget)
    limit = int(budget * (1 - args.margin))
    n_params = count_parameters(model)
    log(f"model {n_params / 1e6:.1f}M parameters (d {args.d_model}, {args.enc_layers}+{args.dec_layers} layers, "
        f"{args.n_mels} mels, vocab {args.vocab_size}), limit {format_bytes(limit)}, CPU")

    # (b) 1D + oom.py, then (a) the heuristic's largest safe M from the same measurements
    shapes_1d = bucket_shapes(bins_1d, features, cfg.dec_max_len)
    t0 = time.time()
    rows_b = optimize(step, shapes_1d, limit, threshold=args.threshold)
    sizes_b, _ = make_monotone(shapes_1d, [r["batch_size"] for r in rows_b])
    seconds_b = time.time() - t0
    # n = floor(M / d) must stay <= oom.py's size in every bucket: M < (size + 1) x d everywhere.
    max_duration = min((n + 1) * d for n, (d, _, _) in zip(sizes_b, shapes_1d))
    sizes_a = [math.ceil(max_duration / d) - 1 for d, _, _ in shapes_1d]  # largest n with n x d < M
    peaks_a = preflight(step, shapes_1d, sizes_a, limit)  # raises if any bucket does not fit

    # (c) 2D 30x2 + oom.py
    shapes_2d = bucket_shapes(bins_2d, features, cfg.dec_max_len)
    t0 = time.time()
    rows_c = optimize(step, shapes_2d, limit, threshold=args.threshold)
    sizes_c, changes_c = make_monotone(shapes_2d, [r["batch_size"] for r in rows_c])
    seconds_c = time.time() - t0

    counts_1d = [c for row in bins_1d.counts for c in row]
    counts_2d = [c for row in bins_2d.counts for c in row]
    mean = {"a": epoch_batch(bins_1d, sizes_a), "b": epoch_batch(bins_1d, sizes_b), "c": epoch_batch(bins_2d, sizes_c)}

    bucket = [("bucket", ">6"), ("<= s", ">6.2f"), ("<= tok", ">6"), ("count", ">6"), ("|", "")]
    print(f"\n1D, {len(shapes_1d)} buckets: (a) heuristic, M < {max_duration:.1f} s of padded audio per batch; "
          "(b) oom.py")
    print_table(bucket + [("a: batch", ">8"), ("peak", ">9"), ("|", ""), ("b: batch", ">8"), ("peak", ">9"),
                          ("trials", ">6")],
                [[b, d, t, counts_1d[b], "|", sizes_a[b], format_bytes(peaks_a[b]), "|", sizes_b[b],
                  format_bytes(r["peak"]), r["trials"]] for b, ((d, _, t), r) in enumerate(zip(shapes_1d, rows_b))])
    print(f"\n2D, {len(shapes_2d)} buckets: (c) oom.py")
    print_table(bucket + [("c: batch", ">8"), ("peak", ">9"), ("trials", ">6")],
                [[b, d, t, counts_2d[b], "|", sizes_c[b], format_bytes(r["peak"]), r["trials"]]
                 for b, ((d, _, t), r) in enumerate(zip(shapes_2d, rows_c))])
    print()
    schemes = [("a", "(a) 1D heuristic", "1x"), ("b", "(b) 1D + oom.py", "3.4x"), ("c", "(c) 2D 30x2 + oom.py", "5x")]
    print_table([("scheme", "<24"), ("mean batch", ">10.1f"), ("vs (a)", ">7"), ("paper", ">6")],
                [[name, mean[key], f"{mean[key] / mean['a']:.2f}x", paper] for key, name, paper in schemes])
    total = time.time() - t_start
    print(f"search: 1D {seconds_b:.0f} s ({sum(r['trials'] for r in rows_b)} trials), 2D {seconds_c:.0f} s "
          f"({sum(r['trials'] for r in rows_c)} trials); total {total:.0f} s; monotone fixes in 2D: {len(changes_c)}")

    print_json({
        "model": {"parameters": n_params, **{k: getattr(cfg, k) for k in (
            "enc_d_model", "enc_heads", "enc_layers", "dec_layers", "n_mels", "vocab_size", "subsampling_channels")}},
        "budget_bytes": budget, "limit_bytes": limit, "threshold": args.threshold, "synthetic": args.synthetic,
        "a": {"max_duration": max_duration, "sizes": sizes_a, "peaks": peaks_a, "mean_batch": mean["a"]},
        "b": {"sizes": sizes_b, "peaks": [r["peak"] for r in rows_b], "trials": [r["trials"] for r in rows_b],
              "mean_batch": mean["b"], "seconds": seconds_b},
        "c": {"sizes": sizes_c, "peaks": [r["peak"] for r in rows_c], "trials": [r["trials"] for r in rows_c],
              "mean_batch": mean["c"], "seconds": seconds_c, "monotone_fixes": changes_c},
        "ratios": {"b/a": mean["b"] / mean["a"], "c/a": mean["c"] / mean["a"]}, "paper": {"b/a": 3.4, "c/a": 5.0},
        "targets": {"c_over_a_ge_3x": mean["c"] / mean["a"] >= 3.0}, "seconds": total})


# --- fit and validate: the memory simulator and the memory model at the paper's scale -----------------

# (seconds of audio, tokens per second, seconds in the batch): 0.5-40 s, 3-25 tokens/s, batches of
# 500 or 900 s (Canary-1B fills 80 GiB near 900 s), and long-transcript outliers at 45-80 tokens/s
# (e2 --scale's workload has them, up to the decoder's dec_max_len) in smaller batches.
FIT = [(1, 12, 900), (4, 4, 500), (4, 20, 900), (10, 8, 500), (10, 25, 900), (20, 3, 900), (20, 12, 500),
       (30, 8, 900), (40, 4, 500), (40, 12, 900), (10, 50, 400), (20, 45, 500)]
HELD_OUT = [(2, 8, 700), (15, 15, 700), (25, 6, 700), (35, 10, 700), (6, 80, 400), (15, 60, 450)]
FRAMES_PER_SECOND = 100  # 10 ms hop


def shape(d, tps, seconds, max_tokens):
    return max(1, int(seconds // d)), d * FRAMES_PER_SECOND + 1, max(2, min(max_tokens, round(d * tps)))


def fit(args):
    cfg = AEDConfig.from_yaml(args.config)
    steps = []
    t0 = time.time()
    with fake_world(args.world_size) if args.strategy == "fsdp" else nullcontext(), SimulatedDevice():
        step = simulated_step(cfg, args.strategy, args.world_size, args.activation_checkpointing)
        for name, shapes in (("fit", FIT), ("held_out", HELD_OUT)):
            for d, tps, seconds in shapes:
                B, T, U = shape(d, tps, seconds, cfg.dec_max_len)
                t = time.time()
                peak = step.peak(B, T, U)
                steps.append({"set": name, "B": B, "T": T, "U": U, "peak": peak, "seconds": time.time() - t})
                print(json.dumps(steps[-1]), flush=True)
    samples = {s: [(x["B"], x["T"], x["U"], x["peak"]) for x in steps if x["set"] == s] for s in ("fit", "held_out")}
    mm = MemoryModel.fit(samples["fit"])
    errors = {s: mm.relative_errors(samples[s]) for s in samples}
    out = {"config": args.config, "strategy": args.strategy, "world_size": args.world_size if args.strategy == "fsdp"
           else None, "activation_checkpointing": args.activation_checkpointing, "model": mm.to_dict(), "steps": steps, "errors": errors,
           "held_out_max_abs_error": max(map(abs, errors["held_out"])), "seconds": time.time() - t0}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(mm)
    print(json.dumps({k: out[k] for k in ("errors", "held_out_max_abs_error", "seconds")}))


TINY = dict(n_mels=24, vocab_size=40, pad_id=1, enc_d_model=32, enc_layers=2, enc_heads=4, subsampling_channels=8,
            dec_d_model=48, dec_layers=2, dec_heads=4, dec_max_len=512)
SMALL = dict(n_mels=80, vocab_size=256, pad_id=1, enc_d_model=128, enc_layers=4, enc_heads=2, subsampling_channels=32,
             dec_d_model=128, dec_layers=4, dec_heads=2, dec_max_len=512)
# (name, model dims, objective, precision, [(B, T frames, U tokens)]): short, long, long-transcript.
CASES = [("tiny", TINY, "aed", "fp32", [(8, 201, 10), (4, 1001, 40), (4, 401, 200)]),
         ("tiny", TINY, "aed", "bf16", [(8, 201, 10), (4, 1001, 40), (4, 401, 200)]),
         ("small", SMALL, "aed", "bf16", [(4, 501, 30), (2, 2001, 100), (4, 501, 250)]),
         ("tiny", TINY, "rnnt", "fp32", [(8, 201, 10), (4, 1001, 40), (4, 401, 100)]),
         ("small", SMALL, "rnnt", "fp32", [(4, 501, 30), (2, 1001, 60)])]  # bf16: oneDNN's CPU LSTM fails


def build(dims, objective):
    torch.manual_seed(0)
    cfg = AEDConfig(**dims)
    model = AED(cfg) if objective == "aed" else TransducerASR(cfg, cfg.vocab_size - 2, 4, pred_dim=64, joint_dim=64)
    return model.train()


def validate(args):
    rows = []
    for name, dims, objective, precision, shapes in CASES:
        def steps():
            model = build(dims, objective)
            return TrainingStep(model, build_optimizer(model, OptimConfig()), precision,
                                text_vocab_size=dims["vocab_size"] - 2)
        real = steps()
        real.warm_up(101, 5)
        measured = [real.peak(*s) for s in shapes]
        with SimulatedDevice():
            sim = steps()
            sim.warm_up(101, 5)
            simulated = [sim.peak(*s) for s in shapes]
        for s, m, p in zip(shapes, measured, simulated):
            rows.append({"model": name, "objective": objective, "precision": precision, "B": s[0], "T": s[1],
                         "U": s[2], "measured": m, "simulated": p, "error": p / m - 1})
            print(json.dumps(rows[-1]), flush=True)
    errors = [r["error"] for r in rows]
    summary = {"median_error": statistics.median(map(abs, errors)), "max_underestimate": max(0.0, -min(errors)),
               "max_overestimate": max(0.0, max(errors))}
    Path(args.out).write_text(json.dumps({"rows": rows, **summary}, indent=1))
    print(f"{'model':>6} {'obj':>5} {'prec':>5} {'B':>3} {'T':>5} {'U':>4} {'measured':>10} {'simulated':>10} {'error':>7}")
    for r in rows:
        print(f"{r['model']:>6} {r['objective']:>5} {r['precision']:>5} {r['B']:>3} {r['T']:>5} {r['U']:>4} "
              f"{r['measured'] / 1e6:>8.2f}MB {r['simulated'] / 1e6:>8.2f}MB {100 * r['error']:>+6.2f}%")
    print(json.dumps(summary))


FSDP_SHAPES = [(8, 201, 10), (4, 1001, 40), (4, 401, 200)]  # (B, T, U): short, long, long-transcript
RSS_SHAPE = (8, 2001, 40)  # a step large enough (~0.1 GB) for the process RSS to resolve


def fsdp_step(world_size: int, precision: str) -> TrainingStep:
    """The tiny AED sharded over `world_size` ranks (a real or a fake process group): fp32, or bf16
    as on CUDA (bf16 parameters gathered, fp32 shards and reductions, bf16 autocast)."""
    model = build(TINY, "aed")
    shard(model, torch.device("cpu"), world_size, precision, bf16_params=precision == "bf16")
    step = TrainingStep(model, build_optimizer(model, OptimConfig()), precision, text_vocab_size=TINY["vocab_size"] - 2)
    step.warm_up(101, 5)
    return step


def fsdp_rank(args):
    """Under torchrun (gloo), for each precision: FSDP_SHAPES measured on a real world; rank 0
    writes them, and its RSS growth over one RSS_SHAPE step next to the tracker's count of it."""
    dist.init_process_group("gloo")
    results = {}
    for precision in args.precision:
        step = fsdp_step(dist.get_world_size(), precision)
        measured = [step.peak(*s) for s in FSDP_SHAPES]
        step.optimizer.zero_grad(set_to_none=True)
        reset_peak_rss()  # so that the step's peak is the highest since
        before = proc_status_bytes("VmRSS")
        with LiveTensorMemory() as mem:  # counts what the step allocates, as RSS growth does
            step.run(*RSS_SHAPE)
        rss = {"tracked": mem.peak, "rss_growth": proc_status_bytes("VmHWM") - before}
        results[precision] = {"measured": measured, "rss": rss}
        del step
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"world_size": dist.get_world_size(), "precisions": results}))
    dist.destroy_process_group()


def validate_fsdp(args):
    real = Path(args.out).with_suffix(".real.json")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}  # RSS: see aed/memory_measure.py
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                    str(args.world_size), __file__, "fsdp-rank", "--out", str(real), "--precision", *args.precision],
                   env=env, check=True)
    real_world = json.loads(real.read_text())["precisions"]
    out = {"world_size": args.world_size, "precisions": {}}
    for precision in args.precision:
        with fake_world(args.world_size), SimulatedDevice():  # one step for every shape, as each rank runs them
            step = fsdp_step(args.world_size, precision)
            simulated = [step.peak(*s) for s in FSDP_SHAPES]
        rows = [{"B": B, "T": T, "U": U, "measured": m, "simulated": p, "error": p / m - 1}
                for (B, T, U), m, p in zip(FSDP_SHAPES, real_world[precision]["measured"], simulated)]
        out["precisions"][precision] = {"rows": rows, "rss": real_world[precision]["rss"],
                                        "max_abs_error": max(abs(r["error"]) for r in rows)}
        for r in rows:
            print(f"FSDP {precision} rank 0 of {args.world_size}: B {r['B']} T {r['T']} U {r['U']}: "
                  f"measured {r['measured']} B, simulated {r['simulated']} B ({100 * r['error']:+.2f}%)")
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


# (B, T frames, U tokens) at a 1B preset's scale: 32 x 5 s, 8 x 20 s with a long transcript, 4 x 40 s.
CUDA_SHAPES = [(32, 501, 60), (8, 2001, 240), (4, 4001, 160)]


def validate_cuda(args):
    """A preset's real bf16 steps on a CUDA device, on one device and under a real
    DistributedDataParallel (nccl, world size 1: its gradient buckets do not depend on the world
    size), against the simulated step the fits are made of (plus cuBLAS's workspace, which
    max_memory_allocated counts) and that step plus the constant the E2 table's DDP rows add. DDP's
    second step, where it rebuilds its buckets, is measured apart: the constant is the later steps'."""
    if not torch.cuda.is_available():
        raise SystemExit("validate-cuda: torch sees no CUDA GPU (it measures real steps on one: ~32 GB for canary-1b)")
    cfg = AEDConfig.from_yaml(args.config)
    torch.manual_seed(0)
    model = AED(cfg).train().cuda()
    one_device = TrainingStep(model, build_optimizer(model, OptimConfig()), "bf16")
    one_device.warm_up(101, 10)
    measured = [one_device.peak(*s) for s in CUDA_SHAPES]
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("nccl", init_method=f"file://{store}/store", rank=0, world_size=1)
        try:
            ddp = TrainingStep(DistributedDataParallel(model), one_device.optimizer, "bf16")
            ddp.peak(*CUDA_SHAPES[0])  # buckets in parameter order; the backward records the order gradients come in
            rebuild = ddp.peak(*CUDA_SHAPES[0])  # the second step rebuilds the buckets in that order, once
            measured_ddp = [ddp.peak(*s) for s in CUDA_SHAPES]
        finally:
            dist.destroy_process_group()
    buckets = sum(p.numel() * p.element_size() for p in model.parameters())
    rebuild_extra = (rebuild - measured_ddp[0]) / buckets  # gradient copies past the steady state's one
    with SimulatedDevice():
        step = simulated_step(cfg)
        simulated = [step.peak(*s) + CUBLAS_WORKSPACE for s in CUDA_SHAPES]
    rows = [{"B": B, "T": T, "U": U, "measured": m, "simulated": p, "error": p / m - 1, "measured_ddp": md,
             "simulated_ddp": p + buckets, "error_ddp": (p + buckets) / md - 1, "ddp_minus_one_device": md - m}
            for (B, T, U), m, p, md in zip(CUDA_SHAPES, measured, simulated, measured_ddp)]
    print(f"{args.config} on {torch.cuda.get_device_name()}, GB (simulated / measured - 1); DDP's buckets "
          f"{buckets / 1e9:.2f} GB")
    print(f"{'B x T x U':>16} {'one device':>11} {'simulated':>16} {'DDP':>7} {'simulated':>16} {'DDP - one':>10}")
    for r in rows:
        print(f"{r['B']:>4} x {r['T']:>4} x {r['U']:>3} {r['measured'] / 1e9:>11.2f} "
              f"{r['simulated'] / 1e9:>7.2f} ({100 * r['error']:+5.1f}%) {r['measured_ddp'] / 1e9:>7.2f} "
              f"{r['simulated_ddp'] / 1e9:>7.2f} ({100 * r['error_ddp']:+5.1f}%) "
              f"{r['ddp_minus_one_device'] / 1e9:>10.2f}")
    print(f"DDP's second step (buckets rebuilt) at {CUDA_SHAPES[0]}: {rebuild / 1e9:.2f} GB, "
          f"{rebuild_extra:+.2f} x the buckets over the later steps")
    out = {"config": args.config, "device": torch.cuda.get_device_name(), "ddp_buckets": buckets, "rows": rows,
           "ddp_rebuild_step": rebuild, "ddp_rebuild_extra_buckets": rebuild_extra}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


def e2_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--synthetic", type=int, default=100_000, help="examples in the synthetic corpus")
    p.add_argument("--margin", type=float, default=0.1)
    p.add_argument("--buckets", type=int, default=30, help="duration buckets (2D: x2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", metavar="PRESET", help="E2 at the paper's scale for this preset (configs/canary-1b.yaml)")
    p.add_argument("--memory-model", help="--scale: the preset's fit (the fit mode's --out)")
    p.add_argument("--device-memory", default="80GiB", help="--scale: the simulated CUDA device (with "
                   "--fsdp-memory-model: a comma-separated list, e.g. 24GiB,48GiB,80GiB)")
    p.add_argument("--fsdp-memory-model", help="--scale: FSDP's fit (fit --strategy fsdp): "
                   "the schemes per --device-memory, DDP (--memory-model) vs FSDP")
    p.add_argument("--confirm", type=int, default=0, help="--scale: run every scheme's K worst batches as simulated "
                   "steps (tens of seconds to minutes each)")
    p.add_argument("--budget", default="220MB", help="small scale: memory budget; steps must fit it minus --margin")
    p.add_argument("--threshold", type=float, default=0.05)
    add_width_args(p, d_model=64, subsampling_channels=16, heads=1)
    p.add_argument("--enc-layers", type=int, default=4)
    p.add_argument("--dec-layers", type=int, default=4)
    p.add_argument("--n-mels", type=int, default=80)
    p.add_argument("--vocab-size", type=int, default=320)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def e2(args) -> None:
    if args.scale:
        if not args.memory_model:
            raise SystemExit("--scale needs --memory-model (bench/oom_bench.py fit PRESET --out FIT.json)")
        torch.set_num_threads(args.threads or 1)
        strategy_grid(args) if args.fsdp_memory_model else scale(args)
    else:
        small(args)


def one_thread(run):
    """`run` with one torch thread, as the simulator's modes run."""
    return lambda args: (torch.set_num_threads(1), run(args))


def preset_flags(p: argparse.ArgumentParser) -> None:
    """validate-cuda's flags, with which fit's begin."""
    p.add_argument("config")
    p.add_argument("--out", required=True)


def fit_flags(p: argparse.ArgumentParser) -> None:
    preset_flags(p)
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default=None, help="default: one device, no data parallelism")
    p.add_argument("--world-size", type=int, default=8, help="--strategy fsdp: ranks the model is sharded over")
    p.add_argument("--activation-checkpointing", choices=["none", "encoder", "decoder", "both"], default="none",
                   help="train.py's activation_checkpointing: layers recomputed in backward")


def fsdp_flags(p: argparse.ArgumentParser, world_size: int | None = 2) -> None:
    """validate-fsdp's flags (world_size: --world-size's default), and its worker's (None: no --world-size)."""
    p.add_argument("--out", required=True)
    if world_size:
        p.add_argument("--world-size", type=int, default=world_size)
    p.add_argument("--precision", choices=["fp32", "bf16"], nargs="+", default=["fp32"])


MODES = {  # name: (its flags, its run, what it measures)
    "e2": (e2_flags, e2, "mean batch size under one memory limit, heuristic vs per-bucket sizes (E2)"),
    "fit": (fit_flags, one_thread(fit), "fit a memory model to simulated steps of a preset"),
    "validate": (lambda p: p.add_argument("--out", required=True), one_thread(validate),
                 "simulated vs measured peaks of real CPU steps"),
    "validate-fsdp": (fsdp_flags, one_thread(validate_fsdp), "simulated vs measured peaks of a real 2-rank FSDP step"),
    "validate-cuda": (preset_flags, one_thread(validate_cuda),
                      "simulated vs measured peaks of a preset's real steps on a CUDA device, one device and DDP"),
    "fsdp-rank": (lambda p: fsdp_flags(p, None), one_thread(fsdp_rank), "(validate-fsdp's torchrun worker)"),
}


def main(argv: list[str] | None = None) -> None:
    run_modes(__doc__, MODES, "e2", argv)


if __name__ == "__main__":
    main()
