"""Dynamic 2D bucketing batch sampler for speech encoder-decoder training (paper sec. 2).

Every example has an input length (`duration`, seconds) and an output length (`num_tokens`,
prompt included); an in-memory one may carry a `weight`, its expected copies per pass (default 1). A batch is padded along both, so batches group examples that are similar in
both. Bins (`bins.py`) give the buckets and map each example to one, or to the reason it is
dropped. Documentation: docs/sampler.md. One part per concern:

    _BatchLimit      the batch size of each bucket, and which examples no batch can hold
    _ListSource      an in-memory list: measured once, so every rank knows every example's bucket
    _StreamSource    a streamed source, read as it comes (in a producer thread, `_Producer`)
    _BucketBuffer    the per-bucket queues: fill schedule, random batches, cutting the rest at the end
    _even_out        equal epoch length across ranks (in-memory lists)
    _Curriculum      epoch 0's optional start: sortagrad, short_first
    _Agreement       how often this rank could take the bucket drawn for all ranks
    _State           what decides the remaining batches, and its saved form (the checkpoint format)
    _Snapshots       recent copies of the state, for `state_dict(rewind=k)`
    BucketingSampler composes them: the bucket drawn each step, epochs, resume, regrouping

A streamed source has three methods; keys and cursors must survive JSON (it turns tuples into lists):
    read(seed, rank, world_size, cursor=None)  yields (key, cursor after it, example dict): this rank's
                                               share of one pass, shuffled by seed, from cursor on
    get(key)                                   the example again (a resumed state holds keys only)
    describe(key)                              where the example is, for messages

    bins = Bins.load("bins.json")       # from bins import Bins; made by tools/estimate_bins.py
    sampler = BucketingSampler(examples, bins, max_duration=360, yield_indices=True)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)   # list[int] batches
    sampler = BucketingSampler(stream, bins, batch_sizes=sizes, infinite=True)
    for examples in sampler: ...                                             # list[dict] batches
    sampler.last_batch_info, sampler.stats, sampler.state_dict(rewind=num_prefetched_batches)
"""

import copy
import json
import logging
import math
import random
import sys
import threading
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import NamedTuple

import numpy as np

from bins import Allocator, Bins

log = logging.getLogger("sampler")

OVER_LIMIT = "over_batch_limit"  # drop reason: no batch can hold the example


def _seed(*parts: int) -> int:
    """A 64-bit seed derived from integers; stable across processes (unlike hash())."""
    a, b = np.random.SeedSequence([int(p) for p in parts]).generate_state(2)
    return (int(a) << 32) | int(b)


class Entry(NamedTuple):
    """An example waiting in a bucket queue, with the two lengths batching looks at."""

    key: object  # list index, or the source's key (re-reads the example on resume)
    duration: float
    num_tokens: int
    example: dict | None  # streamed sources: the example read; list sources: None (indexed by key)


# --- batch sizes ---------------------------------------------------------------------------------


