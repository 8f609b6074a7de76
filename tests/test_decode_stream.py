"""aed/decode_stream.py and `infer.py --stream`: streamed decoding against offline decoding, slicing,
causality, batches of streams, the guards, latency, bad input."""

import dataclasses
import importlib.util
import io
import logging
import math
import os
import random
import sys

import numpy as np
import pytest
import soundfile as sf
import torch
from fixtures.make_word_model import load_clips, word_sequence
from test_train import run_in_process

from aed import cli_infer, cli_stream
from aed.data_audio import FeatureConfig
from aed.data_speech import FRAME
from aed.data_tokenizer import Tokenizer
from aed.decode_metrics import wer
from aed.decode_search import DecodingOptions
from aed.decode_metrics import average_lagging, stream_latency
from aed.decode_stream import StreamConfig, Streamer
from aed.decode_timing import segment_edges
from aed.decode_transcribe import transcribe
from aed.model import AED, AEDConfig
from aed.model_checkpoint import LoadedModel, load_model
from aed.model_decoder import KVCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORD_MODEL = os.path.join(ROOT, "tests", "fixtures", "word_model.pt")  # tests/fixtures/make_word_model.py
RATE = 16000
GREEDY = DecodingOptions(ctc_weight=0.0)  # the attention decoder alone
JOINT = DecodingOptions()  # joint CTC/attention scores, the default


@pytest.fixture(scope="module")
def word_model():
    return load_model(WORD_MODEL)


@pytest.fixture(scope="module")
def sequences():
    """Eight files of 3-6 of the word model's words with pauses: (waveform, [(word, start, end)])."""
    clips, rng, gen = load_clips(), random.Random(0), torch.Generator().manual_seed(0)
    out = []
    for _ in range(8):
        words = [rng.choice(sorted(clips)) for _ in range(rng.randint(3, 6))]
        out.append(word_sequence(clips, words, [rng.uniform(0.1, 0.5) for _ in words], rng.uniform(0.0, 1.0), 1e-3,
                                 gen))
    return out


def streamed(loaded, wav, config=StreamConfig(), piece: float | None = None, options=GREEDY):
    """The stream of `wav` fed in pieces of `piece` seconds (None: in one piece), finished."""
    stream = Streamer(loaded, config, options).open("en", pnc=False)
    step = wav.numel() if piece is None else max(1, round(piece * RATE))
    for i in range(0, wav.numel(), step):
        stream.feed(wav[i: i + step])
    stream.finish()
    return stream


def timed(stream):
    return [(t.id, t.time) for t in stream.tokens]


# --- the decoder cache with a position per row ------------------------------------------------


def test_rows_at_their_own_positions_decode_as_each_row_alone():
    torch.manual_seed(0)
    cfg = AEDConfig(n_mels=16, vocab_size=40, enc_d_model=32, enc_layers=1, enc_heads=2, subsampling_channels=8,
                    dec_d_model=32, dec_layers=2, dec_heads=2, dec_max_len=32, dec_dropout=0.0, dec_dropout_att=0.0)
    model = AED(cfg).eval()
    memory, memory_lens = torch.randn(3, 9, 32), torch.tensor([9, 6, 4])
    prefixes = [[2, 5, 7], [3, 4, 8, 9, 10], [6]]
    steps = [[11, 12], [13, 14], [15, 16]]
    alone = []
    for r, prefix in enumerate(prefixes):
        cache = model.new_cache(memory[r: r + 1], memory_lens[r: r + 1], 12)
        logits = [model.decode_step(torch.tensor([prefix]), cache)]
        logits += [model.decode_step(torch.tensor([[t]]), cache) for t in steps[r]]
        alone.append(torch.cat(logits))  # (3, V)
    c = model.new_cache(memory, memory_lens, 12)
    cache = KVCache(c.keys, c.values, c.cross_kv, c.memory_mask, torch.zeros(3, dtype=torch.long))
    padded = torch.tensor([p + [0] * (5 - len(p)) for p in prefixes])  # (3, 5) right-padded
    hidden = model.decoder.forward_cached(padded, cache)
    lens = torch.tensor([len(p) for p in prefixes])
    cache.length.copy_(lens)
    together = [model.decoder.output_proj(hidden[torch.arange(3), lens - 1])]
    together += [model.decode_step(torch.tensor([[s[i]] for s in steps]), cache) for i in range(2)]
    together = torch.stack(together, dim=1)  # (3 rows, 3 steps, V)
    for r in range(3):
        torch.testing.assert_close(together[r], alone[r], atol=1e-5, rtol=1e-5)


