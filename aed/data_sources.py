"""A `train.manifests` entry -> what reads it. The kinds of entry, and their keys:

    data/train.jsonl  or  {path: data/train.jsonl, weight: 2}       JSONL manifest (read into memory)
    {shards: DIR}                                                   aed's own tar shards (aed/data_shards.py)
    {manifest_filepath: ..., tarred_audio_filepaths: ...}          NeMo tarred set (aed/data_nemo_shar.py)
    {shar: DIR}                                                     Lhotse Shar (aed/data_nemo_shar.py)
    {parquet: GLOB, audio_column: audio, text_column: text, ...}    Hugging Face parquet (aed/data_parquet.py)

Every kind but a manifest is streamed: `open_source` gives an object of the sampler's
streamed-source protocol (aed/data_shards.py has what those readers share). Each takes `weight`
(examples drawn in proportion when several are mixed), and the tags that group entries for
`train.mix_temperature` (aed/data_mixing.py): `dataset` and `language`. A streamed entry may declare
its size, `hours` and `examples` (read from the source's metadata otherwise); a manifest may be
non-speech, `{path: noise.jsonl, nonspeech: true, rate: 0.05}`: audio whose target is empty.
"""

from array import array

import yaml

from aed.config import ConfigError
from aed.data_batch import as_utterance, encode_utterance
from aed.data_manifest import Faults
from aed.data_nemo_shar import NemoTarredSource, SharSource
from aed.data_parquet import FIELDS, ParquetSource
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


def spec_kind(spec) -> str:
    """The kind of a train.manifests entry (a key of KINDS); ConfigError names a malformed one."""
    if isinstance(spec, str):
        return "manifest"
    if isinstance(spec, dict):
        for kind, (marker, keys) in KINDS.items():
            if marker in spec:
                if unknown := set(spec) - keys - TAG_KEYS:
                    raise ConfigError(f"train.manifests entry {spec!r}: unknown key(s) {sorted(unknown)} for a "
                                      f"{kind} entry (accepted: {sorted(keys | TAG_KEYS)})")
                if kind == "nemo" and "manifest_filepath" not in spec:
                    raise ConfigError(f"train.manifests entry {spec!r}: a NeMo tarred set needs manifest_filepath")
                check_tags(spec, spec[marker])
                return kind
    raise ConfigError(f"train.manifests entry {spec!r}: expected a manifest path or a mapping with one of "
                      f"{[marker for marker, _ in KINDS.values()]} (README: Your data as it is)")


def check_tags(spec: dict, name) -> None:
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
    """A train.manifests entry given on a command line: a path, or a YAML flow mapping such as
    '{shar: data/shar}'."""
    if text.lstrip().startswith("{"):
        spec = yaml.safe_load(text)
        spec_kind(spec)  # names a malformed entry now
        return spec
    return text


def as_entry(spec) -> dict:
    """A train.manifests entry as a dict, checked (`spec_kind`): a bare path is {"path": path}."""
    spec_kind(spec)
    return {"path": spec} if isinstance(spec, str) else spec


def is_streamed(spec) -> bool:
    return spec_kind(spec) != "manifest"


def open_source(spec, shuffle_shards: bool = True):
    """The streamed source of a train.manifests entry (not of a plain manifest)."""
    kind = spec_kind(spec)
    if kind == "shards":
        return ShardSource(spec["shards"], shuffle_shards)
    if kind == "nemo":
        return NemoTarredSource(spec["manifest_filepath"], spec["tarred_audio_filepaths"], shuffle_shards)
    if kind == "shar":
        return SharSource(spec["shar"], shuffle_shards)
    if kind == "parquet":
        columns = {k.removesuffix("_column"): v for k, v in spec.items()
                   if k.endswith("_column") and k != "audio_column"}
        constants = {k: v for k, v in spec.items() if k in FIELDS}
        return ParquetSource(spec["parquet"], spec.get("audio_column", "audio"), columns, constants, shuffle_shards)
    raise ConfigError(f"train.manifests entry {spec!r} is a manifest, read into memory, not streamed")


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
