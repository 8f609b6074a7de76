"""Joint CTC/attention decoding and the looping guards vs the attention decoder alone, on one checkpoint.

    python train.py configs/tiny.yaml train.manifests=[data/mini/train.jsonl] val.manifests=[data/mini/dev.jsonl] \\
        max_steps=400 run_dir=runs/dec                                   # ~10 min on a busy 2-core machine
    python bench/joint_decoding_bench.py --ckpt runs/dec/ckpt-00000200.pt runs/dec/ckpt-00000400.pt

Each checkpoint transcribes the manifest through infer.py's pipeline (aed.inference.transcribe) with:
- attention: the attention decoder alone, no guards (the decoding before joint CTC/attention existed);
- guards: + stop at an n-gram repeated more than 4 times or at 25 tokens per second of audio;
- joint: + CTC prefix scores with weight 0.3 (the default of infer.py and validation);
at beam 1 (greedy) and beam 4. Columns: ASR WER (normalised) and its insertions, deletions and
substitutions, hypothesis / reference words (ASR), generated tokens (all files: a looping hypothesis
shows here, even when its pieces join into few words), mean AST BLEU, and the search's seconds (the
encoder's are the same for every row; best of --repeats runs, as the CPU is shared).
Prints a table, then a JSON object as the last line.
"""

import argparse
import json
import sys
from pathlib import Path

import jiwer
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing aed

from aed.inference import load_checkpoint, read_requests, score, transcribe
from aed.metrics import normalize_text

SETTINGS = {  # name: transcribe() options
    "attention": dict(ctc_weight=0.0, max_repeats=0, max_tokens_per_second=None),
    "guards": dict(ctc_weight=0.0),
    "joint": dict(),
}


def asr_errors(results) -> dict:
    """Corpus insertions, deletions, substitutions and word counts of the ASR results (normalised text)."""
    pairs = [(normalize_text(r.request.text), normalize_text(r.pred_text)) for r in results
             if r.error is None and r.request.taskname == "asr" and r.request.text]
    out = jiwer.process_words([ref for ref, _ in pairs], [hyp for _, hyp in pairs])
    return {"ins": out.insertions, "del": out.deletions, "sub": out.substitutions,
            "ref_words": sum(len(ref.split()) for ref, _ in pairs), "hyp_words": sum(len(hyp.split()) for _, hyp in pairs)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", nargs="+", required=True, help="checkpoint files or run directories")
    p.add_argument("--manifest", default="data/mini/dev.jsonl")
    p.add_argument("--beam-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=2, help="runs per row; the fastest search time is reported")
    args = p.parse_args()
    torch.set_num_threads(1)

    rows = []
    for ckpt in args.ckpt:
        asr = load_checkpoint(ckpt)
        requests = read_requests(args.manifest)
        for beam in args.beam_sizes:
            for name, options in SETTINGS.items():
                runs = [transcribe(asr, requests, beam_size=beam, **options) for _ in range(args.repeats)]
                results, _ = runs[0]
                scores = score(results)
                wers = [(m["wer"], m["n"]) for k, m in scores.items() if k.startswith("asr")]
                bleus = [m["bleu"] for k, m in scores.items() if k.startswith("ast")]
                errors = asr_errors(results)
                rows.append({"ckpt": asr.path, "beam": beam, "decoding": name,
                             "wer": round(100 * (errors["ins"] + errors["del"] + errors["sub"]) / errors["ref_words"], 2),
                             **errors, "tokens": sum(len(res.tokens) for res in results),
                             "bleu": round(sum(bleus) / len(bleus), 2) if bleus else None,
                             "search_s": round(min(t.decoder for _, t in runs), 2),
                             "encoder_s": round(min(t.encoder for _, t in runs), 2),
                             "audio_s": round(runs[0][1].audio, 1)})
                r = rows[-1]
                print(f"  done {Path(r['ckpt']).name} beam {beam} {name}: WER {r['wer']} (asr groups {wers})",
                      file=sys.stderr, flush=True)

    header = (f"{'checkpoint':20s} {'beam':>4s} {'decoding':>9s} {'WER %':>7s} {'ins':>5s} {'del':>5s} {'sub':>5s} "
              f"{'hyp/ref words':>13s} {'tokens':>6s} {'BLEU':>5s} {'search s':>8s} {'encoder s':>9s}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{Path(r['ckpt']).name:20s} {r['beam']:4d} {r['decoding']:>9s} {r['wer']:7.2f} {r['ins']:5d} "
              f"{r['del']:5d} {r['sub']:5d} {r['hyp_words']:6d}/{r['ref_words']:<6d} {r['tokens']:6d} "
              f"{r['bleu'] or 0:5.2f} {r['search_s']:8.2f} {r['encoder_s']:9.2f}")
    print(json.dumps({"manifest": args.manifest, "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
