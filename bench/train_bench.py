"""Batch schemes trained for real, in two modes (`python bench/train_bench.py MODE --help` lists a mode's flags):

    throughput (default)  fixed batches vs 1D vs 2D bucketing vs 2D + oom.py batch sizes: the same number
                          of steps of each; throughput, padding and memory, for a tiny and a 30M model
    e4                    the paper's E4 on a recipe (configs/laptop.yaml): fixed batches vs 2D + oom.py,
                          dev WER against training time, the same training-time budget for both

    python bench/train_bench.py --quick               # tiny, fixed/1D/2D, 30 steps each
    python bench/train_bench.py --models tiny         # tiny, all four schemes, 60 steps each
    python bench/train_bench.py                       # and 30M (20 steps)
    python bench/train_bench.py --models 30m --steps 40 --work-dir /tmp/tb   # keep the run dirs and logs
    python data/make_mini_data.py -o data/sentences --hours 9 --dev-per-lang 25 --test-per-lang 40
    python tools/train_tokenizer.py --manifest data/sentences/train.jsonl --model-type char -o data/sentences/tokenizer
    python bench/train_bench.py e4 --budget-s 600 --val-every 300

Every scheme is a real `train.py` run (a subprocess; common.train_run, which bench/report.py's E2 and
E4 train their schemes with too). The schemes:
- fixed: one bucket, `train.batch_size=N`: every batch is a random mix of lengths, padded to its
  longest. N = floor(max_duration / longest utterance), the largest fixed size whose worst batch
  (N of the longest utterances) stays inside the same padded-audio budget as the bucketed schemes,
  i.e. memory-matched, not batch-matched;
- 1D: duration buckets (`train.sub_buckets=1`), n * d <= max_duration per bucket;
- 2D: duration x token buckets (`train.sub_buckets=2`), the same rule;
- 2D + oom.py: 2D bins with per-bucket sizes from `oom.py` for the memory of the 2D scheme's worst
  bucket (margin 0): the same memory, larger batches where it allows.
A scheme's memory ("bound") is its worst bucket, measured by aed.memory_oomptimizer.preflight (one
real step at every bucket's bounds and batch size; CPU: live tensor bytes): what it must provision.
"epoch batch" is the mean batch size over a whole epoch (bins.counts / sizes), which the measured
steps only sample. Each mode prints its tables, then its results as a JSON object on the last line,
with ratios against the fixed scheme of the same run. The machine may be shared: the load average is
printed, timings are noisy, and the ratios of padding and batch size are more trustworthy than those
of speed.

throughput
----------
The data is the sentence part of the bundled data/mini (290 utterances of 0.9-4.1 s); every scheme
trains the same model for the same number of steps, with validation off and one checkpoint at the
end. Equal steps rather than equal wall-clock: train.py stops on max_steps, every scheme then draws
the same number of batches from its batch distribution, and the rates below are per second anyway.
--fixed-batch N overrides fixed's size, e.g. to match 2D's mean. From RUN_DIR/metrics.jsonl
(log_every=1) after the first --warmup steps: mean batch size, audio and text padding
(element-weighted: 1 - sum(lengths) / sum(padded)), audio seconds and tokens per second of training
(data loading included), seconds per step, and peak memory as train.py logs it (CUDA: max
allocated; CPU: process RSS, which includes ~1 GB of runtime). --quick leaves out what costs minutes
on a CPU: the oom.py search (~70 measured steps for 12 buckets) and the "bound" measurements. CPU
training uses train.py's thread rule (cores - loader workers; OMP_NUM_THREADS to match).

e4
--
Both runs are --config, its data and its model, in one process, stopped (SIGTERM, then one more step
that ends with a validation) once their logged step times add up to --budget-s; validation time is
not counted. Stopped by a clock rather than at max_steps, both decay the learning rate as inverse
square root (cosine would have no end to anneal towards). The memory both must fit is the recipe's
step in one process: the bound of its 2D bins at --max-duration padded seconds per batch; fixed's N
uses the same --max-duration.
"""

import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch
import yaml
from common import (ROOT, cores, epoch_batch, fixed_overrides, flat_sizes, load_avg, log, max_duration_sizes, oom_sizes,
                    print_json, print_table, run_modes, train_run, worst_bucket, write_config)

