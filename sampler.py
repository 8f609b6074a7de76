"""Dynamic 2D bucketing batch sampler for speech encoder-decoder training (paper sec. 2, issue 4).

Every example has an input length (`duration`, seconds) and an output length (`num_tokens`,
prompt included). A batch is padded along both, so we group examples that are similar in both:

1. Bins. `estimate-bins` cuts the duration axis into N bins holding equal total audio, then cuts
   each duration bin into M token sub-bins holding equal total tokens, after dropping that bin's
   tokens-per-second (TPS) outliers (z-score > 4) and recording its max TPS. A bucket is one
   (duration bound, token bound) cell; bounds are inclusive upper bounds, buckets are numbered
   duration-major. Duplicate bounds (skewed data) are merged, the merged bin gets more sub-bins.
2. Allocation. `strict`: duration bin first, then its token sub-bin; no fit -> dropped.
   `flexible` (default, the paper's): the first bucket whose two bounds both fit, so an example
   with a long transcript moves to a longer bucket instead of being dropped. Examples longer
   than every bin, or outside the optional TPS limits, are dropped. Every drop is counted by
   reason (`sampler.stats["drops"]`) and logged at the end of each finite epoch.
3. Buffer. Examples flow from the source into per-bucket queues holding up to `buffer_size`
   examples. Each step picks a bucket and draws a random batch from it; what is consumed is
   replaced from the source. Sampling starts once `start_fill` of the buffer is filled and the
   fill target then grows by `fill_ramp` per batch. That schedule is fixed, so with
   `concurrent=True` (a producer thread reads and tokenizes the source into a bounded queue) the
   batches are exactly those of the single-threaded run, whatever the thread timing.
4. Synchronized buckets. The bucket is drawn from an RNG seeded by (seed, epoch) only, identical
   on every rank and weighted by each bucket's expected number of batches; a rank whose drawn
   bucket has no full batch takes the nearest bucket that has one. No inter-process traffic.
5. Epoch end. When a finite source is exhausted the rest of the buffer is cut into batches (the
   last one of a bucket may be short). For an in-memory list every rank can count every rank's
   batches in advance (sum over buckets of ceil(n / batch size)), so ranks with fewer batches
   split their largest remaining ones: all ranks yield the same number of steps and every
   example is used exactly once. Streamed sources cannot count ahead: use `infinite=True` there.
6. Resume. `state_dict()` stores the queues as (key, duration, num_tokens), the source cursor and
   the RNG states; `load_state_dict()` rebuilds them in O(buffer), no replay of the epoch.

Batch size per bucket: `batch_size` (fixed), `max_duration` (`n * d <= max_duration` with d the
bucket's duration bound, or `d + d^2 / quadratic_duration`), or `batch_sizes` per bucket (oom.py,
see `save_batch_sizes` / `load_batch_sizes`). A batch never exceeds its bucket's size.

    bins = Bins.load("bins.json")
    sampler = BucketingSampler(examples, bins, max_duration=360, yield_indices=True)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)   # list[int] batches
    sampler = BucketingSampler(JsonlSource("train.jsonl"), bins, batch_sizes=sizes, infinite=True)
    for examples in sampler: ...                                             # list[dict] batches
    sampler.last_batch_info, sampler.stats, sampler.state_dict(rewind=num_prefetched_batches)

CLI (bins from a uniform random sample of the manifest lines, progress on stderr):
    python sampler.py estimate-bins --manifest train.jsonl --buckets 30 --sub-buckets 2 \\
        --sample 100000 [--tokenizer spm.model --prompt-tokens 9] -o bins.json
"""

import argparse
import copy
import json
import logging
import math
import random
import sys
import threading
import time
from bisect import bisect_left, bisect_right
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import numpy as np

log = logging.getLogger("sampler")


def _seed(*parts: int) -> int:
    """A 64-bit seed derived from integers; stable across processes (unlike hash())."""
    a, b = np.random.SeedSequence([int(p) for p in parts]).generate_state(2)
    return (int(a) << 32) | int(b)


