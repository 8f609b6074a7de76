"""Where the speech is in a waveform: 10 ms frames judged speech or not by their energy, and the
silence around an utterance's speech measured, trimmed or changed.

    speech = speech_frames(wav, 16000)        # (S,) -> (frames,) bool, one per 10 ms
    lead, trail = edge_silence(wavs, 16000)   # median seconds of non-speech before / after the speech
    wav = trim_silence(wav, 16000, keep=0.15) # the speech with at most 0.15 s of silence around it

A frame is speech when its energy is SPEECH_ABOVE_FLOOR_DB above the audio's noise floor (its
10th-percentile frame) and within SPEECH_RANGE_DB of its loudest frame, or within
SPEECH_NEAR_PEAK_DB of that whatever the floor, and never below SILENCE_DBFS (`is_speech`).
Long-form cutting and streams (aed/decode_timing.py, aed/decode_stream.py), training's trim
(train.trim_silence) and its edge variation (aed/data_augment.py) all judge speech by this one rule.
"""

import math

import torch
import torch.nn.functional as F

FRAME = 0.01  # seconds per energy frame
SPEECH_ABOVE_FLOOR_DB = 10.0  # a 10 ms frame is speech this much above the noise floor ...
SPEECH_RANGE_DB = 40.0  # ... and within this much of the loudest frame;
SPEECH_NEAR_PEAK_DB = 15.0  # a frame this close to the loudest is speech whatever the floor: audio with
# no quiet part (continuous speech, music) has a floor of speech, and must not come out as all pause
SILENCE_DBFS = -80.0  # a frame quieter than this is never speech (digital silence, 16-bit dither)


def frame_db(wav: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """wav (S,) -> (S // hop,) mean energy of each 10 ms frame in dB (full scale: 0 dB)."""
    hop = round(sample_rate * FRAME)
    return 10 * torch.log10(wav[: wav.numel() // hop * hop].view(-1, hop).pow(2).mean(dim=1) + 1e-12)


def speech_threshold(db: torch.Tensor) -> float:
    """The energy (dB) above which a 10 ms frame of audio whose frame energies are `db` (frames,) is speech."""
    if db.numel() == 0:
        return math.inf
    peak = float(db.max())
    threshold = max(float(db.quantile(0.1)) + SPEECH_ABOVE_FLOOR_DB, peak - SPEECH_RANGE_DB)
    return max(min(threshold, peak - SPEECH_NEAR_PEAK_DB), SILENCE_DBFS)


def is_speech(db: torch.Tensor) -> torch.Tensor:
    """Frame energies (frames,) in dB -> (frames,) True where the frame sounds like speech."""
    return db > speech_threshold(db)


def speech_frames(wav: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """wav (S,) -> (S // hop,) True at the 10 ms frames that sound like speech."""
    return is_speech(frame_db(wav, sample_rate))


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) frame ranges of the True runs of a boolean mask (frames,)."""
    padded = F.pad(mask.to(torch.int8), (1, 1))
    edges = (padded[1:] - padded[:-1]).nonzero().flatten().tolist()  # starts (+1) and ends (-1) alternate
    return list(zip(edges[0::2], edges[1::2]))


def edge_silence(wavs, sample_rate: int) -> tuple[float, float] | None:
    """The median seconds of non-speech before the first and after the last speech frame of the
    waveforms (S,) `wavs` (`speech_frames` of each alone): the silence a model trained on them
    expects at a segment's edges; None for no waveform with speech."""
    lead, trail = [], []
    for wav in wavs:
        spoken = speech_frames(wav, sample_rate).nonzero().flatten()
        if spoken.numel():
            lead.append(int(spoken[0]) * FRAME)
            trail.append(wav.numel() / sample_rate - (int(spoken[-1]) + 1) * FRAME)
    if not lead:
        return None
    return round(float(torch.tensor(lead).median()), 3), round(max(0.0, float(torch.tensor(trail).median())), 3)


def trim_silence(wav: torch.Tensor, sample_rate: int, keep: float) -> torch.Tensor:
    """wav (S,) -> the part from `keep` s before its first speech frame to `keep` s after its last
    (`speech_frames`, as much of it as there is); unchanged when no frame sounds like speech."""
    start, end = trimmed_span(wav, sample_rate, keep)
    return wav[start:end]


def trimmed_span(wav: torch.Tensor, sample_rate: int, keep: float) -> tuple[int, int]:
    """The samples [start, end) of wav (S,) that `trim_silence` keeps: training cuts its utterances
    with it (train.trim_silence), and inference the inputs of a model trained so."""
    spoken = speech_frames(wav, sample_rate).nonzero().flatten()
    if not spoken.numel():
        return 0, wav.numel()
    hop, margin = round(FRAME * sample_rate), round(keep / FRAME)
    return max(0, int(spoken[0]) - margin) * hop, min(wav.numel(), (int(spoken[-1]) + 1 + margin) * hop)
