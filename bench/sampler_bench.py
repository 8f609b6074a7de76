"""Sampler benchmark: padding, drops and speed of bucketing schemes over one epoch.

    python bench/sampler_bench.py --synthetic 100000 [--workload wide]
    python bench/sampler_bench.py --manifest train.jsonl [--batch-sizes oom_batch_sizes.json]
    pip install --target /tmp/peers -r bench/requirements-peers.txt
    PYTHONPATH=/tmp/peers python bench/sampler_bench.py --synthetic 100000 --peer lhotse

Schemes: fixed batch size (one bucket: the baseline that pads everything), 1D 30 buckets with a
360 s padded-duration budget, 2D 30x2 equal-count (the paper's) strict / flexible with the same
budget, 2D flexible plus the per-bucket TPS filter, 2D with per-bucket batch sizes
(`--batch-sizes`, oom.py's JSON; by default a stand-in memory model, `common.model_batch_sizes`),
and `2d-optimised`: the same 60 buckets laid out for the least padding (bins.py), flexible.
Padding is element-weighted over the epoch: 1 - sum(lengths) / sum(batch_size * max_length);
`2d-bucket-bounds` is 2d-optimised with every batch padded to its bucket's bounds instead (the
first bucket that holds it, as train.compile pads batches to give each bucket one shape).
Every scheme runs in a fresh process so its peak RSS is its own (the RSS includes the examples
list). A second table replays a slow source (--slow-us per example, e.g. JSONL parsing plus
tokenization) with a simulated training step of --step-ms per batch, with and without the
producer thread: the first batch waits for start_fill x buffer_size examples, so at 200 us per
example and 10% of 20000 it cannot come before 0.4 s (the table shows what the source alone took).
`--frontier 30 40` adds the optimised bins' audio/text padding trade-off at 60 and 80 buckets.

`--synthetic N` mimics a large ASR/AST corpus (common.synthetic_corpus): 64% of utterances 2-20 s,
28% a tail to 40 s, 4% long recordings with little speech, 3% under 2 s, 1% high-TPS outliers
(2-4x); 3.4 +- 0.5 tokens/s plus a 6-token prompt. `--workload wide` is `common.wide_corpus`
instead: speech rates spread from 0.5 to 6 tokens/s (see there); `--workload paper` is
`common.paper_corpus`, the workload of bench/oom_bench.py's E2 table. Timings share 2 cores with whatever else runs: treat them as noisy.
The last line printed is a JSON object with every number.
"""

import argparse
import json
import multiprocessing as mp
import resource
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bins import Bins, estimate_bins, load_batch_sizes, save_batch_sizes  # noqa: E402
from common import JsonlSource, model_batch_sizes, paper_corpus, synthetic_corpus, wide_corpus  # noqa: E402
from sampler import BucketingSampler  # noqa: E402


def load_examples(args) -> list:
    if args.manifest is None:
        corpus = {"synthetic": synthetic_corpus, "wide": wide_corpus, "paper": paper_corpus}[args.workload]
        return corpus(args.synthetic, args.seed)
    with open(args.manifest) as f:
        return [{"id": i, **json.loads(line)} for i, line in enumerate(f) if line.strip()]


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def scheme_config(name: str, args, ex: list, tmp: str) -> tuple:
    durs, toks = [e["duration"] for e in ex], [e["num_tokens"] for e in ex]
    if name == "fixed":
        return Bins([max(durs)]), dict(batch_size=args.fixed_batch_size)
    if name == "1d-30":
        return estimate_bins(durs, toks, 30, 1), dict(max_duration=args.max_duration)
    if name in ("2d-optimised", "2d-bucket-bounds"):
        return estimate_bins(durs, toks, 30, 2, method="optimised"), dict(max_duration=args.max_duration)
    bins = estimate_bins(durs, toks, 30, 2, method="equal")
    if name == "2d-strict":
        return bins, dict(max_duration=args.max_duration, allocation="strict")
    if name == "2d-flexible":
        return bins, dict(max_duration=args.max_duration)
    if name == "2d-flexible-tps":
        return bins, dict(max_duration=args.max_duration, max_tps=bins.max_tps)
    path = args.batch_sizes or f"{tmp}/batch_sizes.json"
    if not args.batch_sizes:
        save_batch_sizes(path, bins, model_batch_sizes(bins))
    bins, sizes = load_batch_sizes(path)
    return bins, dict(batch_sizes=sizes)


