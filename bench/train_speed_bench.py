"""The training step's own speed: per bucket, step time, audio seconds and output tokens per second,
model TFLOP/s and MFU, peak memory and where the time goes; eager against compiled, with and
without activation checkpointing, AdamW's fused kernel against torch's default.

    python bench/train_speed_bench.py configs/tiny.yaml                                   # CPU, 4 buckets
    python bench/train_speed_bench.py configs/tiny.yaml --compile both --checkpointing none both
    python bench/train_speed_bench.py configs/tiny.yaml --compile both --interleave  # eager and compiled in turn
    python bench/train_speed_bench.py configs/laptop.yaml --fused both --buckets 2
    python oom.py --config configs/canary-1b-flash.yaml --manifest train.jsonl -o bs.json   # on the GPU
    python bench/train_speed_bench.py configs/canary-1b-flash.yaml --batch-sizes bs.json --compile both

The step is train.py's (`aed.train_setup.train_step`: the config's precision policy, SpecAugment,
the CTC head where configured, AdamW with gradient clipping), built by the same
`build_training_setup`, under DDP or FSDP2 over a process group of one (the config's
train.strategy). `--compile on` compiles every encoder layer and decoder block as
`train.compile=true` does; `--checkpointing` sets `activation_checkpointing`, `--fused`
`optim.fused`.

Shapes: every measured bucket's upper bounds (duration, feature frames, tokens) at its batch size,
from oom.py's output (--batch-sizes) or, without it, from bins estimated on the config's
train.manifests and train.max_duration's sizes; --buckets picks that many spread from the shortest
to the longest. Batches are artificial (random features and tokens, every row at the bounds), so
audio seconds and tokens per second are those of full buckets: real batches hold a little less.
Each bucket runs --warmup steps (the first compiles a new shape), then --steps timed ones.
Variants run one after the other, or with --interleave all built at once, their steps taken in
turn: on a shared machine, whose speed moves by 10-25% from run to run, the ratios between
variants then hold better than their absolute figures. --save writes the results so far after
every bucket, for runs under a time limit (a job's, or `timeout`'s).

Columns: step ms (median); audio s/s and tokens/s (batch x bounds / step time); TFLOP/s from
aed's FLOP counter (matmuls, convolutions and attention, counted once per shape on the eager plain
step: model FLOPs, without the recomputation of checkpointing); MFU against the device's dense
peak from `PEAKS` (GPUs) and against the matmul peak measured here (train.py's progress line's);
peak memory (CUDA: max allocated; CPU: live tensors, eager steps only); forward, backward and
optimizer ms from steps timed phase by phase (train_step's calls in its order, the device
synchronised between them: medians, which need not add up to the step's). Waiting for data is not
part of a step: train.py's progress line reports it for a real run (`data` share). `--profile N`
logs the N ops one step spends most time in, per bucket. `--trace DIR` profiles `--trace-steps`
steps of every variant and bucket with torch.profiler: DIR/VARIANT-BUCKET.json.gz is the trace
(chrome://tracing, Perfetto), and each row gets `kernels`, where the time goes (`kernel_summary`):
shares of the steps' wall time in matrix products, attention, convolutions, normalisation and
elementwise kernels, the optimizer, other kernels, and the host gaps in which the device waited for
the host (launches, Python, synchronisations); waiting for data is none here (the batches are made
in advance), and the top kernels by time. "all" rows: the measured buckets together
(equal steps per bucket). Last line: JSON with every row, per variant, and the compiled/eager and
fused/default ratios of audio seconds per second.
"""

import argparse
import gzip
import re
import shutil
import statistics
import time
from pathlib import Path

import torch
from common import (ROOT, cores, flat_sizes, json_line, load_avg, log, max_duration_sizes, print_json, print_table,
                    show_library_logs)
from torch.nn.parallel import DistributedDataParallel

from aed.train_data import bins_from_manifests
from aed.data_sources import ManifestEntry
from aed.memory_measure import format_bytes, peak_memory
from aed.memory_oomptimizer import artificial_batch
from aed.train_config import load_train_config
from aed.train_distributed import init_distributed
from aed.train_progress import CountFlops, matmul_peak
from aed.train_setup import autocast, build_training_setup, compile_layers, count_targets, train_step
from bins import load_batch_sizes

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from the vendors' data sheets; matched by name.
PEAKS = {"H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "A10G": 70.0,
         "L4": 121.0}


