"""Word and segment timestamps: a hypothesis force-aligned to the CTC head's frame posteriors.

    spans = align(log_probs[b, :enc_lens[b]], ids, blank=model.ctc.blank)   # one (start, end) frame span per id
    words = to_words(tokenizer, ids, spans, frame_seconds(features, model.cfg.subsampling_factor), offset=chunk_start)
    segments = to_segments(words)
    open("a.srt", "w").write(srt(segments))    # or webvtt(words) for one cue per word

Why CTC: the attention decoder has no notion of time (its cross-attention is free to look
anywhere), but the CTC head on the encoder (model.ctc, trained when model.ctc_weight > 0) scores
every encoder frame (80 ms at Canary's 8x subsampling) against the same token ids. Viterbi forced alignment
(torchaudio.functional.forced_align) finds the most likely CTC path that emits exactly the
hypothesis' tokens, so the AED's text gets the CTC head's timing without being changed.

A model without a CTC head (ctc_weight = 0, and the released Canary checkpoints) has no frame
posteriors to align to: asking it for timestamps is an error, raised before any audio is decoded
(`aed.decode_transcribe.transcribe`), not a silent guess.

Precision. A token's CTC span is where the Viterbi path puts it, and CTC's loss does not reward
firing inside the sound: a span may start in the pause before its word (a small model put its
first word at frame 0 wherever it was spoken) or end before the word does. So word times are
taken from the span's pieces that carry sound (not a bare "▁"), then moved to the edges of the
stretch of speech the span overlaps (`snap_to_speech`: 10 ms frames 10 dB above the chunk's
noise floor, its quietest tenth), never past the neighbouring words. A chunk without any pause
has no floor to measure (its quietest tenth is speech): its words shrink toward their loudest
frames, inside the same limits. Measured with bench/long_audio_bench.py on 60 generated files of the word
clips with pauses (tests/fixtures/make_word_model.py's model, 58 transcribed right, 146 words): CTC spans
alone median |error| 75 ms at starts / 76 ms at ends (largest 160 / 184 ms); snapped 3 / 3 ms
(largest 19 / 11 ms). tests/test_decode_timestamps.py asserts medians under 20 ms and every error under
80 ms (one encoder frame) on ten such files. Between words spoken without a pause, the boundary
is the CTC alignment's, with its 80 ms resolution.
"""

from dataclasses import dataclass

import torch

from aed.data_audio import FeatureConfig
from aed.data_tokenizer import Tokenizer
from aed.model import ctc_spans

SENTENCE_END = (".", "!", "?", "。", "？", "！")  # a segment ends after a word ending with one of these
SEGMENT_PAUSE = 1.0  # ... or before a pause this long (s): unpunctuated output still gets cues
SEGMENT_MAX = 7.0  # ... or before it would exceed this many seconds (a subtitle line's usual limit)


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
    (`aed.decode_segment.speech_frames`, of the chunk that starts at `offset` s) inside its aligned span, out to where
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
