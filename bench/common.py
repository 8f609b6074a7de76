"""What the benchmarks share, so that each of them is only its experiment; benchmarks import this
file and never each other.

Every benchmark is a straight-line script that prints progress on stderr, a table on stdout, and
then its results as one JSON object on the last line, which bench/report.py parses. A script with
several experiments takes the experiment as its first argument (`run_modes`). The pieces: paths in
the checkout, progress lines, a fixed-width table and the JSON line; the command-line flags for
width, threads and device, and random-weight models at a given layout; synthetic workloads and a
streamed JSONL source for the sampler; running the checkout's scripts (train.py, oom.py, infer.py, tools/)
as logged subprocesses and reading train.py's per-step metrics back; training runs of batch
schemes (train_bench.py, report.py's E2 and E4); the batch-size arithmetic of bucketed schemes.

Only the standard library is imported at the top: sampler_bench.py measures the memory of processes
that import this file, and torch would add hundreds of MB to them. Functions that need numpy,
torch, yaml or aed import them where they are used.
"""

import argparse
import contextlib
import importlib
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "configs" / "tiny.yaml"
MINI_TOKENIZER = ROOT / "data" / "mini" / "tokenizer"
LAYOUTS = {  # name: (encoder layers, decoder layers), as in configs/canary-*.yaml
    "canary-1b (24+24)": (24, 24),
    "24+4": (24, 4),
    "canary-1b-flash (32+4)": (32, 4),
}


# --- output: progress on stderr, a table and one JSON line on stdout -------------------------------

def log(msg: str) -> None:
    """A timestamped progress line on stderr: stdout holds only the table and the JSON line."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def show_library_logs() -> None:
    """Progress that oom.py and sampler.py log (their bucket-by-bucket searches), in log()'s format."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)


def print_table(columns: list, rows: list) -> None:
    """A fixed-width table. columns: (title, format spec) pairs, e.g. ("layout", "<24"), ("RTFx", ">8.1f");
    rows: lists of values in column order. A title takes its column's width and alignment (numbers
    right, text left unless the spec says otherwise), so header and rows cannot drift apart."""
    titles = []
    for title, spec in columns:
        align, width, kind = re.fullmatch(r"([<>^]?)(\d*)(?:\.\d+)?([a-z%]?)", spec).groups()
        titles.append(f"{title:{align or ('<' if kind in ('', 's') else '>')}{width}}")
    header = " ".join(titles)
    print(header)
    print("-" * len(header))
    for row in rows:
        print(" ".join(f"{value:{spec}}" for value, (_, spec) in zip(row, columns)))


def json_line(result: dict) -> str:
    """`result` as one line of strict JSON, which jq and other languages parse: a value that was not
    measured (NaN) or has no bound (inf) is null."""
    def strict(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: strict(v) for k, v in x.items()}
        return [strict(v) for v in x] if isinstance(x, (list, tuple)) else x

    return json.dumps(strict(result), allow_nan=False)


def print_json(result: dict) -> None:
    """The benchmark's results, as the last line it prints (read back by last_json)."""
    print(json_line(result))


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


# --- the machine ---------------------------------------------------------------------------------

def cores() -> int:
    return len(os.sched_getaffinity(0))


def load_avg() -> list:
    """1, 5 and 15 min load averages: how much other jobs competed with a timing."""
    return [round(x, 2) for x in os.getloadavg()]


def proc_status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status in bytes (Linux): VmRSS, the resident
    set, or VmHWM, its high-water mark."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))  # given in kB


def reset_peak_rss() -> None:
    """Starts VmHWM again from the current resident set (Linux), so that a later peak is the highest since."""
    Path("/proc/self/clear_refs").write_text("5")


def add_device_args(parser, threads: int = 1) -> None:
    parser.add_argument("--threads", type=int, default=threads, help="CPU threads; 1 avoids thrashing a shared machine")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")


def device_from_args(args):
    """Applies --threads; returns the --device as a torch.device."""
    import torch

    torch.set_num_threads(args.threads)
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def sync(device) -> None:
    """Wait for the device's queued work, so that a wall time is the work's own (a CPU has none)."""
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def timed(fn, device=None, repeats: int = 1) -> tuple:
    """(best wall time of `repeats` runs of fn(), the last run's output), the device synchronised
    around each: the minimum is the least disturbed by other jobs."""
    best, out = float("inf"), None
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best, out