# --- bins --------------------------------------------------------------------------------------


@dataclass
class Bins:
    """Bucket bounds. `durations[i]` is the inclusive upper bound of duration bin i (ascending);
    `tokens[i]` the ascending token bounds of its sub-bins (None: 1D bucketing, tokens unbounded);
    `max_tps[i]` the bin's max tokens/s without outliers; `counts[i][j]` how many sampled
    examples landed in bucket (i, j), used to weight bucket selection."""

    durations: list
    tokens: list | None = None
    max_tps: list | None = None
    counts: list | None = None

    def __post_init__(self):
        d = self.durations
        if not d or any(x <= 0 for x in d) or any(a >= b for a, b in zip(d, d[1:])):
            raise ValueError(f"bins: durations must be positive and ascending, got {d}")
        for name in ("tokens", "max_tps", "counts"):
            v = getattr(self, name)
            if v is not None and len(v) != len(d):
                raise ValueError(f"bins: {name} has {len(v)} entries for {len(d)} duration bins")
        for i, t in enumerate(self.tokens or []):
            if not t or any(a >= b for a, b in zip(t, t[1:])):
                raise ValueError(f"bins: tokens[{i}] must be non-empty and ascending, got {t}")
        if self.counts is not None and [len(c) for c in self.counts] != self.shape:
            raise ValueError(f"bins: counts shape {[len(c) for c in self.counts]} != {self.shape}")

    @property
    def shape(self) -> list:
        """Number of token sub-bins of each duration bin."""
        return [len(t) for t in self.tokens] if self.tokens else [1] * len(self.durations)

    @property
    def num_buckets(self) -> int:
        return sum(self.shape)

    def buckets(self) -> list:
        """(duration bound, token bound) of every bucket, duration-major."""
        toks = self.tokens or [[math.inf]] * len(self.durations)
        return [(d, t) for d, ts in zip(self.durations, toks) for t in ts]

    def to_dict(self) -> dict:
        return {"durations": self.durations, "tokens": self.tokens, "max_tps": self.max_tps, "counts": self.counts}

    @classmethod
    def from_dict(cls, d: dict, where: str = "bins") -> "Bins":
        unknown = set(d) - {"durations", "tokens", "max_tps", "counts", "meta"}
        if unknown or "durations" not in d:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} or missing 'durations'")
        return cls(d["durations"], d.get("tokens"), d.get("max_tps"), d.get("counts"))

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()) + "\n")

    @classmethod
    def load(cls, path) -> "Bins":
        return cls.from_dict(json.loads(Path(path).read_text()), where=str(path))


def save_batch_sizes(path, bins: Bins, batch_sizes: list) -> None:
    """Per-bucket batch sizes (oom.py's output): {"bins": ..., "batch_sizes": [[...], ...]},
    nested like `bins.tokens` (one list per duration bin) so a size cannot drift from its bucket."""
    Path(path).write_text(json.dumps({"bins": bins.to_dict(), "batch_sizes": batch_sizes}) + "\n")


def load_batch_sizes(path) -> tuple:
    """Returns (bins, batch_sizes) as written by `save_batch_sizes`."""
    d = json.loads(Path(path).read_text())
    bins = Bins.from_dict(d["bins"], where=f"{path}: bins")
    if [len(s) for s in d["batch_sizes"]] != bins.shape:
        raise ValueError(f"{path}: batch_sizes shape does not match the bins shape {bins.shape}")
    return bins, d["batch_sizes"]


def _equal_mass_bounds(sorted_values: np.ndarray, n: int) -> np.ndarray:
    """Upper bounds of n bins over ascending values such that each bin holds ~1/n of their sum."""
    cum = np.cumsum(sorted_values)
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, n) / n)
    return np.append(sorted_values[np.minimum(cuts, len(cum) - 1)], sorted_values[-1])


