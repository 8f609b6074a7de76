"""A `train.manifests` entry -> what reads it. The kinds of entry, and their keys:

    data/train.jsonl  or  {path: data/train.jsonl, weight: 2}       JSONL manifest (read into memory)
    {shards: DIR}                                                   aed's own tar shards (aed/data_shards.py)
    {manifest_filepath: ..., tarred_audio_filepaths: ...}          NeMo tarred set (aed/data_tarred.py)
    {shar: DIR}                                                     Lhotse Shar (aed/data_tarred.py)
    {parquet: GLOB, audio_column: audio, text_column: text, ...}    Hugging Face parquet (aed/data_parquet.py)

Every kind but a manifest is streamed: `open_source` gives an object of the sampler's
streamed-source protocol (aed/data_stream.py has what those readers share). Each takes `weight`
(examples drawn in proportion when several are mixed).
"""

from array import array

import yaml

from aed.config import ConfigError
from aed.data_batch import as_utterance, encode_utterance
from aed.data_manifest import Faults
from aed.data_parquet import FIELDS, ParquetSource
from aed.data_shards import ShardSource
from aed.data_tarred import NemoTarredSource, SharSource

PARQUET_KEYS = {"parquet", "audio_column", *(f"{f}_column" for f in FIELDS), *FIELDS}
KINDS = {  # kind: (the key that names it, every key it accepts)
    "shards": ("shards", {"shards"}),
    "nemo": ("tarred_audio_filepaths", {"manifest_filepath", "tarred_audio_filepaths"}),
    "shar": ("shar", {"shar"}),
    "parquet": ("parquet", PARQUET_KEYS),
    "manifest": ("path", {"path"}),
}


def spec_kind(spec) -> str:
    """The kind of a train.manifests entry (a key of KINDS); ConfigError names a malformed one."""
    if isinstance(spec, str):
        return "manifest"
    if isinstance(spec, dict):
        for kind, (marker, keys) in KINDS.items():
            if marker in spec:
                if unknown := set(spec) - keys - {"weight"}:
                    raise ConfigError(f"train.manifests entry {spec!r}: unknown key(s) {sorted(unknown)} for a "
                                      f"{kind} entry (accepted: {sorted(keys | {'weight'})})")
                if kind == "nemo" and "manifest_filepath" not in spec:
                    raise ConfigError(f"train.manifests entry {spec!r}: a NeMo tarred set needs manifest_filepath")
                return kind
    raise ConfigError(f"train.manifests entry {spec!r}: expected a manifest path or a mapping with one of "
                      f"{[marker for marker, _ in KINDS.values()]} (README: Your data as it is)")


def parse_spec(text: str):
    """A train.manifests entry given on a command line: a path, or a YAML flow mapping such as
    '{shar: data/shar}'."""
    if text.lstrip().startswith("{"):
        spec = yaml.safe_load(text)
        spec_kind(spec)  # names a malformed entry now
        return spec
    return text


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
