import contextlib
import io
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from tools import make_shards
from torch.utils.data import DataLoader

from aed.data_audio import LogMel, load_audio
from aed.data_batch import Collate, ExampleDataset, decode_audio, encode_utterance
from aed.data_manifest import read_manifest
from aed.data_mixing import MixedSource
from aed.data_shards import INDEX_NAME, ShardSource, shard_order
from aed.data_tokenizer import Tokenizer
from bins import Bins
from sampler import BucketingSampler

MINI = Path(__file__).resolve().parents[1] / "data" / "mini"
N_GOOD = 40  # utterances of the mini set packed by the fixture, plus one cut segment


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """40 mini utterances + a segment with an offset + an invalid line + a missing file, in shards of 7."""
    tmp = tmp_path_factory.mktemp("shards")
    lines = []
    for line in (MINI / "train.jsonl").read_text().splitlines()[:N_GOOD]:
        d = json.loads(line)
        d["audio_filepath"] = str(MINI / d["audio_filepath"])
        lines.append(json.dumps(d))
    seg = json.loads(lines[0]) | {"offset": 0.5, "duration": 1.0}
    lines += [json.dumps(seg), '{"duration": 1.0, broken', json.dumps(seg | {"audio_filepath": "/nonexistent.flac"})]
    manifest = tmp / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    out = tmp / "out"
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        make_shards.main([str(manifest), "-o", str(out), "--shard-size", "7", "--shuffle", "--seed", "3",
                          "--tokenizer", str(MINI / "tokenizer")])
    return manifest, out, log.getvalue()


def read_all(source, seed=0, rank=0, world_size=1):
    return [ex for _, _, ex in source.read(seed, rank, world_size)]


def test_round_trip_audio_and_fields(shards):
    manifest, out, err = shards
    utts = {u.where.split(":")[-1]: u for u in read_manifest(str(manifest), skip_invalid=True)}
    tok = Tokenizer.load(MINI / "tokenizer")
    src = ShardSource(out)
    index = [json.loads(x) for x in (out / INDEX_NAME).read_text().splitlines()]
    assert len(src) == sum(x["count"] for x in index) == N_GOOD + 1  # the segment is in, 2 bad lines are not
    by_path = {}
    for ex in read_all(src):
        by_path.setdefault((ex["audio_filepath"], ex["duration"]), ex)
    assert len(by_path) == N_GOOD + 1
    for u in utts.values():
        if not os.path.exists(u.audio_filepath):
            continue
        ex = by_path[(u.audio_filepath, u.duration)]
        assert (ex["text"], ex["source_lang"], ex["target_lang"], ex["pnc"], ex["taskname"]) == (
            u.text, u.source_lang, u.target_lang, u.pnc, u.taskname)
        assert ex["num_tokens"] == len(encode_utterance(tok, u)[0])
        expected = load_audio(u.audio_filepath, u.offset, u.duration if u.segment else None)  # a file: decoded whole
        assert torch.equal(decode_audio(ex), expected), ex["where"]
    assert "m.jsonl:42: not valid JSON" in err and "/nonexistent.flac: unreadable audio" in err, err
    assert "skipped 1 invalid lines, 1 unreadable audio" in err, err


def test_each_example_once_across_ranks_and_workers(shards):
    _, out, _ = shards
    src = ShardSource(out)
    ranks, workers = 2, 2
    seen = [ex["where"] for r in range(ranks) for w in range(workers)
            for ex in read_all(src, seed=11, rank=r * workers + w, world_size=ranks * workers)]
    assert len(seen) == len(set(seen)) == len(src)
    # Through the sampler (finite epoch), two ranks together also use every example once.
    bins = Bins([2.0, 4.0, 30.0])
    got = [ex["where"] for r in range(2)
           for batch in BucketingSampler(src, bins, batch_size=3, buffer_size=16, rank=r, world_size=2)
           for ex in batch]
    assert sorted(got) == sorted(seen)


