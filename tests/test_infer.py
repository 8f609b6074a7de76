"""infer.py and aed/decode_transcribe.py: real bundled audio through a tiny model trained in this module."""

import copy
import dataclasses
import json
import logging
import math
import os
import shutil
import subprocess
import sys

import pytest
import soundfile as sf
import torch
import torch.nn.functional as F
from test_train import run_in_process

from aed import cli_infer
from aed.data_audio import FeatureConfig, LogMel, load_audio
from aed.data_batch import encode_utterance
from aed.data_manifest import ManifestError, read_manifest
from aed.data_tokenizer import Tokenizer
from aed.decode_metrics import corpus_scores, wer
from aed.decode_search import (DecodingOptions, beam_search, decode_features, greedy_search, length_penalty,
                               token_budget)
from aed.decode_timing import segment_edges
from aed.decode_transcribe import (Request, chunk_length, expand_inputs, plan_chunks, read_requests, request_prompts,
                                   transcribe)
from aed.model import AED, AEDConfig, CTCHead
from aed.model_checkpoint import CheckpointError, LoadedModel, load_model, pack_dir
from aed.train_checkpoint import save_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINI = os.path.join(ROOT, "data", "mini")
EXAMPLES = os.path.join(MINI, "examples.jsonl")
TRAIN_IDS = ["train_en_000006", "train_es-en_000001", "train_de_000009",  # the examples/*.wav, as in training
             "train_en_000015", "train_en_000058", "train_en_000036"]  # ~1.55 s each: the long-audio test
LONG_IDS = TRAIN_IDS[3:]
SILENCE = 1e-4  # amplitude of the noise that pads training audio and fills the gaps of the long file
MAX_PAD = 0.5  # seconds of that noise added before and after each training utterance, at random: more than a gap
EDGES = torch.tensor([0.1, 0.15])  # seconds of silence the mini utterances keep before and after their speech


def with_silence(wav, before: float, after: float, sr=16000):
    """`wav` with `before` and `after` seconds of near-silence added, or where negative, that much of
    its own silence cut."""
    a, b = int(before * sr), int(after * sr)
    wav = wav[max(0, -a): wav.numel() - max(0, -b)]
    return torch.cat([SILENCE * torch.randn(max(0, a)), wav, SILENCE * torch.randn(max(0, b))])


def random_pads(n: int):
    """(n, 2) seconds before and after each utterance: up to MAX_PAD added, or up to its edge's silence
    cut, as a chunk cut at a pause inside that silence cuts it."""
    return torch.rand(n, 2) * (MAX_PAD + EDGES) - EDGES



@pytest.fixture(scope="module")
def train_utts():
    utts = read_manifest(os.path.join(MINI, "train.jsonl"))
    return [next(u for u in utts if f"/{k}." in u.audio_filepath) for k in TRAIN_IDS]


@pytest.fixture(scope="module")
def run_dir(made_once, train_utts):
    """A run directory with a checkpoint (train.py's format) of a tiny model that overfits TRAIN_IDS.

    Trained here, not with train.py: a model that memorised its utterances sample-exactly fails when
    they are shifted by 20 ms, which is what chunking a long file does to them, so every step adds up
    to 0.5 s of near-silence to each end of each utterance, or cuts up to that end's own silence, as a
    chunk's cut in a pause can. Full-batch Adam at a constant rate then converges in a few hundred
    steps (10-30 s of CPU); train.py's warmup/decay and sampled batches needed over twice as many.
    """
    def make(path):
        torch.manual_seed(0)
        tokenizer = Tokenizer.load(os.path.join(MINI, "tokenizer"))
        features = FeatureConfig(n_mels=32)
        cfg = AEDConfig(n_mels=32, vocab_size=tokenizer.padded_vocab_size, pad_id=tokenizer.pad, enc_d_model=64,
                        enc_layers=2, enc_heads=2, subsampling_channels=16, dec_d_model=64, dec_layers=1, dec_heads=2,
                        dec_max_len=64, enc_dropout=0.0, enc_dropout_pre_encoder=0.0, enc_dropout_att=0.0,
                        dec_dropout=0.0, dec_dropout_att=0.0, loss_on_prompt=False)
        model = AED(cfg)
        logmel = LogMel(features).eval()  # no dither: the silence padding is the augmentation
        wavs = [load_audio(u.audio_filepath) for u in train_utts]
        seqs = [encode_utterance(tokenizer, u)[0] for u in train_utts]
        tokens = torch.full((len(seqs), max(map(len, seqs))), tokenizer.pad)  # (B, U)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = torch.tensor(s)
        token_lens = torch.tensor([len(s) for s in seqs])
        prompt_lens = torch.full((len(seqs),), 5)

        def features_of(pads):
            padded = [with_silence(w, float(a), float(b)) for w, (a, b) in zip(wavs, pads)]
            lens = torch.tensor([w.numel() for w in padded])
            batch = torch.zeros(len(padded), int(lens.max()))  # (B, S)
            for i, w in enumerate(padded):
                batch[i, : w.numel()] = w
            return logmel(batch, lens)

        # Silence the tests add, on a grid from none to MAX_PAD before and after (the bundled files as
        # they are, a long file's chunks with their edges, its gaps), then a random draw from the
        # training range. A model right only at the one or two draws a check looks at is right
        # elsewhere (a chunk of the long file) by chance, and which chance follows the CPU's kernels
        # through the rounding of every step before.
        grid = [torch.tensor([[before, after]]).expand(len(wavs), 2)
                for before in (0.0, MAX_PAD / 2, MAX_PAD) for after in (0.0, MAX_PAD / 2, MAX_PAD)]

        def all_correct():
            model.eval()
            for pads in [*grid, random_pads(len(wavs))]:
                hyps = decode_features(model, *features_of(pads), tokens[:, :5], tokenizer.eos, DecodingOptions())[0]
                texts = [tokenizer.decode_hypothesis(h) for h in hyps]
                if texts != [u.text for u in train_utts]:
                    return False
            return True

        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        for step in range(1, 1501):
            model.train()
            loss, n = model(*features_of(random_pads(len(wavs))), tokens, token_lens, prompt_lens)
            (loss / n).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if step % 25 == 0 and all_correct():
                break
        else:
            pytest.fail("the tiny model did not overfit its 6 utterances in 1500 steps")
        save_checkpoint({"step": step, "model": model.state_dict(), "model_config": dataclasses.asdict(cfg),
                         "features": dataclasses.asdict(features),
                         "tokenizer": pack_dir(os.path.join(MINI, "tokenizer"))}, str(path), step, keep_last=1)

    return str(made_once("infer-run", make))


