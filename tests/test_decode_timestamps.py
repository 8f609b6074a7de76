"""aed/decode_timing.py and `transcribe(timestamps=True)`: forced alignment, words, segments, subtitles."""

import dataclasses
import json
import os
import random

import pytest
import soundfile as sf
import torch
from fixtures.make_word_model import load_clips, word_sequence
from test_train import run_in_process

from aed import cli_infer
from aed.data_audio import FeatureConfig, load_audio
from aed.data_tokenizer import Tokenizer
from aed.decode_search import DecodingOptions
from aed.data_speech import speech_frames
from aed.decode_timing import Segment, Word, align, frame_seconds, snap_to_speech, srt, to_segments, to_words, webvtt
from aed.decode_transcribe import Request, plan_chunks, transcribe
from aed.model import AED, AEDConfig
from aed.model_checkpoint import load_model, pack_dir
from aed.train_checkpoint import save_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINI = os.path.join(ROOT, "data", "mini")
WORDS = os.path.join(ROOT, "tests", "fixtures", "words")  # tests/fixtures/make_word_clips.py
WORD_MODEL = os.path.join(ROOT, "tests", "fixtures", "word_model.pt")  # tests/fixtures/make_word_model.py


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.load(os.path.join(MINI, "tokenizer"))


def peaky(T: int, V: int, fires: dict[int, int], blank: int) -> torch.Tensor:
    """(T, V) log-probs: blank everywhere except token fires[t] at frame t, each nearly certain."""
    logits = torch.full((T, V), -10.0)
    logits[:, blank] = 0.0
    for t, token in fires.items():
        logits[t, token] = 5.0
    return logits.log_softmax(-1)


# --- alignment, words, segments, formats ------------------------------------------------------


def test_align_finds_the_frames_where_each_token_fires():
    fires = {3: 7, 4: 7, 9: 2, 12: 7}  # 7 held for two frames, then 2, then 7 again
    spans = align(peaky(16, 10, fires, blank=9), [7, 2, 7], blank=9)
    assert spans == [(3, 5), (9, 10), (12, 13)]
    assert align(peaky(16, 10, {}, blank=9), [], blank=9) == []


def test_a_hypothesis_too_long_for_its_frames_is_spread_evenly():
    spans = align(peaky(4, 10, {}, blank=9), [1, 2, 3, 4, 5, 6], blank=9)  # 6 tokens, 4 frames
    assert len(spans) == 6 and spans[0][0] == 0 and spans[-1][1] == 4
    assert all(a < b for a, b in spans) and all(s[0] <= t[0] for s, t in zip(spans, spans[1:]))


def test_words_start_at_word_marked_pieces_and_carry_the_offset(tokenizer):
    ids = tokenizer.encode("red morning", "en")  # ▁ re d ▁m or n ing
    assert len(ids) == 7
    spans = [(2, 3), (3, 4), (4, 5), (10, 11), (11, 12), (12, 13), (13, 15)]
    words = to_words(tokenizer, ids, spans, encoder_frame_s=0.08, offset=30.0)
    assert [w.text for w in words] == ["red", "morning"]
    # "red" starts at "re" (frame 3), not at the bare "▁" before it: that piece has no sound.
    assert [(w.start, w.end) for w in words] == [pytest.approx((30.24, 30.4)), pytest.approx((30.8, 31.2))]
    assert frame_seconds(FeatureConfig(), 8) == pytest.approx(0.08)
    assert frame_seconds(FeatureConfig(), 4) == pytest.approx(0.04)


