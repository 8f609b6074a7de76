"""Joint CTC/attention decoding and the looping guards vs the attention decoder alone, on one checkpoint.

    python train.py configs/tiny.yaml train.manifests=[data/mini/train.jsonl] val.manifests=[data/mini/dev.jsonl] \\
        max_steps=400 run_dir=runs/dec                                   # ~10 min on a busy 2-core machine
    python bench/joint_decoding_bench.py --ckpt runs/dec/ckpt-00000200.pt runs/dec/ckpt-00000400.pt
    python train.py configs/tiny.yaml max_steps=400 run_dir=runs/digits          # the digit strings
    python bench/joint_decoding_bench.py --ckpt runs/digits --manifest data/mini/digits/dev.jsonl

Each checkpoint transcribes the manifest through infer.py's pipeline (aed.decode_transcribe.transcribe) with:
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
from pathlib import Path

import jiwer
from common import add_device_args, device_from_args, load_avg, log, print_json, print_table

from aed.decode_metrics import simple
from aed.decode_search import DecodingOptions
from aed.decode_transcribe import read_requests, score, transcribe
from aed.model_checkpoint import load_model

SETTINGS = {  # name: DecodingOptions fields other than beam_size
    "attention": dict(ctc_weight=0.0, max_repeats=0, max_tokens_per_second=None),
    "guards": dict(ctc_weight=0.0),
    "joint": dict(),
}


def asr_errors(results) -> dict:
    """Corpus insertions, deletions, substitutions and word counts of the ASR results (normalised text)."""
    pairs = [(simple(r.request.text), simple(r.pred_text)) for r in results
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
    add_device_args(p)
    args = p.parse_args()
    device = device_from_args(args)

    rows = []
    for ckpt in args.ckpt:
        asr = load_model(ckpt, device)
        requests = read_requests(args.manifest)
        for beam in args.beam_sizes:
            for name, fields in SETTINGS.items():
                options = DecodingOptions(beam_size=beam, **fields)
                runs = [transcribe(asr, requests, options) for _ in range(args.repeats)]
                results, _ = runs[0]
                scores = score(results)
                bleus = [m["bleu"] for k, m in scores.items() if k.startswith("ast")]
                errors = asr_errors(results)
                rows.append({"ckpt": asr.path, "beam": beam, "decoding": name,
                             "wer": round(100 * (errors["ins"] + errors["del"] + errors["sub"]) / errors["ref_words"], 2),
                             **errors, "tokens": sum(len(res.tokens) for res in results),
                             "bleu": round(sum(bleus) / len(bleus), 2) if bleus else None,
                             "search_s": round(min(t.decoder for _, t in runs), 2),
                             "encoder_s": round(min(t.encoder for _, t in runs), 2),
                             "audio_s": round(runs[0][1].audio, 1)})
                log(f"{Path(asr.path).name} beam {beam} {name}: WER {rows[-1]['wer']}, search {rows[-1]['search_s']} s")

    print_table([("checkpoint", "<16"), ("beam", "4d"), ("decoding", "<9"), ("WER %", "7.2f"), ("ins", "4d"),
                 ("del", "4d"), ("sub", "4d"), ("hyp words", "9d"), ("ref words", "9d"), ("tokens", "6d"),
                 ("BLEU", ">5"), ("search s", "8.2f"), ("encoder s", "9.2f")],
                [[Path(r["ckpt"]).name, r["beam"], r["decoding"], r["wer"], r["ins"], r["del"], r["sub"],
                  r["hyp_words"], r["ref_words"], r["tokens"], "-" if r["bleu"] is None else f"{r['bleu']:.2f}",
                  r["search_s"], r["encoder_s"]] for r in rows])
    print_json({"manifest": args.manifest, "device": str(device), "threads": args.threads, "load_avg": load_avg(),
                "rows": rows})


if __name__ == "__main__":
    main()
