"""Time in the audio: where the speech and its pauses are, long audio cut at them into segments a
model can decode, the words of a hypothesis timed by force-aligning them to the CTC head's frame
posteriors, and the hypotheses of overlapping segments joined back by those times.

    cuts = plan_segments(frame_db(wav, sample_rate), limit=20.0)   # long audio -> segments at its pauses
    spans = align(log_probs[b, :enc_lens[b]], ids, blank=model.ctc.blank)   # one (start, end) frame span per id
    words = to_words(tokenizer, ids, spans, frame_seconds(features, model.cfg.subsampling_factor), offset=chunk_start)
    segments = to_segments(words)
    open("a.srt", "w").write(srt(segments))    # or webvtt(words) for one cue per word

## Long audio

An attention decoder trained on utterances of a few seconds transcribes such an utterance well and a
stretch that starts or ends inside a word, or holds several utterances, badly. So a long file is cut
where its speaker paused, as a recording is cut into the utterances a corpus trains on:

1. Speech: 10 ms frames judged by their energy over the room's floor around them
   (`aed.data_speech.is_speech`), or by another detector's scores (`aed.data_speech.speech_detector`).
   A gap in the speech shorter than PAUSE is part of it (a stop consonant, a breath between words).
2. Segments: every pause of at least PAUSE ends one. A stretch of speech longer than the segment
   limit (the longest utterance the model was trained on) is split at its longest inner gap, then the
   longer of the two parts again, ...; a stretch with no gap at all is cut at its quietest 100 ms in
   the last quarter of the limit (that cut may split a word). Where a cut is not at a pause, with an
   overlap the next segment starts that much earlier so that `merge_chunks` can join the two.
   With `merge` (infer.py --merge-segments), stretches whose pause is no longer than the silence the
   model heard around an utterance (the two edges below together) are one stretch first, so a
   speaker's hesitations stay inside a segment, which grows up to the limit and is split at its
   longest pauses. Measured neutral on the laptop recipe's model (docs/inference.md), so off by default.
3. Edges: each segment keeps some of its pauses' silence before and after its speech
   (`segment_edges`). A model trained with varied edges (augment.edge_prob) gets a generous margin,
   the middle of the silence it heard at its utterances' edges; one trained on its utterances as
   read gets as much as they held (`edge_silence`, measured when training starts and kept in the
   checkpoint; EDGE where it is not known), as such a model mishears segments with more
   (docs/inference.md, "Long audio"). Longer silence is not decoded at all, and a file without
   speech has no segments (its text is empty).

4. Joining: where segments overlap (a cut inside continuous speech, with an overlap), the words
   spoken in the overlap are in both hypotheses, and the words at a chunk's edges (cut mid-word, or
   heard without context) are the least reliable. Each join keeps chunk i's words up to the middle
   of the overlap and chunk i + 1's from there on, the middle being as far as possible from both
   edges (`merge_chunks`):

       words = merge_chunks([Chunk(0.0, 10.0, words_a, timed=True), Chunk(8.0, 18.0, words_b, timed=True)])

   - Timed words (the model has a CTC head: `align` times every chunk's words): by time.
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

## Word timestamps

Why CTC: the attention decoder has no notion of time (its cross-attention is free to look
anywhere), but the CTC head on the encoder (model.ctc, trained when model.ctc_loss_weight > 0) scores
every encoder frame (80 ms at Canary's 8x subsampling) against the same token ids. Viterbi forced alignment
(torchaudio.functional.forced_align) finds the most likely CTC path that emits exactly the
hypothesis' tokens, so the AED's text gets the CTC head's timing without being changed.

A model without a CTC head (model.ctc_loss_weight = 0, and the released Canary checkpoints) has no frame
posteriors to align to: asking it for timestamps is an error, raised before any audio is decoded
(`aed.decode_transcribe.transcribe`), not a silent guess.

Precision. A token's CTC span is where the Viterbi path puts it, and CTC's loss does not reward
firing inside the sound: a span may start in the pause before its word (a small model put its
first word at frame 0 wherever it was spoken) or end before the word does. So word times are
taken from the span's pieces that carry sound (not a bare "▁"), then moved to the edges of the
stretch of speech the span overlaps (`snap_to_speech`: 10 ms frames 10 dB above the noise floor
around them, `aed.data_speech.is_speech`), never past the neighbouring words. In a chunk without
any pause the floor is the speech's own quietest moments: its words shrink toward their loudest
frames, inside the same limits. Measured with bench/long_audio_bench.py on 60 generated files of the word
clips with pauses (tests/fixtures/make_word_model.py's model, 58 transcribed right, 146 words): CTC spans
alone median |error| 75 ms at starts / 76 ms at ends (largest 160 / 184 ms); snapped 3 / 3 ms
(largest 8 / 64 ms). tests/test_decode_timestamps.py asserts medians under 20 ms and every error under
80 ms (one encoder frame) on ten such files. Between words spoken without a pause, the boundary
is the CTC alignment's, with its 80 ms resolution.
"""