# --- streams against offline decoding ---------------------------------------------------------


@pytest.mark.parametrize("options", [GREEDY, JOINT], ids=["attention", "joint-ctc"])
def test_a_stream_whose_chunk_holds_all_its_audio_is_offline_greedy_decoding(word_model, sequences, tmp_path, options):
    """No policy is reached (the stream's end decodes to EOS), no sentence is ended at a pause
    (endpoint 0): what is left is the encoder and the greedy decoder, as offline, with or without
    the CTC head's scores."""
    paths = []
    for i, (wav, _) in enumerate(sequences):
        paths.append(str(tmp_path / f"s{i}.wav"))
        sf.write(paths[-1], wav.numpy(), RATE, subtype="FLOAT")
    offline, _ = transcribe(word_model, paths, options, pnc=False)
    for (wav, _), res in zip(sequences, offline):
        stream = streamed(word_model, wav, StreamConfig(chunk=60.0, endpoint=0.0), options=options)
        assert stream.ids == res.tokens and stream.text == res.pred_text
        assert all(t.time == pytest.approx(wav.numel() / RATE) for t in stream.tokens)  # all at the end


@pytest.mark.parametrize("options", [GREEDY, JOINT], ids=["attention", "joint-ctc"])
def test_a_whole_utterance_streamed_for_a_model_trained_on_varied_edges_is_its_offline_decoding(word_model, tmp_path,
                                                                                               options):
    """A model trained with varied edges (checkpoint field varied_edges) is given each sentence with a
    margin as wide as its training edges, not cut to them: a whole utterance whose silence before its
    speech fits that margin and without a pause that ends a sentence decodes as offline decoding does,
    at the default stream settings (1 s chunks, AlignAtt committing tokens while the audio goes on)."""
    varied = dataclasses.replace(word_model, varied_edges=(-0.5, 0.5))
    margin = segment_edges(varied)[0]
    clips, rng, gen = load_clips(), random.Random(1), torch.Generator().manual_seed(1)
    paths, wavs, committed = [], [], 0
    for i in range(8):
        words = [rng.choice(sorted(clips)) for _ in range(rng.randint(2, 4))]
        gaps = [rng.uniform(0.02, 0.2) for _ in words[:-1]] + [rng.uniform(0.0, 0.6)]  # the last: its trailing silence
        wav, _ = word_sequence(clips, words, gaps, rng.uniform(0.0, margin - 0.05), rng.choice([0.0, 1e-3]), gen)
        paths.append(str(tmp_path / f"u{i}.wav"))
        sf.write(paths[-1], wav.numpy(), RATE, subtype="FLOAT")
        wavs.append(wav)
    offline, _ = transcribe(varied, paths, options, pnc=False)
    for wav, res in zip(wavs, offline):
        stream = streamed(varied, wav, StreamConfig(), options=options)
        assert stream.ids == res.tokens and stream.text == res.pred_text, (stream.text, res.pred_text)
        committed += sum(t.time < wav.numel() / RATE - 1e-9 for t in stream.tokens)
    assert committed > 0  # the policy committed tokens during the audio: more than one final decode


