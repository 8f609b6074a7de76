import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bins import Allocator, Bins, estimate_bins, load_batch_sizes, save_batch_sizes
from sampler import BucketingSampler

ROOT = Path(__file__).resolve().parents[1]


def make_examples(n, seed=0):
    rng = np.random.default_rng(seed)
    d = np.clip(rng.gamma(3.0, 3.0, n), 0.3, 30.0).round(2)
    t = np.maximum(1, d * rng.normal(4.0, 1.0, n)).astype(int) + 3
    return [{"id": i, "duration": float(a), "num_tokens": int(b)} for i, (a, b) in enumerate(zip(d, t))]


def make_bins(examples, buckets=8, sub=2, method="equal", audio_weight=None):
    return estimate_bins([e["duration"] for e in examples], [e["num_tokens"] for e in examples], buckets, sub,
                         method=method, audio_weight=audio_weight)


class Stream:
    """A streamed source (the protocol in sampler.py's docstring) over examples cut into shards:
    rank r reads line i of shard s when (i + s) % world_size == r, the shard order reshuffled
    every pass."""

    def __init__(self, examples, shards=1, name="m.jsonl"):
        k = max(1, -(-len(examples) // shards))
        self.shards, self.name = [examples[i : i + k] for i in range(0, len(examples), k)], name

    def read(self, seed, rank, world_size, cursor=None):
        order = list(range(len(self.shards)))
        random.Random(seed).shuffle(order)
        pos, line = cursor or (0, 0)
        for p in range(pos, len(order)):
            s = order[p]
            for i in range(line, len(self.shards[s])):
                if (i + s) % world_size == rank:
                    yield (s, i), (p, i + 1), dict(self.shards[s][i])
            line = 0

    def get(self, key):
        return dict(self.shards[key[0]][key[1]])

    def describe(self, key):
        return f"{self.name}:{key[1] + 1}"


def run(sampler, limit=None):
    out = []
    for batch in sampler:
        out.append((sampler.last_batch_info["bucket"], [b["id"] if isinstance(b, dict) else b for b in batch]))
        if limit is not None and len(out) == limit:
            break
    return out


EX = make_examples(3000)
BINS = make_bins(EX)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_every_example_once_per_epoch_and_equal_batch_counts(world_size):
    kw = dict(max_duration=60.0, buffer_size=500, yield_indices=True, world_size=world_size, seed=3)
    seen, counts = [], []
    for rank in range(world_size):
        s = BucketingSampler(EX, BINS, rank=rank, **kw)
        s.set_epoch(2)
        batches = list(s)
        counts.append(len(batches))
        assert len(batches) == len(s)
        seen += [i for b in batches for i in b]
    kept = [i for i, e in enumerate(EX) if isinstance(Allocator(BINS)(e["duration"], e["num_tokens"]), int)]
    assert sorted(seen) == kept
    assert len(set(counts)) == 1, counts  # the natural counts differ: ranks with fewer split batches


def test_a_finite_stream_over_ranks_uses_every_example_once():
    seen = []
    for rank in range(3):
        s = BucketingSampler(Stream(EX[:600], shards=2), BINS, batch_size=5, rank=rank, world_size=3, concurrent=False)
        seen += [e["id"] for b in s for e in b]
    assert sorted(seen) == list(range(600))


def test_epochs_reshuffle_and_same_seed_repeats():
    a = BucketingSampler(EX, BINS, max_duration=60.0, buffer_size=500, yield_indices=True)
    e0 = [list(b) for b in a]
    assert e0 == [list(b) for b in a]  # re-iterating a finished epoch repeats it
    a.set_epoch(1)
    assert e0 != [list(b) for b in a]


def test_no_batch_exceeds_its_limit():
    per_bucket = [[3 + i, 9 + i] for i in range(len(BINS.durations))]
    cases = [dict(max_duration=120.0), dict(batch_size=7), dict(batch_sizes=per_bucket)]
    bounds = BINS.buckets()
    for kw in cases:
        s = BucketingSampler(EX, BINS, buffer_size=400, **kw)
        for batch in s:
            b = s.last_batch_info["bucket"]
            d_ub, t_ub = bounds[b]
            assert all(e["duration"] <= d_ub and e["num_tokens"] <= t_ub for e in batch)
            assert len(batch) <= s.sizes[b]
            if "max_duration" in kw:
                longest = max(e["duration"] for e in batch)
                assert len(batch) * longest <= 120.0
            if "batch_size" in kw:
                assert len(batch) <= 7


def test_strict_vs_flexible_allocation():
    bins = Bins([2.0, 4.0], [[10, 20], [30, 40]])
    strict, flexible = Allocator(bins, "strict"), Allocator(bins, "flexible")
    assert strict(1.5, 15) == flexible(1.5, 15) == 1
    assert strict(1.5, 25) == "tokens_over_bins" and flexible(1.5, 25) == 2  # long transcript moves up
    assert strict(3.0, 5) == flexible(3.0, 5) == 2
    assert strict(1.0, 41) == flexible(1.0, 41) == "tokens_over_bins"
    assert flexible(4.5, 5) == "duration_over_bins" and flexible(0.0, 5) == "bad_duration"
    exs = [{"duration": d, "num_tokens": n} for d, n in [(1.5, 15), (1.5, 25), (1.0, 41), (4.5, 5)]]
    for allocation, kept, drops in [("strict", 1, {"tokens_over_bins": 2, "duration_over_bins": 1}),
                                    ("flexible", 2, {"tokens_over_bins": 1, "duration_over_bins": 1})]:
        s = BucketingSampler(exs, bins, batch_size=1, allocation=allocation)
        assert sum(len(b) for b in s) == kept and s.stats["drops"] == drops


def test_tps_filter_scalar_and_per_bin():
    bins = Bins([2.0, 4.0])
    exs = [{"duration": d, "num_tokens": n} for d, n in [(1.0, 30), (1.0, 5), (3.0, 30), (3.0, 1)]]
    s = BucketingSampler(exs, bins, batch_size=4, max_tps=20, min_tps=2)
    assert sum(len(b) for b in s) == 2 and s.stats["drops"] == {"tps_above_max": 1, "tps_below_min": 1}
    s = BucketingSampler(exs, bins, batch_size=4, max_tps=[40, 5])  # per duration bin
    assert sum(len(b) for b in s) == 3 and s.stats["drops"] == {"tps_above_max": 1}


def test_bins_equal_occupancy_outliers_and_merged_duplicates():
    rng = np.random.default_rng(1)
    d = rng.uniform(1.0, 20.0, 50_000)
    t = (d * rng.uniform(2.0, 6.0, len(d))).astype(int) + 1
    t[:20] = 2000  # TPS outliers
    bins = estimate_bins(d, t, num_buckets=10, sub_buckets=2, method="equal")
    edges = [0.0] + bins.durations
    per_bin = [d[(d > lo) & (d <= hi)].sum() for lo, hi in zip(edges, edges[1:])]
    assert max(per_bin) / min(per_bin) < 1.05
    for lo, hi, toks in zip(edges, edges[1:], bins.tokens):
        tt = t[(d > lo) & (d <= hi) & (t < 2000)]
        assert abs(tt[tt <= toks[0]].sum() / tt.sum() - 0.5) < 0.05
    assert max(bins.max_tps) < 7.0  # the 2000-token outliers were excluded from max TPS and bounds
    assert sum(map(sum, bins.counts)) == len(d) - 20  # outliers fit no bucket
    skew = np.concatenate([rng.uniform(1, 10, 1000), np.full(3000, 30.0)])
    sk = estimate_bins(skew, (skew * 4).astype(int), num_buckets=10, sub_buckets=2, method="equal")
    assert sk.durations == sorted(set(sk.durations)) and sk.durations[-1] == 30.0
    assert len(sk.tokens[-1]) >= 2 and len(sk.durations) < 10


def wide_examples(n, seed=0):
    """Speech rates from 0.5 to 6 tokens/s, long segments with little speech, 1% transcript outliers."""
    rng = np.random.default_rng(seed)
    d = np.clip(0.5 + 39.5 * rng.beta(1.3, 3.0, n), 0.5, 40.0).round(2)
    tps = np.exp(rng.uniform(np.log(0.5), np.log(6.0), n))
    tps[: n // 20] = rng.uniform(0.02, 0.4, n // 20)
    tps[-(n // 100):] *= 4
    t = (tps * d).astype(int) + 6
    return [{"id": i, "duration": float(a), "num_tokens": int(b)} for i, (a, b) in enumerate(zip(d, t))]


WIDE = wide_examples(4000)
OPT = make_bins(WIDE, 10, 3, method="optimised")


def padding_of(examples, bins):
    s = BucketingSampler(examples, bins, max_duration=200.0, buffer_size=1000)
    for _ in s:
        pass
    return s.stats


def test_optimised_bins_keep_the_bucket_count_and_pad_less_without_dropping_more():
    equal = make_bins(WIDE, 10, 3, method="equal")
    assert OPT.num_buckets == equal.num_buckets == 30 and len(set(OPT.shape)) > 1  # sub-bins where needed
    assert OPT.max_tps is not None and len(OPT.max_tps) == len(OPT.durations)
    opt, eq = padding_of(WIDE, OPT), padding_of(WIDE, equal)
    assert sum(opt["drops"].values()) <= sum(eq["drops"].values())
    assert opt["audio_padding"] <= eq["audio_padding"] + 0.005
    assert opt["text_padding"] < eq["text_padding"] - 0.03
    assert make_bins(WIDE, 10, 3, method="optimised") == OPT  # deterministic
    tiny = make_bins(WIDE[:5], 10, 3, method="optimised")  # fewer distinct values than buckets
    assert tiny.num_buckets <= 30 and sum(map(sum, tiny.counts)) == 5


def test_audio_weight_trades_audio_padding_for_text_padding():
    light, heavy = (make_bins(WIDE, 10, 3, method="optimised", audio_weight=w) for w in (1.0, 64.0))
    assert light.num_buckets == heavy.num_buckets == 30
    assert len(light.durations) < len(heavy.durations)  # fewer duration bins, more token sub-bins
    light_pad, heavy_pad = padding_of(WIDE, light), padding_of(WIDE, heavy)
    assert light_pad["audio_padding"] > heavy_pad["audio_padding"]
    assert light_pad["text_padding"] < heavy_pad["text_padding"]
    for bad in (dict(method="equal", audio_weight=4.0), dict(method="optimised", audio_weight=0.0)):
        with pytest.raises(ValueError, match="audio_weight"):
            make_bins(WIDE, 10, 3, **bad)


@pytest.mark.parametrize("world_size", [1, 3])
def test_optimised_bins_every_example_once_and_resume(world_size):
    kw = dict(max_duration=200.0, buffer_size=300, yield_indices=True, world_size=world_size, seed=1)
    seen, counts = [], []
    for rank in range(world_size):
        batches = list(BucketingSampler(WIDE, OPT, rank=rank, **kw))
        counts.append(len(batches))
        seen += [i for b in batches for i in b]
    kept = [i for i, e in enumerate(WIDE) if isinstance(Allocator(OPT)(e["duration"], e["num_tokens"]), int)]
    assert sorted(seen) == kept and len(set(counts)) == 1
    resume_check(lambda: BucketingSampler(WIDE, OPT, rank=world_size - 1, **kw), cut=31, rewind=4)


def test_bins_and_batch_sizes_files_roundtrip(tmp_path):
    BINS.save(tmp_path / "bins.json")
    assert Bins.load(tmp_path / "bins.json") == BINS
    sizes = [[2] * n for n in BINS.shape]
    save_batch_sizes(tmp_path / "bs.json", BINS, sizes)
    bins, got = load_batch_sizes(tmp_path / "bs.json")
    assert bins == BINS and got == sizes
    with pytest.raises(ValueError, match="ascending"):
        Bins([3.0, 2.0])


def test_estimate_bins_tool_counts_tokens_as_training_does(tmp_path, capsys):
    from aed.data_manifest import read_manifest
    from aed.data_batch import encode_utterance
    from aed.data_tokenizer import Tokenizer
    from tools.estimate_bins import main

    tok_dir = ROOT / "data/mini/tokenizer"
    lines = (ROOT / "data/mini/train.jsonl").read_text().splitlines()
    rows = sorted((json.loads(x) for x in lines), key=lambda e: e["duration"])  # a head-only sample would be biased
    for e in rows:
        e["audio_filepath"] = str(ROOT / "data/mini" / e["audio_filepath"])
    bad = ['{"duration": 2.0}', '{"audio_filepath": "a.wav", "duration": 1.0, "text": "hi", "lang": "xx"}']
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join([json.dumps(e) for e in rows] + bad) + "\n")
    main(["--manifest", str(path), "--tokenizer", str(tok_dir), "--buckets", "4", "--sub-buckets", "2",
          "--method", "equal", "-o", str(tmp_path / "b.json")])
    out = json.loads((tmp_path / "b.json").read_text())
    assert out["meta"]["skipped"] == {"bad_line": 1, "not_tokenizable": 1}
    assert "skipped 1 sampled lines (bad_line)" in capsys.readouterr().err
    tok = Tokenizer.load(tok_dir)
    utts = read_manifest(str(ROOT / "data/mini/train.jsonl"))
    n = [len(encode_utterance(tok, u)[0]) for u in utts]
    assert Bins.load(tmp_path / "b.json") == estimate_bins([u.duration for u in utts], n, 4, 2, method="equal")

    main(["--manifest", str(path), "--tokenizer", str(tok_dir), "--sample", "50", "-o", str(tmp_path / "s.json")])
    assert json.loads((tmp_path / "s.json").read_text())["meta"]["sampled"] == 50
    assert Bins.load(tmp_path / "s.json").durations[-1] > 2.5  # uniform over the sorted file, not its head (<= 1.7 s)


class SlowStream(Stream):
    """Random delays in the reader, to shake the producer/consumer timing."""

    def read(self, seed, rank, world_size, cursor=None):
        jitter = random.Random()
        for item in super().read(seed, rank, world_size, cursor):
            if jitter.random() < 0.02:
                time.sleep(0.002)
            yield item


def test_same_batches_with_and_without_concurrency():
    kw = dict(max_duration=60.0, buffer_size=300, seed=7)
    ref = run(BucketingSampler(Stream(EX[:1500]), BINS, concurrent=False, **kw))
    assert run(BucketingSampler(Stream(EX[:1500]), BINS, concurrent=True, **kw)) == ref
    assert run(BucketingSampler(SlowStream(EX[:1500]), BINS, concurrent=True, **kw)) == ref
    assert sorted(i for _, b in ref for i in b) == list(range(1500))


def test_sync_buckets_same_buckets_different_data():
    kw = dict(max_duration=60.0, buffer_size=800, yield_indices=True, world_size=4, infinite=True)
    runs = [run(BucketingSampler(EX, BINS, rank=r, **kw), limit=200) for r in range(4)]
    same = np.mean([len({r[k][0] for r in runs}) == 1 for k in range(200)])
    assert same > 0.9
    data = [{i for _, b in r[:20] for i in b} for r in runs]
    assert all(not (data[0] & x) for x in data[1:])
    unsync = [run(BucketingSampler(EX, BINS, rank=r, sync_buckets=False, **kw), limit=200) for r in range(4)]
    assert np.mean([len({r[k][0] for r in unsync}) == 1 for k in range(200)]) < 0.2


def agreement_at(buffer_size, **kw):
    """Share of steps (after the fill ramp) on which two simulated ranks use the same bucket."""
    kw = dict(max_duration=60.0, buffer_size=buffer_size, yield_indices=True, world_size=2, infinite=True, **kw)
    runs = [run(BucketingSampler(EX, BINS, rank=r, **kw), limit=700) for r in range(2)]
    return np.mean([runs[0][k][0] == runs[1][k][0] for k in range(100, 700)])


def test_sync_buckets_agree_with_a_small_buffer(caplog):
    assert agreement_at(100) > 0.9  # the ranks read on until the drawn bucket has a batch
    with caplog.at_level("WARNING", logger="sampler"):
        assert agreement_at(100, overfill=1.0) < 0.6  # fall back once the buffer is full: the paper's
    warned = [r.getMessage() for r in caplog.records if "took the drawn bucket" in r.getMessage()]
    assert warned and "buffer_size=500 should give 90%" in warned[0]
    assert agreement_at(500, overfill=1.0) > 0.9  # the suggested buffer keeps its promise


def test_resume_while_reading_on_for_the_drawn_bucket():
    resume_check(lambda: BucketingSampler(EX, BINS, max_duration=60.0, buffer_size=100, world_size=2, rank=1),
                 cut=77, rewind=5)
    kw = dict(max_duration=60.0, buffer_size=80, seed=7, infinite=True)
    ref = run(BucketingSampler(Stream(EX[:1500]), BINS, concurrent=False, **kw), limit=300)
    assert run(BucketingSampler(SlowStream(EX[:1500]), BINS, concurrent=True, **kw), limit=300) == ref
    s = BucketingSampler(Stream(EX[:1500]), BINS, concurrent=True, **kw)
    head = run(s, limit=120)
    s2 = BucketingSampler(Stream(EX[:1500]), BINS, concurrent=True, **kw)
    s2.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert head + run(s2, limit=180) == ref


def resume_check(make, cut, rewind=0):
    ref = run(make())
    s = make()
    head = run(s, limit=cut + rewind)
    sd = json.loads(json.dumps(s.state_dict(rewind=rewind)))  # also proves the state is plain data
    s2 = make()
    s2.load_state_dict(sd)
    assert head[:cut] + run(s2) == ref
    assert s2.stats["batches"] == len(ref)


def test_resume_mid_epoch_list_2d_per_bucket_sizes():
    sizes = [[4 + i, 2 + i] for i in range(len(BINS.durations))]
    resume_check(lambda: BucketingSampler(EX, BINS, batch_sizes=sizes, buffer_size=400, world_size=2, rank=1), cut=57)


def test_resume_mid_epoch_concurrent_stream_shards():
    def make():
        return BucketingSampler(Stream(EX[:1500], shards=3), BINS, max_duration=60.0, buffer_size=300,
                                concurrent=True)

    resume_check(make, cut=40)


def test_resume_in_drain_phase_and_with_rewind():
    make = lambda: BucketingSampler(EX, BINS, max_duration=60.0, buffer_size=300)  # noqa: E731
    n = len(make())
    resume_check(make, cut=n - 3)
    resume_check(make, cut=50, rewind=13)  # a DataLoader had prefetched 13 batches


def test_resume_infinite():
    make = lambda: BucketingSampler(EX[:400], BINS, max_duration=60.0, buffer_size=200, infinite=True)  # noqa: E731
    ref = run(make(), limit=250)
    s = make()
    head = run(s, limit=90)
    s2 = make()
    s2.load_state_dict(s.state_dict())
    assert head + run(s2, limit=160) == ref
    counts = np.bincount([i for _, b in ref for i in b], minlength=400)
    assert counts.sum() > 2 * 400 and (counts >= 2).mean() > 0.9  # several reshuffled passes


def test_batch_numbers_continue_across_resume_with_rewind():
    """last_batch_info's number (what seeds a training example's augmentation) is replayed on resume."""
    make = lambda: BucketingSampler(EX[:400], BINS, max_duration=60.0, buffer_size=200, infinite=True)  # noqa: E731
    s, numbers = make(), []
    for _ in zip(range(30), s):
        numbers.append(s.last_batch_info["number"])
    assert numbers == list(range(1, 31))
    s2 = make()
    s2.load_state_dict(s.state_dict(rewind=7))  # a DataLoader had prefetched 7 batches
    next(iter(s2))
    assert s2.last_batch_info["number"] == 24


def test_resume_infinite_concurrent_shards_with_rewind():
    def make(concurrent):
        return BucketingSampler(Stream(EX[:900], shards=3), BINS, max_duration=60.0, buffer_size=400, infinite=True,
                                concurrent=concurrent, world_size=2, rank=1)

    ref = run(make(False), limit=400)
    assert run(make(True), limit=400) == ref
    s = make(True)
    head = run(s, limit=150)
    s2 = make(True)
    s2.load_state_dict(json.loads(json.dumps(s.state_dict(rewind=7))))
    assert head[:143] + run(s2, limit=257) == ref


def test_resume_through_the_usual_epoch_loop():
    make = lambda: BucketingSampler(EX, BINS, max_duration=60.0, buffer_size=300, yield_indices=True)  # noqa: E731
    ref = make()
    ref.set_epoch(1)
    ref = [list(b) for b in ref]
    s = make()
    s.set_epoch(1)
    head = [list(b) for _, b in zip(range(20), s)]
    sd = s.state_dict()
    s2 = make()
    s2.load_state_dict(sd)
    s2.set_epoch(1)  # what a training loop does at the top of every epoch
    assert head + [list(b) for b in s2] == ref


def over_limit(examples, bins, max_duration):
    """(kept, dropped) example indices under max_duration: an example longer than it fits no batch,
    whatever its bucket; a shorter one in a bucket that reaches past the limit still trains."""
    allocate = Allocator(bins)
    usable = [i for i, e in enumerate(examples) if isinstance(allocate(e["duration"], e["num_tokens"]), int)]
    return ([i for i in usable if examples[i]["duration"] <= max_duration],
            [i for i in usable if examples[i]["duration"] > max_duration])


def limit_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "no batch can hold" in r.getMessage()]


@pytest.mark.parametrize("world_size", [1, 3])
def test_over_long_examples_are_dropped_counted_and_named_once(world_size, caplog):
    kept, over = over_limit(EX, BINS, 12.0)
    assert kept and over  # BINS reach 30 s: the longer buckets get batch size 0
    kw = dict(max_duration=12.0, buffer_size=300, yield_indices=True, world_size=world_size, seed=2)
    seen, counts, drops = [], [], 0
    with caplog.at_level("WARNING", logger="sampler"):
        for rank in range(world_size):
            s = BucketingSampler(EX, BINS, rank=rank, **kw)
            batches = list(s)
            assert len(batches) == len(s)
            counts.append(len(batches))
            seen += [i for b in batches for i in b]
            drops += s.stats["drops"]["over_batch_limit"]
    assert sorted(seen) == kept  # the rest, each exactly once
    assert len(set(counts)) == 1, counts
    assert drops == len(over)
    warned = limit_warnings(caplog)
    longest = max(EX[i]["duration"] for i in over)
    assert len(warned) == 1, warned  # one per run: rank 0 speaks for the list every rank holds
    assert f"dropping {len(over)} of {len(EX)} examples (the longest {longest:.2f} s)" in warned[0]
    assert "max_duration=12 (train.max_duration)" in warned[0]
    resume_check(lambda: BucketingSampler(EX, BINS, rank=world_size - 1, **kw), cut=20, rewind=3)


def test_over_long_examples_are_dropped_from_a_stream(caplog):
    kept, over = over_limit(EX[:1500], BINS, 12.0)
    kw = dict(max_duration=12.0, buffer_size=300, seed=7)
    s = BucketingSampler(Stream(EX[:1500]), BINS, concurrent=True, **kw)
    with caplog.at_level("WARNING", logger="sampler"):
        ref = run(s)
    warned, first = limit_warnings(caplog), min(over)  # one shard, one rank: read in file order
    assert len(warned) == 1 and f"m.jsonl:{first + 1} ({EX[first]['duration']:.2f} s)" in warned[0], warned
    assert "max_duration=12 (train.max_duration)" in warned[0]
    assert sorted(i for _, b in ref for i in b) == kept
    assert s.stats["drops"]["over_batch_limit"] == len(over)
    never = [b for b, k in enumerate(s.sizes) if not k]  # a stream's weights come from BINS.counts
    assert np.all(np.diff(s.cum_weights, prepend=0.0)[never] == 0)
    assert run(BucketingSampler(Stream(EX[:1500]), BINS, concurrent=False, **kw)) == ref

    kw = dict(kw, infinite=True, world_size=2, rank=1)
    ref = run(BucketingSampler(Stream(EX[:1500]), BINS, concurrent=False, **kw), limit=300)
    s = BucketingSampler(Stream(EX[:1500]), BINS, concurrent=True, **kw)
    head = run(s, limit=120)
    s2 = BucketingSampler(Stream(EX[:1500]), BINS, concurrent=True, **kw)
    s2.load_state_dict(json.loads(json.dumps(s.state_dict(rewind=5))))
    assert head[:115] + run(s2, limit=185) == ref


def test_zero_batch_sizes_drop_their_buckets_and_all_zero_is_an_error():
    sizes = [[4, 0] if i % 2 else [0, 3] for i in range(len(BINS.durations))]  # zeros between usable buckets
    # overfill=1: falls back to the nearest bucket with a batch often, and that is never one of size 0
    s = BucketingSampler(EX, BINS, batch_sizes=sizes, buffer_size=100, overfill=1.0, yield_indices=True)
    flat = [k for row in sizes for k in row]
    where = [Allocator(BINS)(e["duration"], e["num_tokens"]) for e in EX]
    assert sorted(i for b in s for i in b) == [i for i, a in enumerate(where) if isinstance(a, int) and flat[a]]
    assert s.stats["drops"]["over_batch_limit"] == sum(isinstance(a, int) and not flat[a] for a in where)
    make = lambda: BucketingSampler(EX, BINS, batch_sizes=sizes, buffer_size=20, yield_indices=True)  # noqa: E731
    s = make()
    s.load_state_dict(make().state_dict())  # saved before the first batch: no bucket is full yet
    assert run(s) == run(make())
    with pytest.raises(ValueError, match=r"no example fits a batch: max_duration=0.2 \(train.max_duration\) holds "
                                         r"examples of up to 0.20 s"):
        BucketingSampler(EX, BINS, max_duration=0.2)
    with pytest.raises(ValueError, match=r"batch_sizes \(train.batch_sizes\) gives every bucket batch size 0"):
        BucketingSampler(EX, BINS, batch_sizes=[0] * BINS.num_buckets)


def test_resume_rejects_a_different_configuration():
    sd = BucketingSampler(EX, BINS, batch_size=4).state_dict()
    with pytest.raises(ValueError, match="batch_sizes"):
        BucketingSampler(EX, BINS, batch_size=5).load_state_dict(sd)


class Failing(Stream):
    """Fails after its examples, as a source whose reader meets a broken line."""

    def read(self, seed, rank, world_size, cursor=None):
        yield from super().read(seed, rank, world_size, cursor)
        raise OSError(f"{self.name}:{len(self.shards[0]) + 1}: unreadable")


def test_producer_errors_reach_the_consumer():
    with pytest.raises(OSError, match=r"m\.jsonl:301: unreadable"):
        list(BucketingSampler(Failing(EX[:300]), BINS, max_duration=60.0, buffer_size=100, concurrent=True))
    with pytest.raises(ValueError, match=r"m\.jsonl:1: no 'num_tokens' field"):
        list(BucketingSampler(Stream([{"duration": 2.0}]), BINS, batch_size=2, concurrent=True))
    with pytest.raises(ValueError, match=r"m\.jsonl:1: field 'duration'"):
        list(BucketingSampler(Stream([{"num_tokens": 3}]), BINS, batch_size=2))
    with pytest.raises(ValueError, match=r"examples\[1\]: no 'num_tokens' field"):
        BucketingSampler([EX[0], {"duration": 2.0}], BINS, batch_size=2)


def test_clean_shutdown_on_early_exit(tmp_path):
    (tmp_path / "examples.json").write_text(json.dumps(EX))
    code = f"""
import json, sys, threading
sys.path.insert(0, {str(ROOT)!r})
from bins import Bins
from sampler import BucketingSampler
bins, examples = Bins.load("bins.json"), json.load(open("examples.json"))
for k, batch in enumerate(BucketingSampler(examples, bins, max_duration=60.0, buffer_size=200, concurrent=True)):
    if k == 3:
        during = threading.active_count()
        break
print(during, threading.active_count())
"""
    BINS.save(tmp_path / "bins.json")
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "1"]  # a producer thread while iterating, gone after `break`
    assert time.time() - t0 < 30


def test_dataloader_batch_sampler():
    torch = pytest.importorskip("torch")

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return len(EX)

        def __getitem__(self, i):
            return torch.zeros(int(EX[i]["duration"] * 10) + 1)

    def collate(xs):
        x_lens = torch.tensor([len(x) for x in xs])
        return torch.nn.utils.rnn.pad_sequence(xs, batch_first=True), x_lens

    s = BucketingSampler(EX, BINS, max_duration=60.0, buffer_size=500, yield_indices=True)
    n = 0
    for x, x_lens in torch.utils.data.DataLoader(DS(), batch_sampler=s, collate_fn=collate):
        assert x.shape[0] == len(x_lens) and x.shape[1] == x_lens.max()
        n += 1
    assert n == len(s)


def test_no_threads_left_after_full_iteration():
    before = threading.active_count()
    list(BucketingSampler(Stream(EX[:200]), BINS, batch_size=4, buffer_size=100))
    assert threading.active_count() == before


def test_sortagrad_first_pass_shortest_buckets_first_same_on_every_rank_and_resumes():
    def make(sortagrad, rank=0):
        return BucketingSampler(EX, BINS, max_duration=60.0, infinite=True, world_size=2, rank=rank,
                                sortagrad=sortagrad)

    one_pass = int(make(True).curriculum.pass_batches)
    buckets = [b for b, _ in run(make(True), limit=one_pass)]
    assert buckets == sorted(buckets)  # the whole first pass climbs the buckets
    assert buckets[0] == 0 and buckets[-1] >= len(BINS.durations) * 2 - 2
    assert [b for b, _ in run(make(True, rank=1), limit=one_pass)] == buckets  # ranks stay in step
    later = [b for b, _ in run(make(True), limit=2 * one_pass)][one_pass:]
    assert later != sorted(later)  # then random buckets again, as without sortagrad
    assert [b for b, _ in run(make(False), limit=one_pass)] != buckets

    ref = run(make(True), limit=one_pass + 50)
    s = make(True)
    head = run(s, limit=one_pass // 2)
    s2 = make(True)
    s2.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert head + run(s2, limit=len(ref) - len(head)) == ref


def test_sortagrad_needs_bucket_counts_for_a_stream():
    with pytest.raises(ValueError, match="sortagrad"):
        BucketingSampler(Stream(EX[:100]), Bins(BINS.durations, BINS.tokens), max_duration=60.0, sortagrad=True)


def test_short_first_batches_hold_only_short_examples_then_everything_and_resume_exactly():
    def make(rank=0):
        return BucketingSampler(EX, BINS, max_duration=60.0, infinite=True, world_size=2, rank=rank,
                                short_first=(6.0, 150), yield_indices=True)

    batches = [b for _, b in run(make(), limit=400)]
    longest = [max(EX[i]["duration"] for i in b) for b in batches]
    assert max(longest[:150]) <= 6.0  # more than one pass over the short examples: they repeat
    assert len({i for b in batches[:150] for i in b}) < sum(len(b) for b in batches[:150])
    assert max(longest[150:]) > 20.0  # then the whole data set, in its proportions
    assert np.mean(longest[200:]) > 2 * np.mean(longest[:150])
    assert [bk for bk, _ in run(make(rank=1), limit=150)] == [bk for bk, _ in run(make(), limit=150)]

    with pytest.raises(ValueError, match="no usable example lasts 0.1 s or less"):
        BucketingSampler(EX, BINS, max_duration=60.0, infinite=True, short_first=(0.1, 10))

    for cut in (100, 170):  # inside the short batches and after them
        ref = run(make(), limit=300)
        s = make()
        head = run(s, limit=cut)
        s2 = make()
        s2.load_state_dict(json.loads(json.dumps(s.state_dict(rewind=7))))
        assert head[: cut - 7] + run(s2, limit=300 - cut + 7) == ref
