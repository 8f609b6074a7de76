"""NeMo tarred sets, Lhotse Shar and Hugging Face parquet read in place (aed/data_formats.py),
checked against the JSONL manifest they were written from.

Fixtures come from tools/write_formats.py, whose writers follow the layouts the formats' own
writers produce: NeMo's scripts/speech_recognition/convert_to_tarred_audio_dataset.py, lhotse's
lhotse/shar/writers/ and `datasets`' to_parquet (src/datasets/features/audio.py).
"""

import gzip
import io
import json
import logging
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
import soundfile as sf
import torch
from tools.make_shards import add_member
from tools.write_formats import read_rows, shar_cut, write_nemo_tarred, write_parquet, write_shar

from aed.data_audio import AudioError, LogMel, load_audio
from aed.data_batch import decode_audio
from aed.train_data import bins_from_manifests
from aed.data_manifest import AUDIO_LENGTH, example_fields
from aed.data_formats import cut_row, expand_paths, pair_shards
from aed.data_shards import tar_members
from aed.data_sources import ManifestEntry
from aed.data_tokenizer import Tokenizer
from aed.train_validation import val_dataset
from bins import Bins
from sampler import BucketingSampler

MINI = Path(__file__).resolve().parents[1] / "data" / "mini"
try:
    import pyarrow  # noqa: F401 - optional: `make test` runs without it
    HAS_PYARROW = True
except ImportError:
    HAS_PYARROW = False
needs_pyarrow = pytest.mark.skipif(not HAS_PYARROW, reason="pyarrow is optional: pip install pyarrow")
FORMATS = ["nemo", "shar", pytest.param("parquet", marks=needs_pyarrow)]
NEMO_SHARDS, SHAR_SIZE, ROW_GROUP = 4, 10, 8


def fixture_rows() -> list[dict]:
    """44 rows: 40 mini utterances (every language and AST), NeMo's `answer`/`lang` aliases on one,
    and 4 segments (`offset`): three of one file, which NeMo stores once per shard (-sub<N>)."""
    rows = read_rows(str(MINI / "train.jsonl"))[::7][:40]
    asr = next(i for i, r in enumerate(rows) if r["taskname"] == "asr")
    r = rows[asr]
    rows[asr] = {"audio_filepath": r["audio_filepath"], "duration": r["duration"], "answer": r["text"],
                 "lang": r["source_lang"], "pnc": "no"}
    whole = rows[1]
    segs = [dict(whole, offset=o, duration=0.6) for o in (0.2, 0.9)] + [dict(rows[2], offset=0.3, duration=0.5)]
    # NeMo shards take consecutive rows: put the segments next to their file, inside one shard.
    return rows[:2] + segs[:2] + rows[2:3] + segs[2:] + rows[3:] + [dict(whole, offset=0.0, duration=0.4)]


def spec_of(fmt: str, root: Path) -> dict:
    return {"nemo": {"manifest_filepath": str(root / "sharded_manifests" / "manifest__OP_0..3_CL_.json"),
                     "tarred_audio_filepaths": str(root / "audio__OP_0..3_CL_.tar")},
            "shar": {"shar": str(root)},
            "parquet": {"parquet": str(root / "data" / "*.parquet"), "text_column": "sentence"}}[fmt]


def opened(spec):
    """The streamed source of a train.manifests entry as the config writes it."""
    return ManifestEntry.of(spec).open()


def write(fmt: str, rows: list, root: Path) -> None:
    if fmt == "nemo":
        assert write_nemo_tarred(rows, root, NEMO_SHARDS) == len(rows)  # 44 = 4 x 11: nothing left over
    elif fmt == "shar":
        write_shar(rows, root, SHAR_SIZE)
    else:
        write_parquet(rows, root, num_files=2, row_group_size=ROW_GROUP, rename={"text": "sentence"})


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    rows = fixture_rows()
    out = {}
    for fmt in ["nemo", "shar"] + ["parquet"] * HAS_PYARROW:
        root = tmp_path_factory.mktemp(fmt)
        write(fmt, rows, root)
        out[fmt] = root
    return rows, out


def row_index(fmt: str, where: str) -> int:
    """The fixture row an example came from, by its stable id."""
    path, _, tail = where.rpartition(":")
    if fmt == "nemo":
        return int(Path(path).stem.split("_")[1]) * 11 + int(tail) - 1
    if fmt == "shar":
        return int(tail.rsplit("-", 1)[1])
    return int(Path(path).name.split("-")[1]) * 22 + int(tail)