def manifest_rows(manifest) -> list[dict]:
    """A JSONL manifest's lines as dicts, each audio_filepath resolved against the manifest's folder."""
    manifest = Path(manifest)
    with open(manifest, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:
        row["audio_filepath"] = str((manifest.parent / row["audio_filepath"]).resolve())
    return rows


# --- several experiments in one script -----------------------------------------------------------

def run_modes(doc: str, modes: dict, default: str, argv: list | None = None) -> None:
    """`SCRIPT [MODE] [flags]`: MODE picks one of `modes` ({name: (add_flags(parser), run(args), help)}),
    `default` when the first argument names none, so a script's flags from before it had modes keep
    working without one. `SCRIPT --help` lists the modes, `SCRIPT MODE --help` a mode's flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="mode", metavar="MODE", help=f"one of {list(modes)} (default: {default})")
    for name, (add_flags, _, what) in modes.items():
        add_flags(sub.add_parser(name, help=what, description=what))
    if not argv or (argv[0] not in modes and argv[0] not in ("-h", "--help")):
        argv.insert(0, default)
    args = top.parse_args(argv)
    modes[args.mode][1](args)


# --- random-weight models ------------------------------------------------------------------------

def add_width_args(parser, d_model: int, subsampling_channels: int, heads: int = 8) -> None:
    """The shared width of a benchmark's models; Canary's are 1024, 256 and 8."""
    parser.add_argument("--d-model", type=int, default=d_model, help="encoder and decoder width (Canary: 1024)")
    parser.add_argument("--heads", type=int, default=heads, help="attention heads (Canary: 8)")
    parser.add_argument("--subsampling-channels", type=int, default=subsampling_channels,
                        help="Canary: 256; scaled with the width")


def random_aed(args, enc_layers: int, dec_layers: int, seed: int = 0, **config):
    """An AED with random weights at the width of add_width_args; speed and memory do not depend on the
    weights, and the seed makes every run of a benchmark build the same model. `config` overrides
    the AEDConfig defaults used here: Canary's 128 mels and 5248 tokens, 1024 decoder positions."""
    import torch

    from aed.model import AED, AEDConfig

    cfg = AEDConfig(**{"n_mels": 128, "vocab_size": 5248, "dec_max_len": 1024, "enc_d_model": args.d_model,
                       "dec_d_model": args.d_model, "enc_heads": args.heads, "dec_heads": args.heads,
                       "subsampling_channels": args.subsampling_channels, "enc_layers": enc_layers,
                       "dec_layers": dec_layers, **config})
    torch.manual_seed(seed)
    return AED(cfg)


PRESETS = {name: ROOT / "configs" / f"{name}.yaml" for name in ("canary-180m-flash", "canary-1b-flash")}


def fixed_work(model, tokenizer):
    """A random-weight model as infer.py loads one (a LoadedModel), EOS never chosen: every utterance
    decodes all the tokens it may (fixed work)."""
    import torch

    from aed.data_audio import FeatureConfig
    from aed.model_checkpoint import LoadedModel

    with torch.no_grad():
        model.decoder.output_proj.bias[tokenizer.eos] = -1e9
    return LoadedModel(model, tokenizer, FeatureConfig(), "random weights")


def random_asr(preset: str, tokenizer, device, ctc_loss_weight: float = 0.0):
    """The preset at full width (Canary's vocabulary and 128 mels), random weights, EOS never chosen;
    with a CTC head on the encoder when `ctc_loss_weight` > 0 (the released Canary models have none)."""
    import dataclasses

    import torch

    from aed.model import AED, AEDConfig

    torch.manual_seed(0)
    cfg = AEDConfig.from_yaml(PRESETS[preset])
    if ctc_loss_weight:
        cfg = dataclasses.replace(cfg, ctc_loss_weight=ctc_loss_weight)
    return fixed_work(AED(cfg).to(device).eval(), tokenizer)


# --- workloads: synthetic corpora, and a JSONL manifest streamed to the sampler -------------------

def synthetic_corpus(n: int, seed: int = 0) -> list:
    """A large ASR/AST corpus: 64% of utterances 2-20 s, 28% a tail to 40 s, 4% long recordings with
    little speech, 3% under 2 s, 1% high-TPS outliers (2-4x); 3.4 +- 0.5 tokens/s plus a 6-token prompt."""
    import numpy as np

    rng = np.random.default_rng(seed)
    kind = rng.choice(5, size=n, p=[0.64, 0.28, 0.04, 0.03, 0.01])
    d = np.empty(n)
    tps = rng.normal(3.4, 0.5, n).clip(1.0, None)
    m = kind == 0  # the bulk, skewed towards longer utterances
    d[m] = 2 + 18 * rng.beta(2.5, 1.2, m.sum())
    m = kind == 1  # tail up to 40 s
    d[m] = 20 + 20 * rng.beta(1.0, 1.8, m.sum())
    m = kind == 2  # long recordings with little speech
    d[m] = rng.uniform(28, 40, m.sum())
    tps[m] = rng.uniform(0.0, 1.2, m.sum())
    m = kind == 3  # very short
    d[m] = rng.uniform(0.5, 2.0, m.sum())
    m = kind == 4  # long-transcript outliers (e.g. hallucinated synthetic labels)
    d[m] = rng.uniform(1.0, 20.0, m.sum())
    tps[m] *= rng.uniform(2.0, 4.0, m.sum())
    d = d.round(2)
    t = (tps * d).astype(int) + 6
    return [{"id": i, "duration": float(a), "num_tokens": int(b)} for i, (a, b) in enumerate(zip(d, t))]


def wide_corpus(n: int, seed: int = 0) -> list:
    """A corpus whose speech rate varies widely: speakers, languages and tokenizations
    from ~0.5 to ~6 tokens/s, 0.5-40 s, 6% long segments with little speech, 1% transcript
    outliers (3-5x); plus the 6-token prompt and EOS as in synthetic_corpus."""
    import numpy as np

    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=n, p=[0.93, 0.06, 0.01])
    d = np.clip(0.5 + 39.5 * rng.beta(1.3, 3.0, n), 0.5, 40.0)
    tps = np.exp(rng.uniform(np.log(0.5), np.log(6.0), n))  # rates spread evenly on a log scale
    m = kind == 1  # long recordings with little speech
    d[m] = rng.uniform(15.0, 40.0, m.sum())
    tps[m] = rng.uniform(0.02, 0.4, m.sum())
    m = kind == 2  # long-transcript outliers (e.g. hallucinated synthetic labels)
    tps[m] *= rng.uniform(3.0, 5.0, m.sum())
    d = d.round(2)
    t = (tps * d).astype(int) + 6
    return [{"id": i, "duration": float(a), "num_tokens": int(b)} for i, (a, b) in enumerate(zip(d, t))]