@pytest.fixture(scope="module")
def loaded(run_dir):
    return load_model(run_dir)  # a run directory: its newest checkpoint


# --- with the trained model -------------------------------------------------------------------


def test_bundled_examples_match_their_references(loaded):
    requests = read_requests(EXAMPLES)
    assert {r.taskname for r in requests} == {"asr", "ast"}  # en and de ASR, es->en translation
    results, timings = transcribe(loaded, requests)
    assert [r.pred_text for r in results] == [r.text for r in requests]
    assert all(r.error is None and r.decode_time > 0 for r in results)
    assert timings.audio == pytest.approx(sum(r.duration for r in requests), abs=0.01)
    assert timings.wall >= timings.load_features + timings.encoder + timings.decoder > 0
    assert timings.rtfx > 0


def test_stereo_44k_file_equals_its_16k_mono_version(loaded, tmp_path):
    stereo = os.path.join(MINI, "examples", "de_asr_44k_stereo.wav")
    info = sf.info(stereo)
    assert (info.samplerate, info.channels) == (44100, 2)
    mono = tmp_path / "de_16k_mono.wav"
    sf.write(mono, load_audio(stereo).numpy(), 16000, subtype="PCM_16")  # a real 16-bit file: rounded samples
    results, _ = transcribe(loaded, [stereo, str(mono)], source_lang="de")
    assert results[0].tokens == results[1].tokens
    assert results[0].pred_text == results[1].pred_text == "Offen steht das Grab!"


def test_batch_composition_does_not_change_any_output(loaded, train_utts):
    requests = read_requests(EXAMPLES) + [Request(u.audio_filepath, u.source_lang, u.target_lang, u.pnc, u.taskname)
                                          for u in train_utts]
    alone, _ = transcribe(loaded, requests, batch_duration=1e-3)  # every batch holds one file
    together, _ = transcribe(loaded, requests, batch_duration=1e4)  # one padded batch of all nine
    assert [r.tokens for r in alone] == [r.tokens for r in together]
    assert all(r.tokens for r in alone)


def long_file(train_utts, path, gap: float = 0.4):
    """The LONG_IDS utterances, `gap` seconds of near-silence between them, written to `path`: their
    utterances and waveforms."""
    torch.manual_seed(0)
    utts = [u for u in train_utts if any(f"/{k}." in u.audio_filepath for k in LONG_IDS)]
    wavs = [load_audio(u.audio_filepath) for u in utts]
    long = torch.cat([with_silence(w, 0.0, gap if i < len(wavs) - 1 else 0.0) for i, w in enumerate(wavs)])
    sf.write(path, long.numpy(), 16000, subtype="FLOAT")
    return utts, wavs


def test_long_audio_is_cut_at_pauses_and_recovers_every_word(loaded, train_utts, tmp_path):
    path, gap = tmp_path / "long.wav", 0.4
    utts, wavs = long_file(train_utts, path, gap)
    chunk = 2.0  # longer than each utterance + most of a gap, shorter than two utterances
    assert max(w.numel() for w in wavs) / 16000 < chunk < sf.info(path).frames / 16000

    # Every cut falls into a pause: a gap, or the silence the mini utterances keep at their edges
    # (0.15 s at the end, 0.1 s at the start; data/mini/README.md), so no word is split.
    _, chunks = plan_chunks(Request(str(path), "en", "en", True, "asr"), chunk, 16000)
    assert len(chunks) == len(wavs)
    gaps, t = [], 0.0
    for w in wavs[:-1]:
        t += w.numel() / 16000
        gaps.append((t - 0.15, t + gap + 0.1))
        t += gap
    for (start, _, _), (lo, hi) in zip(chunks[1:], gaps):
        assert lo <= start <= hi, (start, lo, hi)

    # No chunk length given: the one recorded in the checkpoint (the training maximum) is used.
    results, timings = transcribe(dataclasses.replace(loaded, max_train_duration=chunk), [str(path)])
    assert results[0].pred_text == " ".join(u.text for u in utts)
    assert results[0].duration == pytest.approx(sf.info(path).frames / 16000, abs=1e-3)


