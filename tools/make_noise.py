"""Noise and room impulse responses for `augment:` when MUSAN and real RIRs are not at hand, and
degraded copies of test manifests.

    # a training set: coloured noise, babble from the training speech, simulated rooms
    python tools/make_noise.py generate -o data/noise/train --speech data/mini/train.jsonl --seed 0
    # a held-out set for a degraded test set: other noise colours, other rooms, other talkers
    python tools/make_noise.py generate -o data/noise/heldout --split heldout --speech data/mini/dev.jsonl
    # a degraded copy of a test manifest (wavs + manifest), noise at 0-20 dB SNR in a room
    python tools/make_noise.py degrade --manifest data/mini/dev.jsonl --noise data/noise/heldout/noise.jsonl \\
        --rir data/noise/heldout/rir.jsonl --snr 0 20 -o data/mini_dev_noisy
    # a harder copy of a whole corpus (each split alike): talkers 0-20 dB down, a coloured noise floor
    # under a third of the files, up to 0.6 s more silence at each edge, French at half the others' share
    python tools/make_noise.py generate -o data/noise/floors --types white pink brown --rir-count 0
    python tools/make_noise.py degrade --manifest data/long/train.jsonl --gain -20 0 --edges 0 0.6 \
        --noise data/noise/floors/noise.jsonl --noise-prob 0.33 --snr 10 30 --keep fr=0.5 -o data/long_hard/train

`generate` writes DIR/noise/*.wav with DIR/noise.jsonl and DIR/rir/*.wav with DIR/rir.jsonl (the
manifest format of augment.noise_manifests / augment.rir_manifests: audio_filepath, duration, plus
what made each file):
- coloured noise: Gaussian noise shaped to a power spectrum 1/f^beta: white (0), pink (1), brown (2),
  blue (-1), violet (-2);
- babble: the sum of several utterances (equal loudness, each looped from a random point) of
  `--speech`, a speech manifest; give the held-out split other speakers than the training set's;
- sounds that are not noise, synthesised here with numpy: `music` (a band by additive synthesis: a
  melody over chords, sometimes drums; or a solo of struck and plucked notes by modal synthesis), `hum` (50/60 Hz mains and harmonics), `engine`
  (a machine's harmonic series drifting in speed); and for the held-out split other sources and
  kinds: `pluck` (sox's plucked strings playing a melody; needs sox), `rain` (droplets over a pink
  bed), `siren` (swept or two-tone alarms). They serve as noise to mix under speech and, as a
  `nonspeech: true` entry of train.manifests, as audio that must give no text;
- rooms: pyroomacoustics' image-source model of a shoebox room (RT60, size, source and microphone
  drawn at random) where it is installed (pip install -r tests/requirements-augment.txt), else a
  direct path plus exponentially decaying Gaussian noise with the drawn RT60 and direct-to-reverberant
  ratio; `--simulator` picks, and every rir.jsonl line names the one that ran.

`--split heldout` draws from another random stream than `train` for the same --seed (other rooms,
other noise) and defaults to kinds the training split lacks (blue, violet, babble of other
talkers, pluck, rain, siren): train on one, test on the other.

`degrade` runs aed.data_augment.Augment (the training chain) once per utterance, seeded by (--seed,
line number), and writes DIR/audio/*.wav (float WAV, the degradation exactly) and DIR/manifest.jsonl:
each line as it was, with the degraded audio's path and duration (a segment's offset is dropped).
`--keep LANG=SHARE` leaves out lines of a source language by a seeded draw, counted in the last line.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import soundfile as sf
import torch

from aed.config import ConfigError
from aed.data_audio import AudioError, load_audio
from aed.data_augment import Augment, looped, read_recordings
from aed.data_manifest import ManifestError, audio_path, json_object, manifest_lines, seconds
from aed.train_config import AugmentConfig

COLOURS = {"white": 0.0, "pink": 1.0, "brown": 2.0, "blue": -1.0, "violet": -2.0}  # power spectrum ~ 1/f^beta
SOUNDS = ("music", "hum", "engine", "pluck", "rain", "siren")  # synthesised non-speech (`sound`)
# Each split's default kinds: the held-out one shares none with training but babble (of other talkers).
SPLIT_TYPES = {"train": ["white", "pink", "brown", "babble", "music", "hum", "engine"],
               "heldout": ["blue", "violet", "babble", "pluck", "rain", "siren"]}
SPLIT_STREAM = {"train": 0, "heldout": 1}  # the second word of every generator's seed
KEEP_STREAM = 7  # the third word of --keep's draws
LN_1000 = 6.907755  # ln(1000): an amplitude decaying as exp(-LN_1000 t / rt60) is 60 dB down at rt60
PEAK = 0.5  # generated noise is written at this peak: 16-bit PCM without clipping; its level is set by the SNR


def progress(label: str, done: int, total: int, t0: float) -> None:
    """A progress line at every tenth of the work, and at the end."""
    if done == total or done % max(1, total // 10) == 0:
        print(f"{label}: {done}/{total} ({time.time() - t0:.1f} s)", file=sys.stderr, flush=True)


def coloured(rng: np.random.Generator, n: int, beta: float) -> np.ndarray:
    """n samples of Gaussian noise with power spectrum ~ 1/f^beta (no DC), peak PEAK."""
    spec = np.fft.rfft(rng.standard_normal(n))
    f = np.arange(spec.size, dtype=np.float64)
    spec[1:] *= f[1:] ** (-beta / 2)  # amplitude ~ f^(-beta/2): power ~ f^(-beta)
    spec[0] = 0
    x = np.fft.irfft(spec, n)
    return (PEAK * x / np.abs(x).max()).astype(np.float32)


def peak(x: np.ndarray) -> np.ndarray:
    return (PEAK * x / max(np.abs(x).max(), 1e-12)).astype(np.float32)


def note(rng: np.random.Generator, hz: float, n: int, rate: int, harmonics: np.ndarray) -> np.ndarray:
    """One instrument note: the given harmonic amplitudes with a little inharmonicity and vibrato, an
    attack of 5-40 ms and an exponential decay."""
    t = np.arange(n) / rate
    vibrato = 1 + 0.004 * np.sin(2 * np.pi * rng.uniform(4, 7) * t)
    stretch = rng.uniform(0, 0.0008)  # partial k at k * (1 + stretch * k^2) x the fundamental, as in a string
    x = sum(a * np.sin(2 * np.pi * hz * k * (1 + stretch * k * k) * np.cumsum(vibrato) / rate)
            for k, a in enumerate(harmonics, 1) if hz * k < rate / 2)
    attack = np.minimum(1.0, t / rng.uniform(0.005, 0.04))
    return x * attack * np.exp(-t * rng.uniform(0.5, 4.0))


def struck(rng: np.random.Generator, hz: float, n: int, rate: int, brightness: float) -> np.ndarray:
    """One struck or plucked note by modal synthesis (a piano, guitar or marimba rather than a bowed or
    blown one): a click of noise, then partials that start together and die away, the higher ones
    faster, and slightly sharp as a stiff string's or a bar's."""
    t = np.arange(n) / rate
    decay = rng.uniform(1.5, 8.0)  # 1/s, of the fundamental
    x = sum(brightness ** (k - 1) * np.sin(2 * np.pi * hz * k * (1 + 0.0005 * k * k) * t + rng.uniform(0, 6.3))
            * np.exp(-t * decay * (1 + 0.6 * (k - 1))) for k in range(1, 16) if hz * k < rate / 2)
    click = int(0.003 * rate)
    x[:click] += 0.5 * rng.standard_normal(min(click, n)) * np.linspace(1, 0, min(click, n))
    return x


def music(rng: np.random.Generator, n: int, rate: int) -> np.ndarray:
    """Instrumental music in a random major or minor scale at a random tempo, half the time as a band
    (additive synthesis: a melody over held chords, two random timbres, sometimes a kick and hi-hat
    pattern), half the time as a solo of struck or plucked notes of random lengths (`struck`)."""
    scale = np.array([0, 2, 4, 5, 7, 9, 11] if rng.random() < 0.5 else [0, 2, 3, 5, 7, 8, 10])
    root = 110 * 2 ** (rng.integers(0, 12) / 12)
    beat = int(rate * 60 / rng.uniform(70, 160))
    if rng.random() < 0.5:  # a solo: notes of one to four half beats, each ringing into the next
        x, start, step, brightness = np.zeros(n + 4 * beat), 0, 0, rng.uniform(0.3, 0.8)
        while start < n:
            step = int(np.clip(step + rng.integers(-3, 4), 0, 20))
            semis = scale[step % 7] + 12 * (step // 7)
            x[start:start + 4 * beat] += struck(rng, root * 2 ** (semis / 12), 4 * beat, rate, brightness)
            start += int(rng.integers(1, 5)) * beat // 2
        return peak(x[:n])
    lead, pad = (rng.uniform(0, 1, 8) ** 2 / np.arange(1, 9) for _ in range(2))
    x = np.zeros(n + 4 * beat)
    for start in range(0, n, 4 * beat):  # a chord per bar
        degree = int(rng.integers(0, 7))
        for third in (0, 2, 4):
            semis = scale[(degree + third) % 7] + 12 * ((degree + third) // 7)
            x[start:start + 4 * beat] += 0.3 * note(rng, root * 2 ** (semis / 12), 4 * beat, rate, pad)
    step = 0
    for start in range(0, n, beat // 2):  # the melody in eighth notes, a random walk on the scale
        step = int(np.clip(step + rng.integers(-2, 3), 0, 13))
        if rng.random() < 0.8:
            semis = 12 + scale[step % 7] + 12 * (step // 7)
            x[start:start + beat] += note(rng, root * 2 ** (semis / 12), beat, rate, lead)
    if rng.random() < 0.5:  # drums: a kick on each beat, a hi-hat between
        t = np.arange(beat // 2) / rate
        kick = np.sin(2 * np.pi * 60 * t * np.exp(-t * 8)) * np.exp(-t * 20)
        hat = rng.standard_normal(beat // 4) * np.exp(-np.arange(beat // 4) / rate * 80)
        for start in range(0, n, beat):
            x[start:start + kick.size] += 0.8 * kick
            x[start + beat // 2:start + beat // 2 + hat.size] += 0.15 * np.diff(hat, prepend=0)
    return peak(x[:n])


def hum(rng: np.random.Generator, n: int, rate: int) -> np.ndarray:
    """Mains hum: 50 or 60 Hz and its harmonics (odd ones stronger, as a transformer's), slowly
    wavering, over a faint noise floor."""
    t = np.arange(n) / rate
    f0 = 50.0 if rng.random() < 0.5 else 60.0
    x = sum((1.0 if k % 2 else 0.3) * rng.uniform(0.2, 1) / k * np.sin(2 * np.pi * f0 * k * t + rng.uniform(0, 6.3))
            for k in range(1, 12))
    return peak(x * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.1, 1) * t)) + 0.02 * rng.standard_normal(n))


def engine(rng: np.random.Generator, n: int, rate: int) -> np.ndarray:
    """A running engine or machine: a harmonic series whose speed drifts (firing 20-120 Hz), with
    amplitude modulation and brown noise."""
    t = np.arange(n) / rate
    f = rng.uniform(20, 120) * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(0.05, 0.5) * t + rng.uniform(0, 6.3)))
    phase = 2 * np.pi * np.cumsum(f) / rate
    x = sum(rng.uniform(0.1, 1) / k ** 0.7 * np.sin(k * phase) for k in range(1, 25))
    x = x * (1 + 0.3 * np.sin(phase / 2)) + 0.5 * coloured(rng, n, 2.0) / PEAK
    return peak(x)


def pluck(rng: np.random.Generator, n: int, rate: int) -> np.ndarray:
    """Music of another source and timbre: sox's plucked strings (Karplus-Strong) playing a random
    melody. Needs sox on PATH."""
    import shutil
    import subprocess
    import tempfile

    if shutil.which("sox") is None:
        raise SystemExit("--types pluck needs sox (apt-get install sox)")
    notes, total = [], 0.0
    while total < n / rate:
        d = float(rng.choice([0.15, 0.3, 0.45, 0.6]))
        notes += ["synth", f"{d}", "pluck", f"{110 * 2 ** (int(rng.integers(0, 30)) / 12):.2f}", ":"]
        total += d
    with tempfile.NamedTemporaryFile(suffix=".wav") as tmp:
        subprocess.run(["sox", "-q", "-n", "-r", str(rate), "-b", "16", tmp.name, *notes[:-1]], check=True)
        x = sf.read(tmp.name, dtype="float64")[0]
    return peak(np.pad(x, (0, max(0, n - x.size)))[:n])


def rain(rng: np.random.Generator, n: int, rate: int) -> np.ndarray:
    """Rain on a surface: a Poisson stream of droplets (short decaying bursts, each through a random
    resonance) over a pink-noise bed."""
    x = 0.3 * coloured(rng, n, 1.0) / PEAK
    drop = int(0.01 * rate)
    for at in np.flatnonzero(rng.random(n) < rng.uniform(100, 600) / rate):
        hz = rng.uniform(1000, 6000)
        k = np.arange(min(drop, n - at))
        x[at:at + k.size] += rng.uniform(0.2, 1) * np.sin(2 * np.pi * hz * k / rate) * np.exp(-k / (0.002 * rate))
    return peak(x)


def siren(rng: np.random.Generator, n: int, rate: int) -> np.ndarray:
    """An alarm or siren: a tone with a few harmonics swept up and down (wail) or switched between
    two pitches (hi-lo), with a little noise."""
    t = np.arange(n) / rate
    low, high = sorted(rng.uniform(400, 1600, 2))
    period = rng.uniform(0.4, 3.0)
    if rng.random() < 0.5:
        f = low + (high - low) * (0.5 - 0.5 * np.cos(2 * np.pi * t / period))
    else:
        f = np.where((t // (period / 2)) % 2 == 0, low, high)
    phase = 2 * np.pi * np.cumsum(f) / rate
    return peak(sum(np.sin(k * phase) / k for k in (1, 2, 3)) + 0.05 * rng.standard_normal(n))


SYNTHESISERS = {"music": music, "hum": hum, "engine": engine, "pluck": pluck, "rain": rain, "siren": siren}


def babble(rng: np.random.Generator, speech: list, n: int, talkers: int, rate: int, bad: dict) -> np.ndarray:
    """n samples: `talkers` readable utterances of `speech` at equal power, each looped from a random
    point, summed, peak PEAK. Unreadable ones are recorded in `bad` (where -> why) and skipped."""
    mix = torch.zeros(n, dtype=torch.float64)
    voices, order = 0, rng.permutation(len(speech))
    for i in order:
        r = speech[i]
        if r.where in bad:
            continue
        try:
            wav = load_audio(r.path, r.offset, r.duration, rate).double()
        except AudioError as e:
            bad[r.where] = str(e)
            print(f"skipping {r.where}: {e}", file=sys.stderr)
            continue
        if not wav.abs().max() > 0:
            continue
        mix += looped(wav / wav.pow(2).mean().sqrt(), n, int(rng.integers(wav.numel())))
        voices += 1
        if voices == talkers:
            return (PEAK * mix / mix.abs().max()).float().numpy()
    raise SystemExit(f"babble needs {talkers} readable utterances in --speech; found {voices}")


def decay_rir(rng: np.random.Generator, rate: int, rt60: float, drr_db: float, delay: float) -> np.ndarray:
    """A direct path of amplitude 1 after `delay` s, then Gaussian noise decaying 60 dB in `rt60` s
    whose energy is `drr_db` below the direct path's: late reverberation's statistics (Polack's model)
    without a room's early reflections."""
    d, n = round(delay * rate), round(rt60 * rate)
    t = np.arange(1, n + 1) / rate
    tail = rng.standard_normal(n) * np.exp(-LN_1000 * t / rt60)
    tail *= np.sqrt(10 ** (-drr_db / 10) / np.sum(tail**2))
    h = np.zeros(d + 1 + n)
    h[d] = 1.0
    h[d + 1:] = np.clip(tail, -0.9, 0.9)  # the direct path stays the peak: augment aligns on it
    return h.astype(np.float32)


def room_rir(rng: np.random.Generator, rate: int, rt60: float, size: tuple, height: tuple) -> tuple[np.ndarray, dict]:
    """pyroomacoustics' image-source RIR of a random shoebox room with reverberation time `rt60`, and
    what was drawn. Rooms too large for that RT60 (wall absorption above 1) are drawn again."""
    import pyroomacoustics as pra

    for _ in range(100):
        dims = [rng.uniform(*size), rng.uniform(*size), rng.uniform(*height)]
        try:
            absorption, max_order = pra.inverse_sabine(rt60, dims)  # Sabine's formula -> wall absorption
        except ValueError:
            continue
        room = pra.ShoeBox(dims, fs=rate, materials=pra.Material(absorption), max_order=max_order)
        source, mic = ([rng.uniform(0.5, x - 0.5) for x in dims] for _ in range(2))  # 0.5 m from the walls
        room.add_source(source)
        room.add_microphone(mic)
        room.compute_rir()
        h = np.asarray(room.rir[0][0], dtype=np.float32)
        distance = float(np.linalg.norm(np.subtract(source, mic)))
        info = {"room": [round(x, 2) for x in dims], "distance": round(distance, 2)}
        return h / np.abs(h).max(), info
    raise SystemExit(f"no room of sides {size} m and height {height} m has RT60 {rt60:.2f} s; widen --room")


def write_set(out_dir: str, name: str, items, total: int, rate: int, subtype: str) -> None:
    """Writes each (stem, samples, fields) of `items` to out_dir/name/stem.wav, and their manifest
    out_dir/name.jsonl (paths relative to it) to a temporary name renamed when complete."""
    os.makedirs(os.path.join(out_dir, name), exist_ok=True)
    manifest = os.path.join(out_dir, f"{name}.jsonl")
    t0 = time.time()
    with open(manifest + ".tmp", "w") as f:
        for done, (stem, x, fields) in enumerate(items, 1):
            rel = f"{name}/{stem}.wav"
            sf.write(os.path.join(out_dir, rel), x, rate, subtype=subtype)
            f.write(json.dumps({"audio_filepath": rel, "duration": round(len(x) / rate, 4), **fields}) + "\n")
            progress(name, done, total, t0)
    os.replace(manifest + ".tmp", manifest)
    print(f"wrote {manifest}", file=sys.stderr)


def generate(args) -> None:
    types = (args.types or SPLIT_TYPES[args.split]) if args.noise_count else []
    if unknown := sorted(set(types) - set(COLOURS) - set(SYNTHESISERS) - {"babble"}):
        raise SystemExit(f"--types: unknown {unknown}; expected some of "
                         f"{', '.join([*COLOURS, 'babble', *SYNTHESISERS])}")
    if "babble" in types and not args.speech:
        raise SystemExit("babble needs --speech MANIFEST (speech to mix; for --split heldout, other speakers than "
                         "the training set's); or leave babble out of --types")
    simulator = args.simulator
    if simulator == "auto":
        try:
            import pyroomacoustics  # noqa: F401 - only whether it is installed
            simulator = "pyroomacoustics"
        except ImportError:
            simulator = "decay"
    print(f"split {args.split}: noise {types}, rooms by {simulator}", file=sys.stderr)
    stream = SPLIT_STREAM[args.split]
    speech = read_recordings([args.speech], "speech") if "babble" in types else []
    n, bad = round(args.seconds * args.rate), {}

    def noises():
        for k, kind in enumerate(types):
            for i in range(args.noise_count):
                rng = np.random.default_rng([args.seed, stream, 1, k, i])
                if kind == "babble":
                    talkers = int(rng.integers(args.talkers[0], args.talkers[1] + 1))
                    yield f"babble_{i:04d}", babble(rng, speech, n, talkers, args.rate, bad), {"type": kind,
                                                                                              "talkers": talkers}
                elif kind in SYNTHESISERS:
                    yield f"{kind}_{i:04d}", SYNTHESISERS[kind](rng, n, args.rate), {"type": kind}
                else:
                    yield f"{kind}_{i:04d}", coloured(rng, n, COLOURS[kind]), {"type": kind}

    def rirs():
        for i in range(args.rir_count):
            rng = np.random.default_rng([args.seed, stream, 2, i])
            rt60 = float(rng.uniform(*args.rt60))
            if simulator == "pyroomacoustics":
                h, info = room_rir(rng, args.rate, rt60, tuple(args.room), tuple(args.height))
            else:
                drr = float(rng.uniform(*args.drr))
                h = decay_rir(rng, args.rate, rt60, drr, delay=float(rng.uniform(0.001, 0.02)))
                info = {"drr_db": round(drr, 2)}
            yield f"rir_{i:04d}", h, {"simulator": simulator, "rt60": round(rt60, 3), **info}

    if args.noise_count:
        write_set(args.out, "noise", noises(), len(types) * args.noise_count, args.rate, "PCM_16")
    if args.rir_count:
        write_set(args.out, "rir", rirs(), args.rir_count, args.rate, "FLOAT")  # RIR taps need more than 16 bits
    if bad:
        print(f"skipped {len(bad)} unreadable utterance(s) of {args.speech}", file=sys.stderr)


def degrade(args) -> None:
    cfg = AugmentConfig(noise_prob=args.noise_prob if args.noise else 0.0, noise_manifests=args.noise,
                        snr_db=tuple(args.snr), reverb_prob=args.reverb_prob if args.rir else 0.0,
                        rir_manifests=args.rir, codec_prob=args.codec_prob if args.codecs else 0.0,
                        codecs=args.codecs, lowpass_prob=args.lowpass_prob,
                        gain_prob=args.gain_prob if args.gain else 0.0, gain_db=tuple(args.gain or (0.0, 0.0)),
                        edge_prob=args.edge_prob if args.edges else 0.0,
                        edge_seconds=tuple(args.edges or (0.0, 0.0)))
    keep = language_shares(args.keep)
    if not cfg.enabled and not keep:
        raise SystemExit("nothing to do: give --noise, --rir, --codecs, --lowpass-prob, --gain, --edges or --keep")
    augment = Augment(cfg, args.rate)
    lines = list(manifest_lines(args.manifest))
    base_dir = os.path.dirname(os.path.abspath(args.manifest))
    os.makedirs(os.path.join(args.out, "audio"), exist_ok=True)
    manifest, skipped, left_out, t0 = os.path.join(args.out, "manifest.jsonl"), 0, 0, time.time()
    with open(manifest + ".tmp", "w") as f:
        for i, (where, line) in enumerate(lines):
            try:
                d = json_object(line, where)
                offset = seconds(d, "offset", where, positive=False)
                duration = seconds(d, "duration", where, positive=True) if offset is not None else None
                if kept(d, keep, args.seed, i):
                    wav = load_audio(audio_path(d, where, base_dir), offset or 0.0, duration, args.rate)
                else:
                    left_out += 1
                    continue
            except (ManifestError, AudioError) as e:
                print(f"skipping {where}: {e}", file=sys.stderr)
                skipped += 1
                continue
            x = augment(wav, args.seed, i)
            rel = f"audio/{i:06d}.wav"
            sf.write(os.path.join(args.out, rel), x.numpy(), args.rate, subtype="FLOAT")
            d.pop("offset", None)
            f.write(json.dumps({**d, "audio_filepath": rel, "duration": round(x.numel() / args.rate, 4)},
                               ensure_ascii=False) + "\n")
            progress("degrade", i + 1, len(lines), t0)
    os.replace(manifest + ".tmp", manifest)
    print(f"wrote {manifest}: {len(lines) - skipped - left_out} utterance(s), {skipped} skipped (unreadable), "
          f"{left_out} left out by --keep", file=sys.stderr)


def language_shares(pairs: list) -> dict:
    """["fr=0.5", "en=0.7"] -> {"fr": 0.5, "en": 0.7}: the share of each source language's lines kept."""
    shares = {}
    for pair in pairs:
        lang, _, share = pair.partition("=")
        try:
            shares[lang] = float(share)
        except ValueError:
            raise SystemExit(f"error: --keep {pair!r}: expected LANG=SHARE, e.g. fr=0.5") from None
        if not (lang and 0.0 <= shares[lang] <= 1.0):
            raise SystemExit(f"error: --keep {pair!r}: a language and a share in [0, 1]")
    return shares


def kept(line: dict, shares: dict, seed: int, index: int) -> bool:
    """Whether line `index` stays under --keep: its source language's share, by a draw seeded by
    (seed, index, KEEP_STREAM) that the degradation's own draws do not see."""
    share = shares.get(line.get("source_lang"), 1.0)
    return share >= 1.0 or np.random.default_rng([seed, index, KEEP_STREAM]).random() < share


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="write a noise set and a RIR set with their manifests")
    g.add_argument("-o", "--out", required=True, help="output directory (noise.jsonl, rir.jsonl, noise/, rir/)")
    g.add_argument("--split", choices=list(SPLIT_STREAM), default="train",
                   help="train, or heldout: another random stream and other default noise types")
    g.add_argument("--types", nargs="+", help=f"noise types (default per split: {SPLIT_TYPES}); "
                                              f"of {', '.join([*COLOURS, 'babble'])}")
    g.add_argument("--noise-count", type=int, default=10, help="files per noise type (0: no noise set)")
    g.add_argument("--seconds", type=float, default=30.0, help="length of each noise file")
    g.add_argument("--speech", help="speech manifest that babble is mixed from")
    g.add_argument("--talkers", type=int, nargs=2, default=[3, 7], metavar=("MIN", "MAX"),
                   help="voices per babble file")
    g.add_argument("--rir-count", type=int, default=50, help="room impulse responses (0: no RIR set)")
    g.add_argument("--rt60", type=float, nargs=2, default=[0.2, 0.9], metavar=("MIN", "MAX"),
                   help="reverberation time (s, 60 dB decay)")
    g.add_argument("--room", type=float, nargs=2, default=[3.0, 10.0], metavar=("MIN", "MAX"),
                   help="pyroomacoustics: room length and width (m)")
    g.add_argument("--height", type=float, nargs=2, default=[2.5, 4.0], metavar=("MIN", "MAX"),
                   help="pyroomacoustics: room height (m)")
    g.add_argument("--drr", type=float, nargs=2, default=[-3.0, 12.0], metavar=("MIN", "MAX"),
                   help="decay model: direct-to-reverberant ratio (dB)")
    g.add_argument("--simulator", choices=["auto", "pyroomacoustics", "decay"], default="auto",
                   help="auto: pyroomacoustics where installed, else the decay model")
    g.add_argument("--rate", type=int, default=16000, help="sample rate of the files written")
    g.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("degrade", help="write a degraded copy of a manifest (wavs + manifest.jsonl)")
    d.add_argument("--manifest", required=True, help="the manifest to degrade (e.g. a test set)")
    d.add_argument("-o", "--out", required=True, help="output directory (manifest.jsonl, audio/)")
    d.add_argument("--noise", nargs="+", default=[], help="noise manifests (generate's noise.jsonl, MUSAN's)")
    d.add_argument("--snr", type=float, nargs=2, default=[0.0, 20.0], metavar=("MIN", "MAX"), help="SNR range (dB)")
    d.add_argument("--noise-prob", type=float, default=1.0, help="share of utterances given noise")
    d.add_argument("--rir", nargs="+", default=[], help="room impulse response manifests")
    d.add_argument("--reverb-prob", type=float, default=1.0, help="share of utterances reverberated")
    d.add_argument("--codecs", nargs="+", default=[], help="codecs to pick from: telephone, mulaw, mp3, opus")
    d.add_argument("--codec-prob", type=float, default=1.0, help="share of utterances through a codec")
    d.add_argument("--lowpass-prob", type=float, default=0.0, help="share of utterances low-passed (2-6 kHz)")
    d.add_argument("--gain", type=float, nargs=2, metavar=("MIN", "MAX"),
                   help="level change range (dB), e.g. -20 0 for talkers near and far")
    d.add_argument("--gain-prob", type=float, default=1.0, help="share of utterances given a level change")
    d.add_argument("--edges", type=float, nargs=2, metavar=("MIN", "MAX"),
                   help="change of the silence at each edge (s): below 0 crops it (never speech), above 0 "
                        "adds zeros or the file's own floor; noise, if any, then covers it too")
    d.add_argument("--edge-prob", type=float, default=1.0, help="share of utterances whose edges change")
    d.add_argument("--keep", nargs="+", default=[], metavar="LANG=SHARE",
                   help="keep only this share of a source language's lines, e.g. fr=0.5 en=0.7: a corpus "
                        "of unequal languages from an equal one")
    d.add_argument("--rate", type=int, default=16000, help="sample rate of the files written")
    d.add_argument("--seed", type=int, default=0, help="with the line number, seeds each utterance's degradation")
    args = p.parse_args(argv)
    try:
        generate(args) if args.command == "generate" else degrade(args)
    except (ManifestError, ConfigError) as e:  # a bad manifest line or setting, named
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
