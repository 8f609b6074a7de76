"""OOMptimizer benchmark: mean batch size under one memory limit, heuristic vs measured.

    python bench/oom_bench.py                                   # CPU-scaled model, 198 MB limit: ~5 min
    python bench/oom_bench.py --d-model 256 --heads 4 --enc-layers 12 --dec-layers 4 \\
        --subsampling-channels 64 --n-mels 128 --vocab-size 5248 --budget 2GB   # 25M parameters: hours on CPU

Three ways to give each bucket its batch size, on the synthetic corpus of bench/sampler_bench.py
and the same model, optimizer and memory limit (budget minus oom.py's 10% margin):
(a) 1D, 30 duration buckets, padded-duration heuristic: n = floor(M / d) with the largest M for
    which no bucket exceeds the limit: just below min over buckets of (oom.py's size + 1) x d,
    then checked by running every bucket's worst-case batch once (oom.preflight);
(b) the same 1D buckets, sizes from oom.py;
(c) 2D 30x2 buckets, sizes from oom.py.
1D buckets are bounded in tokens by the bin's max tokens/s x d (bins.max_tps, as oom.py does).
The mean batch size is what training sees: examples / batches, with every bucket's occupancy on
the corpus (bins.counts). The paper: (b)/(a) = 3.4x, (c)/(a) = 5x; target here (c)/(a) >= 3x.

Memory is measured on CPU (live tensor bytes, aed/memory.py), every number from a real step. The
search runs ~400 steps, so the default model is Canary-1B's proportions at 1/16 width (d 64, one
attention head per 64 dims as Canary's 8 per 1024, subsampling channels d/4, vocab 5d) with 4+4
layers (Canary-1B: 24+24): 0.7M parameters, chosen so that attention (quadratic in duration),
per-frame and per-token memory keep roughly Canary's proportions. Timings share 2 cores with
other jobs. Prints a table, then a JSON object as the last line.
"""

import argparse
import math
import time

import torch

