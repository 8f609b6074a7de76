"""A run's training data: manifests read into memory, or tar shards streamed, behind one
2D-bucketing sampler, and the DataLoader that turns its batches into padded `Batch`es.

    data = build_training_data(cfg, tokenizer, rank, world_size, bins_out="run/bins.json")
    loader = data.loader(device)      # batches of cfg.train's 2D buckets, forever (infinite passes)
    data.sampler.state_dict(rewind=data.counter.taken - consumed)   # exact resume (aed/train_checkpoint.py: DataPosition)

Bins: the edges of the 2D buckets. A run without train.bins estimates them at its start from the
utterances it has read; before a run, tools/estimate_bins.py and oom.py estimate them from the
training manifests, counting tokens exactly as training does (`bins_from_manifests`, last below):

    bins, meta = bins_from_manifests(["train.jsonl"], tokenizer, num_buckets=30, sub_buckets=2)
    bins, meta = bins_from_manifests([{"shar": "data/shar"}], tokenizer)   # any train.manifests entry
    bins, manifests = bins_from_config("configs/tiny.yaml")   # its manifests, tokenizer and bucket counts

Streamed entries (aed/data_sources.py) give their rows' metadata: NeMo manifests, Shar cuts and parquet
columns hold the durations, so no audio is read (parquet without a duration column: headers only).

An example's token count is the length of what the decoder is trained on: prompt + text + EOS,
from `aed.data_batch.encode_utterance` with the training tokenizer (train.tokenizer), after the line is
read and parsed as training reads it (`manifest_lines` + `parse_line`: .gz, `lang` / `answer`, errors
naming file:line:field). Bins are estimated from a uniform random sample of
the non-empty lines of all manifests (one pass, reservoir sampling); lines that do not parse or
tokenize are skipped, counted by reason (meta["skipped"]) and reported on stderr with the first
such line. `bins.py` explains the estimation itself.
"""

import functools
import logging
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import replace
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader

from aed.config import ConfigError
from aed.data_audio import AudioError, FeatureConfig, LogMel, load_audio, num_frames
from aed.data_augment import Augment
from aed.data_batch import (ROUNDING_SLACK, Collate, ExampleDataset, encodable, encode_utterance, fit_decoder,
                            ignore_stop_signals)
from aed.data_manifest import (Faults, ManifestError, Utterance, check_audio, manifest_lines, nonspeech_fields, parse_line,
                               read_manifest, read_rows)
from aed.data_mixing import (MixLog, MixedSource, Tagged, audio_shares, group_of, nonspeech_examples, stream_weights,
                             temperature_mix)
from aed.data_sources import CountTokens, ManifestEntry, metadata, parse_spec, source_faults
from aed.data_speech import edge_silence, trim_silence
from aed.decode_lm import count_transcripts
from aed.decode_timing import EDGE_SAMPLE
from aed.data_tokenizer import Tokenizer
from aed.train_config import OBJECTIVES, TrainConfig, load_train_config
from aed.train_distributed import all_gather_objects
from bins import Bins, estimate_bins, load_batch_sizes
from sampler import BucketingSampler

log = logging.getLogger(__name__)