import re
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from aed.data_audio import FeatureConfig
from aed.data_speech import FRAME, EnergyDetector, is_speech, runs
from aed.data_tokenizer import Tokenizer
from aed.model import ctc_spans

PAUSE = 0.25  # seconds of non-speech that end a segment: between-word gaps are shorter, sentence ends longer
EDGE = 0.2  # seconds of silence kept before and after a segment's speech, for a model that does not
# record the silence its training utterances held (`edge_silence`)
EDGE_SAMPLE = 100  # training utterances whose edges are measured
QUIET_WINDOW = 0.1  # seconds of audio whose mean energy is compared when continuous speech must be cut
CUT_SEARCH = 0.25  # ... searched for in the last quarter of the segment limit
SENTENCE_END = (".", "!", "?", "。", "？", "！")  # a segment ends after a word ending with one of these
SEGMENT_PAUSE = 1.0  # ... or before a pause this long (s): unpunctuated output still gets cues
SEGMENT_MAX = 7.0  # ... or before it would exceed this many seconds (a subtitle line's usual limit)


# --- speech, pauses and segments -----------------------------------------------------------


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


def split_stretch(stretch: list[tuple[int, int]], db: torch.Tensor, limit: int,
                  pause: int) -> list[tuple[int, int, str]]:
    """One stretch of speech (its runs) -> (start, end, what follows) pieces of at most `limit` frames:
    split at the longest gap between its runs, recursively; a single run longer than the limit is cut
    at its quietest point in the last quarter of each piece. What follows a piece: "pause" (the
    stretch's end, or a gap of at least `pause` frames), "gap" (a shorter gap) or "speech" (a cut
    inside a run)."""
    start, end = stretch[0][0], stretch[-1][1]
    if end - start <= limit:
        return [(start, end, "pause")]
    if len(stretch) > 1:
        gaps = [stretch[i + 1][0] - stretch[i][1] for i in range(len(stretch) - 1)]
        k = max(range(len(gaps)), key=lambda i: gaps[i]) + 1
        head = split_stretch(stretch[:k], db, limit, pause)
        follows = "pause" if gaps[k - 1] >= pause else "gap"
        return head[:-1] + [head[-1][:2] + (follows,)] + split_stretch(stretch[k:], db, limit, pause)
    pieces = []
    while end - start > limit:
        cut = quietest(db, start + round((1 - CUT_SEARCH) * limit), start + limit)
        pieces.append((start, cut, "speech"))
        start = cut
    return pieces + [(start, end, "pause")]


def segment_edges(loaded) -> tuple[float, float]:
    """Seconds of silence a segment of long audio, or a stream's sentence, keeps before and after its
    speech, for `loaded` (aed.model_checkpoint.LoadedModel). A model trained on varied edges heard
    from none to its utterances' own silence plus the most augment added there: the middle of that
    range, a margin wide enough for a faint onset or a fading word. A model trained on its
    utterances as read: as much silence as they held, EDGE where that was not recorded."""
    own = loaded.edge_silence or (EDGE, EDGE)
    if loaded.varied_edges is None:
        return own
    most = max(0.0, loaded.varied_edges[1])
    return (own[0] + most) / 2, (own[1] + most) / 2


def longest_segment(loaded) -> float | None:
    """Seconds of the longest segment (speech and its `segment_edges` silence) for `loaded`: its
    longest training utterance as read; for a model trained with varied edges, that utterance's speech
    with the wider margins around it, which training heard as added silence. (Held to the training
    length with those margins, a segment's speech is shorter than its utterances' and the longest of
    them are split inside.) None where the training length was not recorded."""
    if loaded.max_train_duration is None:
        return None
    own, given = loaded.edge_silence or (EDGE, EDGE), segment_edges(loaded)
    return loaded.max_train_duration + max(0.0, given[0] - own[0]) + max(0.0, given[1] - own[1])


