"""Dynamic 2D bucketing batch sampler for speech encoder-decoder training (paper sec. 2).

Every example has an input length (`duration`, seconds) and an output length (`num_tokens`,
prompt included). A batch is padded along both, so we group examples that are similar in both:

1. Bins (`bins.py`): a grid of (duration bound, token bound) buckets estimated from a sample of
   the data, and an allocation rule (`flexible` by default, or `strict`) mapping each example to
   a bucket or to the reason it is dropped (too long, outside the optional TPS limits). Every
   drop is counted by reason (`sampler.stats["drops"]`) and logged at the end of each finite epoch.
2. Buffer. Examples flow from the source into per-bucket queues holding up to `buffer_size`
   examples. Each step picks a bucket and draws a random batch from it; what is consumed is
   replaced from the source. Sampling starts once `start_fill` of the buffer is filled and the
   fill target then grows by `fill_ramp` per batch. That schedule is fixed, so with
   `concurrent=True` (a producer thread reads and tokenizes the source into a bounded queue) the
   batches are exactly those of the single-threaded run, whatever the thread timing.
3. Synchronized buckets. The bucket is drawn from an RNG seeded by (seed, epoch) only, identical
   on every rank and weighted by each bucket's expected number of batches. No inter-process
   traffic. Each step draws first, then fills: if the drawn bucket has no full batch, the rank
   reads on for it, holding up to `overfill` x the fill target; only beyond that (or at the end
   of the data) does it take the nearest bucket that has a batch, the paper's fallback. Stopping
   at the first bucket with a batch instead let ranks disagree on most steps with small buffers.
   A rank that often falls back logs a warning with the buffer_size that would fix it.
4. Epoch end. When a finite source is exhausted the rest of the buffer is cut into batches (the
   last one of a bucket may be short). For an in-memory list every rank can count every rank's
   batches in advance (sum over buckets of ceil(n / batch size)), so ranks with fewer batches
   split their largest remaining ones: all ranks yield the same number of steps and every
   example is used exactly once. Streamed sources cannot count ahead: use `infinite=True` there.
5. Resume. `state_dict()` stores the queues as (key, duration, num_tokens), the source cursor and
   the RNG states; `load_state_dict()` rebuilds them in O(buffer), no replay of the epoch.
   `regroup_state(states)` maps the states of every rank of a run with another world size to one
   for this rank (in-memory infinite sources): the interrupted pass continues without repeats.

Batch size per bucket: `batch_size` (fixed), `max_duration` (`n * d <= max_duration` with d the
bucket's duration bound, or `d + d^2 / quadratic_duration`), or `batch_sizes` per bucket (oom.py,
see `bins.save_batch_sizes` / `bins.load_batch_sizes`). A batch never exceeds its bucket's size.
An example that no batch can hold is dropped and counted as `over_batch_limit`, as Lhotse's
duration filter drops them: under max_duration, one longer than the limit allows alone (a bucket
that reaches past it still takes a batch of 1 of its shorter examples); under batch_sizes, one in
a bucket of size 0. One warning names the limit (for a list: how many were dropped and the
longest; for a stream: the first one each rank meets). Only a limit that gives every bucket size 0
is an error.

    bins = Bins.load("bins.json")       # from bins import Bins; made by tools/estimate_bins.py
    sampler = BucketingSampler(examples, bins, max_duration=360, yield_indices=True)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)   # list[int] batches
    sampler = BucketingSampler(JsonlSource("train.jsonl"), bins, batch_sizes=sizes, infinite=True)
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
from pathlib import Path
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


# --- sources ------------------------------------------------------------------------------------


class JsonlSource:
    """Examples streamed from JSONL manifests (several paths = shards), one line at a time.

    Rank r keeps line i of shard s when (i + s) % world_size == r: every rank scans all bytes but
    parses only its own lines, so each line goes to exactly one rank. The shard order is reshuffled every pass;
    lines inside a shard are read in order (the sampler's buffer shuffles locally, as Lhotse's).
    Keys are (shard, line, byte offset), so `get` re-reads any example by seeking (used on resume).
    """

    def __init__(self, paths, shuffle_shards: bool = True):
        self.paths = [str(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
        for p in self.paths:
            if not Path(p).is_file():
                raise FileNotFoundError(f"JsonlSource: no such manifest {p}")
        self.shuffle_shards = shuffle_shards
        self._handles = {}

    def read(self, seed: int, rank: int, world_size: int, cursor=None):
        """Yields (key, cursor after this line, example) for this rank, from `cursor` on."""
        order = list(range(len(self.paths)))
        if self.shuffle_shards:
            random.Random(seed).shuffle(order)
        pos, line_no, offset = cursor or (0, 0, 0)
        for p in range(pos, len(order)):
            shard = order[p]
            with open(self.paths[shard], "rb") as f:
                f.seek(offset)
                for line in f:
                    key = (shard, line_no, offset)
                    line_no, offset = line_no + 1, offset + len(line)
                    if (key[1] + shard) % world_size == rank and line.strip():
                        yield key, (p, line_no, offset), self._parse(line, key)
            line_no = offset = 0

    def get(self, key):
        shard, _, offset = key
        if shard not in self._handles:
            self._handles[shard] = open(self.paths[shard], "rb")
        f = self._handles[shard]
        f.seek(offset)
        return self._parse(f.readline(), key)

    def describe(self, key) -> str:
        return f"{self.paths[key[0]]}:{key[1] + 1}"

    def _parse(self, line: bytes, key) -> dict:
        try:
            ex = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{self.describe(key)}: invalid JSON ({e})") from None
        if not isinstance(ex, dict):
            raise ValueError(f"{self.describe(key)}: expected a JSON object, got {type(ex).__name__}")
        return ex


# --- background reading -------------------------------------------------------------------------


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
    condition variable and wake each other only when the other is waiting: no polling interval,
    unlike Lhotse's 0.1 s / 1 s sleeps. Items keep source order, so the consumer sees the same
    sequence as `_Inline`. A producer error is re-raised in the consumer at the point where
    the failing item would have been read."""

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


