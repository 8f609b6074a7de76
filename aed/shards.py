"""Sharded tar datasets: sequential reading of many small utterances.

At cluster scale, opening one small audio file per example on a shared filesystem is the
bottleneck. `tools/make_shards.py` packs a manifest into tar shards; this module streams them.

Layout of a sharded set (a folder):

    shards.jsonl             one line per shard: {"path": "shard-000000.tar", "count": 1000, "duration": 5123.4}
    shard-000000.tar         per example, two consecutive members with the same stem:
        000000017.json       duration, text, source_lang, target_lang, pnc, taskname, audio_filepath
                             (the original file, for messages) and num_tokens (with a tokenizer)
        000000017.flac       the audio exactly as stored (any soundfile format), already cut to
                             the utterance: it is decoded from the start for `duration` seconds

`ShardSource` implements the streamed-source protocol of `sampler.py`'s `BucketingSampler`
(`read`, `get`, `describe`, like `JsonlSource`):

- Each pass shuffles the shard order with the pass seed (the same on every rank); rank r reads
  shards `order[r::world_size]`, so ranks read disjoint shards and every example once per pass.
  A DataLoader worker that reads shards itself passes rank * num_workers + worker_id and
  world_size * num_workers. Members inside a shard are read in order; the sampler's bucket
  buffer shuffles locally.
- Keys are (shard, member, byte offset) and cursors (position in this rank's shard order, shard,
  member, byte offset of the next example): `get` seeks straight to an example and a restored
  cursor continues inside the open shard, so resuming re-reads neither epochs nor shards.
- A missing, corrupt or truncated shard is logged with its path and skipped (the rest of that
  shard is lost); `stats` counts them. A tar cut before a header ends silently (tarfile's rule,
  kept by the shared member reader `aed.tar_source.tar_members`), so the number of examples read
  is checked against the index.

Examples are dicts with the JSON fields plus `audio` (the encoded bytes) and `where`
("shard-000003.tar#17", for messages). Compressed audio is small, so the sampler's buffer holds
it (as Lhotse Shar does) and `ShardDataset` decodes it in DataLoader workers.

`MixedSource` mixes several sources by example weights (e.g. one per language or task).

    source = MixedSource([ShardSource("shards/en"), ShardSource("shards/de")], weights=[2, 1])
    sampler = BucketingSampler(source, bins, batch_sizes=sizes, infinite=True)
    loader = DataLoader(ShardDataset(tokenizer, LogMel(cfg)), batch_sampler=sampler, collate_fn=Collate(pad))
"""

import io
import json
import logging
import random
import tarfile
import zlib
from bisect import bisect_right
from itertools import accumulate
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF
from torch.utils.data import Dataset

from aed.audio import AudioError
from aed.data import Utterance, make_item
from aed.tar_source import CHUNK, tar_members

log = logging.getLogger(__name__)

INDEX_NAME = "shards.jsonl"
SHARD_NAME = "shard-{:06d}.tar"