class _BatchLimit:
    """The batch size of each bucket, from exactly one rule, and the bucket of each example.

    batch_size: the same for every bucket. max_duration: n * d <= max_duration with d the bucket's
    duration bound; a bucket that reaches past the limit still takes batches of 1 of its examples
    up to the limit. batch_sizes: one per bucket, flat or nested like bins.tokens (oom.py). An
    example no batch can hold (longer than max_duration, or in a bucket of size 0) is dropped as
    OVER_LIMIT, as Lhotse's duration filter drops it.
    """

    def __init__(self, bins: Bins, allocate: Allocator, batch_size, max_duration, batch_sizes):
        if sum(x is not None for x in (batch_size, max_duration, batch_sizes)) != 1:
            raise ValueError("give exactly one of batch_size, max_duration, batch_sizes")
        self.allocate, self.max_duration = allocate, max_duration
        self.bounds = bins.buckets()  # (duration bound, token bound) of each bucket
        if batch_size is not None:
            self.sizes = [int(batch_size)] * len(self.bounds)
            self.name = f"batch_size={batch_size} (train.batch_size)"
        elif batch_sizes is not None:
            self.name = "batch_sizes (train.batch_sizes)"
            nested = isinstance(batch_sizes[0], (list, tuple))
            self.sizes = [int(s) for row in batch_sizes for s in row] if nested else [int(s) for s in batch_sizes]
            if len(self.sizes) != len(self.bounds):
                raise ValueError(f"batch_sizes has {len(self.sizes)} entries for {len(self.bounds)} buckets")
        else:
            self.sizes = [self._fit(d) for d, _ in self.bounds]
            self.name = f"max_duration={max_duration:g} (train.max_duration)"
        for b, s in enumerate(self.sizes):
            if s < 0:
                d, t = self.bounds[b]
                raise ValueError(f"bucket {b} (<= {d} s, <= {t} tokens) gets batch size {s} from {self.name}")
        if not any(self.sizes):
            raise ValueError(f"{self.name} gives every bucket batch size 0, so no example fits a batch (the "
                             f"shortest bucket holds up to {self.bounds[0][0]:g} s): raise the limit")

    def _fit(self, d: float) -> int:
        """The batch size of a bucket with duration bound d under max_duration."""
        n = int(self.max_duration // d)
        while n * d > self.max_duration:  # guard against float rounding in //
            n -= 1
        lower = max((d2 for d2, _ in self.bounds if d2 < d), default=0.0)
        return n if n or lower >= self.max_duration else 1  # 1: its examples up to the limit, alone

    def bucket(self, d: float, n: int):
        """The example's bucket, or why it is dropped."""
        a = self.allocate(d, n)
        if a.__class__ is int and (not self.sizes[a] or (self.max_duration is not None and d > self.max_duration)):
            return OVER_LIMIT
        return a

    def why(self) -> str:
        """What no batch can hold, and why, for the over-limit messages."""
        if self.max_duration is not None:
            return f"{self.name} holds examples of up to {self.max_duration:.2f} s"
        bounds = [self.bounds[b][0] for b, k in enumerate(self.sizes) if not k]
        span = f"bound {bounds[0]:g} s" if bounds[0] == bounds[-1] else f"bounds {bounds[0]:g}-{bounds[-1]:g} s"
        return f"{self.name} gives {len(bounds)} of {len(self.sizes)} buckets (duration {span}) batch size 0"


# --- sources -------------------------------------------------------------------------------------


def _measure(ex, where: str) -> tuple:
    """(duration, num_tokens) of an example; `where` names it in errors."""
    if not isinstance(ex, dict):
        raise ValueError(f"{where}: expected a dict example, got {type(ex).__name__}")
    try:
        d = float(ex["duration"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{where}: field 'duration' missing or not a number: {ex.get('duration')!r}") from None
    if "num_tokens" not in ex:
        raise ValueError(f"{where}: no 'num_tokens' field (output tokens, prompt included)")
    return d, int(ex["num_tokens"])


class _ListSource:
    """An in-memory list of examples, measured and allocated once: every rank then knows every
    example's bucket, which gives exact bucket weights and every rank's batch count in advance.
    A pass is a seeded permutation of the list; rank r reads every world_size-th example of it."""

    def __init__(self, examples, limit: _BatchLimit, seed: int, warn: bool):
        self.examples, self.sizes, self.seed = examples, limit.sizes, seed
        meas = [_measure(ex, f"examples[{i}]") for i, ex in enumerate(examples)]
        self.where = [limit.bucket(d, n) for d, n in meas]  # bucket, or why it is dropped
        self.entries = [Entry(i, d, n, None) for i, (d, n) in enumerate(meas)]
        self.durations = np.array([d for d, _ in meas])
        self.weights = np.array([float(ex.get("weight", 1.0)) for ex in examples])
        if len(self.weights) and not (np.isfinite(self.weights).all() and (self.weights >= 0).all()):
            i = int(np.flatnonzero(~(np.isfinite(self.weights) & (self.weights >= 0)))[0])
            raise ValueError(f"examples[{i}]: weight must be a finite number >= 0, got {self.weights[i]}")
        self.weighted = bool((self.weights != 1.0).any())
        self.alloc = np.array([a if isinstance(a, int) else -1 for a in self.where], dtype=np.int64)
        ok = self.alloc >= 0
        self.counts = np.bincount(self.alloc[ok], weights=self.weights[ok], minlength=len(self.sizes))
        self._targets = {}
        over = [d for (d, _), a in zip(meas, self.where) if a == OVER_LIMIT]
        if over and not (self.alloc >= 0).any():
            raise ValueError(f"no example fits a batch: {limit.why()}, and the shortest of the "
                             f"{len(over)} that fit a bucket lasts {min(over):.2f} s: raise the limit")
        if over and warn:
            log.warning("sampler: dropping %d of %d examples (the longest %.2f s) because no batch can hold "
                        "them: %s; raise it to train on them", len(over), len(meas), max(over), limit.why())

    def _permutation(self, epoch: int, pass_idx: int) -> np.ndarray:
        """The pass's examples in order: a seeded permutation of the list. An example of weight w
        comes floor(w) times, and once more for a fraction frac(w) of the examples of that weight,
        drawn anew each pass, so a down-weighted group shows all its examples over the passes."""
        rng = np.random.default_rng(_seed(self.seed, epoch, pass_idx, 3))
        if not self.weighted:
            return rng.permutation(len(self.entries))
        copies = np.floor(self.weights).astype(np.int64)
        frac = self.weights - copies
        for value in np.unique(frac[frac > 0]):
            members = np.flatnonzero(frac == value)
            copies[rng.choice(members, size=round(value * len(members)), replace=False)] += 1
        return rng.permutation(np.repeat(np.arange(len(self.entries)), copies))

    def order(self, epoch: int, pass_idx: int, skip, rank: int, world_size: int, max_seconds=None) -> np.ndarray:
        """The examples `rank` reads in this pass, in order: its share of the pass's permutation,
        without those longer than max_seconds and those `skip` marks as used before a change of
        world size (every copy of them, when weights repeat an example in the pass)."""
        perm = self._permutation(epoch, pass_idx)
        if max_seconds is not None:
            perm = perm[self.durations[perm] <= max_seconds]
        if skip is not None and skip[0] == pass_idx:
            used = np.unpackbits(np.frombuffer(skip[1], dtype=np.uint8), count=len(self.entries)).astype(bool)
            perm = perm[~used[perm]]
        return perm[rank::world_size]

    def read(self, epoch, pass_idx, cursor, skip, rank, world_size, max_seconds=None):
        """Yields (cursor after it, bucket or drop reason, entry) for this rank's share of a pass;
        the cursor is the position in `order`."""
        start, where, entries = cursor or 0, self.where, self.entries
        order = self.order(epoch, pass_idx, skip, rank, world_size, max_seconds)
        for pos, i in enumerate(order[start:].tolist(), start=start + 1):
            yield pos, where[i], entries[i]

    def target(self, epoch: int, world_size: int) -> int:
        """The most batches any rank makes of its share of the epoch (its buckets' ceil(n / batch
        size) summed): every rank yields that many (`_even_out`)."""
        if (epoch, world_size) not in self._targets:
            alloc = self.alloc[self._permutation(epoch, 0)]  # bucket of each position of the pass
            rank_of = np.arange(len(alloc)) % world_size
            ok = alloc >= 0
            nb = len(self.sizes)
            cells = np.bincount(rank_of[ok] * nb + alloc[ok], minlength=world_size * nb)
            per_rank = -(-cells.reshape(world_size, nb) // np.maximum(self.sizes, 1))  # ceil(n / batch size)
            self._targets = {(epoch, world_size): int(per_rank.sum(axis=1).max())}
        return self._targets[epoch, world_size]

    def entry(self, key, duration: float, num_tokens: int) -> Entry:
        return Entry(key, duration, num_tokens, None)

    def batch(self, entries: list, indices: bool) -> list:
        return [e.key for e in entries] if indices else [self.examples[e.key] for e in entries]


class _StreamSource:
    """A streamed source (protocol in the module docstring), measured as it is read. Bucket
    weights come from the bins' sampled counts, if any."""

    def __init__(self, source, limit: _BatchLimit, bins: Bins, seed: int, rank: int):
        self.source, self.limit, self.seed, self.rank = source, limit, seed, rank
        self.counts = np.array([c for row in bins.counts for c in row], np.float64) + 1 if bins.counts else None
        self._warned = False

    def read(self, epoch, pass_idx, cursor, skip, rank, world_size, max_seconds=None):
        """Yields (cursor after it, bucket or drop reason, entry) for this rank's share of a pass.
        skip and max_seconds are for lists only (regrouping and short_first need one)."""
        for key, cur, ex in self.source.read(_seed(self.seed, epoch, pass_idx, 3), rank, world_size, cursor):
            d, n = _measure(ex, self.source.describe(key))
            yield cur, self.limit.bucket(d, n), Entry(key, d, n, ex)

    def warn_over_limit(self, entry: Entry) -> None:
        """Names the first example no batch can hold; later ones are only counted."""
        if not self._warned:
            self._warned = True
            log.warning("sampler: rank %d dropped %s (%.2f s) because no batch can hold it: %s; raise it "
                        "to train on such examples (later ones are only counted, in stats['drops'])",
                        self.rank, self.source.describe(entry.key), entry.duration, self.limit.why())

    def entry(self, key, duration: float, num_tokens: int) -> Entry:
        key = tuple(key)  # JSON turns tuples into lists
        return Entry(key, duration, num_tokens, self.source.get(key))

    def batch(self, entries: list, indices: bool) -> list:
        return [e.example for e in entries]


class _Inline:
    """Reads the item stream in the caller's thread."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return self.items

    def close(self):
        self.items.close()


class _Producer:
    """Reads the item stream in a daemon thread into a bounded deque. Both sides sleep on one
    condition variable and wake each other only when the other is waiting: no polling interval.
    Items keep source order, so the consumer sees the same sequence as `_Inline`. A producer error
    is re-raised in the consumer at the point where the failing item would have been read."""

    def __init__(self, items, capacity: int):
        self.items, self.capacity = items, max(1, capacity)
        self.queue = deque()
        self.cond = threading.Condition()
        self.done = self.stop = self.consumer_waiting = self.producer_waiting = False
        self.error = None
        self.thread = threading.Thread(target=self._run, name="sampler-producer", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for item in self.items:
                with self.cond:
                    while len(self.queue) >= self.capacity and not self.stop:
                        self.producer_waiting = True
                        self.cond.wait()
                    self.producer_waiting = False
                    if self.stop:
                        break
                    self.queue.append(item)
                    if self.consumer_waiting:
                        self.cond.notify()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, who re-raises it
            self.error = e
        finally:
            self.items.close()
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def __iter__(self):
        return self

    def __next__(self):
        with self.cond:
            while not self.queue and not self.done:
                self.consumer_waiting = True
                self.cond.wait()
            self.consumer_waiting = False
            if self.queue:
                item = self.queue.popleft()
                if self.producer_waiting:
                    self.cond.notify()
                return item
            if self.error is not None:
                raise self.error
            raise StopIteration

    def close(self):
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        # A read blocked inside the source may outlast this; the thread is a daemon, so it can
        # never keep the interpreter alive.
        self.thread.join(timeout=5.0)


# --- state ---------------------------------------------------------------------------------------


def _rng(state) -> random.Random:
    r = random.Random()
    r.setstate((state[0], tuple(state[1]), state[2]))  # JSON turns the middle tuple into a list
    return r


@dataclass
class _State:
    """Everything that determines the remaining batches of an epoch (or of an infinite run), and
    the one place that knows its saved form (`to_dict` / `from_dict`, the checkpoint format)."""

    epoch: int
    data_rng: random.Random  # per rank: which examples of a bucket form a batch
    select_rng: random.Random  # shared by all ranks when sync_buckets: which bucket
    stats: dict  # the sampler's running totals (`BucketingSampler.stats`); drops are counted here only
    target: int | None = None  # batches every rank yields this epoch (finite in-memory lists)
    pass_idx: int = 0  # source pass; infinite mode starts a reshuffled pass when one ends
    cursor: object = None  # source position after the last example taken (None: pass start)
    queues: list = field(default_factory=list)  # per bucket: a list of Entry
    occupancy: int = 0
    ready: int = 0  # buckets holding at least one full batch
    batches: int = 0  # batches yielded so far in this epoch
    exhausted: bool = False
    drain: list | None = None  # per bucket: the remaining batches once the source is exhausted
    drops_before: dict = field(default_factory=dict)  # stats["drops"] when this epoch began
    skip: tuple | None = None  # (pass, packed bitmask of examples) used in that pass before a world-size change
    full_from: int | None = None  # short_first: the first pass that reads every example (None: not yet)

    def epoch_drops(self) -> dict:
        """Drops of this epoch by reason: the running counts less those of earlier epochs."""
        before = self.drops_before
        return {r: n - before.get(r, 0) for r, n in self.stats["drops"].items() if n > before.get(r, 0)}

    def copy(self) -> "_State":
        """A copy that later batches of this state leave unchanged."""
        c = copy.copy(self)
        c.queues = [list(q) for q in self.queues]
        c.drain = None if self.drain is None else [list(bb) for bb in self.drain]  # planned batches are never modified
        c.data_rng, c.select_rng = random.Random(), random.Random()
        c.data_rng.setstate(self.data_rng.getstate())
        c.select_rng.setstate(self.select_rng.getstate())
        c.stats = copy.deepcopy(self.stats)  # drops_before is replaced, never modified: shared
        return c

    def to_dict(self, fingerprint: dict) -> dict:
        """Plain data (lists, numbers, the skip mask's bytes). Queued examples are saved as
        [key, duration, num_tokens]; `from_dict` re-reads the example itself by its key."""

        def pack(entries):
            return [[e.key, e.duration, e.num_tokens] for e in entries]

        return {
            "fingerprint": fingerprint,
            "epoch": self.epoch, "target": self.target, "pass_idx": self.pass_idx, "cursor": self.cursor,
            "batches": self.batches, "exhausted": self.exhausted,
            "queues": [pack(q) for q in self.queues],
            "drain": None if self.drain is None else [[pack(x) for x in bb] for bb in self.drain],
            "data_rng": self.data_rng.getstate(), "select_rng": self.select_rng.getstate(),
            "stats": copy.deepcopy(self.stats), "drops": self.epoch_drops(), "skip": self.skip,
            "full_from": self.full_from,
        }

    @classmethod
    def from_dict(cls, sd: dict, sizes: list, entry) -> "_State":
        """The state `to_dict` saved (its fingerprint is the caller's to check). entry(key, duration,
        num_tokens) -> Entry rebuilds a queued example; sizes are the buckets' batch sizes."""

        def unpack(es):
            return [entry(key, d, n) for key, d, n in es]

        stats = copy.deepcopy(sd["stats"])
        epoch_drops = sd["drops"]
        st = cls(epoch=sd["epoch"], data_rng=_rng(sd["data_rng"]), select_rng=_rng(sd["select_rng"]), stats=stats,
                 target=sd["target"], pass_idx=sd["pass_idx"], cursor=sd["cursor"], batches=sd["batches"],
                 exhausted=sd["exhausted"], queues=[unpack(q) for q in sd["queues"]],
                 drain=None if sd["drain"] is None else [[unpack(x) for x in bb] for bb in sd["drain"]],
                 drops_before={r: n - epoch_drops.get(r, 0) for r, n in stats["drops"].items()},
                 skip=sd.get("skip"), full_from=sd.get("full_from"))  # a saved state may lack these two: None
        st.occupancy = sum(map(len, st.queues))
        st.ready = sum(0 < k <= len(q) for q, k in zip(st.queues, sizes))
        return st


class _Snapshots:
    """Copies of the state at the start of an iteration and every EVERY batches (the last few):
    `state_dict(rewind=k)` replays forward from the latest one at least k batches back, for the
    batches a DataLoader prefetched that the trainer never used."""

    EVERY = 100

    def __init__(self):
        self.copies = deque(maxlen=3)

    def start(self, st: _State) -> None:
        self.copies.clear()
        self.copies.append(st.copy())

    def after_batch(self, st: _State) -> None:
        if st.batches % self.EVERY == 0:
            self.copies.append(st.copy())

    def latest(self, batches: int) -> _State | None:
        """A copy of the latest snapshot taken at or before `batches` batches, if any."""
        snaps = [s for s in self.copies if s.batches <= batches]
        return snaps[-1].copy() if snaps else None


# --- the bucket buffer ---------------------------------------------------------------------------


class _BucketBuffer:
    """Per-bucket queues (kept in the `_State`) holding up to `size` examples read from the source.

    Sampling starts once `start_fill` of the buffer is read, and the fill target then grows by
    `fill_ramp` of it per batch. The schedule is fixed, so with a producer thread the batches are
    exactly those of the single-threaded run, whatever the thread timing.
    """

    def __init__(self, sizes: list, size: int, start_fill: float, fill_ramp: float, overfill: float,
                 warn_over_limit=None):
        if overfill < 1:
            raise ValueError(f"overfill must be >= 1, got {overfill}")
        self.sizes, self.size, self.overfill = sizes, size, overfill
        self.start = max(1, int(start_fill * size))
        self.ramp = max(1, int(fill_ramp * size))
        self.warn_over_limit = warn_over_limit  # called with each over-limit drop (streams)
        self._warned_full = False

    def ramped(self, batches: int) -> bool:
        """Whether the fill target has reached the buffer size."""
        return self.start + batches * self.ramp >= self.size

    def fill(self, st: _State, reader, drawn: int) -> None:
        """Moves examples from the reader into the queues until the fill target is buffered and the
        drawn bucket holds a full batch, reading on past the target for it up to `overfill` x the
        target (the first batch: only the target, which keeps time-to-first-batch short). Beyond
        that bound, or when the source ends, the caller falls back to the nearest bucket with a
        batch. Drops are counted here. Runs once per example, hence the locals."""
        want = min(self.size, self.start + st.batches * self.ramp)
        cap = want if st.batches == 0 else int(self.overfill * want)
        queues, sizes, occ, ready = st.queues, self.sizes, st.occupancy, st.ready
        mine, k = queues[drawn], sizes[drawn]
        if occ >= want and ready and (len(mine) >= k or occ >= cap):
            return
        for item in reader:
            st.pass_idx, st.cursor, b, entry = item
            if b.__class__ is str:
                st.stats["drops"][b] = st.stats["drops"].get(b, 0) + 1
                if b == OVER_LIMIT and self.warn_over_limit is not None:
                    self.warn_over_limit(entry)
                continue
            q = queues[b]
            q.append(entry)
            occ += 1
            ready += len(q) == sizes[b]
            if occ >= want and ready and (len(mine) >= k or occ >= cap):
                break
            if occ == cap and not ready and not self._warned_full:
                self._warned_full = True
                log.warning("sampler: buffer full (%d) but no bucket has a full batch; reading on", occ)
        else:
            st.exhausted = True
        st.occupancy, st.ready = occ, ready

    def take(self, st: _State, b: int) -> list:
        """A random full batch from bucket b's queue."""
        q, k, rand = st.queues[b], self.sizes[b], st.data_rng.random
        for t in range(len(q) - 1, len(q) - 1 - k, -1):  # partial Fisher-Yates: O(batch size)
            j = int(rand() * (t + 1))
            q[j], q[t] = q[t], q[j]
        batch = q[len(q) - k :]
        del q[len(q) - k :]
        st.occupancy -= k
        st.ready -= len(q) < k
        return batch

    def cut(self, st: _State) -> list:
        """Empties the queues into batches, per bucket; the last one of a bucket may be short."""
        drain = []
        for q, k in zip(st.queues, self.sizes):
            st.data_rng.shuffle(q)
            drain.append([q[i : i + k] for i in range(0, len(q), k)] if k else [])  # size 0: always empty
        st.queues, st.occupancy, st.ready = [[] for _ in self.sizes], 0, 0
        return drain


def _nearest(b: int, n: int, ok) -> int:
    """The bucket nearest to b among n for which ok(bucket) holds (b first, then lower first)."""
    for dist in range(n):
        for c in (b - dist, b + dist):
            if 0 <= c < n and ok(c):
                return c
    raise AssertionError("no bucket has a batch")


def _even_out(drain: list, batches: int, target: int | None, rank: int) -> list:
    """Splits the largest remaining batches until this rank yields `target` batches in the epoch,
    as many as the rank with the most (`_ListSource.target`): all ranks then take the same number
    of steps and every example is still used once. A stream cannot count ahead (target None)."""
    if target is None:
        return drain
    have = batches + sum(map(len, drain))
    assert have <= target, f"rank {rank} would yield {have} batches > target {target}"
    for _ in range(target - have):
        lens = [(len(x), b, i) for b, bb in enumerate(drain) for i, x in enumerate(bb)]
        n, b, i = max(lens, default=(0, 0, 0))
        if n < 2:
            raise RuntimeError(f"rank {rank}: too few examples left to match the {target} batches "
                               "of the other ranks; use fewer ranks or more data")
        batch = drain[b][i]
        drain[b][i] = batch[: n // 2]
        drain[b].append(batch[n // 2 :])
    return drain


# --- curricula and rank agreement ----------------------------------------------------------------


class _Curriculum:
    """Epoch 0's optional start, the same on every rank.

    sortagrad (Amodei et al., 2016): over the first pass the bucket draw becomes a quantile walk
    that takes each bucket in turn, shortest first, for as many batches as its share of the data.
    short_first=(seconds, batches): the first `batches` batches read only the examples up to
    `seconds` long (passes over them repeat), drawn from the buckets that can hold them; then the
    pass being read is left and the next one reads everything.
    """

    def __init__(self, sortagrad: bool, short_first, bins: Bins, cum_weights: list, pass_batches,
                 durations=None):
        """pass_batches: batches of one pass on one rank (None: unknown); durations: those of the
        usable examples where short_first can work (an in-memory infinite source read in the
        caller's thread), else None."""
        self.sortagrad, self.short_first, self.pass_batches = sortagrad, short_first, pass_batches
        if short_first is not None:
            if durations is None:
                raise ValueError("short_first needs an in-memory list source in infinite, non-concurrent mode")
            if not (durations <= short_first[0]).any():
                raise ValueError(f"short_first: no usable example lasts {short_first[0]} s or less (the shortest: "
                                 f"{durations.min():.2f} s)")
            # The draws go to the buckets that can hold the short examples.
            holds = bins.durations[min(bisect_left(bins.durations, short_first[0]), len(bins.durations) - 1)]
            open_buckets = sum(1 for d, _ in bins.buckets() if d <= holds)
            self.short_share = cum_weights[min(open_buckets, len(cum_weights)) - 1]
        if sortagrad and pass_batches is None:
            raise ValueError("sortagrad needs to know how many batches a pass makes: give a list source or "
                             "bins with counts")

    def draw(self, u: float, st: _State) -> float:
        """The shared uniform draw u, moved to where this batch's bucket should come from."""
        if self.short_first is not None and st.epoch == 0 and st.batches < self.short_first[1]:
            u *= self.short_share
        if self.sortagrad and st.epoch == 0 and st.batches < self.pass_batches:
            u = (st.batches + 0.5) / self.pass_batches
        return u

    def max_seconds(self, st: _State, pass_idx: int) -> float | None:
        """The longest example this pass reads (None: every one)."""
        if self.short_first is None or st.epoch != 0 or (st.full_from is not None and pass_idx >= st.full_from):
            return None
        return self.short_first[0]

    def short_done(self, st: _State) -> bool:
        return st.batches >= self.short_first[1]


class _Agreement:
    """How often this rank could take the bucket drawn for all ranks (sync_buckets). Ranks miss
    independently, so all R of them take it on about rate^R of the steps, and a DDP step waits for
    the slowest rank: one warning when that falls below WARN, with the buffer_size that fixes it."""

    WINDOW = 500  # steps over which the rate is measured
    WARN = 0.9
    SUPPLY_MARGIN = 3.5  # buffer needed / expected reads per batch, fitted in bench/sync_bench.py

    def __init__(self, rank: int, world_size: int, enabled: bool, buffer: _BucketBuffer, counts, cum_weights):
        self.rank, self.world_size, self.enabled = rank, world_size, enabled
        self.buffer, self.cum_weights = buffer, cum_weights
        self.hits, self.num_hits, self.warned = deque(maxlen=self.WINDOW), 0, False
        # Examples to read for one full batch of each bucket at its share of the data.
        n = len(buffer.sizes)
        share = counts / counts.sum() if counts is not None and counts.sum() > 0 else np.full(n, 1 / n)
        self.supply = np.array(buffer.sizes) / np.maximum(share, 1e-12)

    @property
    def rate(self) -> float:
        return self.num_hits / len(self.hits)

    def track(self, hit: bool, occupancy: int) -> None:
        if not self.enabled:
            return
        w = self.hits
        if len(w) == w.maxlen:
            self.num_hits -= w[0]
        w.append(hit)
        self.num_hits += hit
        rate, ranks = self.rate, self.world_size
        if len(w) == w.maxlen and rate**ranks < self.WARN and not self.warned:
            self.warned = True
            log.warning("sampler: rank %d took the drawn bucket on %.1f%% of the last %d steps, so %d ranks agree "
                        "on about %.0f%% (buffer_size %d, %d examples held); buffer_size=%d should give %.0f%%",
                        self.rank, 100 * rate, len(w), ranks, 100 * rate**ranks, self.buffer.size, occupancy,
                        self.suggested_buffer_size(self.WARN), 100 * self.WARN)

    def suggested_buffer_size(self, agreement: float) -> int:
        """A buffer_size at which all ranks take the drawn bucket on about `agreement` of the steps:
        each rank must supply the buckets drawn agreement^(1/R) of the time, and bucket b needs
        about batch size / its share of the data examples read to gather one batch."""
        p = np.diff(self.cum_weights, prepend=0.0)
        order = np.argsort(self.supply)
        covered = np.cumsum(p[order])
        share = agreement ** (1 / self.world_size)
        need = self.supply[order][min(int(np.searchsorted(covered, share)), len(order) - 1)]
        return int(math.ceil(self.SUPPLY_MARGIN * need / self.buffer.overfill / 100) * 100)


# --- stats ---------------------------------------------------------------------------------------


def _new_stats() -> dict:
    return {"batches": 0, "examples": 0, "duration": 0.0, "padded_duration": 0.0,
            "tokens": 0, "padded_tokens": 0, "drops": {}}


def _record(stats: dict, bucket: int, batch: list) -> dict:
    """Adds a batch to the running totals; returns its `last_batch_info`."""
    n = len(batch)
    durs, toks = [e.duration for e in batch], [e.num_tokens for e in batch]
    dmax, tmax, dsum, tsum = max(durs), max(toks), sum(durs), sum(toks)
    stats["batches"] += 1
    stats["examples"] += n
    stats["duration"] += dsum
    stats["padded_duration"] += n * dmax
    stats["tokens"] += tsum
    stats["padded_tokens"] += n * tmax
    return {"bucket": bucket, "size": n, "max_duration": dmax, "max_tokens": tmax,
            "audio_padding": 1 - dsum / (n * dmax), "text_padding": 1 - tsum / (n * tmax) if tmax else 0.0,
            "number": stats["batches"]}


# --- the sampler ---------------------------------------------------------------------------------


class BucketingSampler:
    """Yields batches (list[int] with yield_indices, else list[dict]) from bucketed examples.

    source: a list of example dicts (map-style) or a streamed source (module docstring); examples
    need `duration` and `num_tokens` (prompt included). Give exactly one of batch_size /
    max_duration / batch_sizes. Rank and world size default to torch.distributed's when a process
    group is initialized. After each yield, `last_batch_info` describes that batch (bucket, size,
    max lengths, padding ratios, and its number: batches this rank's sampler yielded so far, kept
    in the state, so a resumed run numbers its batches as the uninterrupted one did); behind a
    prefetching DataLoader it runs ahead of the trainer, `stats` likewise. A new iteration continues an unfinished one; a finished epoch restarts
    unless `set_epoch`.

    Each step draws a bucket from an RNG seeded by (seed, epoch) only, so with sync_buckets every
    rank draws the same one with no inter-process traffic, weighted by each bucket's expected
    number of batches. The rank reads on until the drawn bucket has a batch (`_BucketBuffer.fill`)
    and falls back to the nearest bucket with one only beyond that, or at the end of the data (the
    paper's fallback): stopping at the first bucket with a batch would let ranks disagree on most
    steps with small buffers.
    """

    def __init__(
        self,
        source,
        bins: Bins,
        *,
        batch_size: int | None = None,
        max_duration: float | None = None,
        batch_sizes: list | None = None,
        allocation: str = "flexible",  # or "strict" (drops what its duration bin's token bins can't hold)
        min_tps=None,  # tokens/s limits, scalar or one per duration bin (e.g. bins.max_tps)
        max_tps=None,
        buffer_size: int = 20000,  # examples held in the bucket queues; more = more random batches
        start_fill: float = 0.1,  # fraction of the buffer read before the first batch (paper: 10%)
        fill_ramp: float = 0.01,  # fraction of the buffer the fill target grows by per batch
        overfill: float = 4.0,  # read on for the drawn bucket up to this x the fill target (1: the paper's)
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        sync_buckets: bool = True,  # same bucket on every rank at each step (paper sec. 2)
        concurrent: bool | None = None,  # producer thread; default: on for streamed sources
        infinite: bool = False,  # endless reshuffled passes, for step-based training
        yield_indices: bool = False,  # list sources: batches of indices, for DataLoader(batch_sampler=)
        sortagrad: bool = False,  # epoch 0's first pass walks the buckets from shortest to longest
        short_first: tuple | None = None,  # (seconds, batches): the first batches hold only examples up to that long
    ):
        self.bins, self.is_list = bins, isinstance(source, (list, tuple))
        if yield_indices and not self.is_list:
            raise ValueError("yield_indices needs an in-memory list source (map-style dataset)")
        self.rank, self.world_size = _dist_info(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world_size {self.world_size}")
        self.seed, self.sync_buckets, self.infinite, self.yield_indices = seed, sync_buckets, infinite, yield_indices
        self.sortagrad, self.short_first = sortagrad, short_first
        self.concurrent = (not self.is_list) if concurrent is None else concurrent
        self.allocate = Allocator(bins, allocation, min_tps, max_tps)
        self.limit = _BatchLimit(bins, self.allocate, batch_size, max_duration, batch_sizes)
        self.sizes = self.limit.sizes
        if not self.is_list and not infinite and self.world_size > 1:
            log.warning("sampler: a finite streamed source cannot equalize batch counts across ranks; "
                        "use infinite=True for DDP training (docs/sampler.md)")
        if self.is_list:
            self.data = _ListSource(source, self.limit, seed, warn=self.rank == 0)
        else:
            self.data = _StreamSource(source, self.limit, bins, seed, self.rank)
        self.buffer = _BucketBuffer(self.sizes, buffer_size, start_fill, fill_ramp, overfill,
                                    None if self.is_list else self.data.warn_over_limit)
        usable = np.array(self.sizes) > 0
        counts = None if self.data.counts is None else np.where(usable, self.data.counts, 0.0)  # size 0: no batch
        # Weight = expected batches per bucket, so draws follow how fast each bucket fills up.
        w = counts / np.maximum(self.sizes, 1) if counts is not None and counts.sum() > 0 else usable.astype(float)
        self.cum_weights = list(accumulate((w / w.sum()).tolist()))
        pass_batches = float(w.sum()) / self.world_size if counts is not None else None
        short_ok = self.is_list and infinite and not self.concurrent
        self.curriculum = _Curriculum(sortagrad, short_first, bins, self.cum_weights, pass_batches,
                                      self.data.durations[self.data.alloc >= 0] if short_ok else None)
        self._agreement = _Agreement(self.rank, self.world_size, sync_buckets and self.world_size > 1,
                                     self.buffer, counts, self.cum_weights)
        self.epoch = 0
        self._stats = _new_stats()
        self._live = self._pending = self.last_batch_info = None  # the state being iterated / restored
        self._snapshots = _Snapshots()

    # --- epochs, length, telemetry

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next iteration yields. A state restored by `load_state_dict` for
        this same epoch is kept, so `load_state_dict(sd); set_epoch(sd_epoch); iter()` resumes."""
        self.epoch, self._live = epoch, None
        if self._pending is not None and self._pending.epoch != epoch:
            self._pending = None

    def __len__(self) -> int:
        if not self.is_list or self.infinite:
            raise TypeError("the number of batches is only known for finite in-memory list sources")
        return self.data.target(self.epoch, self.world_size)

    @property
    def stats(self) -> dict:
        """Running totals of this rank: batches, examples, element-weighted padding, drops by reason."""
        s = copy.deepcopy(self._stats)
        s["audio_padding"] = 1 - s["duration"] / s["padded_duration"] if s["padded_duration"] else 0.0
        s["text_padding"] = 1 - s["tokens"] / s["padded_tokens"] if s["padded_tokens"] else 0.0
        return s

    def suggested_buffer_size(self, agreement: float = _Agreement.WARN) -> int:
        """A buffer_size at which all ranks take the drawn bucket on about `agreement` of the steps."""
        return self._agreement.suggested_buffer_size(agreement)

    # --- iteration

    def _fresh_state(self) -> _State:
        e, sel = self.epoch, 0 if self.sync_buckets else self.rank + 1
        return _State(
            epoch=e,
            data_rng=random.Random(_seed(self.seed, e, self.rank + 1, 1)),
            select_rng=random.Random(_seed(self.seed, e, sel, 2)),
            stats=self._stats,
            target=self.data.target(e, self.world_size) if self.is_list and not self.infinite else None,
            queues=[[] for _ in self.sizes],
            drops_before=dict(self._stats["drops"]),
        )

    def _examples(self, st: _State):
        """Yields (pass, cursor, bucket or drop reason, entry) in source order, for this rank, from
        where `st` stands; pass after reshuffled pass when infinite."""
        pass_idx, cursor = st.pass_idx, st.cursor
        while True:
            short = self.curriculum.max_seconds(st, pass_idx)
            used = 0
            for cur, b, entry in self.data.read(st.epoch, pass_idx, cursor, st.skip, self.rank, self.world_size,
                                                short):
                if short is not None and self.curriculum.short_done(st):
                    st.full_from = pass_idx + 1  # leave this pass: the next reads everything
                    break
                used += b.__class__ is int
                yield pass_idx, cur, b, entry
            else:
                if not self.infinite:
                    return
                if not used and cursor is None:
                    raise ValueError(f"rank {self.rank}: a full pass over the source gave no usable example")
            pass_idx, cursor = pass_idx + 1, None

    def _reader(self, st: _State, threaded: bool):
        items = self._examples(st)
        return _Producer(items, self.buffer.size) if threaded else _Inline(items)

    def _next_batch(self, st: _State, reader):
        """Advances the state by one batch; returns (bucket, entries) or None at the epoch end."""
        if st.drain is not None and not any(st.drain):
            return None
        # One draw per batch on every rank keeps the shared selection RNG aligned across ranks.
        u = self.curriculum.draw(st.select_rng.random(), st)
        drawn = min(bisect_right(self.cum_weights, u), len(self.sizes) - 1)
        if not st.exhausted:
            self.buffer.fill(st, reader, drawn)
        if st.exhausted and st.drain is None:
            st.drain = _even_out(self.buffer.cut(st), st.batches, st.target, self.rank)
            if not any(st.drain):
                return None
        if st.drain is not None:
            b = _nearest(drawn, len(self.sizes), lambda c: len(st.drain[c]) > 0)
            batch = st.drain[b].pop()
        else:
            b = _nearest(drawn, len(self.sizes), lambda c: 0 < self.sizes[c] <= len(st.queues[c]))
            if self.buffer.ramped(st.batches):  # during the ramp, misses are the ramp's, not the buffer size's
                self._agreement.track(b == drawn, st.occupancy)
            batch = self.buffer.take(st, b)
        st.batches += 1
        return b, batch

    def __iter__(self):
        st = self._pending or self._live or self._fresh_state()
        if st is self._live and st.drain is not None and not any(st.drain):
            st = self._fresh_state()  # a finished epoch iterated again: same epoch from the start
        self._pending, self._live = None, st
        self._snapshots.start(st)
        reader = self._reader(st, self.concurrent and not st.exhausted)
        try:
            while (out := self._next_batch(st, reader)) is not None:
                b, batch = out
                self.last_batch_info = _record(st.stats, b, batch)
                self._snapshots.after_batch(st)
                yield self.data.batch(batch, self.yield_indices)
        finally:
            reader.close()
        if drops := st.epoch_drops():
            log.warning("sampler: rank %d epoch %d dropped %s", self.rank, st.epoch, drops)

    # --- checkpointing

    def _fingerprint(self) -> dict:
        return {"durations": self.bins.durations, "tokens": self.bins.tokens, "batch_sizes": self.sizes,
                "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "sync_buckets": self.sync_buckets, "infinite": self.infinite, "sortagrad": self.sortagrad,
                "short_first": self.short_first}

    def state_dict(self, rewind: int = 0) -> dict:
        """State after the last yielded batch. rewind=k gives the state k batches earlier, for
        when a DataLoader prefetched k batches the trainer never used (k <= 200 always works)."""
        st = self._live or self._pending or self._fresh_state()
        if rewind:
            goal = st.batches - rewind
            snap = self._snapshots.latest(goal) if self._live is not None and goal >= 0 else None
            if snap is None:
                raise ValueError(f"cannot rewind {rewind} batches from batch {st.batches}: no snapshot that far back")
            st = snap
            reader = self._reader(st, threaded=False)
            while st.batches < goal:
                _record(st.stats, *self._next_batch(st, reader))
            reader.close()
        return st.to_dict(self._fingerprint())

    def load_state_dict(self, sd: dict) -> None:
        """Restores a state; the next iteration continues exactly where it was taken."""
        mine = self._fingerprint()
        for k, v in sd["fingerprint"].items():
            if json.loads(json.dumps(v)) != json.loads(json.dumps(mine[k])):
                raise ValueError(f"sampler state was saved with {k}={v!r}, this sampler has {mine[k]!r}")
        st = _State.from_dict(sd, self.sizes, self.data.entry)
        self.epoch, self._stats = st.epoch, st.stats
        self._pending, self._live = st, None

    def regroup_state(self, states: list[dict]) -> dict:
        """A state for this rank that continues `states`, saved by every rank of a run with another
        world size. In-memory infinite samplers only (what train.py uses for manifests).

        The new ranks split what the old ones had not yet read of the current pass; examples waiting
        in the old bucket queues (read, not yet trained) go back into it. So within that pass no
        example is trained twice and none is left out, except the rest of the pass of an old rank
        that was still finishing the previous one. The bucket queues and per-rank data RNGs start
        afresh, the shared bucket-selection RNG and the fill schedule continue."""
        if not (self.is_list and self.infinite):
            raise ValueError("only an in-memory infinite sampler can continue a run with another world size")
        old = [_State.from_dict(sd, self.sizes, self.data.entry) for sd in states]
        pass_idx = max(o.pass_idx for o in old)
        used = np.zeros(len(self.data.entries), dtype=bool)
        for old_rank, o in enumerate(old):
            if o.pass_idx != pass_idx or o.cursor is None:
                continue
            order = self.data.order(o.epoch, pass_idx, o.skip, old_rank, len(old),
                                    self.curriculum.max_seconds(o, pass_idx))
            used[order[: o.cursor]] = True
            used[[e.key for q in o.queues for e in q]] = False
        self.epoch = old[0].epoch
        stats = old[min(self.rank, len(old) - 1)].stats
        st = _State(epoch=self.epoch, data_rng=self._fresh_state().data_rng, select_rng=old[0].select_rng,
                    stats=stats, pass_idx=pass_idx, batches=old[0].batches, queues=[[] for _ in self.sizes],
                    drops_before=dict(stats["drops"]), skip=(pass_idx, np.packbits(used).tobytes()),
                    full_from=max((o.full_from for o in old if o.full_from is not None), default=None))
        return st.to_dict(self._fingerprint())


def _dist_info(rank, world_size) -> tuple:
    if rank is not None and world_size is not None:
        return rank, world_size
    torch = sys.modules.get("torch")  # if torch was never imported, no process group can exist
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return rank or 0, world_size or 1
