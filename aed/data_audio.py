"""Audio in, log-mel features out, plus SpecAugment.

The feature pipeline reproduces NeMo's `AudioToMelSpectrogramPreprocessor` (FilterbankFeatures)
with the settings Canary-1B / Canary-1B-Flash were trained with, so that checkpoints converted
from NeMo see the features they expect:

    wav (B, S) -> dither -> pre-emphasis -> zero padding -> |STFT|^2 -> mel -> log
        -> per-bin mean/std over valid frames -> zero padding -> feats (B, T, F)

Padding never changes the answer: an utterance alone and inside a padded batch gives the same
features (tests/test_data_audio.py checks it).
"""

import io
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import numpy as np
import soundfile as sf
import torch
import torch.nn as nn
import torchaudio.functional as AF


class AudioError(RuntimeError):
    """A file that cannot give us audio: missing, corrupt, empty, or read past its end."""

    def __init__(self, path, reason):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


# Containers soundfile does not read and the ffmpeg command does: what phones and video record in.
FFMPEG_EXTENSIONS = {".m4a", ".mp4", ".aac", ".webm", ".mkv", ".mov", ".wma", ".amr", ".3gp"}


def load_audio(path, offset=0.0, duration=None, sample_rate=16000, name: str | None = None):
    """Read `duration` seconds from `offset` (whole file by default) as mono float32 (S,) at `sample_rate`.

    `path` is a file, or the bytes of one (a member of a tar shard, a parquet cell), named `name` in
    errors: the one audio reader of training and inference. Only the requested frames are decoded,
    so cutting a segment from a long recording is cheap. A duration reaching past the end of the file
    returns what is there: manifest durations are rounded, and a few missing milliseconds are not
    worth failing a batch over. What soundfile cannot decode (m4a/AAC, mp4, webm, ...) is decoded by
    the ffmpeg command where it is installed (bytes through a temporary file: mp4's index may sit at
    the end, where a pipe cannot seek).
    """
    in_memory = isinstance(path, (bytes, bytearray, memoryview))
    if in_memory:
        name = name or "audio bytes"
        source = io.BytesIO(path)
    elif path is None:
        raise AudioError(name or "example", "no audio")
    else:
        path = name = os.fspath(path)
        if not os.path.isfile(path):
            raise AudioError(path, "file not found")
        source = path
    if offset < 0:
        raise AudioError(name, f"negative offset {offset}")
    if duration is not None and duration <= 0:
        raise AudioError(name, f"non-positive duration {duration}")
    try:
        with sf.SoundFile(source) as f:
            file_rate, total = f.samplerate, f.frames
            start = round(offset * file_rate)
            if total == 0:
                raise AudioError(name, "no samples")
            if start >= total:
                raise AudioError(name, f"offset {offset}s is beyond the end ({total / file_rate:.3f}s)")
            f.seek(start)
            frames = -1 if duration is None else round(duration * file_rate)
            data = f.read(frames, dtype="float32", always_2d=True)  # (S, channels)
    except AudioError:
        raise
    except (RuntimeError, ValueError) as e:  # sf.LibsndfileError is a RuntimeError
        if not in_memory:
            data, file_rate = ffmpeg_read(path, offset, duration, reason=str(e))
        else:
            with tempfile.NamedTemporaryFile() as tmp:
                tmp.write(path)
                tmp.flush()
                try:
                    data, file_rate = ffmpeg_read(tmp.name, offset, duration, reason=str(e))
                except AudioError as err:
                    raise AudioError(name, err.reason) from None
    if data.shape[0] == 0:  # compressed formats may report an estimated frame count
        raise AudioError(name, "no samples")
    wav = torch.from_numpy(data).mean(dim=1)  # average channels: (S, channels) -> (S,)
    if file_rate != sample_rate:
        wav = AF.resample(wav, file_rate, sample_rate)
    return wav


