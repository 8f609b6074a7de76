"""See what training will see: read one train.manifests entry as train.py reads it, decode every
utterance, and print what there is and what was skipped, before a week-long job.

    python tools/inspect_data.py data/mini/train.jsonl
    python tools/inspect_data.py '{shar: data/shar}' --jsonl /tmp/shar.jsonl
    python tools/inspect_data.py '{manifest_filepath: "b1/manifest__OP_0..127_CL_.json",
                                   tarred_audio_filepaths: "b1/audio__OP_0..127_CL_.tar"}'
    python tools/inspect_data.py '{parquet: "hf/data/train-*.parquet", text_column: sentence, source_lang: en}'

Prints utterances, hours, language pairs, tasks, a duration histogram, and every skipped item with
its reason (the readers' faults, audio that does not decode). `--jsonl OUT` writes one line per
example: a stable `id` (file and line, shard and member, or file and row), `duration`, `text`,
`source_lang`, `target_lang`, `taskname` and `num_samples` (decoded samples at 16 kHz). Give
`--tokenizer` to also skip what training's tokenizer cannot encode.
"""

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing aed

from aed.data_audio import AudioError  # noqa: E402
from aed.data_batch import decode_audio, file_audio  # noqa: E402
from aed.data_manifest import AUDIO_LENGTH, DURATION_TOLERANCE, Faults, iter_manifest  # noqa: E402
from aed.data_sources import CountTokens, ManifestEntry, parse_spec, source_faults  # noqa: E402
from aed.data_tokenizer import Tokenizer  # noqa: E402

SAMPLE_RATE = 16000
HISTOGRAM = [0, 1, 2, 5, 10, 15, 20, 30, 40, float("inf")]  # seconds


def examples(entry: ManifestEntry, tokenizer):
    """(id, fields, a function giving the 16 kHz samples, checked against the duration as training
    checks them) per example, in file order, and the Faults that say what the reading skipped."""
    if not entry.streamed:
        faults = Faults()

        def manifest_items():
            for u in iter_manifest(entry.path, skip_invalid=True, faults=faults):
                yield u.where, vars(u), lambda u=u: file_audio(u, SAMPLE_RATE, DURATION_TOLERANCE)

        return manifest_items(), [faults]
    source = entry.open(shuffle_shards=False)
    if tokenizer is not None:
        source = CountTokens(source, tokenizer)

    def streamed_items():
        for _, _, ex in source.read(0, 0, 1):
            yield ex["where"], ex, lambda ex=ex: decode_audio(ex, SAMPLE_RATE)

    return streamed_items(), source_faults(source)


def histogram(durations: list) -> list[str]:
    counts = Counter(next(i for i, hi in enumerate(HISTOGRAM[1:]) if d < hi) for d in durations)
    width = max(counts.values(), default=1)
    lines = []
    for i, (lo, hi) in enumerate(zip(HISTOGRAM, HISTOGRAM[1:])):
        n = counts.get(i, 0)
        label = f"{lo:g}-{hi:g} s" if hi != float("inf") else f">= {lo:g} s"
        lines.append(f"  {label:>9} {n:>9,} {'#' * round(40 * n / width)}")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("spec", help="one train.manifests entry: a manifest path or a YAML mapping such as '{shar: DIR}'")
    p.add_argument("--jsonl", help="write one line per example here")
    p.add_argument("--tokenizer", help="training's tokenizer directory: also skip what it cannot encode")
    args = p.parse_args(argv)

    entry = ManifestEntry.of(parse_spec(args.spec))
    tokenizer = Tokenizer.load(args.tokenizer) if args.tokenizer else None
    items, faults = examples(entry, tokenizer)
    out = open(args.jsonl, "w", encoding="utf-8") if args.jsonl else None
    durations, pairs, tasks, undecodable = [], Counter(), Counter(), []
    t0 = last = time.time()
    for n, (uid, ex, samples) in enumerate(items, 1):
        try:
            num_samples = samples().numel()
        except AudioError as e:
            member = ex.get("audio_filepath", uid)  # the tar member or audio file, where the id names a row
            undecodable.append(("audio_length" if AUDIO_LENGTH in e.reason else "undecodable",
                                uid, e.reason if member == uid else f"{member}: {e.reason}"))
            continue
        durations.append(ex["duration"])
        pairs[f"{ex['source_lang']}->{ex['target_lang']}"] += 1
        tasks[ex["taskname"]] += 1
        if out:
            out.write(json.dumps({"id": uid, "duration": ex["duration"], "text": ex["text"],
                                  "source_lang": ex["source_lang"], "target_lang": ex["target_lang"],
                                  "taskname": ex["taskname"], "num_samples": num_samples}, ensure_ascii=False) + "\n")
        if time.time() - last > 5:
            last = time.time()
            print(f"inspect_data: {n:,} examples read, {n / (last - t0):.0f}/s", file=sys.stderr)
    if out:
        out.close()

    print(f"{args.spec}")
    print(f"utterances  {len(durations):,}")
    print(f"hours       {sum(durations) / 3600:.2f}")
    if durations:
        print(f"duration    min {min(durations):.2f} s, mean {sum(durations) / len(durations):.2f} s, "
              f"max {max(durations):.2f} s")
    print("languages   " + ", ".join(f"{k} {v:,}" for k, v in pairs.most_common()))
    print("tasks       " + ", ".join(f"{k} {v:,}" for k, v in tasks.most_common()))
    print("durations")
    print("\n".join(histogram(durations)))
    skipped = [(kind, where, why) for f in faults for (kind, where), why in f.seen.items()]
    skipped += undecodable
    print(f"skipped     {len(skipped):,}")
    for kind, where, why in skipped:
        print(f"  {kind:<19} {where}: {why}")
    if args.jsonl:
        print(f"wrote {len(durations):,} lines to {args.jsonl}")


if __name__ == "__main__":
    main()
