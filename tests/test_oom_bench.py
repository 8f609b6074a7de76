"""bench/oom_bench.py's E2 machinery at toy scale: the paper-shaped workload, the duration
heuristic's tuned batch_duration and the per-bucket sizes, against a known memory function."""

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from aed.memory_oomptimizer import MemoryModel  # noqa: E402
from aed.train_data import bucket_shapes  # noqa: E402
from aed.data_audio import FeatureConfig, num_frames  # noqa: E402
from bins import estimate_bins  # noqa: E402
from common import paper_corpus  # noqa: E402
from oom_bench import largest_batch_duration, memory_of, model_sizes, run_epoch  # noqa: E402

# A memory function with the shape terms of a real step (bytes; T frames, U tokens): text-heavy,
# so that long-transcript outliers matter as at Canary-1B scale.
MODEL = MemoryModel([1e9, 2e4, 2.0, 4e5, 30.0, 100.0, 0.0])
FEATURES = FeatureConfig()
LIMIT = 4e9


def peak(n, d, t):
    return MODEL.predict(n, num_frames(round(d * FEATURES.sample_rate), FEATURES.hop_length), t)


@pytest.fixture(scope="module")
def workload():
    examples = paper_corpus(3000, seed=1)
    durs, toks = [e["duration"] for e in examples], [e["num_tokens"] for e in examples]
    return examples, estimate_bins(durs, toks, 6, 1)


def test_paper_workload_has_the_documented_shape():
    ex = paper_corpus(20_000, seed=0)
    d = np.array([e["duration"] for e in ex])
    t = np.array([e["num_tokens"] for e in ex])
    tps = (t - 6) / d  # without the prompt and EOS
    assert d.min() >= 0.5 and d.max() <= 40.0 and t.min() >= 6
    assert 0.05 <= np.mean((d >= 20) & (tps < 0.85)) <= 0.07  # long low-speech segments (6%)
    assert 0.004 <= np.mean(tps > 25) <= 0.01  # long-transcript outliers (1%), most above the paper's filter
    assert 3.0 <= np.median(tps) <= 4.5  # the four languages' speech rates
    assert paper_corpus(100, seed=3) == paper_corpus(100, seed=3)


def test_tuned_batch_duration_keeps_every_batch_under_the_limit_and_is_maximal(workload):
    examples, bins = workload
    tuned = largest_batch_duration(examples, bins, peak, LIMIT)
    assert tuned["fails_at"] - tuned["max_duration"] <= 1.0
    assert memory_of(tuned["batches"], peak).max() <= LIMIT
    assert sum(n for _, n, _, _ in tuned["batches"]) == tuned["stats"]["examples"] == len(examples)
    over, _ = run_epoch(examples, bins, max_duration=tuned["fails_at"])
    assert memory_of(over, peak).max() > LIMIT, "1 s more puts a batch over the limit"


def test_tps_filter_lowers_the_peak_and_per_bucket_sizes_fit_every_batch(workload):
    examples, bins = workload
    tuned = largest_batch_duration(examples, bins, peak, LIMIT)
    filtered, stats = run_epoch(examples, bins, max_duration=tuned["max_duration"], max_tps=bins.max_tps)
    assert stats["drops"]["tps_above_max"] > 0
    assert memory_of(filtered, peak).max() < memory_of(tuned["batches"], peak).max()

    sizes = model_sizes(MODEL, bucket_shapes(bins, FEATURES, dec_max_len=10_000), LIMIT)
    batches, stats = run_epoch(examples, bins, batch_sizes=sizes, max_tps=bins.max_tps)
    assert memory_of(batches, peak).max() <= LIMIT
    assert stats["examples"] / len(batches) > tuned["stats"]["examples"] / len(tuned["batches"])


def test_memory_model_round_trips_through_its_dict():
    again = MemoryModel.from_dict(MODEL.to_dict())
    assert again.predict(7, 1000, 80) == MODEL.predict(7, 1000, 80)
    with pytest.raises(ValueError, match="fit.json: missing coefficient"):
        MemoryModel.from_dict({"constant": 1.0}, where="fit.json")
