"""Self-supervised pretraining on a compute budget, at CPU scale (Liu et al., "Efficient Training of
Self-Supervised Speech Foundation Models on a Compute Budget").

    python bench/ssl_budget.py --plot docs/ssl_budget.png     # the study: ~25 min on 2 loaded cores
    python bench/ssl_budget.py --quick                        # every run for a few steps, ~35 s (tests/test_ssl_budget.py)

Every pretraining run is `train.py configs/tiny-ssl.yaml` (BEST-RQ, aed/model_ssl.py) stopped by the same
FLOP budget (`budget_flops`, counted by aed/train_progress.py); every fine-tune is `train.py configs/tiny.yaml`
(AED + CTC head) on the labelled digits (data/mini/digits/train.jsonl, 8.8 min) for the same number
of steps, with `init_from=<pretrained> init_encoder_only=true`, scored on the digits dev set. The
paper's three findings, and the baseline:

    (a) slim-deep vs wide-shallow encoders of (about) the same parameter count
    (b) the full pretraining set vs a random quarter of it (which the budget then repeats ~4x as often)
    (c) three encoder sizes of the slim family at the one budget
    the reference encoder fine-tuned from scratch (random init), at two seeds for the spread (--quick: one)

Pretraining audio (text dropped): data/mini/train.jsonl and data/mini/digits/train.jsonl, plus a
digits corpus from data/make_digits_data.py (five languages, --seed 1; generated into --data on the
first run, reused after) without the strings of the fine-tuning dev set. --quick: the bundled
sentences only, tiny models, a few steps.

The score is the fine-tuned model's dev loss, or dev WER when some fine-tuned model gets below
80% (at this scale WER is mostly uninformative). Prints a table and the results as a JSON last line.
"""

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (ROOT, cores, load_avg, log, print_json, print_table, python_script, read_metrics,  # noqa: E402
                    run_script)

MINI = ROOT / "data" / "mini"
# Encoders (d_model, layers, heads). slim and wide have the same parameter count within ~5%:
# a layer holds ~24 d^2 parameters, so 8 x 96^2 = 2 x 192^2.
FULL = {"budget_flops": 1.2e12, "finetune_steps": 150, "models": {
    "slim": (96, 8, 4), "wide": (192, 2, 4), "small": (64, 4, 4), "large": (128, 12, 4)}}
QUICK = {"budget_flops": 3e9, "finetune_steps": 2, "models": {
    "slim": (32, 4, 2), "wide": (64, 1, 2), "small": (16, 2, 2), "large": (48, 6, 2)}}
COMMON = ["cpu_threads=1", "keep_last=1", "log_every=10", "train.num_workers=1", "model.subsampling_channels=32"]
QUICK_ARGS = ["val.max_utterances=2", "train.num_workers=0", "train.bin_method=equal"]  # seconds, not minutes


def encoder_args(dims) -> list:
    d, layers, heads = dims
    return [f"model.enc_d_model={d}", f"model.enc_layers={layers}", f"model.enc_heads={heads}"]


def encoder_params(dims) -> int:
    """Parameters of the encoder alone (what init_from carries over), counted on the meta device."""
    import torch

    from aed.model_encoder import ConformerEncoder

    d, layers, heads = dims
    with torch.device("meta"):
        enc = ConformerEncoder(80, d, layers, heads, 4, 9, "batch_norm", 32, 0.0, 0.0, 0.0)
    return sum(p.numel() for p in enc.parameters())


# --- data ------------------------------------------------------------------------------------------


