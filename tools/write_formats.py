"""Write a JSONL manifest as a NeMo tarred set, a Lhotse Shar directory or Hugging Face parquet:
small writers that follow each format's published layout, for the tests' fixtures and the reader
benchmark (bench/reader_bench.py), and to try aed's readers on a known manifest.

    python tools/write_formats.py nemo data/mini/train.jsonl -o /tmp/nemo --shards 4
    python tools/write_formats.py shar data/mini/train.jsonl -o /tmp/shar --shard-size 100
    python tools/write_formats.py parquet data/mini/train.jsonl -o /tmp/hf --shards 2

The layouts, as each format's own writer produces them:
- nemo: NeMo's scripts/speech_recognition/convert_to_tarred_audio_dataset.py (`_create_shard`).
  Shards of equal size (the `len % shards` rows left over are dropped, as NeMo does), members named
  after the source path (`/` and `.` -> `_`), a file stored once per shard with later rows naming
  `<base>-sub<N><ext>`, rows keeping their fields plus `shard_id`; `force_codec` re-encodes members
  (new extension) and leaves the rows' names alone, as NeMo's --force_codec does.
- shar: lhotse's lhotse/shar/writers/ (`SharWriter`): `cuts.%06d.jsonl.gz` and `recording.%06d.tar`
  with `<cut_id>.flac` + `<cut_id>.json` pairs; Canary's fields in the cut's `custom`.
- parquet: `datasets`' `to_parquet` (src/datasets/features/audio.py): `data/train-%05d-of-%05d.parquet`,
  an `audio` struct<bytes, path> column, the other fields as columns, row groups of 100 rows, the
  features in the `huggingface` schema metadata.
Rows are manifest dicts (aed/data_manifest.py) with absolute paths; a row with `offset` is a segment
(nemo keeps the whole file and the offset; shar and parquet store the cut audio as FLAC).
"""

import argparse
import gzip
import io
import json
import os
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing aed

from tools.make_shards import add_member, audio_bytes  # noqa: E402

CANARY_FIELDS = ("source_lang", "target_lang", "pnc", "taskname", "answer", "lang")


def segment_audio(row: dict) -> tuple[bytes, str]:
    """(encoded bytes, extension) of a row's utterance: the file as it is, or its segment as FLAC."""
    utt = SimpleNamespace(audio_filepath=row["audio_filepath"], offset=row.get("offset", 0.0), duration=row["duration"],
                          segment="offset" in row)
    return audio_bytes(utt, reencode=False)


def reencode(data: bytes, fmt: str) -> bytes:
    with sf.SoundFile(io.BytesIO(data)) as f:
        wav, rate, subtype = f.read(dtype="int16" if f.subtype == "PCM_16" else "float32"), f.samplerate, f.subtype
    out = io.BytesIO()
    sf.write(out, wav, rate, format=fmt.upper(), subtype=subtype if fmt.lower() in ("wav", "flac") else None)
    return out.getvalue()


