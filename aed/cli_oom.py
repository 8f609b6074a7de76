"""OOMptimizer: the largest batch size of every 2D bucket, found by running real training steps.

    python oom.py --config configs/canary-1b-flash.yaml --bins bins.json -o batch_sizes.json   # GPU: 90%
    python oom.py --config configs/tiny.yaml --bins bins.json --memory-budget 4GB -o batch_sizes.json
    python train.py configs/canary-1b-flash.yaml train.bins=bins.json train.batch_sizes=batch_sizes.json
    python oom.py --config configs/canary-1b.yaml --bins bins.json --simulate-memory 80GiB --memory-model -o bs.json
    python oom.py --config run.yaml --manifest train.jsonl --out buckets.yaml [--simulate-memory 80GiB --memory-model]
    python oom.py --config configs/canary-1b.yaml --bins bins.json --strategy fsdp --world-size 8 \
        --simulate-memory 24GiB --memory-model -o bs.json      # one rank of FSDP over 8 GPUs
    python train.py run.yaml buckets.yaml
    aed-oom --config run.yaml --manifest train.jsonl --out buckets.yaml      # installed (pip install .)

One command from manifests to a training config (--out): without --bins, bins are estimated from
--manifest (default: the config's train.manifests) with the training tokenizer and prompt, the
config's train.num_buckets / sub_buckets / bin_method, leaving out what exceeds model.dec_max_len
(aed/train_data.py, as tools/estimate_bins.py); each duration bin's TPS filter (bins.max_tps,
outliers past 4 standard deviations) bounds the search's token counts and is written as
train.max_tps, so training drops the same outliers; the batch sizes go to -o (default: next to
--out) and --out is a YAML fragment (train.batch_sizes, train.max_tps, train.manifests when
--manifest is given) that train.py merges over the config when given after it.

--simulate-memory sizes a CUDA device of that size on a CPU: the same step on fake tensors
(aed/memory_measure.py). A 1B-parameter fake step takes 15-90 s, so --memory-model fits peak
memory as a low-order function of (B, T, U) to --fit-steps steps (aed/memory_oomptimizer.py), takes every
bucket's size from it and measures --verify buckets at their answer.

The search itself is aed/memory_oomptimizer.py: every bucket's largest batch, found by running train.py's
own training step (built by aed/train_setup.py from the same config) on an artificial batch at
the bucket's bounds, doubling and bisecting. Steps must fit the budget minus a safety margin (10%)
for what an artificial step does not see: allocator fragmentation, pinned loader buffers,
validation decoding. Writes `bins.save_batch_sizes`'s format and prints a table.

--strategy says how the ranks of the training share the work (train.strategy), and so what one
device holds: without it, one process on one device; ddp (or --ddp) adds DDP's gradient buckets,
one more copy of the gradients (and warns when the margin cannot hold a second copy, which DDP's
second step may hold once while it rebuilds them); fsdp shards the model as train.py would
(aed/train_distributed.py) over a fake process group of --world-size ranks (aed/memory_measure.py
`fake_world`: collectives move no data) and measures rank 0: parameters, gradients and AdamW
state divided by the world size, plus whatever FSDP gathers and reduces a layer or two at a time,
by running its real step, not a formula. On a real device that too is one process: one GPU sizes
a rank of an 8-GPU FSDP run. A config with ema_decay adds its EMA of the weights (aed/train_setup.py):
one more fp32 copy of the trainable parameters, of this rank's shards under fsdp.
"""

import argparse
import logging
import os
import sys
import time
from contextlib import nullcontext

import torch
import yaml

from aed.config import ConfigError
from aed.memory_measure import CUDA_BLOCK, SimulatedDevice, fake_world, format_bytes
from aed.memory_oomptimizer import (MemoryBudgetError, TrainingStep, fit_memory_model, make_monotone, memory_limit,
                                    optimize, optimize_with_model, warn_ddp_rebuild)
from aed.train_data import bins_from_config
from aed.train_setup import AMP_DTYPES, ExponentialMovingAverage, load_training_setup
from bins import Bins, save_batch_sizes

