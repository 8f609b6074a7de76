"""Long recordings, offline and streamed, against the same utterances decoded one by one: does any
word get lost however long the audio runs?

    python tools/make_long_audio.py --manifest data/mini/digits/train.jsonl -o runs/long/pauses --seconds 80 --files 8
    python bench/long_recordings_bench.py --ckpt runs/demo --manifest runs/long/pauses/manifest.jsonl

The manifest is `tools/make_long_audio.py`'s: every file lists its utterances (`parts`). For each
file set it decodes
1. each utterance on its own (its stretch of the long file; greedy and joint with CTC 0.3): the
   accuracy to keep;
2. the long files offline (`aed.transcribe`: cut at pauses, greedy and joint with CTC 0.3);
3. the long files as streams (`infer.py --stream`'s path: AlignAtt and wait-k at the default
   buffer), with LAAL per utterance, the lag from each word's end in the audio (the CTC head's
   forced alignment) to its commit per minute of the file, and the sentences the streams ended.
WER (lower-cased, no punctuation: `aed.decode_metrics.simple`) with its deletions, insertions and
substitutions over all files, as a table, then one JSON line.
"""

import argparse
import bisect
import json
import math
import os
import sys
from collections import defaultdict

import jiwer

from aed.decode_metrics import simple
from aed.decode_search import DecodingOptions
from aed.data_audio import load_audio
from aed.decode_stream import StreamConfig, Streamer, average_lagging, spoken_ends, stream_requests
from aed.decode_transcribe import make_request, transcribe
from aed.model_checkpoint import load_model
from common import log, print_json, print_table


def scores(refs: list[str], hyps: list[str]) -> dict:
    out = jiwer.process_words([simple(r) for r in refs], [simple(h or "") or "<empty>" for h in hyps])
    return {"wer": round(100 * out.wer, 2), "deleted": out.deletions, "inserted": out.insertions,
            "substituted": out.substitutions, "words": sum(len(simple(r).split()) for r in refs)}


def stream_lags(decoded, lines: list, rate: int) -> tuple[dict, float, int]:
    """Over all streams: {minute: mean seconds from a word's end in the audio (`spoken_ends`) to its
    commit}; LAAL per utterance (s): each committed word goes to the utterance its spoken end lies in,
    its delay counted from that utterance's start (SimulEval's LAAL of each utterance, then the
    mean: a long file's LAAL would measure how unevenly its words are spread, not the stream's lag);
    and how many streams' words could not be aligned (no CTC path fits their text)."""
    by_minute, laal, unaligned = defaultdict(list), [], 0
    for (res, stream, _), line in zip(decoded, lines):
        ends = spoken_ends(stream, load_audio(res.request.audio_filepath, sample_rate=rate))
        unaligned += ends is None
        delays = defaultdict(list)  # utterance index -> delays (ms) of its words
        for (_, commit, _), end in zip(stream.words(), ends or []):
            by_minute[int(end // 60)].append(commit - end)
            k = bisect.bisect_right([q["start"] for q in line["parts"]], end) - 1
            if k >= 0:
                delays[k].append(1000 * (commit - line["parts"][k]["start"]))
        for k, d in delays.items():
            q = line["parts"][k]
            laal.append(average_lagging(d, 1000 * (q["end"] - q["start"]), len(simple(q["text"]).split())))
    per_minute = {m: round(sum(v) / len(v), 2) for m, v in sorted(by_minute.items())}
    return per_minute, round(sum(laal) / len(laal) / 1000, 2) if laal else math.nan, unaligned


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a run directory or checkpoint")
    p.add_argument("--manifest", nargs="+", required=True, help="tools/make_long_audio.py manifests")
    p.add_argument("--policies", nargs="+", default=["alignatt", "waitk"])
    p.add_argument("--no-utterances", action="store_true", help="skip decoding the utterances one by one")
    args = p.parse_args(argv)
    loaded = load_model(args.ckpt)
    rows, result = [], {"ckpt": args.ckpt, "max_train_duration": loaded.max_train_duration, "sets": {}}
    for manifest in args.manifest:
        base = os.path.dirname(os.path.abspath(manifest))
        lines = [json.loads(line) for line in open(manifest) if line.strip()]
        requests = [make_request(os.path.join(base, d["audio_filepath"]), d["source_lang"], d["target_lang"],
                                 pnc=True, text=d["text"]) for d in lines]
        refs = [d["text"] for d in lines]
        seconds = sum(d["duration"] for d in lines)
        name = os.path.basename(base)
        found = result["sets"][name] = {"files": len(lines), "seconds": round(seconds, 1)}
        log(f"{name}: {len(lines)} files, {seconds:.0f} s")
        if not args.no_utterances:
            parts = [make_request(r.audio_filepath, q["source_lang"], q["target_lang"], offset=q["start"],
                                  duration=q["end"] - q["start"], text=q["text"])
                     for r, d in zip(requests, lines) for q in d["parts"]]
            for label, weight in (("each utterance alone, greedy", 0.0), ("each utterance alone, CTC 0.3", 0.3)):
                res, _ = transcribe(loaded, parts, DecodingOptions(ctc_weight=weight))
                found[label] = scores([q.text for q in parts], [r.pred_text for r in res])
                rows.append([name, label, *found[label].values(), "", ""])
        for label, weight in (("offline, greedy", 0.0), ("offline, CTC 0.3", 0.3)):
            res, timings = transcribe(loaded, requests, DecodingOptions(ctc_weight=weight))
            found[label] = {**scores(refs, [r.pred_text for r in res]), "rtfx": round(timings.rtfx, 1)}
            rows.append([name, label, *list(found[label].values())[:5], "", ""])
        for policy in args.policies:
            streamer = Streamer(loaded, StreamConfig(policy=policy))
            decoded = stream_requests(streamer, requests)
            label = f"stream {policy}"
            stat = scores(refs, [r.pred_text for r, _, _ in decoded])
            stat["lag_per_minute_s"], stat["laal_s"], stat["unaligned_files"] = stream_lags(decoded, lines,
                                                                                            streamer.rate)
            stat["sentences"] = sum(s.sentences for _, s, _ in decoded)
            stat["window_cuts"] = sum(s.window_cuts for _, s, _ in decoded)
            stat["left_s"] = streamer.left / streamer.rate
            found[label] = stat
            rows.append([name, label, *list(stat.values())[:5], stat["laal_s"], stat["sentences"]])
            log(f"{name} {label}: lag per minute {stat['lag_per_minute_s']}")
    print_table([("set", "<8"), ("decoding", "<30"), ("WER %", ">6.1f"), ("deleted", ">8d"), ("inserted", ">9d"),
                 ("substituted", ">12d"), ("words", ">6d"), ("LAAL s", ">7"), ("sentences", ">10")], rows)
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
