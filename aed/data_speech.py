"""Where the speech is in a waveform: 10 ms frames judged speech or not by their energy, and the
silence around an utterance's speech measured, trimmed or changed.

    speech = speech_frames(wav, 16000)        # (S,) -> (frames,) bool, one per 10 ms
    lead, trail = edge_silence(wavs, 16000)   # median seconds of non-speech before / after the speech
    wav = trim_silence(wav, 16000, keep=0.15) # the speech with at most 0.15 s of silence around it

A frame is speech when its energy in the speech band is SPEECH_ABOVE_FLOOR_DB above the noise floor
around it: the quietest 50 ms within FLOOR_SECONDS before it or the one after it, the louder
(`noise_floor`, minimum statistics as speech enhancement tracks noise). A floor found locally
follows a room whose level changes and ignores a loud frame elsewhere (a knock does not hide a
quiet talker); steady noise or room tone of any length never rises 10 dB above its own quietest
50 ms, so audio without speech has none. Stretches holding less than BLIP_SECONDS of speech with
none near them (a knock, a click) are not speech. Energy cannot tell speech from music: a music bed's louder
notes are speech to this rule.
Long-form cutting and streams (aed/decode_timing.py, aed/decode_stream.py), training's trim
(train.trim_silence) and its edge variation (aed/data_augment.py) all judge speech by this one rule.

Long-form cutting and streams can ask a small neural detector instead: Silero VAD (MIT, `pip install
silero-vad`; faster-whisper and WhisperX cut with it), an optional dependency, through the same two
calls (`speech_detector`): `scores` for the audio as it comes (a file's blocks, a stream's pieces),
`speech` for frames so scored. It tells a music bed from speech, which energy cannot, so "auto" (infer.py's
default) takes it wherever it is installed. It hears quiet speech less surely than loud, so it hears the
audio raised where it is quiet and the room is not loud (`lift_gain`). docs/inference.md measures both.

    detector = speech_detector("silero", 16000)
    scores = torch.cat([detector.scores(block) for block in blocks] + [detector.scores(tail, final=True)])
    speech = detector.speech(scores)          # (frames,) bool
"""

import importlib.util
import math
import warnings

import torch
import torch.nn.functional as F

FRAME = 0.01  # seconds per energy frame
SPEECH_BAND = (100.0, 4000.0)  # Hz whose energy is measured: where speech is loud and rooms are quiet
SMOOTH = 0.05  # seconds of frame energy averaged where the floor is looked for: one quiet 10 ms frame
# inside a vowel is no floor
FLOOR_SECONDS = 1.5  # a frame's noise floor is the quietest smoothed energy within this many seconds on
# either side (minimum statistics): it follows a room's level as the level changes, a loud frame far
# away does not move it, and a speaker's shortest pauses (a stop, a breath) reach down to it
SPEECH_ABOVE_FLOOR_DB = 10.0  # a 10 ms frame is speech this much above its floor: steady noise, whose
# smoothed energy moves a few dB, never is, however long it lasts (a lower mark for the frames next to
# such a frame found little more speech and much more of a music bed: docs/inference.md)
SILENCE_DBFS = -80.0  # a frame quieter than this is never speech (digital silence, 16-bit dither), and
# counts as this loud where the floor is looked for
BLIP_SECONDS = 0.1  # a stretch of speech holding fewer frames of it than this, with no other speech
PAUSE_SECONDS = 0.25  # within this on either side, is a knock or a click, not speech