def device_peak(device: torch.device) -> float | None:
    """The data-sheet bf16 peak of a CUDA device in FLOP/s (first matching name in PEAKS), or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAKS.items() if key in name), None)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "CPU")
    return f"{cpu}, {torch.get_num_threads()} threads"


def bucket_table(cfg, setup, batch_sizes: str | None) -> list:
    """[(duration s, frames, tokens, batch size)] of every bucket that takes batches."""
    if batch_sizes:
        bins, sizes = load_batch_sizes(batch_sizes)
    else:
        entries = [ManifestEntry.of(s) for s in cfg.train.manifests]
        if any(e.streamed for e in entries):
            raise SystemExit("streamed train.manifests: give --batch-sizes (oom.py's output for their bins)")
        paths = [e.path for e in entries if not e.nonspeech]  # bins of the speech: non-speech has no text
        bins, _ = bins_from_manifests([str(ROOT / p) for p in paths], setup.tokenizer, cfg.train.num_buckets,
                                      cfg.train.sub_buckets, cfg.train.bin_method, seed=cfg.seed)
        sizes = max_duration_sizes(bins, cfg.train.max_duration)
    return [(*shape, n) for shape, n in zip(setup.bucket_shapes(bins, cfg.train.max_tps), flat_sizes(sizes)) if n > 0]


def spread(items: list, k: int) -> list:
    """k items spread evenly from the first to the last."""
    return items if k >= len(items) else [items[round(i * (len(items) - 1) / max(1, k - 1))] for i in range(k)]


class Bench:
    """One variant's model and optimizer (compiled or not, checkpointed or not, fused or not) and its timed steps."""

    def __init__(self, cfg, device, strategy: str, compiled: bool, name: str = ""):
        self.setup = build_training_setup(cfg, device)
        self.device, self.compiled, self.name = device, compiled, name
        self.module = self.setup.model
        self.model = DistributedDataParallel(self.module) if strategy == "ddp" else self.module

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def batch(self, batch_size, frames, tokens):
        return artificial_batch(batch_size, frames, tokens, self.module.cfg.n_mels, self.setup.tokenizer.vocab_size,
                                self.device)

    def step(self, batch):
        """train.py's step on `batch`."""
        s = self.setup
        return train_step(self.model, [batch], s.optimizer, s.scaler, s.spec_augment, s.precision,
                          s.cfg.optim.clip_grad, count_targets(self.module, [batch]))

    def phases(self, batch) -> tuple[float, float, float]:
        """Seconds of the forward (SpecAugment, model, loss), the backward and the update (unscale, clip,
        AdamW) of one step, each timed to its end: train_step's calls, in its order, stopped between."""
        s, n = self.setup, count_targets(self.module, [batch])
        times = [self.clock()]
        s.optimizer.zero_grad(set_to_none=True)
        with autocast(self.device, s.precision):
            loss, _ = self.model(s.spec_augment(batch.feats, batch.feat_lens), batch.feat_lens, batch.tokens,
                                 batch.token_lens, batch.prompt_lens, batch.transcribed)
        times.append(self.clock())
        s.scaler.scale(loss / n).backward()
        times.append(self.clock())
        s.scaler.unscale_(s.optimizer)
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), s.cfg.optim.clip_grad)
        s.scaler.step(s.optimizer)
        s.scaler.update()
        times.append(self.clock())
        return tuple(b - a for a, b in zip(times, times[1:]))

    def clock(self) -> float:
        self.sync()
        return time.perf_counter()

    def timed_step(self, batch) -> float:
        """Seconds of one step, the device synchronised before and after."""
        t0 = self.clock()
        self.step(batch)
        return self.clock() - t0

    def model_flops(self, batch_size: int, frames: int, tokens: int) -> float:
        """FLOPs of one plain eager step at this shape (compiled blocks run eagerly, nothing is
        recomputed), counted at batch 1 and 2 and extended to `batch_size`: the count is affine in the
        batch (per-row work plus what a batch does once, e.g. projecting the relative positions), and
        a plain step at a checkpointed batch size would not fit in memory."""
        flags = [(m, m.checkpoint_activations) for m in (self.module.encoder, getattr(self.module, "decoder", None))
                 if m is not None]
        for m, _ in flags:
            m.checkpoint_activations = False
        counts = []
        try:
            for rows in (1, 2):
                with torch.compiler.set_stance("force_eager"), CountFlops() as c:
                    self.step(self.batch(rows, frames, tokens))
                counts.append(c.flops)
        finally:
            for m, on in flags:
                m.checkpoint_activations = on
        return counts[0] + (batch_size - 1) * (counts[1] - counts[0])

    def profile(self, batch):
        """torch.profiler's per-op averages of one step (`.table(sort_by=self.profile_key)`: its ops by
        their own time on the device, CUDA kernels' time on a GPU, the CPU's otherwise)."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            self.step(batch)
            self.sync()
        return prof.key_averages()

    @property
    def profile_key(self) -> str:
        return "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"

    def trace(self, batch, steps: int, path: Path) -> dict:
        """`steps` steps under torch.profiler (after one unprofiled step): the trace, gzipped, at
        `path`, and `kernel_summary` of the steps."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.step(batch)
        self.sync()
        with torch.profiler.profile(activities=activities) as prof:
            t0 = self.clock()
            for _ in range(steps):
                self.step(batch)
            wall_s = self.clock() - t0
        plain = path.with_suffix("")  # DIR/NAME.json
        prof.export_chrome_trace(str(plain))
        with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        plain.unlink()
        return kernel_summary(prof, self.device, wall_s, steps)

    def peak_bytes(self, batch) -> int | None:
        """Peak tensor memory of one step: CUDA's allocator, or on the CPU the live-tensor tracker
        (eager only: a compiled step's buffers are not all tensors the tracker sees)."""
        if self.device.type == "cpu" and self.compiled:
            return None
        state = [v for st in self.setup.optimizer.state.values() for v in st.values()]
        existing = [*self.module.parameters(), *self.module.buffers(), *state]
        self.setup.optimizer.zero_grad(set_to_none=True)
        return peak_memory(lambda: self.step(batch), self.device, None, existing)


