"""Tar shards whose audio members are matched to metadata rows by file stem: what the readers of
NeMo tarred datasets (aed/nemo_tarred.py) and Lhotse Shar (aed/shar.py) share.

A shard is a metadata file (NeMo: a manifest; Shar: a cuts file) and a tar of audio members. The
writers store members in row order, but a reader cannot pair them by position: NeMo stores a file
that several rows name once per shard, its converter may change a member's extension, and a
damaged shard loses members. So each shard's rows are grouped by the stem of the member they
name, and the tar is read in order, each member giving the rows of its stem (in row order) with
its bytes. A file cut into segments is one member shared by its rows (one `bytes` object in
memory), each row carrying its `offset`.

Streamed-source protocol (`sampler.py`; as `aed.shards.ShardSource`):
- keys (shard, byte offset of the member's header, row of that member); `get` seeks straight to it.
- cursors (position in this rank's shard order, shard, member header offset, next row of that
  member): a resume seeks into the open shard and re-reads one member, no earlier example.
- faults (`self.faults`, aed/streaming.py): a missing or unreadable shard (the rest of it is
  lost), a member no row names, a row whose member is absent (known at the end of the shard),
  an invalid row. Audio is decoded later (`ShardDataset`), where an undecodable member is reported.
"""

import tarfile
from collections import OrderedDict

from aed.streaming import Faults, shard_order


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

    Read in `chunk`-byte pieces and parsed here, not by tarfile: tarfile's per-member calls (header
    object, seek, tell, one read each) took ~40% of a sampler pass over a NeMo set in a profile, and
    a read per member is a GIL hand-off per member with the sampler's producer thread. Handles
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


class StemMatchedTarSource:
    """Base of the stem-matched tar readers. A subclass sets `self.shards` to [(metadata path, tar
    path)] and `self.what` (a name for messages), and implements `_load_rows(shard)` ->
    {stem: [(where, example fields or None for an invalid row already counted)]} and
    `_member(name)` -> (stem, "audio" | "skip" | "nodata")."""

    ROWS_CACHED = 64  # shards whose rows `get` keeps parsed (a resume re-reads a buffer's examples)

    def __init__(self, shards: list, what: str, shuffle_shards: bool = True):
        if not shards:
            raise ValueError(f"{what}: no shards")
        self.shards, self.what, self.shuffle_shards = shards, what, shuffle_shards
        self.faults = Faults()
        self._handles = {}
        self._rows = OrderedDict()

    def __len__(self) -> int:
        return len(self.shards)

    def read(self, seed: int, rank: int, world_size: int, cursor=None):
        """Yields (key, cursor after this example, example) for this rank, from `cursor` on."""
        order = shard_order(len(self.shards), seed, rank, world_size, self.shuffle_shards, self.what)
        pos, shard, offset, row = cursor or (0, None, 0, 0)
        if shard is not None and (pos >= len(order) or order[pos] != shard):
            raise ValueError(f"resume cursor {cursor} does not match the shard order of {self.what}: the "
                             "shards or the number of readers changed since the checkpoint")
        for p in range(pos, len(order)):
            yield from self._read_shard(p, order[p], offset, row)
            offset = row = 0

    def _read_shard(self, p: int, shard: int, offset: int, row: int):
        meta_path, tar_path = self.shards[shard]
        try:
            groups = dict(self.rows(shard))  # a copy: members pop their rows
        except (OSError, EOFError, ValueError) as e:  # missing, unreadable, bad gzip, not UTF-8
            self.faults.skip("bad_shard", meta_path, f"cannot read it ({e})")
            return
        try:
            f = open(tar_path, "rb", buffering=0)  # tar_members reads large chunks itself
        except OSError as e:
            self.faults.skip("bad_shard", tar_path, f"cannot open it ({e})")
            return
        try:
            with f:
                if offset:  # rows of the members before the cursor were read before the resume
                    self._forget_before(f, offset, groups)
                for at, name, data, _ in tar_members(f, offset):
                    stem, role = self._member(name)
                    if role == "skip":
                        continue
                    rows = groups.pop(stem, None)
                    if rows is None:
                        self.faults.skip("member_without_row", f"{tar_path}:{name}", f"no row of {meta_path} names it")
                        continue
                    for j in range(row if at == offset else 0, len(rows)):
                        where, ex = rows[j]
                        if ex is None:
                            continue
                        if role == "nodata":
                            self.faults.skip("undecodable", where, f"{tar_path}:{name}: stored without audio")
                            continue
                        yield (shard, at, j), (p, shard, at, j + 1), {**ex, "audio": data, "where": where}
        except (OSError, EOFError, tarfile.TarError) as e:
            self.faults.skip("bad_shard", tar_path, f"the rest of it is lost ({e})")
            return
        for stem, rows in groups.items():
            for where, ex in rows:
                if ex is not None:
                    self.faults.skip("row_without_member", where, f"no member {stem}.* in {tar_path}")

    def _forget_before(self, f, offset: int, groups: dict) -> None:
        """Drops the rows of the members whose headers come before `offset` (headers only are read)."""
        f.seek(0)
        tf = tarfile.open(fileobj=f, mode="r:")
        while (m := tf.next()) is not None and m.offset < offset:
            tf.members.clear()
            groups.pop(self._member(m.name)[0], None)

    def rows(self, shard: int) -> dict:
        """The shard's rows grouped by member stem, parsed once and kept for the last few shards."""
        if shard in self._rows:
            self._rows.move_to_end(shard)
        else:
            self._rows[shard] = self._load_rows(shard)
            if len(self._rows) > self.ROWS_CACHED:
                self._rows.popitem(last=False)
        return self._rows[shard]

    def get(self, key) -> dict:
        shard, offset, j = key
        tar_path = self.shards[shard][1]
        try:
            if shard not in self._handles:
                self._handles[shard] = open(tar_path, "rb", buffering=0)
            _, name, data, _ = next(tar_members(self._handles[shard], offset, chunk=0))
            where, ex = self.rows(shard)[self._member(name)[0]][j]
        except (StopIteration, KeyError, IndexError, OSError, EOFError, tarfile.TarError) as e:
            raise ValueError(f"{self.describe(key)}: cannot re-read this example ({e!r})") from None
        return {**ex, "audio": data, "where": where}

    def describe(self, key) -> str:
        return f"{self.shards[key[0]][1]} (member at byte {key[1]}, row {key[2]})"

    def metadata(self):
        """Yields (where, example fields) of every valid row, shard by shard, reading no audio:
        what bins and oom.py need (durations are in the metadata)."""
        for shard, (meta_path, _) in enumerate(self.shards):
            try:
                groups = self._load_rows(shard)
            except (OSError, EOFError, ValueError) as e:
                self.faults.skip("bad_shard", meta_path, f"cannot read it ({e})")
                continue
            for rows in groups.values():
                yield from ((where, ex) for where, ex in rows if ex is not None)
