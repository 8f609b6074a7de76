"""Mixing training data: temperature-balanced shares of sources and languages, and non-speech
examples whose target is empty.

    shares = temperature_shares({("ls", "en"): 960.0, ("mls", "de"): 2000.0}, temperature=2.0)
    utts, num_tokens = temperature_mix(entries, 2.0)            # in-memory manifests (train_data.load_examples)
    weights, shares, groups = stream_weights(entries, sources, 2.0)  # streamed sources (MixedSource's weights)
    source = MixedSource([ShardSource("shards/en"), ShardSource("shards/de")], weights=[2, 1])  # endless, resumable

Groups. Every example belongs to a (dataset, language) group: `dataset` is its train.manifests entry's
tag (default: the entry's path), `language` the entry's tag, else the utterance's own (its
source_lang; "src-tgt" for a translation). With `train.mix_temperature: T` a group's share of the
training audio is hours^(1/T) / sum over groups: T=1 keeps the natural proportions, a large T
approaches uniform. This is NeMo's `reweight_temperature` (w^tau with tau = 1/T) and the
(n/N)^alpha of Canary-1B-v2's data balancing (alpha = 1/T). A pass over in-memory manifests keeps
the data's total hours, redistributed: each example carries a weight, its expected copies per pass,
and the sampler draws the copies anew each pass (sampler.py), so a down-weighted group shows a
different part of itself every pass and all of it over the passes. Inside one streamed source
languages are not separated (give each language its own entry to balance them).

Non-speech (`{path: noise.jsonl, nonspeech: true, rate: 0.05}`): the lines are audio without
speech; each becomes prompt + EOS (an empty text), so the decoder learns to stop at once. A line's
prompt is its own (when it names a language), else the entry's `language` (transcription), else
that of a speech example drawn at random, so non-speech meets every task and language the model
is trained on: a clip weighted w > 1 is held ceil(w) times, each with its own prompt. `rate` is the
expected fraction of a pass's examples (all non-speech entries together below 1).

The prompts are drawn with the seeded RNG that load_examples passes, and the sampler's copies with
its own seed, so every rank and every restart builds the same passes, and the sampler's state
resumes them exactly.
"""

import json
import logging
import math
import random
import re
import time
from bisect import bisect_right
from collections import Counter
from dataclasses import replace
from itertools import accumulate
from pathlib import Path

import numpy as np

from aed.config import ConfigError
from aed.data_manifest import Utterance
from aed.data_shards import ShardSource
from aed.data_sources import ManifestEntry, metadata

log = logging.getLogger(__name__)


def temperature_shares(hours: dict, temperature: float) -> dict:
    """group -> target share: hours^(1/T) / sum of them. T=1: natural; T=inf (YAML .inf): uniform."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    powered = {g: h ** (1.0 / temperature) for g, h in hours.items()}
    total = sum(powered.values())
    return {g: p / total for g, p in powered.items()}


def utterance_language(u: Utterance) -> str:
    return u.source_lang if u.taskname == "asr" else f"{u.source_lang}-{u.target_lang}"


def group_of(entry: ManifestEntry, u: Utterance | None = None) -> tuple[str, str]:
    """(dataset, language) of an example of `entry` (u None: a streamed entry, its language tag or "*")."""
    dataset = entry.dataset or entry.name
    if entry.nonspeech:
        return dataset, "nonspeech"
    return dataset, entry.language or (utterance_language(u) if u is not None else "*")


def label(group: tuple[str, str]) -> str:
    return f"{group[0]} [{group[1]}]"


def log_table(title: str, hours: dict, shares: dict, factors: dict | None = None) -> None:
    """The mix at start: per group its hours, natural share, target share (and the expected copies
    of each of its examples per pass)."""
    total = sum(hours.values())
    width = max(len(label(g)) for g in hours)
    head = f"  {'group':{width}s} {'hours':>10s} {'natural':>8s} {'target':>8s}" + (" per pass" if factors else "")
    rows = [f"  {label(g):{width}s} {hours[g]:10.2f} {hours[g] / total:8.1%} {shares[g]:8.1%}"
            + (f" {factors[g]:8.3f}x" if factors else "") for g in sorted(hours)]
    log.info("%s: %d groups, %.2f h\n%s", title, len(hours), total, "\n".join([head, *rows]))


def audio_shares(groups: list, seconds: list, weights: list | None = None) -> dict:
    """group -> share of the audio, over examples of the given groups, durations (and weights)."""
    total = Counter()
    for g, s, w in zip(groups, seconds, weights or [1.0] * len(groups)):
        total[g] += s * w
    whole = sum(total.values()) or 1.0
    return {g: s / whole for g, s in total.items()}


# --- in-memory manifests --------------------------------------------------------------------------


def temperature_mix(entries: list, temperature: float) -> tuple[list, list]:
    """entries: (ManifestEntry, utterances, token counts) per speech manifest -> (utterances, token counts):
    every utterance once, its `weight` its group's factor = target hours / its hours, so a pass
    keeps the data's total hours and gives each group its temperature share of them."""
    members = {}  # group -> [(utterance, token count)]
    for entry, utts, num_tokens in entries:
        for u, n in zip(utts, num_tokens):
            members.setdefault(group_of(entry, u), []).append((u, n))
    if not members:
        return [], []
    hours = {g: sum(u.duration for u, _ in m) / 3600 for g, m in members.items()}
    shares = temperature_shares(hours, temperature)
    total = sum(hours.values())
    factors = {g: shares[g] * total / hours[g] for g in members}
    log_table(f"train.mix_temperature={temperature:g}", hours, shares, factors)
    picked = [(replace(u, weight=factors[g]), n) for g in sorted(members) for u, n in members[g]]
    return [u for u, _ in picked], [n for _, n in picked]


