"""Training throughput: fixed batches vs 1D vs 2D bucketing vs 2D + oom.py batch sizes.

    python bench/train_bench.py --quick               # tiny, fixed/1D/2D, 30 steps each: ~2 min on 2 CPU cores
    python bench/train_bench.py --models tiny         # tiny, all four schemes, 60 steps each: ~4 min
    python bench/train_bench.py                       # and 30M (20 steps): ~9 min in all on 2 idle CPU cores
    python bench/train_bench.py --models 30m --steps 40 --work-dir /tmp/tb   # keep the run dirs and logs

Every scheme is a real `train.py` run (a subprocess) on the same data (the sentence part of the
bundled data/mini, 290 utterances of 0.9-4.1 s), the same model and the same number of steps,
with validation off and one checkpoint at the end. Equal steps rather than equal wall-clock:
train.py stops on max_steps, every scheme then draws the same number of batches from its batch
distribution, and the rates below are per second anyway. The schemes:

- fixed: one bucket, `train.batch_size=N`: every batch is a random mix of lengths, padded to its
  longest. N = floor(max_duration / longest utterance), the largest fixed size whose worst batch
  (N of the longest utterances) stays inside the same padded-audio budget as the bucketed schemes,
  i.e. memory-matched, not batch-matched (--fixed-batch N overrides it, e.g. to match 2D's mean);
- 1D: duration buckets (`train.sub_buckets=1`), n * d <= max_duration per bucket;
- 2D: duration x token buckets (`train.sub_buckets=2`), the same rule;
- 2D + oom.py: the 2D run's bins with per-bucket sizes from `oom.py`, whose memory budget is the
  2D scheme's own worst-bucket peak (margin 0): the same memory, larger batches where it allows.

From RUN_DIR/metrics.jsonl (log_every=1) after the first --warmup steps: mean batch size, audio
and text padding (element-weighted: 1 - sum(lengths) / sum(padded)), audio seconds and tokens
per second of wall-clock (data loading included), seconds per step, peak memory as train.py logs
it (CUDA: max allocated; CPU: process RSS, which includes ~1 GB of runtime), and ratios against
fixed. "bound" is each scheme's worst bucket, measured by aed.oomptimizer.preflight (one real step at every
bucket's bounds and batch size; CPU: live tensor bytes): the memory the scheme must provision.
"epoch batch" is the mean batch size over a whole epoch (bins.counts / sizes), which the few
measured steps only sample.

--quick leaves out what costs minutes on a CPU: the oom.py search (~70 measured steps for 12
buckets, 5 min for the tiny model on a busy 2-core machine) and the "bound" measurements.

CPU training uses train.py's thread rule (cores - loader workers; OMP_NUM_THREADS to match). The
machine may be shared: the load average is printed, timings are noisy, and the ratios of padding
and batch size are more trustworthy than those of speed. The last line printed is a JSON object.
"""

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch
import yaml

from aed.model import AED, AEDConfig, count_parameters
from aed.oomptimizer import TrainingStep, preflight
from aed.training_setup import load_training_setup
from bins import Bins, load_batch_sizes
from common import (ROOT, cores, epoch_batch, load_avg, log, max_duration_sizes, print_json, print_table,
                    read_metrics, run_script, step_totals, write_config)
from oom import device_memory

# name -> (model overrides of configs/tiny.yaml, default steps). 30m: Canary-1B-Flash's shape
# (deep encoder, 4-layer decoder) at 256 wide: 30.0M parameters with the mini vocabulary.
MODELS = {
    "tiny": ({}, 60),
    "30m": ({"enc_d_model": 256, "enc_layers": 16, "enc_heads": 4, "subsampling_channels": 128,
             "dec_d_model": 256, "dec_layers": 4, "dec_heads": 4}, 20),
}
SCHEMES = ["fixed", "1D", "2D", "2D + oom.py"]


def longest_utterance(manifests: list) -> float:
    longest = 0.0
    for spec in manifests:
        path = ROOT / (spec["path"] if isinstance(spec, dict) else spec)
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        longest = max(longest, float(json.loads(line)["duration"]))
                    except (ValueError, KeyError) as e:
                        raise SystemExit(f"{path}:{i}: no numeric 'duration' ({e!r})") from None
    return longest


