"""Bucket bins estimated from training manifests, counting tokens exactly as training does.

    bins, meta = bins_from_manifests(["train.jsonl"], tokenizer, num_buckets=30, sub_buckets=2)
    bins, meta = bins_from_manifests([{"shar": "data/shar"}], tokenizer)   # any train.manifests entry

Streamed entries (aed/data_sources.py) give their rows' metadata: NeMo manifests, Shar cuts and parquet
columns hold the durations, so no audio is read (parquet without a duration column: headers only).

An example's token count is the length of what the decoder is trained on: prompt + text + EOS,
from `aed.data_batch.encode_utterance` with the training tokenizer (train.tokenizer), after the line is
read and parsed as training reads it (`manifest_lines` + `parse_line`: .gz, `lang` / `answer`, errors
naming file:line:field). Bins are estimated from a uniform random sample of
the non-empty lines of all manifests (one pass, reservoir sampling); lines that do not parse or
tokenize are skipped, counted by reason (meta["skipped"]) and reported on stderr with the first
such line. `bins.py` explains the estimation itself. Shared by tools/estimate_bins.py and oom.py.
"""

import logging
import math
import os
import random
import sys
import time
from collections import Counter

from aed.data_audio import FeatureConfig, num_frames
from aed.data_batch import ROUNDING_SLACK, encode_utterance
from aed.data_manifest import Faults, ManifestError, Utterance, manifest_lines, parse_line
from aed.data_sources import ManifestEntry, metadata, source_faults
from bins import Bins, estimate_bins

log = logging.getLogger(__name__)


def entry_rows(entry: ManifestEntry, faults: Counter):
    """(where, base dir, row) of a train.manifests entry: a manifest's raw lines (`manifest_lines`,
    as training reads them, .gz too; parsed by training's `parse_line` only when sampled), or a
    streamed source's checked example fields; what the source skips is added to `faults`."""
    if not entry.streamed:
        base = os.path.dirname(os.path.abspath(entry.path))
        for where, line in manifest_lines(entry.path):
            yield where, base, line
        return
    source = entry.open(shuffle_shards=False)
    for where, fields in metadata(source):
        yield where, None, fields
    faults.update(Faults.merged(*source_faults(source)))


def sample_lines(entries: list, n: int | None, seed: int) -> tuple:
    """Uniform random sample of n rows over all entries: ([(where, base dir, row)], total, skipped by the sources)."""
    rng, sample, seen, last, faults = random.Random(seed), [], 0, time.time(), Counter()
    for entry in entries:
        for item in entry_rows(entry, faults):
            if n is None or seen < n:
                sample.append(item)
            elif (j := rng.randrange(seen + 1)) < n:
                sample[j] = item
            seen += 1
            if seen % 100_000 == 0 and time.time() - last > 2:
                last = time.time()
                print(f"estimate_bins: scanned {seen:,} rows ({entry.given})", file=sys.stderr)
    return sample, seen, faults


def measure(lines: list, tokenizer, max_tokens: int | None) -> tuple:
    """(durations, num_tokens, skipped by reason, first skipped line per reason)."""
    durations, num_tokens, skipped, example = [], [], Counter(), {}
    last = time.time()
    for k, (where, base, row) in enumerate(lines, 1):
        try:
            utt = parse_line(row, where, base) if isinstance(row, (str, bytes)) else Utterance(  # fields checked by the reader
                where, row["duration"], row["text"], row["source_lang"], row["target_lang"], row["pnc"],
                row["taskname"])
            n = len(encode_utterance(tokenizer, utt)[0])
        except ManifestError as e:
            skipped["bad_line"] += 1
            example.setdefault("bad_line", str(e))
            continue
        except (ValueError, KeyError) as e:  # e.g. a language the tokenizer does not know
            skipped["not_tokenizable"] += 1
            example.setdefault("not_tokenizable", f"{where}: {e}")
            continue
        if max_tokens is not None and n > max_tokens:
            skipped["over_max_tokens"] += 1
            example.setdefault("over_max_tokens", f"{where}: {n} tokens")
            continue
        durations.append(utt.duration)
        num_tokens.append(n)
        if time.time() - last > 2:
            last = time.time()
            print(f"estimate_bins: tokenized {k:,} of {len(lines):,} sampled lines", file=sys.stderr)
    return durations, num_tokens, skipped, example