# Kernel (GPU) or op (CPU) names -> where the time goes, the first pattern that matches; other: the rest.
KERNEL_KINDS = (
    ("optimizer", r"adam|multi_tensor|foreach|optimizer"),
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("matmul", r"gemm|matmul|aten::mm\b|aten::addmm|aten::bmm|aten::baddbmm|cutlass|xmma|cublas|nvjet|sm\d+_.*mma"),
    ("convolution", r"conv|cudnn|winograd|implicit_"),
    ("normalisation and elementwise", r"norm|elementwise|vectorized|reduce|unrolled|pointwise|triton_|silu|relu|"
     r"gelu|threshold|dropout|aten::(add|mul|sub|div|neg|copy_|fill_|zero_|where|clamp|exp|log|sigmoid|sum|mean|cat|masked)"),
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def kernel_summary(prof, device: torch.device, wall_s: float, steps: int, top: int = 15) -> dict:
    """Where `steps` profiled steps' `wall_s` seconds went: on a GPU its kernels (their union is the
    time the device was busy; the rest of the wall time, the host gaps, it waited for the host), on
    the CPU the ops' own time (the rest: Python and the framework between ops). Shares of the wall
    time by `KERNEL_KINDS`, and the `top` kernels by time, in ms per step."""
    cuda = device.type == "cuda"
    if cuda:
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        seconds = [(e.name, e.time_range.elapsed_us() / 1e6) for e in events]
        spans = sorted((e.time_range.start, e.time_range.end) for e in events)
        busy, reach = 0.0, float("-inf")  # the union of the kernels' intervals, in us
        for start, end in spans:
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        busy /= 1e6
    else:
        seconds = [(e.name, e.self_cpu_time_total / 1e6) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CPU]
        busy = sum(s for _, s in seconds)
    by_kind, by_name = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}, {}
    for name, s in seconds:
        by_kind[kind_of(name)] += s
        by_name[name] = by_name.get(name, 0.0) + s
    shares = {kind: s / wall_s for kind, s in by_kind.items()}
    shares["host gaps"] = max(0.0, 1 - busy / wall_s)
    shares["data wait"] = 0.0  # the batches are made before the steps
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"steps": steps, "wall_ms_per_step": 1e3 * wall_s / steps, "busy_ms_per_step": 1e3 * busy / steps,
            "shares": shares, "top": [[name, 1e3 * s / steps, kind_of(name)] for name, s in ranked]}