def estimate_bins(durations, num_tokens, num_buckets: int = 30, sub_buckets: int = 2, outlier_z: float = 4.0) -> Bins:
    """Bins from a sample: equal total duration per duration bin, then (2D, sub_buckets > 1) equal
    total tokens per token sub-bin after dropping examples whose TPS z-score exceeds outlier_z."""
    d = np.asarray(durations, dtype=np.float64)
    t = np.asarray(num_tokens, dtype=np.int64)
    keep = d > 0
    d, t = d[keep], t[keep]
    if len(d) == 0:
        raise ValueError("estimate_bins: no example with a positive duration")
    order = np.argsort(d, kind="stable")
    d, t = d[order], t[order]
    bounds, merged = np.unique(_equal_mass_bounds(d, num_buckets), return_counts=True)
    tokens, max_tps, lo = [], [], 0
    for ub, m in zip(bounds, merged):
        hi = int(np.searchsorted(d, ub, side="right"))
        bd, bt = d[lo:hi], t[lo:hi]
        lo = hi
        tps = bt / bd
        std = tps.std()
        # One-sided: only long-transcript outliers hurt (OOM, hallucinated labels), as in NeMo.
        ok = tps <= tps.mean() + outlier_z * std if std > 0 else np.ones(len(bt), dtype=bool)
        max_tps.append(math.ceil(float(tps[ok].max()) * 1000) / 1000)  # rounded up: keeps the max itself
        if sub_buckets > 1:
            sub = _equal_mass_bounds(np.sort(bt[ok]), sub_buckets * int(m))
            tokens.append([int(x) for x in np.unique(sub)])
    bins = Bins([float(x) for x in bounds], tokens or None, max_tps)
    alloc = _Allocator(bins)
    counts = np.zeros(bins.num_buckets, dtype=np.int64)
    for dd, tt in zip(d.tolist(), t.tolist()):
        b = alloc(dd, tt)
        if isinstance(b, int):
            counts[b] += 1
    starts = list(accumulate(bins.shape, initial=0))
    bins.counts = [counts[s:e].tolist() for s, e in zip(starts, starts[1:])]
    return bins


# --- allocation ---------------------------------------------------------------------------------


def _per_bin(value, n: int, name: str):
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return [float(value)] * n
    if len(value) != n:
        raise ValueError(f"{name}: got {len(value)} values for {n} duration bins")
    return [float(v) for v in value]


class _Allocator:
    """Maps (duration, num_tokens) to a bucket index, or to the reason the example is dropped."""

    def __init__(self, bins: Bins, allocation: str = "flexible", min_tps=None, max_tps=None):
        if allocation not in ("flexible", "strict"):
            raise ValueError(f"allocation must be 'flexible' or 'strict', got {allocation!r}")
        self.strict = allocation == "strict"
        self.durations = bins.durations
        self.tokens = bins.tokens or [[math.inf]] * len(bins.durations)
        self.first = list(accumulate(bins.shape, initial=0))
        self.min_tps = _per_bin(min_tps, len(bins.durations), "min_tps")
        self.max_tps = _per_bin(max_tps, len(bins.durations), "max_tps")

    def __call__(self, d: float, n: int):
        if not d > 0:
            return "bad_duration"
        i = bisect_left(self.durations, d)
        if i == len(self.durations):
            return "duration_over_bins"
        # TPS limits belong to the duration bin the example falls in, before any flexible move.
        if self.max_tps is not None and n / d > self.max_tps[i]:
            return "tps_above_max"
        if self.min_tps is not None and n / d < self.min_tps[i]:
            return "tps_below_min"
        for k in range(i, i + 1 if self.strict else len(self.durations)):
            j = bisect_left(self.tokens[k], n)
            if j < len(self.tokens[k]):
                return self.first[k] + j
        return "tokens_over_bins"


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


