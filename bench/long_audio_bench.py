"""Word timestamps against known boundaries, and long-audio transcripts with and without chunk
overlaps, on generated word audio with the word model (tests/fixtures/make_word_model.py).

    python bench/long_audio_bench.py                                   # the committed model
    python bench/long_audio_bench.py --ckpt /tmp/word_model.pt --files 100

1. Timestamps: `--files` random sequences of the eight clips (1-4 words, 0-1 s of leading silence,
   0.1-0.6 s pauses, a noise floor), seeds the model was not trained on, through
   `transcribe(timestamps=True)`. On files whose transcript is right, each word's start and end
   against the true boundary of its clip: median, 90th percentile, largest; for the CTC spans alone
   and narrowed to the speech inside them (the default).
2. Long audio: `--long-files` files of `--long-words` random words with 0-`--long-gap` s between them over a
   3e-3 noise floor (no pause a cut could use), transcribed in chunks of the model's training maximum
   with `--overlap` and with none (the default): chunks, seconds decoded, WER and its deletions and
   insertions (dropped and repeated words), over all files.
"""

import argparse
import os
import random
import sys
import tempfile

import jiwer
import soundfile as sf
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # the fixtures

import aed.decode_transcribe  # noqa: E402
from aed.decode_transcribe import Request, plan_chunks, transcribe  # noqa: E402
from aed.model_checkpoint import load_model  # noqa: E402
from aed.decode_timestamps import snap_to_speech  # noqa: E402
from common import ROOT, log, print_json, print_table  # noqa: E402
from fixtures.make_word_model import SAMPLE_RATE, load_clips, word_sequence  # noqa: E402

DEFAULT_CKPT = ROOT / "tests" / "fixtures" / "word_model.pt"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=str(DEFAULT_CKPT))
    p.add_argument("--files", type=int, default=60, help="timestamp test files")
    p.add_argument("--long-files", type=int, default=5, help="long files")
    p.add_argument("--long-words", type=int, default=80, help="words in each long file")
    p.add_argument("--long-gap", type=float, default=0.15, help="longest pause between their words (s)")
    p.add_argument("--overlap", type=float, help="chunk overlap (s) compared with none; default: a quarter chunk")
    p.add_argument("--seed", type=int, default=1000, help="test data seed (training uses 0)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    asr, clips = load_model(args.ckpt), load_clips()
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    tmp = tempfile.mkdtemp()

    # --- 1. timestamps against known boundaries
    paths, truths = [], []
    for i in range(args.files):
        words = [rng.choice(sorted(clips)) for _ in range(rng.randint(1, 4))]
        wav, truth = word_sequence(clips, words, [rng.uniform(0.1, 0.6) for _ in words], rng.uniform(0.0, 1.0),
                                   10 ** rng.uniform(-4, -2.5), gen)
        paths.append(os.path.join(tmp, f"t{i}.wav"))
        sf.write(paths[-1], wav.numpy(), SAMPLE_RATE, subtype="FLOAT")
        truths.append(truth)
    stats, rows = {}, []
    for name, snap in (("CTC spans", False), ("snapped to speech", True)):
        log(f"timestamps: {args.files} files, {name}")
        # The CTC spans alone: aed.decode_transcribe's narrowing to the speech in each span, switched off.
        aed.decode_timestamps.snap_to_speech = snap_to_speech if snap else (lambda words, speech, offset: words)
        results, _ = transcribe(asr, paths, pnc=False, timestamps=True)
        starts, ends, right = [], [], 0
        for res, truth in zip(results, truths):
            if [w.text for w in res.words] != [w for w, _, _ in truth]:
                continue
            right += 1
            starts += [abs(w.start - a) for w, (_, a, _) in zip(res.words, truth)]
            ends += [abs(w.end - b) for w, (_, _, b) in zip(res.words, truth)]
            assert all(0 <= w.start < w.end <= res.duration + 1e-6 for w in res.words)
            assert all(x.end <= y.start + 1e-6 for x, y in zip(res.words, res.words[1:]))
        for edge, errors in (("start", torch.tensor(starts)), ("end", torch.tensor(ends))):
            stats[f"{name} {edge}"] = {k: round(float(v), 3) for k, v in (
                ("median", errors.median()), ("p90", errors.quantile(0.9)), ("max", errors.max()))}
            rows.append([f"{name} {edge}", *stats[f"{name} {edge}"].values()])
    aed.decode_timestamps.snap_to_speech = snap_to_speech
    print_table([("word boundary", "<24"), ("median s", ">9.3f"), ("p90 s", ">7.3f"), ("max s", ">7.3f")], rows)
    print(f"{right}/{args.files} files transcribed right; {len(starts)} words timed")

    # --- 2. long files without pauses, chunked with and without overlaps
    files = []
    for i in range(args.long_files):
        words = [rng.choice(sorted(clips)) for _ in range(args.long_words)]
        wav, _ = word_sequence(clips, words, [rng.uniform(0.0, args.long_gap) for _ in words], 0.3, 3e-3, gen)
        files.append((os.path.join(tmp, f"long{i}.wav"), " ".join(words), wav.numel() / SAMPLE_RATE))
        sf.write(files[-1][0], wav.numpy(), SAMPLE_RATE, subtype="FLOAT")
    rows, long = [], {}
    chunk = asr.max_train_duration
    overlap = args.overlap if args.overlap is not None else chunk / 4
    for name, overlap in ((f"overlap {overlap:.2f} s", overlap), ("no overlap", 0.0)):
        log(f"{len(files)} long files ({sum(f[2] for f in files):.0f} s): {name}")
        planned = [plan_chunks(Request(path, "en", "en", False, "asr"), chunk, SAMPLE_RATE, overlap)[1]
                   for path, _, _ in files]
        results, _ = transcribe(asr, [path for path, _, _ in files], pnc=False, chunk_overlap=overlap)
        out = jiwer.process_words([ref for _, ref, _ in files], [res.pred_text.lower() for res in results])
        long[name] = {"overlap_s": round(overlap, 2), "chunks": sum(map(len, planned)),
                      "decoded_s": round(sum(c[2] for cs in planned for c in cs), 1), "wer": round(100 * out.wer, 2),
                      "deletions": out.deletions, "insertions": out.insertions, "substitutions": out.substitutions}
        rows.append([name, overlap, *list(long[name].values())[1:]])
    print_table([("long file", "<16"), ("overlap s", ">10.2f"), ("chunks", ">7d"), ("decoded s", ">10.1f"),
                 ("WER %", ">6.1f"), ("deleted", ">8d"), ("inserted", ">9d"), ("substituted", ">12d")], rows)
    print_json({"ckpt": args.ckpt, "files": args.files, "right": right, "timestamps": stats,
                "long_seconds": round(sum(f[2] for f in files), 1), "long_words": args.long_files * args.long_words,
                "chunk_seconds": chunk, "long": long})


if __name__ == "__main__":
    main()
