"""Count a token n-gram language model of training transcripts, for infer.py's --lm (shallow fusion).

Manifests are read as tools/train_tokenizer.py reads them (the target text of every line, in its
target language; a bad line stops with file:line and field, or with --skip-invalid is skipped and
counted), and each text is encoded with the model's tokenizer: the n-gram is over the same ids the
decoder emits. Only training text: the model then knows the corpus's words, not its test sentences.

    python tools/train_lm.py --manifest data/sentences/train.jsonl --tokenizer data/sentences/tokenizer -o runs/laptop/lm.pt
    python infer.py --ckpt runs/laptop --manifest data/sentences/test.jsonl --beam-size 4 --ctc-weight 0.3 --lm runs/laptop/lm.pt

aed/decode_lm.py says what the model is and why it helps a small model.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing aed

from aed.data_manifest import Faults  # noqa: E402
from aed.data_tokenizer import Tokenizer  # noqa: E402
from aed.decode_lm import count_transcripts  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", nargs="+", required=True, help="training manifests (JSONL, plain or .gz)")
    p.add_argument("--tokenizer", required=True, help="the model's tokenizer directory (train.tokenizer)")
    p.add_argument("--order", type=int, default=7,
                   help="n of the n-gram: 7 characters span about a word and a half (default: %(default)s)")
    p.add_argument("--skip-invalid", action="store_true", help="skip and count bad manifest lines instead of stopping")
    p.add_argument("-o", "--out", required=True, help="the model file to write (infer.py --lm)")
    args = p.parse_args(argv)

    start = time.perf_counter()
    tokenizer = Tokenizer.load(args.tokenizer)
    faults = Faults()
    try:
        lm = count_transcripts(args.manifest, tokenizer, args.order, args.skip_invalid, faults)
    except ValueError as e:
        sys.exit(str(e))
    lm.save(args.out)
    tokens = sum(len(s) for s in lm.sequences)
    skipped = f"; skipped: {faults.summary()}" if faults.counts else ""
    print(f"{len(lm.sequences)} transcripts, {tokens} tokens, order {args.order}: "
          f"{sum(len(t) for t in lm.tables)} contexts; saved to {args.out} in {time.perf_counter() - start:.1f} s{skipped}")


if __name__ == "__main__":
    main()