# Tokens per second of speech by language with Canary's tokenizer (1024 BPE per language): about
# 2.7 words/s x 1.25 tokens/word in English, more tokens per word in German, Spanish and French.
PAPER_LANGUAGES = {"en": (0.5, 3.4), "de": (0.17, 4.2), "es": (0.17, 4.4), "fr": (0.16, 4.0)}


def paper_corpus(n: int, seed: int = 0) -> list:
    """A workload shaped like Canary's training data (0.5-40 s, four languages), for the E2 table.

    Durations: 3% very short (0.5-2 s); 62% segmented speech 2-20 s, skewed long (beta(2.5, 1.2));
    28% a tail to 40 s (long-form audio segmented at 40 s); 6% long low-speech segments (20-40 s
    of music, silence or a few words: 0.05-0.8 tokens/s); 1% long-transcript outliers (1-20 s whose
    rate is 3-10x the speaker's: hallucinated or misaligned synthetic labels, mostly above the
    paper's 25 tokens/s filter). Speech rate: the language's tokens/s (PAPER_LANGUAGES) times a
    per-speaker log-normal factor (sigma 0.2). num_tokens adds the 5-token prompt and EOS.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    weights, rates = zip(*PAPER_LANGUAGES.values())
    lang = rng.choice(len(rates), size=n, p=weights)
    tps = np.array(rates)[lang] * np.exp(rng.normal(0.0, 0.2, n))
    kind = rng.choice(5, size=n, p=[0.03, 0.62, 0.28, 0.06, 0.01])
    d = np.empty(n)
    m = kind == 0  # very short
    d[m] = rng.uniform(0.5, 2.0, m.sum())
    m = kind == 1  # segmented speech
    d[m] = 2 + 18 * rng.beta(2.5, 1.2, m.sum())
    m = kind == 2  # long-form tail
    d[m] = 20 + 20 * rng.beta(1.0, 1.8, m.sum())
    m = kind == 3  # long low-speech segments
    d[m] = rng.uniform(20.0, 40.0, m.sum())
    tps[m] = rng.uniform(0.05, 0.8, m.sum())
    m = kind == 4  # long-transcript outliers
    d[m] = rng.uniform(1.0, 20.0, m.sum())
    tps[m] *= rng.uniform(3.0, 10.0, m.sum())
    d = d.round(2)
    t = np.round(tps * d).astype(int) + 6
    return [{"id": i, "duration": float(a), "num_tokens": int(b)} for i, (a, b) in enumerate(zip(d, t))]


def model_batch_sizes(bins, budget: float = 720.0) -> list:
    """Stand-in for oom.py: memory ~ batch * (d + d^2/30 + tokens/6) with d, tokens the bucket bounds."""
    sizes = [max(1, int(budget / (d + d * d / 30 + t / 6))) for d, t in bins.buckets()]
    it = iter(sizes)
    return [[next(it) for _ in range(k)] for k in bins.shape]


class JsonlSource:
    """A JSONL manifest as a streamed source of the sampler (the protocol in sampler.py's docstring),
    read in file order: rank r of R keeps the lines i with i % R == r (the sampler's buffer
    shuffles). Keys are (line number, byte offset), so `get` re-reads a line by seeking; a cursor is
    the (line number, byte offset) of the next line. Examples are the lines' JSON objects."""

    def __init__(self, path):
        self.path = str(path)
        self._file = None

    def read(self, seed: int, rank: int, world_size: int, cursor=None):
        line_no, offset = cursor or (0, 0)
        with open(self.path, "rb") as f:
            f.seek(offset)
            for line in f:
                key = (line_no, offset)
                line_no, offset = line_no + 1, offset + len(line)
                if key[0] % world_size == rank and line.strip():
                    yield key, (line_no, offset), json.loads(line)

    def get(self, key) -> dict:
        if self._file is None:
            self._file = open(self.path, "rb")
        self._file.seek(key[1])
        return json.loads(self._file.readline())

    def describe(self, key) -> str:
        return f"{self.path}:{key[0] + 1}"


# --- the checkout's scripts as subprocesses ------------------------------------------------------

def write_config(path: Path, **sections) -> Path:
    """configs/tiny.yaml with keys of its sections changed, e.g. model={"enc_layers": 8}: one YAML that
    train.py and oom.py both read."""
    import yaml

    doc = yaml.safe_load(TINY_CONFIG.read_text())
    for section, changes in sections.items():
        doc[section].update(changes)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_script(args: list, log_path: Path, threads: int = 1, append: bool = False) -> None:
    """`python *args` from the repository root with `threads` OpenMP threads, stdout and stderr into
    log_path. A failure ends the benchmark, quoting the end of the log."""
    log(f"$ {shlex.join(str(a) for a in args)}")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log_path, "a" if append else "w") as f:
        code = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, stdout=f,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        script_failed(args[0], code, log_path)


