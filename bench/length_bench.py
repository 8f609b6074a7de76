"""Decoding as sentences grow: ASR WER per reference length for greedy and beam search, with and
without a length penalty, at two CTC weights, on one checkpoint.

    python bench/length_bench.py --ckpt runs/laptop-long --manifest data/long/test.jsonl
    python bench/length_bench.py --ckpt runs/laptop --manifest data/sentences/test.jsonl --bins 3 9 17 41

Each setting transcribes the ASR lines of the manifest through infer.py's pipeline
(aed.decode_transcribe.transcribe, the model's own trim and edges) and scores every utterance's
normalised words (aed.decode_metrics.simple); the table has one row per setting and a column per
bin of reference words (a bin [a, b) holds the utterances of a to b - 1 words), each its corpus WER
with the bin's utterance count in the header. The question it answers: does the beam stay ahead of
greedy as sentences lengthen, and does a length penalty or another CTC weight help the long ones?
Prints the table, then a JSON object as the last line.
"""

import argparse

import jiwer
from common import add_device_args, device_from_args, load_avg, log, print_json, print_table

from aed.decode_metrics import simple
from aed.decode_search import DecodingOptions
from aed.decode_transcribe import read_requests, transcribe
from aed.model_checkpoint import load_model

SETTINGS = {  # name: DecodingOptions fields; the recipe's decoding is "beam 4, CTC 0.3"
    "greedy, CTC 0.3": dict(beam_size=1, ctc_weight=0.3),
    "beam 4, CTC 0.3": dict(beam_size=4, ctc_weight=0.3),
    "beam 4, CTC 0.3, length penalty 1": dict(beam_size=4, ctc_weight=0.3, length_penalty=1.0),
    "greedy, CTC 0.5": dict(beam_size=1, ctc_weight=0.5),
    "beam 4, CTC 0.5": dict(beam_size=4, ctc_weight=0.5),
    "beam 8, CTC 0.3": dict(beam_size=8, ctc_weight=0.3),
}


def wer_by_length(results, bounds: list) -> tuple[list, list]:
    """Corpus WER % per reference-length bin [bounds[i], bounds[i + 1]) and the utterances in each;
    a bin without utterances gets None."""
    pairs = [(simple(r.request.text), simple(r.pred_text)) for r in results if r.error is None]
    wers, counts = [], []
    for low, high in zip(bounds, bounds[1:]):
        inside = [(ref, hyp) for ref, hyp in pairs if low <= len(ref.split()) < high]
        counts.append(len(inside))
        if not inside:
            wers.append(None)
            continue
        out = jiwer.process_words([ref for ref, _ in inside], [hyp for _, hyp in inside])
        errors = out.insertions + out.deletions + out.substitutions
        wers.append(round(100 * errors / sum(len(ref.split()) for ref, _ in inside), 2))
    return wers, counts


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a checkpoint file or run directory")
    p.add_argument("--manifest", required=True, help="a test manifest; its ASR lines are decoded")
    p.add_argument("--bins", type=int, nargs="+", default=[1, 6, 11, 16, 21, 41],
                   help="reference-length bin edges in words, ascending: [a, b) per bin")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), metavar="NAME",
                   help=f"which decodings to run, of: {'; '.join(SETTINGS)}")
    add_device_args(p)
    args = p.parse_args()
    if sorted(set(args.bins)) != args.bins or len(args.bins) < 2:
        p.error("--bins: at least two edges, strictly ascending")
    device = device_from_args(args)
    asr = load_model(args.ckpt, device)
    requests = [r for r in read_requests(args.manifest) if r.taskname == "asr" and r.text]
    log(f"{len(requests)} ASR utterances of {args.manifest}")

    rows = []
    for name in args.settings:
        results, timings = transcribe(asr, requests, DecodingOptions(**SETTINGS[name]))
        wers, counts = wer_by_length(results, [args.bins[0], 10**9])
        by_bin, counts = wer_by_length(results, args.bins)
        rows.append({"setting": name, "wer": wers[0], "by_length": by_bin, "search_s": round(timings.decoder, 1)})
        log(f"{name}: WER {wers[0]} ({' / '.join(map(str, by_bin))} by length), search {timings.decoder:.1f} s")

    bins = [f"{a}-{b - 1} ({n})" for a, b, n in zip(args.bins, args.bins[1:], counts)]
    print_table([("setting", "<36"), ("all", ">6"), *[(b, ">10") for b in bins], ("search s", "8.1f")],
                [[r["setting"], r["wer"], *["-" if w is None else w for w in r["by_length"]], r["search_s"]]
                 for r in rows])
    print_json({"ckpt": asr.path, "manifest": args.manifest, "bins": args.bins, "counts": counts,
                "device": str(device), "threads": args.threads, "load_avg": load_avg(), "rows": rows})


if __name__ == "__main__":
    main()