def test_examples_no_batch_can_hold_are_dropped_counted_and_resume_exactly(shards, caplog):
    _, out, _ = shards
    src, bins = ShardSource(out), Bins([2.0, 4.0, 30.0])  # max_duration=3: sizes 1, 1 (up to 3 s alone), 0
    every = read_all(src)
    short = sorted(ex["where"] for ex in every if ex["duration"] <= 3.0)
    assert 0 < len(short) < len(every)
    got, dropped = [], 0
    with caplog.at_level(logging.WARNING, logger="sampler"):
        for r in range(2):
            s = BucketingSampler(src, bins, max_duration=3.0, buffer_size=16, rank=r, world_size=2)
            got += [ex["where"] for batch in s for ex in batch]
            dropped += s.stats["drops"]["over_batch_limit"]
    assert sorted(got) == short and dropped == len(every) - len(short)
    warned = [m for m in caplog.messages if "no batch can hold" in m]  # at most one per rank
    assert 1 <= len(warned) <= 2 and all("tar#" in m and "max_duration=3 (train.max_duration)" in m for m in warned)

    def make():
        return BucketingSampler(ShardSource(out), bins, max_duration=3.0, buffer_size=8, seed=5, infinite=True)

    it = iter(make())
    ref = [[ex["where"] for ex in next(it)] for _ in range(30)]  # batches of 1: more than one pass
    run = make()
    it = iter(run)
    for _ in range(9):
        next(it)
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(run.state_dict())))
    it = iter(resumed)
    assert [[ex["where"] for ex in next(it)] for _ in range(21)] == ref[9:]


def test_epochs_reshuffle_shard_order(shards):
    _, out, _ = shards
    src = ShardSource(out)
    assert shard_order(len(src.paths), 1, 0, 1, True, 'x') != shard_order(len(src.paths), 2, 0, 1, True, 'x')
    sampler = BucketingSampler(src, Bins([2.0, 4.0, 30.0]), batch_size=3, buffer_size=16, concurrent=False)
    epochs = []
    for e in range(2):
        sampler.set_epoch(e)
        epochs.append([ex["where"] for batch in sampler for ex in batch])
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1])


@pytest.mark.parametrize("concurrent", [False, True])
def test_resume_mid_shard_continues_exactly(shards, concurrent):
    _, out, _ = shards

    def make():
        return BucketingSampler(ShardSource(out), Bins([2.0, 4.0, 30.0]), batch_size=2, buffer_size=8,
                                seed=5, infinite=True, concurrent=concurrent)

    full, it = make(), None
    it = iter(full)
    ref = [[ex["where"] for ex in next(it)] for _ in range(40)]  # > one pass: crosses shards and passes
    run = make()
    it = iter(run)
    for _ in range(9):
        next(it)
    state = json.loads(json.dumps(run.state_dict()))  # the cursor must survive a JSON/torch.save round trip
    _, shard, member, _ = state["cursor"]
    assert 0 < member < ShardSource(out).counts[shard], "the test should stop inside a shard"
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert [[ex["where"] for ex in next(it)] for _ in range(31)] == ref[9:]


def test_weighted_mixing_proportions_and_resume(shards):
    _, out, _ = shards
    index = (out / INDEX_NAME).read_text().splitlines()
    for name, part in (("a.jsonl", index[:3]), ("b.jsonl", index[3:])):
        (out / name).write_text("\n".join(part) + "\n")
    mix = MixedSource([ShardSource(out / "a.jsonl"), ShardSource(out / "b.jsonl")], weights=[3, 1])
    stream = mix.read(seed=7, rank=0, world_size=1)
    items = [next(stream) for _ in range(2000)]  # several passes over both sources
    share = sum(key[0] == 0 for key, _, _ in items) / len(items)
    assert abs(share - 0.75) < 0.035, share
    _, cursor, _ = items[999]
    again = mix.read(seed=7, rank=0, world_size=1, cursor=json.loads(json.dumps(cursor)))
    assert [next(again)[0] for _ in range(50)] == [k for k, _, _ in items[1000:1050]]
    key = items[1234][0]
    assert mix.get(list(key))["where"] == items[1234][2]["where"] == mix.describe(key)