from aed.data_manifest import read_manifest
from aed.data_sources import ManifestEntry
from aed.memory_measure import device_memory
from aed.model import AED, AEDConfig, count_parameters
from aed.train_data import bins_from_config
from aed.train_setup import load_training_setup
from bins import Bins, load_batch_sizes

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
        path = ROOT / ManifestEntry.of(spec).path
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        longest = max(longest, float(json.loads(line)["duration"]))
                    except (ValueError, KeyError) as e:
                        raise SystemExit(f"{path}:{i}: no numeric 'duration' ({e!r})") from None
    return longest


# --- throughput: equal steps of every scheme --------------------------------------------------------

def throughput_flags(p) -> None:
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 30 steps, fixed/1D/2D only, no memory bounds")
    p.add_argument("--models", default=None, help=f"comma-separated, from {list(MODELS)} (default: all)")
    p.add_argument("--steps", type=int, default=None, help="steps per scheme (default: per model)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the averages")
    p.add_argument("--fixed-batch", type=int, default=None,
                   help="fixed scheme's batch size (default: memory-matched, max_duration / longest)")
    p.add_argument("--oom-threshold", type=float, default=0.1, help="oom.py --threshold (its default: 0.05)")
    p.add_argument("--work-dir", default=None, help="keep run dirs and logs here (default: a temp dir, removed)")


