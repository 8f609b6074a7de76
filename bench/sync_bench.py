"""Synchronized bucket selection across DDP ranks (paper sec. 2 and Table 1), in two modes
(`python bench/sync_bench.py MODE --help` lists a mode's flags):

    simulated (default)  R ranks' samplers in one process, a batch's cost from a cost model (E1a)
    real                 R gloo processes under torchrun training on CPU, every step measured (E1b)

    python bench/sync_bench.py                      # R = 2, 16, 128 ranks, both schemes
    python bench/sync_bench.py --ranks 16 --steps 1000 --scheme 2d-per-bucket
    python bench/sync_bench.py --table agreement    # same-bucket steps vs buffer size
    python -m torch.distributed.run --standalone --nproc_per_node 4 bench/sync_bench.py real --steps 300

R ranks each run their own BucketingSampler (rank r of R, infinite mode) on the synthetic corpus
(common.synthetic_corpus), with and without `sync_buckets`. A DDP step lasts as long as its slowest
rank, so both modes report the mean over steps of the max over ranks of a step's cost, the ranks'
busy share (mean / max) and the share of steps where every rank drew from the same bucket; then a
JSON object as the last line.

simulated: the default cost model is FLOP counts of a Canary-1B-like model (change with flags):
d_model 1024, 24 encoder and 24 decoder layers, 4096-token vocabulary, 10 ms frames subsampled 8x,
forward + backward = 3x forward, run at 150 TFLOP/s (an A100 at ~50% of bf16 peak) plus 50 ms per
step (optimizer, gradient all-reduce). Per batch of B examples padded to T' encoder frames, U tokens:
    encoder: L_enc * B * T' * (138 D^2 + 12 D T')        (conformer linears; self-attention)
    decoder: L_dec * B * (U * (84 D^2 + 12 D U + 12 D T') + 12 D^2 T')   (+ cross-attn K/V)
    output:  6 D V * B * U
`--calibrate configs/tiny.yaml` instead times forward+backward of that aed model on this machine
at a few shapes and fits seconds = w . [1, B T', B T'^2, B U, B U T'] (non-negative w): real
measurements, but of a small model on CPU, whose cost balance differs from a 1B model on a GPU.
Timings of the samplers themselves are not measured here (see sampler_bench.py).
The agreement table (2D 30x2 equal-count, flexible, 360 s budget) counts the steps on which
every rank used the drawn bucket, for --agreement-ranks x --agreement-buffers, with `overfill=1`
(the paper's fallback as soon as the buffer reaches its fill target: the sampler's earlier
behaviour) and with the default `overfill` (ranks read on for the drawn bucket). Steps are counted after the fill
ramp (the first 1/fill_ramp batches). It also gives each rank's own hit rate, the examples held
and the sampler's `suggested_buffer_size()`. With many ranks the 100k examples are split thin,
so the rank's buffer may hold several passes over its share: that changes the data, not the rates.

real: the same 2D 30x2 bins with a padded-duration budget per batch, every duration divided by
--time-scale so that a CPU runs a few hundred steps in minutes (a 40 s utterance becomes 10 s, its
text tokens shrink in proportion, the prompt kept). Every rank alternates blocks of --block steps
between its two samplers, so that a change in the load of a shared machine hits both alike. A step
is a real training step of the model in --config (fresh random weights): forward and backward on
random features and tokens of exactly the sampled batch's shape and lengths (reading audio is left
out), one flat all-reduce of the gradients (DDP's, not overlapped with backward) and an AdamW update;
the all-reduce waits for the slowest rank. One torch thread per process: with more processes than
cores they time-share the CPU. Rank 0 prints.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bins and sampler, under torchrun too

from bins import estimate_bins  # noqa: E402
from common import model_batch_sizes, print_table, run_modes, synthetic_corpus  # noqa: E402
from sampler import BucketingSampler  # noqa: E402


def bins_2d(examples: list, buckets: int = 30, sub_buckets: int = 2):
    """The paper's 2D bins (equal-count), estimated on the examples."""
    return estimate_bins([e["duration"] for e in examples], [e["num_tokens"] for e in examples], buckets, sub_buckets,
                         method="equal")


def rank_sampler(examples: list, bins, rank: int, world_size: int, seed: int, **kw) -> BucketingSampler:
    """Rank `rank` of `world_size`'s own sampler (infinite, indices); kw: sync_buckets, buffer and batch settings."""
    return BucketingSampler(examples, bins, rank=rank, world_size=world_size, infinite=True, seed=seed,
                            yield_indices=True, **kw)


