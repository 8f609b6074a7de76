"""Other toolkits' datasets, read in place: NeMo tarred datasets and Lhotse Shar, tar shards whose
audio members are matched to metadata rows by file stem (`StemMatchedTarSource`), with each
format's layout on top (`NemoTarredSource`, `SharSource`), and Hugging Face parquet
(`ParquetSource`). Each is one train.manifests entry (aed/data_sources.py), streamed.

A NeMo or Shar shard is a metadata file (NeMo: a manifest; Shar: a cuts file) and a tar of audio
members. The writers store members in row order, but a reader cannot pair them by position: NeMo
stores a file that several rows name once per shard, its converter may change a member's
extension, and a damaged shard loses members. So each shard's rows are grouped by the stem of the
member they name, and the tar is read in order, each member giving the rows of its stem (in row
order) with its bytes. A file cut into segments is one member shared by its rows (one `bytes`
object in memory), each row carrying its `offset`.

Their streamed-source protocol (`sampler.py`; as `aed.data_shards.ShardSource`):
- keys (shard, byte offset of the member's header, row of that member); `get` seeks straight to it.
- cursors (position in this rank's shard order, shard, member header offset, next row of that
  member): a resume seeks into the open shard and re-reads one member, no earlier example.
- faults (`self.faults`, `aed.data_manifest.Faults`): a missing or unreadable shard (the rest of it is
  lost), a member no row names, a row whose member is absent (known at the end of the shard),
  an invalid row. Audio is decoded later (`aed.data_batch.ExampleDataset`), where an undecodable member or
  one whose length disagrees with its duration is reported.

NeMo tarred audio datasets:

    {manifest_filepath: "data/bucket1/sharded_manifests/manifest__OP_0..127_CL_.json",
     tarred_audio_filepaths: "data/bucket1/audio__OP_0..127_CL_.tar", weight: 1}

The layout is written by NeMo's `scripts/speech_recognition/convert_to_tarred_audio_dataset.py`
(NVIDIA/NeMo, `scripts/speech_recognition/convert_to_tarred_audio_dataset.py`, and NeMo's
`nemo/collections/asr/data/audio_to_text.py` that reads it): per shard k, `audio_k.tar` and a JSONL
manifest `sharded_manifests/manifest_k.json` whose rows keep their fields (Canary's `source_lang`,
`target_lang`, `pnc`, `taskname`, or `answer` and `lang`) and name their tar member in
`audio_filepath`. The rules followed here are NeMo's:

- Paths: `_OP_` / `_CL_` (and `(`, `[`, `<` / `)`, `]`, `>`) stand for braces, then brace expansion
  (`{0..127}`, `{a,b}`); a list of such strings is expanded item by item.
- Shards are paired by the id in their names (`manifest*_<k>*.json`, `audio*_<k>*.tar`), the
  n-th manifest with id k going with the n-th tar with id k, so several buckets' `audio_0.tar`
  do not collide; names without ids pair by position. One manifest for many tars (NeMo's
  `shard_manifests: false`, e.g. `tarred_audio_manifest.json`) sends each row to its `shard_id`.
- A file several rows name (segments, with `offset`) is stored once per shard; later rows name it
  `<base>-sub<N><ext>`: the stem without `-sub<N>` finds the member. Members are matched by stem,
  as the converter's --force_codec changes the extension but not the rows.

Durations come from the manifests (`metadata()`).

Lhotse Shar directories: `{shar: DIR}`.

The layout is written by lhotse's `lhotse/shar/writers/` (documented in Lhotse's "Lhotse Shar"
tutorial, `docs/shar.rst`, and read by `lhotse/shar/readers/lazy.py`): per shard `cuts.000000.jsonl.gz` (one cut per line) and
`recording.000000.tar`, whose members come in pairs in cut order, `<cut_id>.<fmt>` (the cut's
own audio: flac by default, or wav, mp3, opus) then `<cut_id>.json` (its Recording); a cut with
no audio has `<cut_id>.nodata` + `<cut_id>.nometa`. Other fields' files are not needed here.
The stored audio is decoded whole unless the cut is a part of its recording (`cut_row`).

A cut becomes an example by the manifest's rules (`aed.data_manifest.example_fields`): duration
from the cut; text from its supervisions (joined, in order) and the source language from the
first one's `language`; Canary's fields (`source_lang`, `target_lang`, `pnc`, `taskname`, or
NeMo's `answer` / `lang`) from the supervision's `custom` dict, overridden by the cut's (where
NeMo's converters put manifest keys).
Durations come from the cuts (`metadata()`).

Hugging Face parquet files:

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
whose header cannot be read, an invalid row. pyarrow is optional: it is imported only when
a parquet source is opened (`import_pyarrow`).
"""

import glob
import io
import json
import re
import tarfile
from collections import OrderedDict, defaultdict
from pathlib import Path

