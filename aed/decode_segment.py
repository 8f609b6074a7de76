"""Long audio: where the speech is, the audio cut at its pauses into segments a model can decode,
and the hypotheses of overlapping segments joined back.

An attention decoder trained on utterances of a few seconds transcribes such an utterance well and a
stretch that starts or ends inside a word, or holds several utterances, badly. So a long file is cut
where its speaker paused, as a recording is cut into the utterances a corpus trains on:

1. Speech: a 10 ms frame is speech when its energy is SPEECH_ABOVE_FLOOR_DB above the audio's noise
   floor (its 10th-percentile frame) and within SPEECH_RANGE_DB of its loudest frame, or within
   SPEECH_NEAR_PEAK_DB of that whatever the floor, and never below SILENCE_DBFS (`is_speech`).
   A gap in the speech shorter than PAUSE is part of it (a stop consonant, a breath between words).
2. Segments: every pause of at least PAUSE ends one. A stretch of speech longer than the segment
   limit (the longest utterance the model was trained on) is split at its longest inner gap, then the
   longer of the two parts again, ...; a stretch with no gap at all is cut at its quietest 100 ms in
   the last quarter of the limit (that cut may split a word). Where a cut is not at a pause, with an
   overlap the next segment starts that much earlier so that `merge_chunks` can join the two.
3. Edges: each segment keeps as much of its pauses' silence before and after its speech as the
   model's training utterances held (`edge_silence`, measured when training starts and kept in the
   checkpoint; EDGE where it is not known): a model trained on utterances with little silence at
   their edges mishears segments with more (docs/inference.md, "Long audio"). Longer silence is not
   decoded at all, and a file without speech has no segments (its text is empty).

4. Joining: where segments overlap (a cut inside continuous speech, with an overlap), the words
   spoken in the overlap are in both hypotheses, and the words at a chunk's edges (cut mid-word, or
   heard without context) are the least reliable. Each join keeps chunk i's words up to the middle
   of the overlap and chunk i + 1's from there on, the middle being as far as possible from both
   edges (`merge_chunks`):

       words = merge_chunks([Chunk(0.0, 10.0, words_a, timed=True), Chunk(8.0, 18.0, words_b, timed=True)])

   - Timed words (the model has a CTC head: `aed.decode_timestamps` aligns every chunk): by time.
     A word belongs to the chunk on whose side of the middle its centre lies, so a word both chunks
     heard at about the same time is kept once, whatever else the two hypotheses disagree on; only
     a word the two chunks time on opposite sides of the middle could be lost or repeated. Where
     the two words at the join overlap in time, they meet halfway, so times stay ordered.
   - Untimed words (no CTC head): by text. The longest run of words (compared lower-cased, without
     punctuation) that ends chunk i's overlap region and starts chunk i + 1's is the overlap both
     heard; the join falls at its middle word. This is the word-level form of the longest-common-
     subsequence merge of buffered decoding. When the two share no word there (a model that
     misheard either side), the words' times are estimated by spreading each chunk's words evenly
     over it and the join falls at the middle by those estimates: approximate, and counted
     (`MergeStats.estimated`), so the caller can say so.

The streams of aed/decode_stream.py end their sentences at the same pauses (`Streamer.window`).
"""

import math
import re
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from aed.decode_timestamps import Word

FRAME = 0.01  # seconds per energy frame
SPEECH_ABOVE_FLOOR_DB = 10.0  # a 10 ms frame is speech this much above the noise floor ...
SPEECH_RANGE_DB = 40.0  # ... and within this much of the loudest frame;
SPEECH_NEAR_PEAK_DB = 15.0  # a frame this close to the loudest is speech whatever the floor: audio with
# no quiet part (continuous speech, music) has a floor of speech, and must not come out as all pause
SILENCE_DBFS = -80.0  # a frame quieter than this is never speech (digital silence, 16-bit dither)
PAUSE = 0.25  # seconds of non-speech that end a segment: between-word gaps are shorter, sentence ends longer
EDGE = 0.2  # seconds of silence kept before and after a segment's speech, for a model that does not
# record the silence its training utterances held (`edge_silence`)
EDGE_SAMPLE = 100  # training utterances whose edges are measured
QUIET_WINDOW = 0.1  # seconds of audio whose mean energy is compared when continuous speech must be cut
CUT_SEARCH = 0.25  # ... searched for in the last quarter of the segment limit


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