def plan_segments(db: torch.Tensor, limit: float, pause: float = PAUSE,
                  edges: tuple[float, float] = (EDGE, EDGE), detector: EnergyDetector | None = None,
                  merge: bool = False) -> list[Cut]:
    """Frame energies (frames,) of a whole input, or the scores of another `detector` (higher: more
    like speech) -> its segments (`Cut`s, in seconds), each at most `limit` s of speech plus the
    silence `edges` (before, after) at its edges (see the module docstring). With `merge`, stretches
    of speech whose pause the model heard inside its training utterances' edges (at most the two
    edges together) are joined up to `limit` and split at their longest pauses."""
    speech = is_speech(db) if detector is None else detector.speech(db)
    lead, trail = round(edges[0] / FRAME), round(edges[1] / FRAME)
    limit_frames = max(1, round(limit / FRAME) - lead - trail)
    joined = max(pause, (lead + trail + 1) * FRAME) if merge else pause  # pauses inside a stretch
    pieces = [p for stretch in speech_runs(speech, joined)
              for p in split_stretch(stretch, db, limit_frames, round(pause / FRAME))]
    cuts, n = [], db.numel()
    for k, (start, end, follows) in enumerate(pieces):
        # Half of a pause goes to each side; the file's own edges bound the rest.
        before = (pieces[k - 1][1] + start) // 2 if k else 0
        after = (end + pieces[k + 1][0]) // 2 if k + 1 < len(pieces) else n
        joined_before = k and pieces[k - 1][2] == "speech"  # a cut inside a run of speech: no silence to add
        lo = start if joined_before else max(start - lead, before)
        hi = min(end + trail, after) if follows != "speech" else end
        cuts.append(Cut(lo * FRAME, hi * FRAME, follows == "pause"))
    return cuts


@dataclass
class Word:
    text: str
    start: float  # seconds from the start of the file
    end: float
    ids: tuple[int, ...] = ()  # its token ids (not written out)

    def to_json(self) -> dict:
        return {"text": self.text, "start": round(self.start, 3), "end": round(self.end, 3)}


@dataclass
class Segment:
    words: list[Word]

    @property
    def text(self) -> str:
        return " ".join(w.text for w in self.words)

    @property
    def start(self) -> float:
        return self.words[0].start

    @property
    def end(self) -> float:
        return self.words[-1].end

    def to_json(self, with_words: bool = True) -> dict:
        out = {"text": self.text, "start": round(self.start, 3), "end": round(self.end, 3)}
        return out | ({"words": [w.to_json() for w in self.words]} if with_words else {})


def frame_seconds(features: FeatureConfig, subsampling_factor: int) -> float:
    """Seconds per encoder frame: the feature hop times the subsampling factor."""
    return features.hop_length * subsampling_factor / features.sample_rate


# --- alignment --------------------------------------------------------------------------------


def feasible(num_frames: int, ids: list[int]) -> bool:
    """A CTC path needs one frame per token plus a blank between each repeated pair."""
    repeats = sum(a == b for a, b in zip(ids, ids[1:]))
    return num_frames >= len(ids) + repeats


def align(log_probs: torch.Tensor, ids: list[int], blank: int) -> list[tuple[int, int]]:
    """log_probs (T', V) of one utterance (its valid frames only), token ids -> one [start, end)
    frame span per id, in order. Ids must lie below `blank`.

    When the hypothesis is longer than any CTC path through T' frames allows (`feasible`: a
    hallucinating decoder, or speech faster than one token per frame), the tokens are spread
    evenly over the frames instead: times are then approximate, and the caller says so.
    """
    if not ids:
        return []
    T = log_probs.shape[0]
    if not feasible(T, ids):
        edges = [round(i * T / len(ids)) for i in range(len(ids) + 1)]
        return [(a, max(b, a + 1)) for a, b in zip(edges, edges[1:])]
    return ctc_spans(log_probs, ids, blank)


# --- words and segments -----------------------------------------------------------------------


