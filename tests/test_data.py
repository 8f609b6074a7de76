import json
import os

import numpy as np
import pytest
import soundfile as sf
import torch

from aed.audio import FeatureConfig, LogMel
from aed.data import Collate, ManifestError, UtteranceDataset, iter_manifest, read_manifest
from aed.tokenizer import Tokenizer

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
    ds = UtteranceDataset(read_manifest(m), tokenizer, logmel)
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
