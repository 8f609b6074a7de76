"""Reproduce the paper's experiments E1-E4 at CPU scale and write a report with tables and plots.

    python bench/report.py                              # full -> docs/REPORT.md, docs/*.png (see below)
    python bench/report.py --quick -o /tmp/report       # 2-4 min, tiny shapes (tests/test_report.py)
    python bench/report.py --render docs/report_results.json   # re-render text and plots of the committed run
    pip install -r bench/requirements-report.txt        # matplotlib, for the plots (optional)

The full mode generates a 3-hour corpus into runs/report/data_3h the first time (reused afterwards;
--data DIR to put it elsewhere).

Every number in the report comes from this run: the existing benchmarks run as subprocesses and
their JSON last lines are parsed, and the training runs are real `train.py` runs.

- E1 synchronized bucketing: (a) bench/sync_bench.py with its cost model calibrated on
  configs/tiny.yaml (2/16/128 simulated ranks; --quick: 2/16 with its FLOP cost model, no timing); (b) `bench/sync_bench.py real` under torchrun with
  2 and 4 gloo processes (1 thread each; 4 processes time-share 2 cores; --quick: 2 only).
- E2 sampling schemes A-D: sampler-only figures from bench/sampler_bench.py and bench/oom_bench.py
  on the synthetic 100k corpus; then real training of configs/tiny.yaml's model on a corpus from
  data/make_mini_data.py (full: --hours 3; --quick: the bundled data/mini), one run per scheme
  (common.train_run, as bench/train_bench.py trains its schemes), each stopped (SIGTERM) when its
  logged step times add up to the same training-time budget:
    A  1D buckets, padded-duration budget (train.max_duration)
    B  A + tokens-per-second filter at 25 (train.max_tps)
    C  B with per-bucket batch sizes from oom.py, memory budget = A's measured worst bucket
    D  2D buckets (x2 token sub-buckets) + TPS filter + oom.py sizes for the same memory
  The E2 table at the paper's scale (bench/oom_bench.py --scale, an hour of CPU per preset) is not
  rerun: its saved results (docs/e2_scale.json) are rendered as they are.
- E3 architecture: `bench/infer_speed_bench.py rtfx` (24+24, 24+4, 32+4 at one CPU-sized width) and
  the parameter counts of the full-size presets (built on the meta device).
- E4 convergence: a fixed batch size (one bucket, every batch padded to its longest; the largest
  size whose worst batch fits A's padded-duration budget) vs D, the same training-time budget.

Training time of a run = the sum of its logged step times; the step after a validation (whose
logged time includes the validation) counts as the run's median step. After the stop, the run is
resumed for one more step and validated, so every run ends with a validation at its budget.
--quick trains every scheme for the same few steps instead, each in this process (aed.cli_train.main), as
it runs oom.py's sizing and the benchmarks that start no processes of their own (their main()).
"""

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from common import (MINI_TOKENIZER, ROOT, cores, epoch_batch, fixed_overrides, flat_sizes, last_json, load_avg, log,
                    max_duration_sizes, oom_sizes, python_script, run_script, script_failed, train_run, worst_bucket,
                    write_config)

from aed.data_batch import encode_utterance
from aed.data_manifest import read_manifest
from aed.data_tokenizer import Tokenizer
from aed.model import AED, AEDConfig, count_parameters
from aed.train_setup import load_training_setup
from bins import estimate_bins, load_batch_sizes

PAPER = {"sync": {2: 7, 16: 13, 128: 20}, "b/a": 3.4, "c/a": 5.0,
         "rtfx": {"canary-1b (24+24)": 345, "24+4": 1097, "canary-1b-flash (32+4)": 992}}
