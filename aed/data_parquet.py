"""Hugging Face parquet files, read in place:

    {parquet: "data/train-*.parquet", audio_column: audio, text_column: sentence, source_lang: en}

The layout is written by `datasets` (`Dataset.to_parquet` / `push_to_hub`; the `Audio` feature's storage,
huggingface/datasets `src/datasets/features/audio.py`): the audio column is a struct `{bytes, path}` holding each
file's encoded bytes (WAV, FLAC, MP3), rows are stored in row groups of ~100 (audio datasets).
Every manifest field can come from a column: `<field>_column: NAME` names it, a column named as
the field is taken otherwise, and `<field>: VALUE` sets a constant for files without such a
column (common: one language per dataset). Fields: text (or answer), duration, offset,
source_lang, target_lang (or lang), pnc, taskname. Without a duration column, the duration is
read from each audio header (no decoding).

A shard is one row group, so many ranks can share a few large files. Keys are (shard, row),
cursors (position in this rank's shard order, shard, next row): a resume reads one row group.
Faults (`self.faults`): an unreadable file or row group (skipped), a row without audio bytes or
whose header cannot be read, an invalid row. pyarrow is optional: it is imported here only.
"""

import glob
import io
from collections import OrderedDict

import soundfile as sf

from aed.data_manifest import Faults
from aed.data_shards import resume_shards

FIELDS = ("text", "answer", "duration", "offset", "source_lang", "target_lang", "lang", "pnc", "taskname")


def import_pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading parquet needs pyarrow, an optional dependency: pip install pyarrow") from None
    return pq


def header_duration(data: bytes) -> float:
    """Seconds of an encoded audio file, from its header. Raises RuntimeError/ValueError if unreadable."""
    with sf.SoundFile(io.BytesIO(data)) as f:
        if f.frames <= 0 or f.samplerate <= 0:
            raise ValueError("no samples in the header")
        return f.frames / f.samplerate


