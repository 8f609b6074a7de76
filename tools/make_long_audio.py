"""Long recordings from a manifest of utterances, with their references: what long-audio and streaming
decoding are measured on (a lecture, a meeting, an hour of captions are minutes of speech with pauses).

    # files of about 90 s, one language each, 0.3-0.9 s of silence between utterances
    python tools/make_long_audio.py --manifest data/mini/digits/train.jsonl -o runs/long/pauses --seconds 90
    # continuous speech: utterances joined with no gap (only the silence the recordings hold)
    python tools/make_long_audio.py --manifest data/mini/digits/train.jsonl -o runs/long/none --pause 0 0
    # one 10-minute file, languages mixed in it (each utterance keeps its own prompt language in `parts`)
    python tools/make_long_audio.py --manifest data/mini/digits/train.jsonl -o runs/long/ten --seconds 600 \\
        --files 1 --mix-languages
    # the same files as rooms make them: pink noise at 10-20 dB SNR, with a knock in one pause
    python tools/make_long_audio.py --manifest data/mini/digits/train.jsonl -o runs/long/pink --condition pink \\
        --transient

--condition builds the same utterances and pauses as `clean` (same --seed), then:
- pink: pink noise under the whole file, pauses included, at an SNR drawn per file from --snr
  (default 10 20): the speech's mean power over the utterance spans against the noise's over the file;
- room-tone: a room's hum (brown and pink noise in 40-500 Hz) at --floor-db dBFS RMS under
  the whole file, and the pause nearest the middle of the file widened to --gap-seconds (default 45)
  of room tone alone: what a detector hears between talks or while a meeting waits;
- talkers: every other utterance --talker-db (default 24) dB quieter, a second talker farther
  from the microphone; no noise;
- music: a music bed under the whole file at an SNR from --snr (default 12 20). It is synthesised
  (tools/make_noise.py's `music`: a band by additive synthesis or a solo of struck notes), not a
  recording: real music has voices, reverberation and mastering that it lacks.
--transient adds, under any condition, one 30 ms knock near full scale inside a pause (at least
0.1 s from the utterances around it). Each is seeded by (--seed, file number).

Writes DIR/audio/*.wav (16-bit PCM at the first utterance's rate; every utterance is resampled to it)
and DIR/manifest.jsonl: per file its path, duration, the joined reference `text`, the language
fields (those of its utterances; with --mix-languages, of its first), and `parts`: every utterance's
start and end in the file, text, languages and source line, for latency by position and for scoring
parts. Utterances are drawn without replacement in a seeded order; a pass that runs out starts a new
shuffled pass, so a file longer than the manifest repeats utterances (the log says so). The
line records the `condition` and what was drawn for it: `snr_db`; `floor_db` and the `gap` (start,
end); `talker_db`, with each part's `gain_db`; the `transient` (start, end). Only
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run from anywhere: make_noise is beside us
from make_noise import coloured, music  # noqa: E402

from aed.data_audio import AudioError, load_audio  # noqa: E402
from aed.data_manifest import iter_manifest  # noqa: E402

CONDITIONS = ("clean", "pink", "room-tone", "talkers", "music")
DEFAULT_SNR = {"pink": (10.0, 20.0), "music": (12.0, 20.0)}
ROOM_TONE_BAND = (40.0, 500.0)  # Hz: a room's hum (ventilation, traffic through walls) is mostly below 500 Hz;
# microphones and converters cut below about 40
KNOCK = 0.03  # seconds of the --transient knock
KNOCK_PEAK = 0.9  # near full scale: a door, a cup set down next to the microphone
KNOCK_CLEARANCE = 0.1  # seconds between the knock and the utterances around its pause


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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
    p.add_argument("--condition", choices=CONDITIONS, default="clean", help="the room the speech is heard in "
                   "(see the description above; default clean: the utterances as recorded)")
    p.add_argument("--snr", type=float, nargs=2, default=None, metavar=("LO", "HI"), help="pink, music: SNR (dB) "
                   "drawn per file uniformly (default 10 20 for pink, 12 20 for music)")
    p.add_argument("--floor-db", type=float, default=-50.0, help="room-tone: its RMS level in dBFS (default -50)")
    p.add_argument("--gap-seconds", type=float, default=45.0, help="room-tone: seconds of room tone without "
                   "speech in the middle of each file (default 45)")
    p.add_argument("--talker-db", type=float, default=24.0, help="talkers: how much quieter the far talker is "
                   "(dB, default 24)")
    p.add_argument("--transient", action="store_true", help="one 30 ms knock near full scale in a pause of "
                   "each file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.snr is None:
        args.snr = DEFAULT_SNR.get(args.condition)
    elif args.snr[1] < args.snr[0]:
        p.error(f"--snr {args.snr[0]} {args.snr[1]}: need LO <= HI")
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


def mean_power(audio: np.ndarray, spans: list) -> float:
    """The mean power of `audio` over the (start, end) sample spans."""
    return float(np.mean(np.concatenate([audio[a:b] for a, b in spans]).astype(np.float64) ** 2))


def under_speech(audio: np.ndarray, spans: list, bed: np.ndarray, snr_db: float) -> np.ndarray:
    """audio with `bed` (as long) mixed under it at `snr_db`: the mean power of the speech (the
    utterance spans) over the bed's mean power over the whole file."""
    gain = np.sqrt(mean_power(audio, spans) / 10 ** (snr_db / 10) / np.mean(bed.astype(np.float64) ** 2))
    return (audio + gain * bed).astype(np.float32)