def write_nemo_tarred(rows: list[dict], out: str, num_shards: int, force_codec: str | None = None) -> int:
    """audio_<k>.tar + sharded_manifests/manifest_<k>.json + tarred_audio_manifest.json; returns rows written."""
    out = Path(out)
    (out / "sharded_manifests").mkdir(parents=True, exist_ok=True)
    per_shard = len(rows) // num_shards
    everything = []
    for k in range(num_shards):
        stored, shard_rows = {}, []  # source path -> times named in this shard
        with tarfile.open(out / f"audio_{k}.tar", "w", format=tarfile.PAX_FORMAT) as tf:
            for row in rows[k * per_shard : (k + 1) * per_shard]:
                src = row["audio_filepath"]
                stem, ext = os.path.splitext(src)
                base = stem.replace("/", "_").replace(".", "_")
                if src in stored:
                    name = f"{base}-sub{stored[src]}{ext}"
                else:
                    data = Path(src).read_bytes()
                    member_ext = ext
                    if force_codec:
                        data, member_ext = reencode(data, force_codec), "." + force_codec
                    add_member(tf, base + member_ext, data)
                    name = base + ext
                stored[src] = stored.get(src, 0) + 1
                shard_rows.append({**row, "audio_filepath": name, "shard_id": k})
        with open(out / "sharded_manifests" / f"manifest_{k}.json", "w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in shard_rows)
        everything += shard_rows
    with open(out / "tarred_audio_manifest.json", "w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in everything)
    (out / "metadata.yaml").write_text(f"num_shards: {num_shards}\nshuffle: false\nforce_codec: {force_codec}\n")
    return len(everything)


def shar_cut(cut_id: str, row: dict, rate: int, num_samples: int) -> tuple[dict, dict]:
    """(cut, recording) dicts as lhotse's MonoCut.to_dict() / Recording.to_dict() write them."""
    d = row["duration"]
    recording = {"id": cut_id, "sources": [{"type": "shar", "channels": [0], "source": ""}], "sampling_rate": rate,
                 "num_samples": num_samples, "duration": num_samples / rate, "channel_ids": [0]}
    sup = {"id": cut_id, "recording_id": cut_id, "start": 0.0, "duration": d, "channel": 0,
           "text": row.get("text", row.get("answer")), "language": row.get("source_lang", row.get("lang"))}
    custom = {k: row[k] for k in CANARY_FIELDS if k in row and k not in ("answer", "lang")}
    cut = {"id": cut_id, "start": 0.0, "duration": d, "channel": 0, "supervisions": [sup],
           "recording": recording, "custom": custom, "type": "MonoCut"}
    return cut, recording


def write_shar(rows: list[dict], out: str, shard_size: int = 1000) -> int:
    """cuts.%06d.jsonl.gz + recording.%06d.tar; returns rows written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for k, first in enumerate(range(0, len(rows), shard_size)):
        with gzip.open(out / f"cuts.{k:06d}.jsonl.gz", "wt", encoding="utf-8") as cuts, \
                tarfile.open(out / f"recording.{k:06d}.tar", "w", format=tarfile.PAX_FORMAT) as tf:
            for i, row in enumerate(rows[first : first + shard_size], first):
                data, ext = segment_audio(row)
                info = sf.info(io.BytesIO(data))
                cut_id = f"{Path(row['audio_filepath']).stem}-{i:07d}"
                cut, recording = shar_cut(cut_id, row, info.samplerate, info.frames)
                cuts.write(json.dumps(cut, ensure_ascii=False) + "\n")
                add_member(tf, f"{cut_id}.{ext}", data)
                add_member(tf, f"{cut_id}.json", json.dumps(recording).encode())
    return len(rows)


def write_parquet(rows: list[dict], out: str, num_files: int = 1, row_group_size: int = 100,
                  rename: dict | None = None, duration: bool = True) -> int:
    """data/train-%05d-of-%05d.parquet; `rename` maps a field to its column name; duration=False
    leaves the duration column out (most Hub datasets have none). Returns rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rename = rename or {}
    (Path(out) / "data").mkdir(parents=True, exist_ok=True)
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in ("audio_filepath", "offset")]
    if not duration:
        keys.remove("duration")
    features = {"audio": {"sampling_rate": 16000, "_type": "Audio"}} | {
        rename.get(k, k): {"dtype": "float64" if k == "duration" else "string", "_type": "Value"} for k in keys}
    per_file = -(-len(rows) // num_files)
    for k in range(num_files):
        part = rows[k * per_file : (k + 1) * per_file]
        audio = []
        for row in part:
            data, _ = segment_audio(row)
            audio.append({"bytes": data, "path": Path(row["audio_filepath"]).name})
        columns = {"audio": pa.array(audio, pa.struct([("bytes", pa.binary()), ("path", pa.string())]))}
        for key in keys:
            values = [r.get(key) for r in part]
            columns[rename.get(key, key)] = pa.array(values, pa.float64() if key == "duration" else pa.string())
        table = pa.table(columns).replace_schema_metadata(
            {"huggingface": json.dumps({"info": {"features": features}})})
        pq.write_table(table, Path(out) / "data" / f"train-{k:05d}-of-{num_files:05d}.parquet",
                       row_group_size=row_group_size, compression="none")  # audio is compressed already
    return len(rows)


def read_rows(manifest: str) -> list[dict]:
    """The manifest's rows with absolute audio paths."""
    base = os.path.dirname(os.path.abspath(manifest))
    rows = [json.loads(line) for line in open(manifest, encoding="utf-8") if line.strip()]
    for r in rows:
        r["audio_filepath"] = os.path.join(base, r["audio_filepath"])
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("format", choices=["nemo", "shar", "parquet"])
    p.add_argument("manifest")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--shards", type=int, default=1, help="nemo: tar shards; parquet: files")
    p.add_argument("--shard-size", type=int, default=1000, help="shar: cuts per shard")
    args = p.parse_args(argv)
    rows = read_rows(args.manifest)
    if args.format == "nemo":
        n = write_nemo_tarred(rows, args.output, args.shards)
    elif args.format == "shar":
        n = write_shar(rows, args.output, args.shard_size)
    else:
        n = write_parquet(rows, args.output, args.shards)
    print(f"wrote {n} of {len(rows)} rows as {args.format} to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