# --- simulated: every rank's sampler in this process, a cost model ----------------------------------


def flop_cost(args):
    def cost(batch: int, max_duration: float, max_tokens: int) -> float:
        d, t, u = args.d_model, math.ceil(max_duration * 100 / 8), max_tokens
        enc = args.enc_layers * batch * t * (138 * d * d + 12 * d * t)
        dec = args.dec_layers * batch * (u * (84 * d * d + 12 * d * u + 12 * d * t) + 12 * d * d * t)
        out = 6 * d * args.vocab * batch * u
        return (enc + dec + out) / args.flops + args.overhead

    return cost


def features(batch: int, max_duration: float, max_tokens: int) -> list:
    t = math.ceil(max_duration * 100 / 8)  # encoder frames after 8x subsampling of 10 ms frames
    return [1.0, batch * t, batch * t * t, batch * max_tokens, batch * max_tokens * t]


def calibrated_cost(config_path: str, reps: int = 2):
    from aed.model import AED, AEDConfig

    cfg = AEDConfig.from_yaml(config_path)
    model = AED(cfg).train()
    shapes = [(2, 4.0, 16), (8, 4.0, 16), (1, 16.0, 64), (4, 16.0, 64), (4, 8.0, 96), (2, 32.0, 32),
              (1, 32.0, 128), (1, 40.0, 160)]  # (batch, seconds, tokens) spanning the buckets
    x, y = [], []
    for b, secs, u in shapes:
        frames = int(secs * 100)
        feats, feat_lens = torch.randn(b, frames, cfg.n_mels), torch.full((b,), frames)
        tokens, token_lens = torch.randint(2, cfg.vocab_size, (b, u)), torch.full((b,), u)
        times = []
        for _ in range(reps + 1):  # the first run warms up allocators
            t0 = time.perf_counter()
            loss, _ = model(feats, feat_lens, tokens, token_lens, torch.ones(b, dtype=torch.long))
            loss.backward()
            times.append(time.perf_counter() - t0)
        x.append(features(b, secs, u))
        y.append(min(times[1:]))
    # Relative least squares (rows scaled by 1/time), dropping negative terms until none is left.
    a, active = np.array(x) / np.array(y)[:, None], list(range(len(x[0])))
    while True:
        w, *_ = np.linalg.lstsq(a[:, active], np.ones(len(y)), rcond=None)
        if (w >= 0).all():
            break
        active.pop(int(np.argmin(w)))
    coef = np.zeros(len(x[0]))
    coef[active] = w
    fit = np.array(x) @ coef
    print(f"calibrated on {config_path}: w = {coef.tolist()}, max relative error {np.max(np.abs(fit / y - 1)):.0%}")
    return lambda batch, max_duration, max_tokens: float(np.dot(coef, features(batch, max_duration, max_tokens)))


def simulate(args, cost, ex, bins, kw, ranks: int, sync: bool) -> dict:
    samplers = [rank_sampler(ex, bins, r, ranks, args.seed, sync_buckets=sync, buffer_size=args.buffer_size, **kw)
                for r in range(ranks)]
    iters = [iter(s) for s in samplers]
    slowest, mean, same = [], [], 0
    for _ in range(args.steps):
        costs, buckets = [], set()
        for s, it in zip(samplers, iters):
            next(it)
            info = s.last_batch_info
            costs.append(cost(info["size"], info["max_duration"], info["max_tokens"]))
            buckets.add(info["bucket"])
        slowest.append(max(costs))
        mean.append(sum(costs) / ranks)
        same += len(buckets) == 1
    return {"step_s": float(np.mean(slowest)), "rank_busy": float(np.mean(mean) / np.mean(slowest)),
            "same_bucket": same / args.steps}


def agreement(args, ex, bins, ranks: int, buffer_size: int, overfill: float) -> dict:
    samplers = [rank_sampler(ex, bins, r, ranks, args.seed, buffer_size=buffer_size, overfill=overfill,
                             max_duration=args.max_duration) for r in range(ranks)]
    base = samplers[0]
    iters = [iter(s) for s in samplers]
    ramp = 100  # 1 / fill_ramp: the batches before the buffer reaches its fill target
    same = held = 0
    for step in range(ramp + args.agreement_steps):
        buckets = set()
        for s, it in zip(samplers, iters):
            next(it)
            buckets.add(s.last_batch_info["bucket"])
        if step >= ramp:
            same += len(buckets) == 1
            held += base._live.occupancy
    hits = np.mean([s._agreement.rate for s in samplers])
    n = args.agreement_steps
    return {"ranks": ranks, "buffer_size": buffer_size, "overfill": overfill, "same_bucket": same / n,
            "rank_hit": float(hits), "held": held / n, "suggested_buffer_size": base.suggested_buffer_size()}


