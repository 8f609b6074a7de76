"""What the data levers buy on sounds a model never heard: clean WER, WER under held-out music, and
how often non-speech clips come out with text, per model, with and without the no-speech check.

    python tools/make_noise.py generate -o runs/lev/heldout --split heldout --types pluck rain siren blue violet \
        --noise-count 12 --seconds 2 --rir-count 0
    python tools/make_noise.py generate -o runs/lev/heldout_music --split heldout --types pluck --seed 1 \
        --noise-count 20 --seconds 8 --rir-count 0
    python bench/nonspeech_bench.py --ckpt demo=runs/demo ft=runs/ft --clips runs/lev/heldout/noise.jsonl \
        --music runs/lev/heldout_music/noise.jsonl --manifest data/mini/digits/dev.jsonl

For each model (NAME=CKPT; `NAME:ema` decodes a run's EMA weights) and each --ctc-weights (joint
CTC/attention at infer.py's default weight, and the attention decoder alone), greedy decoding
(infer.py's defaults otherwise):
    clean WER          the manifest as it is
    music WER          the manifest with --music mixed under every utterance at 0-20 dB SNR (seeded)
    clips with text    of the --clips (none holds speech), each decoded with the prompt language of
                       its position (round robin over the manifest's languages), per kind and in all
    words per minute   the words written on the clips, per minute of clip audio
with the no-speech check off and at each of --thresholds, each with each of --logprob-thresholds (Whisper's
second condition; 0: the no-speech probability alone). A table, then the JSON line.
"""

import argparse
import dataclasses
import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import log, manifest_rows, print_json, print_table  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", nargs="+", required=True, metavar="NAME=CKPT", help="models to compare")
    p.add_argument("--clips", required=True, help="manifest of non-speech clips (make_noise.py generate's)")
    p.add_argument("--music", required=True, help="manifest of music to mix under the speech (held out)")
    p.add_argument("--manifest", required=True, help="speech with references")
    p.add_argument("--thresholds", type=float, nargs="*", default=[0.1, 0.2, 0.4], help="no-speech thresholds to try")
    p.add_argument("--logprob-thresholds", type=float, nargs="+", default=[-1.0, 0.0],
                   help="the check's mean log-probability thresholds to try with each (0: the probability alone)")
    p.add_argument("--ctc-weights", type=float, nargs="+", default=[0.3, 0.0],
                   help="joint CTC/attention weights to decode with (0: the attention decoder alone)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import soundfile as sf

    from aed.data_audio import load_audio
    from aed.data_augment import add_noise
    from aed.decode_metrics import wer
    from aed.decode_search import DecodingOptions
    from aed.decode_transcribe import Request, read_requests, transcribe
    from aed.model_checkpoint import load_model

    speech, clips = read_requests(args.manifest), manifest_rows(args.clips)
    music = [load_audio(r["audio_filepath"]) for r in manifest_rows(args.music)]
    languages = sorted({r.source_lang for r in speech})
    rng = random.Random(args.seed)
    noisy_dir = Path(args.clips).parent / "speech_under_music"
    noisy_dir.mkdir(exist_ok=True)
    noisy = []
    for i, r in enumerate(speech):  # the same mixtures for every model
        mixed = add_noise(load_audio(r.audio_filepath), music[rng.randrange(len(music))], rng.uniform(0, 20),
                          rng.randrange(10**6))
        path = noisy_dir / f"{i:04d}.wav"
        sf.write(path, mixed.numpy(), 16000, subtype="FLOAT")
        noisy.append(dataclasses.replace(r, audio_filepath=str(path)))
    # each clip with a prompt language, round robin over the speech's languages
    clip_requests = [Request(c["audio_filepath"], languages[i % len(languages)], languages[i % len(languages)],
                             True, "asr") for i, c in enumerate(clips)]

    table, result = [], {}
    for spec in args.ckpt:
        name, ckpt = spec.split("=", 1)
        loaded = load_model(ckpt, ema=name.endswith(":ema"))
        checks = [(None, None)] + list(itertools.product(args.thresholds, args.logprob_thresholds))
        for ctc_weight, (threshold, logprob) in itertools.product(args.ctc_weights, checks):
            options = DecodingOptions(ctc_weight=ctc_weight, no_speech_threshold=threshold, logprob_threshold=logprob)
            scores = {}
            for label, requests in (("clean", speech), ("music", noisy)):
                results, _ = transcribe(loaded, requests, options)
                scores[label] = wer([r.text for r in requests], [res.pred_text for res in results])
            results, _ = transcribe(loaded, clip_requests, options)
            texts = [res.pred_text.split() for res in results]
            minutes = sum(c["duration"] for c in clips) / 60
            kinds = sorted({c["type"] for c in clips})
            by_kind = {k: sum(bool(t) for t, c in zip(texts, clips) if c["type"] == k) for k in kinds}
            row = {"clean_wer": round(scores["clean"], 2), "music_wer": round(scores["music"], 2),
                   "clips_with_text": sum(bool(t) for t in texts), "clips": len(clips),
                   "by_kind": by_kind, "words_per_minute": round(sum(len(t) for t in texts) / minutes, 1)}
            key = f"{name} ctc {ctc_weight:g}" + (" no check" if threshold is None else f" P>{threshold:g} lp<={logprob:g}")
            result[key] = row
            table.append([key, row["clean_wer"], row["music_wer"], f"{row['clips_with_text']}/{len(clips)}",
                          " ".join(f"{k} {n}" for k, n in by_kind.items()), row["words_per_minute"]])
            log(f"{key}: {row}")
    print_table([("model", "<32"), ("clean WER", ">9.1f"), ("music WER", ">9.1f"), ("with text", ">9"),
                 ("by kind", "<40"), ("words/min", ">9.1f")], table)
    print_json({"manifest": args.manifest, "clips": args.clips, "music": args.music, "models": result})


if __name__ == "__main__":
    main()