def load_examples(entries: list, data_cfg, tokenizer, seed: int, rank: int, world_size: int,
                  faults: Faults | None = None) -> tuple[list, list]:
    """Manifests (`ManifestEntry`s: paths or {path, weight, dataset, language}, and non-speech {path,
    nonspeech, rate}) -> (utterances carrying their token ids, token counts): every utterance once (once per speed with
    speed perturbation), its `weight` its expected copies per pass, which the sampler draws anew
    each pass: a manifest's `weight` w, or with data_cfg.mix_temperature its (dataset,
    language) group's factor for its temperature share of the hours, and non-speech lines (target:
    prompt + EOS) their rates of a pass's examples (aed/data_mixing.py). Invalid lines, lines the
    tokenizer cannot encode and (with check_audio) utterances whose audio is unreadable or disagrees
    with its duration are skipped and counted in `faults`, or stop the run without skip_invalid.
    tokenizer None (objective=ssl): audio-only lines are read, and every token count is 0."""
    rng = random.Random(seed)
    faults = Faults() if faults is None else faults
    temperature = data_cfg.mix_temperature
    speech, nonspeech = [], []  # (entry, utterances, token counts) per manifest; (entry, utterances)
    for entry in entries:
        if entry.streamed:
            raise ConfigError(f"train.manifests entry {entry.given!r} is streamed: every entry must then be streamed")
        if entry.nonspeech:
            if tokenizer is None:
                raise ConfigError(f"train.manifests entry {entry.path}: non-speech examples teach the decoder to "
                                  "stop at once; an objective that reads no text has no use for them")
            if data_cfg.min_tps is not None:
                raise ConfigError(f"train.manifests entry {entry.path}: train.min_tps would drop the non-speech "
                                  "examples (their target is the prompt and EOS alone); unset one of them")
            utts = list(read_rows(entry.path, nonspeech_fields, data_cfg.skip_invalid, faults))
            if data_cfg.check_audio:
                utts, _ = with_valid_audio(entry.path, utts, [0] * len(utts), data_cfg, rank, world_size, faults)
            nonspeech.append((entry, utts))
            continue
        if temperature is not None and entry.weight is not None:
            raise ConfigError(f"train.manifests entry {entry.path}: field 'weight': train.mix_temperature sets "
                              "the weights from the hours; remove one of them")
        utts = read_manifest(entry.path, data_cfg.skip_invalid, tokenizer is not None, faults)
        if tokenizer is not None:
            utts, num_tokens = encodable(utts, tokenizer, data_cfg.skip_invalid, faults)
        else:
            num_tokens = [0] * len(utts)
        if data_cfg.check_audio:
            utts, num_tokens = with_valid_audio(entry.path, utts, num_tokens, data_cfg, rank, world_size, faults)
        speech.append((entry, utts, num_tokens))
        log.info("%s: %d utterances, %.2f h%s", entry.path, len(utts), sum(u.duration for u in utts) / 3600,
                 "" if temperature is not None else f", weight {entry.weight or 1.0:g}")
    if temperature is not None:
        out, out_tokens = temperature_mix(speech, temperature)
    else:
        out, out_tokens = [], []
        for entry, utts, num_tokens in speech:
            weight = entry.weight or 1.0
            out += [replace(u, weight=weight) for u in utts] if weight != 1.0 else utts
            out_tokens += num_tokens
    if nonspeech:
        extra, extra_tokens = encodable(nonspeech_examples(nonspeech, out, rng), tokenizer, data_cfg.skip_invalid,
                                        faults)
        out, out_tokens = out + extra, out_tokens + extra_tokens
    if data_cfg.speed_perturb:
        out = [replace(u, speed=f) for f in data_cfg.speed_perturb for u in out]
        out_tokens = out_tokens * len(data_cfg.speed_perturb)
        log.info("speed perturbation %s: %d utterances, %.2f h", data_cfg.speed_perturb, len(out),
                 sum(u.perturbed_duration for u in out) / 3600)
    return out, out_tokens


def with_valid_audio(path: str, utts: list, num_tokens: list, data_cfg, rank: int, world_size: int,
                     faults: Faults | None = None):
    """(utts, num_tokens) without the utterances whose audio header is unreadable or disagrees with
    the manifest's duration (counted in `faults`: unreadable_audio, audio_length). Each rank reads
    1/world_size of the headers; the problems are shared."""
    t0 = time.time()
    problems = sorted(p for part in all_gather_objects(
        check_audio(utts, data_cfg.duration_tolerance, rank, world_size)) for p in part)
    log.info("%s: read the audio headers of %d utterances in %.1f s", path, len(utts), time.time() - t0)
    if not problems:
        return utts, num_tokens
    if not data_cfg.skip_invalid:
        i, why = problems[0]
        raise ManifestError(f"{utts[i].where}: {utts[i].audio_filepath}: {why} ({len(problems)} such "
                            f"utterance(s); train.skip_invalid=true skips them)")
    if rank == 0:
        for i, why in problems[:10]:
            log.warning("skipping %s: %s: %s", utts[i].where, utts[i].audio_filepath, why)
        unreadable = sum(why.startswith("unreadable") for _, why in problems)
        log.warning("%s: skipped %d utterance(s) after reading their audio headers: %d unreadable, %d whose "
                    "duration is off by more than %g%%%s", path, len(problems), unreadable, len(problems) - unreadable,
                    100 * data_cfg.duration_tolerance, " (first 10 shown)" if len(problems) > 10 else "")
    if faults is not None:
        for i, why in problems:  # logged above, the first 10
            faults.skip("unreadable_audio" if why.startswith("unreadable") else "audio_length", utts[i].where, why,
                        quiet=True)
    bad = {i for i, _ in problems}
    keep = [i for i in range(len(utts)) if i not in bad]
    return [utts[i] for i in keep], [num_tokens[i] for i in keep]


