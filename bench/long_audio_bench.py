"""Long audio, two experiments (`python bench/long_audio_bench.py MODE --help` for a mode's flags).

words (the default mode): word timestamps against known boundaries, and long-audio transcripts with
and without chunk overlaps, on generated word audio with the word model
(tests/fixtures/make_word_model.py).

    python bench/long_audio_bench.py                                   # the committed model
    python bench/long_audio_bench.py words --ckpt /tmp/word_model.pt --files 100

1. Timestamps: `--files` random sequences of the eight clips (1-4 words, 0-1 s of leading silence,
   0.1-0.6 s pauses, a noise floor), seeds the model was not trained on, through
   `transcribe(timestamps=True)`. On files whose transcript is right, each word's start and end
   against the true boundary of its clip: median, 90th percentile, largest; for the CTC spans alone
   and narrowed to the speech inside them (the default).
2. Long audio: `--long-files` files of `--long-words` random words with 0-`--long-gap` s between them over a
   3e-3 noise floor (no pause a cut could use), transcribed in chunks of the model's training maximum
   with `--overlap` and with none (the default): chunks, seconds decoded, WER and its deletions and
   insertions (dropped and repeated words), over all files.

recordings: long recordings, offline and streamed, against the same utterances decoded one by one:
does any word get lost however long the audio runs?

    python tools/make_long_audio.py --manifest data/mini/digits/train.jsonl -o runs/long/pauses --seconds 80 --files 8
    python bench/long_audio_bench.py recordings --ckpt runs/demo --manifest runs/long/pauses/manifest.jsonl
    # rooms: the same files under pink noise, say, offline and streamed with each speech detector
    python tools/make_long_audio.py --manifest data/mini/digits/dev.jsonl -o runs/rooms/pink --condition pink
    python bench/long_audio_bench.py recordings --ckpt runs/demo --manifest runs/rooms/pink/manifest.jsonl \\
        --vad energy silero --policies alignatt

The manifest is `tools/make_long_audio.py`'s: every file lists its utterances (`parts`). For each
file set it decodes
1. each utterance on its own (its stretch of the long file; greedy and joint with CTC 0.3): the
   accuracy to keep; and re-edged (`re_edged`): its speech with the training utterances' median
   edges, what a cut at exactly the right pauses gives it;
2. the long files offline (`aed.transcribe`: cut at pauses, greedy and joint with CTC 0.3);
3. the long files as streams (`infer.py --stream`'s path: AlignAtt, at each of
   `--alignatt-thresholds` (default: adaptive, with the threshold each file ended on), and wait-k
   at the default buffer), with LAAL per utterance, the lag from
   each word's end in the audio (the CTC head's forced alignment) to its commit per minute of the
   file, and the sentences the streams ended.
WER (lower-cased, no punctuation: `aed.decode_metrics.simple`) with its deletions, insertions and
substitutions over all files, as a table, then one JSON line. Offline and streamed decoding find
their pauses with each speech detector of `--vad` (`aed.data_speech.DETECTORS`; default: energy
alone), each row labelled with its detector; the utterances, cut at their true edges, need none.
"""

import bisect
import json
import math
import os
import random
import sys
import tempfile
from collections import defaultdict
from dataclasses import replace

import jiwer
import soundfile as sf
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # the fixtures

import aed.decode_transcribe  # noqa: E402
from aed.data_audio import load_audio  # noqa: E402
from aed.decode_metrics import simple  # noqa: E402
from aed.decode_search import DecodingOptions  # noqa: E402
from aed.decode_metrics import average_lagging, spoken_ends  # noqa: E402
from aed.decode_stream import StreamConfig, Streamer, stream_requests  # noqa: E402
from aed.data_speech import DETECTORS, FRAME, speech_frames  # noqa: E402
from aed.decode_timing import EDGE, snap_to_speech  # noqa: E402
from aed.decode_transcribe import Request, make_request, plan_chunks, transcribe  # noqa: E402
from aed.model_checkpoint import load_model  # noqa: E402
from common import ROOT, log, print_json, print_table, run_modes  # noqa: E402
from fixtures.make_word_model import SAMPLE_RATE, load_clips, word_sequence  # noqa: E402

DEFAULT_CKPT = ROOT / "tests" / "fixtures" / "word_model.pt"


# --- words: timestamps and chunked long audio on generated word audio ------------------------------

def word_flags(p) -> None:
    p.add_argument("--ckpt", default=str(DEFAULT_CKPT))
    p.add_argument("--files", type=int, default=60, help="timestamp test files")
    p.add_argument("--long-files", type=int, default=5, help="long files")
    p.add_argument("--long-words", type=int, default=80, help="words in each long file")
    p.add_argument("--long-gap", type=float, default=0.15, help="longest pause between their words (s)")
    p.add_argument("--overlap", type=float, help="chunk overlap (s) compared with none; default: a quarter chunk")
    p.add_argument("--seed", type=int, default=1000, help="test data seed (training uses 0)")
    p.add_argument("--threads", type=int, default=1)