def test_word_times_move_to_the_edges_of_the_speech_in_their_span():
    # 0.5 s of a noise floor, a 0.3 s tone, 0.5 s of the floor: a span over all of it (CTC's first
    # token at frame 0) shrinks to the tone; a span holding no speech is left as it was.
    g = torch.Generator().manual_seed(0)
    floor = lambda s: 1e-3 * torch.randn(int(s * 16000), generator=g)  # noqa: E731
    tone = 0.3 * torch.sin(torch.arange(4800) * 2 * torch.pi * 440 / 16000)
    wav = torch.cat([floor(0.5), tone + floor(0.3), floor(0.5)])
    speech = speech_frames(wav, 16000)
    assert speech.numel() == 130 and speech[50:80].all() and not speech[:50].any() and not speech[80:].any()
    words = [Word("a", 10.0, 11.2, (1,)), Word("b", 11.2, 11.3, (2,))]  # the segment starts at 10 s
    snapped = snap_to_speech(words, speech, offset=10.0)
    assert (snapped[0].start, snapped[0].end) == pytest.approx((10.5, 10.8)) and snapped[1] == words[1]
    # A span inside the tone (CTC fired late and briefly) grows to the tone's edges, but not past
    # its neighbours: the next word's aligned start stops it.
    words = [Word("a", 10.6, 10.68, (1,)), Word("b", 10.75, 11.0, (2,))]
    snapped = snap_to_speech(words, speech, offset=10.0)
    assert (snapped[0].start, snapped[0].end) == pytest.approx((10.5, 10.75))
    assert (snapped[1].start, snapped[1].end) == pytest.approx((10.75, 10.8))


def test_segments_end_at_sentences_pauses_and_length():
    w = lambda text, a, b: Word(text, a, b)  # noqa: E731
    words = [w("Hello", 0.0, 0.4), w("there.", 0.5, 0.9), w("How", 1.0, 1.2), w("are", 1.3, 1.5), w("you", 3.0, 3.3)]
    assert [s.text for s in to_segments(words)] == ["Hello there.", "How are", "you"]  # sentence end, then pause
    many = [w(f"w{i}", 0.5 * i, 0.5 * i + 0.4) for i in range(20)]
    assert all(s.end - s.start <= 7.0 for s in to_segments(many)) and len(to_segments(many)) == 2


def test_srt_and_webvtt_files():
    cues = [Segment([Word("Hello", 0.0, 0.42), Word("there.", 0.5, 1.0)]), Segment([Word("Bye.", 3661.5, 3662.25)])]
    assert srt(cues) == ("1\n00:00:00,000 --> 00:00:01,000\nHello there.\n\n"
                         "2\n01:01:01,500 --> 01:01:02,250\nBye.\n\n")
    assert webvtt(cues) == ("WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nHello there.\n\n"
                            "01:01:01.500 --> 01:01:02.250\nBye.\n\n")
    assert cues[0].to_json(with_words=False) == {"text": "Hello there.", "start": 0.0, "end": 1.0}


# --- through transcribe -----------------------------------------------------------------------


def checkpoint(tmp_path, tokenizer, ctc_loss_weight: float) -> str:
    torch.manual_seed(0)
    cfg = AEDConfig(n_mels=32, vocab_size=tokenizer.padded_vocab_size, pad_id=tokenizer.pad, enc_d_model=32,
                    enc_layers=1, enc_heads=2, subsampling_channels=8, dec_d_model=32, dec_layers=1, dec_heads=2,
                    dec_max_len=64, ctc_loss_weight=ctc_loss_weight)
    run = tmp_path / f"ctc{ctc_loss_weight}"
    run.mkdir()
    save_checkpoint({"model": AED(cfg).state_dict(), "model_config": dataclasses.asdict(cfg),
                     "features": dataclasses.asdict(FeatureConfig(n_mels=32)),
                     "tokenizer": pack_dir(os.path.join(MINI, "tokenizer"))}, str(run), 1, keep_last=1)
    return str(run)


def long_file(tmp_path, seconds_between: float = 0.6) -> tuple[str, list[tuple[str, float, float]]]:
    """The word clips, twice over, with silences between them: (path, [(word, start, end)])."""
    names = list(json.load(open(os.path.join(WORDS, "words.json")))) * 2
    parts, truth, t = [], [], 0.3
    parts.append(torch.zeros(int(0.3 * 16000)))
    for name in names:
        clip = load_audio(os.path.join(WORDS, f"{name}.flac"))
        truth.append((name, t, t + clip.numel() / 16000))
        parts += [clip, torch.zeros(int(seconds_between * 16000))]
        t += clip.numel() / 16000 + seconds_between
    path = tmp_path / "words.wav"
    sf.write(path, torch.cat(parts).numpy(), 16000, subtype="FLOAT")
    return str(path), truth