def test_a_segment_the_no_speech_check_empties_among_kept_ones_is_reported(run_dir, loaded, train_utts, tmp_path):
    """Nothing dropped unsaid: the long file's segments (cut at its pauses) have no-speech probabilities
    times apart; a threshold between them empties the likelier ones.
    Their text goes, and the --out line and the summary count them with their seconds, and the seconds
    between segments that were never decoded. (The file's probability is the lowest of its segments':
    it says speech; only files emptied whole used to be counted.)"""
    path = tmp_path / "long.wav"
    long_file(train_utts, path)
    _, chunks = plan_chunks(Request(str(path), "en", "en", True, "asr"), 2.0, 16000)
    segments, _ = transcribe(loaded, [Request(str(path), "en", "en", True, "asr", offset=offset, duration=duration)
                                      for offset, duration, _ in chunks])  # each alone
    probs = [r.no_speech_prob for r in segments]
    ranked = sorted(probs)
    ratio, k = max((b / a, k) for k, (a, b) in enumerate(zip(ranked, ranked[1:])))
    assert ratio > 1.5, f"the segments' probabilities {probs} lie too close to put a threshold between them"
    threshold = math.sqrt(ranked[k] * ranked[k + 1])
    emptied = [p > threshold for p in probs]
    out = tmp_path / "hyp.jsonl"
    p = run_in_process(cli_infer.main, ["--ckpt", run_dir, "--chunk-seconds", "2", "--no-speech-threshold", repr(threshold),
                                    "--vad", "energy", "--out", str(out), str(path)])  # plan_chunks' detector
    assert p.returncode == 0, p.stderr
    (line,) = [json.loads(row) for row in out.read_text().splitlines()]
    assert line["pred_text"] == " ".join(r.pred_text for r, e in zip(segments, emptied) if not e)
    skipped_s = sum(seconds for (_, _, seconds), e in zip(chunks, emptied) if e)
    assert line["skipped"]["segments"] == sum(emptied) and line["skipped"]["seconds"] == pytest.approx(skipped_s, abs=2e-3)
    assert line["no_speech_prob"] == pytest.approx(min(probs), rel=1e-2)  # 3 significant digits
    undecoded = line["duration"] - sum(seconds for _, _, seconds in chunks)
    assert line["undecoded_seconds"] == pytest.approx(undecoded, abs=2e-3) and undecoded > 0.3  # the pauses
    assert f": {sum(emptied)} segment(s), {skipped_s:.1f} s emptied in 1 of 1 file(s)" in p.stderr, p.stderr
    assert f"{line['undecoded_seconds']:.1f} s judged non-speech by energy" in p.stderr, p.stderr


def test_a_no_speech_probability_of_0_is_reported_as_0(loaded, train_utts, tmp_path, monkeypatch):
    """A file whose first decoded segment is certain to hold speech (P(EOS) after the prompt exactly 0,
    as where its logit underflows) has no-speech probability 0: a 0 is a probability, not a missing one
    (read as 1, it let the next segment's probability stand for the file)."""
    from aed import decode_search

    path = tmp_path / "long.wav"
    long_file(train_utts, path)
    real = decode_search.no_speech_probs
    monkeypatch.setattr(decode_search, "no_speech_probs", lambda *args: real(*args).index_fill(0, torch.tensor([0]), 0.0))
    (res,), _ = transcribe(dataclasses.replace(loaded, max_train_duration=2.0), [str(path)], batch_duration=1e4)
    assert res.no_speech_prob == 0.0 and res.to_json()["no_speech_prob"] == 0.0
    assert res.pred_text == " ".join(u.text for u in train_utts if any(f"/{k}." in u.audio_filepath for k in LONG_IDS))


def test_chunk_length_defaults_to_the_training_maximum_and_warns_beyond_it(caplog):
    trained = LoadedModel(None, None, None, "ckpt.pt", max_train_duration=4.6)
    assert chunk_length(trained, None) == 4.6
    assert chunk_length(dataclasses.replace(trained, max_train_duration=None), None) == 40.0  # e.g. converted Canary
    with caplog.at_level(logging.WARNING):
        assert chunk_length(trained, 3.0) == 3.0 and not caplog.records
        assert chunk_length(trained, 40.0) == 40.0
    assert "trained on utterances of at most 4.6 s" in caplog.text


def test_a_model_trained_with_varied_edges_gets_its_longest_utterances_in_one_segment(tmp_path):
    """Its segments get margins wider than its utterances' own silence (`segment_edges`); the segment
    length grows by as much, so speech as long as its longest training utterance held is one segment,
    not split at a gap between its words (on the demo model, 19 of 190 digit strings were)."""
    model = LoadedModel(None, None, None, "ckpt.pt", max_train_duration=2.1, edge_silence=(0.12, 0.12),
                        varied_edges=(-0.1, 0.5))
    lead, trail = segment_edges(model)
    assert chunk_length(model, None) == pytest.approx(2.1 + (lead - 0.12) + (trail - 0.12))
    # Six utterances of 1.8 s of speech (the 2.1 s less its own edges): four 0.375 s tones 0.1 s apart,
    # 0.8 s pauses between them, over a floor at -70 dBFS.
    gen, t = torch.Generator().manual_seed(0), torch.arange(round(0.375 * 16000)) / 16000
    word, gap, pause = 0.1 * torch.sin(2 * math.pi * 220 * t), torch.zeros(1600), torch.zeros(12800)
    utterance = torch.cat([word, gap, word, gap, word, gap, word])
    wav = torch.cat([pause] + [torch.cat([utterance, pause]) for _ in range(6)])
    wav += 3e-4 * torch.randn(wav.shape, generator=gen)
    sf.write(tmp_path / "six.wav", wav.numpy(), 16000, subtype="FLOAT")
    _, chunks = plan_chunks(Request(str(tmp_path / "six.wav"), "en", "en", False, "asr"), chunk_length(model, None),
                            16000, edges=(lead, trail))
    starts = [0.8 + k * 2.6 for k in range(6)]  # each utterance's speech: [start, start + 1.8]
    assert len(chunks) == 6
    for (offset, _, seconds), start in zip(chunks, starts):
        assert offset <= start and offset + seconds >= start + 1.8