def read_all(source, seed=0, rank=0, world_size=1):
    return [ex for _, _, ex in source.read(seed, rank, world_size)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_every_field_and_sample(sets, fmt):
    rows, roots = sets
    src = opened(spec_of(fmt, roots[fmt]))
    got = {row_index(fmt, ex["where"]): ex for ex in read_all(src)}
    assert sorted(got) == list(range(len(rows))) and not src.faults.counts
    for i, row in enumerate(rows):
        ex, want = got[i], example_fields(row, f"row {i}")
        fields = {k: ex[k] for k in want}
        if fmt != "nemo":  # shar and parquet store the segment itself
            want["offset"] = 0.0
            want["segment"] = ex["segment"]
        assert fields == want, (fmt, i)
        # a row without an offset is its whole file, decoded whole; a segment is cut from its offset
        expected = load_audio(row["audio_filepath"], row.get("offset", 0.0), row["duration"] if "offset" in row else None)
        assert torch.equal(decode_audio(ex), expected), (fmt, i)


def test_nemo_segments_share_one_member_and_force_codec_is_matched_by_stem(tmp_path):
    wav = tmp_path / "src" / "long.take.wav"  # a dot in the name: NeMo writes it as _
    wav.parent.mkdir()
    data, rate = sf.read(MINI / "audio" / "train_de_000001.flac", dtype="int16")
    sf.write(wav, data, rate, subtype="PCM_16")
    rows = [{"audio_filepath": str(wav), "duration": 0.5, "offset": o, "text": f"t{o}", "source_lang": "de",
             "target_lang": "de"} for o in (0.0, 1.0, 2.0)]
    write_nemo_tarred(rows, tmp_path / "set", 1, force_codec="flac")
    members = tarfile.open(tmp_path / "set" / "audio_0.tar").getnames()
    manifest = [json.loads(x) for x in (tmp_path / "set" / "sharded_manifests" / "manifest_0.json").open()]
    assert members == [str(wav.with_suffix("")).replace("/", "_").replace(".", "_") + ".flac"]
    assert [m["audio_filepath"].rpartition("_")[2] for m in manifest] == ["take.wav", "take-sub1.wav", "take-sub2.wav"]
    src = opened({"manifest_filepath": str(tmp_path / "set/sharded_manifests/manifest_0.json"),
                       "tarred_audio_filepaths": str(tmp_path / "set/audio_0.tar")})
    got = read_all(src)
    assert len(got) == 3 and len({id(ex["audio"]) for ex in got}) == 1  # one member in memory
    for ex, row in zip(got, rows):
        assert torch.equal(decode_audio(ex), load_audio(wav, row["offset"], row["duration"]))


def test_nemo_path_syntax_and_shard_pairing():
    assert expand_paths("a/audio__OP_0..2_CL_.tar") == ["a/audio_0.tar", "a/audio_1.tar", "a/audio_2.tar"]
    assert expand_paths("audio_{0..10}.tar")[-2:] == ["audio_9.tar", "audio_10.tar"]  # not padded: 0 is one digit
    assert expand_paths(["b/x_(08..10).tar", "c/{p,q}_[1..2].tar"]) == [
        "b/x_08.tar", "b/x_09.tar", "b/x_10.tar", "c/p_1.tar", "c/p_2.tar", "c/q_1.tar", "c/q_2.tar"]
    # Two buckets that both have shard 0 and 1; tars listed in another order than the manifests.
    manifests = ["b1/manifest_0.json", "b1/manifest_1.json", "b2/manifest_0.json", "b2/manifest_1.json"]
    tars = ["b1/audio_1.tar", "b1/audio_0.tar", "b2/audio_0.tar", "b2/audio_1.tar"]
    assert pair_shards(manifests, tars) == [("b1/manifest_0.json", "b1/audio_0.tar"),
                                            ("b1/manifest_1.json", "b1/audio_1.tar"),
                                            ("b2/manifest_0.json", "b2/audio_0.tar"),
                                            ("b2/manifest_1.json", "b2/audio_1.tar")]
    with pytest.raises(ValueError, match="different shards"):
        pair_shards(["manifest_0.json", "manifest_1.json"], ["audio_0.tar", "audio_2.tar"])


class CharCount:
    """A streamed source whose examples carry num_tokens = characters of the text (what the
    sampler's 2D buckets read; training counts tokenizer ids instead, in aed.data_sources.CountTokens)."""

    def __init__(self, source):
        self.source = source

    def read(self, seed, rank, world_size, cursor=None):
        for key, cur, ex in self.source.read(seed, rank, world_size, cursor):
            yield key, cur, {**ex, "num_tokens": len(ex["text"])}

    def get(self, key):
        ex = self.source.get(key)
        return {**ex, "num_tokens": len(ex["text"])}

    def describe(self, key):
        return self.source.describe(key)


@pytest.mark.parametrize("fmt", FORMATS)
def test_four_ranks_read_every_example_exactly_once(sets, fmt):
    rows, roots = sets
    src = opened(spec_of(fmt, roots[fmt]))
    per_rank = [[ex["where"] for ex in read_all(src, seed=5, rank=r, world_size=4)] for r in range(4)]
    seen = [w for part in per_rank for w in part]
    assert len(seen) == len(set(seen)) == len(rows) and all(per_rank)
    # Through the sampler too: a finite epoch of 4 ranks uses every example once.
    bins = Bins([1.0, 2.0, 30.0])
    got = [ex["where"] for r in range(4)
           for batch in BucketingSampler(CharCount(src), bins, batch_size=3, buffer_size=8, rank=r, world_size=4)
           for ex in batch]
    assert sorted(got) == sorted(seen)


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_mid_shard_equals_an_uninterrupted_pass(sets, fmt):
    _, roots = sets

    def make():
        return BucketingSampler(CharCount(opened(spec_of(fmt, roots[fmt]))), Bins([1.0, 2.0, 30.0]),
                                batch_size=2, buffer_size=6, seed=3, infinite=True)

    it = iter(make())
    ref = [[ex["where"] for ex in next(it)] for _ in range(50)]  # > 2 passes: crosses shards and passes
    run = make()
    it = iter(run)
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(run.state_dict()))  # the cursor survives JSON (the checkpoint)
    cursor = state["cursor"]  # tars: (position, shard, member offset, row); parquet: (position, shard, row)
    assert (cursor[-1] if fmt == "parquet" else cursor[2]) > 0, f"the test should stop inside a shard: {cursor}"
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert [[ex["where"] for ex in next(it)] for _ in range(43)] == ref[7:]