def bins_from_manifests(specs: list, tokenizer, num_buckets: int = 30, sub_buckets: int = 2,
                        method: str = "optimised", sample: int | None = None, seed: int = 0,
                        outlier_z: float = 4.0, max_tokens: int | None = None,
                        audio_weight: float | None = None, speed_perturb: list = ()) -> tuple:
    """(Bins, meta): bins estimated (bins.estimate_bins) from `sample` lines of the manifests (all
    by default), leaving out examples over max_tokens (train.py drops those: model.dec_max_len),
    each line once per speed_perturb factor at its perturbed duration, as train.py sees it.
    specs: train.manifests entries as the config writes them (`aed.data_sources.ManifestEntry.of`);
    meta records what they were estimated from. Raises ValueError if no line is usable."""
    lines, total, faults = sample_lines([ManifestEntry.of(s) for s in specs], sample, seed)
    durations, num_tokens, skipped, example = measure(lines, tokenizer, max_tokens)
    for reason, n in skipped.items():
        print(f"estimate_bins: skipped {n:,} sampled lines ({reason}), e.g. {example[reason]}", file=sys.stderr)
    for reason, n in faults.items():
        print(f"estimate_bins: the readers skipped {n:,} {reason.replace('_', ' ')} (logged above)", file=sys.stderr)
    if not durations:
        raise ValueError(f"estimate_bins: no usable line in {len(lines):,} sampled lines of {specs}")
    if speed_perturb:
        durations = [d / f for f in speed_perturb for d in durations]
        num_tokens = list(num_tokens) * len(speed_perturb)
    bins = estimate_bins(durations, num_tokens, num_buckets, sub_buckets, outlier_z, method, audio_weight)
    meta = {"manifests": list(specs), "lines": total, "sampled": len(lines), "used": len(durations),
            "skipped": dict(skipped) | {f"reader_{r}": n for r, n in faults.items()}, "method": method,
            "audio_weight": audio_weight, "seed": seed, "outlier_z": outlier_z, "max_tokens": max_tokens,
            "speed_perturb": list(speed_perturb)}
    return bins, meta


def bucket_shapes(bins: Bins, features: FeatureConfig, dec_max_len: int, max_tps=None) -> list:
    """(duration bound s, feature frames T, token bound U) of every bucket, duration-major like
    bins.buckets(). 1D bins get U = max_tps x d (max_tps: a number, one per bin, or bins.max_tps)."""
    tps = max_tps if max_tps is not None else bins.max_tps
    if bins.tokens is None and tps is None:
        raise ValueError("1D bins without max_tps: pass the max tokens per second (--max-tps)")
    tps = [float(tps)] * len(bins.durations) if isinstance(tps, (int, float)) else tps
    shapes = []
    for i, d in enumerate(bins.durations):
        for t in bins.tokens[i] if bins.tokens else [math.ceil(tps[i] * d)]:
            if t > dec_max_len:  # train.py drops longer utterances, so no batch reaches t
                log.info("bucket (%.2f s, %d tokens): token bound capped at dec_max_len=%d", d, t, dec_max_len)
            frames = num_frames(round(d * features.sample_rate), features.hop_length)
            shapes.append((d, frames, max(2, min(int(t), dec_max_len))))  # >= 2: one input, one target
    return shapes


def bucket_padding(bins: Bins, features: FeatureConfig, dec_max_len: int, reads_text: bool = True,
                   speed_perturb: list = ()) -> list:
    """(frames, tokens) that `Collate(buckets=...)` pads each bucket's batches to: the bucket's
    bounds (`bucket_shapes`), the frames of audio that may run ROUNDING_SLACK past its duration
    (`fit_duration`; more when slowed down by speed perturbation) included, so that every batch of
    a bucket gets the same shape."""
    slack = ROUNDING_SLACK / min(speed_perturb or [1.0])
    shapes = bucket_shapes(bins, features, dec_max_len, None if reads_text else 0.0)
    return [(num_frames(round((d + slack) * features.sample_rate), features.hop_length), tokens)
            for d, _, tokens in shapes]