def test_a_model_without_ctc_head_refuses_timestamps_before_any_work(tmp_path, tokenizer):
    asr = load_model(checkpoint(tmp_path, tokenizer, ctc_loss_weight=0.0))
    with pytest.raises(ValueError, match="no CTC head"):
        transcribe(asr, [os.path.join(MINI, "examples", "en_asr_16k.wav")], timestamps=True)


def test_times_are_monotonic_within_the_audio_and_offset_per_chunk(tmp_path, tokenizer):
    """Any model's words (an untrained one's here) lie in order inside the chunk they were decoded
    from, with the chunk's start added: the bookkeeping, whatever the model hears."""
    asr = load_model(checkpoint(tmp_path, tokenizer, ctc_loss_weight=0.3))
    path, _ = long_file(tmp_path)
    chunk = 4.0
    (res,), timings = transcribe(asr, [path], DecodingOptions(max_new_tokens=6), chunk_seconds=chunk,
                                 timestamps=True)
    _, chunks = plan_chunks(Request(path, "en", "en", True, "asr"), chunk, 16000)
    assert len(chunks) >= 4 and timings.align > 0
    # Words split at spaces only: an untrained model's byte pieces may decode to other whitespace.
    assert res.words and [w.text for w in res.words] == [w for w in res.pred_text.split(" ") if w]
    assert all(0 <= w.start < w.end <= res.duration + 1e-6 for w in res.words)
    assert all(a.end <= b.start + 1e-6 for a, b in zip(res.words, res.words[1:]))
    bounds = [(start, start + length) for start, _, length in chunks]
    assert all(any(a - 1e-6 <= w.start and w.end <= b + 1e-6 for a, b in bounds) for w in res.words)
    later = [w for w in res.words if w.start >= bounds[1][0]]
    assert later, "no word came from a later chunk: the offsets are untested"


def test_cli_writes_segments_and_subtitles(tmp_path, tokenizer):
    run = checkpoint(tmp_path, tokenizer, ctc_loss_weight=0.3)
    out, subs = tmp_path / "hyp.jsonl", tmp_path / "subs"
    wav = os.path.join(MINI, "examples", "en_asr_16k.wav")
    p = run_in_process(cli_infer.main, ["--ckpt", run, wav, "--out", str(out), "--timestamps", "word",
                                    "--subtitles", str(subs), "--max-new-tokens", "5"])
    assert p.returncode == 0, p.stderr
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["segments"] and all({"text", "start", "end", "words"} <= set(s) for s in row["segments"])
    assert (subs / "en_asr_16k.srt").read_text().startswith("1\n00:00:")
    assert (subs / "en_asr_16k.vtt").read_text().startswith("WEBVTT\n\n00:00:")
    assert "alignment" in p.stderr

    no_ctc = checkpoint(tmp_path, tokenizer, ctc_loss_weight=0.0)
    p = run_in_process(cli_infer.main, ["--ckpt", no_ctc, wav, "--timestamps", "segment"])
    assert p.returncode != 0 and "no CTC head" in p.stderr