@dataclass
class _State:
    """Everything that determines the remaining batches of an epoch (or of an infinite run)."""

    epoch: int
    data_rng: random.Random  # per rank: which examples of a bucket form a batch
    select_rng: random.Random  # shared by all ranks when sync_buckets: which bucket
    stats: dict
    target: int | None = None  # batches every rank yields this epoch (finite in-memory lists)
    pass_idx: int = 0  # source pass; infinite mode starts a reshuffled pass when one ends
    cursor: object = None  # source position after the last example taken (None: pass start)
    queues: list = field(default_factory=list)  # per bucket: entries (key, duration, num_tokens, example)
    occupancy: int = 0
    ready: int = 0  # buckets holding at least one full batch
    batches: int = 0
    exhausted: bool = False
    drain: list | None = None  # per bucket: the remaining batches once the source is exhausted
    drops: Counter = field(default_factory=Counter)
    skip: tuple | None = None  # (pass, packed bitmask of examples) used in that pass before a world-size change


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
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        sync_buckets: bool = True,  # same bucket on every rank at each step (paper sec. 2)
        concurrent: bool | None = None,  # producer thread; default: on for streamed sources
        infinite: bool = False,  # endless reshuffled passes, for step-based training
        yield_indices: bool = False,  # list sources: batches of indices, for DataLoader(batch_sampler=)
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
        self.allocate = _Allocator(bins, allocation, min_tps, max_tps)
        self.bucket_bounds = bins.buckets()
        self.sizes = self._batch_sizes(batch_size, max_duration, quadratic_duration, batch_sizes)
        self.epoch = 0
        self._reset()
        if not self.is_list and not infinite and self.world_size > 1:
            log.warning("sampler: a finite streamed source cannot equalize batch counts across ranks; "
                        "use infinite=True for DDP training (see the module docstring, point 5)")
        self._targets = {}
        self._warned_overflow = False

        if self.is_list:
            # Measure and allocate once: every rank then knows every example's bucket, which gives
            # exact selection weights and the per-rank batch counts needed for equal epoch lengths.
            meas = [self._measure(ex, f"examples[{i}]") for i, ex in enumerate(source)]
            self.where = [self.allocate(d, n) for d, n in meas]  # bucket, or why it is dropped
            self.entries = [(i, d, n, None) for i, (d, n) in enumerate(meas)]
            self.alloc = np.array([a if isinstance(a, int) else -1 for a in self.where], dtype=np.int64)
            counts = np.bincount(self.alloc[self.alloc >= 0], minlength=len(self.sizes)).astype(np.float64)
        else:
            counts = np.array([c for row in bins.counts for c in row], np.float64) + 1 if bins.counts else None
        # Weight = expected batches per bucket, so draws follow how fast each bucket fills up.
        w = counts / np.array(self.sizes) if counts is not None and counts.sum() > 0 else np.ones(len(self.sizes))
        self.cum_weights = list(accumulate((w / w.sum()).tolist()))

    def _reset(self) -> None:
        self._stats = {"batches": 0, "examples": 0, "duration": 0.0, "padded_duration": 0.0,
                       "tokens": 0, "padded_tokens": 0, "drops": {}}
        self._live = self._pending = self.last_batch_info = None
        self._snapshots = deque(maxlen=3)

    def for_rank(self, rank: int) -> "BucketingSampler":
        """The same sampler for another rank, sharing the measured list (rank simulations)."""
        other = copy.copy(self)
        other.rank = rank
        other._reset()
        return other

    def _batch_sizes(self, batch_size, max_duration, quadratic_duration, batch_sizes) -> list:
        if sum(x is not None for x in (batch_size, max_duration, batch_sizes)) != 1:
            raise ValueError("give exactly one of batch_size, max_duration, batch_sizes")
        if batch_size is not None:
            sizes = [int(batch_size)] * len(self.bucket_bounds)
        elif batch_sizes is not None:
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
                sizes.append(n)
        for b, s in enumerate(sizes):
            if s < 1:
                d, t = self.bucket_bounds[b]
                raise ValueError(f"bucket {b} (<= {d} s, <= {t} tokens) gets batch size {s}: raise the limit")
        return sizes

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
            per_rank = -(-cells.reshape(self.world_size, nb) // np.array(self.sizes))  # ceil(n / batch size)
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
        durs, toks = [e[1] for e in batch], [e[2] for e in batch]
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
        )

    def _stream(self, epoch: int, pass_idx: int, cursor, skip=None):
        """Yields (pass, cursor, bucket or drop reason, entry) in source order, for this rank."""
        while True:
            used = 0
            if self.is_list:
                order = self._rank_order(epoch, pass_idx, skip, self.rank, self.world_size)
                used = int((self.alloc[order] >= 0).sum())
                where, entries = self.where, self.entries
                for pos, i in enumerate(order[cursor or 0 :].tolist(), start=(cursor or 0) + 1):
                    yield pass_idx, pos, where[i], entries[i]
            else:
                pass_seed = _seed(self.seed, epoch, pass_idx, 3)
                for key, cur, ex in self.source.read(pass_seed, self.rank, self.world_size, cursor):
                    d, n = self._measure(ex, self.source.describe(key))
                    a = self.allocate(d, n)
                    used += isinstance(a, int)
                    yield pass_idx, cur, a, (key, d, n, ex)
            if not self.infinite:
                return
            if used == 0 and cursor is None:
                raise ValueError(f"rank {self.rank}: a full pass over the source gave no usable example")
            pass_idx, cursor = pass_idx + 1, None

    def _fill(self, st: _State, reader, want: int) -> None:
        """Moves examples from the source into the bucket queues until `want` are buffered and
        some bucket holds a full batch (or the source ends). Runs once per example, hence the locals."""
        queues, sizes, occ, ready = st.queues, self.sizes, st.occupancy, st.ready
        if occ >= want and ready:
            return
        for item in reader:
            st.pass_idx, st.cursor, b, entry = item
            if b.__class__ is str:
                st.drops[b] += 1
                st.stats["drops"][b] = st.stats["drops"].get(b, 0) + 1
                continue
            q = queues[b]
            q.append(entry)
            occ += 1
            ready += len(q) == sizes[b]
            if occ >= want and ready:
                break
            if occ == self.buffer_size and not ready and not self._warned_overflow:
                self._warned_overflow = True
                log.warning("sampler: buffer full (%d) but no bucket has a full batch; reading past buffer_size", occ)
        else:
            st.exhausted = True
        st.occupancy, st.ready = occ, ready

    def _nearest(self, b: int, ok) -> int:
        for dist in range(len(self.sizes)):
            for c in (b - dist, b + dist):
                if 0 <= c < len(self.sizes) and ok(c):
                    return c
        raise AssertionError("no bucket has a batch")

    def _next_batch(self, st: _State, reader):
        """Advances the state by one batch; returns (bucket, entries) or None at the epoch end."""
        if not st.exhausted:
            self._fill(st, reader, min(self.buffer_size, self.start + st.batches * self.ramp))
        if st.exhausted and st.drain is None:
            st.drain = self._plan_drain(st)
        if st.drain is not None and not any(st.drain):
            return None
        # One draw per batch on every rank keeps the shared selection RNG aligned across ranks.
        u = st.select_rng.random()
        drawn = min(bisect_right(self.cum_weights, u), len(self.sizes) - 1)
        if st.drain is not None:
            b = self._nearest(drawn, lambda c: len(st.drain[c]) > 0)
            batch = st.drain[b].pop()
        else:
            b = self._nearest(drawn, lambda c: len(st.queues[c]) >= self.sizes[c])
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
            drain.append([q[i : i + k] for i in range(0, len(q), k)])
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
            return [e[0] for e in batch]
        if self.is_list:
            return [self.source[e[0]] for e in batch]
        return [e[3] for e in batch]

    def _reader(self, st: _State, threaded: bool):
        items = self._stream(st.epoch, st.pass_idx, st.cursor, st.skip)
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
        if st.drops:
            log.warning("sampler: rank %d epoch %d dropped %s", self.rank, st.epoch, dict(st.drops))

    # --- checkpointing

    def _copy(self, st: _State) -> _State:
        c = copy.copy(st)
        c.queues = [list(q) for q in st.queues]
        c.drain = None if st.drain is None else [[list(x) for x in bb] for bb in st.drain]
        c.data_rng, c.select_rng = random.Random(), random.Random()
        c.data_rng.setstate(st.data_rng.getstate())
        c.select_rng.setstate(st.select_rng.getstate())
        c.stats, c.drops = copy.deepcopy(st.stats), Counter(st.drops)
        return c

    def _fingerprint(self) -> dict:
        return {"durations": self.bins.durations, "tokens": self.bins.tokens, "batch_sizes": self.sizes,
                "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "sync_buckets": self.sync_buckets, "infinite": self.infinite}

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

        def pack(entries):  # (key, duration, num_tokens); the example itself is re-read on load
            return [list(e[:3]) for e in entries]

        return {
            "fingerprint": self._fingerprint(),
            "epoch": st.epoch, "target": st.target, "pass_idx": st.pass_idx, "cursor": st.cursor,
            "batches": st.batches, "exhausted": st.exhausted,
            "queues": [pack(q) for q in st.queues],
            "drain": None if st.drain is None else [[pack(x) for x in bb] for bb in st.drain],
            "data_rng": st.data_rng.getstate(), "select_rng": st.select_rng.getstate(),
            "stats": copy.deepcopy(st.stats), "drops": dict(st.drops), "skip": st.skip,
        }

    def _rank_order(self, epoch: int, pass_idx: int, skip, rank: int, world_size: int) -> np.ndarray:
        """The examples `rank` reads in this pass, in order: its share of the pass's permutation,
        after removing those that `skip` says were used before a change of world size."""
        perm = self._permutation(epoch, pass_idx)
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
        first = states[0]
        pass_idx = max(sd["pass_idx"] for sd in states)
        used = np.zeros(len(self.entries), dtype=bool)
        for old_rank, sd in enumerate(states):
            if sd["pass_idx"] != pass_idx or sd["cursor"] is None:
                continue
            used[self._rank_order(sd["epoch"], pass_idx, sd.get("skip"), old_rank, len(states))[: sd["cursor"]]] = True
            queued = [e[0] for q in sd["queues"] for e in q]
            used[queued] = False
        self.epoch = first["epoch"]
        fresh = self._fresh_state()
        return {
            "fingerprint": self._fingerprint(), "epoch": first["epoch"], "target": None, "pass_idx": pass_idx,
            "cursor": None, "batches": first["batches"], "exhausted": False, "queues": [[] for _ in self.sizes],
            "drain": None, "data_rng": fresh.data_rng.getstate(), "select_rng": first["select_rng"],
            "stats": copy.deepcopy(states[min(self.rank, len(states) - 1)]["stats"]), "drops": {},
            "skip": (pass_idx, np.packbits(used).tobytes()),
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restores a state; the next iteration continues exactly where it was taken."""
        mine = self._fingerprint()
        for k, v in sd["fingerprint"].items():
            if json.loads(json.dumps(v)) != json.loads(json.dumps(mine[k])):
                raise ValueError(f"sampler state was saved with {k}={v!r}, this sampler has {mine[k]!r}")

        def unpack(es):
            out = []
            for key, d, n in es:
                key = key if self.is_list else tuple(key)
                out.append((key, d, n, None if self.is_list else self.source.get(key)))
            return out

        def rng(state):
            r = random.Random()
            r.setstate((state[0], tuple(state[1]), state[2]))
            return r

        self.epoch, self._stats = sd["epoch"], copy.deepcopy(sd["stats"])
        st = _State(epoch=sd["epoch"], data_rng=rng(sd["data_rng"]), select_rng=rng(sd["select_rng"]),
                    stats=self._stats, target=sd["target"], pass_idx=sd["pass_idx"], cursor=sd["cursor"],
                    batches=sd["batches"], exhausted=sd["exhausted"], queues=[unpack(q) for q in sd["queues"]],
                    drops=Counter(sd["drops"]), skip=sd.get("skip"))
        st.drain = None if sd["drain"] is None else [[unpack(x) for x in bb] for bb in sd["drain"]]
        st.occupancy = sum(map(len, st.queues))
        st.ready = sum(len(q) >= k for q, k in zip(st.queues, self.sizes))
        self._pending, self._live = st, None


def _dist_info(rank, world_size) -> tuple:
    if rank is not None and world_size is not None:
        return rank, world_size
    torch = sys.modules.get("torch")  # if torch was never imported, no process group can exist
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return rank or 0, world_size or 1


# --- CLI ----------------------------------------------------------------------------------------


def _sample_lines(paths: list, n: int | None, seed: int) -> tuple:
    """Uniform random sample of n non-empty lines over all manifests (reservoir sampling, one pass)."""
    rng, sample, seen, last = random.Random(seed), [], 0, time.time()
    for path in paths:
        with open(path, "rb") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if n is None or seen < n:
                    sample.append((path, line_no, line))
                elif (j := rng.randrange(seen + 1)) < n:
                    sample[j] = (path, line_no, line)
                seen += 1
                if seen % 100_000 == 0 and time.time() - last > 2:
                    last = time.time()
                    print(f"estimate-bins: scanned {seen:,} lines ({path})", file=sys.stderr)
    return sample, seen


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="sampler.py", description="Bucketing sampler tools.")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("estimate-bins", help="estimate 1D/2D bucket bins from JSONL manifests")
    e.add_argument("--manifest", action="append", required=True, help="JSONL with 'duration' (repeat for shards)")
    e.add_argument("--buckets", type=int, default=30, help="duration bins")
    e.add_argument("--sub-buckets", type=int, default=2, help="token sub-bins per duration bin (1 = 1D bucketing)")
    e.add_argument("--sample", type=int, default=None, help="estimate from a uniform random sample of this many lines")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--outlier-z", type=float, default=4.0, help="drop TPS outliers above this z-score per duration bin")
    e.add_argument("--tokenizer", default=None, help="sentencepiece model; else the 'num_tokens' field is used")
    e.add_argument("--text-field", default="text")
    e.add_argument("--prompt-tokens", type=int, default=0, help="added to each tokenized text (the decoder prompt)")
    e.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)

    t0 = time.time()
    lines, total = _sample_lines(args.manifest, args.sample, args.seed)
    sp = None
    if args.tokenizer:
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=args.tokenizer)
    durs, toks = [], []
    for path, line_no, line in lines:
        try:
            ex = json.loads(line)
            durs.append(float(ex["duration"]))
            toks.append(len(sp.encode(ex[args.text_field])) + args.prompt_tokens if sp else int(ex["num_tokens"]))
        except (ValueError, KeyError, TypeError) as err:
            need = args.text_field if sp else "num_tokens"
            raise SystemExit(f"{path}:{line_no}: bad line, need 'duration' and '{need}' ({err!r})") from None
    bins = estimate_bins(durs, toks, args.buckets, args.sub_buckets, args.outlier_z)
    meta = {"manifests": args.manifest, "lines": total, "sampled": len(lines), "seed": args.seed,
            "outlier_z": args.outlier_z}
    Path(args.output).write_text(json.dumps({**bins.to_dict(), "meta": meta}) + "\n")
    print(f"{'bucket':>6} {'<= s':>8} {'<= tokens':>9} {'max tps':>8} {'count':>7}", file=sys.stderr)
    counts = [c for row in bins.counts for c in row]
    for b, (d, t) in enumerate(bins.buckets()):
        i = bisect_left(bins.durations, d)
        print(f"{b:>6} {d:>8.2f} {t:>9} {bins.max_tps[i]:>8.2f} {counts[b]:>7}", file=sys.stderr)
    print(f"estimate-bins: {bins.num_buckets} buckets from {len(lines):,} of {total:,} lines "
          f"in {time.time() - t0:.1f}s -> {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