def ffmpeg_probe(path: str, reason: str) -> tuple[int, int, float]:
    """(sample rate, channels, seconds) of a file's first audio stream, by ffprobe (installed with
    ffmpeg); AudioError naming ffmpeg where it is not installed, with soundfile's `reason`."""
    if shutil.which("ffprobe") is None or shutil.which("ffmpeg") is None:
        raise AudioError(path, f"cannot decode ({reason}); formats soundfile does not read (m4a/AAC, mp4, webm, "
                               f"...) need the ffmpeg command (e.g. apt-get install ffmpeg)")
    out = subprocess.run(["ffprobe", "-v", "error", "-select_streams", "a:0", "-show_entries",
                          "stream=sample_rate,channels:format=duration", "-of", "json", path],
                         capture_output=True, text=True)
    try:
        info = json.loads(out.stdout)
        stream = info["streams"][0]
        return int(stream["sample_rate"]), int(stream["channels"]), float(info["format"]["duration"])
    except (ValueError, KeyError, IndexError) as e:
        raise AudioError(path, f"cannot decode: neither soundfile ({reason}) nor ffmpeg "
                               f"({out.stderr.strip() or 'no audio stream'}) reads it") from e


def ffmpeg_read(path: str, offset: float, duration: float | None, reason: str):
    """`duration` s from `offset` decoded by the ffmpeg command at the file's own rate and channels:
    (S, channels) float32 and the rate, mixed down and resampled by `load_audio` as soundfile's are."""
    rate, channels, seconds = ffmpeg_probe(path, reason)
    if offset >= seconds:
        raise AudioError(path, f"offset {offset}s is beyond the end ({seconds:.3f}s)")
    cut = ["-ss", str(offset)] + (["-t", str(duration)] if duration is not None else [])
    out = subprocess.run(["ffmpeg", "-nostdin", "-v", "error", *cut, "-i", path, "-vn", "-f", "f32le",
                          "-acodec", "pcm_f32le", "-"], capture_output=True)
    if out.returncode != 0:
        raise AudioError(path, f"ffmpeg cannot decode it: {out.stderr.decode(errors='replace').strip()}")
    data = np.frombuffer(bytearray(out.stdout), dtype="<f4")  # writable, as torch.from_numpy wants
    return data[: data.size // channels * channels].reshape(-1, channels), rate  # interleaved -> (S, channels)


def audio_seconds(path: str) -> float:
    """A file's duration from its header (soundfile, else ffprobe), without decoding it: what
    `load_audio` reads, so a file inference reads passes training's audio check (`check_audio`).
    sf.SoundFile, not sf.info: info also formats a description of the file, which is not needed."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise AudioError(path, "file not found")
    try:
        with sf.SoundFile(path) as f:
            frames, rate = f.frames, f.samplerate
    except (RuntimeError, ValueError) as e:  # sf.LibsndfileError is a RuntimeError
        return ffmpeg_probe(path, str(e))[2]
    if frames <= 0 or rate <= 0:
        raise AudioError(path, "no samples in the header")
    return frames / rate


@dataclass(frozen=True)
class FeatureConfig:
    sample_rate: int = 16000  # Canary is trained on 16 kHz audio; load_audio resamples to this
    n_mels: int = 128  # Canary-1B(-Flash) use 128 bins; older NeMo (Fast)Conformer models use 80
    win_length: int = 400  # 25 ms analysis window
    hop_length: int = 160  # 10 ms frame shift: one feature frame per 160 samples
    n_fft: int = 512  # next power of two above win_length; the window is zero padded inside it
    preemph: float = 0.97  # boosts high frequencies before the STFT, as NeMo does
    log_guard: float = 2**-24  # added before log so silent (all-zero) bins stay finite
    dither: float = 1e-5  # tiny noise in training so digital silence does not give a degenerate spectrum
    pad_value: float = 0.0  # value of frames past an utterance's end; 0 is also the normalised mean


def num_frames(num_samples, hop_length=FeatureConfig.hop_length):
    """Valid feature frames for `num_samples` samples (int or tensor).

    NeMo's convention: the centred STFT yields 1 + S // hop frames, but the last one is centred
    past the end of the audio, so only S // hop count as valid. Used for masks, filters and tests.
    """
    return num_samples // hop_length


class LogMel(nn.Module):
    """Batched log-mel features with per-utterance, per-bin normalisation over valid frames only."""

    def __init__(self, cfg=FeatureConfig()):
        super().__init__()
        self.cfg = cfg
        # Symmetric (periodic=False) Hann, as NeMo builds it; torch.stft centres it inside n_fft.
        self.register_buffer("window", torch.hann_window(cfg.win_length, periodic=False), persistent=False)
        # Slaney mel scale with Slaney area normalisation = librosa.filters.mel's default, which NeMo uses.
        fb = AF.melscale_fbanks(
            n_freqs=cfg.n_fft // 2 + 1,
            f_min=0.0,
            f_max=cfg.sample_rate / 2,
            n_mels=cfg.n_mels,
            sample_rate=cfg.sample_rate,
            norm="slaney",
            mel_scale="slaney",
        )
        self.register_buffer("mel_fb", fb.T.contiguous(), persistent=False)  # (F, n_fft // 2 + 1)

    def forward(self, wav, wav_lens, generator: torch.Generator | None = None):
        """wav (B, S) zero padded, wav_lens (B,) samples -> feats (B, T, F), feat_lens (B,).
        `generator`: where the training dither draws from (default: torch's global one).

        T = max(feat_lens): the STFT's extra trailing frame, and frames that exist only because the
        batch was padded wider than its longest utterance, are dropped rather than carried as padding.
        """
        cfg = self.cfg
        assert wav.dim() == 2 and wav_lens.shape == (wav.shape[0],), (
            f"expected wav (B, S) and wav_lens (B,), got {tuple(wav.shape)} and {tuple(wav_lens.shape)}"
        )
        feat_lens = num_frames(wav_lens, cfg.hop_length)
        T = int(feat_lens.max())
        # The STFT and the log need float32 range; bf16 power spectra lose the quiet bins.
        with torch.autocast(device_type=wav.device.type, enabled=False):
            x = wav.float()
            if self.training and cfg.dither > 0:
                x = x + cfg.dither * torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
            x = torch.cat([x[:, :1], x[:, 1:] - cfg.preemph * x[:, :-1]], dim=1)
            # Dither and pre-emphasis write into the padding; zero it so the STFT frames that
            # straddle an utterance's end see exactly what they would see for the utterance alone.
            valid_samples = torch.arange(x.shape[1], device=x.device) < wav_lens[:, None]  # (B, S)
            x = x.masked_fill(~valid_samples, 0.0)
            spec = torch.stft(
                x,
                n_fft=cfg.n_fft,
                hop_length=cfg.hop_length,
                win_length=cfg.win_length,
                window=self.window,
                center=True,
                pad_mode="constant",
                return_complex=True,
            )  # (B, n_fft // 2 + 1, 1 + S // hop)
            spec = spec[..., :T]  # re^2 + im^2 directly: summing view_as_real's pairs is a slow strided reduction
            power = spec.real.square() + spec.imag.square()  # (B, n_fft // 2 + 1, T)
            mel = torch.log(torch.matmul(self.mel_fb, power) + cfg.log_guard)  # (B, F, T)
            feats = self._normalize(mel.transpose(1, 2), feat_lens)  # (B, F, T) -> (B, T, F)
        return feats, feat_lens

    def _normalize(self, x, x_lens):
        """Per-utterance, per-bin mean/std over valid frames only; padded frames set to pad_value."""
        valid = (torch.arange(x.shape[1], device=x.device) < x_lens[:, None])[:, :, None]  # (B, T, 1)
        n = x_lens[:, None, None].to(x.dtype)  # (B, 1, 1)
        mean = x.masked_fill(~valid, 0.0).sum(dim=1, keepdim=True) / n.clamp(min=1)  # (B, 1, F)
        centred = (x - mean).masked_fill(~valid, 0.0)
        # Unbiased (n - 1) std as NeMo's torch.std; a one-frame utterance gets std 0, not NaN.
        std = (centred.pow(2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()  # (B, 1, F)
        x = centred / (std + 1e-5)  # 1e-5 keeps constant bins (e.g. digital silence) finite
        return x.masked_fill(~valid, self.cfg.pad_value)


@dataclass(frozen=True)
class SpecAugmentConfig:
    freq_masks: int = 2  # Canary's SpecAugment: 2 frequency masks ...
    freq_width: int = 27  # ... of up to 27 mel bins
    time_masks: int = 10  # and 10 time masks ...
    time_width: int | float = 0.05  # ... of up to 5% of the utterance each (an int: that many frames)
    freq_warp: float = 0.0  # stretch each utterance's mel axis by a factor in [1 - w, 1 + w] (0: off; Canary: off)

    def __post_init__(self):
        assert 0 <= self.freq_warp < 1, f"freq_warp must be in [0, 1) (a factor of 1 - w must stay positive), got {self.freq_warp}"


class SpecAugment(nn.Module):
    """Frequency and time masking (Park et al. 2019) with Canary's settings; identity in eval mode.

    time_width: a float is a fraction of each utterance's valid length (so long and short
    utterances lose the same share), an int is a number of frames. Masks stay inside valid
    frames, so padding is never touched. Mask value 0 is the per-bin mean after normalisation.
    freq_warp: before masking, a per-utterance stretch of the mel axis moves formants and
    harmonics as a longer or shorter vocal tract would (VTLP, Jaitly & Hinton 2013): a
    recogniser trained on few voices meets new ones. It leaves durations as they are, so the
    sampler's buckets and oom.py's batch sizes still hold.
    """

    def __init__(self, cfg: SpecAugmentConfig = SpecAugmentConfig(), generator=None):
        super().__init__()
        self.freq_masks = cfg.freq_masks
        self.freq_width = cfg.freq_width
        self.time_masks = cfg.time_masks
        self.time_width = cfg.time_width
        self.freq_warp = cfg.freq_warp
        self.generator = generator  # for reproducible tests; None uses torch's global RNG

    def forward(self, feats, feat_lens):
        """feats (B, T, F), feat_lens (B,) -> feats (B, T, F) with masked bins and frames set to 0."""
        if not self.training:
            return feats
        B, T, F = feats.shape
        valid = torch.arange(T, device=feats.device) < feat_lens[:, None]  # (B, T)
        if self.freq_warp > 0:
            feats = torch.where(valid[:, :, None], self._warp_freq(feats), feats)
        if isinstance(self.time_width, float):
            max_time_width = (feat_lens * self.time_width).long().clamp(min=1)
        else:
            max_time_width = torch.full_like(feat_lens, self.time_width)
        max_time_width = torch.minimum(max_time_width, feat_lens)
        time_mask = self._spans(self.time_masks, max_time_width, feat_lens, T)  # (B, T)
        full_f = torch.full_like(feat_lens, F)
        freq_mask = self._spans(self.freq_masks, full_f.clamp(max=self.freq_width), full_f, F)  # (B, F)
        mask = (time_mask[:, :, None] | freq_mask[:, None, :]) & valid[:, :, None]  # (B, T, F)
        return feats.masked_fill(mask, 0.0)

    def _warp_freq(self, feats):
        """feats (B, T, F) -> (B, T, F): in row b, bin f reads bin f / factor_b (linear
        interpolation), factor_b ~ U[1 - freq_warp, 1 + freq_warp]; a shrunk axis repeats its top bin.
        Every frame is warped; the caller keeps the padded ones as they were."""
        B, T, F = feats.shape
        factor = 1 + self.freq_warp * (2 * self._rand(B, feats.device) - 1)  # (B,)
        src = (torch.arange(F, device=feats.device) / factor[:, None]).clamp(max=F - 1)  # (B, F)
        lo = src.long()
        hi = (lo + 1).clamp(max=F - 1)
        low, high = (feats.gather(2, i[:, None, :].expand(B, T, F)) for i in (lo, hi))  # (B, T, F) each
        return torch.lerp(low, high, (src - lo)[:, None, :].to(feats.dtype))

    def _rand(self, *shape_and_device):
        """Uniform [0, 1) draws of the given shape on the given device, from self.generator if set
        (drawn on the generator's device, which may differ from the features', then moved)."""
        *shape, device = shape_and_device
        rng_device = self.generator.device if self.generator is not None else device
        return torch.rand(*shape, generator=self.generator, device=rng_device).to(device)

    def _spans(self, n_masks, max_width, length, size):
        """Union of n_masks random spans per row: width ~ U{0..max_width}, span inside [0, length).

        max_width, length: (B,) -> mask (B, size) bool. All rows and masks are drawn at once.
        """
        B, device = length.shape[0], length.device
        u = self._rand(2, B, n_masks, device)
        width = (u[0] * (max_width[:, None] + 1)).long()  # (B, n_masks)
        start = (u[1] * (length[:, None] - width + 1).clamp(min=1)).long()  # (B, n_masks)
        pos = torch.arange(size, device=device)
        inside = (pos >= start[:, :, None]) & (pos < (start + width)[:, :, None])  # (B, n_masks, size)
        return inside.any(dim=1)
