import json
import os

import numpy as np
import pytest
import soundfile as sf
import torch

from aed.data_audio import FeatureConfig, LogMel, load_audio
from aed.data_audio import AudioError
from aed.data_batch import (ROUNDING_SLACK, Collate, ExampleDataset, duration_batches, encode_utterance,
                            fit_duration, make_item)
from aed.data_manifest import ManifestError, iter_manifest, read_manifest
from aed.data_tokenizer import Tokenizer
from aed.decode_transcribe import read_requests, request_prompts

MINI = os.path.join(os.path.dirname(__file__), "..", "data", "mini")


def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def rec(**kw):
    base = {"audio_filepath": "a.wav", "duration": 1.0, "text": "Hello.", "source_lang": "en",
            "target_lang": "en"}
    base.update(kw)
    return {k: v for k, v in base.items() if v is not None}


def test_fields_defaults_and_relative_paths(tmp_path):
    m = write_lines(tmp_path / "m.jsonl", [
        rec(), "", rec(audio_filepath="/abs/b.wav", answer="Hola.", text=None, source_lang="en",
                      target_lang="es", pnc="no", offset=2.5)])
    a, b = read_manifest(m)
    assert a.audio_filepath == str(tmp_path / "a.wav") and a.taskname == "asr" and a.pnc
    assert b.audio_filepath == "/abs/b.wav" and b.text == "Hola." and b.taskname == "ast"
    assert not b.pnc and b.offset == 2.5 and b.where.endswith("m.jsonl:3")


def test_lang_sets_both_languages(tmp_path):
    m = write_lines(tmp_path / "m.jsonl", [rec(source_lang=None, target_lang=None, lang="de")])
    (u,) = read_manifest(m)
    assert (u.source_lang, u.target_lang, u.taskname) == ("de", "de", "asr")


@pytest.mark.parametrize("bad, field", [
    (rec(duration=-1), "duration"), (rec(duration="2"), "duration"), (rec(text=""), "text"),
    (rec(text=None), "text"), (rec(audio_filepath=None), "audio_filepath"),
    (rec(source_lang=None), "source_lang"), (rec(pnc="maybe"), "pnc"),
    (rec(taskname="asr", target_lang="es"), "taskname"), (rec(taskname="x"), "taskname"),
    (rec(offset=-2), "offset"),
])
def test_errors_name_file_line_and_field(tmp_path, bad, field):
    m = write_lines(tmp_path / "m.jsonl", [rec(), bad])
    with pytest.raises(ManifestError, match=rf"m\.jsonl:2: field '{field}'"):
        read_manifest(m)


def test_invalid_json_and_skip_invalid_counts(tmp_path, caplog):
    m = write_lines(tmp_path / "m.jsonl", [rec(), "{not json", rec(duration=0), rec()])
    with pytest.raises(ManifestError, match=r"m\.jsonl:2: not valid JSON"):
        read_manifest(m)
    assert len(list(iter_manifest(m, skip_invalid=True))) == 2
    assert "skipped 2 invalid line(s)" in caplog.text


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.load(os.path.join(MINI, "tokenizer"))


