"""A `train.manifests` entry -> what reads it. The kinds of entry, and their keys:

    data/train.jsonl  or  {path: data/train.jsonl, weight: 2}       JSONL manifest (read into memory)
    {shards: DIR}                                                   aed's own tar shards (aed/data_shards.py)
    {manifest_filepath: ..., tarred_audio_filepaths: ...}          NeMo tarred set (aed/data_formats.py)
    {shar: DIR}                                                     Lhotse Shar (aed/data_formats.py)
    {parquet: GLOB, audio_column: audio, text_column: text, ...}    Hugging Face parquet (aed/data_formats.py)

    entry = ManifestEntry.of({"shar": "data/shar", "weight": 2})   # checked: errors name the entry and field
    entry.kind, entry.name, entry.weight                           # "shar", "data/shar", 2.0
    source = entry.open()                                          # its streamed reader

The config holds entries as written (a path, or a mapping; train.manifests, val.manifests, the
tools' --manifest); `ManifestEntry.of` turns one into the typed, checked entry that the code reads.
Every kind but a manifest is streamed: `open` gives an object of the sampler's streamed-source
protocol (aed/data_shards.py has what those readers share). Each takes `weight` (examples drawn in
proportion when several are mixed), and the tags that group entries for `train.mix_temperature`
(aed/data_mixing.py): `dataset` and `language`. A streamed entry may declare its size, `hours` and
`examples` (read from the source's metadata otherwise); a manifest may be non-speech,
`{path: noise.jsonl, nonspeech: true, rate: 0.05}`: audio whose target is empty.
"""

from array import array
from dataclasses import dataclass, field

import yaml

from aed.config import ConfigError
from aed.data_batch import as_utterance, encode_utterance
from aed.data_manifest import Faults
from aed.data_formats import FIELDS, NemoTarredSource, ParquetSource, SharSource
from aed.data_shards import ShardSource

PARQUET_KEYS = {"parquet", "audio_column", *(f"{f}_column" for f in FIELDS), *FIELDS}
SIZE_KEYS = {"hours", "examples"}  # a streamed source's declared size (aed/data_mixing.py: stream_weights)
KINDS = {  # kind: (the key that names it, every key it accepts besides TAG_KEYS)
    "shards": ("shards", {"shards"} | SIZE_KEYS),
    "nemo": ("tarred_audio_filepaths", {"manifest_filepath", "tarred_audio_filepaths"} | SIZE_KEYS),
    "shar": ("shar", {"shar"} | SIZE_KEYS),
    "parquet": ("parquet", PARQUET_KEYS | SIZE_KEYS),
    "manifest": ("path", {"path", "nonspeech", "rate"}),
}
TAG_KEYS = {"weight", "dataset", "language"}  # every kind: its mixing weight and its group's tags


@dataclass(frozen=True)
class ManifestEntry:
    """One train.manifests (or val.manifests) entry, checked: `ManifestEntry.of(value)`."""

    kind: str  # a key of KINDS: manifest | shards | nemo | shar | parquet
    location: str  # its kind's key: the manifest's path, shard or Shar directory, NeMo tars' pattern, parquet glob
    manifest_filepath: str | None = None  # nemo: the pattern of its manifests
    dataset: str | None = None  # the group's tags for train.mix_temperature (aed/data_mixing.py: group_of)
    language: str | None = None
    weight: float | None = None  # examples drawn in proportion when mixed; None: not given (1, or the temperature's)
    hours: float | None = None  # a streamed entry's declared size: both or neither (None: read from its metadata)
    examples: int | None = None
    nonspeech: bool = False  # a manifest of audio without speech, whose target is empty ...
    rate: float | None = None  # ... and the fraction of the training examples it makes up
    audio_column: str = "audio"  # parquet: the audio's column
    columns: tuple[tuple[str, str], ...] = ()  # parquet: (field, column) pairs, from its <field>_column keys
    constants: tuple[tuple[str, object], ...] = ()  # parquet: (field, value) pairs, from its <field> keys
    given: str | dict | None = field(default=None, compare=False, repr=False)  # as the config wrote it (messages)

    @classmethod
    def of(cls, value) -> "ManifestEntry":
        """The entry a config value gives: a manifest path, or a mapping with one kind's key (an
        entry is returned as it is). ConfigError names a malformed one, and the field."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls("manifest", value, given=value)
        if isinstance(value, dict):
            for kind, (marker, keys) in KINDS.items():
                if marker in value:
                    if unknown := set(value) - keys - TAG_KEYS:
                        raise ConfigError(f"train.manifests entry {value!r}: unknown key(s) {sorted(unknown)} for a "
                                          f"{kind} entry (accepted: {sorted(keys | TAG_KEYS)})")
                    if kind == "nemo" and "manifest_filepath" not in value:
                        raise ConfigError(f"train.manifests entry {value!r}: a NeMo tarred set needs manifest_filepath")
                    check_fields(value, value[marker])
                    return cls._from_dict(kind, value[marker], value)
        raise ConfigError(f"train.manifests entry {value!r}: expected a manifest path or a mapping with one of "
                          f"{[marker for marker, _ in KINDS.values()]} (README: Your data as it is)")

    @classmethod
    def _from_dict(cls, kind: str, location, d: dict) -> "ManifestEntry":
        def number(key, cast):
            return cast(d[key]) if key in d else None

        return cls(kind, location, manifest_filepath=d.get("manifest_filepath"), dataset=d.get("dataset"),
                   language=d.get("language"), weight=number("weight", float), hours=number("hours", float),
                   examples=number("examples", int), nonspeech=d.get("nonspeech", False), rate=d.get("rate"),
                   audio_column=d.get("audio_column", "audio"),
                   columns=tuple((k.removesuffix("_column"), v) for k, v in d.items()
                                 if k.endswith("_column") and k != "audio_column"),
                   constants=tuple((k, v) for k, v in d.items() if k in FIELDS), given=d)

    @property
    def streamed(self) -> bool:
        return self.kind != "manifest"

    @property
    def name(self) -> str:
        """The path (or directory, glob) that names the entry in logs and errors."""
        return str(self.location)

    @property
    def path(self) -> str | None:
        """A manifest's path (None for a streamed entry)."""
        return None if self.streamed else self.location

    def open(self, shuffle_shards: bool = True):
        """The streamed source of the entry (not of a plain manifest)."""
        if self.kind == "shards":
            return ShardSource(self.location, shuffle_shards)
        if self.kind == "nemo":
            return NemoTarredSource(self.manifest_filepath, self.location, shuffle_shards)
        if self.kind == "shar":
            return SharSource(self.location, shuffle_shards)
        if self.kind == "parquet":
            return ParquetSource(self.location, self.audio_column, dict(self.columns), dict(self.constants),
                                 shuffle_shards)
        raise ConfigError(f"train.manifests entry {self.given!r} is a manifest, read into memory, not streamed")


