"""Peak training memory as a low-order function of the batch shape, fitted to measured steps.

    model = MemoryModel.fit([(B, T, U, peak_bytes), ...])   # measured or simulated steps
    model.predict(B, T, U)                                  # bytes
    model.max_batch_size(T, U, limit)                       # largest B that fits

Why: checking every batch of an epoch against a memory limit takes one step per batch, and a
simulated 1B-parameter step takes tens of seconds (aed/simulated_memory.py). For fixed weights,
precision and optimizer, what a step keeps alive at its peak is the weights, gradients and optimizer
state (a constant) plus, per utterance, activations that are sums of a few shape terms:

    T      encoder activations per frame (convolutions, feed-forward, attention outputs)
    T^2    encoder attention scores and the relative-position bias (B x H x T' x T')
    U      decoder activations per token and the B x U x V logits (V fixed)
    U T    decoder cross-attention (B x H x U x T')
    U^2    decoder self-attention (B x H x U x U)
    k U T  a transducer's joint (k x T' x U x V), built k = min(B, chunk) utterances at a time

so peak(B, T, U) = c + B (a1 T + a2 T^2 + a3 U + a4 U T + a5 U^2) + min(B, k) a6 U T, fitted by
least squares on relative error with non-negative a (an active set: a term whose coefficient comes
out negative is dropped). T counts feature frames, U tokens. The fit is an estimate: report its
error on shapes it was not fitted on (`relative_errors`) before trusting it.
"""

import math

import numpy as np

TERMS = ("B*T", "B*T^2", "B*U", "B*U*T", "B*U^2", "k*U*T")


def _features(B, T, U, chunk):
    k = min(B, chunk) if chunk else 0
    return [1.0, B * T, B * T * T, B * U, B * U * T, B * U * U, k * U * T]


class MemoryModel:
    def __init__(self, coef, chunk: int = 0):
        self.coef = list(coef)  # constant, then one per TERMS entry
        self.chunk = chunk  # transducer chunk size (0: no joint term)

    @classmethod
    def fit(cls, samples, chunk: int = 0) -> "MemoryModel":
        """samples: [(B, T, U, peak bytes)]; chunk: the transducer's chunk size, 0 for an AED."""
        X = np.array([_features(B, T, U, chunk) for B, T, U, _ in samples], dtype=np.float64)
        y = np.array([p for *_, p in samples], dtype=np.float64)
        w = 1.0 / y  # relative error: small and large steps count alike
        scale = np.abs(X).max(0)
        scale[scale == 0] = 1.0
        active = [j for j in range(X.shape[1]) if chunk or j != len(TERMS)]
        while True:
            sol, *_ = np.linalg.lstsq((X[:, active] / scale[active]) * w[:, None], y * w, rcond=None)
            negative = [j for j, c in zip(active, sol) if j > 0 and c < 0]
            if not negative:
                break
            active.remove(min(negative, key=lambda j: sol[active.index(j)]))
        coef = np.zeros(X.shape[1])
        coef[active] = sol / scale[active]
        return cls(coef, chunk)

    def predict(self, B, T, U) -> float:
        return float(np.dot(self.coef, _features(B, T, U, self.chunk)))

    def max_batch_size(self, T, U, limit: float) -> int:
        """Largest B with predict(B, T, U) <= limit (0 if none); predict grows with B."""
        if self.predict(1, T, U) > limit:
            return 0
        lo, hi = 1, 2
        while self.predict(hi, T, U) <= limit:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.predict(mid, T, U) <= limit else (lo, mid)
        return lo

    def relative_errors(self, samples) -> list:
        """(predicted - measured) / measured for each (B, T, U, peak): negative = under-estimate."""
        return [self.predict(B, T, U) / p - 1 for B, T, U, p in samples]

    def to_dict(self) -> dict:
        return {"constant": self.coef[0], **dict(zip(TERMS, self.coef[1:])), "chunk": self.chunk}

    @classmethod
    def from_dict(cls, d: dict, where: str = "memory model") -> "MemoryModel":
        """The model `to_dict` wrote; `where` names the source in errors."""
        missing = sorted({"constant", *TERMS} - set(d))
        if missing:
            raise ValueError(f"{where}: missing coefficient(s) {missing}")
        return cls([float(d["constant"]), *(float(d[t]) for t in TERMS)], int(d.get("chunk", 0)))

    def __repr__(self):
        terms = " + ".join(f"{c:.3g} {n}" for n, c in zip(TERMS, self.coef[1:]) if c)
        return f"MemoryModel({self.coef[0] / 2**30:.2f} GiB + {terms} bytes)"


def fit_shapes(durations, tps, frames_per_second: float, target_seconds: float, max_tokens: int) -> list:
    """(B, T, U) shapes to fit on: every duration x tokens-per-second pair, at the batch size a
    duration heuristic of `target_seconds` gives (so the fit sees steps of realistic size)."""
    shapes = []
    for d in durations:
        for r in tps:
            B = max(1, math.floor(target_seconds / d))
            shapes.append((B, round(d * frames_per_second), max(2, min(max_tokens, round(r * d)))))
    return shapes
