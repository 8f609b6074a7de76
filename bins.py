"""Bucket bins for 2D bucketing (paper sec. 2): their file format, allocation and estimation.

Every example has an input length (`duration`, seconds) and an output length (`num_tokens`,
prompt included). A bucket is one (duration bound, token bound) cell; bounds are inclusive upper
bounds, buckets are numbered duration-major. Works on those two numbers only (no `aed` import).

Estimation (`estimate_bins`), from a sample, keeping a fixed number of buckets:
- `equal` (the paper's): cut the duration axis into N bins holding equal total audio, then cut
  each duration bin into M token sub-bins holding equal total tokens, after dropping that bin's
  tokens-per-second (TPS) outliers (z-score > 4) and recording its max TPS. Duplicate bounds
  (skewed data) are merged, the merged bin gets more sub-bins.
- `optimised` (default, beyond the paper): the same N x M buckets and TPS rule, but where speech
  rates vary, some duration bins need more token sub-bins than others. Dynamic programming picks
  duration edges, sub-bin counts and token edges with the least padding (see `_Layouts`).
`tools/estimate_bins.py` runs it on manifests with the training tokenizer.

Allocation (`Allocator`): `strict` puts an example in its duration bin's first token sub-bin that
holds it, else drops it; `flexible` (the paper's) takes the first bucket whose two bounds both fit,
so an example with a long transcript moves to a longer bucket instead of being dropped. Examples
longer than every bin, or outside the optional TPS limits, are dropped with a reason.
"""

import json
import math
from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import numpy as np


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


# --- allocation ---------------------------------------------------------------------------------


def _per_bin(value, n: int, name: str):
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return [float(value)] * n
    if len(value) != n:
        raise ValueError(f"{name}: got {len(value)} values for {n} duration bins")
    return [float(v) for v in value]


class Allocator:
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


# --- estimation ---------------------------------------------------------------------------------


def _equal_mass_bounds(sorted_values: np.ndarray, n: int) -> np.ndarray:
    """Upper bounds of n bins over ascending values such that each bin holds ~1/n of their sum."""
    cum = np.cumsum(sorted_values)
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, n) / n)
    return np.append(sorted_values[np.minimum(cuts, len(cum) - 1)], sorted_values[-1])


def _tps_inliers(d: np.ndarray, t: np.ndarray, outlier_z: float) -> tuple:
    """(mask of a duration bin's examples that are not TPS outliers, the bin's max TPS among them).
    One-sided: only long-transcript outliers hurt (OOM, hallucinated labels), as in NeMo."""
    tps = t / d
    std = tps.std()
    ok = tps <= tps.mean() + outlier_z * std if std > 0 else np.ones(len(t), dtype=bool)
    return ok, math.ceil(float(tps[ok].max()) * 1000) / 1000  # rounded up: keeps the max itself


def _cut_positions(v: np.ndarray, candidates: int) -> np.ndarray:
    """Up to `candidates` end positions of bins over ascending v, at quantiles, never splitting
    equal values; the last is len(v)."""
    ends = np.flatnonzero(np.append(v[1:] != v[:-1], True)) + 1
    quantiles = np.linspace(len(v) / candidates, len(v), candidates)
    return np.unique(ends[np.minimum(np.searchsorted(ends, quantiles), len(ends) - 1)])


def _optimal_partition(v: np.ndarray, max_bins: int, candidates: int = 64, bounds: bool = True) -> tuple:
    """Bins over ascending values v that minimise the padding sum(bound of its bin - value), with
    bounds among ~`candidates` quantiles of v: (the least padding with m = 1..max_bins bins, the
    bounds of the best max_bins bins, or None without `bounds`: the layout search asks thousands of
    times for the padding alone). Dynamic programming over the cut positions."""
    pos = np.concatenate([[0], _cut_positions(v, candidates)])
    cum = np.concatenate([[0.0], np.cumsum(v, dtype=np.float64)])
    # cost[a, b]: padding of one bin holding v[pos[a]:pos[b]], whose bound is v[pos[b] - 1]
    count = pos[None, :] - pos[:, None]
    cost = count * v[np.maximum(pos - 1, 0)][None, :] - (cum[pos][None, :] - cum[pos][:, None])
    cost[count <= 0] = np.inf
    best, back, least = cost[0], [], [float(cost[0, -1])]
    for _ in range(1, max_bins):
        total = best[:, None] + cost  # the previous bins end at a, the next one covers a..b
        if bounds:
            back.append(np.argmin(total, axis=0))
        best = total.min(axis=0)
        least.append(float(best[-1]))
    if not bounds:
        return least, None
    cuts, b = [len(pos) - 1], len(pos) - 1
    for arg in reversed(back):
        b = int(arg[b])
        cuts.append(b)
    return least, [v[pos[c] - 1] for c in reversed(cuts) if c > 0]