# The package's commands that the checkout's scripts start: what runs in process in their place.
COMMANDS = {"train.py": "aed.cli_train", "oom.py": "aed.cli_oom", "infer.py": "aed.cli_infer"}


def python_script(args: list, log_path: Path, in_process: bool = False, threads: int = 1) -> None:
    """`python SCRIPT ...` (args[0]: train.py, oom.py, infer.py, or a bench/ script with a main(argv) that
    starts no processes of its own) as run_script runs it; or, in_process, that main() in this process
    (the top-level scripts': their package commands, COMMANDS) with its log and output written to
    log_path, which spares a benchmark's short runs (--quick) importing torch and aed again each time."""
    if not in_process:
        run_script(args, log_path, threads)
        return
    if str(ROOT) not in sys.path:  # aed without an install (bench/ is on the path already)
        sys.path.insert(0, str(ROOT))
    script = importlib.import_module(COMMANDS.get(str(args[0]), Path(args[0]).stem))

    log(f"$ {shlex.join(str(a) for a in args)}  (in this process)")
    root, cwd = logging.getLogger(), os.getcwd()
    with open(log_path, "w") as f, contextlib.redirect_stdout(f):
        handler = logging.StreamHandler(f)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        root.addHandler(handler)  # before main: its logging.basicConfig then adds no stderr handler
        root.setLevel(logging.INFO)
        os.chdir(ROOT)
        try:
            script.main([str(a) for a in args[1:]])
            code = 0
        except SystemExit as e:  # main's own exit, with a status or a message (the log's last line)
            code = e.code or 0
            if code:
                print(code)
        finally:
            os.chdir(cwd)
            root.removeHandler(handler)
    if code != 0:
        script_failed(args[0], code, log_path)


