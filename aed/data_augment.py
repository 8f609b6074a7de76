"""Changing a training waveform on the fly: the silence at its edges, reverberation, additive noise,
gain, clipping, low-pass and codecs, each with a probability and a range (`AugmentConfig`, the
`augment:` section).

    augment = Augment(cfg.augment, sample_rate=16000)  # reads the noise/RIR manifests, not their audio
    wav = augment(wav, seed, index, draw)              # (S,) -> (S,), the same for the same arguments

It runs in the DataLoader workers (`aed.data_batch.ExampleDataset`, after speed perturbation and
before the features), never in the training step, and only on training data. Every random choice
comes from a generator seeded by (seed, index, draw): the index is the utterance's place in the run's
examples, the draw the number of the sampler batch that holds it this time. An utterance thus
meets a new degradation on every pass over the data, and a resumed run, whose sampler state
carries the batch count, replays the same degradations whichever worker loads the utterance.

The chain follows a recording's path: where the recording starts and stops around the words
(edges), the room (reverberation), the noise in it, the recording level (gain), an overdriven
converter (clipping), then the channel (low-pass, codec).

Edges. A corpus cut by one tool holds about the same silence before and after every utterance's
speech, and a model trained on it learns those edges with the words: the same words with 50 ms more
silence, as another runtime's padding or a user's recording gives them, come out as other words.
`change_edges` moves each edge of an utterance by its own draw: a crop of the silence it holds
there (never into its speech, `aed.data_speech.speech_frames`), or added silence, digital zeros or
the recording's own floor (the non-speech at its edges, looped). Small draws shift the speech in time,
as NeMo's ShiftPerturbation does; larger ones give the varied edges real corpora hold. Added silence
makes an utterance longer than its duration says: batch shapes count the most it can add
(`AugmentConfig.added_seconds`). Noise and
room impulse responses come from JSONL manifests (audio_filepath, duration[, offset]; MUSAN's, or
what tools/make_noise.py writes); they are decoded on first use and kept per worker, and a bad
one (missing, unreadable, empty, silent) is skipped, counted and logged once.
"""

import io
import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF

from aed.config import ConfigError
from aed.data_audio import AudioError, load_audio
from aed.data_manifest import Faults, ManifestError, audio_path, read_rows, seconds
from aed.data_speech import FRAME, speech_frames

log = logging.getLogger(__name__)