def agreement_table(args, ex) -> list:
    bins = bins_2d(ex)
    rows, checks = [], {}
    print(f"{'ranks':>5} {'buffer':>6} {'same bucket':>11} {'(overfill 1)':>12} {'rank hit':>8} {'(1)':>6} "
          f"{'held':>6} {'(1)':>6} {'suggested':>9} {'sim s':>6}")
    for r in args.agreement_ranks:
        for b in args.agreement_buffers:
            t0 = time.perf_counter()
            old, new = (agreement(args, ex, bins, r, b, f) for f in (1.0, args.overfill))
            rows.append({"before": old, "after": new})
            print(f"{r:>5} {b:>6} {new['same_bucket']:>11.1%} {old['same_bucket']:>12.1%} {new['rank_hit']:>8.1%} "
                  f"{old['rank_hit']:>6.1%} {new['held']:>6.0f} {old['held']:>6.0f} "
                  f"{new['suggested_buffer_size']:>9} {time.perf_counter() - t0:>6.1f}")
        # The buffer the warning suggests must deliver what it promises (90% of steps agree).
        b = rows[-1]["after"]["suggested_buffer_size"]
        check = agreement(args, ex, bins, r, b, args.overfill)
        checks[r] = check
        print(f"{r:>5} {b:>6} {check['same_bucket']:>11.1%} {'':>12} {check['rank_hit']:>8.1%} {'':>6} "
              f"{check['held']:>6.0f} {'':>6} {'(itself)':>9}")
    print(f"same bucket: steps (after the fill ramp, {args.agreement_steps}) where every rank used the drawn bucket; "
          f"overfill {args.overfill:g} (default) vs 1 (the paper's fallback); held: mean examples in rank 0's buffer")
    return rows, checks


