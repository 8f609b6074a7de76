"""Sharded tar datasets: sequential reading of many small utterances, and what every streamed
reader shares.

At cluster scale, opening one small audio file per example on a shared filesystem is the
bottleneck. `tools/make_shards.py` packs a manifest into tar shards; this module streams them.

What every streamed reader shares (`ShardSource` here, and aed/data_formats.py's NeMo tarred sets,
Lhotse Shar and parquet; `sampler.py` describes the streamed-source protocol they follow):

- `shard_order`: the shards a rank reads in a pass, disjoint across ranks, reshuffled every pass;
  `resume_shards`: that order walked from a resume cursor, the one loop every reader's `read` uses.
- `tar_members`: the regular members of a tar, streamed in large reads or one at a byte offset.

Their examples are dicts: the checked fields of `aed.data_manifest.example_fields`, `audio` (the
encoded bytes of the file that holds the utterance), `offset` (seconds into that audio where it
starts) and `where` (a stable id naming the shard and member or row, for messages and
`inspect_data`). Compressed audio is small, so the sampler's buffer holds it (as Lhotse Shar
does), and DataLoader workers decode it (`aed.data_batch.ExampleDataset`). Several sources are
mixed by weight by `aed.data_mixing.MixedSource`.

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
  kept by `tar_members`), so the number of examples read is checked against the index.

Examples are dicts with the JSON fields plus `audio` (the encoded bytes) and `where`
("shard-000003.tar#17", for messages); `aed.data_batch.ExampleDataset` decodes them.
"""

import json
import random
import tarfile
from pathlib import Path

from aed.data_manifest import Faults


# --- the shards a rank reads ------------------------------------------------------------------


def shard_order(num_shards: int, seed: int, rank: int, world_size: int, shuffle: bool, what: str) -> list:
    """Shard indices this rank reads in the pass seeded by `seed`: every rank shuffles with the
    same seed and takes every world_size-th, so ranks read disjoint shards and all of them."""
    if num_shards < world_size:
        raise ValueError(f"{what}: {num_shards} shards cannot feed {world_size} readers: use fewer ranks "
                         "or write the data in more shards")
    order = list(range(num_shards))
    if shuffle:
        random.Random(seed).shuffle(order)
    return order[rank::world_size]


def resume_shards(num_shards: int, seed: int, rank: int, world_size: int, shuffle: bool, what: str,
                  cursor, start: tuple):
    """Yields (position in this rank's shard order, shard, where in it to start) for the pass seeded
    by `seed`, from a resume `cursor` on. Every reader's cursor is (position, shard, *inner), its
    own inner part saying where in the shard to go on (`start`: the beginning of a shard); the
    resumed shard starts at the cursor's inner part, every later one at `start`. A cursor whose
    shard is not at its position in this order (shards or ranks changed) raises ValueError."""
    order = shard_order(num_shards, seed, rank, world_size, shuffle, what)
    pos, shard, *inner = cursor or (0, None, *start)
    if shard is not None and (pos >= len(order) or order[pos] != shard):
        raise ValueError(f"resume cursor {cursor} does not match the shard order of {what}: the shards or "
                         "the number of readers changed since the checkpoint")
    for p in range(pos, len(order)):
        yield p, order[p], tuple(inner)
        inner = start


# --- the members of a tar ---------------------------------------------------------------------


BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)  # two of them end an archive
REGULAR = (b"0", b"\0", b"7")  # file types that hold a member's bytes
CHUNK = 1 << 22  # bytes read at a time when streaming a shard


def octal(field: bytes) -> int:
    """A tar header number: octal text, or base-256 when the high bit is set (GNU, > 8 GiB)."""
    if field[0] & 0x80:
        return int.from_bytes(field[1:], "big")
    return int(field.strip(b"\0 ") or b"0", 8)


def tar_members(f, offset: int = 0, chunk: int = CHUNK):
    """Yields (byte offset of the member's first header, name, bytes, byte offset after it) of the
    regular members of a tar, from the header at `offset`: a resume or `get` seeks to such an offset.

    Read in `chunk`-byte pieces and parsed here, not by tarfile: tarfile makes several calls per
    member (header object, seek, tell, one read each), and a read per member is a GIL hand-off per
    member with the sampler's producer thread (docs/data.md). Handles
    ustar, pax (long names) and GNU long-name headers. chunk=0 reads only what one member needs
    (`get`). Raises tarfile.ReadError on a header with a wrong checksum or data cut short; a tar
    cut before a header ends silently (tarfile's rule too), which callers detect by what is missing."""
    f.seek(offset)
    buf, base = memoryview(b""), offset  # the file's bytes from `base` on

    def need(pos: int, n: int) -> bytes:
        """n bytes from `pos` (fewer at the end of the file). Each byte is copied twice, from the
        kernel into a chunk and from the chunk into the member's own bytes."""
        nonlocal buf, base
        end = base + len(buf)
        if pos + n > end:
            if pos > end:  # past what was read (the data of a member not needed): skip it
                f.seek(pos)
            kept = buf[pos - base :] if pos < end else b""
            fresh = bytearray(max(chunk, n))
            fresh[: len(kept)] = kept
            got, view = len(kept), memoryview(fresh)
            while got < n and (k := f.readinto(view[got:])):
                got += k
            buf, base = view[:got], pos
        return bytes(buf[pos - base : pos - base + n])

    pos = first = offset
    long_name = None
    while len(header := need(pos, BLOCK)) == BLOCK and header != ZERO_BLOCK:
        try:
            if octal(header[148:156]) != sum(header[:148]) + 8 * 32 + sum(header[156:]):  # chksum counts as spaces
                raise ValueError("wrong checksum")
            size, kind = octal(header[124:136]), header[156:157]
        except ValueError as e:
            raise tarfile.ReadError(f"bad tar header at byte {pos} ({e})") from None
        data_pos, pos = pos + BLOCK, pos + BLOCK + -(-size // BLOCK) * BLOCK
        if kind in (b"x", b"L"):  # the next member's long name: a pax record "path=..." or GNU's
            data = need(data_pos, size)
            if kind == b"L":
                long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            for record in data.decode("utf-8", "surrogateescape").split("\n"):
                if " path=" in record:
                    long_name = record.split(" path=", 1)[1]
            continue
        if kind in REGULAR:
            name = long_name
            if name is None:
                name = header[:100].split(b"\0", 1)[0]
                if header[257:262] == b"ustar" and header[345] != 0:  # ustar's name prefix
                    name = header[345:500].split(b"\0", 1)[0] + b"/" + name
                name = name.decode("utf-8", "surrogateescape")
            data = need(data_pos, size)
            if len(data) < size:
                raise tarfile.ReadError(f"{name}: data cut short ({len(data)} of {size} bytes)")
            yield first, name, data, pos
        long_name, first = None, pos


# --- aed's own shards -------------------------------------------------------------------------


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
        a corrupt shard. Members are read by `tar_members` (chunk=0: one example)."""
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


