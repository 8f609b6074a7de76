"""Reader benchmark: NeMo tarred, Lhotse Shar and Hugging Face parquet read in place by aed, against
aed's own tar shards, per-file reading of the JSONL manifest, and Lhotse's reader of the same files.

    python bench/reader_bench.py                                   # 20,000 utterances, ~12 h of audio
    PYTHONPATH=/tmp/peers python bench/reader_bench.py             # with Lhotse (bench/requirements-peers.txt)

The set: data/mini's utterances hard-linked under 20,000 distinct names (distinct paths: NeMo's
converter stores a file that rows name twice only once per shard), written once per format by
tools/make_shards.py and tools/write_formats.py (1000 utterances per shard or file, parquet row
groups of 100) and kept in --work-dir for the next run.

Columns, one process and one thread each, the fastest of --repeat passes (the CPU is shared):
- read: every example's metadata and audio bytes, as the sampler's source yields them (Lhotse:
  iterating the CutSet, whose cuts hold the bytes). ex/s, and MB/s of the format's files.
  cold: the files' pages are dropped first (posix_fadvise DONTNEED; the host may still cache the
  virtual disk), warm: the same pass again right after.
- decode: read and decode every utterance to 16 kHz samples (aed: `decode_audio`; Lhotse:
  `cut.load_audio()`; files: `load_audio`), warm.
- sampler: examples/s of one epoch of `BucketingSampler` (2D bins, max_duration 200 s, buffer 2000,
  producer thread), token counts computed on the fly in every case (the JSONL source through
  num_tokens_fn), as training reads each source.
Lhotse has no reader of NeMo tarred sets (NeMo's own needs nemo_toolkit) nor of parquet files
(`from_huggingface_dataset` needs `datasets`): those cells are "-". Timings share 2 CPU cores with
other jobs: noisy. The last line is a JSON object.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

from aed.audio import load_audio
from aed.data import Utterance, encode_utterance, read_manifest, text_and_task
from aed.hf_parquet import ParquetSource
from aed.nemo_tarred import NemoTarredSource
from aed.shar import SharSource
from aed.shards import ShardSource, decode_audio
from aed.sources import CountTokens
from aed.tokenizer import Tokenizer
from bins import estimate_bins
from common import MINI_TOKENIZER, ROOT, log, print_json, print_table
from sampler import BucketingSampler, JsonlSource
from tools import make_shards
from tools.write_formats import read_rows, write_nemo_tarred, write_parquet, write_shar

PER_SHARD = 1000


def make_set(work: Path, n: int) -> None:
    """The hard-linked source set, its manifest, and the four formats written from it."""
    if (work / "done").exists():
        return
    rows = read_rows(str(ROOT / "data/mini/train.jsonl"))
    (work / "audio").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        row = dict(rows[i % len(rows)])
        link = work / "audio" / f"u{i:06d}.flac"
        if not link.exists():
            os.link(row["audio_filepath"], link)
        lines.append(json.dumps(row | {"audio_filepath": str(link)}, ensure_ascii=False))
    (work / "train.jsonl").write_text("\n".join(lines) + "\n")
    rows = read_rows(str(work / "train.jsonl"))
    t0 = time.time()
    make_shards.main([str(work / "train.jsonl"), "-o", str(work / "aed"), "--shard-size", str(PER_SHARD)])
    write_nemo_tarred(rows, work / "nemo", n // PER_SHARD)
    write_shar(rows, work / "shar", PER_SHARD)
    write_parquet(rows, work / "parquet", n // PER_SHARD, row_group_size=100)
    log(f"wrote the four formats in {time.time() - t0:.0f} s")
    (work / "done").touch()


def files_of(work: Path, fmt: str) -> list[Path]:
    if fmt == "files":
        return [work / "train.jsonl", *sorted((work / "audio").iterdir())]
    return [p for p in sorted((work / fmt).rglob("*")) if p.is_file()]


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Files:
    """Per-file reading: the manifest's lines, each utterance's file read whole (JsonlSource + open)."""

    def __init__(self, manifest: Path):
        self.manifest = manifest

    def read(self, *_):
        for key, cur, ex in JsonlSource(self.manifest, shuffle_shards=False).read(0, 0, 1):
            ex["audio"] = Path(ex["audio_filepath"]).read_bytes()
            yield key, cur, ex


def aed_reader(work: Path, fmt: str):
    if fmt == "files":
        return Files(work / "train.jsonl")
    if fmt == "aed":
        return ShardSource(work / "aed", shuffle_shards=False)
    if fmt == "nemo":
        n = len(list((work / "nemo").glob("audio_*.tar")))
        return NemoTarredSource(str(work / f"nemo/sharded_manifests/manifest__OP_0..{n - 1}_CL_.json"),
                                str(work / f"nemo/audio__OP_0..{n - 1}_CL_.tar"), shuffle_shards=False)
    if fmt == "shar":
        return SharSource(work / "shar", shuffle_shards=False)
    return ParquetSource(str(work / "parquet/data/*.parquet"), shuffle_shards=False)


def aed_pass(work: Path, fmt: str, decode: bool) -> int:
    n = 0
    for _, _, ex in aed_reader(work, fmt).read(0, 0, 1):
        if decode:
            if fmt == "files":
                load_audio(ex["audio_filepath"], 0.0, ex["duration"])
            else:
                decode_audio(ex)
        n += len(ex["audio"]) > 0
    return n


def lhotse_pass(work: Path, decode: bool) -> int:
    from lhotse import CutSet

    n = 0
    for cut in CutSet.from_shar(in_dir=str(work / "shar")):
        if decode:
            cut.load_audio()
        n += len(cut.recording.sources[0].source) > 0  # the bytes the tar held
    return n


def timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, n


def sampler_rate(work: Path, fmt: str, tok, bins, repeat: int) -> float:
    args = dict(max_duration=200.0, buffer_size=2000, seed=0)
    if fmt == "files":
        def num_tokens(ex):  # the line's fields checked as the readers check theirs
            return len(encode_utterance(tok, Utterance("", ex["duration"], *text_and_task(ex, "")))[0])

        source, extra = JsonlSource(work / "train.jsonl"), {"num_tokens_fn": num_tokens}
    else:
        source, extra = CountTokens(aed_reader(work, fmt), tok), {}
    best = 0.0
    for _ in range(repeat):
        sampler = BucketingSampler(source, bins, **args, **extra)
        dt, n = timed(lambda: sum(len(b) for b in sampler))
        best = max(best, n / dt)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default="/tmp/reader_bench")
    p.add_argument("--utterances", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=3, help="passes per measurement; the fastest counts")
    args = p.parse_args()
    torch.set_num_threads(1)  # as in one DataLoader worker
    work = Path(args.work_dir)
    make_set(work, args.utterances)
    try:
        import lhotse  # noqa: F401

        has_lhotse = True
    except ImportError:
        has_lhotse = False
        log("lhotse is not importable: its columns are '-' (bench/requirements-peers.txt)")

    tok = Tokenizer.load(MINI_TOKENIZER)
    utts = read_manifest(str(work / "train.jsonl"))
    bins = estimate_bins([u.duration for u in utts], [len(encode_utterance(tok, u)[0]) for u in utts], 8, 2)
    hours = sum(u.duration for u in utts) / 3600
    results = []
    for fmt in ("files", "aed", "nemo", "shar", "parquet"):
        for reader in ("aed", "lhotse"):
            if reader == "lhotse" and (fmt != "shar" or not has_lhotse):
                continue
            files = files_of(work, fmt)
            mb = sum(p.stat().st_size for p in files) / 1e6

            def one_pass(decode):
                return aed_pass(work, fmt, decode) if reader == "aed" else lhotse_pass(work, decode)

            cold, warm = [], []
            for _ in range(args.repeat):  # the best of a few: other jobs share the CPU
                drop_cache(files)
                t, n = timed(lambda: one_pass(False))
                cold.append(t)
                warm.append(timed(lambda: one_pass(False))[0])
            cold, warm = min(cold), min(warm)
            decode = timed(lambda: one_pass(True))[0]  # decoding dominates: once is enough
            r = {"format": fmt, "reader": reader, "examples": n, "MB": round(mb),
                 "cold_ex_s": round(n / cold), "cold_MB_s": round(mb / cold), "warm_ex_s": round(n / warm),
                 "warm_MB_s": round(mb / warm), "decode_ex_s": round(n / decode)}
            if reader == "aed":
                r["sampler_ex_s"] = round(sampler_rate(work, fmt, tok, bins, args.repeat))
            log(str(r))
            results.append(r)

    print(f"{len(utts)} utterances, {hours:.1f} h; one process, one thread; timings share 2 CPU cores with other jobs")
    print_table([("format", "<8"), ("reader", "<7"), ("MB", ">5"), ("cold ex/s", ">9"), ("cold MB/s", ">9"),
                 ("warm ex/s", ">9"), ("warm MB/s", ">9"), ("decode ex/s", ">11"), ("sampler ex/s", ">12")],
                [[r["format"], r["reader"], r["MB"], r["cold_ex_s"], r["cold_MB_s"], r["warm_ex_s"], r["warm_MB_s"],
                  r["decode_ex_s"], r.get("sampler_ex_s", "-")] for r in results])
    print_json({"utterances": len(utts), "hours": round(hours, 2), "results": results})


if __name__ == "__main__":
    main()