def test_setting_ranges_are_checked_by_the_library_and_reported_by_infer_py(capsys):
    """One home for the checks: DecodingOptions, `transcribe` and `load_model` raise before any work,
    and infer.py's parser reports the same message as a usage error (exit 2)."""
    for kw, message in (({"beam_size": 0}, "beam size"), ({"ctc_weight": 1.5}, "CTC weight"),
                        ({"max_repeats": -1}, "max repeats")):
        with pytest.raises(ValueError, match=message):
            DecodingOptions(**kw)
    nothing_loaded = LoadedModel(None, None, None, "ckpt.pt")
    for kw, message in (({"chunk_overlap": -1.0}, "chunk overlap"), ({"batch_duration": 0.0}, "batch duration")):
        with pytest.raises(ValueError, match=message):
            transcribe(nothing_loaded, ["a.wav"], DecodingOptions(), **kw)
    with pytest.raises(ValueError, match="do not combine"):
        load_model("no/such/checkpoint", compile=True, int8=True)
    for flags, message in ((["--beam-size", "0"], "beam size"), (["--max-new-tokens", "0"], "max new tokens"),
                           (["--ctc-weight", "2"], "CTC weight"), (["--max-repeats", "-1"], "max repeats"),
                           (["--chunk-seconds", "0"], "chunk seconds"), (["--chunk-overlap", "-1"], "chunk overlap"),
                           (["--no-speech-threshold", "2"], "no-speech threshold"),
                           (["--int8", "--compile", "--device", "cpu"], "do not combine"),
                           (["--int8", "--device", "cuda:0"], "CPUs only"), (["--subtitles", "subs"], "--timestamps")):
        with pytest.raises(SystemExit) as e:
            cli_infer.parse_args(["--ckpt", "runs/x", "a.wav", *flags])
        assert e.value.code == 2 and message in capsys.readouterr().err, flags
    assert cli_infer.parse_args(["--ckpt", "runs/x", "a.wav", "--max-tokens-per-second", "0"]).max_tokens_per_second == 0
    # The no-speech check: on by default, streams too (each sentence where it ends); Whisper's second condition asked for.
    options = cli_infer.decoding_options(cli_infer.parse_args(["--ckpt", "runs/x", "a.wav"]))
    assert (options.no_speech_threshold, options.logprob_threshold) == (0.1, None)
    assert cli_infer.decoding_options(cli_infer.parse_args(["--ckpt", "runs/x", "--stream", "-"])) == options
    asked = cli_infer.parse_args(["--ckpt", "runs/x", "--stream", "-", "--no-speech-threshold", "0.2", "--logprob-threshold", "-2"])
    assert (cli_infer.decoding_options(asked).no_speech_threshold, cli_infer.decoding_options(asked).logprob_threshold) == (0.2, -2)


def test_every_decoding_option_is_a_flag_with_the_options_default_and_its_value_reaches_the_search(capsys):
    """infer.py's decoding flags are made from DecodingOptions' fields: one per option a user sets (not
    frame_seconds, the model's), each defaulting to the field's default and passing its value on."""
    user = [f for f in dataclasses.fields(DecodingOptions) if "set_from" not in f.metadata]
    assert [f.name for f in dataclasses.fields(DecodingOptions) if f not in user] == ["frame_seconds"]
    defaults = cli_infer.parse_args(["--ckpt", "runs/x", "a.wav"])
    assert {f.name: getattr(defaults, f.name) for f in user} == {f.name: f.default for f in user}
    assert cli_infer.decoding_options(defaults) == DecodingOptions()
    asked = {"beam_size": 3, "length_penalty": 0.5, "max_delta": 7, "max_new_tokens": 9, "ctc_weight": 0.6,
             "ctc_candidates": 5, "max_repeats": 2, "max_tokens_per_second": 12.5, "no_speech_threshold": 0.4,
             "logprob_threshold": -0.7, "lm": "runs/x/lm.pt", "lm_weight": 0.5}
    assert set(asked) == {f.name for f in user}  # a new option needs a value here
    assert all(value != getattr(DecodingOptions(), name) for name, value in asked.items())
    flags = [arg for name, value in asked.items() for arg in ("--" + name.replace("_", "-"), str(value))]
    assert cli_infer.decoding_options(cli_infer.parse_args(["--ckpt", "runs/x", "a.wav", *flags])) \
        == DecodingOptions(**asked)
    with pytest.raises(SystemExit):
        cli_infer.parse_args(["--ckpt", "runs/x", "a.wav", "--frame-seconds", "0.04"])
    assert "unrecognized arguments: --frame-seconds" in capsys.readouterr().err


class TracedBeams:
    """The model as a search steps it, recording the generated ids each row holds after every step
    that is fed back (`cache.reorder` moves the survivors' histories, `decode_step` appends their tokens)."""

    def __init__(self, model):
        self.model, self.cfg = model, model.cfg
        self.rows, self.beams = None, []

    def new_cache(self, memory, memory_lens, max_len, rows_per_utterance=1):
        cache = self.model.new_cache(memory, memory_lens, max_len, rows_per_utterance)
        reorder = cache.reorder

        def traced_reorder(index):
            self.rows = [self.rows[i] for i in index.tolist()]
            reorder(index)

        cache.reorder = traced_reorder
        return cache

    def decode_step(self, tokens, cache):
        if self.rows is None:  # the prompt
            self.rows = [() for _ in range(tokens.size(0))]
        else:
            self.rows = [row + (t,) for row, t in zip(self.rows, tokens[:, 0].tolist())]
            self.beams.append(self.rows)
        return self.model.decode_step(tokens, cache)