def words(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def audio_only(paths: list, out: Path, exclude: set = frozenset()) -> list:
    """Manifest lines of `paths` reduced to absolute audio path and duration, without the utterances
    whose text is in `exclude`; written to `out`, returned."""
    lines = []
    for path in paths:
        for line in open(path):
            d = json.loads(line)
            if words(d.get("text", "")) in exclude:
                continue
            lines.append({"audio_filepath": str((Path(path).parent / d["audio_filepath"]).resolve()),
                          "duration": d["duration"]})
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def pretraining_sets(quick: bool, data: Path, work: Path) -> dict:
    """{"full": manifest, "quarter": manifest, "hours": {...}, "source": how}: unlabelled audio."""
    sources = [MINI / "train.jsonl"]
    how = "data/mini/train.jsonl"
    if not quick:
        cmd = ["data/make_digits_data.py", "-o", str(data), "--seed", "1", "--train-per-lang", "600",
               "--dev-per-lang", "2", "--langs", "de", "en", "es", "fr", "it", "--num-workers", str(cores())]
        if not (data / "train.jsonl").exists():
            run_script(cmd, work / "make_digits_data.log")
        sources += [MINI / "digits" / "train.jsonl", data / "train.jsonl"]
        how += " + data/mini/digits/train.jsonl + `" + " ".join(cmd) + "`"
    dev_strings = {words(json.loads(line)["text"]) for line in open(MINI / "digits" / "dev.jsonl")}
    full = audio_only(sources, work / "pretrain_full.jsonl", exclude=dev_strings)
    quarter = random.Random(0).sample(full, len(full) // 4)
    (work / "pretrain_quarter.jsonl").write_text("".join(json.dumps(x) + "\n" for x in quarter))
    audio_only([MINI / "dev.jsonl"], work / "ssl_dev.jsonl")
    return {"full": work / "pretrain_full.jsonl", "quarter": work / "pretrain_quarter.jsonl", "source": how,
            "hours": {"full": sum(x["duration"] for x in full) / 3600,
                      "quarter": sum(x["duration"] for x in quarter) / 3600}}


# --- runs ------------------------------------------------------------------------------------------


def last_row(rows: list, key: str):
    return next((r for r in reversed(rows) if key in r), None)


def pretrain(name: str, dims, manifest: Path, mode: dict, work: Path) -> dict:
    run_dir = work / "runs" / f"ssl_{name}"
    args = ["train.py", "configs/tiny-ssl.yaml", f"run_dir={run_dir}", *COMMON, *encoder_args(dims),
            f"train.manifests=[{manifest}]", f"val.manifests=[{work / 'ssl_dev.jsonl'}]", "max_steps=100000000",
            f"budget_flops={mode['budget_flops']}", "val.every=100000000", "ckpt_every=100000000",
            "optim.warmup_steps=50"]
    if mode["quick"]:
        args += QUICK_ARGS
    t0 = time.time()
    python_script(args, work / f"ssl_{name}.log", in_process=mode["quick"])
    rows = read_metrics(run_dir)
    train = [r for r in rows if "train/step_time" in r]
    step = max(r["step"] for r in train)
    seen_s = sum(r["train/audio_s_per_s"] * r["train/step_time"] * (r["step"] - p["step"])
                 for p, r in zip([{"step": 0}] + train, train))  # valid audio seconds over the logged windows
    result = {"steps": step, "flops": last_row(rows, "train/flops")["train/flops"], "audio_hours_seen": seen_s / 3600,
              "ssl_train_loss": train[-1]["train/loss"], "ssl_dev_loss": last_row(rows, "val/ssl_dev/loss")[
                  "val/ssl_dev/loss"], "ssl_dev_loss_at_0": rows[0].get("val/ssl_dev/loss"),
              "wall_s": time.time() - t0, "ckpt": str(run_dir / f"ckpt-{step:08d}")}
    log(f"[ssl {name}] {step} steps, {result['flops']:.3g} FLOPs, {result['audio_hours_seen']:.2f} h of audio, "
        f"SSL dev loss {result['ssl_dev_loss_at_0']:.3f} -> {result['ssl_dev_loss']:.3f}, {result['wall_s']:.0f} s")
    return result


def finetune(name: str, dims, init: str | None, mode: dict, work: Path, seed: int = 0) -> dict:
    run_dir = work / "runs" / f"ft_{name}"
    steps = mode["finetune_steps"]
    args = ["train.py", "configs/tiny.yaml", f"run_dir={run_dir}", *COMMON, *encoder_args(dims), f"seed={seed}",
            f"max_steps={steps}", f"val.every={steps}", f"ckpt_every={steps}", "optim.warmup_steps=50"]
    if init:
        args += [f"init_from={init}", "init_encoder_only=true"]
    if mode["quick"]:  # an untrained decoder babbles to its last position: a short one
        args += QUICK_ARGS + ["model.dec_d_model=32", "model.dec_layers=1", "model.dec_heads=2", "model.dec_max_len=64"]
    t0 = time.time()
    python_script(args, work / f"ft_{name}.log", in_process=mode["quick"])
    rows = read_metrics(run_dir)
    final = last_row(rows, "val/dev/loss")
    result = {"dev_loss": final["val/dev/loss"], "dev_wer": final["val/dev/wer"], "steps": steps,
              "flops": last_row(rows, "train/flops")["train/flops"], "wall_s": time.time() - t0}
    log(f"[ft {name}] dev loss {result['dev_loss']:.3f}, WER {result['dev_wer']:.1f}% in {result['wall_s']:.0f} s")
    return result


# --- report ----------------------------------------------------------------------------------------


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot (pip install -r bench/requirements-report.txt)")
        return
    metric = res["ssl_vs_scratch"]["metric"]
    label = "fine-tuned dev loss" if metric == "loss" else "fine-tuned dev WER (%)"
    scratch = res["ssl_vs_scratch"]["scratch"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (title, names, values) in zip(axes[:2], [
            ("(a) same parameters", ["slim-deep", "wide-shallow"],
             [res["slim_vs_wide"]["slim"], res["slim_vs_wide"]["wide"]]),
            ("(b) same FLOPs, pretraining data", ["full set", "quarter, repeated"],
             [res["data_size"]["full"], res["data_size"]["quarter"]])]):
        ax.bar(names, values, color=["tab:blue", "tab:orange"])
        ax.axhline(scratch, color="gray", ls="--", label="no pretraining")
        ax.set_title(title)
        ax.set_ylabel(label)
        ax.set_ylim(min(values + [scratch]) * 0.9, max(values + [scratch]) * 1.05)
        ax.legend(loc="lower right")
    sweep = res["size_sweep"]
    axes[2].plot([r["params"] / 1e6 for r in sweep], [r["score"] for r in sweep], "o-", label="SSL, then fine-tuned")
    axes[2].axhline(scratch, color="gray", ls="--", label="no pretraining (reference size)")
    axes[2].set_xlabel("encoder parameters (M)")
    axes[2].set_ylabel(label)
    axes[2].set_title("(c) sizes at one pretraining budget")
    axes[2].legend()
    fig.suptitle(f"BEST-RQ pretraining budget {res['budget_flops']:.3g} FLOPs, fine-tuning "
                 f"{res['finetune_steps']} steps on 8.8 min of labelled digits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"plot -> {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models, a few steps each (the test)")
    p.add_argument("--data", default=str(ROOT / "runs" / "ssl_budget" / "digits_corpus"),
                   help="generated pretraining corpus (made on the first run, reused after)")
    p.add_argument("--work-dir", default=str(ROOT / "runs" / "ssl_budget" / "work"), help="run dirs and logs")
    p.add_argument("--plot", default=None, help="write the figure here (needs matplotlib)")
    args = p.parse_args()
    mode = {**(QUICK if args.quick else FULL), "quick": args.quick}
    work = Path(args.work_dir)
    (work / "runs").mkdir(parents=True, exist_ok=True)
    t0, load_start = time.time(), load_avg()

    data = pretraining_sets(args.quick, Path(args.data), work)
    log(f"pretraining audio: full {data['hours']['full']:.2f} h, quarter {data['hours']['quarter']:.2f} h")
    models = mode["models"]
    ssl = {name: pretrain(name, models[name], data["full"], mode, work) for name in ("slim", "wide", "small", "large")}
    ssl["quarter"] = pretrain("quarter", models["slim"], data["quarter"], mode, work)
    ft = {name: finetune(name, models["slim" if name == "quarter" else name], ssl[name]["ckpt"], mode, work)
          for name in ssl}
    ft["scratch"] = finetune("scratch", models["slim"], None, mode, work)
    if not args.quick:  # the seed-to-seed spread of the same training, to judge the differences by
        ft["scratch_seed1"] = finetune("scratch_seed1", models["slim"], None, mode, work, seed=1)

    metric = "wer" if min(r["dev_wer"] for r in ft.values()) < 80 else "loss"
    score = {name: r[f"dev_{metric}"] for name, r in ft.items()}
    params = {name: encoder_params(dims) for name, dims in models.items()}
    rows = []
    for name in [n for n in ("small", "slim", "large", "wide", "quarter", "scratch", "scratch_seed1") if n in ft]:
        dims = models["slim" if name in ("quarter", "scratch", "scratch_seed1") else name]
        s = ssl.get(name)
        rows.append([name, f"{dims[0]}x{dims[1]}", params["slim" if dims == models["slim"] else name] / 1e6,
                     "full" if name not in ("quarter", "scratch", "scratch_seed1") else name.split("_")[0],
                     s["steps"] if s else 0, s["flops"] if s else 0.0, s["audio_hours_seen"] if s else 0.0,
                     s["ssl_dev_loss"] if s else float("nan"), ft[name]["dev_loss"], ft[name]["dev_wer"]])
    print_table([("run", "<14"), ("enc DxL", "<8"), ("params M", ">8.2f"), ("pretrain", "<8"), ("SSL steps", ">9d"),
                 ("SSL FLOPs", ">10.3g"), ("audio h", ">7.2f"), ("SSL dev", ">7.3f"), ("ft dev loss", ">11.3f"),
                 ("ft WER %", ">8.1f")], rows)
    res = {"ssl_vs_scratch": {"ssl": score["slim"], "scratch": score["scratch"],
                              "scratch_seed1": score.get("scratch_seed1"), "metric": metric},
           "slim_vs_wide": {"slim": score["slim"], "wide": score["wide"], "metric": metric,
                            "params": {"slim": params["slim"], "wide": params["wide"]}},
           "data_size": {"full": score["slim"], "quarter": score["quarter"], "metric": metric,
                         "hours": data["hours"], "audio_hours_seen": {
                             "full": ssl["slim"]["audio_hours_seen"], "quarter": ssl["quarter"]["audio_hours_seen"]}},
           "size_sweep": [{"name": n, "enc_d_model": models[n][0], "enc_layers": models[n][1], "params": params[n],
                           "pretrain_steps": ssl[n]["steps"], "pretrain_flops": ssl[n]["flops"],
                           "audio_hours_seen": ssl[n]["audio_hours_seen"], "ssl_dev_loss": ssl[n]["ssl_dev_loss"],
                           "score": score[n], "dev_loss": ft[n]["dev_loss"], "dev_wer": ft[n]["dev_wer"]}
                          for n in ("small", "slim", "large")],
           "budget_flops": mode["budget_flops"], "finetune_steps": mode["finetune_steps"], "quick": args.quick,
           "pretraining_audio": data["source"], "ssl": ssl, "finetune": ft, "cores": cores(),
           "load_avg": {"start": load_start, "end": load_avg()}, "total_s": time.time() - t0}
    if args.plot:
        plot(res, Path(args.plot))
    print_json(res)


if __name__ == "__main__":
    main()
