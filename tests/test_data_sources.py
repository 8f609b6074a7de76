"""A train.manifests entry as one typed, checked object (aed/data_sources.py: ManifestEntry): a bare
path and its mapping are the same entry, every kind keeps its fields, and a malformed entry is a
ConfigError that names the entry and the field."""

import dataclasses

import pytest

from aed.config import ConfigError
from aed.data_sources import ManifestEntry, parse_spec


def test_a_bare_path_and_its_mapping_are_the_same_manifest_entry():
    bare, mapped = ManifestEntry.of("data/a.jsonl"), ManifestEntry.of({"path": "data/a.jsonl"})
    assert bare == mapped and bare.given == "data/a.jsonl" and mapped.given == {"path": "data/a.jsonl"}
    assert (bare.kind, bare.path, bare.name, bare.streamed) == ("manifest", "data/a.jsonl", "data/a.jsonl", False)
    assert (bare.weight, bare.dataset, bare.language, bare.nonspeech, bare.rate) == (None, None, None, False, None)
    assert ManifestEntry.of(bare) is bare  # an entry already: itself
    with pytest.raises(dataclasses.FrozenInstanceError):
        bare.weight = 2.0


def test_every_kind_keeps_its_fields():
    tagged = ManifestEntry.of({"path": "a.jsonl", "weight": 2, "dataset": "ls", "language": "en"})
    assert (tagged.weight, tagged.dataset, tagged.language) == (2.0, "ls", "en") and isinstance(tagged.weight, float)
    noise = ManifestEntry.of({"path": "noise.jsonl", "nonspeech": True, "rate": 0.05})
    assert noise.nonspeech and noise.rate == 0.05 and noise.weight is None
    shar = ManifestEntry.of({"shar": "data/shar", "hours": 3, "examples": 1200})
    assert (shar.kind, shar.name, shar.path, shar.streamed) == ("shar", "data/shar", None, True)
    assert (shar.hours, shar.examples) == (3.0, 1200)
    assert ManifestEntry.of({"shards": "shards/en"}).kind == "shards"
    nemo = ManifestEntry.of({"manifest_filepath": "m_OP_0..3_CL_.json", "tarred_audio_filepaths": "a_OP_0..3_CL_.tar"})
    assert (nemo.kind, nemo.location, nemo.manifest_filepath) == ("nemo", "a_OP_0..3_CL_.tar", "m_OP_0..3_CL_.json")
    parquet = ManifestEntry.of({"parquet": "hf/*.parquet", "audio_column": "wav", "text_column": "sentence",
                                "source_lang": "de"})
    assert (parquet.kind, parquet.location, parquet.audio_column) == ("parquet", "hf/*.parquet", "wav")
    assert dict(parquet.columns) == {"text": "sentence"} and dict(parquet.constants) == {"source_lang": "de"}
    assert ManifestEntry.of({"parquet": "hf/*.parquet"}).audio_column == "audio"


@pytest.mark.parametrize("value, message", [
    ({"path": "a.jsonl", "weight": -1}, "entry a.jsonl: field 'weight': must be a positive number, got -1"),
    ({"path": "a.jsonl", "language": 3}, "entry a.jsonl: field 'language': must be a non-empty string"),
    ({"path": "a.jsonl", "rate": 0.1}, "entry a.jsonl: field 'rate': only a non-speech manifest"),
    ({"path": "a.jsonl", "nonspeech": True}, "entry a.jsonl: field 'rate': a non-speech manifest needs"),
    ({"shar": "d", "hours": 3}, "entry d: a declared size needs both 'hours' and 'examples'"),
    ({"shar": "d", "weight": 2, "rate": 0.1}, r"unknown key\(s\) \['rate'\] for a shar entry"),
    ({"tarred_audio_filepaths": "a.tar"}, "a NeMo tarred set needs manifest_filepath"),
    ({"manifest": "a.jsonl"}, "expected a manifest path or a mapping with one of"),
    (3, "entry 3: expected a manifest path"),
])
def test_a_bad_entry_is_an_error_naming_it_and_the_field(value, message):
    with pytest.raises(ConfigError, match=message):
        ManifestEntry.of(value)


def test_a_command_line_entry_is_the_configs_value_checked():
    assert parse_spec("data/a.jsonl") == "data/a.jsonl"
    assert parse_spec("{shar: data/shar, weight: 2}") == {"shar": "data/shar", "weight": 2}
    with pytest.raises(ConfigError, match="field 'weight'"):
        parse_spec("{shar: data/shar, weight: 0}")


def test_a_manifest_is_read_into_memory_not_opened_as_a_stream():
    with pytest.raises(ConfigError, match="is a manifest, read into memory, not streamed"):
        ManifestEntry.of("a.jsonl").open()