class ShardSource:
    """Examples streamed from one sharded set (a folder with `shards.jsonl`, or that file)."""

    def __init__(self, path, shuffle_shards: bool = True):
        index = Path(path) / INDEX_NAME if Path(path).is_dir() else Path(path)
        if not index.is_file():
            raise FileNotFoundError(f"ShardSource: no shard index {index} (made by tools/make_shards.py)")
        self.paths, self.counts = [], []
        for line_no, line in enumerate(index.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                self.paths.append(str(index.parent / d["path"]))
                self.counts.append(int(d["count"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}:{line_no}: bad index line, need 'path' and 'count' ({e!r})") from None
        if not self.paths:
            raise ValueError(f"{index}: no shards")
        self.shuffle_shards = shuffle_shards
        self.stats = {"bad_shards": 0, "bad_examples": 0}
        self._handles = {}

    def __len__(self) -> int:
        return sum(self.counts)

    def _open(self, path):
        """The one place a shard is opened (the I/O benchmark adds a latency here)."""
        return open(path, "rb")

    def shard_order(self, seed: int, rank: int, world_size: int) -> list:
        """Shard indices this rank reads in the pass seeded by `seed`."""
        if len(self.paths) < world_size:
            raise ValueError(f"{len(self.paths)} shards cannot feed {world_size} readers: "
                             "make more, smaller shards (make_shards.py --shard-size)")
        order = list(range(len(self.paths)))
        if self.shuffle_shards:
            random.Random(seed).shuffle(order)
        return order[rank::world_size]

    def read(self, seed: int, rank: int, world_size: int, cursor=None):
        """Yields (key, cursor after this example, example) for this rank, from `cursor` on."""
        order = self.shard_order(seed, rank, world_size)
        pos, shard, member, offset = cursor or (0, None, 0, 0)
        if shard is not None and (pos >= len(order) or order[pos] != shard):
            raise ValueError(f"resume cursor {cursor} does not match the shard order: the shard index "
                             "or the number of readers changed since the checkpoint")
        for p in range(pos, len(order)):
            shard = order[p]
            path, n = self.paths[shard], member
            try:
                with self._open(path) as f:
                    for key, (member, offset), ex in self._examples(shard, f, member, offset):
                        n = member
                        if ex is not None:
                            yield key, (p, shard, member, offset), ex
                if n < self.counts[shard]:
                    raise tarfile.ReadError(f"ended after {n} of {self.counts[shard]} examples (truncated?)")
            except (OSError, EOFError, tarfile.TarError) as e:
                self.stats["bad_shards"] += 1
                log.warning("skipping the rest of shard %s after example %d: %s", path, n, e)
            member = offset = 0

    def get(self, key) -> dict:
        shard, member, offset = key
        if shard not in self._handles:
            self._handles[shard] = self._open(self.paths[shard])
        try:
            ex = next(self._examples(shard, self._handles[shard], member, offset, chunk=0))[2]
        except (StopIteration, OSError, EOFError, tarfile.TarError) as e:
            raise ValueError(f"{self.describe(key)}: cannot re-read this example ({e!r})") from None
        if ex is None:
            raise ValueError(f"{self.describe(key)}: this example is no longer readable")
        return ex

    def describe(self, key) -> str:
        return f"{self.paths[key[0]]}#{key[1]}"

    def _examples(self, shard: int, f, member: int, offset: int, chunk: int = CHUNK):
        """Yields (key, (next member, next offset), example) from the example whose header is at
        `offset`; example is None for a bad one (logged and counted). Raises tarfile/OS errors on
        a corrupt shard. Members are read by `aed.tar_source.tar_members` (chunk=0: one example)."""
        pending = None  # (key, name, bytes) of a .json waiting for its audio
        for at, name, data, end in tar_members(f, offset, chunk):
            stem, _, ext = name.rpartition(".")
            if pending is None:
                if ext == "json":
                    pending = ((shard, member, at), name, data)
                else:
                    self._bad(shard, member, f"audio member {name} without its .json")
                continue
            key, meta_name, meta = pending
            pending = None
            member += 1
            if meta_name.rpartition(".")[0] != stem:
                self._bad(*key[:2], f"{meta_name} is followed by {name}, not its audio")
                if ext == "json":  # the audio went missing: this json may start the next pair
                    pending = ((shard, member, at), name, data)
                yield key, (member, at if pending else end), None
                continue
            try:
                ex = json.loads(meta)
                ex["duration"] = float(ex["duration"])
            except (ValueError, KeyError, TypeError) as e:
                self._bad(*key[:2], f"bad JSON in {meta_name} ({e!r})")
                yield key, (member, end), None
                continue
            ex["audio"] = data
            ex["where"] = self.describe(key)
            yield key, (member, end), ex

    def _bad(self, shard: int, member: int, why: str) -> None:
        self.stats["bad_examples"] += 1
        log.warning("%s: skipped: %s", self.describe((shard, member)), why)


class MixedSource:
    """Several sources mixed by weight: each example comes from source i with probability
    weights[i] / sum(weights) (weights count examples, not hours). Every source is cycled in
    its own reshuffled passes, so the mix is endless: use the sampler with infinite=True.

    Keys are (source index, *source key); the cursor is (examples drawn, per source (pass, cursor)),
    and the draws are a fixed function of (seed, rank, draw number), so a resume continues exactly.
    """

    BLOCK = 4096  # draws generated at a time

    def __init__(self, sources: list, weights: list):
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"MixedSource: {len(sources)} sources but {len(weights)} weights")
        if any(not w > 0 for w in weights):
            raise ValueError(f"MixedSource: weights must be positive, got {weights}")
        self.sources = sources
        total = float(sum(weights))
        self.cum_weights = list(accumulate(w / total for w in weights))

    def read(self, seed: int, rank: int, world_size: int, cursor=None):
        n, subs = cursor or (0, [(0, None)] * len(self.sources))
        subs = [tuple(s) for s in subs]
        streams = [self._cycle(i, seed, rank, world_size, *subs[i]) for i in range(len(self.sources))]
        draws = None
        while True:
            if draws is None or n % self.BLOCK == 0:
                draws = np.random.default_rng([seed, rank, n // self.BLOCK]).random(self.BLOCK).tolist()
            i = min(bisect_right(self.cum_weights, draws[n % self.BLOCK]), len(self.sources) - 1)
            key, sub, ex = next(streams[i])
            subs[i] = sub
            n += 1
            yield (i, *key), (n, list(subs)), ex

    def _cycle(self, i: int, seed: int, rank: int, world_size: int, pass_idx: int, cursor):
        while True:
            got = 0
            pass_seed = random.Random(f"{seed}/{i}/{pass_idx}").getrandbits(64)
            for key, cur, ex in self.sources[i].read(pass_seed, rank, world_size, cursor):
                got += 1
                yield key, (pass_idx, cur), ex
            if got == 0 and cursor is None:
                raise ValueError(f"MixedSource: source {i} gave rank {rank} no example in a whole pass")
            pass_idx, cursor = pass_idx + 1, None

    def get(self, key) -> dict:
        return self.sources[key[0]].get(tuple(key[1:]))

    def describe(self, key) -> str:
        return self.sources[key[0]].describe(tuple(key[1:]))


def decode_audio(example: dict, sample_rate: int = 16000) -> torch.Tensor:
    """An example's audio bytes -> mono float32 (S,) at `sample_rate`: `duration` seconds from
    `offset` (default 0; a NeMo member shared by the segments of one file), the same samples
    `aed.audio.load_audio` gives for the original file (it needs a path)."""
    where = example.get("where", "example")
    try:
        with sf.SoundFile(io.BytesIO(example["audio"])) as f:
            start = round(example.get("offset", 0.0) * f.samplerate)
            if start >= f.frames > 0:
                raise AudioError(where, f"offset {example['offset']}s is beyond the end "
                                        f"({f.frames / f.samplerate:.3f}s)")
            if start:
                f.seek(start)
            data = f.read(round(example["duration"] * f.samplerate), dtype="float32", always_2d=True)
            file_rate = f.samplerate
    except AudioError:
        raise
    except (RuntimeError, ValueError, TypeError) as e:  # sf.LibsndfileError is a RuntimeError; TypeError: no bytes
        raise AudioError(where, f"cannot decode ({e})") from e
    if data.shape[0] == 0:
        raise AudioError(where, "no samples")
    wav = torch.from_numpy(data).mean(dim=1)  # average channels: (S, channels) -> (S,)
    if file_rate != sample_rate:
        wav = AF.resample(wav, file_rate, sample_rate)
    return wav


class ShardDataset(Dataset):
    """Decodes the example dicts of a streamed batch in DataLoader workers: use it with
    `DataLoader(..., batch_sampler=BucketingSampler(source, ...))`, which hands each example dict
    to `__getitem__`. Items are `aed.data.make_item`'s, as the per-file dataset's, so
    `aed.data.Collate` pads them; a bad audio comes back as {"error": ...}. Dither is seeded by
    (seed, example location), as the per-file dataset does by index.
    """

    def __init__(self, tokenizer, logmel, seed: int = 0):
        self.tokenizer, self.logmel, self.seed = tokenizer, logmel, seed

    def __getitem__(self, ex: dict) -> dict:
        where = ex["where"]
        try:
            wav = decode_audio(ex, self.logmel.cfg.sample_rate)
        except AudioError as e:
            return {"error": str(e), "audio_filepath": where}
        index = zlib.crc32(where.encode())  # stable across processes, unlike hash()
        return make_item(wav, as_utterance(ex), index, self.tokenizer, self.logmel, self.seed)


def as_utterance(ex: dict) -> Utterance:
    """A streamed example as the Utterance that tokenizing and `make_item` read. Its location
    (`where`) names it in batches and messages: its original file may not exist where training
    runs. Fields were validated by the reader (or when the shard was made)."""
    where = ex["where"]
    return Utterance(where, ex["duration"], ex["text"], ex["source_lang"], ex["target_lang"], ex["pnc"],
                     ex["taskname"], ex.get("offset", 0.0), where=where)
