"""Synchronized bucket selection measured for real: R gloo processes training on CPU (E1b).

    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/sync_real_bench.py
    python -m torch.distributed.run --standalone --nproc_per_node 4 bench/sync_real_bench.py --steps 300

The workload is bench/sync_bench.py's synthetic corpus (common.synthetic_corpus) (the same 2D 30x2 bins, padded-duration
budget per batch), with every duration divided by --time-scale so that a CPU runs a few hundred
steps in minutes: a 40 s utterance becomes 10 s, and its token count shrinks in proportion (the
prompt kept). Every rank holds two BucketingSamplers over the same examples (rank r of R,
infinite), one with `sync_buckets` and one without, and alternates blocks of --block steps
between them, so that a change in the load of a shared machine hits both schemes alike.

A step is a real training step of the model in --config (fresh random weights): forward and
backward on random features and tokens of exactly the sampled batch's shape (B, T) and lengths
(the data content does not change the cost; reading audio is left out), then one flat all-reduce
of the gradients (what DDP does, without overlapping it with backward) and an AdamW update. The
all-reduce waits for the slowest rank, so a step's wall time is the slowest rank's compute plus
communication; we report the mean over steps of the max over ranks of that time, the ranks'
busy share (mean / max of their compute), and the share of steps where all ranks used the same
bucket. One torch thread per process: with more processes than cores they time-share the CPU.
Prints a table, then a JSON object as the last line (rank 0).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aed.train_distributed import cleanup, init_distributed  # noqa: E402
from aed.model import AED, AEDConfig  # noqa: E402
from bins import estimate_bins  # noqa: E402
from common import synthetic_corpus  # noqa: E402
from sampler import BucketingSampler  # noqa: E402

PROMPT_TOKENS = 6  # synthetic_corpus adds a 6-token prompt to every example


def scaled_corpus(n: int, scale: float, seed: int) -> list:
    """synthetic_corpus with durations / scale and text tokens / scale (the prompt kept)."""
    out = []
    for e in synthetic_corpus(n, seed):
        text = max(1, round((e["num_tokens"] - PROMPT_TOKENS) / scale))
        out.append({"duration": round(e["duration"] / scale, 3), "num_tokens": text + PROMPT_TOKENS})
    return out


def random_batch(examples: list, idx: list, cfg: AEDConfig, gen: torch.Generator) -> tuple:
    """Random features (B, T, F) and tokens (B, U) with the batch's true lengths (10 ms frames)."""
    feat_lens = torch.tensor([max(1, round(examples[i]["duration"] * 100)) for i in idx])
    token_lens = torch.tensor([examples[i]["num_tokens"] for i in idx])
    feats = torch.randn(len(idx), int(feat_lens.max()), cfg.n_mels, generator=gen)  # (B, T, F)
    tokens = torch.randint(2, cfg.vocab_size, (len(idx), int(token_lens.max())), generator=gen)  # (B, U)
    tokens[torch.arange(tokens.shape[1])[None, :] >= token_lens[:, None]] = cfg.pad_id
    return feats, feat_lens, tokens, token_lens, torch.full((len(idx),), PROMPT_TOKENS)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    args = p.parse_args()
    torch.set_num_threads(1)  # one per process: 4 processes on 2 cores already oversubscribe
    rank, _, world_size, device = init_distributed()
    if device.type != "cpu" or world_size < 2:
        sys.exit("run under torchrun with --nproc_per_node >= 2 on CPU (gloo)")

    examples = scaled_corpus(args.synthetic, args.time_scale, args.seed)
    bins = estimate_bins([e["duration"] for e in examples], [e["num_tokens"] for e in examples],
                         args.buckets, args.sub_buckets, method="equal")  # the paper's bins, as measured
    samplers = {name: BucketingSampler(examples, bins, max_duration=args.max_duration, rank=rank,
                                       world_size=world_size, sync_buckets=sync, infinite=True,
                                       buffer_size=len(examples), seed=args.seed, yield_indices=True)
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
        print(f"{'scheme':<8} {'step s':>7} {'max compute s':>13} {'busy':>5} {'same bucket':>11}")
        for name, r in res.items():
            print(f"{name:<8} {r['step_s']:>7.3f} {r['compute_max_s']:>13.3f} {r['busy']:>5.0%} "
                  f"{r['same_bucket']:>11.0%}")
        print(f"sync speedup (unsync step / sync step - 1): {speedup:.1%}")
        print(json.dumps({"world_size": world_size, "threads_per_process": 1, "steps": args.steps,
                          "block": args.block, "synthetic": args.synthetic, "time_scale": args.time_scale,
                          "max_duration": args.max_duration, "bins_shape": list(bins.shape),
                          "parameters": sum(q.numel() for q in params), "config": args.config,
                          "seconds": time.perf_counter() - t_start, **res, "speedup": speedup}))
    cleanup()


if __name__ == "__main__":
    main()
