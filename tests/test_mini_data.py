"""The committed mini data set (data/mini/) is complete and consistent.

Reads only the committed files (json + soundfile), so it runs without espeak-ng or Apertium.
"""

import importlib.util
import json
import os
import re

import pytest
import soundfile as sf

MINI = os.path.join(os.path.dirname(__file__), "..", "data", "mini")
LANGS = {"en", "de", "fr", "es"}
AST_DIRECTIONS = {("en", "es"), ("es", "en")}
FIELDS = {"audio_filepath", "duration", "text", "source_lang", "target_lang", "pnc", "taskname"}


def generator():
    """data/make_mini_data.py, the generator of the set, loaded from its file."""
    spec = importlib.util.spec_from_file_location("make_mini_data", os.path.join(MINI, "..", "make_mini_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_manifest(name):
    with open(os.path.join(MINI, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def key(text):
    """Same identity as the generator's dedup_key: case and punctuation do not make a new sentence."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


@pytest.mark.parametrize("name", ["train.jsonl", "dev.jsonl", "examples.jsonl", "digits/train.jsonl",
                                  "digits/dev.jsonl"])
def test_manifest_fields_and_audio(name):
    entries = read_manifest(name)
    assert entries, f"{name} is empty"
    paths = [e["audio_filepath"] for e in entries]
    assert len(set(paths)) == len(paths), f"{name}: an audio file is listed twice"
    for i, e in enumerate(entries, 1):
        where = f"{name}:{i}"
        assert set(e) == FIELDS, f"{where}: fields {sorted(e)}"
        assert e["source_lang"] in LANGS and e["target_lang"] in LANGS, where
        task = "asr" if e["source_lang"] == e["target_lang"] else "ast"
        pair = f"{e['source_lang']}->{e['target_lang']}"
        assert e["taskname"] == task, f"{where}: taskname {e['taskname']} for {pair}"
        if task == "ast":
            assert (e["source_lang"], e["target_lang"]) in AST_DIRECTIONS, where
        assert e["pnc"] == "yes", where
        text = e["text"]
        assert text == text.strip() and text[:1].upper() == text[:1], f"{where}: {text!r}"
        assert text[-1] in ".!?", f"{where}: PnC text should end a sentence: {text!r}"
        assert not os.path.isabs(e["audio_filepath"]), where

        path = os.path.join(MINI, os.path.dirname(name), e["audio_filepath"])
        assert os.path.isfile(path), f"{where}: missing {path}"
        info = sf.info(path)
        if name != "examples.jsonl":  # the examples deliberately include a 44.1 kHz stereo file
            assert e["audio_filepath"].endswith(".flac"), where
            assert (info.samplerate, info.channels) == (16000, 1), \
                f"{where}: {info.samplerate} Hz x {info.channels} channels"
        assert isinstance(e["duration"], float) and e["duration"] == round(e["duration"], 3), where
        measured = info.frames / info.samplerate
        assert abs(measured - e["duration"]) < 0.010, f"{where}: file {measured} s, manifest {e['duration']} s"


def test_train_dev_disjoint_and_all_pairs_present():
    train, dev = read_manifest("train.jsonl"), read_manifest("dev.jsonl")
    train_texts = {key(e["text"]) for e in train}
    dev_texts = {key(e["text"]) for e in dev}
    assert not train_texts & dev_texts, sorted(train_texts & dev_texts)[:5]
    for split in (train, dev):
        pairs = {(e["source_lang"], e["target_lang"]) for e in split}
        assert pairs == {(lang, lang) for lang in LANGS} | AST_DIRECTIONS, sorted(pairs)


def test_examples_are_training_utterances():
    train = {(e["text"], e["source_lang"], e["target_lang"]) for e in read_manifest("train.jsonl")}
    examples = read_manifest("examples.jsonl")
    assert len(examples) == 3
    for e in examples:
        assert (e["text"], e["source_lang"], e["target_lang"]) in train, e["text"]
        info = sf.info(os.path.join(MINI, e["audio_filepath"]))
        assert info.format == "WAV" and info.subtype == "PCM_16", e["audio_filepath"]
    rates = {sf.info(os.path.join(MINI, e["audio_filepath"])).samplerate for e in examples}
    assert rates == {16000, 44100}, rates
    stereo = [e for e in examples if sf.info(os.path.join(MINI, e["audio_filepath"])).channels == 2]
    assert len(stereo) == 1 and "44k_stereo" in stereo[0]["audio_filepath"]


def test_digit_strings_are_new_in_dev_and_use_only_digit_words():
    words = {"en": "zero one two three four five six seven eight nine",
             "de": "null eins zwei drei vier fünf sechs sieben acht neun",
             "fr": "zéro un deux trois quatre cinq six sept huit neuf",
             "es": "cero uno dos tres cuatro cinco seis siete ocho nueve"}
    train, dev = read_manifest("digits/train.jsonl"), read_manifest("digits/dev.jsonl")
    for e in train + dev:
        assert e["taskname"] == "asr" and set(key(e["text"]).split()) <= set(words[e["source_lang"]].split()), e
    for lang in LANGS:
        train_strings = {key(e["text"]) for e in train if e["source_lang"] == lang}
        dev_strings = {key(e["text"]) for e in dev if e["source_lang"] == lang}
        assert len(train_strings) == 100 and len(dev_strings) == 12 and not train_strings & dev_strings, lang


def test_test_split_has_its_own_sentences_and_voices():
    """--test-per-lang: test sentences are in neither dev nor train, and spoken by voices they never use."""
    import argparse
    import random

    tool = generator()
    TEST_VARIANTS, VARIANTS, plan_jobs, split_pool = tool.TEST_VARIANTS, tool.VARIANTS, tool.plan_jobs, tool.split_pool

    assert not set(TEST_VARIANTS) & set(VARIANTS)
    sentences = [f"sentence number {i}" for i in range(200)]
    args = argparse.Namespace(dev_per_lang=5, test_per_lang=7, train_per_lang=None, ast_pairs=None)
    lists = split_pool("en", sentences, random.Random(0), args)
    assert len(lists[("test", "en")]) == 7 and len(lists[("dev", "en")]) == 5
    by_split = {split: {s for (sp, _), items in lists.items() if sp == split for s in items}
                for split in ("train", "dev", "test")}
    assert sum(map(len, by_split.values())) == len(sentences)  # every sentence lands in exactly one split
    assert not by_split["test"] & (by_split["train"] | by_split["dev"])

    texts = [("en", "en", s, s) for s in lists[("test", "en")]]
    jobs = list(plan_jobs("test", texts, random.Random(0), repeat=False, variants=TEST_VARIANTS))
    assert sorted(j.spoken for j in jobs) == sorted(lists[("test", "en")])
    assert all(any(j.voice.endswith(v) for v in TEST_VARIANTS if v) for j in jobs)


def test_help_pages_give_paragraphs_without_markup(tmp_path):
    """French text comes from GNOME's Mallard pages and LibreOffice's HTML pages (in sub-folders)."""
    read_help_pages = generator().read_help_pages

    (tmp_path / "files.page").write_text(
        "<page><title>Fichiers</title><p>Ouvrez le dossier.</p><p>Cliquez sur <gui>Ouvrir</gui>.</p></page>",
        encoding="utf-8")
    (tmp_path / "text" / "swriter").mkdir(parents=True)
    (tmp_path / "text" / "swriter" / "main.html").write_text(
        '<p id="par_1" class="paragraph" dir="auto">S&eacute;lectionnez l&apos;image.</p>'
        '<p id="par_2" class="paragraph" dir="auto">Choisissez <emph>Format</emph>.</p>',
        encoding="utf-8")
    assert read_help_pages(tmp_path) == ["Ouvrez le dossier.", "Sélectionnez l'image."]


def test_words_option_sets_the_sentence_length_range():
    import argparse

    tool = generator()
    sentence = "The early bird gets the worm, but the second mouse gets the cheese."  # 13 words
    assert tool.clean_sentence(sentence, "en", tool.words_range("3-8")) is None
    assert tool.clean_sentence(sentence, "en", tool.words_range("3-30")) == sentence
    for bad in ("30-3", "0-5", "five"):
        with pytest.raises(argparse.ArgumentTypeError):
            tool.words_range(bad)