def summary(name: str, t: list, batches: int, examples: int, padded: list, drops: dict, base_rss: float) -> dict:
    """t = [construction start, iteration start, first batch, epoch end]; padded = the four
    element sums behind the padding ratios (audio, padded audio, tokens, padded tokens)."""
    return {"scheme": name, "batches": batches, "mean_batch": examples / batches,
            "audio_padding": 1 - padded[0] / padded[1], "text_padding": 1 - padded[2] / padded[3], "drops": drops,
            "init_s": t[1] - t[0], "ttfb_s": t[2] - t[1], "epoch_s": t[3] - t[1],
            "batches_per_s": batches / (t[3] - t[1]), "examples_per_s": examples / (t[3] - t[1]),
            "peak_rss_mb": rss_mb(), "sampler_rss_mb": rss_mb() - base_rss}


def run_scheme(name: str, args) -> dict:
    ex = load_examples(args)
    with tempfile.TemporaryDirectory() as tmp:
        bins, kw = scheme_config(name, args, ex, tmp)
    base = rss_mb()
    t = [time.perf_counter()]
    s = BucketingSampler(ex, bins, buffer_size=args.buffer_size, seed=args.seed, yield_indices=True, **kw)
    t.append(time.perf_counter())
    bounds = [0.0, 0.0]  # padded audio and tokens when each batch is padded to its bucket's bounds
    for batch in s:
        if len(t) == 2:
            t.append(time.perf_counter())
        if name == "2d-bucket-bounds":
            d, n = max(ex[i]["duration"] for i in batch), max(ex[i]["num_tokens"] for i in batch)
            bd, bn = next((bd, bn) for bd, bn in bins.buckets() if bd >= d and bn >= n)
            bounds[0], bounds[1] = bounds[0] + len(batch) * bd, bounds[1] + len(batch) * bn
    t.append(time.perf_counter())
    st = s.stats
    padded = [st["duration"], bounds[0] or st["padded_duration"], st["tokens"], bounds[1] or st["padded_tokens"]]
    return summary(name, t, st["batches"], st["examples"], padded, st["drops"], base)


def run_lhotse(args) -> dict:
    try:
        from lhotse import CutSet, MonoCut
        from lhotse.dataset.sampling.dynamic_bucketing import DynamicBucketingSampler
    except ImportError as e:
        return {"scheme": "lhotse-1d-30", "error": f"lhotse missing ({e}): see bench/requirements-peers.txt"}
    warnings.filterwarnings("ignore", message=".*eagerly read CutSet")  # in memory on purpose: same data as ours
    ex = load_examples(args)
    bins = estimate_bins([e["duration"] for e in ex], [e["num_tokens"] for e in ex], 30, 1)
    tokens = {str(e["id"]): e["num_tokens"] for e in ex}
    cuts = CutSet.from_cuts(MonoCut(id=str(e["id"]), start=0.0, duration=e["duration"], channel=0) for e in ex)
    base = rss_mb()
    t = [time.perf_counter()]
    # Same 30 duration bins as our 1D scheme (Lhotse's last bucket is open-ended), same budget.
    s = DynamicBucketingSampler(cuts, max_duration=args.max_duration, num_buckets=30, shuffle=True,
                                duration_bins=bins.durations[:-1], buffer_size=args.buffer_size, seed=args.seed)
    t.append(time.perf_counter())
    n, nb, padded = 0, 0, np.zeros(4)
    for batch in s:
        if len(t) == 2:
            t.append(time.perf_counter())
        d, k = [c.duration for c in batch], [tokens[c.id] for c in batch]
        padded += [sum(d), len(d) * max(d), sum(k), len(k) * max(k)]
        n, nb = n + len(d), nb + 1
    t.append(time.perf_counter())
    return summary("lhotse-1d-30", t, nb, n, padded.tolist(), {"not_yielded": len(ex) - n}, base)


class SlowJsonl(JsonlSource):
    """A JSONL source that costs `us` microseconds per example (sleeps release the GIL, like I/O)."""

    def __init__(self, path, us: float):
        super().__init__(path)
        self.us = us

    def read(self, *a, **kw):
        for k, item in enumerate(super().read(*a, **kw)):
            if k % 10 == 9:  # sleep in groups of 10: single 200 us sleeps overshoot a lot
                time.sleep(10 * self.us / 1e6)
            yield item