def test_dataset_collate_offsets_and_bad_audio(tmp_path, tokenizer):
    rng = np.random.default_rng(0)
    long = rng.standard_normal(16000 * 3).astype("float32") * 0.1
    sf.write(tmp_path / "long.wav", long, 16000, subtype="FLOAT")
    (tmp_path / "corrupt.wav").write_bytes(b"RIFF not really a wav")
    m = write_lines(tmp_path / "m.jsonl", [
        rec(audio_filepath="long.wav", duration=3.0, text="A long one."),
        rec(audio_filepath="long.wav", duration=1.0, offset=1.5, text="Hola.", target_lang="es"),
        rec(audio_filepath="corrupt.wav", text="Broken."),
        rec(audio_filepath="missing.wav", text="Gone."),
    ])
    logmel = LogMel(FeatureConfig(n_mels=80)).eval()
    ds = ExampleDataset(read_manifest(m), tokenizer, logmel)
    batch = Collate(tokenizer.pad)([ds[i] for i in range(len(ds))])

    assert len(batch) == 2 and batch.indices == [0, 1]
    assert len(batch.errors) == 2
    assert "m.jsonl:3" in batch.errors[0] and "corrupt.wav" in batch.errors[0]
    assert "m.jsonl:4" in batch.errors[1] and "file not found" in batch.errors[1]
    assert batch.feats.shape == (2, 300, 80) and batch.feat_lens.tolist() == [300, 100]
    assert batch.feats[1, 100:].abs().sum() == 0
    # The offset segment equals features computed from the same samples directly.
    seg = torch.from_numpy(long[24000:40000])
    direct, _ = logmel(seg[None], torch.tensor([16000]))
    torch.testing.assert_close(batch.feats[1, :100], direct[0])
    # Tokens: prompt + text + EOS, right padded; the AST row has the translate prompt.
    ids0, p0 = tokenizer.encode_example("A long one.", "en", "en", True)
    ids1, p1 = tokenizer.encode_example("Hola.", "en", "es", True, task="translate")
    assert batch.token_lens.tolist() == [len(ids0), len(ids1)]
    assert batch.prompt_lens.tolist() == [p0, p1]
    assert batch.tokens[0, : len(ids0)].tolist() == ids0
    assert batch.tokens[1, : len(ids1)].tolist() == ids1
    assert (batch.tokens[1, len(ids1):] == tokenizer.pad).all()
    assert tokenizer.decode(batch.tokens[1, p1: len(ids1) - 1].tolist()) == "Hola."
    assert batch.transcribed.tolist() == [True, False]  # the translation's text was never spoken


def test_make_item_is_the_item_of_files_and_shards_and_inference_prompts_agree(tmp_path, tokenizer):
    wav = (np.random.default_rng(1).standard_normal(16000 * 2) * 0.1).astype("float32")
    sf.write(tmp_path / "a.wav", wav, 16000, subtype="FLOAT")
    m = write_lines(tmp_path / "m.jsonl", [
        rec(duration=2.0, text="Hola.", source_lang="en", target_lang="es", pnc="no"),
        rec(duration=1.0, offset=0.5, text="A segment."),
    ])
    logmel = LogMel(FeatureConfig(n_mels=80)).train()  # dither on: the seed must match too
    utts = read_manifest(m)
    per_file = ExampleDataset(utts, tokenizer, logmel, seed=3)
    for i, (utt, prompt) in enumerate(zip(utts, request_prompts(read_requests(m), tokenizer))):
        item = per_file[i]
        direct = make_item(load_audio(utt.audio_filepath, utt.offset, utt.duration), utt, i, tokenizer, logmel, seed=3)
        assert item.keys() == direct.keys() and torch.equal(item["feats"], direct["feats"])
        assert (item["tokens"], item["prompt_len"], item["index"]) == (direct["tokens"], direct["prompt_len"], i)
        assert item["tokens"][: item["prompt_len"]] == prompt  # inference prompts the model as training did
        # The same utterance as a shard example (aed/data_shards.py): its audio already cut to the segment.
        seg = tmp_path / f"seg{i}.wav"
        sf.write(seg, load_audio(utt.audio_filepath, utt.offset, utt.duration).numpy(), 16000, subtype="FLOAT")
        ex = {"audio": seg.read_bytes(), "duration": utt.duration, "text": utt.text, "source_lang": utt.source_lang,
              "target_lang": utt.target_lang, "pnc": utt.pnc, "taskname": utt.taskname, "where": f"s.tar#{i}"}
        shard_item = ExampleDataset(None, tokenizer, logmel, seed=3)[ex]
        assert shard_item["audio_filepath"] == f"s.tar#{i}"
        assert (shard_item["tokens"], shard_item["prompt_len"]) == (item["tokens"], item["prompt_len"])
        assert torch.equal(shard_item["feats"], make_item(load_audio(utt.audio_filepath, utt.offset, utt.duration),
                                                          utt, shard_item["index"], tokenizer, logmel, seed=3)["feats"])