import soundfile as sf

from aed.data_manifest import DURATION_TOLERANCE, Faults, manifest_lines
from aed.data_shards import resume_shards, tar_members


# --- NeMo tarred datasets and Lhotse Shar: tar members matched to rows by stem --------------------


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
        for p, shard, (offset, row) in resume_shards(len(self.shards), seed, rank, world_size, self.shuffle_shards,
                                                     self.what, cursor, (0, 0)):
            yield from self._read_shard(p, shard, offset, row)

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


MANIFEST_ID = re.compile(r"manifest[^/]*_(\d+)[^/]*\.json$")
TAR_ID = re.compile(r"audio[^/]*_(\d+)[^/]*\.tar$")
SUB_SUFFIX = re.compile(r"-sub\d+$")
OPEN, CLOSE = ("_OP_", "(", "[", "<"), ("_CL_", ")", "]", ">")


def expand_braces(s: str) -> list[str]:
    """Brace expansion, innermost group first: `a{0..2}` -> a0 a1 a2 (`{00..10}` keeps the width, `{0..10}` not),
    `{x,y}` -> x y."""
    m = re.search(r"\{([^{}]*)\}", s)
    if m is None:
        return [s]
    body, head, tail = m.group(1), s[: m.start()], s[m.end() :]
    if r := re.fullmatch(r"(\d+)\.\.(\d+)", body):
        lo, hi = r.groups()
        padded = any(len(b) > 1 and b.startswith("0") for b in (lo, hi))  # bash's rule: {00..10}, not {0..10}
        width = max(len(lo), len(hi)) if padded else 0
        step = 1 if int(hi) >= int(lo) else -1
        items = [str(i).zfill(width) for i in range(int(lo), int(hi) + step, step)]
    elif "," in body:
        items = body.split(",")
    else:
        raise ValueError(f"{s}: cannot expand {{{body}}} (expected a..b or a,b,...)")
    out = []
    for item in items:
        for x in expand_braces(head + item + tail):
            if x not in out:
                out.append(x)
    return out


def expand_paths(spec) -> list[str]:
    """NeMo's path syntax (a string, or a list of them) -> the paths it names, in order."""
    out = []
    for s in [spec] if isinstance(spec, str) else spec:
        for o in OPEN:
            s = s.replace(o, "{")
        for c in CLOSE:
            s = s.replace(c, "}")
        out += expand_braces(s)
    return out


def pair_shards(manifests: list[str], tars: list[str]) -> list[tuple[str, str]]:
    """(manifest, tar) per shard, matched by (shard id, occurrence) as NeMo does, else by position."""
    def keyed(paths, pattern):
        seen, keys = defaultdict(int), []
        for p in paths:
            m = pattern.search(Path(p).name)
            if m is None:
                return None
            k = int(m.group(1))
            keys.append((k, seen[k]))
            seen[k] += 1
        return dict(zip(keys, paths))

    by_manifest, by_tar = keyed(manifests, MANIFEST_ID), keyed(tars, TAR_ID)
    if by_manifest is not None and by_tar is not None:
        if set(by_manifest) != set(by_tar):
            lonely = sorted(set(by_manifest) ^ set(by_tar))[:3]
            raise ValueError(f"NeMo tarred set: manifests and tars name different shards, e.g. (id, occurrence) "
                             f"{lonely}: {len(manifests)} manifests, {len(tars)} tars")
        return [(by_manifest[k], by_tar[k]) for k in by_manifest]
    if len(manifests) != len(tars):
        raise ValueError(f"NeMo tarred set: {len(manifests)} manifests but {len(tars)} tars, and their names "
                         "carry no shard ids (manifest_<k>.json, audio_<k>.tar) to pair them by")
    return list(zip(manifests, tars))


def member_stem(name: str) -> str:
    """The stem shared by a member and the rows naming it: no extension, no `-sub<N>`."""
    stem = name.rpartition(".")[0] or name
    return SUB_SUFFIX.sub("", stem)