def word_audio(args) -> None:
    torch.set_num_threads(args.threads)
    asr, clips = load_model(args.ckpt), load_clips()
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    tmp = tempfile.mkdtemp()

    # --- 1. timestamps against known boundaries
    paths, truths = [], []
    for i in range(args.files):
        words = [rng.choice(sorted(clips)) for _ in range(rng.randint(1, 4))]
        wav, truth = word_sequence(clips, words, [rng.uniform(0.1, 0.6) for _ in words], rng.uniform(0.0, 1.0),
                                   10 ** rng.uniform(-4, -2.5), gen)
        paths.append(os.path.join(tmp, f"t{i}.wav"))
        sf.write(paths[-1], wav.numpy(), SAMPLE_RATE, subtype="FLOAT")
        truths.append(truth)
    stats, rows = {}, []
    for name, snap in (("CTC spans", False), ("snapped to speech", True)):
        log(f"timestamps: {args.files} files, {name}")
        # The CTC spans alone: aed.decode_transcribe's narrowing to the speech in each span, switched off.
        aed.decode_transcribe.snap_to_speech = snap_to_speech if snap else (lambda words, speech, offset: words)
        results, _ = transcribe(asr, paths, pnc=False, timestamps=True)
        starts, ends, right = [], [], 0
        for res, truth in zip(results, truths):
            if [w.text for w in res.words] != [w for w, _, _ in truth]:
                continue
            right += 1
            starts += [abs(w.start - a) for w, (_, a, _) in zip(res.words, truth)]
            ends += [abs(w.end - b) for w, (_, _, b) in zip(res.words, truth)]
            assert all(0 <= w.start < w.end <= res.duration + 1e-6 for w in res.words)
            assert all(x.end <= y.start + 1e-6 for x, y in zip(res.words, res.words[1:]))
        for edge, errors in (("start", torch.tensor(starts)), ("end", torch.tensor(ends))):
            stats[f"{name} {edge}"] = {k: round(float(v), 3) for k, v in (
                ("median", errors.median()), ("p90", errors.quantile(0.9)), ("max", errors.max()))}
            rows.append([f"{name} {edge}", *stats[f"{name} {edge}"].values()])
    aed.decode_transcribe.snap_to_speech = snap_to_speech
    print_table([("word boundary", "<24"), ("median s", ">9.3f"), ("p90 s", ">7.3f"), ("max s", ">7.3f")], rows)
    print(f"{right}/{args.files} files transcribed right; {len(starts)} words timed")

    # --- 2. long files without pauses, chunked with and without overlaps
    files = []
    for i in range(args.long_files):
        words = [rng.choice(sorted(clips)) for _ in range(args.long_words)]
        wav, _ = word_sequence(clips, words, [rng.uniform(0.0, args.long_gap) for _ in words], 0.3, 3e-3, gen)
        files.append((os.path.join(tmp, f"long{i}.wav"), " ".join(words), wav.numel() / SAMPLE_RATE))
        sf.write(files[-1][0], wav.numpy(), SAMPLE_RATE, subtype="FLOAT")
    rows, long = [], {}
    chunk = asr.max_train_duration
    overlap = args.overlap if args.overlap is not None else chunk / 4
    for name, overlap in ((f"overlap {overlap:.2f} s", overlap), ("no overlap", 0.0)):
        log(f"{len(files)} long files ({sum(f[2] for f in files):.0f} s): {name}")
        planned = [plan_chunks(Request(path, "en", "en", False, "asr"), chunk, SAMPLE_RATE, overlap)[1]
                   for path, _, _ in files]
        results, _ = transcribe(asr, [path for path, _, _ in files], pnc=False, chunk_overlap=overlap)
        out = jiwer.process_words([ref for _, ref, _ in files], [res.pred_text.lower() for res in results])
        long[name] = {"overlap_s": round(overlap, 2), "chunks": sum(map(len, planned)),
                      "decoded_s": round(sum(c[2] for cs in planned for c in cs), 1), "wer": round(100 * out.wer, 2),
                      "deletions": out.deletions, "insertions": out.insertions, "substitutions": out.substitutions}
        rows.append([name, overlap, *list(long[name].values())[1:]])
    print_table([("long file", "<16"), ("overlap s", ">10.2f"), ("chunks", ">7d"), ("decoded s", ">10.1f"),
                 ("WER %", ">6.1f"), ("deleted", ">8d"), ("inserted", ">9d"), ("substituted", ">12d")], rows)
    print_json({"ckpt": args.ckpt, "files": args.files, "right": right, "timestamps": stats,
                "long_seconds": round(sum(f[2] for f in files), 1), "long_words": args.long_files * args.long_words,
                "chunk_seconds": chunk, "long": long})



# --- recordings: tools/make_long_audio.py's files, offline and streamed ----------------------------


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