def check_fields(spec: dict, name) -> None:
    """ConfigError naming the entry (`name`: its path) and the field when a tag or size has a wrong value."""
    def bad(key, why):
        raise ConfigError(f"train.manifests entry {name}: field '{key}': {why}, got {spec[key]!r}")

    def number(key):
        return isinstance(spec[key], (int, float)) and not isinstance(spec[key], bool)

    for key in ("dataset", "language"):
        if key in spec and (not isinstance(spec[key], str) or not spec[key]):
            bad(key, "must be a non-empty string")
    for key in ("weight", "hours", "examples"):
        if key in spec and not (number(key) and spec[key] > 0):
            bad(key, "must be a positive number")
    if ("hours" in spec) != ("examples" in spec):
        raise ConfigError(f"train.manifests entry {name}: a declared size needs both 'hours' and 'examples' "
                          "(examples are drawn by count, so hours alone cannot set the mix)")
    if "nonspeech" in spec and not isinstance(spec["nonspeech"], bool):
        bad("nonspeech", "must be true or false")
    if spec.get("nonspeech"):
        if "rate" not in spec:
            raise ConfigError(f"train.manifests entry {name}: field 'rate': a non-speech manifest needs the "
                              "fraction of training examples it makes up, e.g. rate: 0.05")
        if "weight" in spec:
            bad("weight", "a non-speech manifest is mixed in by its rate, not a weight")
    if "rate" in spec and not spec.get("nonspeech"):
        bad("rate", "only a non-speech manifest (nonspeech: true) has a rate")
    if "rate" in spec and not (number("rate") and 0 < spec["rate"] < 1):
        bad("rate", "must lie strictly between 0 and 1")


def parse_spec(text: str):
    """A train.manifests entry given on a command line -> the config's value: a path, or the YAML
    flow mapping such as '{shar: data/shar}', checked (`ManifestEntry.of`)."""
    if text.lstrip().startswith("{"):
        spec = yaml.safe_load(text)
        ManifestEntry.of(spec)  # names a malformed entry now
        return spec
    return text


def metadata(source):
    """(where, example fields) of every example of a streamed source, reading no audio where the
    format keeps durations apart from it (all but aed's own shards, whose fields sit in the tar)."""
    if hasattr(source, "metadata"):
        yield from source.metadata()
        return
    for _, _, ex in source.read(0, 0, 1):
        yield ex["where"], {k: v for k, v in ex.items() if k != "audio"}


class CountTokens:
    """A streamed source whose examples carry `num_tokens` (prompt + text + EOS, as training
    encodes them) for the sampler's 2D buckets, computed as they stream by, and the ids themselves
    (`token_ids`, `prompt_len`), so the DataLoader worker does not tokenize them again. An example
    the tokenizer cannot encode (a language it lacks) is skipped and counted in `faults`."""

    def __init__(self, source, tokenizer):
        self.source, self.tokenizer, self.faults = source, tokenizer, Faults()

    def read(self, seed: int, rank: int, world_size: int, cursor=None):
        for key, cur, ex in self.source.read(seed, rank, world_size, cursor):
            if "num_tokens" in ex or self._count(ex):
                yield key, cur, ex

    def _count(self, ex: dict) -> bool:
        try:
            ids, prompt_len = encode_utterance(self.tokenizer, as_utterance(ex))
        except (ValueError, KeyError) as e:
            self.faults.skip("not_encodable", ex["where"], f"the tokenizer cannot encode it ({e})")
            return False
        ex["num_tokens"], ex["token_ids"], ex["prompt_len"] = len(ids), array("i", ids).tobytes(), prompt_len
        return True

    def get(self, key) -> dict:
        ex = self.source.get(key)
        if "num_tokens" not in ex and not self._count(ex):
            raise ValueError(f"{self.describe(key)}: the tokenizer cannot encode this example")
        return ex

    def describe(self, key) -> str:
        return self.source.describe(key)


def source_faults(source) -> list:
    """Every `Faults` of a streamed source: its own, the wrappers' around it (CountTokens) and those
    of the sources it mixes (MixedSource)."""
    out = [source.faults] if hasattr(source, "faults") else []
    if hasattr(source, "source"):
        out += source_faults(source.source)
    for s in getattr(source, "sources", ()):
        out += source_faults(s)
    return out
