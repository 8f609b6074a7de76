"""The paper's E4 on the laptop recipe: fixed batches vs 2D buckets with oom.py batch sizes, dev WER
against training time, the same training-time budget for both.

    python tools/make_mini_data.py -o data/sentences --hours 9 --dev-per-lang 25 --test-per-lang 40
    python tools/train_tokenizer.py --manifest data/sentences/train.jsonl --model-type char -o data/sentences/tokenizer
    python bench/laptop_e4.py --budget-s 600 --val-every 300     # ~24 min on 2 idle cores

Both runs are configs/laptop.yaml, its data and its model, in one process, stopped (SIGTERM, then
one more step that ends with a validation) once their logged step times add up to --budget-s;
validation time is not counted. Stopped by a clock rather than at max_steps, both decay the learning
rate as inverse square root (cosine would have no end to anneal towards). The memory both must fit
is the recipe's step in one process: the peak of its worst bucket at --max-duration padded seconds
per batch (2D bins), measured by aed.oomptimizer.preflight (CPU: live tensor bytes).
- fixed: one bucket, the largest batch size N whose batch of the longest utterances stays inside
  the recipe's padded-duration budget (N = floor(--max-duration / longest)), every batch padded to
  its longest utterance;
- 2D + oom.py: the recipe's 2D bins with per-bucket sizes from oom.py under that memory.
The last line printed is a JSON object.
"""

import argparse
import shutil
import time
from pathlib import Path

import torch
import yaml

from aed.config import load_train_config
from aed.data import read_manifest
from aed.oomptimizer import TrainingStep, preflight
from aed.training_setup import load_training_setup
from bins import load_batch_sizes
from common import ROOT, epoch_batch, load_avg, log, max_duration_sizes, print_json, print_table, run_script
from oom import manifest_bins
from report import train_run


def memory_bound(config: str, bins, sizes: list) -> int:
    """Peak bytes of the worst bucket at these batch sizes: one real step per bucket."""
    setup = load_training_setup(config, torch.device("cpu"))
    return max(preflight(TrainingStep.of(setup), setup.bucket_shapes(bins), sizes, 1 << 40))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/laptop.yaml", help="the recipe (train.py YAML)")
    p.add_argument("--budget-s", type=float, default=600.0, help="training seconds per run (validation excluded)")
    p.add_argument("--val-every", type=int, default=200, help="validate every N steps")
    p.add_argument("--max-duration", type=float, default=30.0,
                   help="padded seconds per batch that set the memory bound (the recipe's step: 2 ranks x 15 s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per run (runs go one after the other)")
    p.add_argument("--work-dir", default=None, help="run dirs and logs (default: runs/laptop_e4)")
    args = p.parse_args()
    work = Path(args.work_dir or ROOT / "runs" / "laptop_e4")
    work.mkdir(parents=True, exist_ok=True)
    t0, load_start = time.time(), load_avg()

    cfg = load_train_config(args.config)
    bins, manifests = manifest_bins(args.config, None, None)
    longest = max(u.duration for m in manifests for u in read_manifest(m))
    m = args.max_duration
    budget = memory_bound(args.config, bins, max_duration_sizes(bins, m))
    fixed_n = max(1, int(m // longest))
    log(f"recipe's worst bucket: {budget / 1e6:.0f} MB of live tensors; fixed batch {fixed_n} "
        f"(max_duration {m:g} s, longest utterance {longest:.2f} s)")
    fragment = work / "buckets.yaml"
    run_script(["oom.py", "--config", args.config, "--out", fragment, "--memory-budget", budget, "--margin", "0",
                "--threshold", "0.1", "--device", "cpu"], work / "oom.log", threads=args.threads)
    oom_bins, oom_sizes = load_batch_sizes(str(work / "buckets.batch_sizes.json"))
    recipe = yaml.safe_load(Path(args.config).read_text())
    recipe["train"].update(yaml.safe_load(fragment.read_text())["train"])  # batch sizes, per-bin TPS limits
    oom_config = work / "laptop_oom.yaml"
    oom_config.write_text(yaml.safe_dump(recipe, sort_keys=False))

    mode = {"budget_s": args.budget_s, "val_every": args.val_every}
    common = [f"cpu_threads={args.threads}", "optim.schedule=inverse_sqrt"]
    schemes = {"fixed": (Path(args.config), ["train.num_buckets=1", "train.sub_buckets=1",
                                               f"train.batch_size={fixed_n}", "train.max_duration=null"],
                          [fixed_n], None),
               "2D + oom.py": (oom_config, [], oom_sizes, oom_bins)}
    runs = {}
    for name, (config, overrides, sizes, b) in schemes.items():
        run_name = name.split()[0].lower()
        shutil.rmtree(work / "runs" / run_name, ignore_errors=True)
        flat = [s for row in sizes for s in row] if isinstance(sizes[0], list) else list(sizes)
        runs[name] = train_run(run_name, config, common + overrides, mode, work) | {
            "buckets": len(flat), "epoch_batch": epoch_batch(b, flat) if b is not None and b.counts else float(fixed_n)}

    print_report(runs, {"config": args.config, "budget_s": args.budget_s, "memory_budget_bytes": budget,
                        "fixed_batch": fixed_n, "load_start": load_start, "load_end": load_avg(),
                        "wall_s": time.time() - t0})


def print_report(runs: dict, about: dict) -> None:
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


if __name__ == "__main__":
    main()