@pytest.mark.parametrize("ctc_loss_weight", [0.3, 0.0])
def test_overlapping_chunks_of_continuous_speech_merge_into_one_ordered_transcript(tmp_path, tokenizer, ctc_loss_weight):
    """Words without pauses between them (and a noise floor): where a cut is not at a pause the next
    chunk starts `overlap` before the previous one ends, and the merged words (by time with a CTC head, by text without) lie in order, each once, inside the
    audio. An untrained model: the bookkeeping, not recognition (tests/test_decode_merge.py has the rules)."""
    asr = load_model(checkpoint(tmp_path, tokenizer, ctc_loss_weight=ctc_loss_weight))
    path, truth = long_file(tmp_path, seconds_between=0.0)
    wav = load_audio(path)
    sf.write(path, (wav + 0.01 * torch.randn(wav.numel(), generator=torch.Generator().manual_seed(0))).numpy(),
             16000, subtype="FLOAT")
    chunk, overlap = 2.0, 0.5
    _, chunks = plan_chunks(Request(path, "en", "en", True, "asr"), chunk, 16000, overlap)
    overlaps = [a[0] + a[2] - b[0] for a, b in zip(chunks, chunks[1:])]
    assert len(chunks) >= 4 and sum(o > 0 for o in overlaps) >= 2 and max(overlaps) <= overlap + 1e-6
    assert all(a[0] <= b[0] for a, b in zip(chunks, chunks[1:]))
    (res,), _ = transcribe(asr, [path], DecodingOptions(max_new_tokens=6), chunk_seconds=chunk,
                           chunk_overlap=overlap, timestamps=ctc_loss_weight > 0)
    assert res.error is None and res.duration == pytest.approx(wav.numel() / 16000, abs=1e-3)  # overlaps count once
    assert res.pred_text and res.tokens
    if ctc_loss_weight > 0:
        assert " ".join(w.text for w in res.words) == res.pred_text
        assert [t for w in res.words for t in w.ids] == res.tokens
        assert all(0 <= w.start < w.end <= res.duration + 1e-6 for w in res.words)
        assert all(a.end <= b.start + 1e-6 for a, b in zip(res.words, res.words[1:]))
        assert any(w.start >= chunks[2][0] for w in res.words), "no word from a later chunk"
    (no_overlap,), _ = transcribe(asr, [path], DecodingOptions(max_new_tokens=6), chunk_seconds=chunk,
                                  chunk_overlap=0.0)
    assert no_overlap.duration == pytest.approx(res.duration, abs=1e-3)


# |error| of the committed word model's word starts and ends (tests/fixtures/make_word_model.py) on the ten
# files below: measured median 2.9 / 3.1 ms, largest 6.2 / 7.5 ms (all ten transcribed right).
MEDIAN_BOUND = 0.02  # s: a quarter of an encoder frame
MAX_BOUND = 0.08  # s: one encoder frame


def test_a_trained_models_word_times_are_near_the_true_boundaries(tmp_path):
    """Random sequences of the word clips with pauses and a noise floor; on the files it transcribes
    right, the word model's times (CTC spans narrowed to the speech in them) against the clips'
    true boundaries. bench/long_audio_bench.py measures the same on more files."""
    asr = load_model(WORD_MODEL)
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    clips = load_clips()
    paths, truths = [], []
    for i in range(10):
        words = [rng.choice(sorted(clips)) for _ in range(rng.randint(2, 4))]
        wav, truth = word_sequence(clips, words, [rng.uniform(0.1, 0.6) for _ in words], rng.uniform(0.0, 1.0),
                                   10 ** rng.uniform(-4, -2.5), gen)
        paths.append(str(tmp_path / f"w{i}.wav"))
        sf.write(paths[-1], wav.numpy(), 16000, subtype="FLOAT")
        truths.append(truth)
    results, _ = transcribe(asr, paths, pnc=False, timestamps=True)
    for res in results:
        assert all(0 <= w.start < w.end <= res.duration + 1e-6 for w in res.words)
        assert all(a.end <= b.start + 1e-6 for a, b in zip(res.words, res.words[1:]))
    right = [(res, truth) for res, truth in zip(results, truths) if [w.text for w in res.words] == [w for w, _, _ in truth]]
    assert len(right) >= 8, [res.pred_text for res in results]
    starts = torch.tensor([abs(w.start - a) for res, truth in right for w, (_, a, _) in zip(res.words, truth)])
    ends = torch.tensor([abs(w.end - b) for res, truth in right for w, (_, _, b) in zip(res.words, truth)])
    assert starts.median() <= MEDIAN_BOUND and ends.median() <= MEDIAN_BOUND, (starts.median(), ends.median())
    assert starts.max() <= MAX_BOUND and ends.max() <= MAX_BOUND, (starts.max(), ends.max())