def speech_runs(speech: torch.Tensor, pause: float = PAUSE) -> list[list[tuple[int, int]]]:
    """The stretches of speech between pauses of at least `pause` s: each a list of its speech runs
    (start, end frames), whose gaps are shorter than the pause."""
    stretches = []
    for start, end in runs(speech):
        if stretches and start - stretches[-1][-1][1] < round(pause / FRAME):
            stretches[-1].append((start, end))
        else:
            stretches.append([(start, end)])
    return stretches


@dataclass(frozen=True)
class Cut:
    """A segment of a long input, in seconds from its start."""

    start: float
    end: float
    pause_after: bool  # it ends in a pause (or at the end); False: a cut inside continuous speech (at a
    # gap between words shorter than a pause, or inside a word)


def quietest(db: torch.Tensor, lo: int, hi: int) -> int:
    """The middle frame of the quietest QUIET_WINDOW within frames [lo, hi) (the middle of a tie:
    digital silence)."""
    window = round(QUIET_WINDOW / FRAME)
    if hi - lo < window:
        return hi
    smooth = F.avg_pool1d(db[lo:hi][None, None], window, stride=1)[0, 0]  # (hi - lo - window + 1,)
    first = int(smooth.argmin())
    last = first
    while last + 1 < smooth.numel() and smooth[last + 1] == smooth[first]:
        last += 1
    return lo + (first + last) // 2 + window // 2


def split_stretch(stretch: list[tuple[int, int]], db: torch.Tensor, limit: int) -> list[tuple[int, int, str]]:
    """One stretch of speech (its runs) -> (start, end, what follows) pieces of at most `limit` frames:
    split at the longest gap between its runs, recursively; a single run longer than the limit is cut
    at its quietest point in the last quarter of each piece. What follows a piece: "pause" (the
    stretch's end), "gap" (a gap inside it) or "speech" (a cut inside a run)."""
    start, end = stretch[0][0], stretch[-1][1]
    if end - start <= limit:
        return [(start, end, "pause")]
    if len(stretch) > 1:
        gaps = [stretch[i + 1][0] - stretch[i][1] for i in range(len(stretch) - 1)]
        k = max(range(len(gaps)), key=lambda i: gaps[i]) + 1
        head = split_stretch(stretch[:k], db, limit)
        return head[:-1] + [head[-1][:2] + ("gap",)] + split_stretch(stretch[k:], db, limit)
    pieces = []
    while end - start > limit:
        cut = quietest(db, start + round((1 - CUT_SEARCH) * limit), start + limit)
        pieces.append((start, cut, "speech"))
        start = cut
    return pieces + [(start, end, "pause")]


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


def plan_segments(db: torch.Tensor, limit: float, pause: float = PAUSE,
                  edges: tuple[float, float] = (EDGE, EDGE)) -> list[Cut]:
    """Frame energies (frames,) of a whole input -> its segments (`Cut`s, in seconds), each at most
    `limit` s of speech plus the silence `edges` (before, after) at its edges (see the module docstring)."""
    speech = is_speech(db)
    lead, trail = round(edges[0] / FRAME), round(edges[1] / FRAME)
    limit_frames = max(1, round(limit / FRAME) - lead - trail)
    pieces = [p for stretch in speech_runs(speech, pause) for p in split_stretch(stretch, db, limit_frames)]
    cuts, n = [], db.numel()
    for k, (start, end, follows) in enumerate(pieces):
        # Half of a pause goes to each side; the file's own edges bound the rest.
        before = (pieces[k - 1][1] + start) // 2 if k else 0
        after = (end + pieces[k + 1][0]) // 2 if k + 1 < len(pieces) else n
        joined_before = k and pieces[k - 1][2] == "speech"  # a cut inside a run of speech: no silence to add
        in_gap = follows != "speech"
        first, last = own_edges(db, start if joined_before else before, after if in_gap else end, start, end)
        if last - first <= limit_frames:  # judged on its own, the speech may reach a little further
            start, end = start if joined_before else first, last if in_gap else end
        lo = start if joined_before else max(start - lead, before)
        hi = min(end + trail, after) if in_gap else end
        cuts.append(Cut(lo * FRAME, hi * FRAME, follows == "pause"))
    return cuts


def own_edges(db: torch.Tensor, lo: int, hi: int, start: int, end: int) -> tuple[int, int]:
    """The first and last speech frame + 1 of frames [lo, hi) judged on their own, as `edge_silence`
    judges a training utterance (a file's loudest frame moves the threshold, and with it where a
    fading word ends); (start, end) where that finds no speech."""
    spoken = is_speech(db[lo:hi]).nonzero().flatten()
    return (lo + int(spoken[0]), lo + int(spoken[-1]) + 1) if spoken.numel() else (start, end)


