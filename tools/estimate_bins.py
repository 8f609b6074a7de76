"""Estimate bucket bins from training manifests, counting tokens exactly as training does.

    python tools/estimate_bins.py --manifest train.jsonl --tokenizer data/mini/tokenizer -o bins.json
    python tools/estimate_bins.py --manifest '{shar: data/shar}' --tokenizer data/mini/tokenizer -o bins.json
    python tools/estimate_bins.py --manifest a.jsonl --manifest b.jsonl --tokenizer TOK_DIR \\
        --buckets 30 --sub-buckets 2 --method equal --sample 100000 --max-tokens 512 -o bins.json

An example's token count is the length of what the decoder is trained on: prompt + text + EOS,
from `aed.data_batch.encode_utterance` with the training tokenizer (train.tokenizer), after the line is
parsed by the manifest reader training uses (.gz manifests and NeMo's `lang` / `answer` included). Bins are estimated from a uniform random sample of
the non-empty lines of all manifests (one pass, reservoir sampling); lines that do not parse or
tokenize are skipped and counted by reason (aed/train_data.py, shared with oom.py --manifest).
Progress goes to stderr. The bins go to `-o`, with a `meta` record of what they were estimated
from; `bins.py` explains the estimation itself.
"""

import argparse
import json
import sys
import time
from bisect import bisect_left
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing aed

from aed.train_data import bins_from_manifests  # noqa: E402
from aed.data_sources import parse_spec  # noqa: E402
from aed.data_tokenizer import Tokenizer  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--manifest", action="append", required=True, type=parse_spec,
                   help="a train.manifests entry (repeat for several): a JSONL path, or a YAML mapping such as "
                        "'{shar: data/shar}' (README: Your data as it is)")
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
    p.add_argument("--speed-perturb", type=lambda s: [float(f) for f in s.split(",")], default=[],
                   help="comma-separated factors, as train.speed_perturb (e.g. 0.9,1.0,1.1): bins of the perturbed durations")
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)

    t0 = time.time()
    tokenizer = Tokenizer.load(args.tokenizer)
    try:
        bins, meta = bins_from_manifests(args.manifest, tokenizer, args.buckets, args.sub_buckets, args.method,
                                         args.sample, args.seed, args.outlier_z, args.max_tokens,
                                         args.audio_weight, args.speed_perturb)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    meta["tokenizer"] = args.tokenizer
    Path(args.output).write_text(json.dumps({**bins.to_dict(), "meta": meta}) + "\n")
    print(f"{'bucket':>6} {'<= s':>8} {'<= tokens':>9} {'max tps':>8} {'count':>7}", file=sys.stderr)
    counts = [c for row in bins.counts for c in row]
    for b, (d, t) in enumerate(bins.buckets()):
        i = bisect_left(bins.durations, d)
        print(f"{b:>6} {d:>8.2f} {t:>9} {bins.max_tps[i]:>8.2f} {counts[b]:>7}", file=sys.stderr)
    print(f"estimate_bins: {bins.num_buckets} buckets from {meta['used']:,} of {meta['lines']:,} lines "
          f"in {time.time() - t0:.1f}s -> {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