def timings(benches: list, batch, args) -> list[dict]:
    """Each variant's warm-up seconds and its timed steps and phases on `batch`. The variants take
    their steps in turn (one step of each, then the next round), so that a change in the machine's
    load during the run reaches every variant alike. With one variant, simply its steps."""
    out = []
    for bench in benches:
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            bench.step(batch)
        bench.sync()
        out.append({"warmup_s": time.perf_counter() - t0, "steps": [], "phases": []})
    for _ in range(args.steps):
        for bench, t in zip(benches, out):
            t["steps"].append(bench.timed_step(batch))
    for _ in range(args.steps):
        for bench, t in zip(benches, out):
            t["phases"].append(bench.phases(batch))
    return out


def measure(bench: Bench, bucket, batch, timing: dict, flops: float, args, peaks) -> dict:
    """One variant's row for one bucket, from its `timings` and the bucket's model FLOPs."""
    d, frames, tokens, batch_size = bucket
    step_s, warmup_s = statistics.median(timing["steps"]), timing["warmup_s"]
    forward_s, backward_s, update_s = map(statistics.median, zip(*timing["phases"]))
    peak = bench.peak_bytes(batch)
    if args.profile:
        log(f"  bucket {d:.2f} s, {tokens} tokens: one step's top {args.profile} ops by their own time\n"
            + bench.profile(batch).table(sort_by=bench.profile_key, row_limit=args.profile, max_name_column_width=70))
    kernels = None
    if args.trace:
        slug = re.sub(r"[^a-z0-9]+", "-", bench.name.lower()).strip("-")
        kernels = bench.trace(batch, args.trace_steps, Path(args.trace) / f"{slug}-{d:g}s.json.gz")
        log(f"  {bench.name}, bucket {d:.2f} s: " + ", ".join(
            f"{kind} {100 * share:.0f}%" for kind, share in kernels["shares"].items()))
    row = {"duration": d, "frames": frames, "tokens": tokens, "batch": batch_size, "step_ms": 1e3 * step_s,
           "audio_s_per_s": batch_size * d / step_s, "tokens_per_s": batch_size * tokens / step_s,
           "tflops": flops / step_s / 1e12, "flops": flops, "peak_bytes": peak, "warmup_s": warmup_s,
           "forward_ms": 1e3 * forward_s, "backward_ms": 1e3 * backward_s, "optimizer_ms": 1e3 * update_s,
           **({"kernels": kernels} if kernels else {})}
    row["mfu_sheet"] = flops / step_s / peaks["sheet"] if peaks["sheet"] else None
    row["mfu_measured"] = flops / step_s / peaks["measured"]
    log(f"  {bench.name}, bucket {d:.2f} s, {tokens} tokens, batch {batch_size}: {row['step_ms']:.1f} ms, "
        f"{row['audio_s_per_s']:.1f} audio s/s, MFU {100 * row['mfu_measured']:.1f}% of measured "
        f"(warm-up {warmup_s:.1f} s)")
    return row


def overall(rows: list, peaks) -> dict:
    """The measured buckets together, one step each: totals over total time."""
    seconds = sum(r["step_ms"] for r in rows) / 1e3
    flops_per_s = sum(r["flops"] for r in rows) / seconds
    return {"audio_s_per_s": sum(r["batch"] * r["duration"] for r in rows) / seconds,
            "tokens_per_s": sum(r["batch"] * r["tokens"] for r in rows) / seconds, "tflops": flops_per_s / 1e12,
            "peak_bytes": max((r["peak_bytes"] for r in rows if r["peak_bytes"] is not None), default=None),
            "warmup_s": sum(r["warmup_s"] for r in rows),
            "mfu_sheet": flops_per_s / peaks["sheet"] if peaks["sheet"] else None,
            "mfu_measured": flops_per_s / peaks["measured"]}


