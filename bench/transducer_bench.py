"""Batched vs sample-wise vs chunked transducer loss: peak memory, time, largest batch in a budget.

    python bench/transducer_bench.py          # the target shape below: ~50 min on 2 shared CPU cores, half of it
                                              # the budget search (sample-wise probes up to B=512)
    python bench/transducer_bench.py --max-lattice 2e7 --budget-mb 128   # a quick look

Each measurement is one loss forward + `backward()` over a leaf "encoder output" (B, T', enc_dim),
so it covers the projections, the predictor, the joint and the loss; all lengths are full (the worst
batch of a bucket). Every (shape, method) runs in a fresh subprocess, so one run's allocator state
and high-water mark cannot leak into the next.

Peak memory is what one step adds on top of the resident model and inputs (the encoder output is
resident in training too):
- CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() before the step (exact, tensors only).
- CPU: peak RSS minus RSS before the step, from /proc/self/status (VmHWM, VmRSS), with the peak reset
  through /proc/self/clear_refs just before the step. The worker runs with MALLOC_MMAP_THRESHOLD_=65536,
  so every large tensor is its own mmap and goes back to the OS when freed: RSS then follows live
  tensor memory, and the peak includes buffers allocated inside C++ kernels, which a Python-level
  tensor hook would miss. A tiny warm-up step first pages in kernel code so it is not counted.
Time is the minimum over --iters steps on the same batch: other jobs share the cores, and the
minimum is the least disturbed estimate.

Shapes with B*T'*(U+1)*V above --max-lattice are run with B scaled down to fit, and marked so; the
default keeps the issue's target shape (32, 200, 50, 1024) unscaled and scales (64, 250, 60, 1024).
The last line is a JSON object with every number in the table.
"""
import argparse
import os
import subprocess
import sys
import time

from common import last_json, log, print_json, print_table, proc_status_bytes, reset_peak_rss

SHAPES = [(8, 100, 20, 256), (32, 150, 40, 512), (32, 200, 50, 1024), (64, 250, 60, 1024)]
TARGET_SHAPE = (32, 200, 50, 1024)  # the target: sample-wise memory <= 0.1x, time <= 1.5x batched here


def run_worker(args):
    """One measurement in this process; prints a JSON line."""
    import torch

    from aed.model_transducer import Transducer, TransducerConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, T, U, V = args.shape
    torch.manual_seed(0)  # same weights and inputs for every method, so the losses must agree
    cfg = TransducerConfig(vocab_size=V, enc_dim=args.enc_dim, pred_dim=args.joint_dim,
                           joint_dim=args.joint_dim, dropout=0.0)
    model = Transducer(cfg).to(device)

    def inputs(B, T, U):
        enc = torch.randn(B, T, args.enc_dim, device=device, requires_grad=True)
        targets = torch.randint(0, V - 1, (B, U), device=device)
        return enc, torch.full((B,), T, device=device), targets, torch.full((B,), U, device=device)

    def step(enc, enc_lens, targets, target_lens):
        """(seconds, peak bytes the step added over what was resident before it, loss)."""
        model.zero_grad(set_to_none=True)
        enc.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            reset_peak_rss()
            before = proc_status_bytes("VmRSS")
        start = time.perf_counter()
        loss, _ = model.loss(enc, enc_lens, targets, target_lens, mode=args.mode, chunk_size=args.chunk)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            peak = proc_status_bytes("VmHWM") - before
        return time.perf_counter() - start, peak, loss.item()

    # Warm-up on a tiny batch: pages in kernel code and starts autograd threads, which RSS would
    # otherwise count as memory of the first measured step.
    step(*inputs(1, min(T, 8), min(U, 4)))
    batch = inputs(B, T, U)  # resident before the step, as the encoder output is in training
    runs = [step(*batch) for _ in range(args.iters)]
    print_json({"peak_mb": max(r[1] for r in runs) / 2**20, "time_s": min(r[0] for r in runs),
                "loss": runs[0][2], "device": device})