class ParquetSource:
    """Examples streamed from Hugging Face parquet files; see the module docstring."""

    GROUPS_CACHED = 4  # row groups `get` keeps read

    def __init__(self, pattern: str, audio_column: str = "audio", columns: dict | None = None,
                 constants: dict | None = None, shuffle_shards: bool = True):
        self.pq = import_pyarrow()
        self.paths = sorted(glob.glob(pattern))
        if not self.paths:
            raise FileNotFoundError(f"ParquetSource: no file matches {pattern}")
        self.audio_column, self.constants, self.shuffle_shards = audio_column, dict(constants or {}), shuffle_shards
        self.what = f"parquet files {pattern}"
        self.faults = Faults()
        self.shards = []  # (file index, row group, rows before it in the file)
        self.columns = {}  # field -> column name, from the first readable file's schema
        for i, path in enumerate(self.paths):
            try:
                pf = self.pq.ParquetFile(path)
                meta = pf.metadata
            except (OSError, ValueError) as e:  # pyarrow's errors derive from these
                self.faults.skip("bad_shard", path, f"cannot read its footer ({e})")
                continue
            if not self.columns:
                self.columns = self._map_columns(pf.schema_arrow.names, columns or {}, path)
            first = 0
            for g in range(meta.num_row_groups):
                self.shards.append((i, g, first))
                first += meta.row_group(g).num_rows
        if not self.shards:
            raise ValueError(f"{self.what}: no readable row group")
        self._groups = OrderedDict()

    def _map_columns(self, names: list, columns: dict, path: str) -> dict:
        if self.audio_column not in names:
            raise ValueError(f"{path}: no audio column {self.audio_column!r} (columns: {names}); set audio_column")
        mapped = {f: f for f in FIELDS if f in names and f not in self.constants}
        for field, name in columns.items():
            if name not in names:
                raise ValueError(f"{path}: no column {name!r} for {field} (columns: {names})")
            mapped[field] = name
        return mapped

    def __len__(self) -> int:
        return len(self.shards)

    def read(self, seed: int, rank: int, world_size: int, cursor=None):
        """Yields (key, cursor after this example, example) for this rank, from `cursor` on."""
        for p, shard, (row,) in resume_shards(len(self.shards), seed, rank, world_size, self.shuffle_shards,
                                              self.what, cursor, (0,)):
            try:
                rows = self._read_group(shard)
            except (OSError, ValueError) as e:
                self.faults.skip("bad_shard", self._group_name(shard), f"cannot read it ({e})")
                continue
            for i in range(row, len(rows)):
                ex = self._example(shard, i, rows[i])
                if ex is not None:
                    yield (shard, i), (p, shard, i + 1), ex

    def get(self, key) -> dict:
        shard, i = key
        if shard not in self._groups:
            self._groups[shard] = self._read_group(shard)
            if len(self._groups) > self.GROUPS_CACHED:
                self._groups.popitem(last=False)
        ex = self._example(shard, i, self._groups[shard][i])
        if ex is None:
            raise ValueError(f"{self.describe(key)}: this example is no longer readable")
        return ex

    def describe(self, key) -> str:
        file, _, first = self.shards[key[0]]
        return f"{self.paths[file]}:{first + key[1]}"

    def _group_name(self, shard: int) -> str:
        file, group, _ = self.shards[shard]
        return f"{self.paths[file]} row group {group}"

    def _read_group(self, shard: int, audio: bool = True) -> list[dict]:
        """The row group's rows as dicts of the mapped columns, with the audio bytes under `audio`
        (left out with audio=False: the other columns are a tiny part of the bytes)."""
        file, group, _ = self.shards[shard]
        names = sorted(set(self.columns.values()))
        table = self.pq.ParquetFile(self.paths[file]).read_row_group(
            group, columns=[self.audio_column, *names] if audio else names)
        values = {f: table.column(c).to_pylist() for f, c in self.columns.items()}
        if audio:
            column = table.column(self.audio_column).combine_chunks()  # struct<bytes, path>, or plain binary
            values["audio"] = column.field("bytes").to_pylist() if hasattr(column, "field") else column.to_pylist()
        return [{f: v[i] for f, v in values.items()} for i in range(table.num_rows)]

    def _example(self, shard: int, i: int, row: dict) -> dict | None:
        where = self.describe((shard, i))
        data = row["audio"]
        if not data:
            self.faults.skip("undecodable", where, "no audio bytes in the row")
            return None
        d = {**self.constants, **self._present(row)}
        if "duration" not in d:
            try:
                d["duration"] = header_duration(data)
            except (RuntimeError, ValueError) as e:  # sf.LibsndfileError is a RuntimeError
                self.faults.skip("undecodable", where, f"cannot read the audio header ({e})")
                return None
        ex = self.faults.fields(d, where)
        return ex and {**ex, "audio": data, "where": where, "audio_filepath": where}

    @staticmethod
    def _present(row: dict) -> dict:
        """The row's fields that have a value (a null cell falls back to the constant, if any)."""
        return {f: v for f, v in row.items() if v is not None and f != "audio"}

    def metadata(self):
        """Yields (where, example fields) of every valid row; audio is read only for durations that
        no column gives."""
        audio = "duration" not in self.columns and "duration" not in self.constants
        for shard in range(len(self.shards)):
            try:
                rows = self._read_group(shard, audio)
            except (OSError, ValueError) as e:
                self.faults.skip("bad_shard", self._group_name(shard), f"cannot read it ({e})")
                continue
            for i, row in enumerate(rows):
                if audio:
                    ex = self._example(shard, i, row)
                    if ex is not None:
                        yield ex["where"], {k: v for k, v in ex.items() if k != "audio"}
                elif ex := self.faults.fields({**self.constants, **self._present(row)}, self.describe((shard, i))):
                    yield self.describe((shard, i)), ex