TPS_FILTER = 25.0  # the paper's tokens-per-second filter (scheme B)
MODES = {
    "full": {
        "sync_bench": ["--calibrate", "configs/tiny.yaml", "--table", "cost"],  # (its agreement table is not reported)
        "sync_real": ["--steps", "150", "--time-scale", "8", "--max-duration", "6"],
        "sync_real_ranks": [2, 4],
        "sampler_bench": ["--synthetic", "100000", "--slow-examples", "5000"],
        "oom_bench": ["--threads", "1"],
        "rtfx": ["--utterances", "24", "--beams", "1"],
        "hours": 3.0, "buckets": 10, "budget_s": 120.0, "val_every": 40, "val_utterances": None,
        "max_duration": 60.0,
    },
    "quick": {
        "sync_bench": ["--synthetic", "5000", "--steps", "30", "--buffer-size", "2000", "--table", "cost",
                       "--ranks", "2", "16"],  # FLOPs; 128 simulated ranks would take most of the time
        "sync_real": ["--steps", "4", "--warmup", "1", "--block", "2", "--synthetic", "2000",
                      "--time-scale", "8", "--max-duration", "6"],
        "sync_real_ranks": [2],  # 4 processes took 23 s of --quick's 140 on 2 cores
        "sampler_bench": ["--synthetic", "5000", "--slow-examples", "500", "--buffer-size", "2000"],
        "oom_bench": ["--threads", "1", "--synthetic", "5000", "--buckets", "2"],
        "rtfx": ["--utterances", "2", "--batch-sizes", "1", "--beams", "1", "--tokens", "5",
                 "--min-seconds", "1", "--max-seconds", "3"],
        "hours": 0.0, "buckets": 3, "budget_s": None, "steps": 4, "val_every": 4, "val_utterances": 8,
        "max_duration": 20.0,
    },
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per process on a shared 2-core machine


def run_json(args: list, log_path: Path, in_process: bool = False) -> dict:
    """`python *args` (a benchmark); its stdout and stderr go to log_path; returns its JSON last line.
    in_process: a bench/ script's main(argv) in this process (--quick: no new interpreter each time)."""
    t0 = time.time()
    if in_process:
        python_script(args, log_path, in_process=True)
        stdout = log_path.read_text()
    else:
        log(f"$ {shlex.join(str(a) for a in args)}")
        with open(log_path, "w") as f:
            p = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=f,
                               text=True)
            f.write(p.stdout)
        if p.returncode != 0 or not p.stdout.strip():
            script_failed(args[0], p.returncode, log_path)
        stdout = p.stdout
    log(f"  done in {time.time() - t0:.0f} s")
    return last_json(stdout)


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": git or "unknown",
            "dirty": bool(dirty), "cores": cores(), "cpu": cpu, "torch": torch.__version__,
            "python": platform.python_version(), "load_start": load_avg()}


# --- E2 / E4: real training runs ---------------------------------------------------------------


def prepare_corpus(mode: dict, args, work: Path) -> tuple:
    """(train manifest, dev manifest, how it was made: the command, with the corpus's path relative to
    the checkout when it is inside, as the report quotes it)."""
    if not mode["hours"]:
        return ROOT / "data/mini/train.jsonl", ROOT / "data/mini/dev.jsonl", "the bundled data/mini"
    out = Path(args.data).resolve() if args.data else ROOT / "runs" / "report" / f"data_{mode['hours']:g}h"
    shown = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out  # commands run from the checkout
    cmd = ["data/make_mini_data.py", "-o", str(shown), "--hours", f"{mode['hours']:g}", "--num-workers",
           str(cores()), "--seed", "0"]
    how = f"`{shlex.join(cmd)}`"
    if (out / "train.jsonl").exists():
        return out / "train.jsonl", out / "dev.jsonl", how + " (reused from an earlier run)"
    run_script(cmd, work / "make_mini_data.log")
    return out / "train.jsonl", out / "dev.jsonl", how


