"""Reading training data, in two modes (`python bench/reader_bench.py MODE --help` lists a mode's flags):

    formats (default)  NeMo tarred, Lhotse Shar and Hugging Face parquet read in place by aed, against
                       aed's own tar shards, per-file reading of the JSONL manifest, and Lhotse's reader
                       of the same files
    latency            per-file reading vs aed's tar shards on a filesystem where every file open
                       costs --open-ms, with and without the sampler's producer thread

    python bench/reader_bench.py                                   # 20,000 utterances, ~12 h of audio
    PYTHONPATH=/tmp/peers python bench/reader_bench.py             # with Lhotse (bench/requirements-peers.txt)
    python bench/reader_bench.py latency                           # data/mini x 8 (~1.4 h of audio)
    python data/make_mini_data.py -o /tmp/mini10h --hours 10 --num-workers 2
    python bench/reader_bench.py latency --manifest /tmp/mini10h/train.jsonl --repeat 1

Each mode prints a table, then its results as a JSON object on the last line. Timings share the CPU
with other jobs: noisy, so compare the rows of one run.

formats
-------
The set: data/mini's utterances hard-linked under 20,000 distinct names (distinct paths: NeMo's
converter stores a file that rows name twice only once per shard), written once per format by
tools/make_shards.py and tools/write_formats.py (1000 utterances per shard or file, parquet row
groups of 100) and kept in --work-dir for the next run.

Columns, one process and one thread each, the fastest of --repeat passes:
- read: every example's metadata and audio bytes, as the sampler's source yields them (Lhotse:
  iterating the CutSet, whose cuts hold the bytes). ex/s, and MB/s of the format's files.
  cold: the files' pages are dropped first (posix_fadvise DONTNEED; the host may still cache the
  virtual disk), warm: the same pass again right after.
- decode: read and decode every utterance to 16 kHz samples (aed: `decode_audio`; Lhotse:
  `cut.load_audio()`; files: `load_audio`), warm.
- sampler: examples/s of one epoch of `BucketingSampler` (2D bins, max_duration 200 s, buffer 2000,
  producer thread), token counts computed on the fly in every case (`aed.data_sources.CountTokens`;
  the manifest's lines checked first, as train.py checks a manifest's), as training reads each source.
Lhotse has no reader of NeMo tarred sets (NeMo's own needs nemo_toolkit) nor of parquet files
(`from_huggingface_dataset` needs `datasets`): those cells are "-".

latency
-------
A shared cluster filesystem costs milliseconds per file open (metadata round trips) however small the
file; local page-cached files cost microseconds. --open-ms adds that latency to every open() of the
audio files and of the shards, in this process (`slow_opens`): one per utterance when reading files,
one per shard when reading tars. Both readers are streamed sources of `BucketingSampler` (the audio
bytes are read in the source, so in the producer thread when concurrent); the consumer decodes every
batch's audio and then sleeps --step-ms as a stand-in for the training step, which is the work the
producer overlaps with. The manifest holds absolute paths and num_tokens, so both readers do the
same work but I/O. Columns: ttfb = time to the first batch (the sampler first fills start_fill x
buffer_size examples, paper sec. 2), ex/s and audio s/s over one epoch. train.py's per-file path
loads audio in DataLoader workers, which divides the per-file latency by the number of workers but
not more.
"""

import builtins
import contextlib
import io
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from common import MINI_TOKENIZER, ROOT, JsonlSource, log, print_json, print_table, run_modes, timed
from tools import make_shards
from tools.write_formats import read_rows, write_nemo_tarred, write_parquet, write_shar

from aed.data_audio import load_audio
from aed.data_batch import decode_audio, encode_utterance
from aed.data_manifest import example_fields, read_manifest
from aed.data_formats import NemoTarredSource, ParquetSource, SharSource
from aed.data_shards import ShardSource
from aed.data_sources import CountTokens
from aed.data_tokenizer import Tokenizer
from bins import estimate_bins
from sampler import BucketingSampler

PER_SHARD = 1000