class NemoTarredSource(StemMatchedTarSource):
    """Examples streamed from one NeMo tarred set (one bucket); see the module docstring. One
    manifest for many tars (NeMo's `shard_manifests: false`, e.g. `tarred_audio_manifest.json`) is
    read once, its rows going to the tar named by their `shard_id`."""

    def __init__(self, manifest_filepath, tarred_audio_filepaths, shuffle_shards: bool = True):
        manifests, tars = expand_paths(manifest_filepath), expand_paths(tarred_audio_filepaths)
        self._one_manifest = None  # shard_id -> rows grouped by stem, when one manifest serves every tar
        if len(manifests) == 1 and len(tars) > 1:
            ids = [TAR_ID.search(Path(t).name) for t in tars]
            if None in ids:
                raise ValueError(f"NeMo tarred set: one manifest for {len(tars)} tars, but a tar name carries no "
                                 f"shard id (audio_<k>.tar) to match the rows' shard_id: {tars[ids.index(None)]}")
            self._tar_ids = [int(m.group(1)) for m in ids]
            shards = [(manifests[0], t) for t in tars]
        else:
            shards = pair_shards(manifests, tars)
        super().__init__(shards, f"NeMo tarred set {tarred_audio_filepaths}", shuffle_shards)

    def _member(self, name: str) -> tuple[str, str]:
        return member_stem(name), "audio"

    def _load_rows(self, shard: int) -> dict:
        path = self.shards[shard][0]
        if not hasattr(self, "_tar_ids"):
            return self._parse(path)
        if self._one_manifest is None:
            self._one_manifest = self._parse(path, by_shard_id=True)
        return self._one_manifest.get(self._tar_ids[shard], {})

    def _parse(self, path: str, by_shard_id: bool = False) -> dict:
        """A manifest's rows grouped by member stem; by_shard_id: {shard_id: such groups}."""
        out = defaultdict(lambda: defaultdict(list)) if by_shard_id else defaultdict(list)
        for where, line in manifest_lines(path):
            try:
                d = json.loads(line)
                name = d["audio_filepath"]
                if not isinstance(name, str):
                    raise TypeError(f"audio_filepath is {type(name).__name__}")
                groups = out[int(d["shard_id"])] if by_shard_id else out
            except (ValueError, KeyError, TypeError) as e:
                self.faults.skip("invalid_row", where, f"not a JSON object with an audio_filepath"
                                 f"{' and a shard_id' if by_shard_id else ''} ({e!r})")
                continue
            ex = self.faults.fields(d, where)
            groups[member_stem(name)].append((where, ex and {**ex, "audio_filepath": name}))
        return out


CUTS_NAME = re.compile(r"cuts\.(\d+)\.jsonl(\.gz)?$")
NOT_AUDIO = {"json", "nometa"}  # the Recording manifest beside each audio member; no data's pair


def cut_row(cut: dict) -> dict:
    """A Shar cut -> a row with manifest keys. Lhotse stores each cut's own audio (its Recording
    starts where the cut does and lasts as long), decoded whole; a cut that is a part of its stored
    recording (a later `start`, or shorter than the recording says it lasts) is a segment of it,
    decoded from `start` for its duration."""
    sups = cut.get("supervisions") or []
    first = sups[0] if sups else {}
    d = {"lang": first.get("language"), **(first.get("custom") or {}), **(cut.get("custom") or {})}
    texts = [s["text"] for s in sups if isinstance(s.get("text"), str) and s["text"].strip()]
    if texts:
        d["text"] = " ".join(texts)
    d["duration"] = cut.get("duration")
    d.pop("offset", None)  # a manifest key NeMo's converters may leave: the stored audio is not the original file
    start, recorded = cut.get("start") or 0.0, (cut.get("recording") or {}).get("duration")
    numbers = all(isinstance(x, (int, float)) for x in (start, recorded, d["duration"]))
    if numbers and (start > 0 or recorded - d["duration"] > DURATION_TOLERANCE * d["duration"]):
        d["offset"] = float(start)
    return d


class SharSource(StemMatchedTarSource):
    """Examples streamed from one Shar directory; see the module docstring."""

    def __init__(self, directory, shuffle_shards: bool = True):
        root = Path(directory)
        if not root.is_dir():
            raise FileNotFoundError(f"SharSource: no such directory {root}")
        cuts = sorted((p for p in root.iterdir() if CUTS_NAME.match(p.name)), key=lambda p: p.name)
        if not cuts:
            raise ValueError(f"SharSource: {root} has no cuts.NNNNNN.jsonl.gz")
        shards = [(str(c), str(root / f"recording.{CUTS_NAME.match(c.name).group(1)}.tar")) for c in cuts]
        super().__init__(shards, f"Shar directory {root}", shuffle_shards)

    def _member(self, name: str) -> tuple[str, str]:
        stem, _, ext = name.rpartition(".")
        return stem, "skip" if ext in NOT_AUDIO else "nodata" if ext == "nodata" else "audio"

    def _load_rows(self, shard: int) -> dict:
        path = self.shards[shard][0]
        groups = defaultdict(list)
        for where, line in manifest_lines(path):
            try:
                cut = json.loads(line)
                cut_id = cut["id"]
            except (ValueError, KeyError, TypeError) as e:
                self.faults.skip("invalid_row", where, f"not a cut ({e!r})")
                continue
            where = f"{path}:{cut_id}"
            ex = self.faults.fields(cut_row(cut), where)
            groups[cut_id].append((where, ex and {**ex, "audio_filepath": cut_id}))
        return groups


# --- Hugging Face parquet -------------------------------------------------------------------------


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