def re_edged(part: Request, loaded) -> Request:
    """The utterance `part` of a long file cut as an ideal pause detector would cut it: its own speech
    (`speech_frames` of the utterance alone) with the median silence the model's training utterances
    held before and after it (`edge_silence`), taken from the long file. Where this misses the
    utterance alone, what the model hears is the edges' silence, not where segmentation cut."""
    rate = loaded.features.sample_rate
    wav = load_audio(part.audio_filepath, part.offset, part.duration, rate)
    spoken = speech_frames(wav, rate).nonzero().flatten()
    if not spoken.numel():
        return part
    lead, trail = loaded.edge_silence or (EDGE, EDGE)
    start = max(0.0, part.offset + float(spoken[0]) * FRAME - lead)
    end = part.offset + (int(spoken[-1]) + 1) * FRAME + trail
    return replace(part, offset=start, duration=end - start)


def threshold_arg(text: str) -> float | None:
    return None if text == "auto" else float(text)


def recording_flags(p) -> None:
    p.add_argument("--ckpt", required=True, help="a run directory or checkpoint")
    p.add_argument("--manifest", nargs="+", required=True, help="tools/make_long_audio.py manifests")
    p.add_argument("--policies", nargs="+", default=["alignatt", "waitk"])
    p.add_argument("--alignatt-thresholds", nargs="+", type=threshold_arg, default=[StreamConfig.alignatt_threshold],
                   metavar="S", help="AlignAtt streams at each of these thresholds (s before the chunk's end; "
                                     "auto: the default, adapting to how far the attention peaks step)")
    p.add_argument("--no-utterances", action="store_true", help="skip decoding the utterances one by one")
    p.add_argument("--no-offline", action="store_true", help="skip decoding the long files offline")
    p.add_argument("--merge-segments", action="store_true",
                   help="decode offline a second time with infer.py --merge-segments (rows marked merged)")
    p.add_argument("--vad", nargs="+", choices=DETECTORS, default=["energy"],
                   help="decode offline and stream with each of these speech detectors (silero: silero-vad)")


def recordings(args) -> None:
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
            edged = [re_edged(r, loaded) for r in parts]
            for label, weight, reqs in (("each utterance alone, greedy", 0.0, parts),
                                        ("each utterance alone, CTC 0.3", 0.3, parts),
                                        ("each re-edged, CTC 0.3", 0.3, edged)):
                res, _ = transcribe(loaded, reqs, DecodingOptions(ctc_weight=weight))
                found[label] = scores([q.text for q in parts], [r.pred_text for r in res])
                rows.append([name, label, *found[label].values(), "", ""])
        offline = [(label, weight, vad, merge) for vad in args.vad for merge in [False, True][:1 + args.merge_segments]
                   for label, weight in (("offline, greedy", 0.0), ("offline, CTC 0.3", 0.3))]
        for label, weight, vad, merge in offline * (not args.no_offline):
            label = f"{label}, {vad}" + (", merged" if merge else "")
            res, timings = transcribe(loaded, requests, DecodingOptions(ctc_weight=weight), vad=vad,
                                      merge_segments=merge)
            found[label] = {**scores(refs, [r.pred_text for r in res]), "rtfx": round(timings.rtfx, 1)}
            rows.append([name, label, *list(found[label].values())[:5], "", ""])
        streams = [(policy, t, vad) for vad in args.vad for policy in args.policies
                   for t in (args.alignatt_thresholds if policy == "alignatt" else [None])]
        for policy, threshold, vad in streams:
            streamer = Streamer(loaded, StreamConfig(policy=policy, alignatt_threshold=threshold, vad=vad))
            decoded = stream_requests(streamer, requests)
            swept = len(args.alignatt_thresholds) > 1 and policy == "alignatt"
            label = (f"stream {policy}" + (f" {'auto' if threshold is None else f'{threshold:g} s'}" if swept else "")
                     + f", {vad}")
            stat = scores(refs, [r.pred_text for r, _, _ in decoded])
            stat["lag_per_minute_s"], stat["laal_s"], stat["unaligned_files"] = stream_lags(decoded, lines,
                                                                                            streamer.rate)
            stat["sentences"] = sum(s.sentences for _, s, _ in decoded)
            stat["window_cuts"] = sum(s.window_cuts for _, s, _ in decoded)
            stat["left_s"] = streamer.left / streamer.rate
            if policy == "alignatt":  # where each file's threshold ended, adaptive or not
                frames = [streamer.policy.alignatt_frames(s.policy) for _, s, _ in decoded]
                stat["alignatt_threshold_s"] = [round(f * streamer.frame_s, 2) for f in frames]
            found[label] = stat
            rows.append([name, label, *list(stat.values())[:5], stat["laal_s"], stat["sentences"]])
            log(f"{name} {label}: lag per minute {stat['lag_per_minute_s']}")
    print_table([("set", "<10"), ("decoding", "<30"), ("WER %", ">6.1f"), ("deleted", ">8d"), ("inserted", ">9d"),
                 ("substituted", ">12d"), ("words", ">6d"), ("LAAL s", ">7"), ("sentences", ">10")], rows)
    print_json(result)


MODES = {"words": (word_flags, word_audio, "word timestamps and chunked long audio, on generated word audio"),
         "recordings": (recording_flags, recordings, "long recordings offline and streamed, against their utterances")}

if __name__ == "__main__":
    run_modes(__doc__, MODES, "words")