def build_training_data(cfg: TrainConfig, tokenizer, rank: int, world_size: int,
                        bins_out: str | None = None) -> "TrainingData":
    """The sampler and dataset of cfg.train: manifests in memory, or streamed sources (aed's tar
    shards, NeMo tarred sets, Lhotse Shar, parquet: aed/data_sources.py) read through the sampler's
    producer thread, token counts computed as they stream by (then bins must be given). An objective that
    reads no text (ssl) reads audio alone: no text, 1D (duration) buckets. Bins estimated from the
    manifests are saved to `bins_out` when given. ConfigError / ManifestError name what is wrong."""
    reads_text = OBJECTIVES[cfg.objective].reads_text
    # An example's audio as the workers prepare it: its edge silence trimmed, degraded (training data
    # only; the noise/RIR manifests are read and checked now), then its features.
    trim = silence_trimmer(cfg)
    augment = Augment(cfg.augment, cfg.features.sample_rate) if cfg.augment.enabled else None
    logmel = LogMel(cfg.features).train()  # train mode: dither
    sampler_args = dict(allocation=cfg.train.allocation, min_tps=cfg.train.min_tps,
                        max_tps=cfg.train.max_tps, buffer_size=cfg.train.buffer_size, seed=cfg.seed,
                        rank=rank, world_size=world_size, sync_buckets=cfg.train.sync_buckets,
                        overfill=cfg.train.buffer_overfill, sortagrad=cfg.train.sortagrad, infinite=True)
    bins = Bins.load(cfg.train.bins) if cfg.train.bins else None  # None: estimated from the manifests
    if cfg.train.batch_sizes:
        bins, sizes = load_batch_sizes(cfg.train.batch_sizes)  # the bins the sizes were searched for
        sampler_args["batch_sizes"] = sizes
    elif cfg.train.batch_size is not None:
        sampler_args["batch_size"] = cfg.train.batch_size
    else:
        sampler_args["max_duration"] = cfg.train.max_duration
    data = dict(pad_id=tokenizer.pad, num_workers=cfg.train.num_workers, seed=cfg.seed)

    entries = [ManifestEntry.of(s) for s in cfg.train.manifests]  # checked: ConfigError names a bad one
    streamed = [e for e in entries if e.streamed]
    if streamed:
        if not reads_text:
            raise ConfigError(f"objective={cfg.objective} reads manifests (audio-only lines are fine), not "
                              "streamed sources")
        if cfg.train.speed_perturb or cfg.train.short_first:
            raise ConfigError("train.speed_perturb and train.short_first work on in-memory manifests; streamed "
                              "sources are read as they come")
        if len(streamed) != len(entries) or bins is None:
            raise ConfigError("streamed training needs every train.manifests entry streamed ({shards: DIR}, "
                              "{shar: DIR}, a NeMo tarred set or {parquet: GLOB}; README: Your data as it is) and "
                              "train.bins or train.batch_sizes (tools/estimate_bins.py reads the same entries)")
        longest = max(max(row) for row in bins.tokens) if bins.tokens else None
        if longest is None or longest > cfg.model.dec_max_len:
            raise ConfigError(f"streamed training needs 2D bins whose token bounds fit "
                              f"model.dec_max_len={cfg.model.dec_max_len} (the sampler drops longer examples)")
        opened = [e.open() for e in streamed]
        sources = [CountTokens(s, tokenizer) for s in opened]
        weights, mix = [e.weight or 1.0 for e in streamed], None
        if cfg.train.mix_temperature is not None:
            if weighted := [e for e in streamed if e.weight is not None]:
                raise ConfigError(f"train.manifests entry {weighted[0].given!r}: field 'weight': train.mix_temperature "
                                  "sets the weights from the hours; remove one of them")
            weights, shares, groups = stream_weights(streamed, opened, cfg.train.mix_temperature)
            sources = [Tagged(s, i) for i, s in enumerate(sources)]
            mix = MixLog(lambda ex: (groups[ex["mix_source"]], ex["duration"]), shares, cfg.train.mix_log_every)
        source = sources[0] if len(sources) == 1 else MixedSource(sources, weights)
        sampler = BucketingSampler(source, bins, **sampler_args)
        dataset = ExampleDataset(None, tokenizer, logmel, cfg.seed, cfg.train.duration_tolerance, augment, trim)
        return TrainingData(sampler, dataset, bins, BatchCounter(sampler, mix), **data,
                            faults=tuple(f for s in sources for f in source_faults(s)),
                            pad_to=compiled_shapes(cfg, bins, reads_text))

    text_tokenizer = tokenizer if reads_text else None
    faults = Faults()
    utts, num_tokens = load_examples(entries, cfg.train, text_tokenizer, cfg.seed, rank, world_size, faults)
    utts, num_tokens = fit_decoder(utts, num_tokens, cfg.model.dec_max_len, "training")
    if bins is None:
        bins = estimate_bins([u.perturbed_duration for u in utts], num_tokens, cfg.train.num_buckets,
                             cfg.train.sub_buckets if reads_text else 1, method=cfg.train.bin_method)
        if bins_out:
            bins.save(bins_out)
    examples = [{"duration": u.perturbed_duration, "num_tokens": n, "weight": u.weight}
                for u, n in zip(utts, num_tokens)]
    seconds, steps = cfg.train.short_first or (None, 0)
    short_first = (seconds, int(steps) * cfg.optim.grad_accum) if seconds else None  # sampler batches
    try:
        sampler = BucketingSampler(examples, bins, **sampler_args, short_first=short_first, yield_indices=True)
    except ValueError as e:  # settings the data cannot meet (short_first, a batch limit no example fits)
        raise ConfigError(f"train: {e}") from None
    if faults.counts:
        log.warning("train.manifests: skipped %s", faults.summary())
    dataset = ExampleDataset(utts, text_tokenizer, logmel, cfg.seed, cfg.train.duration_tolerance, augment, trim)
    counter = BatchCounter(sampler, epoch_mix_log(entries, cfg.train.mix_temperature, utts, world_size))
    return TrainingData(sampler, dataset, bins, counter, **data, faults=(faults,),
                        pad_to=compiled_shapes(cfg, bins, reads_text),
                        edge_silence=measure_edges(utts, cfg.features.sample_rate, cfg.seed, trim))