@pytest.mark.parametrize("tokens", [1, 2])
def test_waitk_commits_nothing_before_its_lag_then_its_tokens_per_chunk(word_model, sequences, tokens):
    config = StreamConfig(policy="waitk", waitk_lag=2, waitk_tokens=tokens, chunk=0.5, right=0.25, endpoint=0.0)
    streamer, reached = Streamer(word_model, config, GREEDY), 0
    second = (2 * streamer.chunk + streamer.right) / RATE  # the second chunk's look-ahead ends (whole frames)
    for wav, _ in sequences:
        stream = streamed(word_model, wav, config)
        end = wav.numel() / RATE
        during = [t.time for t in stream.tokens if t.time < end - 1e-9]  # committed by the policy, not at the end
        assert during and min(during) == pytest.approx(second)  # nothing before the lag, then at once
        assert all(during.count(t) <= tokens for t in during)  # at most `tokens` per chunk
        reached += len(during)
    assert reached >= len(sequences)  # the policy committed tokens while the audio went on


@pytest.mark.parametrize("config", [StreamConfig(chunk=0.5, right=0.25), StreamConfig(chunk=1.0, left=2.0),
                                    StreamConfig(policy="waitk", chunk=0.5, waitk_tokens=2)],
                         ids=["alignatt-0.5", "alignatt-1.0-left-2", "waitk-0.5"])
def test_how_the_caller_slices_the_audio_never_matters(word_model, sequences, config):
    wav = torch.cat([sequences[0][0], sequences[1][0]])  # ~10 s: the 2 s left context slides
    whole = streamed(word_model, wav, config)
    assert len(whole.tokens) >= 6
    for piece in (0.01, 0.37, 3.0):
        stream = streamed(word_model, wav, config, piece)
        assert timed(stream) == timed(whole) and stream.chunks == whole.chunks, piece


def test_streamed_words_are_those_of_offline_decoding_and_arrive_during_the_audio(word_model, sequences, tmp_path):
    """AlignAtt at 1 s chunks + 0.5 s look-ahead on the eight files: words no worse than offline greedy
    decoding of the same model, most committed before the audio ends."""
    refs = [" ".join(w for w, _, _ in truth) for _, truth in sequences]
    streams = [streamed(word_model, wav, StreamConfig(chunk=1.0, right=0.5)) for wav, _ in sequences]
    paths = []
    for i, (wav, _) in enumerate(sequences):
        paths.append(str(tmp_path / f"s{i}.wav"))
        sf.write(paths[-1], wav.numpy(), RATE, subtype="FLOAT")
    offline = [res.pred_text for res in transcribe(word_model, paths, GREEDY, pnc=False)[0]]
    assert wer(refs, [s.text for s in streams]) <= wer(refs, offline) + 5.0
    early = sum(t < wav.numel() / RATE - 1e-6 for s, (wav, _) in zip(streams, sequences) for _, t, _ in s.words())
    assert early >= 0.5 * sum(len(s.words()) for s in streams)


def test_tokens_are_timed_in_order_by_the_audio_they_waited_for(word_model, sequences):
    config = StreamConfig(chunk=0.5, right=0.25)
    streamer = Streamer(word_model, config, GREEDY)
    for wav, _ in sequences[:4]:
        stream, received = streamer.open("en", pnc=False), 0
        for i in range(0, wav.numel(), 4000):
            for t in stream.feed(wav[i: i + 4000]):
                received = min(i + 4000, wav.numel())
                assert t.time <= received / RATE + 1e-9  # never later than what had arrived: it was heard
        stream.finish()
        times = [t.time for t in stream.tokens]
        assert times == sorted(times) and times[-1] <= wav.numel() / RATE + 1e-9
        chunk_ends = {round((k + 1) * streamer.chunk + streamer.right) for k in range(stream.chunks)}
        assert all(round(t * RATE) in chunk_ends | {wav.numel()} for t in times)  # the end of a chunk's look-ahead


def test_no_token_depends_on_audio_after_its_time(word_model, sequences):
    """Two streams share their first 3 s and then differ: every token committed by the time
    3 s had been heard is the same in both."""
    config = StreamConfig(chunk=0.5, right=0.25)
    head = sequences[2][0][: 3 * RATE]
    a = streamed(word_model, torch.cat([head, sequences[3][0]]), config)
    b = streamed(word_model, torch.cat([head, sequences[4][0].flip(0)]), config)
    early_a = [(t.id, t.time) for t in a.tokens if t.time <= 3.0]
    assert early_a and early_a == [(t.id, t.time) for t in b.tokens if t.time <= 3.0]


