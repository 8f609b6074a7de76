"""Estimate bucket bins from training manifests, counting tokens exactly as training does.

    python tools/estimate_bins.py --manifest train.jsonl --tokenizer data/mini/tokenizer -o bins.json
    python tools/estimate_bins.py --manifest a.jsonl --manifest b.jsonl --tokenizer TOK_DIR \\
        --buckets 30 --sub-buckets 2 --method equal --sample 100000 --max-tokens 512 -o bins.json

An example's token count is the length of what the decoder is trained on: prompt + text + EOS,
from `aed.data.encode_utterance` with the training tokenizer (train.tokenizer), after the line is
parsed by the manifest reader training uses. Bins are estimated from a uniform random sample of
the non-empty lines of all manifests (one pass, reservoir sampling); lines that do not parse or
tokenize are skipped and counted by reason. Progress goes to stderr. The bins go to `-o`, with a
`meta` record of what they were estimated from; `bins.py` explains the estimation itself.
"""

import argparse
import json
import os
import random
import sys
import time
from bisect import bisect_left
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing aed

from aed.data import ManifestError, encode_utterance, parse_line  # noqa: E402
from aed.tokenizer import Tokenizer  # noqa: E402
from bins import estimate_bins  # noqa: E402


def sample_lines(paths: list, n: int | None, seed: int) -> tuple:
    """Uniform random sample of n non-empty lines over all manifests: ([(path, line_no, line)], total)."""
    rng, sample, seen, last = random.Random(seed), [], 0, time.time()
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if n is None or seen < n:
                    sample.append((path, line_no, line))
                elif (j := rng.randrange(seen + 1)) < n:
                    sample[j] = (path, line_no, line)
                seen += 1
                if seen % 100_000 == 0 and time.time() - last > 2:
                    last = time.time()
                    print(f"estimate_bins: scanned {seen:,} lines ({path})", file=sys.stderr)
    return sample, seen


def measure(lines: list, tokenizer, max_tokens: int | None) -> tuple:
    """(durations, num_tokens, skipped by reason, first skipped line per reason)."""
    durations, num_tokens, skipped, example = [], [], Counter(), {}
    last = time.time()
    for k, (path, line_no, line) in enumerate(lines, 1):
        where = f"{path}:{line_no}"
        try:
            utt = parse_line(line, where, os.path.dirname(os.path.abspath(path)))
            n = len(encode_utterance(tokenizer, utt)[0])
        except ManifestError as e:
            skipped["bad_line"] += 1
            example.setdefault("bad_line", str(e))
            continue
        except (ValueError, KeyError) as e:  # e.g. a language the tokenizer does not know
            skipped["not_tokenizable"] += 1
            example.setdefault("not_tokenizable", f"{where}: {e}")
            continue
        if max_tokens is not None and n > max_tokens:
            skipped["over_max_tokens"] += 1
            example.setdefault("over_max_tokens", f"{where}: {n} tokens")
            continue
        durations.append(utt.duration)
        num_tokens.append(n)
        if time.time() - last > 2:
            last = time.time()
            print(f"estimate_bins: tokenized {k:,} of {len(lines):,} sampled lines", file=sys.stderr)
    return durations, num_tokens, skipped, example


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--manifest", action="append", required=True, help="NeMo-style JSONL (repeat for several)")
    p.add_argument("--tokenizer", required=True, help="the training tokenizer directory (train.tokenizer)")
    p.add_argument("--buckets", type=int, default=30, help="duration bins")
    p.add_argument("--sub-buckets", type=int, default=2, help="token sub-bins per duration bin (1 = 1D bucketing)")
    p.add_argument("--method", choices=["optimised", "equal"], default="optimised",
                   help="optimised: --buckets x --sub-buckets buckets laid out for the least padding; "
                        "equal: the paper's equal-count bins")
    p.add_argument("--audio-weight", type=float, default=None,
                   help="optimised only: trade audio for text padding (least weight x audio + text padding); "
                        "default: the least text padding with no more audio padding than equal-count bins")
    p.add_argument("--sample", type=int, default=None, help="estimate from a uniform random sample of this many lines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--outlier-z", type=float, default=4.0, help="drop TPS outliers above this z-score per duration bin")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="leave out longer examples, as train.py does with model.dec_max_len")
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)

    t0 = time.time()
    tokenizer = Tokenizer.load(args.tokenizer)
    lines, total = sample_lines(args.manifest, args.sample, args.seed)
    durations, num_tokens, skipped, example = measure(lines, tokenizer, args.max_tokens)
    for reason, n in skipped.items():
        print(f"estimate_bins: skipped {n:,} sampled lines ({reason}), e.g. {example[reason]}", file=sys.stderr)
    if not durations:
        raise SystemExit(f"estimate_bins: no usable line in {len(lines):,} sampled lines")
    bins = estimate_bins(durations, num_tokens, args.buckets, args.sub_buckets, args.outlier_z, args.method,
                        args.audio_weight)

    meta = {"manifests": args.manifest, "tokenizer": args.tokenizer, "lines": total, "sampled": len(lines),
            "skipped": dict(skipped), "method": args.method, "audio_weight": args.audio_weight, "seed": args.seed,
            "outlier_z": args.outlier_z, "max_tokens": args.max_tokens}
    Path(args.output).write_text(json.dumps({**bins.to_dict(), "meta": meta}) + "\n")
    print(f"{'bucket':>6} {'<= s':>8} {'<= tokens':>9} {'max tps':>8} {'count':>7}", file=sys.stderr)
    counts = [c for row in bins.counts for c in row]
    for b, (d, t) in enumerate(bins.buckets()):
        i = bisect_left(bins.durations, d)
        print(f"{b:>6} {d:>8.2f} {t:>9} {bins.max_tps[i]:>8.2f} {counts[b]:>7}", file=sys.stderr)
    print(f"estimate_bins: {bins.num_buckets} buckets from {len(durations):,} of {total:,} lines "
          f"in {time.time() - t0:.1f}s -> {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
