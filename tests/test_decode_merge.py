"""aed/decode_timing.py's merge_chunks: the hypotheses of overlapping chunks, joined with every spoken word once.

The chunks here are built by hand from a known word sequence, with what really goes wrong at a
chunk's edges: a word cut by the chunk end comes out garbled or not at all, and a chunk that starts
inside a word hears a fragment of it. The last test runs the whole path on generated audio."""

import os
import random

import pytest
import soundfile as sf
import torch
from fixtures.make_word_model import load_clips, word_sequence

from aed.decode_timing import Chunk, MergeStats, Word, longest_common_run, merge_chunks
from aed.decode_transcribe import Request, plan_chunks, transcribe
from aed.model_checkpoint import load_model

WORD_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "word_model.pt")

TRUTH = "the red house by the water was green and blue every morning at seven near the table".split()
STEP = 0.5  # word k is spoken over [k * STEP, k * STEP + 0.4)
END = len(TRUTH) * STEP


def spoken(k: int, text: str | None = None) -> Word:
    return Word(text or TRUTH[k], k * STEP, k * STEP + 0.4, (k,))


def chunk(start: float, end: float, timed: bool = True, garble_edges: bool = True) -> Chunk:
    """What a chunk over [start, end) hears: the words inside it; a word cut by `end` garbled to its
    first two letters, a fragment ("uh") of the word `start` cuts into."""
    words = []
    for k in range(len(TRUTH)):
        w = spoken(k)
        if w.start >= start and w.end <= end:
            words.append(w)
        elif garble_edges and w.start < end < w.end:
            words.append(Word(w.text[:2], w.start, end, (100 + k,)))
        elif garble_edges and w.start < start < w.end:
            words.insert(0, Word("uh", start, w.end, (200 + k,)))
    return Chunk(start, end, words, timed)


def texts(words: list[Word]) -> list[str]:
    return [w.text for w in words]


def test_timed_chunks_keep_each_word_from_the_side_of_the_overlap_middle_it_lies_on():
    # Three chunks; cuts at 3.2 s (inside "was", word 6) and 6.1 s (inside "at", word 12)
    chunks = [chunk(0.0, 3.2), chunk(2.2, 6.1), chunk(5.1, END)]
    assert "wa" in texts(chunks[0].words) and chunks[1].words[0].text == "uh"  # the edges are wrong
    stats = MergeStats()
    merged = merge_chunks(chunks, stats)
    assert texts(merged) == TRUTH
    assert [w.ids for w in merged] == [(k,) for k in range(len(TRUTH))]
    assert all(a.end <= b.start for a, b in zip(merged, merged[1:]))  # in time order, each once
    assert stats.joins == 2 and stats.by_text == 0 and stats.estimated == 0


def test_untimed_chunks_are_joined_in_the_words_both_heard():
    # No times: the join is found in the text. Case and punctuation do not stop a match.
    chunks = [chunk(0.0, 3.2, timed=False), chunk(2.2, 6.1, timed=False), chunk(5.1, END, timed=False)]
    assert chunks[1].words[1].text == "water"
    chunks[1].words[1] = Word("Water,", 0.0, 0.0, (5,))
    for c in chunks:  # untimed chunks carry no times: only the text may be used
        c.words = [Word(w.text, 0.0, 0.0, w.ids) for w in c.words]
    stats = MergeStats()
    merged = merge_chunks(chunks, stats)
    assert [w.text.lower().strip(",") for w in merged] == TRUTH
    assert stats.by_text == 2 and stats.estimated == 0


def test_disagreeing_overlaps_fall_back_to_estimated_positions_and_are_counted():
    # The second chunk heard different words in the overlap: no common word, so the join falls at
    # the overlap's middle by evenly spread times (exact here, as the words are evenly spread).
    first = chunk(0.0, 4.0, timed=False, garble_edges=False)
    second = chunk(3.0, END, timed=False, garble_edges=False)
    second.words[:2] = [Word("bread", 0, 0, (300,)), Word("oven", 0, 0, (301,))]  # words 6 and 7 misheard
    stats = MergeStats()
    merged = merge_chunks([first, second], stats)
    assert stats.estimated == 1 and stats.by_text == 0
    assert texts(merged) == TRUTH[:7] + ["oven"] + TRUTH[8:]  # the middle, 3.5 s, lies between words 6 and 7