CODECS = ("telephone", "mulaw", "mp3", "opus")
LOSSY = {"mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}  # libsndfile format, subtype
LOSSY_RATES = {"mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),  # MPEG-1/2/2.5
               "opus": (8000, 12000, 16000, 24000, 48000)}
MP3_MAX_LEVEL = 0.99  # libsndfile 1.2 refuses an MP3 compression level of 1.0
TELEPHONE_RATE = 8000  # narrowband telephony
TELEPHONE_LOW_HZ = 300.0  # the telephone band's lower edge (ITU-T G.712)
AUGMENT_STREAM = 0xA06  # the last word of the generator's seed: draws apart from the dither's
EDGE_STREAM = 0xED6  # ... and the edges' draws apart from the degradations'
FLOOR_MIN = 0.05  # seconds of non-speech a recording needs for its own floor to fill added silence


# --- the recordings: noise and room impulse responses -------------------------------------------


@dataclass(frozen=True)
class Recording:
    path: str
    offset: float
    duration: float | None  # None: the whole file (a line without an offset)
    where: str  # "noise.jsonl:3", for messages


def read_recordings(paths: list[str], kind: str) -> list[Recording]:
    """The lines of `paths` (JSONL: audio_filepath, duration, optional offset; relative paths are
    relative to the manifest's folder) as Recordings. A bad line raises ManifestError naming the
    file, line and field; a manifest without lines raises too."""

    def parse(d, where, base_dir):
        duration = seconds(d, "duration", where, positive=True, required=True)
        offset = seconds(d, "offset", where, positive=False)
        return Recording(audio_path(d, where, base_dir), offset or 0.0, duration if offset is not None else None,
                         where)

    out = []
    for path in paths:
        try:
            rows = list(read_rows(path, parse))
        except OSError as e:
            raise ManifestError(f"augment: {kind} manifest {path}: {e.strerror or e}") from None
        if not rows:
            raise ManifestError(f"augment: {kind} manifest {path} has no lines")
        out += rows
    return out


class AllBad(RuntimeError):
    """Every recording of a pool is unreadable: the degradation cannot run as configured."""


class RecordingPool:
    """Recordings of some manifests, decoded (at `sample_rate`, mono) on first use and kept up to
    `cache_bytes` per process; a bad one (missing, unreadable, empty, silent) is skipped, counted in
    `faults` and logged once. `pick` is deterministic given the generator: which recordings are bad
    is a property of the files, not of what this process has already loaded."""

    def __init__(self, manifests: list[str], kind: str, sample_rate: int, cache_bytes: int):
        self.manifests, self.kind, self.rate, self.cache_bytes = manifests, kind, sample_rate, cache_bytes
        self.recordings = read_recordings(manifests, kind)
        self.cache = OrderedDict()  # index -> (S,) float32, least recently used first
        self.bad = {}  # index -> why
        self.faults = Faults()

    def pick(self, rng: np.random.Generator) -> torch.Tensor:
        """A random readable recording (S,): the drawn one, or the next readable one after it.
        Raises AllBad when none can be read."""
        n = len(self.recordings)
        first = int(rng.integers(n))
        for k in range(n):
            wav = self.load((first + k) % n)
            if wav is not None:
                return wav
        examples = "; ".join(f"{self.recordings[i].where}: {why}" for i, why in list(self.bad.items())[:3])
        raise AllBad(f"augment: all {n} {self.kind} recording(s) of {self.manifests} are unreadable ({examples}); "
                     f"fix them or leave augment.{self.kind}_prob at 0")

    def load(self, i: int) -> torch.Tensor | None:
        if i in self.cache:
            self.cache.move_to_end(i)
            return self.cache[i]
        if i in self.bad:
            return None
        r = self.recordings[i]
        try:
            wav = load_audio(r.path, r.offset, r.duration, self.rate)
            if not bool(wav.abs().max() > 0):
                raise AudioError(r.path, "silent (every sample is 0)")
        except AudioError as e:
            self.bad[i] = str(e)
            self.faults.skip("unreadable_audio", r.where, str(e), f"augment: {self.kind}")
            return None
        self.cache[i] = wav
        held = sum(w.numel() * w.element_size() for w in self.cache.values())
        while held > self.cache_bytes and len(self.cache) > 1:
            held -= (dropped := self.cache.popitem(last=False)[1]).numel() * dropped.element_size()
        return wav


# --- the edges: (S,) -> (S',) float32 -----------------------------------------------------------


def change_edges(wav: torch.Tensor, rate: int, lead: float, trail: float, fill: str,
                 rng: np.random.Generator) -> torch.Tensor:
    """wav (S,) with its leading and trailing silence changed by `lead` and `trail` seconds: a
    negative change crops that much of the non-speech before its first (after its last) speech
    frame, at most all of it; a positive one adds silence there, digital zeros (`fill` "zeros")
    or the recording's own floor, the non-speech at its edges looped from a random place ("floor";
    zeros when it holds less than FLOOR_MIN s of it). A waveform without speech only gets silence added."""
    hop = round(rate * FRAME)
    speech = speech_frames(wav, rate)  # (S // hop,)
    spoken = speech.nonzero().flatten()
    first, last = (int(spoken[0]) * hop, (int(spoken[-1]) + 1) * hop) if spoken.numel() else (0, wav.numel())
    start = min(round(-lead * rate), first) if lead < 0 else 0
    end = wav.numel() - min(round(-trail * rate), wav.numel() - last) if trail < 0 else wav.numel()
    before, after = round(max(lead, 0.0) * rate), round(max(trail, 0.0) * rate)
    if before + after == 0:
        return wav[start:end]
    floor = torch.cat([wav[:first], wav[last:]])  # the non-speech at its edges: no word in it, not even a faint one
    if fill == "floor" and floor.numel() >= FLOOR_MIN * rate:
        added = looped(floor, before + after, int(rng.integers(floor.numel())))
    else:
        added = wav.new_zeros(before + after)
    return torch.cat([added[:before], wav[start:end], added[before:]])


# --- the degradations: (S,) -> (S,) float32 ----------------------------------------------------


def power(x: torch.Tensor) -> float:
    """Mean square of x, in float64 (an SNR measured to a hundredth of a dB needs it)."""
    return float(x.double().pow(2).mean())


def looped(x: torch.Tensor, length: int, start: int) -> torch.Tensor:
    """`length` samples of x read from `start`, wrapping round to its beginning as often as needed."""
    return x[(start + torch.arange(length)) % x.numel()]


def add_noise(wav: torch.Tensor, noise: torch.Tensor, snr_db: float, start: int) -> torch.Tensor:
    """wav + noise scaled to `snr_db` over the whole utterance; the noise is read from `start` and
    looped to the utterance's length. A silent stretch of noise leaves wav as it is."""
    cut = looped(noise, wav.numel(), start)  # (S,)
    noise_power = power(cut)
    if noise_power == 0:
        return wav
    scale = (power(wav) / (noise_power * 10 ** (snr_db / 10))) ** 0.5
    return wav + scale * cut


def reverberate(wav: torch.Tensor, rir: torch.Tensor) -> torch.Tensor:
    """wav convolved with a room impulse response (FFT convolution): the same length, the direct
    path (the RIR's peak) at time 0, so words stay where the original had them, and the same
    power, so reverberation changes the sound, not the level."""
    direct, n = int(rir.abs().argmax()), wav.numel() + rir.numel() - 1
    size = 1 << (n - 1).bit_length()  # a power of two: an FFT of a length with a large prime factor is ~10x slower
    full = torch.fft.irfft(torch.fft.rfft(wav, size) * torch.fft.rfft(rir, size), size)  # (size,): linear, as size >= n
    wet = full[direct: direct + wav.numel()]  # (S,) from the direct path
    wet_power = power(wet)
    return wet * (power(wav) / wet_power) ** 0.5 if wet_power > 0 else wet


def clip(wav: torch.Tensor, level: float) -> torch.Tensor:
    """Hard clipping at `level` x the utterance's peak."""
    limit = float(wav.abs().max()) * level
    return wav.clamp(-limit, limit)


RESAMPLE_WIDTH = 16  # torchaudio's sinc half-width in zero crossings: its default 6 leaves the band
# above low_rate / 2 only ~27 dB down after the round trip (white noise, 16 -> 8 -> 16 kHz); 16: ~43 dB


def resample_back(wav: torch.Tensor, rate: int, low_rate: int, low=lambda x: x) -> torch.Tensor:
    """wav taken down to `low_rate` (which band-limits it below low_rate / 2), through `low`, and
    back to `rate` at its own length (torchaudio's resampling is zero-phase: nothing shifts)."""
    down = AF.resample(wav, rate, low_rate, lowpass_filter_width=RESAMPLE_WIDTH)
    back = AF.resample(low(down), low_rate, rate, lowpass_filter_width=RESAMPLE_WIDTH)
    n = wav.numel()
    return back[:n] if back.numel() >= n else torch.cat([back, back.new_zeros(n - back.numel())])


def lowpass(wav: torch.Tensor, rate: int, cutoff_hz: float) -> torch.Tensor:
    """wav band-limited to `cutoff_hz` (rounded to 50 Hz: resampling between rates with a large
    common divisor keeps the kernels small)."""
    return resample_back(wav, rate, 2 * 50 * max(1, round(cutoff_hz / 50)))


def mulaw(wav: torch.Tensor) -> torch.Tensor:
    """8-bit mu-law quantisation (G.711's companding) of wav clamped to [-1, 1]."""
    return AF.mu_law_decoding(AF.mu_law_encoding(wav.clamp(-1, 1), 256), 256)


def telephone(wav: torch.Tensor, rate: int) -> torch.Tensor:
    """A narrowband phone call: 8 kHz, high-passed at 300 Hz, 8-bit mu-law, back at `rate`."""
    return resample_back(wav, rate, TELEPHONE_RATE,
                         lambda x: mulaw(AF.highpass_biquad(x, TELEPHONE_RATE, TELEPHONE_LOW_HZ)))


def lossy(wav: torch.Tensor, rate: int, codec: str, level: float) -> torch.Tensor:
    """wav (clamped to [-1, 1], as a file holds it) encoded as mp3 or opus at libsndfile's compression
    `level` and decoded, in memory. libsndfile trims the encoder delay: the samples come back aligned;
    the length is made the input's in case a decoder pads the last frame."""
    fmt, subtype = LOSSY[codec]
    buf = io.BytesIO()
    sf.write(buf, wav.clamp(-1, 1).numpy(), rate, format=fmt, subtype=subtype,
             compression_level=min(level, MP3_MAX_LEVEL) if codec == "mp3" else level)
    buf.seek(0)
    out = torch.from_numpy(sf.read(buf, dtype="float32")[0])
    n = wav.numel()
    return out[:n] if out.numel() >= n else torch.cat([out, out.new_zeros(n - out.numel())])


# --- the chain ----------------------------------------------------------------------------------


class Augment:
    """The changes of `cfg` (aed.train_config.AugmentConfig), applied to one utterance at a time:
    (S,) -> (S',) float32 (S' = S but for the edges), every random choice from a generator seeded
    by (seed, index, draw). Noise
    and RIR manifests are read here (bad lines raise ManifestError naming them); their audio is read
    by the DataLoader workers when first drawn. Settings the training sample rate cannot meet raise ConfigError."""

    def __init__(self, cfg, sample_rate: int):
        self.cfg, self.rate = cfg, sample_rate
        if cfg.lowpass_prob > 0 and cfg.lowpass_hz[1] >= sample_rate / 2:
            raise ConfigError(f"augment.lowpass_hz: cutoffs below half of features.sample_rate={sample_rate}, "
                              f"got {list(cfg.lowpass_hz)}")
        for codec in (c for c in cfg.codecs if c in LOSSY_RATES and cfg.codec_prob > 0):
            if sample_rate not in LOSSY_RATES[codec]:
                raise ConfigError(f"augment.codecs: {codec} cannot encode {sample_rate} Hz audio (it takes "
                                  f"{', '.join(map(str, LOSSY_RATES[codec]))})")
        cache = cfg.cache_mb * 2**20
        self.rirs = RecordingPool(cfg.rir_manifests, "reverb", sample_rate, cache // 2) if cfg.reverb_prob else None
        self.noises = RecordingPool(cfg.noise_manifests, "noise", sample_rate, cache // 2) if cfg.noise_prob else None

    def __call__(self, wav: torch.Tensor, seed: int, index: int, draw: int = 0) -> torch.Tensor:
        """wav (S,) -> (S',): the changes drawn for (seed, index, draw); the same every time."""
        cfg = self.cfg
        if cfg.edge_prob > 0 and draw >= cfg.edge_after:  # its own generator: the degradations draw as without edges
            edges = np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, index, draw, EDGE_STREAM])
            if edges.random() < cfg.edge_prob:
                lead, trail = edges.uniform(*cfg.edge_seconds, size=2)
                fill = "floor" if edges.random() < cfg.edge_floor_prob else "zeros"
                wav = change_edges(wav, self.rate, float(lead), float(trail), fill, edges)
        # SeedSequence words must be >= 0
        rng = np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, index, draw, AUGMENT_STREAM])
        # Every decision is drawn first, so an effect's draws never shift another's decision.
        on = rng.random(6) < [cfg.reverb_prob, cfg.noise_prob, cfg.gain_prob, cfg.clip_prob,
                              cfg.lowpass_prob, cfg.codec_prob]
        if on[0]:
            wav = reverberate(wav, self.rirs.pick(rng))
        if on[1]:
            noise = self.noises.pick(rng)
            wav = add_noise(wav, noise, rng.uniform(*cfg.snr_db), int(rng.integers(noise.numel())))
        if on[2]:
            wav = wav * 10 ** (rng.uniform(*cfg.gain_db) / 20)
        if on[3]:
            wav = clip(wav, rng.uniform(*cfg.clip_level))
        if on[4]:
            wav = lowpass(wav, self.rate, rng.uniform(*cfg.lowpass_hz))
        if on[5]:
            codec = cfg.codecs[int(rng.integers(len(cfg.codecs)))]
            if codec == "telephone":
                wav = telephone(wav, self.rate)
            elif codec == "mulaw":
                wav = mulaw(wav)
            else:
                wav = lossy(wav, self.rate, codec, rng.uniform(*cfg.codec_level))
        return wav.float()