def test_a_beam_search_fuses_the_runs_own_ngram_unless_told_not_to(loaded, tmp_path):
    """A run directory with an lm.pt (train.lm_order): transcribe's beam search fuses it as --lm would;
    lm_weight 0 and greedy decoding leave the model alone. The n-gram knows other sentences only, and a
    heavy weight pulls the overfit model's text towards them."""
    from aed.decode_lm import NGramLM
    from aed.decode_transcribe import transcribe

    run = tmp_path / "run"
    run.mkdir()
    os.symlink(loaded.path, run / os.path.basename(os.path.normpath(loaded.path)))
    tok = loaded.tokenizer
    others = [("Eins eins eins.", "de"), ("One one one.", "en"), ("Uno uno uno.", "es")]
    NGramLM([tok.encode(t, lang) for t, lang in others], tok.padded_vocab_size, tok.eos, order=4).save(run / "lm.pt")
    own = load_model(str(run))
    assert own.lm == str(run / "lm.pt") and loaded.lm is None
    requests = read_requests(EXAMPLES)

    def texts(model, **options):
        return [r.pred_text for r in transcribe(model, requests, DecodingOptions(**options))[0]]

    fused = texts(own, beam_size=3, lm_weight=2.0)
    assert fused == texts(loaded, beam_size=3, lm_weight=2.0, lm=str(run / "lm.pt"))
    plain = texts(loaded, beam_size=3)
    assert fused != plain, "the n-gram should change some text, or this test shows nothing"
    assert texts(own, beam_size=3, lm_weight=0.0) == plain
    assert texts(own, lm_weight=2.0) == texts(loaded)  # greedy: the model alone


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_search_keeps_the_best_hypotheses_and_beats_greedy_unless_they_displaced_it(loaded, alpha):
    """What beam search promises, checked at every step of real decodes against scores recomputed
    in float64 without the cache: the K hypotheses kept are the best K extensions of the last beam, and
    the answer is the best extension of the last. Nothing more: greedy's path may leave the beam for K
    prefixes that outrank it and end below it, so beam outranks greedy only where greedy's path stayed
    in the beam. The attention decoder alone, without the loop guard (the joint CTC search and the
    guard's charge are checked in tests/test_decode_search.py); noise on its weights makes the overfit
    model unsure, so beams hold rival hypotheses."""
    k = 4
    options = DecodingOptions(beam_size=k, length_penalty=alpha, ctc_weight=0.0, max_repeats=0)
    torch.manual_seed(0)
    model = copy.deepcopy(loaded.model)
    with torch.no_grad():
        for p in model.decoder.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference = copy.deepcopy(model).double()
    dev = [r for r in read_requests(os.path.join(MINI, "dev.jsonl")) if r.source_lang == "en"][:4]
    requests = read_requests(EXAMPLES) + dev
    wavs = [load_audio(r.audio_filepath) for r in requests]
    lens = torch.tensor([w.numel() for w in wavs])
    batch = torch.zeros(len(wavs), int(lens.max()))  # (B, S)
    for i, w in enumerate(wavs):
        batch[i, : w.numel()] = w
    prompt = torch.tensor(request_prompts(requests, loaded.tokenizer))  # (B, P)
    eos = loaded.tokenizer.eos
    with torch.no_grad():
        memory, memory_lens = model.encode(*LogMel(loaded.features).eval()(batch, lens))
    traced = TracedBeams(model)
    answers = beam_search(traced, memory, memory_lens, prompt, eos, options)
    greedy = greedy_search(model, memory, memory_lens, prompt, eos, options)
    limits = token_budget(model, memory_lens, prompt.size(1), options).tolist()
    assert traced.beams and all(len(beam) == len(requests) * k for beam in traced.beams)
    # The search adds float32 log-softmaxes of float32 logits: each term is off by a few float32 ulps of
    # the step's largest logit. 16 per step bound the error of both sides of a comparison (a length
    # penalty, >= 1, only divides it).
    eps = torch.finfo(torch.float32).eps

    for b, req in enumerate(requests):
        mem = memory[b : b + 1, : memory_lens[b]].double()  # (1, T', D)

        def log_probs(prefixes):
            """Generated-id tuples of one length (R) -> float64 log-probs of each next token (R, V), and
            the largest logit."""
            tokens = torch.tensor([prompt[b].tolist() + list(p) for p in prefixes])  # (R, P + U)
            r = len(prefixes)
            with torch.no_grad():
                hidden = reference.decoder(tokens, mem.expand(r, -1, -1), memory_lens[b].repeat(r))  # (R, P + U, D)
                logits = reference.decoder.output_proj(hidden[:, -1])  # (R, V)
            return F.log_softmax(logits, dim=-1), float(logits.abs().max())

        def ended(p):
            return eos in p or len(p) >= limits[b]

        def length(p):  # tokens generated, EOS included, as the search counts them
            return min(p.index(eos) + 1 if eos in p else len(p), limits[b])

        def rank(p):
            return scores[p] / float(length_penalty(torch.tensor(float(length(p))), alpha))

        scores, largest = {(): 0.0}, 0.0  # hypotheses seen -> summed log-probability
        beam = [()]
        displaced = False  # greedy's path left the beam
        g = tuple(greedy[b]) + ((eos,) if len(greedy[b]) < limits[b] else ())
        for step, kept in enumerate([*[rows[b * k : (b + 1) * k] for rows in traced.beams], None], start=1):
            candidates = []
            live = sorted({p for p in beam if not ended(p)})
            for p in {p for p in beam if ended(p)}:  # a finished hypothesis only waits, at no cost
                candidates.append(p + (eos,))
                scores[p + (eos,)] = scores[p]
            if live:
                logp, top = log_probs(live)
                largest = max(largest, top)
                for p, row in zip(live, logp.tolist()):
                    for token, lp in enumerate(row):
                        candidates.append(p + (token,))
                        scores[p + (token,)] = scores[p] + lp
            tol = 16 * step * eps * (largest + 1)
            best = max(rank(c) for c in candidates)
            g_prefix = (g + (eos,) * step)[:step]
            if kept is None:  # the last step: its best extension is the answer
                found = [c for c in candidates if list(c[: c.index(eos)] if eos in c else c) == answers[b]]
                assert len(found) == 1, (req.audio_filepath, answers[b], "not an extension of the last beam")
                assert rank(found[0]) >= best - tol, (req.audio_filepath, step, rank(found[0]), best)
                if not displaced:  # then greedy's hypothesis was among the last step's candidates
                    assert g_prefix in candidates and rank(found[0]) >= rank(g_prefix) - tol, (
                        req.audio_filepath, answers[b], greedy[b])
                break
            assert set(kept) <= set(candidates) and len(set(kept)) == k, (req.audio_filepath, step)
            passed_over = max((rank(c) for c in set(candidates) - set(kept)), default=float("-inf"))
            assert min(rank(p) for p in kept) >= passed_over - tol, (req.audio_filepath, step)
            displaced |= g_prefix not in kept
            beam = kept


def test_max_new_tokens_caps_every_utterance(loaded):
    requests = read_requests(EXAMPLES)
    full, _ = transcribe(loaded, requests)
    capped, _ = transcribe(loaded, requests, DecodingOptions(max_new_tokens=3))
    assert [r.tokens for r in capped] == [r.tokens[:3] for r in full]  # greedy: a prefix of the full output
    capped_beam, _ = transcribe(loaded, requests, DecodingOptions(beam_size=2, max_new_tokens=3))
    assert all(len(r.tokens) <= 3 for r in capped_beam)