def test_corrupt_and_truncated_shards_are_skipped(shards, tmp_path, caplog):
    _, out, _ = shards
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    src = ShardSource(bad)
    tars = src.paths
    with open(tars[0], "r+b") as f:
        f.truncate(os.path.getsize(tars[0]) // 2)  # cut inside a member: tarfile raises
    Path(tars[1]).write_bytes(os.urandom(3000))
    os.remove(tars[2])
    # Cut exactly before the 4th example's header: tarfile ends silently, the index count notices.
    fourth = next(key for key, _, _ in ShardSource(out).read(0, 0, 1) if key[:2] == (3, 3))
    with open(tars[3], "r+b") as f:
        f.truncate(fourth[2])
    with caplog.at_level(logging.WARNING, logger="aed.data_shards"):
        got = read_all(src)
    assert src.faults.counts["bad_shard"] == 4
    for t in tars[:4]:
        assert t in caplog.text
    assert "ended after 3 of 7 examples" in caplog.text
    from_3 = sum(ex["where"].startswith(tars[3]) for ex in got)
    from_0 = sum(ex["where"].startswith(tars[0]) for ex in got)
    assert from_3 == 3 and 0 < from_0 < src.counts[0]
    assert len(got) == from_0 + from_3 + sum(src.counts[4:])
    sampler = BucketingSampler(ShardSource(bad), Bins([2.0, 4.0, 30.0]), batch_size=3, buffer_size=16)
    assert sum(len(b) for b in sampler) == len(got)  # training goes on with the rest


def test_shard_dataset_matches_per_file_dataset(shards):
    manifest, out, _ = shards
    tok = Tokenizer.load(MINI / "tokenizer")
    logmel = LogMel().eval()
    utts = [u for u in read_manifest(str(manifest), skip_invalid=True) if os.path.exists(u.audio_filepath)]
    per_file = ExampleDataset(utts, tok, logmel)
    sampler = BucketingSampler(ShardSource(out), Bins([2.0, 4.0, 30.0]), batch_size=4, buffer_size=16)
    loader = DataLoader(ExampleDataset(None, tok, logmel), batch_sampler=sampler, collate_fn=Collate(tok.pad))
    batch = next(iter(loader))
    assert len(batch) == 4 and not batch.errors
    where = {ex["where"]: ex for ex in read_all(ShardSource(out))}
    ex = where[batch.where[0]]
    i = next(i for i, u in enumerate(utts) if (u.audio_filepath, u.duration) == (ex["audio_filepath"], ex["duration"]))
    item = per_file[i]
    n = batch.feat_lens[0]
    assert torch.equal(batch.feats[0, :n], item["feats"])
    assert batch.tokens[0, : batch.token_lens[0]].tolist() == item["tokens"]


def test_resume_shards_is_the_one_cursor_loop():
    """Every reader's cursor is (position, shard, *its own inner part); the resumed shard starts at
    the inner part, later ones at the start, and a cursor from another order is refused."""
    from aed.data_shards import resume_shards

    order = shard_order(6, 3, 1, 2, True, "x")
    walk = list(resume_shards(6, 3, 1, 2, True, "x", None, (0, 0)))
    assert walk == [(p, s, (0, 0)) for p, s in enumerate(order)]
    walk = list(resume_shards(6, 3, 1, 2, True, "x", (1, order[1], 5, 4096), (0, 0)))
    assert walk == [(1, order[1], (5, 4096)), (2, order[2], (0, 0))]
    with pytest.raises(ValueError, match="does not match the shard order of x"):
        list(resume_shards(6, 3, 1, 2, True, "x", (1, order[0], 5, 4096), (0, 0)))