def test_chunks_that_do_not_overlap_are_concatenated():
    merged = merge_chunks([chunk(0.0, 3.0, garble_edges=False), chunk(3.0, END, garble_edges=False)])
    assert texts(merged) == TRUTH
    assert merge_chunks([]) == [] and merge_chunks([Chunk(0.0, 3.0, [], True)]) == []


def test_longest_common_run_prefers_the_run_nearest_the_overlap():
    assert longest_common_run(["a", "b", "c", "d"], ["c", "d", "e"]) == (2, 0, 2)
    assert longest_common_run(["x", "the", "y", "the"], ["the", "z"]) == (3, 0, 1)  # the later "the" in a
    assert longest_common_run(["a"], ["b"])[2] == 0


def test_words_at_a_timed_join_that_overlap_in_time_meet_halfway():
    # Chunk one heard "red" end at 1.6 s, chunk two heard "house" start at 1.4 s: times must stay ordered.
    first = Chunk(0.0, 2.0, [Word("the", 0.0, 0.4, (0,)), Word("red", 0.5, 1.6, (1,))], True)
    second = Chunk(1.0, 3.0, [Word("red", 1.0, 1.3, (1,)), Word("house", 1.4, 1.8, (2,)), Word("by", 1.9, 2.2, (3,))],
                   True)
    merged = merge_chunks([first, second])
    assert texts(merged) == ["the", "red", "house", "by"]
    assert merged[1].end == merged[2].start == pytest.approx(1.5)
    assert all(a.end <= b.start for a, b in zip(merged, merged[1:]))


def test_words_both_chunks_heard_in_an_overlap_are_kept_once(tmp_path, monkeypatch):
    """Through `transcribe`, with the committed word model (tests/fixtures/make_word_model.py): 40 words
    with short gaps between them, so most cuts are not at a pause: those joins overlap and are merged.
    Every word spoken inside an overlap that both chunks' hypotheses (as `transcribe` decoded them, in
    their batch) contain once is in the merged transcript exactly once, at its place in time: neither
    repeated (both chunks heard it) nor dropped (each chunk leaving it to the other). Words a chunk
    misses or doubles are the model's errors, not the merge's, and are not counted."""
    import aed.decode_transcribe
    asr = load_model(WORD_MODEL)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    clips = load_clips()
    words = [rng.choice(sorted(clips)) for _ in range(40)]
    wav, truth = word_sequence(clips, words, [rng.uniform(0.05, 0.1) for _ in words], 0.3, 1e-2, gen)
    path = str(tmp_path / "long.wav")
    sf.write(path, wav.numpy(), 16000, subtype="FLOAT")
    chunk = asr.max_train_duration
    overlap = chunk / 4
    decoded = []  # the chunks merge_chunks was given
    monkeypatch.setattr(aed.decode_transcribe, "merge_chunks",
                        lambda chunks, stats=None: decoded.extend(chunks) or merge_chunks(chunks, stats))
    (res,), _ = transcribe(asr, [path], pnc=False, chunk_overlap=overlap, timestamps=True)
    assert all(x.end <= y.start + 1e-6 for x, y in zip(res.words, res.words[1:]))
    _, chunks = plan_chunks(Request(path, "en", "en", False, "asr"), chunk, 16000, overlap)
    assert [(c.start, c.end) for c in decoded] == [(o, o + d) for o, d, _ in chunks]
    joins = [k for k in range(len(chunks) - 1) if chunks[k + 1][0] < chunks[k][0] + chunks[k][2]]  # overlapping
    assert len(joins) >= 4
    chunk_words = [c.words for c in decoded]  # each chunk's own hypothesis, times in the file

    def heard(hyp, word, a, b):
        return [w.text for w in hyp if a <= (w.start + w.end) / 2 <= b] == [word]

    checked = 0
    for k in joins:
        start, end = chunks[k + 1][0], chunks[k][0] + chunks[k][2]  # the overlap of chunks k and k + 1
        for word, a, b in truth:
            if start <= a and b <= end and heard(chunk_words[k], word, a, b) and heard(chunk_words[k + 1], word, a, b):
                assert heard(res.words, word, a, b), f"{word!r} at {a:.2f}-{b:.2f} s: " + str(
                    [w.text for w in res.words if a <= (w.start + w.end) / 2 <= b])
                checked += 1
    assert checked >= len(joins)  # about two words per overlap
