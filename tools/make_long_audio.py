"""Long recordings from a manifest of utterances, with their references: what long-audio and streaming
decoding are measured on (a lecture, a meeting, an hour of captions are minutes of speech with pauses).

    # files of about 90 s, one language each, 0.3-0.9 s of silence between utterances
    python tools/make_long_audio.py --manifest data/mini/digits/train.jsonl -o runs/long/pauses --seconds 90
    # continuous speech: utterances joined with no gap (only the silence the recordings hold)
    python tools/make_long_audio.py --manifest data/mini/digits/train.jsonl -o runs/long/none --pause 0 0
    # one 10-minute file, languages mixed in it (each utterance keeps its own prompt language in `parts`)
    python tools/make_long_audio.py --manifest data/mini/digits/train.jsonl -o runs/long/ten --seconds 600 \\
        --files 1 --mix-languages

Writes DIR/audio/*.wav (16-bit PCM at the first utterance's rate; every utterance is resampled to it)
and DIR/manifest.jsonl: per file its path, duration, the joined reference `text`, the language
fields (those of its utterances; with --mix-languages, of its first), and `parts`: every utterance's
start and end in the file, text, languages and source line, for latency by position and for scoring
parts. Utterances are drawn without replacement in a seeded order; a pass that runs out starts a new
shuffled pass, so a file longer than the manifest repeats utterances (the log says so). Only
transcription lines (source = target language) are used: a joined translation has no reference.
An utterance whose audio cannot be read is skipped, named and counted.
"""

import argparse
import json
import os
import random
import sys
from collections import defaultdict

import numpy as np
import soundfile as sf

from aed.data_audio import AudioError, load_audio
from aed.data_manifest import iter_manifest


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--manifest", nargs="+", required=True, help="utterance manifests (JSONL) to draw from")
    p.add_argument("-o", "--out", required=True, help="output directory (audio/ and manifest.jsonl)")
    p.add_argument("--seconds", type=float, default=90.0, help="length of each file: utterances are added "
                   "until it is reached (default 90)")
    p.add_argument("--files", type=int, default=None, help="files to write (default: one per language, or 8 with "
                   "--mix-languages)")
    p.add_argument("--pause", type=float, nargs=2, default=(0.3, 0.9), metavar=("MIN", "MAX"),
                   help="seconds of silence between utterances, drawn uniformly (default 0.3 0.9; 0 0: none)")
    p.add_argument("--noise-db", type=float, default=None, help="add white noise this many dB below full scale "
                   "(e.g. -50) under the whole file, pauses included")
    p.add_argument("--mix-languages", action="store_true", help="draw each utterance from any language, not one "
                   "language per file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.pause[0] < 0 or args.pause[1] < args.pause[0]:
        p.error(f"--pause {args.pause[0]} {args.pause[1]}: need 0 <= MIN <= MAX")
    if args.seconds <= 0 or (args.files is not None and args.files < 1):
        p.error("--seconds must be > 0 and --files >= 1")
    return args


def draw(pool: list, rng: random.Random):
    """Utterances of `pool` in shuffled passes, endlessly; yields (utterance, pass number)."""
    n = 0
    while True:
        order = list(pool)
        rng.shuffle(order)
        for utt in order:
            yield utt, n
        n += 1


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    utts = [u for path in args.manifest for u in iter_manifest(path) if u.source_lang == u.target_lang]
    if not utts:
        sys.exit(f"{', '.join(args.manifest)}: no transcription lines (source_lang == target_lang) to join")
    by_lang = defaultdict(list)
    for u in utts:
        by_lang[u.source_lang].append(u)
    groups = [utts] if args.mix_languages else [by_lang[lang] for lang in sorted(by_lang)]
    n_files = args.files or (8 if args.mix_languages else len(groups))
    rate = sf.info(utts[0].audio_filepath).samplerate
    os.makedirs(os.path.join(args.out, "audio"), exist_ok=True)
    streams = [draw(g, rng) for g in groups]
    lines, repeated, unreadable = [], 0, {}
    for f in range(n_files):
        pieces, parts, n = [], [], 0  # n: samples so far
        stream = streams[f % len(streams)]
        while n < args.seconds * rate:
            utt, n_pass = next(stream)
            if utt.where in unreadable:
                continue
            try:
                wav = load_audio(utt.audio_filepath, utt.offset, utt.duration if utt.segment else None, rate).numpy()
            except AudioError as e:
                unreadable[utt.where] = e.reason
                print(f"skipping {utt.where}: {e}", file=sys.stderr)
                if all(u.where in unreadable for u in groups[f % len(groups)]):
                    sys.exit(f"no readable audio among the utterances this file draws from ({utt.source_lang})")
                continue
            repeated += n_pass > 0
            if parts:
                pieces.append(np.zeros(round(rng.uniform(*args.pause) * rate), dtype=np.float32))
                n += len(pieces[-1])
            parts.append({"start": round(n / rate, 5), "end": round((n + len(wav)) / rate, 5), "text": utt.text,
                          "source_lang": utt.source_lang, "target_lang": utt.target_lang, "from": utt.where})
            pieces.append(wav)
            n += len(wav)
        audio = np.concatenate(pieces)
        if args.noise_db is not None:
            audio = audio + np.random.default_rng([args.seed, f]).normal(0, 10 ** (args.noise_db / 20), len(audio))
        name = f"long_{f:03d}_{parts[0]['source_lang']}.wav"
        sf.write(os.path.join(args.out, "audio", name), np.clip(audio, -1, 1), rate, subtype="PCM_16")
        first = parts[0]
        lines.append({"audio_filepath": f"audio/{name}", "duration": round(len(audio) / rate, 3),
                      "text": " ".join(p["text"] for p in parts), "source_lang": first["source_lang"],
                      "target_lang": first["target_lang"], "pnc": "yes", "taskname": "asr", "parts": parts})
        print(f"{name}: {len(audio) / rate:.1f} s, {len(parts)} utterances", file=sys.stderr, flush=True)
    with open(os.path.join(args.out, "manifest.jsonl"), "w") as fh:
        for line in lines:
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")
    if unreadable:
        print(f"skipped {len(unreadable)} utterance(s) whose audio could not be read", file=sys.stderr)
    if repeated:
        print(f"{repeated} utterance(s) repeated: the files hold more than the manifest has", file=sys.stderr)
    print(f"wrote {len(lines)} file(s) to {os.path.join(args.out, 'manifest.jsonl')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