def bench_model(name: str, args, work: Path, device: torch.device) -> dict:
    # One YAML that both train.py and oom.py read. The paper's models train with cross-entropy alone, and
    # the sentences have more varied lengths than the digits.
    config = write_config(work / f"{name}.yaml", model={**MODELS[name][0], "ctc_loss_weight": 0.0},
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
        peak = worst_bucket(setup, bins, sizes, budget=device_memory(device))
        del setup
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return peak

    work = work / name
    results = {}
    runs = {s: s.replace(" + ", "_").replace(".", "") for s in (SCHEMES[:3] if args.quick else SCHEMES)}
    overrides = {"fixed": fixed_overrides(fixed_n), "1D": ["train.sub_buckets=1"], "2D": ["train.sub_buckets=2"]}
    for scheme, run in runs.items():
        t0, load0 = time.time(), load_avg()
        log(f"[{name}] {scheme}: load average {load0}")
        if scheme == "2D + oom.py":
            # The budget is what 2D's batch sizes already need, so both schemes get the same memory.
            sizes_path = work / "oom_batch_sizes.json"
            t_oom = time.time()
            oom_sizes(config, ["-o", sizes_path], results["2D"]["bound_bytes"], work / "oom.log",
                      "--bins", work / "runs" / runs["2D"] / "bins.json", threshold=args.oom_threshold,
                      device=device, threads=cores())
            oom_seconds = time.time() - t_oom
            overrides[scheme] = [f"train.batch_sizes={sizes_path}"]
        res = train_run(run, config, overrides[scheme], work, steps=steps, threads=threads, warmup=args.warmup)
        if scheme == "2D + oom.py":
            bins, sizes = load_batch_sizes(sizes_path)
            sizes = flat_sizes(sizes)
            res["oom_seconds"] = oom_seconds
        else:
            bins = Bins.load(work / "runs" / run / "bins.json")
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


def throughput_mode(args) -> None:
    names = ["tiny"] if args.quick else (args.models.split(",") if args.models else list(MODELS))
    unknown = set(names) - set(MODELS)
    if unknown:
        raise SystemExit(f"--models: unknown {sorted(unknown)}, choose from {list(MODELS)}")
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


# --- e4: fixed vs 2D + oom.py on a recipe, one training-time budget ---------------------------------

def e4_flags(p) -> None:
    p.add_argument("--config", default="configs/laptop.yaml", help="the recipe (train.py YAML)")
    p.add_argument("--budget-s", type=float, default=600.0, help="training seconds per run (validation excluded)")
    p.add_argument("--val-every", type=int, default=200, help="validate every N steps")
    p.add_argument("--max-duration", type=float, default=30.0,
                   help="padded seconds per batch that set the memory bound (the recipe's step: 2 ranks x 15 s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per run (runs go one after the other)")
    p.add_argument("--work-dir", default=None, help="run dirs and logs (default: runs/laptop_e4)")


def e4_schemes(args, work: Path) -> tuple:
    """({name: (config, overrides, batch sizes, bins or None)}, the memory budget, fixed's batch size): the
    recipe's worst bucket at --max-duration is the budget, oom.py sizes the 2D bins for it."""
    bins, manifests = bins_from_config(args.config)
    longest = max(u.duration for m in manifests for u in read_manifest(m))
    m = args.max_duration
    budget = worst_bucket(load_training_setup(args.config, torch.device("cpu")), bins, max_duration_sizes(bins, m))
    fixed_n = max(1, int(m // longest))
    log(f"recipe's worst bucket: {budget / 1e6:.0f} MB of live tensors; fixed batch {fixed_n} "
        f"(max_duration {m:g} s, longest utterance {longest:.2f} s)")
    fragment = work / "buckets.yaml"
    oom_sizes(args.config, ["--out", fragment], budget, work / "oom.log", threads=args.threads)
    oom_bins, oom_batch_sizes = load_batch_sizes(str(work / "buckets.batch_sizes.json"))
    recipe = yaml.safe_load(Path(args.config).read_text())
    recipe["train"].update(yaml.safe_load(fragment.read_text())["train"])  # batch sizes, per-bin TPS limits
    oom_config = work / "laptop_oom.yaml"
    oom_config.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return ({"fixed": (Path(args.config), fixed_overrides(fixed_n), [fixed_n], None),
             "2D + oom.py": (oom_config, [], oom_batch_sizes, oom_bins)}, budget, fixed_n)


def e4_mode(args) -> None:
    work = Path(args.work_dir or ROOT / "runs" / "laptop_e4")
    work.mkdir(parents=True, exist_ok=True)
    t0, load_start = time.time(), load_avg()
    schemes, budget, fixed_n = e4_schemes(args, work)
    runs = {}
    for name, (config, overrides, sizes, bins) in schemes.items():
        sizes = flat_sizes(sizes)
        runs[name] = train_run(name.split()[0].lower(), config, overrides + ["optim.schedule=inverse_sqrt"], work,
                               budget_s=args.budget_s, val_every=args.val_every, threads=args.threads)
        runs[name] |= {"rss_gb": runs[name].pop("memory_gb"), "buckets": len(sizes),
                       "epoch_batch": epoch_batch(bins, sizes) if bins is not None and bins.counts else float(fixed_n)}
    print_e4(runs, {"config": args.config, "budget_s": args.budget_s, "memory_budget_bytes": budget,
                    "fixed_batch": fixed_n, "load_start": load_start, "load_end": load_avg(),
                    "wall_s": time.time() - t0})


def print_e4(runs: dict, about: dict) -> None:
    """Both runs' totals, their validation curves, and everything as the JSON last line."""
    print_table([("run", "<12"), ("buckets", ">7"), ("steps", ">5"), ("training s", ">10.0f"), ("batch", ">5.1f"),
                 ("epoch batch", ">11.1f"), ("audio pad %", ">11.1f"), ("text pad %", ">10.1f"), ("audio s/s", ">9.1f"),
                 ("dev WER", ">7.1f"), ("dev loss", ">8.3f")],
                [[name, r["buckets"], r["steps"], r["seconds"], r["batch"], r["epoch_batch"], r["audio_padding"],
                  r["text_padding"], r["audio_s_per_s"], r["val"][-1]["wer"], r["val"][-1]["loss"]]
                 for name, r in runs.items()])
    print()
    print_table([("run", "<12"), ("step", ">5"), ("training s", ">10.0f"), ("dev loss", ">8.3f"), ("dev WER", ">7.1f")],
                [[name, v["step"], v["seconds"], v["loss"], v["wer"]] for name, r in runs.items() for v in r["val"]])
    print_json(about | {"runs": runs})


MODES = {  # name: (its flags, its run, what it measures)
    "throughput": (throughput_flags, throughput_mode, "fixed vs 1D vs 2D vs 2D + oom.py, equal steps"),
    "e4": (e4_flags, e4_mode, "fixed vs 2D + oom.py on a recipe, dev WER at one training-time budget"),
}


def main(argv: list[str] | None = None) -> None:
    run_modes(__doc__, MODES, "throughput", argv)


if __name__ == "__main__":
    main()