def script_failed(script: str, code: int, log_path: Path):
    tail = "\n".join(log_path.read_text().splitlines()[-15:])
    raise SystemExit(f"{script} exited with {code}; last lines of {log_path}:\n{tail}")


def read_metrics(run_dir: Path) -> list:
    """train.py's RUN_DIR/metrics.jsonl rows. While train.py runs, its last line may be half written:
    only whole lines count."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in open(path) if line.endswith("\n")] if path.exists() else []


def step_totals(rows: list) -> dict:
    """Training steps logged by train.py (log_every=1) summed: valid audio seconds and tokens, the
    element-weighted padding of all of them together (1 - valid / padded, in %), the mean batch size
    and the peak memory."""
    audio = [r["train/audio_s_per_s"] * r["train/step_time"] for r in rows]  # valid audio s of each step
    tokens = [r["train/tokens_per_s"] * r["train/step_time"] for r in rows]
    padded_audio = sum(a / (1 - r["train/audio_padding"] / 100) for a, r in zip(audio, rows))
    padded_tokens = sum(t / (1 - r["train/text_padding"] / 100) for t, r in zip(tokens, rows))
    return {"steps": len(rows), "batch": sum(r["train/batch_size"] for r in rows) / len(rows),
            "audio_s": sum(audio), "tokens": sum(tokens),
            "audio_padding": 100 * (1 - sum(audio) / padded_audio),
            "text_padding": 100 * (1 - sum(tokens) / padded_tokens),
            "memory_gb": max(r["train/memory_gb"] for r in rows)}


# --- batch schemes trained for real: train_bench.py and report.py's E2 and E4 ----------------------

def fixed_overrides(batch_size: int) -> list:
    """train.py overrides of the fixed scheme: one bucket, `batch_size` examples of any length per
    batch, every batch padded to its longest."""
    return ["train.num_buckets=1", "train.sub_buckets=1", f"train.batch_size={batch_size}", "train.max_duration=null"]


def worst_bucket(setup, bins, sizes: list, max_tps=None, budget: int = 1 << 40) -> int:
    """The memory a scheme must provision: the peak bytes of its worst bucket, one real step at every
    bucket's bounds and batch size (aed.memory_oomptimizer.preflight; CPU: live tensor bytes).
    setup: aed.train_setup.load_training_setup of the run's config."""
    from aed.memory_oomptimizer import TrainingStep, preflight

    return max(preflight(TrainingStep.of(setup), setup.bucket_shapes(bins, max_tps), sizes, budget))


def oom_sizes(config, outputs: list, budget: int, log_path: Path, *flags, threshold: float = 0.1,
              device="cpu", threads: int = 1, in_process: bool = False) -> None:
    """oom.py's per-bucket batch sizes of `config` for a memory budget that is already a measured
    peak (margin 0); outputs: its -o and/or --out flags with their paths, flags: any others."""
    python_script(["oom.py", "--config", config, *outputs, "--memory-budget", budget, "--margin", "0",
                   "--threshold", threshold, "--device", device, *flags], log_path, in_process, threads)


def train_run(name: str, config, overrides: list, work: Path, *, steps: int | None = None,
              budget_s: float | None = None, val_every: int = 0, threads: int = 1, warmup: int = 0,
              in_process: bool = False) -> dict:
    """One train.py run of a scheme in work/runs/NAME, its log work/train_NAME.log: `steps` steps
    (in this process with in_process), or stopped once its logged step times add up to `budget_s`
    seconds of training (SIGTERM; then one more step, which ends with a validation at the budget).
    val_every 0: no validation. Returns train_summary of its metrics, after `warmup` steps."""
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a run left by an earlier benchmark would be resumed
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    base = ["train.py", str(config), f"run_dir={run_dir}", "log_every=1", "keep_last=1", f"cpu_threads={threads}",
            *overrides]
    log_path = work / f"train_{name}.log"
    t0 = time.time()
    if budget_s is None:
        python_script(base + [f"max_steps={steps}", f"val.every={val_every}", f"ckpt_every={steps}"], log_path,
                      in_process, threads)
        restarts = {1}
    else:
        last = _train_until(base + ["max_steps=10000000", f"val.every={val_every}", "ckpt_every=10000000"],
                            run_dir, budget_s, threads, log_path)
        # Resume for one more step, which ends with a validation at the budget.
        run_script(base + [f"max_steps={last + 1}", f"val.every={last + 1}", f"ckpt_every={last + 1}"], log_path,
                   threads, append=True)
        restarts = {1, last + 1}
    log(f"[{name}] done in {time.time() - t0:.0f} s")
    return train_summary(read_metrics(run_dir), restarts, warmup) | {"wall_s": time.time() - t0}