def _padding(bins: "Bins", d: np.ndarray, t: np.ndarray) -> tuple:
    """(audio padding, text padding, drops, counts per bucket) of a sample allocated to bins, with
    every example padded to its bucket's bounds (an upper bound on the padding of real batches)."""
    alloc = Allocator(bins)
    where = np.array([b if isinstance(b, int) else -1 for b in map(alloc, d.tolist(), t.tolist())])
    ok = where >= 0
    bounds = np.array(bins.buckets(), dtype=np.float64)[where[ok]]
    audio = 1 - d[ok].sum() / bounds[:, 0].sum()
    text = 1 - t[ok].sum() / bounds[:, 1].sum() if bins.tokens else 0.0
    return audio, text, int((~ok).sum()), np.bincount(where[ok], minlength=bins.num_buckets)


def _equal_bins(d, t, num_buckets: int, sub_buckets: int, outlier_z: float) -> "Bins":
    bounds, merged = np.unique(_equal_mass_bounds(d, num_buckets), return_counts=True)
    tokens, max_tps, lo = [], [], 0
    for ub, m in zip(bounds, merged):
        hi = int(np.searchsorted(d, ub, side="right"))
        ok, mt = _tps_inliers(d[lo:hi], t[lo:hi], outlier_z)
        max_tps.append(mt)
        if sub_buckets > 1:
            sub = _equal_mass_bounds(np.sort(t[lo:hi][ok]), sub_buckets * int(m))
            tokens.append([int(x) for x in np.unique(sub)])
        lo = hi
    return Bins([float(x) for x in bounds], tokens or None, max_tps)