def nonspeech_examples(entries: list, speech: list, rng: random.Random) -> list:
    """entries: (ManifestEntry, utterances) per non-speech manifest; speech: the speech utterances -> the
    non-speech utterances, entry i's weights adding up to rate_i / (1 - sum of rates) x the speech
    examples of a pass (so it makes up rate_i of a pass's examples), each with its prompt fields set
    (module docstring)."""
    rates = [entry.rate for entry, _ in entries]
    if sum(rates) >= 1:
        raise ConfigError(f"train.manifests: the non-speech rates add up to {sum(rates):g}; they are fractions "
                          "of all training examples and must add up to less than 1")
    if not speech:
        raise ConfigError("train.manifests: non-speech entries need speech examples to mix into")
    out = []
    per_pass = sum(u.weight for u in speech)
    for (entry, utts), rate in zip(entries, rates):
        if not utts:
            raise ConfigError(f"train.manifests entry {entry.path}: a non-speech manifest with no usable line")
        count = rate / (1 - sum(rates)) * per_pass  # this entry's examples per pass
        w = count / len(utts)  # each clip's expected copies per pass
        variants = max(1, math.ceil(w))  # a clip seen more than once a pass: each time another prompt
        for u in utts:
            for _ in range(variants):
                v = replace(u, weight=w / variants)
                if not u.source_lang:  # the line named no language: the entry's, or a speech example's prompt
                    lang = entry.language
                    p = replace(u, source_lang=lang, target_lang=lang, taskname="asr") if lang else rng.choice(speech)
                    v = replace(v, source_lang=p.source_lang, target_lang=p.target_lang, pnc=p.pnc, taskname=p.taskname)
                out.append(v)
        log.info("%s: %d non-speech utterances, %.2f h; %.1f a pass (rate %g), drawn anew each pass", entry.path,
                 len(utts), sum(u.duration for u in utts) / 3600, count, rate)
    return out


# --- streamed sources -----------------------------------------------------------------------------


def stream_size(entry: ManifestEntry, source) -> tuple[int, float]:
    """(examples, hours) of a streamed source: declared on its entry (`examples`, `hours`), from an aed
    shard index (its per-shard count and duration), or counted from the source's metadata (NeMo
    manifests, Shar cuts, parquet columns: no audio read; logged, as it reads every row)."""
    if entry.hours is not None:
        return entry.examples, entry.hours
    name = entry.name
    if isinstance(source, ShardSource):
        try:
            lines = [json.loads(line) for line in Path(source.index).read_text().splitlines() if line.strip()]
            return sum(d["count"] for d in lines), sum(d["duration"] for d in lines) / 3600
        except KeyError:
            raise ConfigError(f"train.manifests entry {name}: train.mix_temperature needs its size, and "
                              f"{source.index} has no per-shard 'duration': declare it on the entry, hours: H and "
                              "examples: N") from None
    t0, examples, seconds = time.time(), 0, 0.0
    for _, fields in metadata(source):
        examples, seconds = examples + 1, seconds + fields["duration"]
    if not examples:
        raise ConfigError(f"train.manifests entry {name}: its metadata lists no example, so it has no size to mix by")
    log.info("%s: %d examples, %.2f h (read from its metadata in %.1f s; declare hours and examples on the "
             "entry to skip this)", name, examples, seconds / 3600, time.time() - t0)
    return examples, seconds / 3600


def stream_weights(entries: list, sources: list, temperature: float) -> tuple[list, dict, list]:
    """The MixedSource weights (they count examples) that give each (dataset, language) group its
    temperature share of the audio: entry e of group g draws p_g x (e's hours / g's hours) of the
    audio, so its weight is that over e's mean duration. Also returns the target shares and each
    entry's group, for the log."""
    sizes = [stream_size(entry, source) for entry, source in zip(entries, sources)]
    groups = [group_of(entry) for entry in entries]
    hours = Counter()
    for g, (_, h) in zip(groups, sizes):
        hours[g] += h
    shares = temperature_shares(dict(hours), temperature)
    weights = [shares[g] * n / hours[g] for g, (n, _) in zip(groups, sizes)]
    log_table(f"train.mix_temperature={temperature:g} (streamed)", dict(hours), shares)
    return weights, shares, groups