def _train_until(cmd: list, run_dir: Path, budget_s: float, threads: int, log_path: Path) -> int:
    """`python *cmd` (train.py) stopped by SIGTERM once its training clock reaches budget_s; train.py
    then saves a checkpoint and exits 0. Returns the last step it logged."""
    log(f"$ {shlex.join(cmd)}  (SIGTERM after {budget_s:g} s of training)")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log_path, "w") as f:
        proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(1)
            if max(step_clock(read_metrics(run_dir), {1}).values()) >= budget_s:
                proc.send_signal(signal.SIGTERM)
                proc.wait()
    if proc.returncode != 0:
        script_failed("train.py", proc.returncode, log_path)
    return max(r["step"] for r in read_metrics(run_dir) if "train/step_time" in r)


def step_clock(rows: list, restarts: set) -> dict:
    """step -> training seconds at its end: the running sum of logged step times, where a step
    logged right after a validation or a (re)start counts as the median step (its logged time
    includes the validation or the DataLoader start)."""
    import statistics

    train = [r for r in rows if "train/step_time" in r]
    after = {r["step"] + 1 for r in rows if "val/dev/loss" in r} | restarts
    median = statistics.median(r["train/step_time"] for r in train) if train else 0.0
    clock, t = {0: 0.0}, 0.0
    for r in train:
        t += median if r["step"] in after else r["train/step_time"]
        clock[r["step"]] = t
    return clock


def train_summary(rows: list, restarts: set, warmup: int = 0) -> dict:
    """A run's training steps after the first `warmup` (step_totals: batch size, padding, memory),
    their training seconds by step_clock, the rates per training second, and the validation curve."""
    train = [r for r in rows if "train/step_time" in r]
    if len(train) <= warmup:
        raise SystemExit(f"{len(train)} training steps logged: none left after skipping {warmup} warm-up steps")
    clock = step_clock(rows, restarts)
    seconds = clock[train[-1]["step"]] - (clock[train[warmup - 1]["step"]] if warmup else 0.0)
    totals = step_totals(train[warmup:])
    val = [{"step": r["step"], "seconds": clock[r["step"]], "loss": r["val/dev/loss"], "wer": r.get("val/dev/wer")}
           for r in rows if "val/dev/loss" in r]
    return totals | {"seconds": seconds, "step_time": seconds / totals["steps"],
                     "audio_s_per_s": totals["audio_s"] / seconds, "tokens_per_s": totals["tokens"] / seconds,
                     "audio_hours": totals["audio_s"] / 3600, "val": val}


# --- batch sizes of bucketed schemes ----------------------------------------------------------------

def max_duration_sizes(bins, max_duration: float) -> list:
    """Per-bucket batch sizes of a padded-duration budget (n x d <= max_duration), as the sampler sets them."""
    from sampler import BucketingSampler

    return BucketingSampler([], bins, max_duration=max_duration, rank=0, world_size=1).sizes


def flat_sizes(sizes: list) -> list:
    """Per-bucket batch sizes in bins.buckets() order (oom.py writes a list per duration bin)."""
    return [s for row in sizes for s in row] if isinstance(sizes[0], list) else list(sizes)


def epoch_batch(bins, sizes: list) -> float:
    """Mean batch size over an epoch, from the bins' occupancy: sum(n_b) / sum(n_b / size_b), where
    bucket b holds n_b examples and batches of size_b (sizes: flat, in bins.buckets() order)."""
    counts = [c for row in bins.counts for c in row]
    return sum(counts) / sum(n / s for n, s in zip(counts, sizes) if n)