def test_an_items_dither_is_its_seed_and_index_alone(tmp_path, tokenizer):
    """make_item draws the dither from a generator of (seed, index): torch's global random state is
    neither read nor moved, so a worker's other draws cannot change an item, nor an item theirs."""
    wav = (np.random.default_rng(2).standard_normal(16000) * 0.1).astype("float32")
    sf.write(tmp_path / "a.wav", wav, 16000, subtype="FLOAT")
    utt = read_manifest(write_lines(tmp_path / "m.jsonl", [rec(text="A.")]))[0]
    wav = torch.from_numpy(wav)
    logmel = LogMel(FeatureConfig(n_mels=80)).train()
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    first = make_item(wav, utt, 5, tokenizer, logmel, seed=3)["feats"]
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(123)  # another global state: the same item
    assert torch.equal(make_item(wav, utt, 5, tokenizer, logmel, seed=3)["feats"], first)
    assert not torch.equal(make_item(wav, utt, 6, tokenizer, logmel, seed=3)["feats"], first)
    assert not torch.equal(make_item(wav, utt, 5, tokenizer, logmel, seed=4)["feats"], first)


def test_duration_batches_respect_the_padded_budget_and_cover_every_index_once():
    durations = np.random.default_rng(0).uniform(0.5, 20.0, 500).tolist() + [45.0, 12.0, 12.0]
    budget = 60.0
    batches = duration_batches(durations, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(durations)))
    longest = [durations[b[0]] for b in batches]
    assert longest == sorted(longest, reverse=True), "longest first"
    for b in batches:
        assert durations[b[0]] == max(durations[i] for i in b)
        assert len(b) * durations[b[0]] <= budget
    assert [len(b) for b in duration_batches([3.0, 1.0, 2.0, 2.5], 6.0)] == [2, 2]  # padded 2 x 3 s, then 2 x 2 s
    assert duration_batches([5.0, 1.0], 2.0) == [[0], [1]]  # over the budget alone: a batch of its own
    assert duration_batches([], 10.0) == []


@pytest.mark.parametrize("loss_on_prompt", [True, False])
def test_sampler_token_counts_are_the_batch_lengths_and_count_targets_is_what_the_loss_scores(loss_on_prompt):
    """The sampler buckets on num_tokens (train.py: len(encode_utterance(...)[0])), the batch pads to
    those lengths, and the global loss normaliser (count_targets) equals the forward's own count."""
    from aed.model import AED, AEDConfig
    from aed.train_setup import count_targets

    tok = Tokenizer.load(os.path.join(MINI, "tokenizer"))
    utts = read_manifest(os.path.join(MINI, "train.jsonl"))[:6]  # asr and ast, four languages
    num_tokens = [len(encode_utterance(tok, u)[0]) for u in utts]
    ds = ExampleDataset(utts, tok, LogMel(FeatureConfig(n_mels=80)).eval())
    batch = Collate(tok.pad)([ds[i] for i in range(len(utts))])
    assert batch.token_lens.tolist() == num_tokens and batch.tokens.shape[1] == max(num_tokens)
    torch.manual_seed(0)
    model = AED(AEDConfig(n_mels=80, vocab_size=tok.padded_vocab_size, pad_id=tok.pad, enc_d_model=32, enc_layers=1,
                          enc_heads=2, subsampling_channels=8, dec_d_model=32, dec_layers=1, dec_heads=2,
                          loss_on_prompt=loss_on_prompt)).eval()
    with torch.no_grad():
        _, n = model(batch.feats, batch.feat_lens, batch.tokens, batch.token_lens, batch.prompt_lens)
    assert count_targets(model, [batch]) == int(n)
    expected = [u - 1 if loss_on_prompt else u - p for u, p in zip(num_tokens, batch.prompt_lens.tolist())]
    assert int(n) == sum(expected)