# --- faults: each skipped, counted and logged once with its path ---------------------------------


def truncate_in_last_member(tar: Path) -> None:
    last = tarfile.open(tar).getmembers()[-1]
    with open(tar, "r+b") as f:
        f.truncate(last.offset_data + 10)


def add_garbage_member(tar: Path, name: str) -> None:
    with tarfile.open(tar, "a") as tf:
        info = tarfile.TarInfo(name)
        info.size = 100
        tf.addfile(info, io.BytesIO(os.urandom(100)))


def damage_nemo(root: Path) -> tuple[dict, str]:
    os.remove(root / "audio_3.tar")  # missing shard
    truncate_in_last_member(root / "audio_1.tar")
    manifest0 = root / "sharded_manifests" / "manifest_0.json"
    lines = manifest0.read_text().splitlines()
    extra = json.loads(lines[-1]) | {"audio_filepath": "_not_in_the_tar.flac"}  # a row with no member
    manifest0.write_text("\n".join(lines[1:] + [json.dumps(extra), "{broken"]) + "\n")  # row 1 gone: member alone
    add_garbage_member(root / "audio_2.tar", "_zz_garbage.flac")  # undecodable, with a row
    manifest2 = root / "sharded_manifests" / "manifest_2.json"
    with open(manifest2, "a") as f:
        f.write(json.dumps({"audio_filepath": "_zz_garbage.flac", "duration": 1.0, "text": "x", "lang": "en"}) + "\n")
    return {"bad_shard": 2, "member_without_row": 1, "row_without_member": 1, "invalid_row": 1}, "_zz_garbage.flac"