class Files:
    """Per-file reading: the manifest's lines, each utterance's audio file read whole with open().
    check_fields: each line's fields checked and normalised as train.py checks a manifest's (which the
    token counts of CountTokens need)."""

    def __init__(self, manifest: Path, check_fields: bool = False):
        self.lines, self.check_fields = JsonlSource(manifest), check_fields

    def read(self, seed: int, rank: int, world_size: int, cursor=None):
        for key, cur, ex in self.lines.read(seed, rank, world_size, cursor):
            yield key, cur, self._load(key, ex)

    def get(self, key) -> dict:
        return self._load(key, self.lines.get(key))

    def describe(self, key) -> str:
        return self.lines.describe(key)

    def _load(self, key, ex: dict) -> dict:
        ex["where"] = self.describe(key)
        if self.check_fields:
            ex.update(example_fields(ex, ex["where"]))
        with open(ex["audio_filepath"], "rb") as f:
            ex["audio"] = f.read()
        return ex


@contextlib.contextmanager
def slow_opens(folders: list, seconds: float):
    """Every open() in this process (any thread) of a file under one of `folders` first waits `seconds`:
    a shared filesystem's per-open round trips, for readers that open their files with open()."""
    real_open = builtins.open
    prefixes = tuple(os.path.join(os.path.abspath(d), "") for d in folders)

    def slow_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.path.abspath(file).startswith(prefixes):
            time.sleep(seconds)
        return real_open(file, *args, **kwargs)

    builtins.open = slow_open
    try:
        yield
    finally:
        builtins.open = real_open


# --- formats: every format aed reads in place, one process and one thread ---------------------------

def formats_flags(p) -> None:
    p.add_argument("--work-dir", default="/tmp/reader_bench")
    p.add_argument("--utterances", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=3, help="passes per measurement; the fastest counts")


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


def aed_reader(work: Path, fmt: str, check_fields: bool = False):
    if fmt == "files":
        return Files(work / "train.jsonl", check_fields)
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


def sampler_rate(work: Path, fmt: str, tok, bins, repeat: int) -> float:
    source = CountTokens(aed_reader(work, fmt, check_fields=True), tok)
    best = 0.0
    for _ in range(repeat):
        sampler = BucketingSampler(source, bins, max_duration=200.0, buffer_size=2000, seed=0)
        dt, n = timed(lambda: sum(len(b) for b in sampler))
        best = max(best, n / dt)
    return best


def measure_format(work: Path, fmt: str, reader: str, tok, bins, repeat: int) -> dict:
    """One row of the table: the read passes cold and warm, decoding, and aed's sampler."""
    files = files_of(work, fmt)
    mb = sum(p.stat().st_size for p in files) / 1e6

    def one_pass(decode):
        return aed_pass(work, fmt, decode) if reader == "aed" else lhotse_pass(work, decode)

    cold, warm = [], []
    for _ in range(repeat):  # the best of a few: other jobs share the CPU
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
        r["sampler_ex_s"] = round(sampler_rate(work, fmt, tok, bins, repeat))
    log(str(r))
    return r


def formats_mode(args) -> None:
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
    results = [measure_format(work, fmt, reader, tok, bins, args.repeat)
               for fmt in ("files", "aed", "nemo", "shar", "parquet") for reader in ("aed", "lhotse")
               if reader == "aed" or (fmt == "shar" and has_lhotse)]
    print(f"{len(utts)} utterances, {hours:.1f} h; one process, one thread; timings share 2 CPU cores with other jobs")
    print_table([("format", "<8"), ("reader", "<7"), ("MB", ">5"), ("cold ex/s", ">9"), ("cold MB/s", ">9"),
                 ("warm ex/s", ">9"), ("warm MB/s", ">9"), ("decode ex/s", ">11"), ("sampler ex/s", ">12")],
                [[r["format"], r["reader"], r["MB"], r["cold_ex_s"], r["cold_MB_s"], r["warm_ex_s"], r["warm_MB_s"],
                  r["decode_ex_s"], r.get("sampler_ex_s", "-")] for r in results])
    print_json({"utterances": len(utts), "hours": round(hours, 2), "results": results})


# --- latency: per-file reading vs tar shards when every open costs milliseconds ---------------------

def latency_flags(p) -> None:
    p.add_argument("--manifest", default=str(ROOT / "data/mini/train.jsonl"))
    p.add_argument("--tokenizer", default=str(MINI_TOKENIZER))
    p.add_argument("--repeat", type=int, default=8, help="repeat the manifest this many times")
    p.add_argument("--shard-size", type=int, default=100)
    p.add_argument("--open-ms", type=float, default=5.0, help="simulated latency of every file open")
    p.add_argument("--step-ms", type=float, default=20.0, help="simulated training step per batch")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--buffer-size", type=int, default=1000)


