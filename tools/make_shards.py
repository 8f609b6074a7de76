"""Pack a manifest into tar shards for sequential reading at cluster scale.

    python tools/make_shards.py data/mini/train.jsonl -o /tmp/mini_shards --shard-size 100 \\
        --shuffle --seed 0 --tokenizer data/mini/tokenizer --num-workers 2

Writes DIR/shard-000000.tar, ... (layout in aed/data_shards.py) and the index DIR/shards.jsonl
(path, count, total duration per shard), read by `aed.data_shards.ShardSource`.

- Audio is copied byte for byte (FLAC, WAV, ... any soundfile format). An utterance with an
  offset (a segment of a longer recording) is cut and stored as FLAC; `--reencode` stores every
  utterance as FLAC. FLAC keeps 8/16/24-bit PCM exactly; float sources become 24-bit.
- `--tokenizer DIR` stores `num_tokens` (prompt + text + EOS, as train.py counts) so the bucketing
  sampler never tokenizes. Shards made without it are tokenised as they stream by
  (`aed.data_sources.CountTokens`).
- `--shuffle` mixes speakers and languages across shards; the reader only shuffles shard order
  and a local buffer, so a manifest sorted by language should be shuffled here.
- Invalid manifest lines and unreadable audio are reported with file and line and skipped; the
  counts are printed at the end. Shards are written to a temporary name and renamed when
  complete, so an interrupted run leaves no half-written shard under a final name.
"""

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import random
import sys
import tarfile
import time
from pathlib import Path

import soundfile as sf

from aed.data_batch import encode_utterance
from aed.data_manifest import ManifestError, manifest_lines, parse_line
from aed.data_shards import INDEX_NAME, SHARD_NAME
from aed.data_tokenizer import Tokenizer

FLAC_SUBTYPES = {"PCM_S8", "PCM_16", "PCM_24"}  # what FLAC stores losslessly


def audio_bytes(utt, reencode: bool) -> tuple:
    """(encoded bytes, extension) of one utterance's audio: the file as it is, or cut to
    [offset, offset + duration) when the utterance is a segment of it (its line gave an offset), so
    a member always holds exactly its utterance. Raises (RuntimeError, ValueError, OSError) on
    unreadable audio."""
    if not reencode and not utt.segment:
        data = Path(utt.audio_filepath).read_bytes()
        info = sf.info(io.BytesIO(data))  # header check: a missing or non-audio file fails here
        if info.frames == 0:
            raise ValueError("no samples")
        return data, Path(utt.audio_filepath).suffix.lstrip(".").lower() or info.format.lower()
    with sf.SoundFile(utt.audio_filepath) as f:
        start = round(utt.offset * f.samplerate)
        if start >= f.frames:
            raise ValueError(f"offset {utt.offset}s is beyond the end ({f.frames / f.samplerate:.3f}s)")
        f.seek(start)
        wav = f.read(round(utt.duration * f.samplerate), dtype="float32", always_2d=True)  # (S, channels)
        rate, subtype = f.samplerate, f.subtype if f.subtype in FLAC_SUBTYPES else "PCM_24"
    if len(wav) == 0:
        raise ValueError("no samples")
    out = io.BytesIO()
    sf.write(out, wav, rate, format="FLAC", subtype=subtype)
    return out.getvalue(), "flac"


def add_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0  # mtime 0: same input, same bytes
    tf.addfile(info, io.BytesIO(data))


def write_shard(job: tuple) -> tuple:
    """Writes one shard; returns (shard index, path, count, duration, [skip messages])."""
    shard, out_dir, items, reencode = job
    path = Path(out_dir) / SHARD_NAME.format(shard)
    tmp = path.with_name(path.name + ".tmp")
    count, duration, skipped = 0, 0.0, []
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
        for idx, utt, num_tokens in items:
            try:
                data, ext = audio_bytes(utt, reencode)
            except (RuntimeError, ValueError, OSError) as e:  # sf.LibsndfileError is a RuntimeError
                skipped.append(f"{utt.where}: {utt.audio_filepath}: unreadable audio ({e})")
                continue
            meta = {"audio_filepath": utt.audio_filepath, "duration": utt.duration, "text": utt.text,
                    "source_lang": utt.source_lang, "target_lang": utt.target_lang, "pnc": utt.pnc,
                    "taskname": utt.taskname, "segment": False}  # the member holds exactly this utterance
            if num_tokens is not None:
                meta["num_tokens"] = num_tokens
            add_member(tf, f"{idx:09d}.json", json.dumps(meta, ensure_ascii=False).encode())
            add_member(tf, f"{idx:09d}.{ext}", data)
            count, duration = count + 1, duration + utt.duration
    if count:
        os.replace(tmp, path)
    else:
        tmp.unlink()
    return shard, path.name, count, duration, skipped