def train(config: Path, run_dir: Path, steps: int, threads: int, overrides: list) -> None:
    """One train.py run; its full log goes to run_dir/train.log."""
    run_dir.mkdir(parents=True)
    run_script(["train.py", config, f"run_dir={run_dir}", f"max_steps={steps}", "log_every=1", "val.every=0",
                f"ckpt_every={steps}", "keep_last=1", f"cpu_threads={threads}", *overrides],
               run_dir / "train.log", threads)


def summarize(run_dir: Path, warmup: int) -> dict:
    """Throughput and padding over the steps after `warmup`, from metrics.jsonl (one row per step)."""
    rows = [r for r in read_metrics(run_dir) if "train/loss" in r][warmup:]
    if not rows:
        raise SystemExit(f"{run_dir / 'metrics.jsonl'}: no steps left after skipping {warmup} warm-up steps")
    seconds = sum(r["train/step_time"] for r in rows)
    totals = step_totals(rows)
    return totals | {"audio_s_per_s": totals["audio_s"] / seconds, "tokens_per_s": totals["tokens"] / seconds,
                     "step_time": seconds / len(rows)}


def bench_model(name: str, args, work: Path, device: torch.device) -> dict:
    # One YAML that both train.py and oom.py read. The paper's models train with cross-entropy alone, and
    # the sentences have more varied lengths than the digits.
    config = write_config(work / f"{name}.yaml", model={**MODELS[name][0], "ctc_weight": 0.0},
                          train={"manifests": ["data/mini/train.jsonl"]})
    doc = yaml.safe_load(config.read_text())
    steps = args.steps or (30 if args.quick else MODELS[name][1])
    max_duration = doc["train"]["max_duration"]
    workers = doc["train"]["num_workers"]
    threads = max(1, cores() - workers)  # train.py's own rule, made explicit
    fixed_n = args.fixed_batch or math.floor(max_duration / longest_utterance(doc["train"]["manifests"]))
    n_params = count_parameters(AED(AEDConfig(**doc["model"])))
    log(f"[{name}] {n_params / 1e6:.2f}M parameters, {steps} steps per scheme, {device}, "
        f"{threads} torch thread(s) + {workers} loader worker(s), max_duration {max_duration} s, fixed batch {fixed_n}")

    def bound(bins: Bins, sizes: list) -> int:
        """Worst-bucket peak of a scheme's sizes (no budget to enforce: the device's memory). The
        model lives only during the measurement, so it holds no device memory while train.py runs."""
        setup = load_training_setup(str(config), device)
        peak = max(preflight(TrainingStep.of(setup), setup.bucket_shapes(bins), sizes, device_memory(device)))
        del setup
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return peak

    results = {}
    schemes = SCHEMES[:3] if args.quick else SCHEMES
    runs = {s: work / name / s.replace(" + ", "_").replace(".", "") for s in schemes}
    overrides = {"fixed": ["train.num_buckets=1", "train.sub_buckets=1", f"train.batch_size={fixed_n}",
                           "train.max_duration=null"],
                 "1D": ["train.sub_buckets=1"], "2D": ["train.sub_buckets=2"]}
    for scheme in schemes:
        t0, load0 = time.time(), load_avg()
        log(f"[{name}] {scheme}: load average {load0}")
        if scheme == "2D + oom.py":
            # The budget is what 2D's batch sizes already need, so both schemes get the same memory.
            budget = results["2D"]["bound_bytes"]
            sizes_path = work / name / "oom_batch_sizes.json"
            t_oom = time.time()
            run_script(["oom.py", "--config", config, "--bins", runs["2D"] / "bins.json", "-o", sizes_path,
                        "--memory-budget", budget, "--margin", "0", "--threshold", args.oom_threshold,
                        "--device", device], work / name / "oom.log", threads=cores())
            oom_seconds = time.time() - t_oom
            overrides[scheme] = [f"train.batch_sizes={sizes_path}"]
        train(config, runs[scheme], steps, threads, overrides[scheme])
        res = summarize(runs[scheme], args.warmup)
        if scheme == "2D + oom.py":
            bins, sizes = load_batch_sizes(sizes_path)
            sizes = [s for row in sizes for s in row]
            res["oom_seconds"] = oom_seconds
        else:
            bins = Bins.load(runs[scheme] / "bins.json")
            sizes = [fixed_n] if scheme == "fixed" else max_duration_sizes(bins, max_duration)
        res.update(buckets=bins.num_buckets, sizes=sizes,
                   epoch_batch=epoch_batch(bins, sizes), load_avg=[load0, load_avg()],
                   bound_bytes=None if args.quick else bound(bins, sizes), seconds=time.time() - t0)
        results[scheme] = res
    return {"parameters": n_params, "steps": steps, "warmup": args.warmup, "threads": threads,
            "loader_workers": workers, "max_duration": max_duration, "fixed_batch": fixed_n, "schemes": results}