def test_speed_perturbation_copies_each_utterance_at_each_speed_with_its_perturbed_duration(tmp_path):
    from dataclasses import replace

    from aed.train_config import TrainSection, load_train_config
    from aed.config import ConfigError
    from aed.data_sources import ManifestEntry
    from aed.train_data import load_examples

    tokenizer = Tokenizer.load(os.path.join(MINI, "tokenizer"))
    manifest = os.path.join(MINI, "dev.jsonl")
    cfg = TrainSection(manifests=[manifest], speed_perturb=[0.9, 1.0, 1.1], check_audio=False)
    utts, num_tokens = load_examples([ManifestEntry.of(manifest)], cfg, tokenizer, seed=0, rank=0, world_size=1)
    plain = read_manifest(manifest)
    assert [u.speed for u in utts] == [0.9] * len(plain) + [1.0] * len(plain) + [1.1] * len(plain)
    assert [u.perturbed_duration for u in utts[-len(plain):]] == pytest.approx([u.duration / 1.1 for u in plain])
    assert num_tokens[:len(plain)] == num_tokens[-len(plain):]

    # The audio the model sees is the recording played faster: 1/1.1 of its samples, same spectrum shape.
    logmel = LogMel(FeatureConfig(n_mels=80)).eval()
    u = plain[0]
    normal = ExampleDataset([u], tokenizer, logmel)[0]["feats"]
    fast = ExampleDataset([replace(u, speed=1.1)], tokenizer, logmel)[0]["feats"]
    assert len(fast) == pytest.approx(len(normal) / 1.1, abs=2)
    assert len(fast) * 0.01 == pytest.approx(replace(u, speed=1.1).perturbed_duration, abs=0.03)

    with pytest.raises(ConfigError, match="speed_perturb"):
        load_train_config(None, ["train.speed_perturb=[0.9, 1.005]"])


# --- one manifest reader, one count of what was skipped, one tokenization --------------------------


def test_one_reader_for_training_bins_and_tokenizer_training_gz_and_aliases(tmp_path):
    """A gzip manifest with NeMo's `lang` and `answer` reads the same in training, bin estimation
    and tokenizer training, and a bad line stops each with the same file:line:field."""
    import gzip

    from aed.train_data import bins_from_manifests
    from tools.train_tokenizer import read_manifests

    src = [json.loads(x) for x in open(os.path.join(MINI, "train.jsonl"))][:12]
    for r in src:
        r["audio_filepath"] = os.path.abspath(os.path.join(MINI, r["audio_filepath"]))
    nemo = [{"audio_filepath": r["audio_filepath"], "duration": r["duration"], "answer": r["text"],
             "lang": r["source_lang"]} for r in src if r["source_lang"] == r["target_lang"]]
    path = tmp_path / "train.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in nemo)
    utts = read_manifest(str(path))
    assert [(u.text, u.source_lang, u.target_lang) for u in utts] == list(read_manifests([str(path)]))
    tok = Tokenizer.load(os.path.join(MINI, "tokenizer"))
    _, meta = bins_from_manifests([str(path)], tok, 2, 1, method="equal")
    assert meta["used"] == len(nemo) and not meta["skipped"]

    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt", encoding="utf-8") as f:
        f.write(json.dumps(nemo[0]) + "\n" + json.dumps(dict(nemo[0], lang=None)) + "\n")
    for read in (lambda: read_manifest(str(bad)), lambda: list(read_manifests([str(bad)]))):
        with pytest.raises(ManifestError, match=r"bad.jsonl.gz:2: field 'source_lang'"):
            read()


