"""I/O benchmark: per-file reading vs tar shards, with and without the sampler's producer thread.

    python bench/io_bench.py                                   # data/mini x 8 (~1.4 h of audio), ~1 min
    python tools/make_mini_data.py -o /tmp/mini10h --hours 10 --num-workers 2
    python bench/io_bench.py --manifest /tmp/mini10h/train.jsonl --repeat 1

A shared cluster filesystem costs milliseconds per file open (metadata round trips) however
small the file; local page-cached files cost microseconds. `--open-ms` adds that latency to every
open: one per utterance when reading files, one per shard when reading tars. Both readers are
streamed sources of `BucketingSampler` (the audio bytes are read in the source, so in the
producer thread when concurrent); the consumer decodes every batch's audio and then sleeps
`--step-ms` as a stand-in for the training step, which is the work the producer overlaps with.

Columns: ttfb = time to the first batch (the sampler first fills start_fill x buffer_size
examples, paper sec. 2), ex/s and audio s/s over one epoch. train.py's per-file path loads audio in
DataLoader workers, which divides the per-file latency by the number of workers but not more.
The CPU is shared with other jobs: timings are noisy. The last line is a JSON object.
"""

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

import torch

from aed.data import encode_utterance, read_manifest
from aed.shards import ShardSource, decode_audio
from aed.tokenizer import Tokenizer
from bins import estimate_bins
from common import MINI_TOKENIZER, ROOT, print_json, print_table
from sampler import BucketingSampler, JsonlSource
from tools import make_shards


class SlowShards(ShardSource):
    def __init__(self, path, open_s: float):
        super().__init__(path)
        self.open_s = open_s

    def _open(self, path):
        time.sleep(self.open_s)
        return super()._open(path)


class SlowFiles(JsonlSource):
    """Manifest lines streamed with each utterance's audio file read in the source."""

    def __init__(self, path, open_s: float):
        super().__init__(path, shuffle_shards=False)
        self.open_s = open_s

    def read(self, seed, rank, world_size, cursor=None):
        for key, cur, ex in super().read(seed, rank, world_size, cursor):
            time.sleep(self.open_s)
            ex["audio"] = Path(ex["audio_filepath"]).read_bytes()
            yield key, cur, ex


def run(source, bins, args, concurrent: bool) -> dict:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", default=str(ROOT / "data/mini/train.jsonl"))
    p.add_argument("--tokenizer", default=str(MINI_TOKENIZER))
    p.add_argument("--repeat", type=int, default=8, help="repeat the manifest this many times")
    p.add_argument("--shard-size", type=int, default=100)
    p.add_argument("--open-ms", type=float, default=5.0, help="simulated latency of every file open")
    p.add_argument("--step-ms", type=float, default=20.0, help="simulated training step per batch")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--buffer-size", type=int, default=1000)
    args = p.parse_args()
    # Decoding runs in this process, as in one DataLoader worker (which PyTorch limits to one
    # thread): a second intra-op thread made each decode ~10x slower on the shared 2 cores.
    torch.set_num_threads(1)

    tok = Tokenizer.load(args.tokenizer)
    utts = read_manifest(args.manifest)
    with tempfile.TemporaryDirectory() as tmp:
        # Absolute paths and num_tokens in the manifest: both readers then do the same work but I/O.
        lines = [json.dumps({"audio_filepath": u.audio_filepath, "duration": u.duration, "text": u.text,
                             "source_lang": u.source_lang, "target_lang": u.target_lang, "pnc": u.pnc,
                             "taskname": u.taskname, "num_tokens": len(encode_utterance(tok, u)[0])})
                 for u in utts] * args.repeat
        manifest = Path(tmp) / "train.jsonl"
        manifest.write_text("\n".join(lines) + "\n")
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(io.StringIO()):
            make_shards.main([str(manifest), "-o", f"{tmp}/shards", "--shard-size", str(args.shard_size),
                              "--shuffle", "--num-workers", "2", "--tokenizer", args.tokenizer])
        shard_s = time.perf_counter() - t0
        examples = [json.loads(x) for x in lines]
        bins = estimate_bins([e["duration"] for e in examples], [e["num_tokens"] for e in examples], 8, 1)
        hours = sum(e["duration"] for e in examples) / 3600
        print(f"{len(lines)} examples ({hours:.2f} h), {-(-len(lines) // args.shard_size)} shards made in "
              f"{shard_s:.1f}s; open latency {args.open_ms:g} ms, step {args.step_ms:g} ms, "
              f"batch {args.batch_size}, buffer {args.buffer_size}")
        results = []
        for reader in ("files", "shards"):
            for concurrent in (False, True):
                open_s = args.open_ms / 1000
                source = SlowFiles(manifest, open_s) if reader == "files" else SlowShards(f"{tmp}/shards", open_s)
                results.append({"reader": reader, "concurrent": concurrent, **run(source, bins, args, concurrent)})

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


if __name__ == "__main__":
    main()
