"""What the benchmarks share, so that each of them is only its experiment.

Every benchmark is a straight-line script that prints progress on stderr, a table on stdout, and
then its results as one JSON object on the last line, which bench/report.py parses. The pieces:
paths in the checkout, progress lines, a fixed-width table and the JSON line; the command-line
flags for width, threads and device, and random-weight models at a given layout; running the
checkout's scripts (train.py, oom.py, tools/) as logged subprocesses and reading train.py's
per-step metrics back; the batch-size arithmetic of bucketed schemes.

Only the standard library is imported at the top: sampler_bench.py measures the memory of processes
that import this file, and torch would add hundreds of MB to them. Functions that need torch, yaml
or aed import them where they are used.
"""

import contextlib
import importlib
import json
import logging
import math
import os
import re
import shlex
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


def print_json(result: dict) -> None:
    """The benchmark's results, as the last line it prints (read back by last_json). A value that was
    not measured (NaN) or has no bound (inf) is null: strict JSON, which jq and other languages parse."""
    def strict(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: strict(v) for k, v in x.items()}
        return [strict(v) for v in x] if isinstance(x, (list, tuple)) else x

    print(json.dumps(strict(result), allow_nan=False))


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


# --- the machine ---------------------------------------------------------------------------------

def cores() -> int:
    return len(os.sched_getaffinity(0))


def load_avg() -> list:
    """1, 5 and 15 min load averages: how much other jobs competed with a timing."""
    return [round(x, 2) for x in os.getloadavg()]


def add_device_args(parser, threads: int = 1) -> None:
    parser.add_argument("--threads", type=int, default=threads, help="CPU threads; 1 avoids thrashing a shared machine")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")


def device_from_args(args):
    """Applies --threads; returns the --device as a torch.device."""
    import torch

    torch.set_num_threads(args.threads)
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


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


def python_script(args: list, log_path: Path, in_process: bool = False) -> None:
    """`python SCRIPT ...` (args[0]: a script with a main(argv): train.py, oom.py, or a bench/ script
    that starts no processes of its own) as run_script runs it; or, in_process, that main() in this
    process with its log and output written to log_path, which spares a benchmark's short runs
    (--quick) importing torch and aed again each time."""
    if not in_process:
        run_script(args, log_path)
        return
    if str(ROOT) not in sys.path:  # the root scripts import as modules (bench/ is on the path already)
        sys.path.insert(0, str(ROOT))
    script = importlib.import_module(Path(args[0]).stem)

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


# --- batch sizes of bucketed schemes ----------------------------------------------------------------

def max_duration_sizes(bins, max_duration: float) -> list:
    """Per-bucket batch sizes of a padded-duration budget (n x d <= max_duration), as the sampler sets them."""
    from sampler import BucketingSampler

    return BucketingSampler([], bins, max_duration=max_duration, rank=0, world_size=1).sizes


def epoch_batch(bins, sizes: list) -> float:
    """Mean batch size over an epoch, from the bins' occupancy: sum(n_b) / sum(n_b / size_b), where
    bucket b holds n_b examples and batches of size_b (sizes: flat, in bins.buckets() order)."""
    counts = [c for row in bins.counts for c in row]
    return sum(counts) / sum(n / s for n, s in zip(counts, sizes) if n)