def room_tone(rng: np.random.Generator, n: int, rate: int) -> np.ndarray:
    """n samples of a room's hum at unit RMS: brown noise with some pink, band-passed (second order)
    between ROOM_TONE_BAND's edges, so that it rumbles rather than hisses as white noise does; the
    high-pass is a microphone's, without which brown noise drifts by tens of dB over seconds."""
    x = coloured(rng, n, 2.0) + 0.3 * coloured(rng, n, 1.0)
    f, (low, high) = np.fft.rfftfreq(n, 1 / rate), ROOM_TONE_BAND
    spec = np.fft.rfft(x) * (f / low) ** 2 / np.sqrt(1 + (f / low) ** 4) / np.sqrt(1 + (f / high) ** 4)
    x = np.fft.irfft(spec, n)
    return (x / np.sqrt(np.mean(x**2))).astype(np.float32)


def widen_middle_pause(audio: np.ndarray, spans: list, samples: int) -> tuple[np.ndarray, list, tuple]:
    """The pause between the two utterances nearest the middle of the file made `samples` long (by
    inserting silence), so that the file's middle holds that much without speech: (audio, the
    utterance spans moved, the gap's (start, end) samples)."""
    if len(spans) < 2:
        sys.exit("room-tone: a file holds one utterance, with no pause to widen; give a larger --seconds")
    k = min(range(len(spans) - 1), key=lambda i: abs(spans[i][1] + spans[i + 1][0] - audio.size))  # 2x the middle
    start, end = spans[k][1], spans[k + 1][0]
    extra = max(0, samples - (end - start))
    audio = np.concatenate([audio[:end], np.zeros(extra, dtype=audio.dtype), audio[end:]])
    spans = spans[:k + 1] + [(a + extra, b + extra) for a, b in spans[k + 1:]]
    return audio, spans, (start, end + extra)


def knock(rng: np.random.Generator, rate: int) -> np.ndarray:
    """KNOCK seconds of a knock at peak KNOCK_PEAK: a click of noise and a low resonance, both
    dying away within a few milliseconds, as a knuckle on a table or a door sounds."""
    t = np.arange(round(KNOCK * rate)) / rate
    click = rng.standard_normal(t.size) * np.exp(-t / 0.002)
    x = click + np.sin(2 * np.pi * rng.uniform(120, 250) * t) * np.exp(-t / 0.008)
    return (KNOCK_PEAK * x / np.abs(x).max()).astype(np.float32)


def add_knock(rng: np.random.Generator, audio: np.ndarray, spans: list, rate: int) -> tuple[np.ndarray, tuple]:
    """audio with a knock in a pause drawn at random among those with room for it KNOCK_CLEARANCE
    from both utterances; (audio, the knock's (start, end) samples)."""
    sound = knock(rng, rate)
    clearance = round(KNOCK_CLEARANCE * rate)
    places = [(b + clearance, a - clearance - sound.size) for (_, b), (a, _) in zip(spans, spans[1:])]
    places = [(lo, hi) for lo, hi in places if hi >= lo]  # the first and last samples the knock may start at
    if not places:
        sys.exit(f"--transient: no pause is {2 * KNOCK_CLEARANCE + KNOCK:.2f} s long; widen --pause")
    lo, hi = places[rng.integers(len(places))]
    at = int(rng.integers(lo, hi + 1))
    audio = audio.copy()
    audio[at:at + sound.size] += sound
    return audio, (at, at + sound.size)