def damage_shar(root: Path) -> tuple[dict, str]:
    os.remove(root / "recording.000003.tar")  # missing shard
    (root / "cuts.000004.jsonl.gz").write_bytes(gzip.compress(b"x" * 100)[:-8])  # truncated cuts file
    with gzip.open(root / "cuts.000000.jsonl.gz", "rt") as f:
        cuts = [json.loads(x) for x in f]
    extra = dict(cuts[0], id="no-such-recording")  # a cut with no audio member
    with gzip.open(root / "cuts.000000.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(c) + "\n" for c in cuts[1:] + [extra])  # cut 0 gone: its member alone
    with tarfile.open(root / "recording.000001.tar") as tf:  # an undecodable member for cut 0 of shard 1
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    with tarfile.open(root / "recording.000001.tar", "w") as tf:
        for m, data in members:
            tf.addfile(m, io.BytesIO(os.urandom(len(data)) if m is members[0][0] else data))
    return {"bad_shard": 2, "member_without_row": 1, "row_without_member": 1}, members[0][0].name.rpartition(".")[0]


def damage_parquet(root: Path) -> tuple[dict, None]:
    files = sorted((root / "data").glob("*.parquet"))
    files[1].write_bytes(files[1].read_bytes()[:-100])  # truncated: its footer is gone
    return {"bad_shard": 1}, None


@pytest.mark.parametrize("fmt", FORMATS)
def test_faults_are_skipped_counted_and_logged_once(sets, fmt, tmp_path, caplog):
    rows, roots = sets
    root = tmp_path / fmt
    shutil.copytree(roots[fmt], root)
    want, undecodable = {"nemo": damage_nemo, "shar": damage_shar, "parquet": damage_parquet}[fmt](root)
    with caplog.at_level(logging.WARNING, logger="aed"):
        src = opened(spec_of(fmt, root))
        first = read_all(src)
        again = read_all(src, seed=1)  # another pass meets the same faults: no new count or message
    assert dict(src.faults.counts) == want
    assert sorted(ex["where"] for ex in first) == sorted(ex["where"] for ex in again)
    assert 0 < len(first) < len(rows)
    assert len(caplog.records) == sum(want.values())
    for (kind, where), _ in src.faults.seen.items():
        assert where in caplog.text
    if undecodable:  # durations come from the metadata: the decoder meets it, and names it
        bad = next(ex for ex in first if ex["audio_filepath"] == undecodable)
        with pytest.raises(AudioError, match=f"{bad['where']}: cannot decode"):
            decode_audio(bad)


@needs_pyarrow
def test_parquet_rows_without_audio_or_header_and_constants(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{k: v for k, v in r.items() if k not in ("source_lang", "target_lang", "taskname")}
            for r in read_rows(str(MINI / "train.jsonl"))[:6]]
    write_parquet(rows, tmp_path, row_group_size=3, duration=False)
    path = next((tmp_path / "data").glob("*.parquet"))
    table = pq.read_table(path).to_pylist()
    table[1]["audio"] = {"bytes": None, "path": "x"}
    table[4]["audio"] = {"bytes": b"not audio", "path": "y"}
    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(path)), path, row_group_size=3)
    src = opened({"parquet": str(path), "source_lang": "de", "target_lang": "de"})
    got = read_all(src)
    assert len(got) == 4 and dict(src.faults.counts) == {"undecodable": 2}
    for ex in got:
        i = int(ex["where"].rpartition(":")[2])
        assert abs(ex["duration"] - rows[i]["duration"]) < 0.01 and ex["source_lang"] == "de"


@pytest.mark.parametrize("fmt", FORMATS)
def test_bins_from_a_streamed_entry_equal_those_of_its_manifest(sets, fmt, tmp_path):
    rows, roots = sets
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = Tokenizer.load(MINI / "tokenizer")
    want, _ = bins_from_manifests([str(manifest)], tok, 4, 2, method="equal")
    got, meta = bins_from_manifests([spec_of(fmt, roots[fmt])], tok, 4, 2, method="equal")
    assert got == want and meta["used"] == len(rows)