class _Layouts:
    """Layouts of `total` buckets: duration edges, the number of token sub-bins of each duration
    bin and their token edges. The search runs on an evenly spaced subsample of the (duration-
    sorted) sample, over `candidates` quantile cuts of the duration axis: a duration bin spans at
    most `widest` of them and holds at most `most_sub` token sub-bins. Final token edges and max
    TPS come from the whole sample."""

    def __init__(self, d, t, total: int, outlier_z: float, sample: int = 20_000, candidates: int = 120,
                 widest: int = 30, most_sub: int = 10):
        self.d, self.t, self.total, self.outlier_z = d, t, total, outlier_z
        step = max(1, len(d) // sample)
        ds, ts = d[::step], t[::step]
        self.pos = np.concatenate([[0], _cut_positions(ds, candidates)])
        self.ds = ds
        cum = np.concatenate([[0.0], np.cumsum(ds)])
        k, pos = len(self.pos) - 1, self.pos
        # [a, w(, m)]: padding of the duration bin over ds[pos[a]:pos[a + w + 1]] (with m sub-bins),
        # relative to the total duration (tokens) of the subsample
        self.audio = np.full((k, widest), np.inf)
        self.text = np.full((k, widest, most_sub), np.inf)
        for a in range(k):
            for w in range(min(widest, k - a)):
                lo, hi = pos[a], pos[a + w + 1]
                self.audio[a, w] = ((hi - lo) * ds[hi - 1] - (cum[hi] - cum[lo])) / cum[-1]
                ok, _ = _tps_inliers(ds[lo:hi], ts[lo:hi], outlier_z)
                text = _optimal_partition(np.sort(ts[lo:hi][ok]), most_sub, candidates=48, bounds=False)[0]
                self.text[a, w, : len(text)] = np.array(text) / ts.sum()

    def best(self, audio_weight: float) -> "Bins":
        """The layout with the least audio_weight * audio padding + text padding (dynamic
        programming over (duration cut, buckets used so far))."""
        k, widest, most_sub = self.text.shape
        total = self.total
        cost = audio_weight * self.audio[:, :, None] + self.text
        best = np.full((k + 1, total + 1), np.inf)  # [b, s]: least cost of ds[:pos[b]] in s buckets
        best[0, 0] = 0.0
        came = np.zeros((k + 1, total + 1, 2), dtype=np.int64)  # the (a, m) that gave best[b, s]
        for b in range(1, k + 1):
            a = np.arange(max(0, b - widest), b)  # the last duration bin covers ds[pos[a]:pos[b]] ...
            options = np.full((len(a), most_sub, total + 1), np.inf)  # ... with m sub-bins: [a, m - 1, s]
            for m in range(1, min(most_sub, total) + 1):
                options[:, m - 1, m:] = best[a, : total + 1 - m] + cost[a, b - a - 1, m - 1][:, None]
            options = options.reshape(-1, total + 1)
            pick = np.argmin(options, axis=0)
            best[b] = options[pick, np.arange(total + 1)]
            came[b, :, 0], came[b, :, 1] = a[pick // most_sub], pick % most_sub + 1
        s = total if np.isfinite(best[k, total]) else int(np.argmin(best[k]))
        cuts, b = [], k
        while b > 0:
            a, m = came[b, s]
            cuts.append((self.pos[b], int(m)))
            b, s = int(a), s - int(m)
        d, t = self.d, self.t
        bounds, tokens, max_tps, lo = [], [], [], 0
        for end, m in reversed(cuts):
            hi = len(d) if end == self.pos[-1] else int(np.searchsorted(d, self.ds[end - 1], side="right"))
            ok, mt = _tps_inliers(d[lo:hi], t[lo:hi], self.outlier_z)
            bounds.append(float(d[hi - 1]))
            max_tps.append(mt)
            tokens.append(sorted({int(x) for x in _optimal_partition(np.sort(t[lo:hi][ok]), m)[1]}))
            lo = hi
        return Bins(bounds, tokens, max_tps)


def estimate_bins(durations, num_tokens, num_buckets: int = 30, sub_buckets: int = 2, outlier_z: float = 4.0,
                  method: str = "optimised", audio_weight: float | None = None) -> "Bins":
    """Bins from a sample of (duration, num_tokens).

    method="equal" (the paper's): num_buckets duration bins of equal total duration, each cut into
    sub_buckets token sub-bins of equal total tokens after dropping the duration bin's TPS
    outliers (z-score > outlier_z). method="optimised" (default; 2D only, 1D bins are always
    equal): the same number of buckets, num_buckets x sub_buckets, and the same TPS rule, but the
    duration edges, the number of token sub-bins of each duration bin and their token edges
    minimise the text padding while the audio padding stays at most that of the equal-count bins
    (every example padded to its bucket's bounds), and the longest token bound is kept, so flexible
    allocation drops no more of the sample. Speech rates that vary widely need more token sub-bins where the
    token counts spread most; measured in bench/sampler_bench.py.

    audio_weight (optimised only): instead of that rule, the layout with the least
    audio_weight x audio padding + text padding. Larger weights give less audio and more text
    padding; `bench/sampler_bench.py --frontier` prints the trade-off on a workload.
    """
    if method not in ("equal", "optimised"):
        raise ValueError(f"estimate_bins: method must be 'equal' or 'optimised', got {method!r}")
    if audio_weight is not None and not (method == "optimised" and sub_buckets > 1 and audio_weight > 0):
        raise ValueError("estimate_bins: audio_weight needs method='optimised', sub_buckets > 1 and a positive value")
    d = np.asarray(durations, dtype=np.float64)
    t = np.asarray(num_tokens, dtype=np.int64)
    keep = d > 0
    d, t = d[keep], t[keep]
    if len(d) == 0:
        raise ValueError("estimate_bins: no example with a positive duration")
    order = np.argsort(d, kind="stable")
    d, t = d[order], t[order]
    bins = _equal_bins(d, t, num_buckets, sub_buckets, outlier_z)
    equal_audio, _, _, counts = _padding(bins, d, t)
    if method == "optimised" and sub_buckets > 1:
        longest = max(row[-1] for row in bins.tokens)
        layouts = _Layouts(d, t, num_buckets * sub_buckets, outlier_z)

        def layout(log2_weight: float) -> tuple:
            candidate = layouts.best(2.0**log2_weight)
            # An example the equal-count bins keep fits a bucket up to their longest token bound, so
            # with that bound on the last bucket, flexible allocation drops no more than they do.
            candidate.tokens[-1][-1] = max(candidate.tokens[-1][-1], longest)
            audio, _, _, candidate_counts = _padding(candidate, d, t)
            return candidate, candidate_counts, audio <= equal_audio

        if audio_weight:
            bins, counts, _ = layout(math.log2(audio_weight))
        else:
            # The least text padding whose audio padding is no more than the equal-count bins': the
            # smallest audio weight that gets there, by bisection on its log (2^0 .. 2^6). If even
            # 2^6 does not, the equal-count bins stay.
            lo, hi = 0.0, 6.0
            found = layout(hi)
            if found[2]:
                for _ in range(5):
                    mid = (lo + hi) / 2
                    candidate = layout(mid)
                    lo, hi, found = (lo, mid, candidate) if candidate[2] else (mid, hi, found)
                bins, counts = found[0], found[1]
    starts = list(accumulate(bins.shape, initial=0))
    bins.counts = [counts[s:e].tolist() for s, e in zip(starts, starts[1:])]
    return bins