@pytest.mark.parametrize("options", [GREEDY, JOINT], ids=["attention", "joint-ctc"])
def test_a_batch_of_streams_decodes_each_as_it_decodes_alone(word_model, sequences, options):
    config = StreamConfig(chunk=0.5, right=0.25)
    alone = [streamed(word_model, wav, config, options=options) for wav, _ in sequences[:5]]
    streamer = Streamer(word_model, config, options)
    streams = [streamer.open("en", pnc=False) for _ in alone]
    wavs = [wav for wav, _ in sequences[:5]]
    for start in range(0, max(w.numel() for w in wavs), 4800):  # 0.3 s per round, to every stream at once
        for s, w in zip(streams, wavs):
            if start < w.numel():
                s.push(w[start: start + 4800])
        streamer.run(streams)
    streamer.run(streams, final=True)
    for s, ref in zip(streams, alone):
        assert timed(s) == timed(ref)


def test_a_larger_alignatt_threshold_commits_later(word_model, sequences):
    """Without sentence ends at pauses (which commit what the policy held back), a threshold the
    attention can never meet commits everything at the stream's end."""
    mean_time = []
    for threshold in (0.0, 0.64, 100.0):
        config = StreamConfig(chunk=0.5, right=0.25, alignatt_threshold=threshold, endpoint=0.0)
        streams = [streamed(word_model, wav, config)
                   for wav, _ in sequences[:4]]
        mean_time.append(sum(t.time for s in streams for t in s.tokens) / sum(len(s.tokens) for s in streams))
    assert mean_time[0] <= mean_time[1] < mean_time[2]
    ends = [wav.numel() / RATE for wav, _ in sequences[:4]]
    assert all(t.time == pytest.approx(end) for s, end in zip(streams, ends) for t in s.tokens)  # all in the last chunk


# --- guards and bad input ---------------------------------------------------------------------


def test_a_looping_decoder_is_held_at_max_repeats_and_the_stall_is_logged(caplog):
    """A decoder that can only say one token: the stream commits max_repeats of them, holds the next,
    says that it stalls once, and the last chunk ends the hypothesis as offline search does."""
    tokenizer = Tokenizer.load(os.path.join(ROOT, "data", "mini", "tokenizer"))
    cfg = AEDConfig(n_mels=80, vocab_size=tokenizer.padded_vocab_size, pad_id=tokenizer.pad, enc_d_model=32,
                    enc_layers=1, enc_heads=2, subsampling_channels=8, dec_d_model=32, dec_layers=1, dec_heads=2,
                    dec_max_len=128)
    model = AED(cfg).eval()
    word = tokenizer.encode("a", "en")[-1]
    with torch.no_grad():
        model.decoder.output_proj.bias[word] = 100.0
    loaded = LoadedModel(model, tokenizer, FeatureConfig(n_mels=80), "looping")
    config = StreamConfig(policy="waitk", waitk_lag=1, waitk_tokens=3, chunk=0.5, right=0.0)
    stream = Streamer(loaded, config, DecodingOptions(ctc_weight=0.0, max_repeats=4)).open("en")
    with caplog.at_level(logging.WARNING, logger="aed.decode_policy"):
        t = torch.arange(8 * RATE) / RATE
        stream.feed(0.01 * torch.randn(8 * RATE) * (0.1 + torch.sin(torch.pi * 5 * t).abs()))  # syllables
        assert stream.ids == [word] * 4 and stream.policy.stalls == 1
        assert sum("stream stalls" in r.message for r in caplog.records) == 1
    stream.finish()
    assert stream.ids == [word] * 5