def test_inspect_data_lists_examples_and_everything_skipped(sets, tmp_path, capsys):
    rows, roots = sets
    from tools.inspect_data import main

    out = tmp_path / "shar.jsonl"
    main([json.dumps(spec_of("shar", roots["shar"])), "--jsonl", str(out)])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == len(rows) and f"utterances  {len(rows)}" in capsys.readouterr().out
    for line in lines:
        row = rows[row_index("shar", line["id"])]
        assert line["text"] == row.get("text", row.get("answer")) and line["duration"] == row["duration"]
        whole = "offset" not in row  # a whole file is decoded whole, a segment for its duration
        assert line["num_samples"] == load_audio(row["audio_filepath"], row.get("offset", 0.0),
                                                 None if whole else row["duration"]).numel()

    root = tmp_path / "nemo"
    shutil.copytree(roots["nemo"], root)
    want, undecodable = damage_nemo(root)
    main([json.dumps(spec_of("nemo", root)), "--jsonl", str(tmp_path / "nemo.jsonl")])
    report = capsys.readouterr().out
    assert f"skipped     {sum(want.values()) + 1}" in report
    for kind in [*want, "undecodable"]:
        assert kind in report
    assert undecodable in report


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_tar_members_read_what_tarfile_reads(tmp_path, fmt):
    path = tmp_path / "t.tar"
    names = ["a.flac", "d" * 120 + ".flac" if fmt != tarfile.USTAR_FORMAT else "p" * 90 + "/" + "n" * 90,
             "é.wav", "empty.json"]
    with tarfile.open(path, "w", format=fmt) as tf:
        folder = tarfile.TarInfo("a_dir")
        folder.type = tarfile.DIRTYPE
        tf.addfile(folder)  # not a regular member: skipped
        for i, name in enumerate(names):
            info = tarfile.TarInfo(name)
            info.size = 700 * i
            tf.addfile(info, io.BytesIO(bytes([i]) * info.size))
    with open(path, "rb", buffering=0) as f:
        got = list(tar_members(f, chunk=1000))  # chunks smaller than members
        assert [(n, d) for _, n, d, _ in got] == [(n, bytes([i]) * 700 * i) for i, n in enumerate(names)]
        assert [next(tar_members(f, at, chunk=0))[1] for at, _, _, _ in got] == names  # seek to any member
        assert [end for _, _, _, end in got[:-1]] == [at for at, _, _, _ in got[1:]]
    with open(path, "r+b") as f:
        f.seek(got[2][0] + 10)
        f.write(b"x")
    with open(path, "rb", buffering=0) as f, pytest.raises(tarfile.ReadError, match="wrong checksum"):
        list(tar_members(f))


def test_validation_reads_a_streamed_entry_as_its_manifest(sets, tmp_path):
    rows, roots = sets
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok, logmel = Tokenizer.load(MINI / "tokenizer"), LogMel().eval()

    def items(spec, rank, world_size):
        ds = val_dataset(ManifestEntry.of(spec), None, tok, logmel, False, rank, world_size)
        return {(u.text, u.duration, u.offset): ds[i] for i, u in enumerate(ds.utterances)}

    want = items(str(manifest), 0, 1)
    got = [items(spec_of("nemo", roots["nemo"]), r, 2) for r in range(2)]
    assert len(got[0]) + len(got[1]) == len(want) and got[0].keys() | got[1].keys() == want.keys()
    for key, item in (got[0] | got[1]).items():
        assert torch.equal(item["feats"], want[key]["feats"]) and item["tokens"] == want[key]["tokens"], key


def test_shar_fields_from_supervision_and_cut_custom():
    cut = {"id": "c1", "duration": 2.0, "custom": {"target_lang": "de", "taskname": "ast"},
           "supervisions": [{"text": "hello", "language": "en", "custom": {"pnc": "no"}},
                            {"text": "there", "language": "en"}]}
    assert example_fields(cut_row(cut), "c1") == {"duration": 2.0, "offset": 0.0, "segment": False, "text": "hello there",
                                                  "source_lang": "en", "target_lang": "de", "pnc": False,
                                                  "taskname": "ast"}
    nemo_style = {"id": "c2", "duration": 1.0, "supervisions": [], "custom": {"answer": "hallo", "lang": "de"}}
    assert example_fields(cut_row(nemo_style), "c2")["text"] == "hallo"


@pytest.mark.parametrize("fmt, subtype", [("WAV", "PCM_16"), ("OGG", "OPUS"), ("MP3", "MPEG_LAYER_III")])
def test_shar_members_in_any_format_soundfile_decodes(tmp_path, fmt, subtype):
    row = read_rows(str(MINI / "train.jsonl"))[0]
    wav, rate = sf.read(row["audio_filepath"], dtype="float32")
    data = io.BytesIO()
    sf.write(data, wav, rate, format=fmt, subtype=subtype)
    cut, recording = shar_cut("c0", row, rate, len(wav))
    with gzip.open(tmp_path / "cuts.000000.jsonl.gz", "wt") as f:
        f.write(json.dumps(cut) + "\n")
    ext = {"WAV": "wav", "OGG": "opus", "MP3": "mp3"}[fmt]
    with tarfile.open(tmp_path / "recording.000000.tar", "w") as tf:
        add_member(tf, f"c0.{ext}", data.getvalue())
        add_member(tf, "c0.json", json.dumps(recording).encode())
    (ex,) = read_all(opened({"shar": str(tmp_path)}))
    got, want = decode_audio(ex), load_audio(row["audio_filepath"])  # the member is decoded whole
    if fmt == "WAV":
        assert torch.equal(got, want)
    else:  # lossy: the length, within a codec frame
        assert abs(got.numel() - want.numel()) < 0.05 * rate, (got.numel(), want.numel())