def save_transcript_lm(cfg: TrainConfig, tokenizer, path: str) -> None:
    """train.lm_order's n-gram of the training transcripts (aed/decode_lm.py), saved to `path` (the run
    directory's lm.pt, which the beam search of the run's models fuses). In-memory manifests only: the
    non-speech entries have no text, and streamed sources are read as they come (tools/train_lm.py
    counts their manifests)."""
    entries = [ManifestEntry.of(s) for s in cfg.train.manifests]
    paths = [e.path for e in entries if not e.streamed and not e.nonspeech]
    if not paths or len(paths) < len([e for e in entries if not e.nonspeech]):
        log.warning("train.lm_order=%d: streamed sources are not counted, so the run has no n-gram "
                    "(tools/train_lm.py counts a manifest's transcripts)", cfg.train.lm_order)
        return
    start = time.perf_counter()
    lm = count_transcripts(paths, tokenizer, cfg.train.lm_order, cfg.train.skip_invalid)
    lm.save(path)
    log.info("n-gram of order %d over %d training transcripts saved to %s in %.1f s: the beam search of this "
             "run's models fuses it (infer.py --lm-weight)", lm.order, len(lm.sequences), path,
             time.perf_counter() - start)


def silence_trimmer(cfg: TrainConfig):
    """train.trim_silence's cut, wav (S,) -> wav, for the datasets (None when off): a picklable
    function, as DataLoader workers may need."""
    if cfg.train.trim_silence is None:
        return None
    return functools.partial(trim_silence, sample_rate=cfg.features.sample_rate, keep=cfg.train.trim_silence)