def print_model_table(name: str, m: dict) -> None:
    print(f"\n{name}: {m['parameters'] / 1e6:.1f}M parameters, {m['steps']} steps per scheme, first "
          f"{m['warmup']} skipped; {m['threads']} torch thread(s) + {m['loader_workers']} loader worker(s)")
    base = m["schemes"]["fixed"]
    rows = []
    for scheme, r in m["schemes"].items():
        rows.append([f"fixed {m['fixed_batch']}" if scheme == "fixed" else scheme, r["buckets"], r["batch"],
                     r["epoch_batch"], f"{r['audio_padding']:.1f}%", f"{r['text_padding']:.1f}%", r["audio_s_per_s"],
                     r["tokens_per_s"], r["step_time"], r["memory_gb"],
                     f"{r['bound_bytes'] / 1e6:.1f}" if r["bound_bytes"] else "-", "|",
                     f"{r['batch'] / base['batch']:.2f}x", f"{r['audio_s_per_s'] / base['audio_s_per_s']:.2f}x",
                     f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
                     f"{r['load_avg'][0][0]:.2f} / {r['load_avg'][1][0]:.2f}"])
    print_table([("scheme", "<12"), ("buckets", ">7"), ("batch", ">6.1f"), ("epoch batch", ">11.1f"),
                 ("pad audio", ">9"), ("pad text", ">8"), ("audio s/s", ">9.1f"), ("tok/s", ">7.0f"),
                 ("s/step", ">6.2f"), ("mem GB", ">6.2f"), ("bound MB", ">8"), ("|", ""), ("x batch", ">7"),
                 ("x audio s/s", ">11"), ("x tok/s", ">7"), ("load avg (1 min) before/after", "")], rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 30 steps, fixed/1D/2D only, no memory bounds")
    p.add_argument("--models", default=None, help=f"comma-separated, from {list(MODELS)} (default: all)")
    p.add_argument("--steps", type=int, default=None, help="steps per scheme (default: per model)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the averages")
    p.add_argument("--fixed-batch", type=int, default=None,
                   help="fixed scheme's batch size (default: memory-matched, max_duration / longest)")
    p.add_argument("--oom-threshold", type=float, default=0.1, help="oom.py --threshold (its default: 0.05)")
    p.add_argument("--work-dir", default=None, help="keep run dirs and logs here (default: a temp dir, removed)")
    args = p.parse_args()
    names = ["tiny"] if args.quick else (args.models.split(",") if args.models else list(MODELS))
    unknown = set(names) - set(MODELS)
    if unknown:
        p.error(f"--models: unknown {sorted(unknown)}, choose from {list(MODELS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(cores())  # our preflight steps run between trainings
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="train_bench_"))
    work.mkdir(parents=True, exist_ok=True)

    t0, load_start = time.time(), load_avg()
    try:
        models = {name: bench_model(name, args, work, device) for name in names}
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    for name, m in models.items():
        print_model_table(name, m)
    load_end = load_avg()
    print(f"\nload average (1, 5, 15 min) at start {load_start}, at end {load_end} on {cores()} cores: other "
          f"jobs share this machine, so speeds are noisy; padding and batch sizes are not. "
          f"{time.time() - t0:.0f} s in total.")
    print_json({"device": str(device), "cores": cores(), "load_avg_start": load_start, "load_avg_end": load_end,
                "seconds": time.time() - t0, "models": models})


if __name__ == "__main__":
    main()