def simulated_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 16, 128])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--scheme", choices=["1d-30", "2d-per-bucket", "both"], default="both",
                   help="1D 30 buckets with the 360 s budget, or 2D 30x2 with per-bucket batch sizes")
    p.add_argument("--synthetic", type=int, default=100_000)
    p.add_argument("--buffer-size", type=int, default=20_000)
    p.add_argument("--max-duration", type=float, default=360.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--enc-layers", type=int, default=24)
    p.add_argument("--dec-layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--flops", type=float, default=150e12, help="effective FLOP/s of one GPU")
    p.add_argument("--overhead", type=float, default=0.05, help="fixed seconds per step")
    p.add_argument("--calibrate", metavar="CONFIG", default=None, help="fit the cost model to this aed model's timings")
    p.add_argument("--table", choices=["cost", "agreement", "both"], default="both")
    p.add_argument("--agreement-ranks", type=int, nargs="+", default=[2, 8, 64])
    p.add_argument("--agreement-buffers", type=int, nargs="+", default=[600, 2000, 6000, 20000])
    p.add_argument("--agreement-steps", type=int, default=500)
    p.add_argument("--overfill", type=float, default=4.0, help="the sampler's overfill in the agreement table")


def simulated_mode(args) -> None:
    ex = synthetic_corpus(args.synthetic, args.seed)
    out = {"steps": args.steps, "buffer_size": args.buffer_size, "cost_model": args.calibrate or "flops"}
    if args.table in ("agreement", "both"):
        out["agreement"], checks = agreement_table(args, ex)
        out["agreement_at_suggested_buffer"] = list(checks.values())
        out["targets"] = {f"same_bucket_ge_90pct_at_suggested_buffer_{r}_ranks": c["same_bucket"] >= 0.9
                          for r, c in checks.items()}
        if args.table == "agreement":
            print(json.dumps(out))
            return
        print()
    cost = calibrated_cost(args.calibrate) if args.calibrate else flop_cost(args)
    durs, toks = [e["duration"] for e in ex], [e["num_tokens"] for e in ex]
    schemes = {}
    if args.scheme in ("1d-30", "both"):
        schemes["1d-30"] = (estimate_bins(durs, toks, 30, 1), {"max_duration": args.max_duration})
    if args.scheme in ("2d-per-bucket", "both"):
        bins2d = bins_2d(ex)
        schemes["2d-per-bucket"] = (bins2d, {"batch_sizes": model_batch_sizes(bins2d)})

    results = []
    print(f"{'scheme':<14} {'ranks':>5} {'step s (unsync)':>15} {'step s (sync)':>13} {'speedup':>8} "
          f"{'same bucket':>11} {'(unsync)':>8} {'busy':>5} {'(unsync)':>8} {'sim s':>6}")
    for name, (bins, kw) in schemes.items():
        for r in args.ranks:
            t0 = time.perf_counter()
            off = simulate(args, cost, ex, bins, kw, r, sync=False)
            on = simulate(args, cost, ex, bins, kw, r, sync=True)
            row = {"scheme": name, "ranks": r, "unsync": off, "sync": on, "speedup": off["step_s"] / on["step_s"] - 1}
            results.append(row)
            print(f"{name:<14} {r:>5} {off['step_s']:>15.3f} {on['step_s']:>13.3f} {row['speedup']:>8.1%} "
                  f"{on['same_bucket']:>11.1%} {off['same_bucket']:>8.1%} {on['rank_busy']:>5.0%} "
                  f"{off['rank_busy']:>8.0%} {time.perf_counter() - t0:>6.1f}")
    print("speedup = unsync step time / sync step time - 1; busy = mean rank time / slowest rank time")
    by16 = [x for x in results if x["ranks"] == 16]
    targets = {"same_bucket_ge_95pct_at_16_ranks": all(x["sync"]["same_bucket"] >= 0.95 for x in by16)}
    for name in schemes:
        gains = [x["speedup"] for x in results if x["scheme"] == name]
        targets[f"{name}_gain_grows_with_ranks"] = all(a < b for a, b in zip(gains, gains[1:]))
    print(json.dumps({**out, "results": results, "targets": {**out.get("targets", {}), **targets}}))


# --- real: R gloo processes, each step measured ------------------------------------------------------

PROMPT_TOKENS = 6  # synthetic_corpus adds a 6-token prompt to every example


def scaled_corpus(n: int, scale: float, seed: int) -> list:
    """synthetic_corpus with durations / scale and text tokens / scale (the prompt kept)."""
    out = []
    for e in synthetic_corpus(n, seed):
        text = max(1, round((e["num_tokens"] - PROMPT_TOKENS) / scale))
        out.append({"duration": round(e["duration"] / scale, 3), "num_tokens": text + PROMPT_TOKENS})
    return out


def random_batch(examples: list, idx: list, cfg, gen: torch.Generator) -> tuple:
    """Random features (B, T, F) and tokens (B, U) with the batch's true lengths (10 ms frames)."""
    feat_lens = torch.tensor([max(1, round(examples[i]["duration"] * 100)) for i in idx])
    token_lens = torch.tensor([examples[i]["num_tokens"] for i in idx])
    feats = torch.randn(len(idx), int(feat_lens.max()), cfg.n_mels, generator=gen)  # (B, T, F)
    tokens = torch.randint(2, cfg.vocab_size, (len(idx), int(token_lens.max())), generator=gen)  # (B, U)
    tokens[torch.arange(tokens.shape[1])[None, :] >= token_lens[:, None]] = cfg.pad_id
    return feats, feat_lens, tokens, token_lens, torch.full((len(idx),), PROMPT_TOKENS)


def real_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.yaml", help="YAML whose `model` section is trained")
    p.add_argument("--steps", type=int, default=200, help="measured steps per scheme")
    p.add_argument("--warmup", type=int, default=4, help="unmeasured steps per scheme first")
    p.add_argument("--block", type=int, default=10, help="steps per scheme before switching to the other")
    p.add_argument("--synthetic", type=int, default=20_000, help="examples in the synthetic corpus")
    p.add_argument("--time-scale", type=float, default=4.0, help="durations and text tokens divided by this")
    p.add_argument("--max-duration", type=float, default=20.0, help="padded seconds per batch (after scaling)")
    p.add_argument("--buckets", type=int, default=30)
    p.add_argument("--sub-buckets", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)


def real_mode(args) -> None:
    import torch.distributed as dist
    import yaml

    from aed.model import AED, AEDConfig
    from aed.train_distributed import exit_worker, init_distributed

    torch.set_num_threads(1)  # one per process: 4 processes on 2 cores already oversubscribe
    rank, _, world_size, device = init_distributed()
    if device.type != "cpu" or world_size < 2:
        sys.exit("run under torchrun with --nproc_per_node >= 2 on CPU (gloo)")

    examples = scaled_corpus(args.synthetic, args.time_scale, args.seed)
    bins = bins_2d(examples, args.buckets, args.sub_buckets)  # the paper's bins, as measured
    samplers = {name: rank_sampler(examples, bins, rank, world_size, args.seed, max_duration=args.max_duration,
                                   sync_buckets=sync, buffer_size=len(examples))
                for name, sync in (("unsync", False), ("sync", True))}
    iters = {name: iter(s) for name, s in samplers.items()}

    torch.manual_seed(args.seed)  # the same initial weights on every rank, as DDP guarantees
    cfg = AEDConfig(**yaml.safe_load(open(args.config))["model"])
    model = AED(cfg).train()
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(args.seed + rank)

    def step(name: str) -> tuple:
        idx = next(iters[name])
        bucket = samplers[name].last_batch_info["bucket"]
        batch = random_batch(examples, idx, cfg, gen)  # made before the clock starts: no data time
        t0 = time.perf_counter()
        loss, n = model(*batch)
        (loss / n).backward()
        compute = time.perf_counter() - t0
        flat = torch.cat([q.grad.flatten() for q in params])
        dist.all_reduce(flat)  # waits for the slowest rank
        flat /= world_size
        offset = 0
        for q in params:
            q.grad.copy_(flat[offset: offset + q.numel()].view_as(q))
            offset += q.numel()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, compute, bucket

    log = {name: [] for name in samplers}  # (step wall s, compute s, bucket) per measured step
    for name in samplers:
        for _ in range(args.warmup):
            step(name)
    t_start = time.perf_counter()
    while any(len(v) < args.steps for v in log.values()):
        for name in samplers:
            for _ in range(min(args.block, args.steps - len(log[name]))):
                log[name].append(step(name))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, log)

    if rank == 0:
        res = {}
        for name in samplers:
            per_rank = np.array([g[name] for g in gathered])  # (R, steps, 3)
            wall, compute, buckets = per_rank[:, :, 0], per_rank[:, :, 1], per_rank[:, :, 2]
            res[name] = {"step_s": float(wall.max(0).mean()), "compute_max_s": float(compute.max(0).mean()),
                         "busy": float(compute.mean(0).mean() / compute.max(0).mean()),
                         "same_bucket": float((buckets == buckets[0]).all(0).mean()),
                         "mean_batch": float(np.mean([samplers[name].sizes[int(b)] for b in buckets.flat]))}
        speedup = res["unsync"]["step_s"] / res["sync"]["step_s"] - 1
        print(f"{world_size} gloo processes x 1 thread, {args.steps} steps per scheme (blocks of {args.block}), "
              f"{model.__class__.__name__} from {args.config} "
              f"({sum(q.numel() for q in params) / 1e6:.2f}M parameters), "
              f"{time.perf_counter() - t_start:.0f} s")
        print_table([("scheme", "<8"), ("step s", ">7.3f"), ("max compute s", ">13.3f"), ("busy", ">5.0%"),
                     ("same bucket", ">11.0%")],
                    [[k, r["step_s"], r["compute_max_s"], r["busy"], r["same_bucket"]] for k, r in res.items()])
        print(f"sync speedup (unsync step / sync step - 1): {speedup:.1%}")
        print(json.dumps({"world_size": world_size, "threads_per_process": 1, "steps": args.steps,
                          "block": args.block, "synthetic": args.synthetic, "time_scale": args.time_scale,
                          "max_duration": args.max_duration, "bins_shape": list(bins.shape),
                          "parameters": sum(q.numel() for q in params), "config": args.config,
                          "seconds": time.perf_counter() - t_start, **res, "speedup": speedup}))
    exit_worker()  # as train.py ends: the interpreter's own exit can abort a finished rank


MODES = {  # name: (its flags, its run, what it measures)
    "simulated": (simulated_flags, simulated_mode, "R simulated ranks' samplers, a cost model per batch"),
    "real": (real_flags, real_mode, "R gloo processes under torchrun training on CPU, every step measured"),
}


def main(argv: list[str] | None = None) -> None:
    run_modes(__doc__, MODES, "simulated", argv)


if __name__ == "__main__":
    main()