def measure(shape, mode, chunk, args, iters=None):
    """Run one configuration in a fresh subprocess and return its JSON result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--shape", *map(str, shape), "--mode", mode,
           "--chunk", str(chunk), "--iters", str(iters or args.iters), "--enc-dim", str(args.enc_dim),
           "--joint-dim", str(args.joint_dim)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"worker {shape} {mode} chunk={chunk} failed:\n{out.stderr[-2000:]}")
    return last_json(out.stdout)


def largest_batch(mode, chunk, args):
    """Largest B at --budget-shape whose peak fits --budget-mb: doubling, then bisection to ~6%."""
    T, U, V = args.budget_shape

    def fits(B):
        peak = measure((B, T, U, V), mode, chunk, args, iters=1)["peak_mb"]
        log(f"budget probe {mode:10s} chunk={chunk:<3d} B={B:<5d} peak {peak:8.1f} MB")
        return peak <= args.budget_mb

    lo, hi = 0, 1
    while hi <= args.max_batch and fits(hi):
        lo, hi = hi, hi * 2
    if hi > args.max_batch:
        return lo, True  # fits at the cap; the true limit is higher
    while hi - lo > max(1, lo // 16):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, False


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shape", type=int, nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="batched", help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, default=4, help="samples per chunk for the chunked variant")
    p.add_argument("--iters", type=int, default=2, help="timed runs per configuration (min is reported)")
    p.add_argument("--enc-dim", type=int, default=512, help="encoder output width")
    p.add_argument("--joint-dim", type=int, default=640, help="joint and predictor width (NeMo: 640)")
    p.add_argument("--max-lattice", type=float, default=32 * 200 * 51 * 1024,
                   help="largest B*T'*(U+1)*V run as is; bigger shapes get a smaller B")
    p.add_argument("--budget-mb", type=float, default=512, help="memory budget for the largest-batch search")
    p.add_argument("--budget-shape", type=int, nargs=3, default=[100, 20, 256], metavar=("T", "U", "V"),
                   help="(T', U, V) for the largest-batch search (small, so sample-wise probes finish)")
    p.add_argument("--max-batch", type=int, default=1024, help="largest B the budget search tries")
    args = p.parse_args()
    if args.worker:
        return run_worker(args)

    methods = [("batched", 1), ("samplewise", 1), ("samplewise", args.chunk)]
    name = {("batched", 1): "batched", ("samplewise", 1): "sample-wise",
            ("samplewise", args.chunk): f"chunked({args.chunk})"}
    rows = []
    for B, T, U, V in SHAPES:
        run_B = max(1, min(B, int(args.max_lattice // (T * (U + 1) * V))))
        for mode, chunk in methods:
            r = measure((run_B, T, U, V), mode, chunk, args)
            rows.append({"shape": [B, T, U, V], "run_B": run_B, "method": name[(mode, chunk)], **r})
            log(str(rows[-1]))

    budget = {}
    for mode, chunk in methods:
        B, capped = largest_batch(mode, chunk, args)
        budget[name[(mode, chunk)]] = {"largest_batch": B, "hit_cap": capped}

    # --- report ---
    print(f"\ntransducer loss + backward, enc_dim {args.enc_dim}, joint_dim {args.joint_dim}, "
          f"device {rows[0]['device']}, full lengths")
    table = []
    for row in rows:
        ref = next(r for r in rows if r["shape"] == row["shape"] and r["method"] == "batched")
        row["mem_ratio"] = row["peak_mb"] / ref["peak_mb"]
        row["time_ratio"] = row["time_s"] / ref["time_s"]
        row["loss_rel_diff"] = abs(row["loss"] - ref["loss"]) / abs(ref["loss"])
        B, T, U, V = row["shape"]
        shape = f"{row['run_B']}, {T}, {U}, {V}" + (f" (B {B})" if row["run_B"] != B else "")
        table.append([shape, row["method"], row["peak_mb"], row["mem_ratio"], row["time_s"], row["time_ratio"],
                      row["loss_rel_diff"]])
    print_table([("B, T, U, V", ">22"), ("method", ">12"), ("peak MB", "9.1f"), ("x batched", "9.3f"),
                 ("time s", "8.2f"), ("x batched", "9.2f"), ("loss rel. diff", "14.1e")], table)
    if any(r["run_B"] != r["shape"][0] for r in rows):
        print(f"(B X): shape scaled from batch X to fit --max-lattice {args.max_lattice:.3g} on this machine")
    T, U, V = args.budget_shape
    print(f"\nlargest batch within {args.budget_mb:g} MB at T'={T}, U={U}, V={V}:")
    for method, b in budget.items():
        print(f"{method:>14}: {b['largest_batch']}" + (" (fits at the --max-batch cap)" if b["hit_cap"] else ""))

    target = [r for r in rows if tuple(r["shape"]) == TARGET_SHAPE and r["run_B"] == TARGET_SHAPE[0]]
    targets = {}
    if target:
        sw = next(r for r in target if r["method"] == "sample-wise")
        ch = next(r for r in target if r["method"].startswith("chunked"))
        targets = {"samplewise_mem_ratio": sw["mem_ratio"], "samplewise_time_ratio": sw["time_ratio"],
                   "chunked_mem_ratio": ch["mem_ratio"], "chunked_time_ratio": ch["time_ratio"],
                   "met": sw["mem_ratio"] <= 0.1 and sw["time_ratio"] <= 1.5}
        print(f"\ntarget at {TARGET_SHAPE}: sample-wise memory {sw['mem_ratio']:.3f}x (<= 0.1), "
              f"time {sw['time_ratio']:.2f}x (<= 1.5); chunked time {ch['time_ratio']:.2f}x -> "
              f"{'met' if targets['met'] else 'NOT met'}")
    print_json({"enc_dim": args.enc_dim, "joint_dim": args.joint_dim, "device": rows[0]["device"],
                "memory_method": "cuda max_memory_allocated" if rows[0]["device"] == "cuda"
                else "VmHWM - VmRSS before step (clear_refs reset), MALLOC_MMAP_THRESHOLD_=65536",
                "rows": rows, "budget_mb": args.budget_mb, "budget_shape": args.budget_shape,
                "budget": budget, "targets": targets})


if __name__ == "__main__":
    main()