def measure_edges(utts: list, sample_rate: int, seed: int, trim=None) -> tuple[float, float] | None:
    """The silence the training utterances hold before and after their speech (medians over
    EDGE_SAMPLE of them, `aed.data_speech.edge_silence`, after `trim`): inference cuts long audio
    into segments with as much, the edges the model was trained on. Unreadable audio is left out."""
    t0 = time.time()
    wavs = []
    for u in random.Random(seed).sample(utts, min(EDGE_SAMPLE, len(utts))):
        try:
            wav = load_audio(u.audio_filepath, u.offset, u.duration if u.segment else None, sample_rate)
            wavs.append(wav if trim is None else trim(wav))
        except AudioError:
            continue
    edges = edge_silence(wavs, sample_rate)
    if edges is not None:
        log.info("training utterances hold a median %.2f s of silence before their speech and %.2f s after "
                 "(%d measured in %.1f s): inference cuts long audio with as much", *edges, len(wavs), time.time() - t0)
    return edges


def compiled_shapes(cfg: TrainConfig, bins: Bins, reads_text: bool) -> list | None:
    """With train.compile, the (frames, tokens) bounds of every bucket that batches are padded to
    (`bucket_padding`): a compiled block then compiles once per bucket, where padding to the longest
    item would give it a new shape almost every batch. None without it: the least padding."""
    if not cfg.compile:
        return None
    try:
        return bucket_padding(bins, cfg.features, cfg.model.dec_max_len, reads_text, cfg.train.speed_perturb,
                              cfg.augment.added_seconds)
    except ValueError as e:  # 1D bins without max_tps
        raise ConfigError(f"train.compile pads batches to their bucket's bounds: {e}") from None


def epoch_mix_log(entries: list, temperature: float | None, utts: list, world_size: int) -> MixLog | None:
    """The realised-mix log of in-memory manifests mixed by weight, temperature or with non-speech
    entries: a line per this rank's share of a pass, beside the pass's expected composition."""
    if temperature is None and not any(e.nonspeech or e.weight is not None for e in entries):
        return None
    by_path = {e.path: e for e in entries}
    groups = [group_of(by_path[u.where.rsplit(":", 1)[0]], u) for u in utts]  # where: "path:line"
    seconds = [u.perturbed_duration for u in utts]
    weights = [u.weight for u in utts]
    return MixLog(lambda i: (groups[i], seconds[i]), audio_shares(groups, seconds, weights),
                  round(sum(weights) / world_size))


class BatchCounter:
    """Counts the batches the DataLoader has taken from the sampler: the DataLoader prefetches,
    so a checkpoint rewinds the sampler by (taken - trained) batches to resume exactly. Each
    example goes to the dataset as (example, the batch's number), the draw that seeds its
    augmentation. A MixLog, when given, sees every batch (the realised mix of sources and languages)."""

    def __init__(self, sampler, mix: MixLog | None = None):
        self.sampler, self.taken, self.mix = sampler, 0, mix

    def __iter__(self):
        for batch in self.sampler:
            self.taken += 1
            if self.mix is not None:
                self.mix.see(batch)
            draw = self.sampler.last_batch_info["number"]
            yield [(example, draw) for example in batch]