def epoch(source, bins, args, concurrent: bool) -> dict:
    """One epoch of the sampler over `source`, every batch's audio decoded, then --step-ms of "training"."""
    sampler = BucketingSampler(source, bins, batch_size=args.batch_size, buffer_size=args.buffer_size,
                               concurrent=concurrent)
    t0 = time.perf_counter()
    ttfb, n, audio_s = None, 0, 0.0
    for batch in sampler:
        ttfb = ttfb if ttfb is not None else time.perf_counter() - t0
        for ex in batch:
            decode_audio(ex)
            audio_s += ex["duration"]
        n += len(batch)
        time.sleep(args.step_ms / 1000)
    total = time.perf_counter() - t0
    return {"examples": n, "ttfb_s": round(ttfb, 3), "epoch_s": round(total, 2),
            "examples_per_s": round(n / total, 1), "audio_s_per_s": round(audio_s / total, 1)}


def latency_mode(args) -> None:
    # Decoding runs in this process, as in one DataLoader worker (which PyTorch limits to one
    # thread): a second intra-op thread made each decode far slower on a shared 2-core machine.
    torch.set_num_threads(1)
    tok = Tokenizer.load(args.tokenizer)
    utts = read_manifest(args.manifest)
    lines = [json.dumps({"audio_filepath": u.audio_filepath, "duration": u.duration, "text": u.text,
                         "source_lang": u.source_lang, "target_lang": u.target_lang, "pnc": u.pnc,
                         "taskname": u.taskname, "num_tokens": len(encode_utterance(tok, u)[0])})
             for u in utts] * args.repeat
    examples = [json.loads(x) for x in lines]
    bins = estimate_bins([e["duration"] for e in examples], [e["num_tokens"] for e in examples], 8, 1)
    hours = sum(e["duration"] for e in examples) / 3600
    audio_dirs = sorted({os.path.dirname(u.audio_filepath) for u in utts})
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "train.jsonl"
        manifest.write_text("\n".join(lines) + "\n")
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(io.StringIO()):
            make_shards.main([str(manifest), "-o", f"{tmp}/shards", "--shard-size", str(args.shard_size),
                              "--shuffle", "--num-workers", "2", "--tokenizer", args.tokenizer])
        shard_s = time.perf_counter() - t0
        print(f"{len(lines)} examples ({hours:.2f} h), {-(-len(lines) // args.shard_size)} shards made in "
              f"{shard_s:.1f}s; open latency {args.open_ms:g} ms, step {args.step_ms:g} ms, "
              f"batch {args.batch_size}, buffer {args.buffer_size}")
        results = []
        for reader in ("files", "shards"):
            for concurrent in (False, True):
                source = Files(manifest) if reader == "files" else ShardSource(f"{tmp}/shards")
                with slow_opens(audio_dirs + [f"{tmp}/shards"], args.open_ms / 1000):
                    results.append({"reader": reader, "concurrent": concurrent,
                                    **epoch(source, bins, args, concurrent)})

    print_table([("reader", "<7"), ("thread", ">6"), ("examples", ">8"), ("ttfb s", ">7.3f"), ("epoch s", ">8.2f"),
                 ("ex/s", ">7.1f"), ("audio s/s", ">9.1f")],
                [[r["reader"], str(r["concurrent"]), r["examples"], r["ttfb_s"], r["epoch_s"], r["examples_per_s"],
                  r["audio_s_per_s"]] for r in results])
    print("timings share 2 CPU cores with other jobs: noisy")
    print_json({"workload": {"examples": len(lines), "hours": round(hours, 3), "open_ms": args.open_ms,
                             "step_ms": args.step_ms, "batch_size": args.batch_size,
                             "buffer_size": args.buffer_size, "shard_size": args.shard_size,
                             "make_shards_s": round(shard_s, 2)},
                "results": results})


MODES = {  # name: (its flags, its run, what it measures)
    "formats": (formats_flags, formats_mode, "every format aed reads in place, cold and warm, decoded, sampled"),
    "latency": (latency_flags, latency_mode, "per-file reading vs tar shards when every file open costs --open-ms"),
}


def main(argv: list[str] | None = None) -> None:
    run_modes(__doc__, MODES, "formats", argv)


if __name__ == "__main__":
    main()