class MixedSource:
    """Several sources mixed by weight: each example comes from source i with probability
    weights[i] / sum(weights) (weights count examples, not hours). Every source is cycled in
    its own reshuffled passes, so the mix is endless: use the sampler with infinite=True.

    Keys are (source index, *source key); the cursor is (examples drawn, per source (pass, cursor)),
    and the draws are a fixed function of (seed, rank, draw number), so a resume continues exactly.
    """

    BLOCK = 4096  # draws generated at a time

    def __init__(self, sources: list, weights: list):
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"MixedSource: {len(sources)} sources but {len(weights)} weights")
        if any(not w > 0 for w in weights):
            raise ValueError(f"MixedSource: weights must be positive, got {weights}")
        self.sources = sources
        total = float(sum(weights))
        self.cum_weights = list(accumulate(w / total for w in weights))

    def read(self, seed: int, rank: int, world_size: int, cursor=None):
        n, subs = cursor or (0, [(0, None)] * len(self.sources))
        subs = [tuple(s) for s in subs]
        streams = [self._cycle(i, seed, rank, world_size, *subs[i]) for i in range(len(self.sources))]
        draws = None
        while True:
            if draws is None or n % self.BLOCK == 0:
                draws = np.random.default_rng([seed, rank, n // self.BLOCK]).random(self.BLOCK).tolist()
            i = min(bisect_right(self.cum_weights, draws[n % self.BLOCK]), len(self.sources) - 1)
            key, sub, ex = next(streams[i])
            subs[i] = sub
            n += 1
            yield (i, *key), (n, list(subs)), ex

    def _cycle(self, i: int, seed: int, rank: int, world_size: int, pass_idx: int, cursor):
        while True:
            got = 0
            pass_seed = random.Random(f"{seed}/{i}/{pass_idx}").getrandbits(64)
            for key, cur, ex in self.sources[i].read(pass_seed, rank, world_size, cursor):
                got += 1
                yield key, (pass_idx, cur), ex
            if got == 0 and cursor is None:
                raise ValueError(f"MixedSource: source {i} gave rank {rank} no example in a whole pass")
            pass_idx, cursor = pass_idx + 1, None

    def get(self, key) -> dict:
        return self.sources[key[0]].get(tuple(key[1:]))

    def describe(self, key) -> str:
        return self.sources[key[0]].describe(tuple(key[1:]))


class Tagged:
    """A streamed source whose examples carry `mix_source` (its index in the mix), so the batches can
    be counted by group (MixLog); a wrapper of the streamed-source protocol."""

    def __init__(self, source, index: int):
        self.source, self.index = source, index

    def read(self, seed: int, rank: int, world_size: int, cursor=None):
        for key, cur, ex in self.source.read(seed, rank, world_size, cursor):
            ex["mix_source"] = self.index
            yield key, cur, ex

    def get(self, key) -> dict:
        return {**self.source.get(key), "mix_source": self.index}

    def describe(self, key) -> str:
        return self.source.describe(key)


class MixLog:
    """The realised mix: each group's share of the audio in the batches this rank takes from the
    sampler, beside its target. Every `every` examples (about a pass of this rank) a log line gives
    that window's shares and the shares since the run (re)started; `values` gives the latter for
    metrics.jsonl and TensorBoard. A window's shares swing with the buckets its batches came from
    (short non-speech clips sit in the short buckets, drawn in turn): the shares since the start are
    the ones that converge on the target. `item` maps a batch element (an index into the in-memory
    examples, or a streamed example dict) to (group, seconds)."""

    def __init__(self, item, targets: dict, every: int):
        self.item, self.targets, self.every = item, targets, max(1, every)
        self.seconds, self.since_start, self.count, self.lines = Counter(), Counter(), 0, 0

    def see(self, batch: list) -> None:
        for element in batch:
            group, seconds = self.item(element)
            self.seconds[group] += seconds
            self.since_start[group] += seconds
            self.count += 1
            if self.count >= self.every:
                self.flush()

    def shares(self) -> dict:
        """group -> share of the audio since the run (re)started."""
        total = sum(self.since_start.values()) or 1.0
        return {g: self.since_start[g] / total for g in sorted(set(self.targets) | set(self.since_start))}

    def values(self) -> dict:
        """{"mix/<dataset>/<language>": share since the start} (TensorBoard's tag characters)."""
        return {"mix/" + re.sub(r"[^A-Za-z0-9_.\-/]", "_", f"{g[0]}/{g[1]}").lstrip("/"): share
                for g, share in self.shares().items()}

    def flush(self) -> None:
        total = sum(self.seconds.values()) or 1.0
        since = self.shares()
        self.lines += 1
        parts = [f"{label(g)} {self.seconds[g] / total:.1%} (since the start {since[g]:.1%}, target "
                 f"{self.targets.get(g, 0.0):.1%})" for g in sorted(set(self.targets) | set(self.seconds))]
        log.info("realised mix #%d, share of the audio in the last %d examples (%.2f h): %s", self.lines,
                 self.count, total / 3600, ", ".join(parts))
        self.seconds, self.count = Counter(), 0
