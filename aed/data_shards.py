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
(`read`, `get`, `describe`):

- Each pass shuffles the shard order with the pass seed (the same on every rank); rank r reads
  shards `order[r::world_size]`, so ranks read disjoint shards and every example once per pass.
  A DataLoader worker that reads shards itself passes rank * num_workers + worker_id and
  world_size * num_workers. Members inside a shard are read in order; the sampler's bucket
  buffer shuffles locally.
- Keys are (shard, member, byte offset) and cursors (position in this rank's shard order, shard,
  member, byte offset of the next example): `get` seeks straight to an example and a restored
  cursor continues inside the open shard, so resuming re-reads neither epochs nor shards.
- A missing, corrupt or truncated shard is logged with its path and skipped (the rest of that
  shard is lost); `faults` (`aed.data_manifest.Faults`) counts them (bad_shard) and the bad
  examples (bad_example), each logged once. A tar cut before a header ends silently (tarfile's rule,
  kept by the shared member reader `aed.data_tarred.tar_members`), so the number of examples read
  is checked against the index.

Examples are dicts with the JSON fields plus `audio` (the encoded bytes) and `where`
("shard-000003.tar#17", for messages); `aed.data_batch.ExampleDataset` decodes them.
"""

import json
import tarfile
from pathlib import Path

from aed.data_manifest import Faults
from aed.data_stream import resume_shards
from aed.data_tarred import CHUNK, tar_members

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
        self.index, self.shuffle_shards = str(index), shuffle_shards
        self.faults = Faults()
        self._handles = {}

    def __len__(self) -> int:
        return sum(self.counts)

    def read(self, seed: int, rank: int, world_size: int, cursor=None):
        """Yields (key, cursor after this example, example) for this rank, from `cursor` on."""
        for p, shard, (member, offset) in resume_shards(len(self.paths), seed, rank, world_size, self.shuffle_shards,
                                                        self.index, cursor, (0, 0)):
            path, n = self.paths[shard], member
            try:
                with open(path, "rb") as f:
                    for key, (member, offset), ex in self._examples(shard, f, member, offset):
                        n = member
                        if ex is not None:
                            yield key, (p, shard, member, offset), ex
                if n < self.counts[shard]:
                    raise tarfile.ReadError(f"ended after {n} of {self.counts[shard]} examples (truncated?)")
            except (OSError, EOFError, tarfile.TarError) as e:
                self.faults.skip("bad_shard", path, f"the rest of it is lost, after example {n} ({e})")

    def get(self, key) -> dict:
        shard, member, offset = key
        if shard not in self._handles:
            self._handles[shard] = open(self.paths[shard], "rb")
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
        a corrupt shard. Members are read by `aed.data_tarred.tar_members` (chunk=0: one example)."""
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
            ex.setdefault("segment", None)  # shards written before members were cut to their utterance
            yield key, (member, end), ex

    def _bad(self, shard: int, member: int, why: str) -> None:
        self.faults.skip("bad_example", self.describe((shard, member)), why)