def in_room(audio: np.ndarray, spans: list, rate: int, args, rng: np.random.Generator) -> tuple:
    """The clean file `audio` with its utterances at `spans` (start, end samples) as --condition and
    --transient hear it: (audio, spans, the manifest fields recording what was drawn)."""
    fields = {"condition": args.condition}
    if args.condition == "talkers":  # before any noise: the far talker is quieter, the room is not
        audio = audio.copy()
        for a, b in spans[1::2]:
            audio[a:b] *= 10 ** (-args.talker_db / 20)
        fields["talker_db"] = args.talker_db
    if args.condition == "room-tone":
        audio, spans, gap = widen_middle_pause(audio, spans, round(args.gap_seconds * rate))
        fields.update(floor_db=args.floor_db, gap=[round(gap[0] / rate, 5), round(gap[1] / rate, 5)])
    if args.transient:
        audio, at = add_knock(rng, audio, spans, rate)
        fields["transient"] = [round(at[0] / rate, 5), round(at[1] / rate, 5)]
    if args.condition in ("pink", "music"):
        snr = round(float(rng.uniform(*args.snr)), 2)
        bed = coloured(rng, audio.size, 1.0) if args.condition == "pink" else music(rng, audio.size, rate)
        audio = under_speech(audio, spans, bed, snr)
        fields["snr_db"] = snr
    if args.condition == "room-tone":
        audio = (audio + 10 ** (args.floor_db / 20) * room_tone(rng, audio.size, rate)).astype(np.float32)
    return audio, spans, fields


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
    lines, repeated, unreadable, clipped = [], 0, {}, 0
    for f in range(n_files):
        pieces, parts, spans, n = [], [], [], 0  # n: samples so far; spans: each utterance's (start, end) samples
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
            parts.append({"start": None, "end": None, "text": utt.text, "source_lang": utt.source_lang,
                          "target_lang": utt.target_lang, "from": utt.where})
            spans.append((n, n + len(wav)))
            pieces.append(wav)
            n += len(wav)
        room_rng = np.random.default_rng([args.seed, f, 1])  # --noise-db's is [seed, f]
        audio, spans, drawn = in_room(np.concatenate(pieces), spans, rate, args, room_rng)
        for part, (a, b) in zip(parts, spans):
            part["start"], part["end"] = round(a / rate, 5), round(b / rate, 5)
        for part in parts[1::2] if args.condition == "talkers" else []:
            part["gain_db"] = -args.talker_db
        if args.noise_db is not None:
            audio = audio + np.random.default_rng([args.seed, f]).normal(0, 10 ** (args.noise_db / 20), len(audio))
        name = f"long_{f:03d}_{parts[0]['source_lang']}.wav"
        clipped += int(np.count_nonzero(np.abs(audio) > 1))
        sf.write(os.path.join(args.out, "audio", name), np.clip(audio, -1, 1), rate, subtype="PCM_16")
        first = parts[0]
        lines.append({"audio_filepath": f"audio/{name}", "duration": round(len(audio) / rate, 3),
                      "text": " ".join(p["text"] for p in parts), "source_lang": first["source_lang"],
                      "target_lang": first["target_lang"], "pnc": "yes", "taskname": "asr", "parts": parts, **drawn})
        shown = ", ".join(f"{k} {v}" for k, v in drawn.items())
        print(f"{name}: {len(audio) / rate:.1f} s, {len(parts)} utterances, {shown}", file=sys.stderr, flush=True)
    with open(os.path.join(args.out, "manifest.jsonl"), "w") as fh:
        for line in lines:
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")
    if unreadable:
        print(f"skipped {len(unreadable)} utterance(s) whose audio could not be read", file=sys.stderr)
    if clipped:
        print(f"{clipped} sample(s) clipped at full scale (loud speech under the noise or knock)", file=sys.stderr)
    if repeated:
        print(f"{repeated} utterance(s) repeated: the files hold more than the manifest has", file=sys.stderr)
    print(f"wrote {len(lines)} file(s) to {os.path.join(args.out, 'manifest.jsonl')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