log = logging.getLogger(__name__)


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
    p.add_argument("--manifest", action="append", help="without --bins: estimate bins from this train.manifests "
                   "entry (repeat): a path or a YAML mapping such as '{shar: DIR}'")
    p.add_argument("--sample", type=int, default=None, help="without --bins: estimate from this many lines")
    p.add_argument("-o", "--output", help="batch sizes JSON for train.batch_sizes (default: next to --out)")
    p.add_argument("--out", help="YAML fragment for train.py (train.batch_sizes, train.max_tps, train.manifests)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--memory-budget", help="memory the training may use, e.g. 20GB (CPU: live tensor bytes)")
    budget.add_argument("--memory-fraction", type=float, default=0.9,
                        help="budget as a fraction of the device's memory (CPU: of the RAM)")
    budget.add_argument("--simulate-memory", metavar="SIZE",
                        help="simulate a CUDA device of this size (e.g. 80GB) with fake tensors on the CPU "
                        "(aed/memory_measure.py); the margin covers what the simulation does not model")
    p.add_argument("--margin", type=float, default=0.1, help="safety margin: steps must fit budget x (1 - margin)")
    p.add_argument("--memory-model", action="store_true",
                   help="fit a memory model to --fit-steps steps and take every bucket's size from it "
                   "(aed/memory_oomptimizer.py), instead of bisecting every bucket with steps")
    p.add_argument("--fit-steps", type=int, default=12, help="--memory-model: steps to fit on")
    p.add_argument("--verify", type=int, default=4, help="--memory-model: buckets measured at their answer")
    p.add_argument("--dtype", choices=list(AMP_DTYPES), default=None, help="precision (default: the config's)")
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default=None,
                   help="multi-GPU training's train.strategy: ddp adds its gradient buckets; fsdp measures one rank "
                   "of a model sharded over --world-size ranks (default: one device, no data parallelism)")
    p.add_argument("--ddp", action="store_const", const="ddp", dest="strategy", help="same as --strategy ddp")
    p.add_argument("--world-size", type=int, default=8, help="--strategy fsdp: ranks the model is sharded over")
    p.add_argument("--threshold", type=float, default=0.05, help="stop when fit and failure are this close")
    p.add_argument("--start-batch-size", type=int, default=16, help="first trial of the largest bucket")
    p.add_argument("--max-tps", type=float, default=None,
                   help="1D bins: tokens/s that bound each bucket's tokens (default: bins.max_tps)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.strategy == "fsdp" and args.world_size < 2:
        p.error("--strategy fsdp needs --world-size of 2 or more (one rank shards nothing)")
    if not (args.output or args.out):
        p.error("give -o (batch sizes JSON) or --out (a YAML fragment for train.py), or both")
    if args.bins and args.manifest:
        p.error("--manifest estimates bins: give it or --bins, not both")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    output = args.output or os.path.splitext(args.out)[0] + ".batch_sizes.json"
    try:
        bins, manifests = (None, None) if args.bins else bins_from_config(args.config, args.manifest, args.sample)
    except (ConfigError, OSError, ValueError) as e:
        raise SystemExit(f"oom.py: {args.config}: {e}") from None

    simulated = args.simulate_memory is not None
    device = torch.device("cpu" if simulated else args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    fsdp = args.strategy == "fsdp"
    strategy = [f"train.strategy={args.strategy}"] if args.strategy else []  # fsdp: training_setup shards
    # The fake world first: FSDP's mesh is built from the process group, and the model on fake tensors.
    with fake_world(args.world_size) if fsdp else nullcontext(), SimulatedDevice() if simulated else nullcontext():
        setup = load_training_setup(args.config, device, args.dtype, strategy, simulated=simulated)
        model, precision = setup.model, setup.precision
        try:
            bins = bins or Bins.load(args.bins)
            shapes = setup.bucket_shapes(bins, args.max_tps)
            total, budget_bytes, limit = memory_limit(device, args.margin, args.memory_budget, args.memory_fraction,
                                                      args.simulate_memory)
        except (OSError, ValueError) as e:
            raise SystemExit(f"oom.py: {e}") from None
        if device.type == "cuda":  # real OOMs at the limit, like a GPU that is this size
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        parallel = {"ddp": " + DDP buckets", "fsdp": f", FSDP rank 0 of {args.world_size}", None: ""}[args.strategy]
        # made here, inside the simulation: on fake tensors (and sharded) like the parameters it copies
        ema = ExponentialMovingAverage(model, setup.cfg.ema_decay) if setup.cfg.ema_decay else None
        log.info("model %.1fM parameters, %s%s, %s%s%s; budget %s -> limit %s (margin %.0f%%); %d buckets",
                 sum(p.numel() for p in model.parameters()) / 1e6, device, " (simulated CUDA)" if simulated else "",
                 precision, parallel, " + EMA of the weights" if ema else "", format_bytes(budget_bytes),
                 format_bytes(limit), 100 * args.margin, len(shapes))

        if args.strategy == "ddp":
            warn_ddp_rebuild(model, budget_bytes, args.margin)
        t0 = time.time()
        step = TrainingStep.of(setup, args.strategy == "ddp", granularity=CUDA_BLOCK if simulated else 1, ema=ema)
        try:
            if args.memory_model:
                chunk = getattr(model, "chunk_size", 0)  # a transducer computes its joint this many samples at a time
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
    where = (f"limit {format_bytes(limit)} ({precision}"
             f"{', DDP' if args.strategy == 'ddp' else f', FSDP over {args.world_size}' if fsdp else ''}"
             f"{', simulated CUDA' if simulated else ''})")
    if args.out:
        write_fragment(args.out, output, args.max_tps if args.max_tps is not None else bins.max_tps,
                       args.manifest and manifests, f"oom.py: batch sizes for {args.config}, {where}")
    print_table(rows, {b: old for b, old, _ in changes})
    print(f"{len(rows)} buckets, {sum(r['trials'] for r in rows)} trials in {time.time() - t0:.0f} s; {where} -> "
          f"{output}{' and ' + args.out if args.out else ''}")


if __name__ == "__main__":
    main()