from aed.audio import FeatureConfig
from aed.memory import format_bytes, parse_bytes
from aed.model import count_parameters
from common import add_width_args, epoch_batch, log, print_json, print_table, random_aed, show_library_logs
from oom import TrainingStep, bucket_shapes, make_monotone, optimize, preflight
from sampler import estimate_bins
from sampler_bench import synthetic_corpus


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--synthetic", type=int, default=100_000, help="examples in the synthetic corpus")
    p.add_argument("--budget", default="220MB", help="memory budget; steps must fit it minus --margin")
    p.add_argument("--margin", type=float, default=0.1)
    p.add_argument("--threshold", type=float, default=0.05)
    p.add_argument("--buckets", type=int, default=30, help="duration buckets (2D: x2)")
    add_width_args(p, d_model=64, subsampling_channels=16, heads=1)
    p.add_argument("--enc-layers", type=int, default=4)
    p.add_argument("--dec-layers", type=int, default=4)
    p.add_argument("--n-mels", type=int, default=80)
    p.add_argument("--vocab-size", type=int, default=320)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    show_library_logs()
    t_start = time.time()

    ex = synthetic_corpus(args.synthetic, args.seed)
    durs, toks = [e["duration"] for e in ex], [e["num_tokens"] for e in ex]
    bins_1d = estimate_bins(durs, toks, args.buckets, 1)
    bins_2d = estimate_bins(durs, toks, args.buckets, 2, method="equal")  # the paper's 2D bins
    features = FeatureConfig(n_mels=args.n_mels)
    model = random_aed(args, args.enc_layers, args.dec_layers, seed=args.seed, n_mels=args.n_mels,
                       vocab_size=args.vocab_size, dec_max_len=512).train()
    cfg = model.cfg
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = TrainingStep(model, optimizer)
    budget = parse_bytes(args.budget)
    limit = int(budget * (1 - args.margin))
    n_params = count_parameters(model)
    log(f"model {n_params / 1e6:.1f}M parameters (d {args.d_model}, {args.enc_layers}+{args.dec_layers} layers, "
        f"{args.n_mels} mels, vocab {args.vocab_size}), limit {format_bytes(limit)}, CPU")

    # (b) 1D + oom.py, then (a) the heuristic's largest safe M from the same measurements
    shapes_1d = bucket_shapes(bins_1d, features, cfg.dec_max_len)
    t0 = time.time()
    rows_b = optimize(step, shapes_1d, limit, threshold=args.threshold)
    sizes_b, _ = make_monotone(shapes_1d, [r["batch_size"] for r in rows_b])
    seconds_b = time.time() - t0
    # n = floor(M / d) must stay <= oom.py's size in every bucket: M < (size + 1) x d everywhere.
    max_duration = min((n + 1) * d for n, (d, _, _) in zip(sizes_b, shapes_1d))
    sizes_a = [math.ceil(max_duration / d) - 1 for d, _, _ in shapes_1d]  # largest n with n x d < M
    peaks_a = preflight(model, optimizer, bins_1d, sizes_a, limit, features)  # raises if any bucket does not fit

    # (c) 2D 30x2 + oom.py
    shapes_2d = bucket_shapes(bins_2d, features, cfg.dec_max_len)
    t0 = time.time()
    rows_c = optimize(step, shapes_2d, limit, threshold=args.threshold)
    sizes_c, changes_c = make_monotone(shapes_2d, [r["batch_size"] for r in rows_c])
    seconds_c = time.time() - t0

    counts_1d = [c for row in bins_1d.counts for c in row]
    counts_2d = [c for row in bins_2d.counts for c in row]
    mean = {"a": epoch_batch(bins_1d, sizes_a), "b": epoch_batch(bins_1d, sizes_b), "c": epoch_batch(bins_2d, sizes_c)}

    bucket = [("bucket", ">6"), ("<= s", ">6.2f"), ("<= tok", ">6"), ("count", ">6"), ("|", "")]
    print(f"\n1D, {len(shapes_1d)} buckets: (a) heuristic, M < {max_duration:.1f} s of padded audio per batch; "
          "(b) oom.py")
    print_table(bucket + [("a: batch", ">8"), ("peak", ">9"), ("|", ""), ("b: batch", ">8"), ("peak", ">9"),
                          ("trials", ">6")],
                [[b, d, t, counts_1d[b], "|", sizes_a[b], format_bytes(peaks_a[b]), "|", sizes_b[b],
                  format_bytes(r["peak"]), r["trials"]] for b, ((d, _, t), r) in enumerate(zip(shapes_1d, rows_b))])
    print(f"\n2D, {len(shapes_2d)} buckets: (c) oom.py")
    print_table(bucket + [("c: batch", ">8"), ("peak", ">9"), ("trials", ">6")],
                [[b, d, t, counts_2d[b], "|", sizes_c[b], format_bytes(r["peak"]), r["trials"]]
                 for b, ((d, _, t), r) in enumerate(zip(shapes_2d, rows_c))])
    print()
    schemes = [("a", "(a) 1D heuristic", "1x"), ("b", "(b) 1D + oom.py", "3.4x"), ("c", "(c) 2D 30x2 + oom.py", "5x")]
    print_table([("scheme", "<24"), ("mean batch", ">10.1f"), ("vs (a)", ">7"), ("paper", ">6")],
                [[name, mean[key], f"{mean[key] / mean['a']:.2f}x", paper] for key, name, paper in schemes])
    total = time.time() - t_start
    print(f"search: 1D {seconds_b:.0f} s ({sum(r['trials'] for r in rows_b)} trials), 2D {seconds_c:.0f} s "
          f"({sum(r['trials'] for r in rows_c)} trials); total {total:.0f} s; monotone fixes in 2D: {len(changes_c)}")

    print_json({
        "model": {"parameters": n_params, **{k: getattr(cfg, k) for k in (
            "enc_d_model", "enc_heads", "enc_layers", "dec_layers", "n_mels", "vocab_size", "subsampling_channels")}},
        "budget_bytes": budget, "limit_bytes": limit, "threshold": args.threshold, "synthetic": args.synthetic,
        "a": {"max_duration": max_duration, "sizes": sizes_a, "peaks": peaks_a, "mean_batch": mean["a"]},
        "b": {"sizes": sizes_b, "peaks": [r["peak"] for r in rows_b], "trials": [r["trials"] for r in rows_b],
              "mean_batch": mean["b"], "seconds": seconds_b},
        "c": {"sizes": sizes_c, "peaks": [r["peak"] for r in rows_c], "trials": [r["trials"] for r in rows_c],
              "mean_batch": mean["c"], "seconds": seconds_c, "monotone_fixes": changes_c},
        "ratios": {"b/a": mean["b"] / mean["a"], "c/a": mean["c"] / mean["a"]}, "paper": {"b/a": 3.4, "c/a": 5.0},
        "targets": {"c_over_a_ge_3x": mean["c"] / mean["a"] >= 3.0}, "seconds": total})


if __name__ == "__main__":
    main()