def test_what_a_stream_cannot_take_gets_a_clear_error_or_an_empty_result(word_model):
    streamer = Streamer(word_model)
    stream = streamer.open("en")
    with pytest.raises(ValueError, match="mono"):
        stream.feed(torch.zeros(1600, 2))
    with pytest.raises(ValueError, match="float samples"):
        stream.feed(np.zeros(1600, dtype=np.int16))
    with pytest.raises(ValueError, match="16000 Hz"):
        stream.feed(np.zeros(800, dtype=np.float32), sample_rate=8000)
    assert stream.finish() == [] and stream.text == "" and stream.received == 0  # an empty stream
    with pytest.raises(ValueError, match="finished"):
        stream.feed(np.zeros(100, dtype=np.float32))
    tiny = streamer.open("en")
    tiny.feed(np.zeros(100, dtype=np.float32))  # under one encoder frame
    assert tiny.finish() == []
    with pytest.raises(ValueError, match="policy"):
        StreamConfig(policy="greedy")
    with pytest.raises(ValueError, match="chunk"):
        StreamConfig(chunk=0)
    with pytest.raises(ValueError, match="beam"):
        Streamer(word_model, options=DecodingOptions(beam_size=4))
    with pytest.raises(ValueError, match="does not fuse a language model"):
        Streamer(word_model, options=DecodingOptions(beam_size=1, lm="lm.pt"))


@pytest.mark.parametrize("options", [GREEDY, JOINT], ids=["attention", "joint-ctc"])
def test_a_sentence_of_non_speech_is_emptied_by_the_no_speech_check_and_counted(word_model, options):
    """Words, a pause, a second of noise, a pause, words: three sentences. The word model never learned
    non-speech, but its EOS right after the prompt is times likelier on the noise than on its words: at
    a threshold between them the noise sentence is emptied where it ends (its word, committed while it
    was heard, withdrawn), and counted with its seconds. It writes that word confidently, so Whisper's
    second condition (-1) keeps it."""
    clips, gen = load_clips(), torch.Generator().manual_seed(0)
    words = sorted(clips)
    before, _ = word_sequence(clips, words[:3], [0.1, 0.1, 0.8], 0.3, 1e-3, gen)  # ends in a pause
    after, _ = word_sequence(clips, words[3:6], [0.1, 0.1, 0.3], 0.0, 1e-3, gen)
    noise = torch.cat([0.3 * torch.randn(RATE, generator=gen), 1e-3 * torch.randn(round(0.8 * RATE), generator=gen)])
    never = dataclasses.replace(options, no_speech_threshold=1.0)  # the check runs and empties nothing
    speech, nonspeech, speech_after = (streamed(word_model, wav, options=never).no_speech_prob
                                       for wav in (before, noise, after))
    assert nonspeech > 3 * max(speech, speech_after), (speech, nonspeech, speech_after)
    threshold = math.sqrt(nonspeech * max(speech, speech_after))
    wav = torch.cat([before, noise, after])
    heard = streamed(word_model, wav, options=never)
    checked = streamed(word_model, wav, options=dataclasses.replace(options, no_speech_threshold=threshold))
    kept = streamed(word_model, wav, options=dataclasses.replace(options, no_speech_threshold=threshold,
                                                                 logprob_threshold=-1.0))
    assert heard.sentences == checked.sentences == 3 and heard.skipped_sentences == 0
    assert kept.ids == heard.ids and kept.skipped_sentences == 0  # confident text stays
    assert checked.skipped_sentences == 1 and 1.0 <= checked.skipped_seconds <= 1.0 + 0.8  # the noise and its edges
    assert checked.no_speech_prob == heard.no_speech_prob  # the lowest of its sentences'
    # The noise sentence's tokens are gone, the words before and after it as they were.
    n = len(heard.ids) - len(checked.ids)
    k = next((k for k in range(len(checked.ids) + 1) if heard.ids[:k] + heard.ids[k + n:] == checked.ids), None)
    assert n > 0 and k is not None and 0 < k < len(checked.ids), (heard.ids, checked.ids)
    assert heard.tokens[k].time > before.numel() / RATE