def run_slow(label: str, args, start_fill: float, concurrent: bool, first_batch_only: bool = False) -> dict:
    ex = load_examples(args)[: args.slow_examples]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "slow.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in ex))
        bins = estimate_bins([e["duration"] for e in ex], [e["num_tokens"] for e in ex], 30, 2, method="equal")
        t0 = time.perf_counter()  # what the source alone takes to supply the examples the first batch waits for
        first = max(1, int(start_fill * args.buffer_size))
        for _ in zip(range(first), SlowJsonl(path, args.slow_us).read(args.seed, 0, 1)):
            pass
        source_s = time.perf_counter() - t0
        s = BucketingSampler(SlowJsonl(path, args.slow_us), bins, max_duration=args.max_duration, seed=args.seed,
                             buffer_size=args.buffer_size, start_fill=start_fill, concurrent=concurrent)
        t0 = time.perf_counter()
        ttfb = None
        for _ in s:
            ttfb = ttfb if ttfb is not None else time.perf_counter() - t0
            if first_batch_only:
                break
            time.sleep(args.step_ms / 1e3)  # the training step the reader can overlap with
        t1 = time.perf_counter()
    return {"scheme": label, "start_fill": start_fill, "concurrent": concurrent, "ttfb_s": ttfb, "source_s": source_s,
            "epoch_s": None if first_batch_only else t1 - t0, "batches": s.stats["batches"]}


FRONTIER_WEIGHTS = (2.0, 4.0, 8.0, 16.0, 32.0)


def run_frontier(args) -> list:
    """The optimised layout's audio/text padding trade-off: for each duration-bin count in
    --frontier (x2 buckets) and each audio weight, the epoch's padding with those bins."""
    ex = load_examples(args)
    durs, toks = [e["duration"] for e in ex], [e["num_tokens"] for e in ex]
    rows = []
    for n in args.frontier:
        for w in FRONTIER_WEIGHTS:
            bins = estimate_bins(durs, toks, n, 2, method="optimised", audio_weight=w)
            s = BucketingSampler(ex, bins, buffer_size=args.buffer_size, seed=args.seed, yield_indices=True,
                                 max_duration=args.max_duration)
            for _ in s:
                pass
            st = s.stats
            rows.append({"buckets": 2 * n, "audio_weight": w, "duration_bins": len(bins.durations),
                         "audio_padding": 1 - st["duration"] / st["padded_duration"],
                         "text_padding": 1 - st["tokens"] / st["padded_tokens"], "drops": sum(st["drops"].values())})
    return rows