# --- sampler ------------------------------------------------------------------------------------


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
                 skip=sd.get("skip"),  # states saved before world-size changes were supported have none
                 full_from=sd.get("full_from"))
        st.occupancy = sum(map(len, st.queues))
        st.ready = sum(0 < k <= len(q) for q, k in zip(st.queues, sizes))
        return st


class BucketingSampler:
    """Yields batches (list[int] with yield_indices, else list[dict]) from bucketed examples.

    source: a list of example dicts (map-style; metadata measured once up front) or a streamed
    source such as `JsonlSource`. Examples need `duration` and `num_tokens` (prompt included),
    else `num_tokens_fn(example)` is called lazily (in the producer thread when concurrent).
    Give exactly one of batch_size / max_duration / batch_sizes (per bucket, flat or nested).
    Rank and world size default to torch.distributed's when a process group is initialized.
    After each yield, `last_batch_info` describes that batch (bucket, size, max lengths, padding
    ratios); behind a prefetching DataLoader it runs ahead of the trainer, `stats` likewise.
    A new iteration continues an unfinished one; a finished epoch restarts unless `set_epoch`.
    """

    SNAPSHOT_EVERY = 100  # batches between the snapshots that `state_dict(rewind=...)` replays from
    AGREEMENT_WINDOW = 500  # steps over which a rank measures how often it took the drawn bucket
    AGREEMENT_WARN = 0.9  # warn when the ranks are expected to agree on fewer steps than this
    SUPPLY_MARGIN = 3.5  # buffer needed / expected reads per batch, fitted in bench/sync_bench.py

    def __init__(
        self,
        source,
        bins: Bins,
        *,
        batch_size: int | None = None,
        max_duration: float | None = None,
        quadratic_duration: float | None = None,
        batch_sizes: list | None = None,
        allocation: str = "flexible",  # or "strict" (drops what its duration bin's token bins can't hold)
        min_tps=None,  # tokens/s limits, scalar or one per duration bin (e.g. bins.max_tps)
        max_tps=None,
        num_tokens_fn=None,
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
        self.source, self.bins = source, bins
        self.is_list = isinstance(source, (list, tuple))
        if yield_indices and not self.is_list:
            raise ValueError("yield_indices needs an in-memory list source (map-style dataset)")
        self.rank, self.world_size = _dist_info(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world_size {self.world_size}")
        self.seed, self.sync_buckets, self.infinite, self.yield_indices = seed, sync_buckets, infinite, yield_indices
        self.concurrent = (not self.is_list) if concurrent is None else concurrent
        self.num_tokens_fn = num_tokens_fn
        self.buffer_size = buffer_size
        self.start = max(1, int(start_fill * buffer_size))
        self.ramp = max(1, int(fill_ramp * buffer_size))
        if overfill < 1:
            raise ValueError(f"overfill must be >= 1, got {overfill}")
        self.overfill = overfill
        self.allocate = Allocator(bins, allocation, min_tps, max_tps)
        self.bucket_bounds = bins.buckets()
        self.sizes, self._limit = self._batch_sizes(batch_size, max_duration, quadratic_duration, batch_sizes)
        # max_duration: the longest example a batch of one may hold (its cost d + d^2 / q solved for d).
        self._longest_alone = None if max_duration is None else (
            max_duration if not quadratic_duration
            else quadratic_duration / 2 * (math.sqrt(1 + 4 * max_duration / quadratic_duration) - 1))
        self.epoch = 0
        self._reset()
        if not self.is_list and not infinite and self.world_size > 1:
            log.warning("sampler: a finite streamed source cannot equalize batch counts across ranks; "
                        "use infinite=True for DDP training (see the module docstring, point 5)")
        self._targets = {}
        self._warned_overflow = False
        self._warned_limit = self.is_list  # lists warn here, once for all examples; streams at the first drop

        if self.is_list:
            # Measure and allocate once: every rank then knows every example's bucket, which gives
            # exact selection weights and the per-rank batch counts needed for equal epoch lengths.
            meas = [self._measure(ex, f"examples[{i}]") for i, ex in enumerate(source)]
            self.where = [self._bucket(d, n) for d, n in meas]  # bucket, or why it is dropped
            self.entries = [Entry(i, d, n, None) for i, (d, n) in enumerate(meas)]
            self._durations = np.array([d for d, _ in meas])
            self.alloc = np.array([a if isinstance(a, int) else -1 for a in self.where], dtype=np.int64)
            counts = np.bincount(self.alloc[self.alloc >= 0], minlength=len(self.sizes)).astype(np.float64)
            over = [d for (d, _), a in zip(meas, self.where) if a == OVER_LIMIT]
            if over and not (self.alloc >= 0).any():
                raise ValueError(f"no example fits a batch: {self._over_limit()}, and the shortest of the "
                                 f"{len(over)} that fit a bucket lasts {min(over):.2f} s: raise the limit")
            if over and self.rank == 0:
                log.warning("sampler: dropping %d of %d examples (the longest %.2f s) because no batch can hold "
                            "them: %s; raise it to train on them", len(over), len(meas), max(over),
                            self._over_limit())
        else:
            counts = np.array([c for row in bins.counts for c in row], np.float64) + 1 if bins.counts else None
        usable = np.array(self.sizes) > 0
        if counts is not None:
            counts[~usable] = 0  # buckets of size 0 get no batch, hence no weight
        # Weight = expected batches per bucket, so draws follow how fast each bucket fills up.
        w = counts / np.maximum(self.sizes, 1) if counts is not None and counts.sum() > 0 else usable.astype(float)
        self.cum_weights = list(accumulate((w / w.sum()).tolist()))
        self.sortagrad = sortagrad
        self.short_first = short_first
        if short_first is not None:
            if not (self.is_list and infinite) or self.concurrent:
                raise ValueError("short_first needs an in-memory list source in infinite, non-concurrent mode")
            if not (self._durations[self.alloc >= 0] <= short_first[0]).any():
                raise ValueError(f"short_first: no usable example lasts {short_first[0]} s or less (the shortest: "
                                 f"{self._durations[self.alloc >= 0].min():.2f} s)")
            # The draws of the short passes go to the buckets that can hold their utterances.
            holds = bins.durations[min(bisect_left(bins.durations, short_first[0]), len(bins.durations) - 1)]
            open_buckets = sum(1 for d, _ in self.bucket_bounds if d <= holds)
            self._short_share = self.cum_weights[min(open_buckets, len(self.cum_weights)) - 1]
        if sortagrad and counts is None:
            raise ValueError("sortagrad needs to know how many batches a pass makes: give a list source or "
                             "bins with counts")
        # Batches of one pass on one rank: the span over which sortagrad walks the buckets.
        self._pass_batches = float(w.sum()) / self.world_size if counts is not None else None
        # Examples to read for one full batch of each bucket at its share of the data.
        n = len(self.sizes)
        share = counts / counts.sum() if counts is not None and counts.sum() > 0 else np.full(n, 1 / n)
        self._supply = np.array(self.sizes) / np.maximum(share, 1e-12)

    def _reset(self) -> None:
        self._stats = {"batches": 0, "examples": 0, "duration": 0.0, "padded_duration": 0.0,
                       "tokens": 0, "padded_tokens": 0, "drops": {}}
        self._live = self._pending = self.last_batch_info = None
        self._snapshots = deque(maxlen=3)
        self._hits, self._num_hits, self._warned_agreement = deque(maxlen=self.AGREEMENT_WINDOW), 0, False

    def for_rank(self, rank: int) -> "BucketingSampler":
        """The same sampler for another rank, sharing the measured list (rank simulations)."""
        other = copy.copy(self)
        other.rank = rank
        other._reset()
        return other

    def _batch_sizes(self, batch_size, max_duration, quadratic_duration, batch_sizes) -> tuple:
        """(batch size per bucket, the limit that set them, for messages)."""
        if sum(x is not None for x in (batch_size, max_duration, batch_sizes)) != 1:
            raise ValueError("give exactly one of batch_size, max_duration, batch_sizes")
        if batch_size is not None:
            sizes = [int(batch_size)] * len(self.bucket_bounds)
            limit = f"batch_size={batch_size} (train.batch_size)"
        elif batch_sizes is not None:
            limit = "batch_sizes (train.batch_sizes)"
            nested = isinstance(batch_sizes[0], (list, tuple))
            sizes = [int(s) for row in batch_sizes for s in row] if nested else [int(s) for s in batch_sizes]
            if len(sizes) != len(self.bucket_bounds):
                raise ValueError(f"batch_sizes has {len(sizes)} entries for {len(self.bucket_bounds)} buckets")
        else:
            sizes = []
            for d, _ in self.bucket_bounds:
                eff = d + d * d / quadratic_duration if quadratic_duration else d
                n = int(max_duration // eff)
                while n * eff > max_duration:  # guard against float rounding in //
                    n -= 1
                lower = max((d2 for d2, _ in self.bucket_bounds if d2 < d), default=0.0)
                lower_eff = lower + lower * lower / quadratic_duration if quadratic_duration else lower
                sizes.append(n if n or lower_eff >= max_duration else 1)  # 1: its examples up to the limit, alone
            limit = f"max_duration={max_duration:g} (train.max_duration)"
        for b, s in enumerate(sizes):
            if s < 0:
                d, t = self.bucket_bounds[b]
                raise ValueError(f"bucket {b} (<= {d} s, <= {t} tokens) gets batch size {s} from {limit}")
        if not any(sizes):
            raise ValueError(f"{limit} gives every bucket batch size 0, so no example fits a batch (the shortest "
                             f"bucket holds up to {self.bucket_bounds[0][0]:g} s): raise the limit")
        return sizes, limit

    def _over_limit(self) -> str:
        """What no batch can hold, and why, for the over-limit warnings."""
        if self._longest_alone is not None:
            return f"{self._limit} holds examples of up to {self._longest_alone:.2f} s"
        bounds = [self.bucket_bounds[b][0] for b, k in enumerate(self.sizes) if not k]
        span = f"bound {bounds[0]:g} s" if bounds[0] == bounds[-1] else f"bounds {bounds[0]:g}-{bounds[-1]:g} s"
        return f"{self._limit} gives {len(bounds)} of {len(self.sizes)} buckets (duration {span}) batch size 0"

    def _bucket(self, d: float, n: int):
        """The example's bucket, or why it is dropped: longer than a batch may hold, or in a bucket
        of batch size 0."""
        a = self.allocate(d, n)
        if a.__class__ is int and (not self.sizes[a] or (self._longest_alone is not None and d > self._longest_alone)):
            return OVER_LIMIT
        return a

    def _measure(self, ex, where: str) -> tuple:
        if not isinstance(ex, dict):
            raise ValueError(f"{where}: expected a dict example, got {type(ex).__name__}")
        try:
            d = float(ex["duration"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: field 'duration' missing or not a number: {ex.get('duration')!r}") from None
        if "num_tokens" in ex:
            return d, int(ex["num_tokens"])
        if self.num_tokens_fn is None:
            raise ValueError(f"{where}: no 'num_tokens' field and no num_tokens_fn given")
        return d, int(self.num_tokens_fn(ex))

    # --- epochs, length, telemetry

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next iteration yields. A state restored by `load_state_dict` for
        this same epoch is kept, so `load_state_dict(sd); set_epoch(sd_epoch); iter()` resumes."""
        self.epoch, self._live = epoch, None
        if self._pending is not None and self._pending.epoch != epoch:
            self._pending = None

    def _permutation(self, epoch: int, pass_idx: int) -> np.ndarray:
        return np.random.default_rng(_seed(self.seed, epoch, pass_idx, 3)).permutation(len(self.entries))

    def _epoch_target(self, epoch: int) -> int:
        """The largest number of batches any rank produces this epoch (every rank yields that)."""
        if epoch not in self._targets:
            perm = self._permutation(epoch, 0)
            rank_of = np.empty(len(perm), dtype=np.int64)
            rank_of[perm] = np.arange(len(perm)) % self.world_size
            ok = self.alloc >= 0
            nb = len(self.sizes)
            cells = np.bincount(rank_of[ok] * nb + self.alloc[ok], minlength=self.world_size * nb)
            per_rank = -(-cells.reshape(self.world_size, nb) // np.maximum(self.sizes, 1))  # ceil(n / batch size)
            self._targets = {epoch: int(per_rank.sum(axis=1).max())}
        return self._targets[epoch]

    def __len__(self) -> int:
        if not self.is_list or self.infinite:
            raise TypeError("the number of batches is only known for finite in-memory list sources")
        return self._epoch_target(self.epoch)

    @property
    def stats(self) -> dict:
        """Running totals of this rank: batches, examples, element-weighted padding, drops by reason."""
        s = copy.deepcopy(self._stats)
        s["audio_padding"] = 1 - s["duration"] / s["padded_duration"] if s["padded_duration"] else 0.0
        s["text_padding"] = 1 - s["tokens"] / s["padded_tokens"] if s["padded_tokens"] else 0.0
        return s

    @staticmethod
    def _record(stats: dict, bucket: int, batch: list) -> dict:
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
                "audio_padding": 1 - dsum / (n * dmax), "text_padding": 1 - tsum / (n * tmax) if tmax else 0.0}

    # --- iteration

    def _fresh_state(self) -> _State:
        e, sel = self.epoch, 0 if self.sync_buckets else self.rank + 1
        return _State(
            epoch=e,
            data_rng=random.Random(_seed(self.seed, e, self.rank + 1, 1)),
            select_rng=random.Random(_seed(self.seed, e, sel, 2)),
            stats=self._stats,
            target=self._epoch_target(e) if self.is_list and not self.infinite else None,
            queues=[[] for _ in self.sizes],
            drops_before=dict(self._stats["drops"]),
        )

    def _reads_short(self, st: _State, pass_idx: int) -> bool:
        return self.short_first is not None and st.epoch == 0 and (st.full_from is None or pass_idx < st.full_from)

    def _stream(self, st: _State):
        """Yields (pass, cursor, bucket or drop reason, entry) in source order, for this rank, from
        where `st` stands. short_first: passes over the short examples, until the short batches
        are done; then the pass being read is left, and the next one reads everything."""
        epoch, pass_idx, cursor, skip = st.epoch, st.pass_idx, st.cursor, st.skip
        while True:
            used = 0
            if self.is_list:
                short = self._reads_short(st, pass_idx)
                order = self._rank_order(epoch, pass_idx, skip, self.rank, self.world_size, short)
                used = int((self.alloc[order] >= 0).sum())
                where, entries = self.where, self.entries
                for pos, i in enumerate(order[cursor or 0 :].tolist(), start=(cursor or 0) + 1):
                    if short and st.batches >= self.short_first[1]:
                        st.full_from = pass_idx + 1
                        break
                    yield pass_idx, pos, where[i], entries[i]
            else:
                pass_seed = _seed(self.seed, epoch, pass_idx, 3)
                for key, cur, ex in self.source.read(pass_seed, self.rank, self.world_size, cursor):
                    d, n = self._measure(ex, self.source.describe(key))
                    a = self._bucket(d, n)
                    used += isinstance(a, int)
                    yield pass_idx, cur, a, Entry(key, d, n, ex)
            if not self.infinite:
                return
            if used == 0 and cursor is None:
                raise ValueError(f"rank {self.rank}: a full pass over the source gave no usable example")
            pass_idx, cursor = pass_idx + 1, None

    def _fill(self, st: _State, reader, drawn: int) -> None:
        """Moves examples from the source into the bucket queues until the fill target is buffered
        and the drawn bucket holds a full batch, reading on past the target for it up to
        `overfill` x target (the first batch: only the target, which keeps time-to-first-batch
        short). Beyond that bound, or when the source ends, the caller falls back to the nearest
        bucket with a batch. Runs once per example, hence the locals."""
        want = min(self.buffer_size, self.start + st.batches * self.ramp)
        cap = want if st.batches == 0 else int(self.overfill * want)
        queues, sizes, occ, ready = st.queues, self.sizes, st.occupancy, st.ready
        mine, k = queues[drawn], sizes[drawn]
        if occ >= want and ready and (len(mine) >= k or occ >= cap):
            return
        for item in reader:
            st.pass_idx, st.cursor, b, entry = item
            if b.__class__ is str:
                st.stats["drops"][b] = st.stats["drops"].get(b, 0) + 1
                if b == OVER_LIMIT and not self._warned_limit:
                    self._warned_limit = True
                    log.warning("sampler: rank %d dropped %s (%.2f s) because no batch can hold it: %s; raise it "
                                "to train on such examples (later ones are only counted, in stats['drops'])",
                                self.rank, self.source.describe(entry.key), entry.duration, self._over_limit())
                continue
            q = queues[b]
            q.append(entry)
            occ += 1
            ready += len(q) == sizes[b]
            if occ >= want and ready and (len(mine) >= k or occ >= cap):
                break
            if occ == cap and not ready and not self._warned_overflow:
                self._warned_overflow = True
                log.warning("sampler: buffer full (%d) but no bucket has a full batch; reading on", occ)
        else:
            st.exhausted = True
        st.occupancy, st.ready = occ, ready

    def _track_agreement(self, hit: bool, occupancy: int) -> None:
        """Warns once when this rank often could not take the drawn bucket: with sync_buckets the
        ranks then train on different buckets, and a DDP step waits for the slowest."""
        if not self.sync_buckets or self.world_size == 1:
            return
        w = self._hits
        if len(w) == w.maxlen:
            self._num_hits -= w[0]
        w.append(hit)
        self._num_hits += hit
        rate = self._num_hits / len(w)
        # Ranks miss independently, so all of them take the drawn bucket on about rate^R of the steps.
        if len(w) == w.maxlen and rate**self.world_size < self.AGREEMENT_WARN and not self._warned_agreement:
            self._warned_agreement = True
            log.warning("sampler: rank %d took the drawn bucket on %.1f%% of the last %d steps, so %d ranks agree "
                        "on about %.0f%% (buffer_size %d, %d examples held); buffer_size=%d should give %.0f%%",
                        self.rank, 100 * rate, len(w), self.world_size, 100 * rate**self.world_size,
                        self.buffer_size, occupancy, self.suggested_buffer_size(), 100 * self.AGREEMENT_WARN)

    def suggested_buffer_size(self, agreement: float = AGREEMENT_WARN) -> int:
        """A buffer_size at which all ranks take the drawn bucket on about `agreement` of the steps:
        each rank must supply the buckets drawn agreement^(1/R) of the time, and bucket b needs
        about batch size / its share of the data examples read to gather one batch."""
        p = np.diff(self.cum_weights, prepend=0.0)
        order = np.argsort(self._supply)
        covered = np.cumsum(p[order])
        share = agreement ** (1 / self.world_size)
        need = self._supply[order][min(int(np.searchsorted(covered, share)), len(order) - 1)]
        return int(math.ceil(self.SUPPLY_MARGIN * need / self.overfill / 100) * 100)

    def _nearest(self, b: int, ok) -> int:
        for dist in range(len(self.sizes)):
            for c in (b - dist, b + dist):
                if 0 <= c < len(self.sizes) and ok(c):
                    return c
        raise AssertionError("no bucket has a batch")

    def _next_batch(self, st: _State, reader):
        """Advances the state by one batch; returns (bucket, entries) or None at the epoch end."""
        if st.drain is not None and not any(st.drain):
            return None
        # One draw per batch on every rank keeps the shared selection RNG aligned across ranks.
        u = st.select_rng.random()
        if self.short_first is not None and st.epoch == 0 and st.batches < self.short_first[1]:
            u *= self._short_share
        if self.sortagrad and st.epoch == 0 and st.batches < self._pass_batches:
            # Sortagrad (Amodei et al., 2016): the same quantile walk on every rank takes each bucket
            # in turn, shortest first, for as many batches as its share of the data.
            u = (st.batches + 0.5) / self._pass_batches
        drawn = min(bisect_right(self.cum_weights, u), len(self.sizes) - 1)
        if not st.exhausted:
            self._fill(st, reader, drawn)
        if st.exhausted and st.drain is None:
            st.drain = self._plan_drain(st)
            if not any(st.drain):
                return None
        if st.drain is not None:
            b = self._nearest(drawn, lambda c: len(st.drain[c]) > 0)
            batch = st.drain[b].pop()
        else:
            b = self._nearest(drawn, lambda c: 0 < self.sizes[c] <= len(st.queues[c]))
            if self.start + st.batches * self.ramp >= self.buffer_size:  # past the ramp: misses are the buffer's
                self._track_agreement(b == drawn, st.occupancy)
            q, k, rand = st.queues[b], self.sizes[b], st.data_rng.random
            for t in range(len(q) - 1, len(q) - 1 - k, -1):  # partial Fisher-Yates: O(batch size)
                j = int(rand() * (t + 1))
                q[j], q[t] = q[t], q[j]
            batch = q[len(q) - k :]
            del q[len(q) - k :]
            st.occupancy -= k
            st.ready -= len(q) < k
        st.batches += 1
        return b, batch

    def _plan_drain(self, st: _State) -> list:
        """Cuts the remaining buffer into batches; splits the largest until this rank reaches the target."""
        drain = []
        for q, k in zip(st.queues, self.sizes):
            st.data_rng.shuffle(q)
            drain.append([q[i : i + k] for i in range(0, len(q), k)] if k else [])  # size 0: always empty
        st.queues, st.occupancy, st.ready = [[] for _ in self.sizes], 0, 0
        have = st.batches + sum(map(len, drain))
        if st.target is not None:
            assert have <= st.target, f"rank {self.rank} would yield {have} batches > target {st.target}"
            for _ in range(st.target - have):
                lens = [(len(x), b, i) for b, bb in enumerate(drain) for i, x in enumerate(bb)]
                n, b, i = max(lens, default=(0, 0, 0))
                if n < 2:
                    raise RuntimeError(f"rank {self.rank}: too few examples left to match the {st.target} batches "
                                       "of the other ranks; use fewer ranks or more data")
                batch = drain[b][i]
                drain[b][i] = batch[: n // 2]
                drain[b].append(batch[n // 2 :])
        return drain

    def _output(self, batch: list) -> list:
        if self.yield_indices:
            return [e.key for e in batch]
        if self.is_list:
            return [self.source[e.key] for e in batch]
        return [e.example for e in batch]

    def _reader(self, st: _State, threaded: bool):
        items = self._stream(st)
        return _Producer(items, self.buffer_size) if threaded else _Inline(items)

    def __iter__(self):
        st = self._pending or self._live or self._fresh_state()
        if st is self._live and st.drain is not None and not any(st.drain):
            st = self._fresh_state()  # a finished epoch iterated again: same epoch from the start
        self._pending, self._live = None, st
        self._snapshots.clear()
        self._snapshots.append(self._copy(st))
        reader = self._reader(st, self.concurrent and not st.exhausted)
        try:
            while (out := self._next_batch(st, reader)) is not None:
                b, batch = out
                self.last_batch_info = self._record(st.stats, b, batch)
                if st.batches % self.SNAPSHOT_EVERY == 0:
                    self._snapshots.append(self._copy(st))
                yield self._output(batch)
        finally:
            reader.close()
        if drops := st.epoch_drops():
            log.warning("sampler: rank %d epoch %d dropped %s", self.rank, st.epoch, drops)

    # --- checkpointing

    def _copy(self, st: _State) -> _State:
        c = copy.copy(st)
        c.queues = [list(q) for q in st.queues]
        c.drain = None if st.drain is None else [list(bb) for bb in st.drain]  # planned batches are never modified
        c.data_rng, c.select_rng = random.Random(), random.Random()
        c.data_rng.setstate(st.data_rng.getstate())
        c.select_rng.setstate(st.select_rng.getstate())
        c.stats = copy.deepcopy(st.stats)  # drops_before is replaced, never modified: shared
        return c

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
            snaps = [s for s in self._snapshots if s.batches <= goal] if self._live is not None and goal >= 0 else []
            if not snaps:
                raise ValueError(f"cannot rewind {rewind} batches from batch {st.batches}: no snapshot that far back")
            st = self._copy(snaps[-1])
            reader = self._reader(st, threaded=False)
            while st.batches < goal:
                self._record(st.stats, *self._next_batch(st, reader))
            reader.close()
        return st.to_dict(self._fingerprint())

    def _rank_order(self, epoch: int, pass_idx: int, skip, rank: int, world_size: int,
                    short: bool = False) -> np.ndarray:
        """The examples `rank` reads in this pass, in order: its share of the pass's permutation,
        after removing those that `skip` says were used before a change of world size."""
        perm = self._permutation(epoch, pass_idx)
        if short:
            perm = perm[self._durations[perm] <= self.short_first[0]]
        if skip is not None and skip[0] == pass_idx:
            used = np.unpackbits(np.frombuffer(skip[1], dtype=np.uint8), count=len(self.entries)).astype(bool)
            perm = perm[~used[perm]]
        return perm[rank::world_size]

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
        old = [_State.from_dict(sd, self.sizes, self._entry) for sd in states]
        pass_idx = max(o.pass_idx for o in old)
        used = np.zeros(len(self.entries), dtype=bool)
        for old_rank, o in enumerate(old):
            if o.pass_idx != pass_idx or o.cursor is None:
                continue
            order = self._rank_order(o.epoch, pass_idx, o.skip, old_rank, len(old), self._reads_short(o, pass_idx))
            used[order[: o.cursor]] = True
            used[[e.key for q in o.queues for e in q]] = False
        self.epoch = old[0].epoch
        stats = old[min(self.rank, len(old) - 1)].stats
        st = _State(epoch=self.epoch, data_rng=self._fresh_state().data_rng, select_rng=old[0].select_rng,
                    stats=stats, pass_idx=pass_idx, batches=old[0].batches, queues=[[] for _ in self.sizes],
                    drops_before=dict(stats["drops"]), skip=(pass_idx, np.packbits(used).tobytes()),
                    full_from=max((o.full_from for o in old if o.full_from is not None), default=None))
        return st.to_dict(self._fingerprint())

    def load_state_dict(self, sd: dict) -> None:
        """Restores a state; the next iteration continues exactly where it was taken."""
        mine = self._fingerprint()
        for k, v in sd["fingerprint"].items():
            if json.loads(json.dumps(v)) != json.loads(json.dumps(mine[k])):
                raise ValueError(f"sampler state was saved with {k}={v!r}, this sampler has {mine[k]!r}")
        st = _State.from_dict(sd, self.sizes, self._entry)
        self.epoch, self._stats = st.epoch, st.stats
        self._pending, self._live = st, None

    def _entry(self, key, duration: float, num_tokens: int) -> Entry:
        """A queued example from its saved form: list sources index it, streamed ones re-read it."""
        if self.is_list:
            return Entry(key, duration, num_tokens, None)
        key = tuple(key)  # JSON turns tuples into lists
        return Entry(key, duration, num_tokens, self.source.get(key))


def _dist_info(rank, world_size) -> tuple:
    if rank is not None and world_size is not None:
        return rank, world_size
    torch = sys.modules.get("torch")  # if torch was never imported, no process group can exist
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return rank or 0, world_size or 1


if __name__ == "__main__":
    sys.exit("sampler.py has no command line any more: estimate bins with the training tokenizer using\n"
             "    python tools/estimate_bins.py --manifest train.jsonl --tokenizer TOKENIZER_DIR -o bins.json")