# --- latency ----------------------------------------------------------------------------------


@pytest.mark.parametrize("vad", ["energy", pytest.param("silero", marks=pytest.mark.skipif(
    importlib.util.find_spec("silero_vad") is None, reason="pip install silero-vad"))])
@pytest.mark.parametrize("room", ["room tone -50 dBFS, 60 s", "white noise -60 dBFS, 20 s"])
def test_a_stream_of_a_room_without_speech_decodes_nothing_and_writes_nothing(word_model, vad, room):
    """A minute of room tone (a rumble, brown noise band-passed as a microphone hears a room) or steady
    hiss, streamed with no one speaking: no sentence is decoded, so nothing is written. (Judged by a
    threshold set from the newest 30 s, every frame of such audio was speech: 18 words in 20 s.)"""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_long_audio
    rng = np.random.default_rng(7)
    if room.startswith("room tone"):
        audio = 10 ** (-50 / 20) * make_long_audio.room_tone(rng, 60 * RATE, RATE)
    else:
        audio = 10 ** (-60 / 20) * rng.standard_normal(20 * RATE).astype(np.float32)
    stream = Streamer(word_model, StreamConfig(vad=vad)).open("en", pnc=False)
    for piece in np.array_split(audio, 97):
        stream.feed(piece)
    stream.finish()
    assert stream.text == "" and stream.sentence_seconds == 0.0, (stream.text, stream.sentence_seconds)


def test_average_lagging_as_simuleval_defines_it():
    # Words at 1, 2 and 3 s of a 3 s source with a 3-word reference: each word 1 s after its ideal time.
    assert average_lagging([1000, 2000, 3000], 3000, 3, length_adaptive=False) == pytest.approx(1000)
    # tau stops the sum at the first word emitted at the end: the 4th word does not count.
    assert average_lagging([500, 3000, 3000, 3000], 3000, 2, length_adaptive=False) == pytest.approx((500 + 1500) / 2)
    # LAAL: 4 output words against a 2-word reference use rate 4/3000, which AL's 2/3000 would under-count.
    assert average_lagging([500, 3000, 3000, 3000], 3000, 2) == pytest.approx((500 + 3000 - 750) / 2)
    assert average_lagging([3500], 3000, 1) == 3500  # after the source ended: that delay
    assert math.isnan(average_lagging([], 3000, 2))


def test_a_streams_latency_counts_its_words_and_chunks(word_model, sequences):
    wav, truth = sequences[0]
    stream = streamed(word_model, wav, StreamConfig(chunk=0.5, right=0.25))
    m = stream_latency(stream, wav.numel() / RATE, " ".join(w for w, _, _ in truth), wav)
    words = stream.words()
    assert m["first_word"] == pytest.approx(words[0][1] * 1000)
    # Committed after it was spoken, within the chunk, look-ahead and AlignAtt threshold that a word waits for.
    assert [w for w, _, _ in words] == [w for w, _, _ in truth]
    true_lag = sum(t - end for (_, t, _), (_, _, end) in zip(words, truth)) / len(words) * 1000
    assert 0 < m["spoken_lag"] < 2500 and abs(m["spoken_lag"] - true_lag) < 200, (m["spoken_lag"], true_lag)
    assert 0 < m["laal"] <= m["laal_ca"] and m["al"] <= m["al_ca"]
    assert m["rtf_mean"] > 0 and m["rtf_max"] >= m["rtf_mean"]


# --- infer.py --stream ------------------------------------------------------------------------


