"""Bucket bins for 2D bucketing (paper sec. 2): their file format, allocation and estimation.

Every example has an input length (`duration`, seconds) and an output length (`num_tokens`,
prompt included). A bucket is one (duration bound, token bound) cell; bounds are inclusive upper
bounds, buckets are numbered duration-major. Works on those two numbers only (no `aed` import).

Estimation (`estimate_bins`): cut the duration axis into N bins holding equal total audio, then
cut each duration bin into M token sub-bins holding equal total tokens, after dropping that bin's
tokens-per-second (TPS) outliers (z-score > 4) and recording its max TPS. Duplicate bounds (skewed
data) are merged, the merged bin gets more sub-bins. `tools/estimate_bins.py` runs it on manifests
with the training tokenizer.

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
    alloc = Allocator(bins)
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