# --- joining overlapping chunks ---------------------------------------------------------------

NON_WORD = re.compile(r"[^\w']+")


@dataclass
class Chunk:
    start: float  # seconds in the file
    end: float
    words: list[Word]  # in order; untimed: start/end ignored
    timed: bool


@dataclass
class MergeStats:
    joins: int = 0  # joins of overlapping chunks
    by_text: int = 0  # placed by matching words
    estimated: int = 0  # placed by evenly spread word times (no common word in the overlap)


def spread(chunk: Chunk) -> list[Word]:
    """The chunk's words with times spread evenly over it: the estimate for a chunk without alignments."""
    n, length = len(chunk.words), chunk.end - chunk.start
    return [Word(w.text, chunk.start + k * length / n, chunk.start + (k + 1) * length / n, w.ids)
            for k, w in enumerate(chunk.words)]


def _key(word: Word) -> str:
    return NON_WORD.sub("", word.text.lower()) or word.text


def longest_common_run(a: list[str], b: list[str]) -> tuple[int, int, int]:
    """(i, j, n): a[i:i+n] == b[j:j+n] with n as large as possible; among equally long runs the one
    nearest a's end and b's start (where an overlap lies); n = 0 when they share no word."""
    best, best_key = (0, 0, 0), (0, 0)
    run = [0] * (len(b) + 1)  # run[j + 1]: length of the common run ending at a[i - 1], b[j]
    for i in range(len(a)):
        new = [0] * (len(b) + 1)
        for j in range(len(b)):
            if a[i] == b[j]:
                n = new[j + 1] = run[j] + 1
                key = (n, (i - n + 1) - (j - n + 1))
                if key > best_key:
                    best, best_key = (i - n + 1, j - n + 1, n), key
        run = new
    return best


def _centre(w: Word) -> float:
    return (w.start + w.end) / 2


def merge_chunks(chunks: list[Chunk], stats: MergeStats | None = None) -> list[Word]:
    """Consecutive chunks of one file (chunk i + 1 may start before chunk i ends) -> their words,
    each spoken word once, in order. Words keep their times when timed (estimated ones are not
    returned: untimed input gives untimed output, the words as the chunks had them)."""
    stats = stats if stats is not None else MergeStats()
    out: list[Word] = []  # words kept so far, with (possibly estimated) times
    originals: list[Word] = []  # the same words as the chunks gave them
    for k, chunk in enumerate(chunks):
        words = chunk.words if chunk.timed else spread(chunk)
        if k == 0 or chunk.start >= chunks[k - 1].end:
            out, originals = out + words, originals + chunk.words
            continue
        prev = chunks[k - 1]
        middle = (chunk.start + prev.end) / 2
        stats.joins += 1
        cut_out, cut_new = None, None
        if not (chunk.timed and prev.timed):
            # The overlap regions, with a margin of one overlap for speech that is not evenly spread.
            margin = prev.end - chunk.start
            tail = [i for i, w in enumerate(out) if _centre(w) >= chunk.start - margin]
            head = [j for j, w in enumerate(words) if _centre(w) < prev.end + margin]
            if tail and head:
                i, j, n = longest_common_run([_key(out[i]) for i in tail], [_key(words[j]) for j in head])
                if n:
                    cut_out, cut_new = tail[0] + i + n // 2, head[0] + j + n // 2
                    stats.by_text += 1
            if cut_out is None:
                stats.estimated += 1
        if cut_out is None:
            cut_out = sum(_centre(w) < middle for w in out)  # words are in time order
            cut_new = sum(_centre(w) < middle for w in words)
        if 0 < cut_out and cut_new < len(words) and out[cut_out - 1].end > words[cut_new].start:
            # The two chunks placed the words at the join a little differently: they meet halfway.
            a, b = out[cut_out - 1], words[cut_new]
            t = min(max((a.end + b.start) / 2, a.start), b.end)
            out[cut_out - 1], words = replace(a, end=t), words[:cut_new] + [replace(b, start=t)] + words[cut_new + 1:]
        out, originals = out[:cut_out] + words[cut_new:], originals[:cut_out] + chunk.words[cut_new:]
    return out if all(c.timed for c in chunks) else originals