def test_joint_ctc_decoding_is_on_by_default_for_a_model_with_a_ctc_head(loaded):
    """A CTC head that hears only blanks: joint decoding (the default) ends every hypothesis at once,
    ctc_weight=0 gives the attention decoder's transcripts unchanged."""
    requests = read_requests(EXAMPLES)
    plain, _ = transcribe(loaded, requests)
    with_head = dataclasses.replace(loaded, model=copy.deepcopy(loaded.model))
    with_head.model.ctc = CTCHead(loaded.model.cfg.enc_d_model, loaded.model.cfg.vocab_size + 1)
    with torch.no_grad():
        with_head.model.ctc.proj.weight.zero_()
        with_head.model.ctc.proj.bias.zero_()
        with_head.model.ctc.proj.bias[-1] = 50.0  # blank at every frame
    attention_only, _ = transcribe(with_head, requests, DecodingOptions(ctc_weight=0.0))
    joint, _ = transcribe(with_head, requests)
    assert [r.tokens for r in attention_only] == [r.tokens for r in plain] and all(r.tokens for r in plain)
    assert [r.tokens for r in joint] == [[] for _ in requests]


def test_no_speech_check_is_the_first_steps_eos_probability_and_whispers_second_condition_keeps_confident_text(
        loaded, tmp_path):
    """Whisper's check with aed's non-speech target: P(EOS) right after the prompt above the threshold
    (and with a logprob_threshold, Whisper's second condition: the decoder's mean log-probability of its
    hypothesis at most that). Biased towards EOS at that step, the model still writes text for a file,
    confidently: the default empties it, and its --out line counts it with its seconds; Whisper's -1
    keeps it, and so does any threshold below its mean."""
    from aed.decode_search import no_speech_probs

    requests = read_requests(EXAMPLES)
    plain, _ = transcribe(loaded, requests, DecodingOptions(no_speech_threshold=None))
    kept, _ = transcribe(loaded, requests)  # the check is on by default
    assert [r.tokens for r in kept] == [r.tokens for r in plain] and all(r.tokens for r in plain)
    probs = [r.no_speech_prob for r in kept]
    assert all(0 <= p < 0.5 for p in probs), probs  # a trained model on its own training speech
    # The probability is the softmax of the first step's logits at EOS, as computed by hand.
    model, tok = loaded.model, loaded.tokenizer
    wav = load_audio(requests[0].audio_filepath)
    feats, feat_lens = LogMel(loaded.features).eval()(wav[None], torch.tensor([wav.numel()]))
    prompt = torch.tensor([tok.prompt_ids(requests[0].source_lang, requests[0].target_lang, requests[0].pnc)])
    with torch.no_grad():
        memory, memory_lens = model.encode(feats, feat_lens)
        hidden = model.decoder(prompt, memory, memory_lens)[:, -1]
        by_hand = torch.softmax(model.decoder.output_proj(hidden).float(), -1)[0, tok.eos]
    assert float(no_speech_probs(model, memory, memory_lens, prompt, tok.eos)[0]) == pytest.approx(float(by_hand),
                                                                                                abs=1e-5)
    assert probs[0] == pytest.approx(float(by_hand), abs=1e-4)
    # EOS made likelier (a bias on its logit) until the first file gives it 0.2-0.5 at the first step,
    # where greedy search still writes text: above the default threshold (0.1), below one of 0.5.
    first = requests[:1]
    biased = dataclasses.replace(loaded, model=copy.deepcopy(loaded.model))
    for _ in range(80):
        with torch.no_grad():
            biased.model.decoder.output_proj.bias[tok.eos] += 0.25
        (probe,), _ = transcribe(biased, first, DecodingOptions(no_speech_threshold=0.5, ctc_weight=0.0))
        if probe.no_speech_prob > 0.2:
            break
    assert 0.2 < probe.no_speech_prob < 0.5 and probe.tokens
    # Its text's mean log-probability, by hand: the uncached decoder's, of its tokens and EOS.
    said = torch.tensor([probe.tokens + [tok.eos]])
    with torch.no_grad():
        hidden = biased.model.decoder(torch.cat([prompt, said[:, :-1]], dim=1), memory, memory_lens)
        logp = torch.log_softmax(biased.model.decoder.output_proj(hidden).float(), -1)[0, prompt.size(1) - 1:]
    mean = float(logp.gather(1, said[0, :, None]).mean())
    assert -1.0 < mean < 0.0  # confident: Whisper's second condition (-1) is not met
    (kept,), _ = transcribe(biased, first, DecodingOptions(ctc_weight=0.0, logprob_threshold=-1.0))
    assert kept.tokens == probe.tokens and kept.to_json()["skipped"] == {"segments": 0, "seconds": 0.0}
    for logprob_threshold, emptied in ((mean - 0.05, False), (mean + 0.05, True), (None, True)):  # None: the default
        (res,), _ = transcribe(biased, first, DecodingOptions(ctc_weight=0.0, logprob_threshold=logprob_threshold))
        assert (res.tokens, res.pred_text) == (([], "") if emptied else (probe.tokens, probe.pred_text))
        assert res.no_speech_prob == probe.no_speech_prob
        skipped = res.to_json()["skipped"]
        assert skipped["segments"] == emptied and skipped["seconds"] == pytest.approx(emptied * res.duration, abs=1e-3)
    assert "no_speech_prob" in res.to_json() and "no_speech_prob" not in plain[0].to_json()
    assert "skipped" not in plain[0].to_json()