class TrainingData(NamedTuple):
    sampler: BucketingSampler
    dataset: ExampleDataset  # sampler batch -> items
    bins: Bins
    counter: BatchCounter  # the sampler, counting the batches the DataLoader has taken from it
    pad_id: int
    num_workers: int
    seed: int
    faults: tuple = ()  # the Faults of the readers: manifests read at start, or each streamed source
    pad_to: list | None = None  # (frames, tokens) of every bucket, for Collate: train.compile's shapes
    edge_silence: tuple | None = None  # (before, after): median seconds of silence around the speech of
    # the training utterances (`measure_edges`); None for streamed sources, which are not read ahead

    def skipped(self, batches: Faults | None = None) -> dict:
        """Everything this rank's data left out so far, by kind, in one dict: what the readers
        skipped, what the sampler dropped (its stats, e.g. over_batch_limit) and, given the run's
        batch Faults (`Faults.report` of each Batch.errors), the items dropped from batches."""
        counts = Faults.merged(*self.faults, batches)
        for reason, n in self.sampler.stats.get("drops", {}).items():
            counts[f"sampler_{reason}"] += n
        return {k: n for k, n in sorted(counts.items()) if n}

    def loader(self, device: torch.device) -> DataLoader:
        """A DataLoader over the sampler's batches. Its own generator: worker seeds must not consume
        the global RNG, or a resumed run's dropout and SpecAugment would differ from an uninterrupted one."""
        return DataLoader(self.dataset, batch_sampler=self.counter, collate_fn=Collate(self.pad_id, self.pad_to),
                          num_workers=self.num_workers, pin_memory=device.type == "cuda",
                          worker_init_fn=ignore_stop_signals, generator=torch.Generator().manual_seed(self.seed))


# --- bucket bins estimated from the manifests ------------------------------------------------


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


def bins_from_config(config: str, manifests: list | None = None, sample: int | None = None) -> tuple:
    """(bins, the manifests) estimated as a run of `config` (a YAML path) would tokenize its data:
    the config's tokenizer, prompt, bucket counts, bin method and dec_max_len; manifests (entries,
    as strings or mappings) default to its train.manifests. Raises ConfigError, OSError or ValueError."""
    cfg = load_train_config(config)
    manifests = [parse_spec(m) for m in manifests] if manifests else list(cfg.train.manifests)
    bins, meta = bins_from_manifests(manifests, Tokenizer.load(cfg.train.tokenizer), cfg.train.num_buckets,
                                     cfg.train.sub_buckets, cfg.train.bin_method, sample, cfg.seed,
                                     max_tokens=cfg.model.dec_max_len, speed_perturb=cfg.train.speed_perturb)
    log.info("bins: %d buckets from %d of %d lines of %s (skipped: %s)", bins.num_buckets, meta["used"],
             meta["lines"], ", ".join(map(str, manifests)), meta["skipped"] or "none")
    return bins, manifests


def bucket_shapes(bins: Bins, features: FeatureConfig, dec_max_len: int, max_tps=None, added: float = 0.0) -> list:
    """(duration bound s, feature frames T, token bound U) of every bucket, duration-major like
    bins.buckets(); T counts `added` seconds beyond the bound (what augment's edges may add:
    AugmentConfig.added_seconds). 1D bins get U = max_tps x d (max_tps: a number, one per bin, or
    bins.max_tps)."""
    tps = max_tps if max_tps is not None else bins.max_tps
    if bins.tokens is None and tps is None:
        raise ValueError("1D bins without max_tps: pass the max tokens per second (--max-tps)")
    tps = [float(tps)] * len(bins.durations) if isinstance(tps, (int, float)) else tps
    shapes = []
    for i, d in enumerate(bins.durations):
        for t in bins.tokens[i] if bins.tokens else [math.ceil(tps[i] * d)]:
            if t > dec_max_len:  # train.py drops longer utterances, so no batch reaches t
                log.info("bucket (%.2f s, %d tokens): token bound capped at dec_max_len=%d", d, t, dec_max_len)
            frames = num_frames(round((d + added) * features.sample_rate), features.hop_length)
            shapes.append((d, frames, max(2, min(int(t), dec_max_len))))  # >= 2: one input, one target
    return shapes


def bucket_padding(bins: Bins, features: FeatureConfig, dec_max_len: int, reads_text: bool = True,
                   speed_perturb: list = (), added: float = 0.0) -> list:
    """(frames, tokens) that `Collate(buckets=...)` pads each bucket's batches to: the bucket's
    bounds (`bucket_shapes`), the frames of audio that may run ROUNDING_SLACK past its duration
    (`fit_duration`; more when slowed down by speed perturbation) and the `added` seconds of the
    edges included, so that every batch of a bucket gets the same shape."""
    slack = ROUNDING_SLACK / min(speed_perturb or [1.0])
    shapes = bucket_shapes(bins, features, dec_max_len, None if reads_text else 0.0)
    return [(num_frames(round((d + slack + added) * features.sample_rate), features.hop_length), tokens)
            for d, _, tokens in shapes]
