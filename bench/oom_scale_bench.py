"""OOMptimizer at the paper's scale without a GPU: simulated steps of Canary-1B(-Flash), a fitted memory model.

    python bench/oom_scale_bench.py fit configs/canary-1b.yaml --out canary-1b.model.json     # 18 steps
    python bench/oom_scale_bench.py validate --out validation.json                             # real vs simulated
    python bench/oom_scale_bench.py validate-fsdp --out fsdp.json    # real 2-rank FSDP vs simulated, fp32, ~1 min
    python bench/oom_scale_bench.py validate-fsdp --precision fp32 bf16 --out fsdp.json    # and bf16, as on CUDA
    python bench/oom_scale_bench.py fit configs/canary-1b.yaml --strategy fsdp --world-size 8 --out 1b.fsdp8.json
    python bench/oom_scale_bench.py fit configs/canary-1b.yaml --strategy ddp --activation-checkpointing both --out 1b.ddp.ckpt.json
    python bench/oom_scale_bench.py validate-cuda configs/canary-1b.yaml --out 1b.cuda.json     # on a GPU: real steps

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
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from common import simulated_step
from torch.nn.parallel import DistributedDataParallel

from aed.memory_measure import CUBLAS_WORKSPACE, LiveTensorMemory, SimulatedDevice, fake_world
from aed.memory_oomptimizer import MemoryModel, TrainingStep
from aed.model import AED, AEDConfig
from aed.model_transducer import TransducerASR
from aed.train_config import OptimConfig
from aed.train_distributed import shard
from aed.train_setup import build_optimizer

# (seconds of audio, tokens per second, seconds in the batch): 0.5-40 s, 3-25 tokens/s, batches of
# 500 or 900 s (Canary-1B fills 80 GiB near 900 s), and long-transcript outliers at 45-80 tokens/s
# (bench/oom_bench.py's workload has them, up to the decoder's dec_max_len) in smaller batches.
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

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    dist.init_process_group("gloo")
    results = {}
    for precision in args.precision:
        step = fsdp_step(dist.get_world_size(), precision)
        measured = [step.peak(*s) for s in FSDP_SHAPES]
        step.optimizer.zero_grad(set_to_none=True)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS, so that the step's peak is the highest since (Linux)
        before = status("VmRSS:")
        with LiveTensorMemory() as mem:  # counts what the step allocates, as RSS growth does
            step.run(*RSS_SHAPE)
        rss = {"tracked": mem.peak, "rss_growth": status("VmHWM:") - before}
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


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit", help="fit a memory model to simulated steps of a preset")
    f.add_argument("config")
    f.add_argument("--out", required=True)
    f.add_argument("--strategy", choices=["ddp", "fsdp"], default=None, help="default: one device, no data parallelism")
    f.add_argument("--world-size", type=int, default=8, help="--strategy fsdp: ranks the model is sharded over")
    f.add_argument("--activation-checkpointing", choices=["none", "encoder", "decoder", "both"], default="none",
                   help="train.py's activation_checkpointing: layers recomputed in backward")
    v = sub.add_parser("validate", help="simulated vs measured peaks of real CPU steps")
    v.add_argument("--out", required=True)
    vf = sub.add_parser("validate-fsdp", help="simulated vs measured peaks of a real 2-rank FSDP step (gloo)")
    vf.add_argument("--out", required=True)
    vf.add_argument("--world-size", type=int, default=2)
    vf.add_argument("--precision", choices=["fp32", "bf16"], nargs="+", default=["fp32"])
    vc = sub.add_parser("validate-cuda", help="simulated vs measured peaks of a preset's real steps on a CUDA "
                        "device, one device and DDP")
    vc.add_argument("config")
    vc.add_argument("--out", required=True)
    r = sub.add_parser("fsdp-rank", help="(validate-fsdp's torchrun worker)")
    r.add_argument("--out", required=True)
    r.add_argument("--precision", choices=["fp32", "bf16"], nargs="+", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    {"fit": fit, "validate": validate, "validate-fsdp": validate_fsdp, "validate-cuda": validate_cuda,
     "fsdp-rank": fsdp_rank}[args.command](args)