@pytest.mark.slow
def test_cli_directory_with_a_corrupt_file_and_a_manifest(run_dir, tmp_path):
    audio = tmp_path / "clips"
    (audio / "sub").mkdir(parents=True)
    shutil.copy(os.path.join(MINI, "examples", "en_asr_16k.wav"), audio / "a.wav")
    shutil.copy(os.path.join(MINI, "audio", "train_en_000058.flac"), audio / "sub" / "b.flac")
    (audio / "corrupt.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot really")
    (audio / "notes.txt").write_text("not audio: ignored")
    out = tmp_path / "hyp.jsonl"
    p = run_in_process(cli_infer.main, ["--ckpt", run_dir, str(audio), "--manifest", EXAMPLES, "--out", str(out)])
    assert p.returncode == 1, p.stderr  # some input failed
    assert "FAILED" in p.stderr and "corrupt.wav: cannot decode" in p.stderr
    lines = dict(line.split("\t") for line in p.stdout.splitlines())
    assert lines[str(audio / "a.wav")] == "Laugh at your problems; everybody else does."
    assert lines[str(audio / "sub" / "b.flac")] == "Cats are smarter than dogs."
    assert lines[os.path.join(MINI, "examples", "es-en_ast_16k.wav")] == "No all slip means a fall."
    assert len(lines) == 5  # 3 from the manifest + 2 readable files; notes.txt is not an input

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6  # every input, the failed one included, with its reason
    assert [r for r in rows if "error" in r][0]["audio_filepath"].endswith("corrupt.wav")
    ast = next(r for r in rows if r.get("taskname") == "ast")
    assert ast["pred_text"] == ast["text"] and ast["source_lang"] == "es" and ast["target_lang"] == "en"
    assert all({"duration", "decode_time", "pnc"} <= set(r) for r in rows)
    assert "asr de: WER 0.00%" in p.stderr and "ast es-en: BLEU 100.00" in p.stderr
    assert "RTFx" in p.stderr and "encoder" in p.stderr and "decoder" in p.stderr


# --- inputs, without a model ------------------------------------------------------------------