def test_request_fields_is_the_lenient_reading_for_inference(tmp_path):
    from aed.data_manifest import Faults, read_rows, request_fields

    m = write_lines(tmp_path / "m.jsonl", [{"audio_filepath": "x.wav"}, {"audio_filepath": "y.wav", "lang": "de",
                                                                          "answer": "Hallo", "offset": 1.5},
                                           "not json", {"audio_filepath": "z.wav", "duration": -1}])
    faults = Faults()
    rows = list(read_rows(m, lambda d, where, base: request_fields(d, where, base, "en", "en"), True, faults))
    assert [(r["audio_filepath"], r["source_lang"], r["text"], r["duration"], r["offset"], r["segment"]) for r in rows] \
        == [(str(tmp_path / "x.wav"), "en", None, None, 0.0, False), (str(tmp_path / "y.wav"), "de", "Hallo", None, 1.5, True)]
    assert dict(faults.counts) == {"invalid_row": 2} and "2 invalid row" == faults.summary()
    with pytest.raises(ManifestError, match=r"m.jsonl:3: not valid JSON"):
        list(read_rows(m, lambda d, where, base: request_fields(d, where, base)))


def test_each_utterance_is_tokenized_once_and_skips_are_counted(tmp_path):
    """`encodable` counts tokens and carries the ids; the dataset item uses them without encoding
    again. What the tokenizer cannot encode is counted in the Faults passed in."""
    from aed.data_manifest import Faults
    from aed.data_batch import encodable

    tok = Tokenizer.load(os.path.join(MINI, "tokenizer"))
    utts = read_manifest(os.path.join(MINI, "train.jsonl"))[:4]
    utts.append(utts[0].__class__(**{**vars(utts[0]), "source_lang": "xx", "target_lang": "xx"}))
    faults = Faults()
    kept, counts = encodable(utts, tok, skip_invalid=True, faults=faults)
    assert len(kept) == 4 and dict(faults.counts) == {"not_encodable": 1}
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode_example(self, *a, **kw):
            calls.append(a)
            return tok.encode_example(*a, **kw)

    ds = ExampleDataset(kept, Counting(), LogMel(FeatureConfig(n_mels=32)).eval())
    for i, u in enumerate(utts[:4]):
        item = ds[i]
        assert item["tokens"] == encode_utterance(tok, u)[0] and len(item["tokens"]) == counts[i]
        assert item["prompt_len"] == encode_utterance(tok, u)[1]
    assert calls == []


def test_faults_count_by_kind_log_once_and_add_up(caplog):
    from aed.data_manifest import AUDIO_LENGTH, Faults

    a, b = Faults(), Faults()
    assert a.skip("bad_shard", "s0.tar", "gone") and not a.skip("bad_shard", "s0.tar", "gone")
    b.report(["x.flac: cannot decode", f"y.flac: {AUDIO_LENGTH}: ...", "x.flac: cannot decode"], "training")
    assert dict(b.counts) == {"unreadable_audio": 1, "audio_length": 1}
    assert dict(Faults.merged(a, None, b)) == {"bad_shard": 1, "unreadable_audio": 1, "audio_length": 1}
    assert caplog.text.count("s0.tar") == 1 and caplog.text.count("x.flac") == 1
    assert b.summary() == "1 audio length, 1 unreadable audio"


def test_audio_is_checked_against_its_duration_then_held_to_its_bucket_bound():
    """Within the tolerance a whole file's samples are kept up to the rounding slack past its duration
    and cut beyond it (its bucket's batch size was measured at that duration); outside it, an error."""
    rate, audio = 16000, np.zeros(16000 * 10)  # 10 s
    assert len(fit_duration(audio, rate, 10.0, False, "a", 0.1)) == 16000 * 10  # exact
    assert len(fit_duration(audio, rate, 9.996, False, "a", 0.1)) == 16000 * 10  # rounded down: every sample
    assert len(fit_duration(audio, rate, 9.5, False, "a", 0.1)) == round((9.5 + ROUNDING_SLACK) * rate)
    for duration, segment in ((8.5, False), (11.5, False), (11.5, True), (11.5, None)):
        with pytest.raises(AudioError, match="audio length"):
            fit_duration(audio, rate, duration, segment, "a", 0.1)
    assert len(fit_duration(audio, rate, 5.0, True, "a", 0.1)) == round(5.01 * rate)  # a segment of a longer read