def speed_ratios(results: list) -> dict:
    """Compiled/eager and fused/default audio seconds per second of the variants measured in full."""
    speed = {(r["compiled"], r["checkpointing"], r["fused"]): r["all"]["audio_s_per_s"] for r in results if "all" in r}
    ratios = {}
    for (compiled, checkpointing, fused), v in speed.items():
        adamw = f"AdamW {'fused' if fused else 'default'}"
        if compiled and (False, checkpointing, fused) in speed:
            ratios[f"compiled/eager, checkpointing {checkpointing}, {adamw}"] = v / speed[False, checkpointing, fused]
        if fused and (compiled, checkpointing, False) in speed:
            ratios[f"AdamW fused/default, {'compiled' if compiled else 'eager'}, checkpointing {checkpointing}"] = (
                v / speed[compiled, checkpointing, False])
    return ratios


def summary(args, cfg, device, peaks, results: list) -> dict:
    """The JSON line: the run's setting, every variant's rows (and its "all" once every bucket is
    measured) and the ratios."""
    return {"config": args.config, "device": device_name(device), "torch": torch.__version__,
            "strategy": cfg.train.strategy, "peak_flops_sheet": peaks["sheet"],
            "peak_flops_measured": peaks["measured"], "load_avg": load_avg(), "interleaved": args.interleave,
            "variants": results, "ratios": speed_ratios(results)}