def in_child(fn, *a):
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *a).result()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--synthetic", type=int, default=100_000, help="examples in the synthetic corpus")
    p.add_argument("--workload", choices=["synthetic", "wide", "paper"], default="synthetic",
                   help="which synthetic corpus")
    p.add_argument("--manifest", default=None, help="JSONL with duration and num_tokens (instead of --synthetic)")
    p.add_argument("--batch-sizes", default=None, help="oom.py's per-bucket batch sizes JSON (2d-per-bucket)")
    p.add_argument("--peer", choices=["lhotse"], default=None)
    p.add_argument("--max-duration", type=float, default=360.0)
    p.add_argument("--fixed-batch-size", type=int, default=64)
    p.add_argument("--buffer-size", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow-us", type=float, default=200.0, help="simulated source cost per example")
    p.add_argument("--slow-examples", type=int, default=40_000)
    p.add_argument("--step-ms", type=float, default=4.0, help="simulated training step in the slow-source runs")
    p.add_argument("--frontier", type=int, nargs="*", default=[],
                   help="also print the optimised bins' audio/text padding trade-off for these duration-bin counts "
                        "(x2 buckets each), one row per audio weight (~1 min per count)")
    args = p.parse_args()

    names = ["fixed", "1d-30", "2d-strict", "2d-flexible", "2d-flexible-tps", "2d-per-bucket", "2d-optimised",
             "2d-bucket-bounds"]
    rows = [in_child(run_scheme, n, args) for n in names]
    if args.peer == "lhotse":
        rows.append(in_child(run_lhotse, args))
    slow_runs = [("100%, inline", 1.0, False, True), ("10%, inline", 0.1, False),
                 ("10%, thread", 0.1, True), ("3%, thread", 0.03, True)]
    slow = [in_child(run_slow, label, args, *cfg) for label, *cfg in slow_runs]
    frontier = in_child(run_frontier, args) if args.frontier else []

    data = f"{args.workload} {args.synthetic}" if args.manifest is None else args.manifest
    print(f"workload: {data}, buffer {args.buffer_size}, budget {args.max_duration:g} s")
    print(f"{'scheme':<16} {'batches':>7} {'mean bs':>7} {'audio pad':>9} {'text pad':>8} {'init s':>6} "
          f"{'ttfb s':>6} {'batch/s':>8} {'ex/s':>9} {'RSS MB':>7} {'+MB':>5}  drops")
    for r in rows:
        if "error" in r:
            print(f"{r['scheme']:<16} {r['error']}")
            continue
        print(f"{r['scheme']:<16} {r['batches']:>7} {r['mean_batch']:>7.1f} {r['audio_padding']:>9.1%} "
              f"{r['text_padding']:>8.1%} {r['init_s']:>6.2f} {r['ttfb_s']:>6.3f} {r['batches_per_s']:>8.0f} "
              f"{r['examples_per_s']:>9.0f} {r['peak_rss_mb']:>7.0f} {r['sampler_rss_mb']:>5.0f}  {r['drops'] or '-'}")
    print(f"\nslow source (2D 30x2 flexible): {args.slow_examples} examples at {args.slow_us:g} us each, "
          f"{args.step_ms:g} ms simulated training step per batch")
    print(f"{'start, reader':<14} {'ttfb s':>7} {'source s':>8} {'epoch s':>8}")
    for r in slow:
        print(f"{r['scheme']:<14} {r['ttfb_s']:>7.3f} {r['source_s']:>8.3f} {r['epoch_s'] or float('nan'):>8.2f}")
    print("the first batch waits for start_fill x buffer_size examples, thread or not (the batches are the same "
          "by design): source s,\nthe measured time the source alone takes to supply them (nominally start_fill x "
          "buffer_size x slow-us), is a lower bound on ttfb;\nthe thread overlaps the reading that follows with the "
          "training steps")
    if frontier:
        print("\noptimised bins, audio/text padding trade-off (estimate_bins(audio_weight=w)), flexible, one epoch")
        print(f"{'buckets':>7} {'weight':>6} {'dur bins':>8} {'audio pad':>9} {'text pad':>8} {'drops':>5}")
        for r in frontier:
            print(f"{r['buckets']:>7} {r['audio_weight']:>6g} {r['duration_bins']:>8} {r['audio_padding']:>9.1%} "
                  f"{r['text_padding']:>8.1%} {r['drops']:>5}")

    by = {r["scheme"]: r for r in rows}
    flex, opt = by["2d-flexible"], by["2d-optimised"]
    ten = next(r for r in slow if r["concurrent"] and r["start_fill"] == 0.1)
    targets = {"2d_flexible_audio_padding_le_5pct": flex["audio_padding"] <= 0.05,
               "2d_flexible_text_padding_le_20pct": flex["text_padding"] <= 0.20,
               "2d_optimised_audio_padding_le_5pct": opt["audio_padding"] <= 0.05,
               "2d_optimised_text_padding_le_30pct": opt["text_padding"] <= 0.30,
               "2d_optimised_drops_le_2d_flexible": sum(opt["drops"].values()) <= sum(flex["drops"].values()),
               "ttfb_concurrent_slow_le_0.2s": min(r["ttfb_s"] for r in slow if r["concurrent"]) <= 0.2,
               "ttfb_10pct_thread_lt_0.3s": ten["ttfb_s"] < 0.3,
               "ttfb_10pct_thread_minus_source_lt_0.1s": ten["ttfb_s"] - ten["source_s"] < 0.1}
    if "examples_per_s" in by.get("lhotse-1d-30", {}):
        for name in ("2d-flexible", "2d-optimised"):
            ratio = by[name]["examples_per_s"] / by["lhotse-1d-30"]["examples_per_s"]
            by[name]["vs_lhotse_examples_per_s"] = ratio
            targets[f"{name.replace('-', '_')}_ge_2.5x_lhotse_examples_per_s"] = ratio >= 2.5
    workload = {"data": data, "buffer_size": args.buffer_size, "max_duration": args.max_duration}
    print(json.dumps({"workload": workload, "schemes": by, "slow_source": slow, "frontier": frontier,
                      "targets": targets}))


if __name__ == "__main__":
    main()