def frame_db(wav: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """wav (S,) -> (S // hop,) energy of each 10 ms frame in the speech band (SPEECH_BAND Hz) in dB; a
    full-scale sine in the band reads -3 dB. Outside the band are a room's rumble and hum, which
    make the level of pink or brown noise wander by 10 dB and more from frame to frame."""
    hop = round(sample_rate * FRAME)
    frames = wav[: wav.numel() // hop * hop].view(-1, hop)  # (frames, hop)
    if frames.shape[0] == 0:
        return wav.new_zeros(0)
    window = torch.hann_window(hop, periodic=False, dtype=wav.dtype, device=wav.device)
    power = torch.fft.rfft((frames - frames.mean(dim=1, keepdim=True)) * window).abs().pow(2)  # (frames, hop // 2 + 1)
    freqs = torch.fft.rfftfreq(hop, 1 / sample_rate)
    band = (freqs >= SPEECH_BAND[0]) & (freqs <= SPEECH_BAND[1])
    return 10 * torch.log10(power[:, band].sum(dim=1) * 2 / (hop * window.pow(2).sum()) + 1e-12)


def noise_floor(db: torch.Tensor) -> torch.Tensor:
    """Frame energies (frames,) in dB -> (frames,) the noise floor at each frame: the quietest
    SMOOTH-long stretch within FLOOR_SECONDS before it and the one after it, the louder of the two
    (frames below SILENCE_DBFS count as SILENCE_DBFS). Either side alone would take a floor from
    across a change of level: after a machine starts, or before it stops, its noise would be speech.
    Near the audio's ends, where one side holds less than FLOOR_SECONDS, the other side alone (the
    audio's last word has no pause after it to measure); where neither does, the quieter of the two."""
    n, smooth, reach = db.numel(), round(SMOOTH / FRAME), round(FLOOR_SECONDS / FRAME)
    if n == 0:
        return db
    level = F.avg_pool1d(db.clamp(min=SILENCE_DBFS)[None, None], smooth, stride=1, padding=smooth // 2,
                         count_include_pad=False)[0, 0, :n]  # (frames,)
    before = -F.max_pool1d(F.pad(-level, (reach, 0), value=-math.inf)[None], reach + 1, stride=1)[0]  # (frames,)
    after = -F.max_pool1d(F.pad(-level, (0, reach), value=-math.inf)[None], reach + 1, stride=1)[0]
    frame = torch.arange(n, device=db.device)
    full_before, full_after = frame >= reach, frame + reach < n
    return torch.where(full_before & full_after, torch.maximum(before, after),
                       torch.where(full_before, before, torch.where(full_after, after, torch.minimum(before, after))))


def is_speech(db: torch.Tensor) -> torch.Tensor:
    """Frame energies (frames,) in dB -> (frames,) True where the frame sounds like speech: above its
    floor by SPEECH_ABOVE_FLOOR_DB, and not in a blip (`without_blips`)."""
    return without_blips(db > noise_floor(db) + SPEECH_ABOVE_FLOOR_DB)


def without_blips(speech: torch.Tensor) -> torch.Tensor:
    """A speech mask (frames,) without its blips: stretches of speech (runs less than PAUSE_SECONDS
    apart) holding less than BLIP_SECONDS of it (a knock, a click, a few frames of noise that rose over
    its floor by chance)."""
    pause, blip = round(PAUSE_SECONDS / FRAME), round(BLIP_SECONDS / FRAME)
    stretch: list[tuple[int, int]] = []
    for start, end in runs(speech) + [(math.inf, math.inf)]:  # a sentinel closes the last stretch
        if stretch and start - stretch[-1][1] >= pause:
            if sum(b - a for a, b in stretch) < blip:
                speech[stretch[0][0]:stretch[-1][1]] = False
            stretch = []
        stretch.append((start, end))
    return speech


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


# --- detectors for audio that comes in pieces --------------------------------------------------

DETECTORS = ("auto", "energy", "silero")
SILERO_RATE, SILERO_WINDOW = 16000, 512  # Silero VAD scores 32 ms windows of 16 kHz audio
SILERO_ON, SILERO_OFF = 0.5, 0.35  # speech starts at this probability and lasts while above that one
# (Silero's get_speech_timestamps' defaults)
SILERO_MIN_SPEECH = 0.25  # seconds: a shorter run of Silero's speech is none (its get_speech_timestamps drops
# such segments too): under a music bed, a note heard as speech for a moment, and the short runs that
# carry an utterance's end on into the bed (French prompts over music: 2.2-3.1% of the pauses called
# speech without this, 0.0-1.0% with it; docs/inference.md)
LIFT_TO_DB = -26.0  # Silero hears a quiet talker less surely (86-88% of a far talker 24-44 dB under full
# scale found; 98-99% raised): the audio it hears is raised until its loudest frame of the past
# LIFT_LEVEL_SECONDS reaches this frame energy (frame_db),
LIFT_MAX_DB = 24.0  # by at most this much,
LIFT_FLOOR_DB = -60.0  # and never so far that the room's floor (the quietest 50 ms of the past
# FLOOR_SECONDS) rises above this: raised noise is what Silero calls speech (a gain without this limit
# called 2-12% of the pauses under pink noise speech)
LIFT_LEVEL_SECONDS = 1.0
LIFT_RELEASE_SECONDS = 0.3  # the gain falls at once when the audio grows loud, and rises as its mean
# over this long: no click as it moves
LIFT_HISTORY = round((FLOOR_SECONDS + SMOOTH + LIFT_RELEASE_SECONDS) / FRAME) + 1  # frames of the past a gain needs


class EnergyDetector:
    """The energy rule above for audio that comes in pieces: `scores` are frame energies (dB)."""

    def __init__(self, sample_rate: int):
        self.rate, self.hop = sample_rate, round(sample_rate * FRAME)
        self.pending = torch.zeros(0)  # samples of a frame not yet complete

    def scores(self, samples: torch.Tensor, final: bool = False) -> torch.Tensor:
        """(S,) the next samples -> (frames,) a score per 10 ms frame they complete; `final`: the audio
        ends here (a last partial frame is dropped, as frame_db drops it)."""
        audio = torch.cat([self.pending, samples.float()])
        done = audio.numel() // self.hop * self.hop
        self.pending = audio[done:]
        return frame_db(audio[:done], self.rate)

    def speech(self, scores: torch.Tensor) -> torch.Tensor:
        """(frames,) scores -> (frames,) True where the frame is speech."""
        return is_speech(scores)


def hysteresis(on: torch.Tensor, still: torch.Tensor) -> torch.Tensor:
    """(frames,) bool: the runs of `still` that hold a frame of `on` (speech starts where it is clearly
    speech, and lasts while it is likely to be: Silero's decision)."""
    speech = on.clone()
    for start, end in runs(still):
        if on[start:end].any():
            speech[start:end] = True
    return speech


def past(pool, x: torch.Tensor, frames: int, fill: float | None) -> torch.Tensor:
    """(frames,) -> (frames,) `pool` (max or mean) over each frame and the `frames` - 1 before it, the
    audio's start padded with `fill` (None: its first frame repeated)."""
    padded = F.pad(x[None, None], (frames - 1, 0), mode="replicate") if fill is None else \
        F.pad(x, (frames - 1, 0), value=fill)[None, None]
    return pool(padded, frames, stride=1)[0, 0]


def lift_gain(db: torch.Tensor) -> torch.Tensor:
    """Frame energies (frames,) in dB -> (frames,) the gain in dB that raises a quiet stretch for
    Silero (LIFT_*), each frame's from its own and earlier frames only, so that a stream gets the
    gains a whole file would."""
    if db.numel() == 0:  # a stream's first piece, shorter than a frame
        return db
    smooth, reach = round(SMOOTH / FRAME), round(FLOOR_SECONDS / FRAME)
    level = past(F.max_pool1d, db, round(LIFT_LEVEL_SECONDS / FRAME), -math.inf)
    floor = -past(F.max_pool1d, -past(F.avg_pool1d, db.clamp(min=SILENCE_DBFS), smooth, None),
                  reach, -math.inf)  # the quietest 50 ms of the past FLOOR_SECONDS
    gain = torch.minimum((LIFT_TO_DB - level).clamp(0, LIFT_MAX_DB), (LIFT_FLOOR_DB - floor).clamp(min=0))
    return torch.minimum(gain, past(F.avg_pool1d, gain, round(LIFT_RELEASE_SECONDS / FRAME), 0.0))


class SileroDetector(EnergyDetector):
    """Silero VAD 5+ (`pip install silero-vad`): `scores` are its speech probabilities, each 10 ms frame
    taking that of the window holding its middle. A frame is scored once that window is complete (a
    stream's newest 30 ms wait for the next piece), and the last partial window of a file, padded
    with zeros. Silero hears the audio raised where it is quiet (`lift_gain`: each sample by the gain of
    the 10 ms frame before its own, so no sample waits for its frame to end). `speech`: above SILERO_ON,
    and on while above SILERO_OFF, for SILERO_MIN_SPEECH at least; blips dropped as above."""

    def __init__(self, sample_rate: int):
        if sample_rate != SILERO_RATE:
            raise ValueError(f"the silero speech detector takes {SILERO_RATE} Hz audio, this model {sample_rate} Hz")
        threads = torch.get_num_threads()
        try:
            from silero_vad import load_silero_vad
        except ImportError:
            raise ImportError("the silero speech detector needs Silero VAD: pip install silero-vad") from None
        finally:
            torch.set_num_threads(threads)  # importing silero_vad sets one thread for the whole process
        super().__init__(sample_rate)
        with warnings.catch_warnings():  # torch.jit.load's and importlib's deprecations: Silero's to act on
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            self.model = load_silero_vad()  # its state carries from window to window: one per input
        self.windows = 0  # windows scored so far
        self.frames = 0  # frames scored so far
        self.last = torch.zeros(1)  # the newest window's probability (a frame may straddle two calls)
        self.frame_tail = torch.zeros(0)  # samples of the 10 ms frame not yet complete, as heard
        self.past_db = torch.zeros(0)  # energies of the last LIFT_HISTORY complete frames
        self.gain = 0.0  # dB: the newest complete frame's gain, for the samples of the next

    def lift(self, samples: torch.Tensor) -> torch.Tensor:
        """(S,) the next samples -> (S,) them raised by `lift_gain`, clipped at full scale."""
        audio = torch.cat([self.frame_tail, samples])
        done = audio.numel() // self.hop
        db = torch.cat([self.past_db, frame_db(audio[:done * self.hop], self.rate)])
        gains = lift_gain(db)[db.numel() - done:]  # (done,) the new frames'
        per_frame = torch.cat([torch.tensor([self.gain]), gains])  # (done + 1,): frame i's samples take gain i
        per_sample = per_frame.repeat_interleave(self.hop)[self.frame_tail.numel():audio.numel()]  # (S,)
        self.frame_tail, self.past_db = audio[done * self.hop:], db[-LIFT_HISTORY:]
        self.gain = float(per_frame[-1])
        return (samples * 10 ** (per_sample / 20)).clamp(-1.0, 1.0)

    def scores(self, samples: torch.Tensor, final: bool = False) -> torch.Tensor:
        audio = torch.cat([self.pending, self.lift(samples.float())])
        total = (self.windows * SILERO_WINDOW + audio.numel()) // self.hop  # frames these samples complete
        if final and audio.numel() % SILERO_WINDOW:
            audio = F.pad(audio, (0, SILERO_WINDOW - audio.numel() % SILERO_WINDOW))
        complete = audio.numel() // SILERO_WINDOW * SILERO_WINDOW
        self.pending = audio[complete:]
        with torch.no_grad():  # window by window: its state (and 64 samples of context) carry over
            new = torch.stack([self.model(w[None], SILERO_RATE)[0, 0] for w in audio[:complete].split(SILERO_WINDOW)]
                              ) if complete else audio[:0]
        probs = torch.cat([self.last, new])  # (windows,) from window self.windows - 1
        first, self.windows = self.windows - 1, self.windows + new.numel()
        self.last = probs[-1:]
        # Frames wholly inside scored windows; with `final`, every frame these samples complete.
        end = total if final else self.windows * SILERO_WINDOW // self.hop
        middles = (torch.arange(self.frames, end) * self.hop + self.hop // 2) // SILERO_WINDOW  # (frames,) windows
        self.frames = end
        return probs[middles - first]

    def speech(self, scores: torch.Tensor) -> torch.Tensor:
        speech = hysteresis(scores >= SILERO_ON, scores >= SILERO_OFF)
        for start, end in runs(speech):
            if end - start < round(SILERO_MIN_SPEECH / FRAME):
                speech[start:end] = False
        return without_blips(speech)


def detector_name(name: str, sample_rate: int) -> str:
    """The detector a name (DETECTORS) picks: "auto" is silero where Silero VAD is installed and the
    audio is at its 16 kHz (it keeps a music bed out of the segments: docs/REPORT.md, "Long recordings
    in rooms"), else energy."""
    if name not in DETECTORS:
        raise ValueError(f"unknown speech detector {name!r}: choose one of {', '.join(DETECTORS)}")
    if name != "auto":
        return name
    return "silero" if sample_rate == SILERO_RATE and importlib.util.find_spec("silero_vad") else "energy"


def speech_detector(name: str, sample_rate: int) -> EnergyDetector:
    """A detector by name (DETECTORS): a new one for each input, as its state follows the audio."""
    name = detector_name(name, sample_rate)
    return SileroDetector(sample_rate) if name == "silero" else EnergyDetector(sample_rate)