def save(path: str | None, result: dict) -> None:
    """--save: the results so far, written whole (a new file, then renamed over the old one)."""
    if path:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json_line(result) + "\n")
        tmp.replace(path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="+", help="train.py's YAML file(s) (model, precision, optimizer, train.strategy), "
                   "then key=value overrides, as train.py takes them")
    p.add_argument("--batch-sizes", help="oom.py's -o output (bins and per-bucket batch sizes); default: bins "
                   "estimated from train.manifests with train.max_duration's sizes")
    p.add_argument("--buckets", type=int, default=4, help="buckets measured, spread from shortest to longest")
    p.add_argument("--compile", choices=["off", "on", "both"], default="off", help="train.compile variants")
    p.add_argument("--checkpointing", nargs="+", default=["none"], choices=["none", "encoder", "decoder", "both"],
                   help="activation_checkpointing variants")
    p.add_argument("--fused", choices=["on", "off", "both"], default=None,
                   help="optim.fused variants (default: the config's)")
    p.add_argument("--interleave", action="store_true",
                   help="hold every variant at once and take their steps in turn, bucket by bucket, so that the "
                   "machine's load moves them alike (shared CPUs); needs the memory of all variants' models")
    p.add_argument("--save", metavar="FILE", help="write the JSON line's results to FILE after every bucket, so that a "
                   "run stopped by a time limit keeps what it measured")
    p.add_argument("--steps", type=int, default=5, help="timed steps per bucket (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per bucket first (compiles a new shape)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="log each bucket's N most expensive ops of one profiled step (torch.profiler)")
    p.add_argument("--trace", metavar="DIR", help="profile --trace-steps steps of every variant and bucket: a gzipped "
                   "torch.profiler trace each in DIR, and where the time goes in each row's `kernels`")
    p.add_argument("--trace-steps", type=int, default=2, metavar="N", help="steps per trace (default: %(default)s)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core)")
    args = p.parse_args(argv)
    files = next((i for i, a in enumerate(args.config) if "=" in a), len(args.config))  # the YAML files come first
    args.config, args.overrides = args.config[:files], args.config[files:]
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    show_library_logs()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(args.threads or cores())
    cfg = load_train_config(args.config, args.overrides)
    init_distributed(group_of_one=True)  # DDP or FSDP2 over a group of one, as train.py runs one process
    peaks = {"sheet": device_peak(device), "measured": None}
    switch = {"off": [False], "on": [True], "both": [False, True], None: [cfg.optim.fused]}
    variants = [(c, ck, f) for c in switch[args.compile] for ck in args.checkpointing for f in switch[args.fused]]
    results, buckets = [], None
    for group in [variants] if args.interleave else [[v] for v in variants]:
        benches = []
        for compiled, checkpointing, fused in group:
            name = (f"{'compiled' if compiled else 'eager'}, checkpointing {checkpointing}, "
                    f"AdamW {'fused' if fused else 'default'}")
            log(f"{name}: building {' '.join(args.config)} on {device}")
            variant_cfg = load_train_config(args.config, [*args.overrides, f"activation_checkpointing={checkpointing}",
                                                          f"optim.fused={str(fused).lower()}"])
            bench = Bench(variant_cfg, device, cfg.train.strategy, compiled, name)
            if buckets is None:
                buckets = spread(bucket_table(variant_cfg, bench.setup, args.batch_sizes), args.buckets)
                peaks["measured"] = matmul_peak(device, bench.setup.precision)
                log(f"matmul peak {peaks['measured'] / 1e12:.3g} TFLOP/s measured ({bench.setup.precision})"
                    + (f", {peaks['sheet'] / 1e12:.4g} on the data sheet" if peaks["sheet"] else ""))
            if compiled:  # each bucket is one shape, as train.compile pads batches to their bucket's bounds
                compile_layers(bench.module, len(buckets))
            benches.append(bench)
            results.append({"variant": name, "compiled": compiled, "checkpointing": checkpointing, "fused": fused,
                            "buckets": []})
        mine = results[-len(benches):]
        for bucket in buckets:
            _, frames, tokens, batch_size = bucket
            batch = benches[0].batch(batch_size, frames, tokens)
            flops = benches[0].model_flops(batch_size, frames, tokens)  # model FLOPs: the same for every variant
            for bench, res, timing in zip(benches, mine, timings(benches, batch, args)):
                res["buckets"].append(measure(bench, bucket, batch, timing, flops, args, peaks))
            save(args.save, summary(args, cfg, device, peaks, results))
        for res in mine:
            whole = res["all"] = overall(res["buckets"], peaks)
            log(f"  {res['variant']}, all buckets: {whole['audio_s_per_s']:.1f} audio s/s, {whole['tflops']:.3g} "
                f"TFLOP/s, MFU {100 * whole['mfu_measured']:.1f}% of measured")  # before the table: a cut run keeps it
        save(args.save, summary(args, cfg, device, peaks, results))
        del benches, bench
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def gib(b):
        return "-" if b is None else format_bytes(b)

    columns = [("variant", "<48"), ("bucket", "<14"), ("batch", ">5"), ("step ms", ">9.1f"), ("audio s/s", ">9.1f"),
               ("tokens/s", ">9.0f"), ("TFLOP/s", ">8.3f"), ("MFU sheet", ">9"), ("MFU meas.", ">9"),
               ("peak", ">10"), ("fwd ms", ">8.1f"), ("bwd ms", ">8.1f"), ("opt ms", ">7.1f"), ("warm-up s", ">9.1f")]
    table = []
    for res in results:
        for r in res["buckets"]:
            table.append([res["variant"], f"{r['duration']:.2f} s {r['tokens']} tok", r["batch"], r["step_ms"],
                          r["audio_s_per_s"], r["tokens_per_s"], r["tflops"],
                          "-" if r["mfu_sheet"] is None else f"{100 * r['mfu_sheet']:.1f}%",
                          f"{100 * r['mfu_measured']:.1f}%", gib(r["peak_bytes"]), r["forward_ms"], r["backward_ms"],
                          r["optimizer_ms"], r["warmup_s"]])
        a = res["all"]
        table.append([res["variant"], "all", "", float("nan"), a["audio_s_per_s"], a["tokens_per_s"], a["tflops"],
                      "-" if a["mfu_sheet"] is None else f"{100 * a['mfu_sheet']:.1f}%",
                      f"{100 * a['mfu_measured']:.1f}%", gib(a["peak_bytes"]),
                      float("nan"), float("nan"), float("nan"), a["warmup_s"]])
    print(f"{' '.join(args.config)} on {device_name(device)}, torch {torch.__version__}, strategy {cfg.train.strategy} "
          f"(group of one), load average {load_avg()}")
    print_table(columns, table)
    result = summary(args, cfg, device, peaks, results)
    for k, v in result["ratios"].items():
        print(f"{k}: {v:.2f}x audio seconds per second")
    print_json(result)


if __name__ == "__main__":
    main()