def word_spans(tokenizer: Tokenizer, ids: list[int]) -> list[tuple[int, int]]:
    """Token ids -> [first, end) index range of each word: a word starts at a SentencePiece piece
    with the word-start marker "▁" (or at the first token)."""
    starts = [i for i, t in enumerate(ids) if i == 0 or tokenizer.id_to_token(t).startswith("▁")]
    return list(zip(starts, starts[1:] + [len(ids)]))


def to_words(tokenizer: Tokenizer, ids: list[int], spans: list[tuple[int, int]] | None, encoder_frame_s: float,
             offset: float = 0.0) -> list[Word]:
    """Tokens and their encoder-frame spans -> words with times in seconds (`offset` added: the
    chunk's start in its file); spans None: untimed words (times 0). A word's time is that of its
    pieces other than a bare "▁": that piece only marks the word boundary, has no sound of its own,
    and CTC may emit it anywhere in the pause before the word."""
    assert spans is None or len(spans) == len(ids), f"{len(spans)} spans for {len(ids)} tokens"
    words = []
    for a, b in word_spans(tokenizer, ids):
        sounding = [i for i in range(a, b) if tokenizer.id_to_token(ids[i]) != "▁"] or [a, b - 1]
        first, last = sounding[0], sounding[-1]
        start, end = (offset + spans[first][0] * encoder_frame_s, offset + spans[last][1] * encoder_frame_s) \
            if spans else (0.0, 0.0)
        words.append(Word(tokenizer.decode(ids[a:b]).strip(), start, end, tuple(ids[a:b])))
    return [w for w in words if w.text]  # a lone "▁" piece decodes to nothing


def snap_to_speech(words: list[Word], speech: torch.Tensor, offset: float) -> list[Word]:
    """Each word's times moved to the edges of its sound: from the first and last speech frame
    (`speech_frames`, of the chunk that starts at `offset` s) inside its aligned span, out to where
    that stretch of speech begins and ends, but not past the previous word's (new) end or the next
    word's aligned start. A word whose span holds no speech is left as it is.
    Why: CTC emits a token on any frame between its neighbours' (peaky, often early: a first word
    from frame 0), so a span may cover a pause before the word and stop before the word ends; the
    audio says where the sound is."""
    out, n = [], speech.numel()
    for k, w in enumerate(words):
        lo, hi = round((w.start - offset) * 100), min(round((w.end - offset) * 100), n)
        inside = speech[lo:hi].nonzero().flatten() if lo < hi else speech[:0]
        if inside.numel():
            floor = round((out[-1].end - offset) * 100) if out else 0
            ceiling = min(round((words[k + 1].start - offset) * 100), n) if k + 1 < len(words) else n
            first, last = lo + int(inside[0]), lo + int(inside[-1])
            while first - 1 >= floor and speech[first - 1]:
                first -= 1
            while last + 1 < ceiling and speech[last + 1]:
                last += 1
            w = Word(w.text, offset + first / 100, offset + (last + 1) / 100, w.ids)
        out.append(w)
    return out


def to_segments(words: list[Word]) -> list[Segment]:
    """Words -> subtitle-sized segments: a new one after a sentence end, at a pause of
    SEGMENT_PAUSE, or where the current one would grow past SEGMENT_MAX seconds."""
    segments = []
    for w in words:
        if (not segments or segments[-1].words[-1].text.endswith(SENTENCE_END)
                or w.start - segments[-1].end >= SEGMENT_PAUSE or w.end - segments[-1].start > SEGMENT_MAX):
            segments.append(Segment([w]))
        else:
            segments[-1].words.append(w)
    return segments


# --- subtitle files ---------------------------------------------------------------------------


def _clock(seconds: float, decimal: str) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{decimal}{ms % 1000:03d}"


def srt(cues: list[Word] | list[Segment]) -> str:
    """SubRip: numbered cues, `HH:MM:SS,mmm --> HH:MM:SS,mmm`, blank line after each."""
    return "".join(f"{n}\n{_clock(c.start, ',')} --> {_clock(c.end, ',')}\n{c.text}\n\n"
                   for n, c in enumerate(cues, 1))


def webvtt(cues: list[Word] | list[Segment]) -> str:
    """WebVTT: a `WEBVTT` header, then cues with `HH:MM:SS.mmm` times."""
    return "WEBVTT\n\n" + "".join(f"{_clock(c.start, '.')} --> {_clock(c.end, '.')}\n{c.text}\n\n" for c in cues)


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