def run_training(mode: dict, args, work: Path) -> dict:
    train_path, dev_path, how = prepare_corpus(mode, args, work)
    tokenizer = Tokenizer.load(MINI_TOKENIZER)
    utts = read_manifest(str(train_path))
    durs = [u.duration for u in utts]
    toks = [len(encode_utterance(tokenizer, u)[0]) for u in utts]
    corpus = {"how": how, "utterances": len(utts), "hours": sum(durs) / 3600, "min_s": min(durs),
              "max_s": max(durs), "dev_utterances": len(read_manifest(str(dev_path))),
              "over_tps_filter": sum(n / d > TPS_FILTER for n, d in zip(toks, durs)),
              "max_tps": max(n / d for n, d in zip(toks, durs))}
    config = write_config(work / "e2.yaml", train={"manifests": [str(train_path)], "tokenizer": str(MINI_TOKENIZER)},
                          val={"manifests": [str(dev_path)], "max_utterances": mode["val_utterances"]})

    nb, m = mode["buckets"], mode["max_duration"]
    bins = {"1d": estimate_bins(durs, toks, nb, 1),
            "2d": estimate_bins(durs, toks, nb, 2, method="equal")}  # the paper's bins
    for k, b in bins.items():
        b.save(work / f"bins_{k}.json")
    setup = load_training_setup(str(config), torch.device("cpu"))  # memory of a scheme: common.worst_bucket
    sizes_a = max_duration_sizes(bins["1d"], m)
    budget = worst_bucket(setup, bins["1d"], sizes_a)
    fixed_n = max(1, int(m // max(durs)))  # the largest batch of the longest utterances inside A's budget
    oom = {k: work / f"batch_sizes_{k}.json" for k in ("1d", "2d")}
    for k, out in oom.items():
        oom_sizes(config, ["-o", out], budget, work / f"oom_{k}.log", "--bins", work / f"bins_{k}.json",
                  "--max-tps", TPS_FILTER, in_process=args.quick)

    common = [f"train.num_buckets={nb}", f"train.buffer_size={len(utts)}"]
    schemes = {
        "fixed": (fixed_overrides(fixed_n), estimate_bins(durs, toks, 1, 1), [fixed_n], None),
        "A": ([f"train.bins={work / 'bins_1d.json'}", f"train.max_duration={m}"], bins["1d"], sizes_a, None),
        "B": ([f"train.bins={work / 'bins_1d.json'}", f"train.max_duration={m}", f"train.max_tps={TPS_FILTER}"],
              bins["1d"], sizes_a, TPS_FILTER),
        "C": ([f"train.batch_sizes={oom['1d']}", f"train.max_tps={TPS_FILTER}"],
              *load_batch_sizes(oom["1d"]), TPS_FILTER),
        "D": ([f"train.batch_sizes={oom['2d']}", f"train.max_tps={TPS_FILTER}"],
              *load_batch_sizes(oom["2d"]), TPS_FILTER),
    }
    runs = {}
    for name, (overrides, b, sizes, max_tps) in schemes.items():
        flat = flat_sizes(sizes)
        run = train_run(name, config, common + overrides, work, steps=mode.get("steps"), budget_s=mode["budget_s"],
                        val_every=mode["val_every"], in_process=args.quick)
        run["rss_gb"] = run.pop("memory_gb")  # the report's name for train.py's memory: a CPU process's RSS
        runs[name] = run | {"buckets": len(flat), "sizes": flat, "bound_bytes": worst_bucket(setup, b, sizes, max_tps),
                            "epoch_batch": epoch_batch(b, flat) if b.counts else None}
    return {"corpus": corpus, "budget_bytes": budget, "fixed_batch": fixed_n, "max_duration": m, "buckets": nb,
            "budget_s": mode["budget_s"], "val_every": mode["val_every"], "runs": runs}


# --- E3: parameter counts at full size ---------------------------------------------------------


def parameter_counts() -> list:
    rows = []
    for name in ("canary-1b", "canary-1b-smalldec", "canary-1b-flash"):
        cfg = AEDConfig.from_yaml(ROOT / "configs" / f"{name}.yaml")
        with torch.device("meta"):  # shapes only
            model = AED(cfg)
        enc = count_parameters(model.encoder) + count_parameters(model.encoder_decoder_proj)
        rows.append({"preset": f"configs/{name}.yaml", "layout": f"{cfg.enc_layers}+{cfg.dec_layers}",
                     "encoder": enc, "decoder": count_parameters(model) - enc, "total": count_parameters(model)})
    return rows


# --- plots and the report ----------------------------------------------------------------------


def plots(res: dict, out: Path) -> list:
    """PNG files written next to the report; [] when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for scheme, marker in (("2d-per-bucket", "o-"), ("1d-30", "o:")):
        sim = [r for r in res["e1a"]["results"] if r["scheme"] == scheme]
        ax.plot([r["ranks"] for r in sim], [100 * r["speedup"] for r in sim], marker, label=f"simulated, {scheme}")
    ax.plot(list(PAPER["sync"]), list(PAPER["sync"].values()), "s--", label="paper (GPUs)")
    ax.plot([r["world_size"] for r in res["e1b"]], [100 * r["speedup"] for r in res["e1b"]], "^",
            markersize=9, label="measured, gloo on CPU")
    ax.set(xscale="log", xlabel="ranks", ylabel="step time saved by sync (%)", title="E1: synchronized buckets")
    ax.axhline(0, color="grey", lw=0.5)
    ax.legend(fontsize=8)
    files.append(save_fig(fig, out / "e1_sync.png"))

    runs = res["e2"]["runs"]
    for fname, names, title in (("e2_schemes.png", ["A", "B", "C", "D"], "E2: schemes A-D"),
                                ("e4_convergence.png", ["fixed", "D"], "E4: fixed batch vs 2D (D)")):
        fig, axes = plt.subplots(2, 2, figsize=(10, 7))
        for name in names:
            v = runs[name]["val"]
            for col, x in enumerate(("seconds", "step")):
                axes[0, col].plot([p[x] for p in v], [p["loss"] for p in v], "o-", label=name)
                axes[1, col].plot([p[x] for p in v], [p["wer"] for p in v], "o-", label=name)
        for col, x in enumerate(("training seconds", "steps")):
            axes[0, col].set(xlabel=x, ylabel="dev loss")
            axes[1, col].set(xlabel=x, ylabel="dev WER (%)")
            axes[0, col].legend(fontsize=8)
        fig.suptitle(title)
        files.append(save_fig(fig, out / fname))
    return files


def save_fig(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path.name


def table(header: list, rows: list) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
                     + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def pct(x: float) -> str:
    return f"{x:.1f}%"


E2_SCALE = ROOT / "docs" / "e2_scale.json"  # bench/oom_bench.py --scale results (an hour of CPU: not rerun here)


def scale_section(path: Path = E2_SCALE) -> list:
    """Markdown lines of the E2 table at the paper's scale, from the saved bench/oom_bench.py --scale
    JSON lines ({preset: {"command": ..., "result": ...}}); none if the file is absent."""
    if not path.exists():
        return []
    runs = json.loads(path.read_text())
    s = ["### E2 at the paper's scale: Canary-1B and Canary-1B-Flash on a simulated 80 GiB GPU", "",
         "Every batch of one epoch of the real sampler (one rank, a 100k-utterance workload shaped like the "
         "paper's data: `common.paper_corpus`) is checked against the tensor limit (80 GiB minus the 10% "
         "margin, CUDA context and cuBLAS workspace; batches are sized to it less the model's worst held-out "
         "under-estimate) with a memory model fitted to simulated bf16 training steps of the preset "
         "(`bench/oom_bench.py fit`); each scheme's two worst batches are then run as simulated steps. "
         "A's and B's batch_duration is the largest at which no batch of the epoch is over the limit (bisection "
         "to 1 s). B's TPS filter is each duration bin's own max tokens/s (outliers past 4 standard deviations; "
         "the paper filters at 25). Numbers from the runs below, not from `make report`.", ""]
    for preset, run in runs.items():
        r = run["result"]
        bd = r["batch_duration"]
        names = {"A": f"A 1D 30, heuristic, M = {bd['A']:.0f} s", "B": f"B + TPS filter, M = {bd['B']:.0f} s",
                 "C": "C + oom.py per-bucket sizes", "D": "D + 2D 30x2"}
        paper = {"A": "1x", "B": "", "C": "3.4x", "D": "5x"}
        a = r["schemes"]["A"]["mean_batch"]
        s += [f"**{preset}** (`{run['command']}`):", ""]
        s.append(table(["scheme", "mean batch", "vs A", "paper", "memory mean / max", "batches over limit",
                        "audio / text padding", "dropped"],
                       [[names[k], f"{x['mean_batch']:.1f}", f"{x['mean_batch'] / a:.2f}x", paper[k],
                         f"{100 * x['mean_memory']:.1f}% / {100 * x['max_memory']:.1f}%", x["over_limit"],
                         f"{100 * x['audio_padding']:.1f}% / {100 * x['text_padding']:.1f}%",
                         sum(x["drops"].values())] for k, x in r["schemes"].items()]))
        v = r["validation"]
        fixed = run["memory_model"]["constant"]  # weights, gradients, AdamW state: in every batch
        headroom = (r["sized_bytes"] - fixed) / (r["schemes"]["A"]["mean_memory"] * r["limit_bytes"] - fixed)
        s += ["", f"TPS filter at A's batch_duration: peak memory {100 * r['tps_peak_reduction']:.1f}% lower (paper: "
              f"20%). Memory model vs simulated steps it was not fitted on ({v['held_out_steps']} held-out shapes, "
              f"{v['confirmed_steps']} worst batches): median |error| {100 * v['median_error']:.1f}%, largest "
              f"under-estimate {100 * v['max_underestimate']:.1f}%; worst batches over the limit as simulated steps: "
              f"{v['confirmed_over_limit']} of {v['confirmed_steps']}. The limit holds {headroom:.2f}x the "
              f"activation memory of A's average batch ({fixed / 1e9:.1f} GB of weights, gradients and optimizer "
              "state aside): about the most any per-bucket sizes can add to the mean batch, activations growing "
              "with the batch size.", ""]
        if r["confirmed"]:
            s.append(table(["scheme", "worst batch (B x T frames x U tokens)", "predicted", "simulated", "error",
                            "simulated / limit"],
                           [[c["scheme"], f"{c['B']} x {c['T']} x {c['U']}", f"{c['predicted'] / 1e9:.2f} GB",
                             f"{c['simulated'] / 1e9:.2f} GB", f"{100 * c['error']:+.1f}%",
                             pct(100 * c["simulated"] / r["limit_bytes"])] for c in r["confirmed"]]))
            s.append("")
    return s


HAND_WRITTEN = "<!-- hand-written below this line: bench/report.py keeps it when it rewrites the report -->"


def write_report(res: dict, out: Path, pngs: list) -> Path:
    """REPORT.md in `out`: the generated sections, then whatever an older REPORT.md there holds below
    HAND_WRITTEN."""
    def figure(name: str, alt: str) -> str:
        return f"![{alt}]({name})" if name in pngs else f"*(plot {name} skipped: matplotlib missing)*"

    s = (header_section(res) + e1_section(res, figure) + e2_section(res, figure) + scale_section()
         + e3_section(res) + e4_section(res, figure))
    path = out / "REPORT.md"
    old = path.read_text() if path.exists() else ""
    kept = "\n" + old[old.index(HAND_WRITTEN):] if HAND_WRITTEN in old else ""  # hand-written sections survive
    path.write_text("\n".join(s) + "\n" + kept)
    return path


def header_section(res: dict) -> list:
    m = res["machine"]
    return [f"# Reproducing the paper's experiments at CPU scale{' (--quick)' if res['quick'] else ''}", "",
         "Generated by `bench/report.py`; every number below was measured by that run. The paper: Zelasko et al. "
         "2025, *Training and Inference Efficiency of Encoder-Decoder Speech Models* (GPU clusters, 1B models); "
         "here: a shared 2-core CPU and models of a few million parameters, so compare trends, not magnitudes.", "",
         table(["", ""], [["command", f"`{res['command']}`"], ["date", m["date"]],
                          ["git commit", m["commit"] + (" (with uncommitted changes)" if m["dirty"] else "")],
                          ["machine", f"{m['cores']} cores, {m['cpu']}, torch {m['torch']}, Python {m['python']}"],
                          ["load average (1/5/15 min)", f"{m['load_start']} at start, {m['load_end']} at end "
                                                        "(the report itself keeps ~1 core busy; more means other jobs, and noisier timings)"],
                          ["total runtime", f"{res['seconds'] / 60:.1f} min"]]), ""]


def e1_section(res: dict, figure) -> list:
    cost_model = ("cost model fitted to forward+backward times of configs/tiny.yaml on this CPU"
                  if res["e1a"]["cost_model"] != "flops" else "FLOP cost model of a 1B model on a GPU (--quick)")
    s = ["## E1 Synchronized bucket selection", "",
          "Paper: drawing the same bucket on every rank at each step makes steps 7% / 13% / 20% faster at "
          "2 / 16 / 128 GPUs, because a DDP step waits for its slowest rank.", "",
          f"**(a) Simulated** (`bench/sync_bench.py`, {cost_model}; R samplers on the synthetic corpus, "
          f"{res['e1a']['steps']} steps per cell):", ""]
    s.append(table(["scheme", "ranks", "step s (no sync)", "step s (sync)", "saved", "paper", "same bucket (sync)"],
                   [[r["scheme"], r["ranks"], f"{r['unsync']['step_s']:.4f}", f"{r['sync']['step_s']:.4f}",
                     pct(100 * r["speedup"]), f"{PAPER['sync'].get(r['ranks'], '-')}%",
                     pct(100 * r["sync"]["same_bucket"])] for r in res["e1a"]["results"]]))
    b0 = res["e1b"][0]
    s += ["", f"**(b) Measured** (`bench/sync_bench.py real` under torchrun, gloo, 1 torch thread per process; "
          f"{b0['steps']} steps per scheme, alternating blocks of {b0['block']}; the model of {b0['config']} "
          f"({b0['parameters'] / 1e6:.2f}M parameters) trained on random features of each sampled batch's shape; "
          f"synthetic corpus with durations / {b0['time_scale']:g}, 2D {len(b0['bins_shape'])}x2 buckets, "
          f"{b0['max_duration']:g} s per batch). With 4 processes on 2 cores the processes time-share the CPU.", ""]
    s.append(table(["processes", "step s (no sync)", "step s (sync)", "saved", "busy (no sync)", "busy (sync)",
                    "same bucket (no sync / sync)"],
                   [[r["world_size"], f"{r['unsync']['step_s']:.3f}", f"{r['sync']['step_s']:.3f}",
                     pct(100 * r["speedup"]), pct(100 * r["unsync"]["busy"]), pct(100 * r["sync"]["busy"]),
                     f"{pct(100 * r['unsync']['same_bucket'])} / {pct(100 * r['sync']['same_bucket'])}"]
                    for r in res["e1b"]]))
    s += ["", "step s = mean over steps of the slowest rank's step; busy = mean rank compute / slowest rank "
          "compute. The measured setting gives every batch the same padded duration, so batches of different "
          "buckets cost about the same, and the ranks of a step wait little for each other even without sync "
          "(see busy); differences of a few percent are within the step-to-step noise of processes sharing "
          "2 cores. The simulation in (a) models a cluster's independent GPUs, which these processes are not.", "",
          figure("e1_sync.png", "E1"), ""]
    return s


def training_budget(e2: dict) -> str:
    """What the E2 and E4 runs had in common: a training-time budget, or (--quick) a number of steps."""
    if e2["budget_s"]:
        return f"the same training-time budget of {e2['budget_s']:g} s (sum of step times, validation excluded)"
    return f"{e2['runs']['A']['steps']} steps each (--quick: equal steps, not equal time)"


def e2_section(res: dict, figure) -> list:
    e2, runs = res["e2"], res["e2"]["runs"]
    sb = res["sampler"]["schemes"]
    s = ["## E2 Sampling schemes A-D", "",
          "Paper: per-bucket batch sizes from the OOMptimizer give 3.4x the mean batch size of a 1D "
          "padded-duration heuristic (C vs A); 2D buckets 5x (D vs A).", "",
          f"**Sampler only**, {res['sampler']['workload']['data']} utterances (`bench/sampler_bench.py`, "
          f"{res['sampler']['workload']['max_duration']:g} s budget; one epoch):", ""]
    s.append(table(["scheme", "batches", "mean batch", "audio padding", "text padding", "drops"],
                   [[k, r["batches"], f"{r['mean_batch']:.1f}", pct(100 * r["audio_padding"]),
                     pct(100 * r["text_padding"]), sum(r["drops"].values()) if r["drops"] else 0]
                    for k, r in sb.items() if "mean_batch" in r]))
    ob = res["oom_bench"]
    s += ["", f"**Mean batch size under one memory limit** (`bench/oom_bench.py`: a {ob['model']['parameters'] / 1e6:.1f}M "
          f"model with Canary's proportions, limit {ob['limit_bytes'] / 1e6:.0f} MB of live tensors, "
          f"{ob['synthetic']} synthetic utterances; the heuristic's budget is tuned to the same limit):", ""]
    s.append(table(["scheme", "mean batch", "vs (a)", "paper"],
                   [["(a) 1D, padded-duration heuristic", f"{ob['a']['mean_batch']:.1f}", "1.00x", "1x"],
                    ["(b) 1D + oom.py", f"{ob['b']['mean_batch']:.1f}", f"{ob['ratios']['b/a']:.2f}x", "3.4x"],
                    ["(c) 2D + oom.py", f"{ob['c']['mean_batch']:.1f}", f"{ob['ratios']['c/a']:.2f}x", "5x"]]))
    c = e2["corpus"]
    s += ["", f"**Training** the model of configs/tiny.yaml on {c['how']}: {c['utterances']} utterances, "
          f"{c['hours']:.2f} h, {c['min_s']:.2f}-{c['max_s']:.2f} s; dev {c['dev_utterances']} utterances (sentences "
          f"not in train). Buckets: {e2['buckets']} (1D) and {e2['buckets']}x2 (2D); A's budget "
          f"{e2['max_duration']:g} padded seconds per batch; C and D get oom.py's sizes for A's measured worst-bucket "
          f"memory ({e2['budget_bytes'] / 1e6:.0f} MB of live tensors; oom.py bounds a 1D bucket's tokens at "
          f"{TPS_FILTER:g} tokens/s x its duration, the filter's limit, where A's memory was measured at the bins' "
          f"own max tokens/s, so C's search is the more conservative). The TPS filter at {TPS_FILTER:g} tokens/s "
          f"matches {c['over_tps_filter']} utterance(s) of this corpus (max {c['max_tps']:.1f} tokens/s). "
          f"One torch thread and one loader worker per run; {training_budget(e2)}; validation every {e2['val_every']} steps and "
          "at the end.", ""]
    s.append(run_table(runs, ["A", "B", "C", "D"]))
    s += ["", "batch = mean examples per step during training; epoch batch = over an epoch from the bucket counts; "
          "padding is element-weighted (1 - real / padded); audio s/s = training audio seconds per second of "
          "training; memory = the worst bucket's peak of live tensors (aed.memory_oomptimizer.preflight), RSS = train.py's process "
          "memory (includes ~1 GB of runtime).", "",
          "The runs ran one after another; whatever else used the 2 cores (see the load averages) changed how "
          "much CPU each run got: compare s/step of runs with similar batch sizes and padding. Steps, audio s/s "
          "and the curves against seconds therefore compare the runs only roughly; batch sizes, padding, memory "
          "and the curves against steps do not depend on the load.", "", figure("e2_schemes.png", "E2"), ""]
    return s


def e3_section(res: dict) -> list:
    rt = res["rtfx"]
    s = ["## E3 Architecture: RTFx and parameters", "",
          "Paper Table 3 (GPU): RTFx 345 (24+24), 1097 (24+4), 992 (32+4), i.e. the Flash layout ~3x the "
          "24+24 one.", "",
          f"`bench/infer_speed_bench.py rtfx`: infer.py's pipeline (WAV files -> features -> encoder -> greedy "
          f"decoding) with random weights at width {rt['d_model']} (layer counts as the presets), {rt['utterances']} generated "
          f"files / {rt['audio_s']:g} s of audio, {rt['tokens']} tokens per utterance, {rt['threads']} thread, "
          f"{rt['device']}:", ""]
    s.append(table(["layout", "search", "batch", "RTFx", "encoder-only RTFx", "vs 24+24", "paper RTFx"],
                   [[r["layout"], r["search"], r["batch"], f"{r['rtfx']:.1f}", f"{r['encoder_only_rtfx']:.1f}",
                     f"{r['rtfx_vs_canary_1b']:.2f}x", PAPER["rtfx"].get(r["layout"], "-")] for r in rt["rows"]]))
    s += ["", "Parameters of the full-size presets (`python -m aed.model --count`):", ""]
    s.append(table(["preset", "layout", "encoder", "decoder", "total"],
                   [[r["preset"], r["layout"], f"{r['encoder']:,}", f"{r['decoder']:,}", f"{r['total']:,}"]
                    for r in res["params"]]))
    return s


def e4_section(res: dict, figure) -> list:
    e2, runs = res["e2"], res["e2"]["runs"]
    f_, d_ = runs["fixed"], runs["D"]
    s = ["", "## E4 Convergence: fixed batch size vs optimised 2D", "",
          "Paper: the 2D setup reaches the same WER in about half the steps, with 4.5% / 19% audio / text "
          "padding vs 57% / 59% for fixed-size batches.", "",
          f"Same model, data and {training_budget(e2)}. fixed = one bucket, batch size {e2['fixed_batch']} (the "
          f"largest whose worst batch stays inside A's {e2['max_duration']:g} s budget), every batch padded to its "
          "longest utterance; D as above.", ""]
    s.append(run_table(runs, ["fixed", "D"]))
    s += ["", "Validation curve (dev loss, WER %):", ""]
    s.append(table(["run", "step", "training s", "dev loss", "dev WER"],
                   [[n, p["step"], f"{p['seconds']:.0f}", f"{p['loss']:.3f}", pct(p["wer"])]
                    for n in ("fixed", "D") for p in runs[n]["val"]]))
    target = max(f_["val"][-1]["loss"], d_["val"][-1]["loss"])
    reach = {n: next(p for p in runs[n]["val"] if p["loss"] <= target) for n in ("fixed", "D")}
    s += ["", f"Dev loss {target:.3f} (the higher of the two final losses) is first reached by fixed at step "
          f"{reach['fixed']['step']} / {reach['fixed']['seconds']:.0f} s and by D at step "
          f"{reach['D']['step']} / {reach['D']['seconds']:.0f} s.",
          "", figure("e4_convergence.png", "E4"), "",
          "## Notes", "",
          "- A model of a few million parameters trained from scratch for minutes on synthetic speech does not "
          "learn to recognise unseen sentences: dev WER stays near (or above) 100%, so the dev loss is the "
          "convergence measure here; the WER columns are reported as measured.",
          "- Speeds were taken on 2 cores that other jobs may share (see the load averages); padding, batch sizes and counts are "
          "exact, time ratios are rough."]
    return s


def run_table(runs: dict, names: list) -> str:
    rows = []
    for n in names:
        r = runs[n]
        v0, v1 = r["val"][0], r["val"][-1]
        rows.append([n, r["buckets"], r["steps"], f"{r['seconds']:.0f}", f"{r['seconds'] / r['steps']:.2f}",
                     f"{r['batch']:.1f}",
                     f"{r['epoch_batch']:.1f}" if r["epoch_batch"] else "-", pct(r["audio_padding"]),
                     pct(r["text_padding"]), f"{r['audio_s_per_s']:.1f}", f"{r['bound_bytes'] / 1e6:.0f}",
                     f"{r['rss_gb']:.2f}", f"{v0['loss']:.2f} -> {v1['loss']:.2f}", pct(v1["wer"])])
    return table(["run", "buckets", "steps", "training s", "s/step", "batch", "epoch batch", "audio pad", "text pad",
                  "audio s/s", "memory MB", "RSS GB", "dev loss", "final WER"], rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes and few steps: a few minutes")
    p.add_argument("-o", "--out", default=str(ROOT / "docs"), help="folder for REPORT.md and the PNGs")
    p.add_argument("--data", default=None, help="corpus folder (generated there if it has no train.jsonl)")
    p.add_argument("--work-dir", default=None, help="keep logs and run dirs here (default: a temp dir)")
    p.add_argument("--render", metavar="RESULTS_JSON", default=None,
                   help="only rewrite the report and plots from an earlier run's results.json (no measuring)")
    args = p.parse_args()
    if args.render:
        res = json.loads(Path(args.render).read_text())
        pngs = plots(res, Path(args.out))
        log(f"wrote {write_report(res, Path(args.out), pngs)} and {len(pngs)} plot(s) from {args.render}")
        return
    mode = MODES["quick" if args.quick else "full"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="aed_report_"))
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    t0 = time.time()
    log(f"logs and runs in {work}")
    res = {"command": shlex.join(["python", "bench/report.py", *sys.argv[1:]]), "quick": args.quick,
           "machine": machine()}
    res["e1a"] = run_json(["bench/sync_bench.py", *mode["sync_bench"]], work / "sync_bench.log", args.quick)
    res["e1b"] = [run_json(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                            "bench/sync_bench.py", "real", *mode["sync_real"]], work / f"sync_real_{n}.log")
                  for n in mode["sync_real_ranks"]]
    # (a subprocess even for --quick: its schemes run in spawned processes, which would import this script)
    res["sampler"] = run_json(["bench/sampler_bench.py", *mode["sampler_bench"]], work / "sampler_bench.log")
    res["oom_bench"] = run_json(["bench/oom_bench.py", *mode["oom_bench"]], work / "oom_bench.log", args.quick)
    res["e2"] = run_training(mode, args, work)
    res["rtfx"] = run_json(["bench/infer_speed_bench.py", "rtfx", *mode["rtfx"]], work / "infer_rtfx.log", args.quick)
    res["params"] = parameter_counts()
    res["machine"]["load_end"] = load_avg()
    res["seconds"] = time.time() - t0
    (work / "results.json").write_text(json.dumps(res, indent=1, default=str))
    pngs = plots(res, out)
    path = write_report(res, out, pngs)
    if not pngs:
        log("matplotlib missing: plots skipped (pip install -r bench/requirements-report.txt)")
    log(f"wrote {path} and {len(pngs)} plot(s) in {res['seconds'] / 60:.1f} min; raw results in {work / 'results.json'}")


if __name__ == "__main__":
    main()