def test_manifest_lines_override_the_defaults_and_bad_lines_name_the_field(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text("\n".join(json.dumps(d) for d in [
        {"audio_filepath": "a.wav"},
        {"audio_filepath": "/abs/b.wav", "source_lang": "es", "target_lang": "en", "text": "Hi.", "duration": 2.5},
        {"audio_filepath": "c.wav", "lang": "de", "pnc": "no", "offset": 1.0, "answer": "Hallo"},
    ]) + "\n")
    a, b, c = read_requests(str(m), source_lang="fr")
    assert a.audio_filepath == str(tmp_path / "a.wav")  # relative to the manifest's folder
    assert (a.source_lang, a.target_lang, a.taskname, a.pnc, a.duration) == ("fr", "fr", "asr", True, None)
    assert (b.source_lang, b.target_lang, b.taskname, b.text, b.duration) == ("es", "en", "ast", "Hi.", 2.5)
    assert (c.source_lang, c.target_lang, c.pnc, c.offset, c.text) == ("de", "de", False, 1.0, "Hallo")

    for line, message in [('{"duration": 1}', "m.jsonl:1: field 'audio_filepath'"),
                          ('{"audio_filepath": "a.wav", "duration": -1}', "m.jsonl:1: field 'duration'"),
                          ('{"audio_filepath": "a.wav", "pnc": "maybe"}', "m.jsonl:1: field 'pnc'"),
                          ('{"audio_filepath": "a.wav", "source_lang": "es", "target_lang": "en", "taskname": "asr"}',
                           "m.jsonl:1: field 'taskname'"),
                          ("{not json", "m.jsonl:1: not valid JSON")]:
        m.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            read_requests(str(m))


def test_requests_and_training_utterances_share_fields_and_messages(tmp_path):
    m = tmp_path / "m.jsonl"
    full = {"audio_filepath": "a.wav", "duration": 2.0, "offset": 0.5, "text": "Hola.", "source_lang": "en",
            "target_lang": "es", "pnc": "no", "taskname": "s2t_translation"}
    m.write_text(json.dumps(full) + "\n")
    (req,), (utt,) = read_requests(str(m)), read_manifest(str(m))
    fields = ("audio_filepath", "source_lang", "target_lang", "pnc", "taskname", "offset", "duration", "text", "where")
    assert [getattr(req, f) for f in fields] == [getattr(utt, f) for f in fields]
    for bad in ({"pnc": "maybe"}, {"offset": -1}, {"duration": 0}, {"taskname": "asr"}, {"source_lang": 7}):
        m.write_text(json.dumps(full | bad) + "\n")
        with pytest.raises(ManifestError) as strict:
            read_manifest(str(m))
        with pytest.raises(ManifestError) as lenient:
            read_requests(str(m))
        assert str(strict.value) == str(lenient.value) and f"m.jsonl:1: field '{next(iter(bad))}'" in str(strict.value)


def test_corpus_scores_per_language_pair_and_pooled_asr_wer():
    rows = [("asr", "en", "en", "the cat sat", "the cat sat"), ("ast", "es", "en", "a b c d", "a b c d"),
            ("asr", "de", "de", "Ein Hund.", "ein hund"), ("asr", "en", "en", "on the mat", "on a mat")]
    scores, asr_wer = corpus_scores(rows)
    assert list(scores) == ["asr de", "asr en", "ast es-en"]
    assert scores["asr en"] == {"wer": pytest.approx(100 / 6), "wer_pnc": pytest.approx(100 / 6), "n": 2}
    assert scores["asr de"] == {"wer": 0.0, "wer_pnc": 100.0, "n": 1}  # normalised vs raw text
    assert scores["ast es-en"]["n"] == 1 and scores["ast es-en"]["bleu"] == pytest.approx(100.0)
    assert asr_wer == pytest.approx(100 / 8) == wer([r[3] for r in rows if r[0] == "asr"],
                                                    [r[4] for r in rows if r[0] == "asr"])
    assert corpus_scores(rows[1:2]) == ({"ast es-en": scores["ast es-en"]}, None)


def test_expand_inputs_walks_directories_and_keeps_unmatched_patterns(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    for name in ("d/x.wav", "d/e/y.FLAC", "d/readme.txt", "z.ogg"):
        (tmp_path / name).write_bytes(b"")
    assert expand_inputs([str(tmp_path / "d")]) == [str(tmp_path / "d" / "e" / "y.FLAC"), str(tmp_path / "d" / "x.wav")]
    assert expand_inputs([str(tmp_path / "*.ogg")]) == [str(tmp_path / "z.ogg")]
    assert expand_inputs([str(tmp_path / "*.mp3")]) == [str(tmp_path / "*.mp3")]  # reported as not found later


def test_average_of_the_newest_checkpoints(run_dir, tmp_path):
    """--average N decodes with the mean weights of a run's newest N checkpoints; asking for more
    than the run keeps is an error that says so."""
    from aed.model_checkpoint import average_checkpoints, checkpoint_step, read_checkpoint

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    newest = read_checkpoint(str(run / os.listdir(run)[0]))
    for step, scale in ((1, 0.5), (2, 1.5)):  # two older checkpoints whose weights average to the newest
        older = dict(newest, model={k: v * scale if v.is_floating_point() else v for k, v in newest["model"].items()})
        save_checkpoint(older, str(run), step, keep_last=3)
    paths, averaged = average_checkpoints(str(run), 3)
    assert [checkpoint_step(p) for p in paths] == [1, 2, checkpoint_step(os.listdir(run_dir)[0])]
    for k, v in newest["model"].items():
        assert torch.allclose(averaged["model"][k], v * (1 + 0.5 + 1.5) / 3 if v.is_floating_point() else v)
    _, two = average_checkpoints(str(run), 2)  # the newest and ckpt-2: 1.25 x the weights
    w = "decoder.output_proj.weight"
    assert torch.allclose(two["model"][w], newest["model"][w] * 1.25)
    assert load_model(str(run), average=2).model.state_dict()[w].allclose(newest["model"][w] * 1.25)
    with pytest.raises(CheckpointError, match="3 valid checkpoint.*asked to average 4"):
        load_model(str(run), average=4)


def test_a_checkpoint_saved_when_the_ctc_loss_weight_was_model_ctc_weight_loads_with_its_head(tmp_path):
    """The CTC loss weight was model.ctc_weight: a checkpoint whose saved model config has that key
    (a run's DCP directory, or a single file) loads as it was trained, CTC head and weights included.
    The bundled word models were saved so."""
    torch.manual_seed(0)
    tokenizer = Tokenizer.load(os.path.join(MINI, "tokenizer"))
    cfg = AEDConfig(n_mels=80, vocab_size=tokenizer.padded_vocab_size, pad_id=tokenizer.pad, enc_d_model=32,
                    enc_layers=1, enc_heads=2, subsampling_channels=8, dec_d_model=32, dec_layers=1, dec_heads=2,
                    dec_max_len=64, ctc_loss_weight=0.3)
    model = AED(cfg)
    saved = dataclasses.asdict(cfg)
    saved["ctc_weight"] = saved.pop("ctc_loss_weight")
    state = {"step": 1, "model": model.state_dict(), "model_config": saved,
             "features": dataclasses.asdict(FeatureConfig(n_mels=80)),
             "tokenizer": pack_dir(os.path.join(MINI, "tokenizer"))}
    save_checkpoint(dict(state), str(tmp_path / "run"), 1, keep_last=1)
    torch.save(state, tmp_path / "old.pt")
    for path in (tmp_path / "run", tmp_path / "old.pt"):
        loaded = load_model(str(path))
        assert loaded.model.cfg == cfg and loaded.model.ctc is not None, path
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.model.state_dict().items())
    word_model = os.path.join(ROOT, "tests", "fixtures", "word_model.pt")
    assert "ctc_weight" in torch.load(word_model, weights_only=False)["model_config"]
    assert load_model(word_model).model.cfg.ctc_loss_weight == 0.5


@pytest.mark.slow
def test_the_speed_bench_runs_its_files_part_alone_and_ends_with_its_json():
    """`--parts files` (no decoder-step timing): the long-file ratio is reported and the JSON is the last
    line. Each system's peak memory counts its own model only: int8's lacks the fp32 weights it replaced."""
    p = subprocess.run([sys.executable, "bench/infer_speed_bench.py", "--layouts", "canary-180m-flash", "--systems",
                        "aed-int8", "aed-eager", "--parts", "files", "--utterances", "2", "--tokens", "3",
                        "--batch-sizes", "1", "--long-seconds", "30", "--no-peers", "--threads", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert not any(summary["decoder_step_ms"].values()) and summary["long_file_vs_short_files"] > 0
    systems = {name.split("/")[0]: rows["batch1"] for name, rows in summary["systems"].items()}
    assert systems["aed-eager"]["tokens"] == systems["aed-int8"]["tokens"] == 2 * 3
    # 180M weights: 0.73 GB in fp32; int8 keeps ~0.2 GB of its Linear layers' 0.69 GB
    assert systems["aed-int8"]["peak_gb"] < systems["aed-eager"]["peak_gb"] - 0.3, systems


def test_the_speed_bench_counts_the_weight_bytes_a_decoder_step_reads():
    """Every decoder Linear but the cross-attention keys and values (projected once per utterance), the
    output layer once (tied to the embedding); int8 reads a quarter of fp32's bytes."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from infer_speed_bench import step_weight_bytes

    cfg = AEDConfig(vocab_size=48, enc_d_model=16, enc_layers=1, enc_heads=2, subsampling_channels=8, dec_d_model=24,
                    dec_layers=2, dec_heads=2, dec_ff_mult=3)
    d, ff = cfg.dec_d_model, cfg.dec_ff_mult * cfg.dec_d_model
    weights = cfg.dec_layers * (4 * d * d + 2 * d * d + 2 * d * ff) + d * cfg.vocab_size  # self q,k,v,o; cross q,o
    model = AED(cfg)
    assert step_weight_bytes(model, "aed-eager") == 4 * weights
    assert step_weight_bytes(model, "aed-int8") == weights