def test_infer_streams_files_and_standard_input(word_model, sequences, tmp_path, monkeypatch):
    import json
    paths = []
    for i, (wav, _) in enumerate(sequences[:3]):
        paths.append(str(tmp_path / f"s{i}.wav"))
        sf.write(paths[-1], wav.numpy(), RATE, subtype="FLOAT")
    out = tmp_path / "hyp.jsonl"
    flags = ["--ckpt", WORD_MODEL, "--no-pnc", "--stream-chunk", "0.5", "--right-context", "0.25",
             "--vad", "energy"]  # StreamConfig's detector, which `streamed` takes
    proc = run_in_process(cli_infer.main, flags + ["--stream", "--out", str(out)] + paths)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    for line, (wav, _) in zip(lines, sequences):
        alone = streamed(word_model, wav, StreamConfig(chunk=0.5, right=0.25))
        assert line["pred_text"] == alone.text and [t["time"] for t in line["tokens"]] == [
            round(t.time, 3) for t in alone.tokens]
        assert set(line["latency"]) >= {"al", "laal", "al_ca", "laal_ca", "first_word"}
        assert line["skipped"] == {"segments": 0, "seconds": 0.0} and 0 <= line["undecoded_seconds"] < line["duration"]
    assert "LAAL" in proc.stderr and "no speech (P > 0.1): 0 sentence(s)" in proc.stderr

    pcm = (sequences[0][0].clamp(-1, 1) * 32767).round().short().numpy().tobytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(pcm))))
    proc = run_in_process(cli_infer.main, flags + ["--stream", "-"])
    assert proc.returncode == 0, proc.stderr
    assert " ".join(proc.stdout.split()) == lines[0]["pred_text"]  # a line a sentence; 16-bit rounding changes nothing

    with open(paths[0], "rb") as f:  # a WAV file is not raw PCM
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(f.read()))))
    proc = run_in_process(cli_infer.main, flags + ["--stream", "-"])
    assert proc.returncode != 0 and "not raw PCM" in proc.stderr and "Traceback" not in proc.stderr

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(b""))))
    proc = run_in_process(cli_infer.main, flags + ["--stream", "-"])
    assert proc.returncode == 0 and "no audio" in proc.stderr


def test_a_live_line_keeps_the_newest_text_and_greys_what_is_not_committed():
    class Stream:
        def __init__(self, committed, partial):
            self.committed, self.partial = committed, partial

        def sentence_text(self, first, partial=False):
            return self.committed + (self.partial if partial else "")

    assert cli_stream.with_partial(Stream("hello", " world"), 0, 40) == "hello\x1b[2m world\x1b[0m"
    assert cli_stream.with_partial(Stream("abcdefghij", ""), 0, 5) == "…ghij"
    assert cli_stream.with_partial(Stream("hello world", " again"), 0, 12) == "…world\x1b[2m again\x1b[0m"  # 12 shown
    assert cli_stream.with_partial(Stream("ab", "cdefghijkl"), 0, 5) == "…\x1b[2mijkl\x1b[0m"