def read_utterances(manifest: str) -> tuple:
    """Valid utterances of the manifest and the messages of the lines skipped."""
    base_dir = os.path.dirname(os.path.abspath(manifest))
    utts, bad = [], []
    for where, line in manifest_lines(manifest):
        try:
            utts.append(parse_line(line, where, base_dir))
        except ManifestError as e:
            bad.append(str(e))
    return utts, bad


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("manifest", help="NeMo-style JSONL manifest (aed/data_manifest.py)")
    p.add_argument("-o", "--output", required=True, help="output folder (created)")
    p.add_argument("--shard-size", type=int, default=1000, help="examples per shard")
    p.add_argument("--shuffle", action="store_true", help="shuffle the manifest before sharding")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="aed tokenizer folder: store num_tokens")
    p.add_argument("--reencode", action="store_true", help="store all audio as FLAC")
    p.add_argument("--num-workers", type=int, default=1, help="processes writing shards in parallel")
    args = p.parse_args(argv)
    if args.shard_size < 1:
        p.error("--shard-size must be >= 1")

    t0 = time.time()
    utts, bad_lines = read_utterances(args.manifest)
    for msg in bad_lines:
        print(f"skipped line: {msg}", file=sys.stderr)
    if args.shuffle:
        random.Random(args.seed).shuffle(utts)
    tok = Tokenizer.load(args.tokenizer) if args.tokenizer else None
    items = [(i, u, len(encode_utterance(tok, u)[0]) if tok else None) for i, u in enumerate(utts)]
    os.makedirs(args.output, exist_ok=True)
    jobs = [(s, args.output, items[i : i + args.shard_size], args.reencode)
            for s, i in enumerate(range(0, len(items), args.shard_size))]
    print(f"{args.manifest}: {len(utts)} utterances ({len(bad_lines)} invalid lines skipped) "
          f"-> {len(jobs)} shards in {args.output}", file=sys.stderr)

    done, written, hours, bad_audio = [], 0, 0.0, 0
    ctx = multiprocessing.get_context("fork")  # workers inherit the parsed utterances
    with ctx.Pool(args.num_workers) if args.num_workers > 1 else contextlib.nullcontext() as pool:
        results = pool.imap_unordered(write_shard, jobs) if pool else map(write_shard, jobs)
        for finished, (shard, name, count, duration, skipped) in enumerate(results, 1):
            for msg in skipped:
                print(f"skipped: {msg}", file=sys.stderr)
            bad_audio += len(skipped)
            written, hours = written + count, hours + duration / 3600
            if count:
                done.append((shard, {"path": name, "count": count, "duration": round(duration, 3)}))
            elapsed = time.time() - t0
            eta = elapsed / (written + bad_audio) * (len(utts) - written - bad_audio) if written else 0
            print(f"[{finished}/{len(jobs)} shards] {written} examples, {hours:.2f} h, "
                  f"{written / elapsed:.0f} ex/s, eta {eta:.0f}s", file=sys.stderr)

    with open(Path(args.output) / INDEX_NAME, "w") as f:
        for _, entry in sorted(done, key=lambda x: x[0]):
            f.write(json.dumps(entry) + "\n")
    print(f"wrote {written} examples ({hours:.2f} h) in {len(done)} shards + {INDEX_NAME} to {args.output} "
          f"in {time.time() - t0:.1f}s; skipped {len(bad_lines)} invalid lines, {bad_audio} unreadable audio",
          file=sys.stderr)


if __name__ == "__main__":
    main()