def test_parquet_without_pyarrow_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an environment without it gives
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        opened({"parquet": "data/*.parquet"})


@pytest.mark.slow(seconds=16)
def test_training_on_a_nemo_and_a_shar_entry_mixed_resumes_exactly(sets, tmp_path):
    from tests.test_train import losses, run_train

    rows, roots = sets
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bins, _ = bins_from_manifests([str(manifest)], Tokenizer.load(MINI / "tokenizer"), 4, 2)
    bins.save(tmp_path / "bins.json")
    entries = json.dumps([spec_of("nemo", roots["nemo"]) | {"weight": 2}, spec_of("shar", roots["shar"])])
    args = [f"train.manifests={entries}", f"train.bins={tmp_path / 'bins.json'}", "ckpt_every=100",
            "train.max_duration=8"]
    a, b = tmp_path / "a", tmp_path / "b"
    # Run a also validates on the Shar set and on its JSONL twin: the same utterances, the same loss.
    val = json.dumps([spec_of("shar", roots["shar"]), str(manifest)])
    run_train(a, "max_steps=4", *args, f"val.manifests={val}", "val.every=4")
    run_train(b, "max_steps=2", *args)
    p = run_train(b, "max_steps=4", *args)
    assert "resumed from" in p.stderr
    la, lb = losses(a), losses(b)
    assert sorted(la) == sorted(lb) == [1, 2, 3, 4] and all(la[s] == lb[s] for s in la), (la, lb)
    with open(a / "metrics.jsonl") as f:
        last = [row for row in map(json.loads, f) if row["step"] == 4 and f"val/{roots['shar'].name}/loss" in row][0]
    assert last[f"val/{roots['shar'].name}/loss"] == pytest.approx(last["val/m/loss"], rel=1e-5)


def test_nemo_one_manifest_for_every_tar_by_shard_id(sets):
    rows, roots = sets
    root = roots["nemo"]
    one = opened({"manifest_filepath": str(root / "tarred_audio_manifest.json"),
                       "tarred_audio_filepaths": str(root / "audio__OP_0..3_CL_.tar")})
    sharded = opened(spec_of("nemo", root))
    def by_fields(source):
        return {(ex["audio_filepath"], ex["offset"], ex["duration"], ex["text"]): ex["audio"] for ex in read_all(source)}

    got, want = by_fields(one), by_fields(sharded)
    assert got == want and len(got) == len(rows) and not one.faults.counts


def test_a_member_whose_metadata_duration_is_wrong_is_skipped_and_counted(tmp_path):
    """Streamed members follow the per-file rule: a whole member is decoded whole (not cut to the
    metadata's rounded duration), a segment must end inside its member, and a duration off by more
    than the tolerance is an error item that the run counts (kind audio_length), never a silent cut."""
    from aed.data_manifest import Faults
    from aed.data_batch import Collate
    from aed.data_batch import ExampleDataset

    rows = read_rows(str(MINI / "train.jsonl"))[:3]
    real = sf.info(rows[0]["audio_filepath"]).duration
    rows = [dict(rows[0], duration=round(real, 2)),  # rounded, as NeMo's manifests are: fine
            dict(rows[1], duration=round(0.5 * sf.info(rows[1]["audio_filepath"]).duration, 2)),  # wrong
            dict(rows[0], offset=real - 0.5, duration=2.0)]  # a segment past the end of its member
    write_nemo_tarred(rows, tmp_path, 1)
    src = opened({"manifest_filepath": str(tmp_path / "sharded_manifests" / "manifest_0.json"),
                       "tarred_audio_filepaths": str(tmp_path / "audio_0.tar")})
    good, wrong, past = read_all(src)
    assert torch.equal(decode_audio(good), load_audio(rows[0]["audio_filepath"]))  # every sample, none cut
    for ex in (wrong, past):
        with pytest.raises(AudioError, match=AUDIO_LENGTH):
            decode_audio(ex)
    tok = Tokenizer.load(MINI / "tokenizer")
    ds = ExampleDataset(None, tok, LogMel().eval())
    batch = Collate(tok.pad)([ds[ex] for ex in (good, wrong, past)])
    assert len(batch) == 1 and len(batch.errors) == 2
    faults = Faults()
    faults.report(batch.errors, "training")
    faults.report(batch.errors, "training")  # met again next pass: counted once
    assert dict(faults.counts) == {"audio_length": 2}