def syllables(frames: int) -> torch.Tensor:
    """(frames,) dB of speech: syllables of 160 ms at -10 dB, each followed by a 40 ms dip to -60 dB
    (a stop, the edge of a syllable): 50 dB above a room at -70 dB, and its own dips 10 dB below the
    speech (its floor) even where no pause lies within FLOOR_SECONDS."""
    return torch.tensor(([-10.0] * 16 + [-60.0] * 4) * (frames // 20 + 1))[:frames]


def test_a_click_before_speech_does_not_end_a_sentence_of_its_own(word_model):
    """A click (80 ms, far above the floor) before speech, then a gap, then speech in the look-ahead:
    the click is no speech, so the gap is no pause after speech and the sentence goes on into the
    speech. Cut there, each such sound became a sentence of its own, decoded into a hallucinated
    word (a ten-minute stream of the demo model wrote "Ach" six times)."""
    streamer = Streamer(word_model, StreamConfig(chunk=1.0, right=0.5))
    s = streamer.open("en", pnc=False)
    s.chunks = 9
    chunk_end = (s.chunks + 1) * streamer.chunk // 160  # in 10 ms frames; the look-ahead follows it
    start = chunk_end - 60
    recent = torch.full((start,), -70.0)  # the room before the sentence
    sentence = torch.cat([torch.full((10,), -70.0), torch.full((8,), -35.0),  # the click
                          torch.full((57,), -70.0), torch.full((100,), -10.0)])  # a gap, then speech (look-ahead)
    s.levels = torch.cat([recent, sentence])  # 10 ms frames from the stream's start
    s.received, s.scored, s.kept_from = s.levels.numel() * 160, s.levels.numel(), start * 160
    window = streamer.window(s, final=False)
    lead = round(streamer.edges[0] / FRAME)
    assert not window.closing and window.start == (start + 75 - lead) * 160, window  # lead before the speech


def test_a_sentence_longer_than_training_utterances_ends_at_its_longest_gap(word_model):
    """Two stretches of speech with a 0.15 s gap between them (shorter than a pause), then a pause, all
    in the heard audio: the sentence would run longer than the model's longest training utterance,
    so it ends in the gap, as offline segmentation splits such a stretch, unless a committed token's
    attention peak lies after the gap (its sound would be cut off from its sentence)."""
    streamer = Streamer(word_model, StreamConfig(chunk=1.0, right=0.5))
    longest = streamer.longest // 160  # 10 ms frames
    s = streamer.open("en", pnc=False)
    s.chunks = 9
    chunk_end = (s.chunks + 1) * streamer.chunk // 160
    start = chunk_end - 600  # the sentence began 6 s before the chunk's end; heard to 0.48 s after it
    recent = torch.full((start,), -70.0)  # the room before the sentence
    sentence = torch.cat([torch.full((20,), -70.0), syllables(290), torch.full((15,), -70.0),
                          syllables(270), torch.full((53,), -70.0)])  # lead, speech, gap, speech, pause
    assert sentence.numel() - 53 + 20 > longest  # cut 0.2 s after its speech, the sentence would be too long
    s.levels = torch.cat([recent, sentence])
    s.received, s.scored, s.kept_from = s.levels.numel() * 160, s.levels.numel(), start * 160
    window = streamer.window(s, final=False)
    assert window.closing and (start + 310) * 160 <= window.chunk_end <= (start + 325) * 160, window
    streamer.policy.committed(s.policy, (start + 400) * 160 / streamer.rate)  # a token heard the second stretch
    window = streamer.window(s, final=False)
    assert window.closing and (start + 400) * 160 < window.chunk_end <= (start + 600) * 160, window  # a dip after it


def test_a_full_window_ends_its_sentence_at_a_gap_before_its_quietest_point(word_model):
    """A sentence that outgrows its window with no pause in it ends at the longest gap in its speech,
    as offline segmentation splits a stretch too long for the model, even where a faint stretch of
    speech is quieter on average (cut there, a word is cut in two); where no gap lies after the
    attention of its committed tokens, at the window's quietest 100 ms (here the gap, before them)."""
    streamer = Streamer(word_model, StreamConfig(chunk=1.0, right=0.5))
    s = streamer.open("en", pnc=False)
    s.chunks = 9
    chunk_end = (s.chunks + 1) * streamer.chunk // 160  # in 10 ms frames
    start = chunk_end - (streamer.left + streamer.chunk) // 160 - 32  # the window is full
    recent = torch.full((start,), -70.0)  # the room before the sentence
    sentence = torch.cat([torch.full((20,), -70.0), syllables(280), torch.full((30,), -35.0),
                          syllables(120), torch.full((8,), -70.0),  # faint speech ... an 80 ms gap
                          torch.full((150,), -10.0)])  # speech without a gap to the window's end
    s.levels = torch.cat([recent, sentence])
    s.received, s.scored, s.kept_from = s.levels.numel() * 160, s.levels.numel(), start * 160
    window = streamer.window(s, final=False)
    assert window.closing and window.full and (start + 450) * 160 <= window.chunk_end <= (start + 454) * 160, window
    streamer.policy.committed(s.policy, (start + 500) * 160 / streamer.rate)  # a token heard the speech after the gap
    window = streamer.window(s, final=False)
    assert window.closing and window.full and (start + 446) * 160 <= window.chunk_end <= (start + 460) * 160, window
