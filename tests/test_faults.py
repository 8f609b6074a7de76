"""Injected faults that used to lose work or stop a run: corrupt checkpoints, replayed steps after a
kill, bad manifest lines and audio."""

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from test_train import ROOT, SMALL, run_in_process, run_train

from aed import cli_infer
from aed.data_audio import FeatureConfig
from aed.data_manifest import Utterance, check_audio
from aed.model import AED, AEDConfig
from aed.model_checkpoint import (TRAINING_KEYS, CheckpointError, list_checkpoints, load_latest, load_model, pack_dir,
                                  read_checkpoint)
from aed.train_checkpoint import begin_checkpoint, load_training_state, save_checkpoint, write_meta
from bins import estimate_bins
from sampler import BucketingSampler

MINI_TOKENIZER = os.path.join(ROOT, "data", "mini", "tokenizer")


def fake_state(step: int) -> dict:
    return {k: {} for k in TRAINING_KEYS} | {"step": step, "model": {"w": torch.full((4,), float(step))},
                                              "optimizer": {"state": {"w": {"exp_avg": torch.zeros(4)}},
                                                            "param_groups": [{"lr": 0.1, "params": ["w"]}]}}


def truncate(path) -> None:
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


def tensors_file(run_dir, step: int, rank: int = 0):
    """Where rank `rank` of a DCP checkpoint writes its tensors."""
    return run_dir / f"ckpt-{step:08d}" / f"__{rank}_0.distcp"


def test_cleanup_keeps_the_checkpoint_it_just_saved_beside_a_corrupt_newer_one(tmp_path):
    for step in (1, 2):
        save_checkpoint(fake_state(step), tmp_path, step, keep_last=1)
    (tmp_path / "ckpt-00000009").mkdir()  # a save that was killed halfway, higher step
    save_checkpoint(fake_state(3), tmp_path, 3, keep_last=1)
    names = [os.path.basename(p) for p in list_checkpoints(tmp_path)]
    assert names == ["ckpt-00000003", "ckpt-00000009"]  # step 2 rotated out, 3 kept, 9 untouched
    path, ckpt = load_latest(tmp_path)
    assert path.endswith("ckpt-00000003") and ckpt["step"] == 3


def test_newest_valid_checkpoint_is_found_and_the_bad_ones_named(tmp_path, caplog):
    for step in (1, 2):
        save_checkpoint(fake_state(step), tmp_path, step, keep_last=5)
    truncate(tensors_file(tmp_path, 2))
    torch.save({"step": 3}, tmp_path / "ckpt-00000003.pt")  # loads, but is not a training checkpoint
    begin_checkpoint(tmp_path / "ckpt-00000004")  # killed while the ranks were still writing their tensors
    write_meta(fake_state(4), tmp_path / "ckpt-00000004")
    for with_tensors in (True, False):  # inference reads the tensors; training checks them, then loads its shards
        caplog.clear()
        path, ckpt = load_latest(tmp_path, with_tensors=with_tensors)
        assert ckpt["step"] == 1
        assert "ckpt-00000004: incomplete (no COMPLETE marker" in caplog.text
        assert "ckpt-00000003.pt: not a complete aed checkpoint" in caplog.text
        assert "ckpt-00000002/__0_0.distcp: truncated" in caplog.text


def test_run_dir_whose_only_checkpoint_is_corrupt_has_none_to_resume_from(tmp_path):
    save_checkpoint(fake_state(5), tmp_path, 5, keep_last=1)
    truncate(tensors_file(tmp_path, 5))
    with pytest.raises(CheckpointError, match="(?s)ckpt-00000005/__0_0.distcp: truncated.*move them away"):
        load_latest(tmp_path)


@pytest.mark.slow
def test_train_py_does_not_restart_a_run_whose_checkpoints_are_all_corrupt(tmp_path):
    save_checkpoint(fake_state(5), tmp_path, 5, keep_last=1)
    truncate(tensors_file(tmp_path, 5))
    p = run_train(tmp_path, "max_steps=2", check=False)
    assert p.returncode != 0 and "cannot resume" in p.stderr and "ckpt-00000005" in p.stderr
    assert not os.path.exists(tmp_path / "metrics.jsonl")  # no step was trained


@pytest.mark.slow
def test_steps_replayed_after_a_kill_are_logged_once(tmp_path):
    run_train(tmp_path, "max_steps=4", "ckpt_every=2")
    shutil.rmtree(tmp_path / "ckpt-00000004")  # as if killed after step 4 was logged, before its save
    p = run_train(tmp_path, "max_steps=4", "ckpt_every=2")
    assert "resumed from" in p.stderr and "dropped 2 rows logged after step 2" in p.stderr
    with open(tmp_path / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if "train/loss" in line]
    assert steps == [1, 2, 3, 4]


def tiny_inference_state() -> dict:
    cfg = AEDConfig(n_mels=80, vocab_size=528, enc_d_model=32, enc_layers=1, enc_heads=2, subsampling_channels=8,
                    dec_d_model=32, dec_layers=1, dec_heads=2, dec_max_len=64)
    return {"model_config": dataclasses.asdict(cfg), "model": AED(cfg).state_dict(),
            "features": dataclasses.asdict(FeatureConfig(n_mels=80)), "tokenizer": pack_dir(MINI_TOKENIZER)}


def test_inference_on_a_run_dir_falls_back_past_a_truncated_newest_checkpoint(tmp_path, caplog):
    state = tiny_inference_state()
    save_checkpoint(state, tmp_path, 1, keep_last=2)
    save_checkpoint(state, tmp_path, 2, keep_last=2)
    truncate(tensors_file(tmp_path, 2))
    asr = load_model(str(tmp_path))
    assert asr.path.endswith("ckpt-00000001") and "ckpt-00000002/__0_0.distcp: truncated" in caplog.text
    with pytest.raises(CheckpointError, match="ckpt-00000002/__0_0.distcp: truncated"):
        load_model(str(tmp_path / "ckpt-00000002"))  # a checkpoint named explicitly: no substitute


# --- bad data ---------------------------------------------------------------------------------


def mini_records(n: int) -> list[dict]:
    with open(os.path.join(ROOT, "data", "mini", "train.jsonl")) as f:
        records = [json.loads(line) for line in f.read().splitlines()[:n]]
    for r in records:
        r["audio_filepath"] = os.path.join(ROOT, "data", "mini", r["audio_filepath"])
    return records


def bad_manifest(tmp_path) -> str:
    """20 good lines, then: not UTF-8, an unknown language, a missing file, a doubled duration."""
    records = mini_records(20)
    lines = [json.dumps(r).encode() for r in records]
    lines.append(json.dumps(dict(records[0], text="caf\u00e9")).encode().replace(b"\\u00e9", b"\xe9"))  # Latin-1
    lines.append(json.dumps(dict(records[1], source_lang="xx", target_lang="xx")).encode())
    lines.append(json.dumps(dict(records[2], audio_filepath=str(tmp_path / "gone.flac"))).encode())
    lines.append(json.dumps(dict(records[3], duration=2 * records[3]["duration"])).encode())
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


@pytest.mark.slow
def test_bad_lines_and_bad_audio_are_skipped_with_file_and_line(tmp_path):
    manifest = bad_manifest(tmp_path)
    p = run_train(tmp_path / "run", "max_steps=2", f"train.manifests=[{manifest}]")
    assert "m.jsonl:21: not UTF-8 (byte 0xe9 at column" in p.stderr
    assert "m.jsonl:22: unknown language 'xx'" in p.stderr
    assert "m.jsonl:23: " in p.stderr and "gone.flac: unreadable audio" in p.stderr
    assert "m.jsonl:24: " in p.stderr and "but the audio lasts" in p.stderr
    assert "skipped 2 utterance(s) after reading their audio headers: 1 unreadable, 1 whose duration" in p.stderr
    assert "m.jsonl: 20 utterances" in p.stderr

    p = run_train(tmp_path / "strict", "max_steps=2", f"train.manifests=[{manifest}]", "train.skip_invalid=false",
                  check=False)
    assert p.returncode != 0 and "data error: " in p.stderr and "m.jsonl:21: not UTF-8" in p.stderr
    assert "Traceback" not in p.stderr


def test_segments_may_be_shorter_than_their_file_but_must_end_inside_it(tmp_path):
    utts = [Utterance(r["audio_filepath"], r["duration"], "x", "en", "en", True, "asr", where=f"m:{i}")
            for i, r in enumerate(mini_records(1))]
    whole = utts[0]
    half = dataclasses.replace(whole, duration=whole.duration / 2, where="m:1")
    segment = dataclasses.replace(half, offset=0.1, segment=True, where="m:2")
    past_end = dataclasses.replace(segment, offset=whole.duration * 0.9, where="m:3")
    problems = dict(check_audio([whole, half, segment, past_end], tolerance=0.1))
    assert sorted(problems) == [1, 3], problems
    assert problems[3].startswith("segment")


@pytest.mark.slow
def test_unreadable_audio_is_logged_once_per_run_however_often_it_is_drawn(tmp_path):
    records = mini_records(12)
    (tmp_path / "corrupt.flac").write_bytes(b"fLaC but not really")
    records.append(dict(records[0], audio_filepath=str(tmp_path / "corrupt.flac")))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records))
    # check_audio=false: the file must get past the start-up check, as one that breaks mid-run does
    p = run_train(tmp_path / "run", "max_steps=6", f"train.manifests=[{manifest}]", "train.check_audio=false",
                  "train.batch_size=8", "train.max_duration=null")
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        drawn = [json.loads(line)["train/skipped_audio"] for line in f][-1]
    assert drawn >= 2  # 6 steps x 8 of 13 utterances: the bad one comes round more than once
    assert p.stderr.count("skipped unreadable audio") == 1 and "corrupt.flac" in p.stderr
    assert "rank 0 skipped, by kind: unreadable_audio 1" in p.stderr  # the run's one summary of its skips


@pytest.mark.slow
def test_infer_skip_invalid_skips_and_counts_bad_manifest_lines(tmp_path):
    run_dir = tmp_path / "run"
    save_checkpoint(tiny_inference_state(), run_dir, 1, keep_last=1)
    wav = os.path.join(ROOT, "data", "mini", "examples", "en_asr_16k.wav")
    manifest = tmp_path / "m.jsonl"
    manifest.write_bytes(b"\n".join([json.dumps({"audio_filepath": wav, "lang": "en"}).encode(),
                                     b'{"audio_filepath": "caf\xe9.wav"}',  # Latin-1
                                     json.dumps({"lang": "en"}).encode(),
                                     json.dumps({"audio_filepath": wav, "lang": "xx"}).encode()]) + b"\n")
    args = ["--ckpt", str(run_dir), "--manifest", str(manifest), "--max-new-tokens", "4"]
    p = run_in_process(cli_infer.main, args)
    assert p.returncode != 0 and "m.jsonl:2: not UTF-8" in p.stderr and "Traceback" not in p.stderr
    p = run_in_process(cli_infer.main, args + ["--skip-invalid"])
    assert p.returncode == 0, p.stderr
    assert "m.jsonl:2: not UTF-8" in p.stderr and "m.jsonl:3: field 'audio_filepath'" in p.stderr
    assert "skipped 2 invalid line(s)" in p.stderr
    assert "skipping " in p.stderr and "m.jsonl:4: language xx -> xx" in p.stderr
    assert "1 transcribed, 0 failed" in p.stderr


# --- distributed ------------------------------------------------------------------------------


def rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the torchrun worker with RANK=rank among the launcher's children."""
    with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children") as f:
        for pid in map(int, f.read().split()):
            with open(f"/proc/{pid}/environ", "rb") as env:
                if f"RANK={rank}".encode() in env.read().split(b"\0"):
                    return pid
    raise AssertionError(f"no worker with RANK={rank} under pid {launcher_pid}")


@pytest.mark.slow
def test_survivors_say_a_peer_rank_exited_instead_of_blaming_their_batch(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           "configs/tiny.yaml", f"run_dir={tmp_path}", *SMALL, "max_steps=1000", "ckpt_every=1000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    for line in proc.stderr:
        if "step 2 |" in line:
            os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)  # as an OOM killer or a failed node does
            break
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "stopping: a peer rank exited or lost its connection" in rest, rest[-3000:]  # rank 0's last words
    assert "training step failed on batch" not in rest


# --- resuming on another world size -----------------------------------------------------------


def test_sampler_regrouped_to_another_world_size_trains_each_example_of_the_pass_once():
    """4 ranks -> 3: within the interrupted pass, nothing trained before is drawn again and nothing
    is left out. (Which batches the new ranks form differs from an uninterrupted run.) Each old
    rank's share of the pass (750) exceeds what it reads ahead (up to 4 x the buffer), so all
    four are still in the first pass when they stop."""
    rng = random.Random(0)
    examples = [{"duration": rng.uniform(1, 20), "num_tokens": rng.randint(3, 60)} for _ in range(3000)]
    bins = estimate_bins([e["duration"] for e in examples], [e["num_tokens"] for e in examples], 4, 2)
    kw = dict(batch_size=6, buffer_size=120, infinite=True, yield_indices=True, seed=3)
    trained, states = [], []
    for rank in range(4):
        old = BucketingSampler(examples, bins, rank=rank, world_size=4, **kw)
        it = iter(old)
        trained += [i for _ in range(15) for i in next(it)]
        states.append(old.state_dict())
    assert len(trained) == len(set(trained))

    drawn, left = [], set()
    for rank in range(3):
        new = BucketingSampler(examples, bins, rank=rank, world_size=3, **kw)
        new.load_state_dict(new.regroup_state(states))
        for batch in new:
            sd = new.state_dict()
            if sd["pass_idx"] > 0:  # the next pass began: the rest of pass 0 is in this batch and the queues
                left |= set(batch) | {e[0] for q in sd["queues"] for e in q}
                break
            drawn += batch
    assert not set(trained) & set(drawn)
    assert len(drawn) == len(set(drawn))
    usable = {i for i, bucket in enumerate(new.data.alloc) if bucket >= 0}  # not dropped as outliers
    assert set(trained) | set(drawn) | left == usable


def test_regrouped_inside_the_short_phase_stays_short_until_it_ends_then_reads_everything():
    """short_first, 4 ranks -> 3 at step 15 of 40 short steps: the new ranks finish the short
    steps on short examples not yet trained in that pass, then the long examples come back."""
    rng = random.Random(1)
    examples = [{"duration": rng.uniform(1, 20), "num_tokens": rng.randint(3, 60)} for _ in range(6000)]
    bins = estimate_bins([e["duration"] for e in examples], [e["num_tokens"] for e in examples], 4, 2)
    kw = dict(batch_size=6, buffer_size=60, infinite=True, yield_indices=True, seed=3, short_first=(6.0, 40))
    trained, states = [], []
    for rank in range(4):
        old = BucketingSampler(examples, bins, rank=rank, world_size=4, **kw)
        it = iter(old)
        trained += [i for _ in range(15) for i in next(it)]
        states.append(old.state_dict())
    assert max(examples[i]["duration"] for i in trained) <= 6.0

    for rank in range(3):
        new = BucketingSampler(examples, bins, rank=rank, world_size=3, **kw)
        new.load_state_dict(new.regroup_state(states))
        it = iter(new)
        short_steps = [next(it) for _ in range(40 - 15)]
        drawn = [i for b in short_steps for i in b]
        assert max(examples[i]["duration"] for i in drawn) <= 6.0
        assert not set(trained) & set(drawn) and len(drawn) == len(set(drawn))
        later = [i for _ in range(60) for i in next(it)]
        assert max(examples[i]["duration"] for i in later) > 12.0


class ListStream:
    """The smallest streamed source (the protocol in sampler.py's docstring): one shard, read in
    order, line i by rank i % world_size."""

    def __init__(self, examples):
        self.examples = examples

    def read(self, seed, rank, world_size, cursor=None):
        for i in range(cursor or 0, len(self.examples)):
            if i % world_size == rank:
                yield i, i + 1, dict(self.examples[i])

    def get(self, key):
        return dict(self.examples[key])

    def describe(self, key):
        return f"example {key}"


def test_a_streamed_source_cannot_be_regrouped_and_says_so():
    examples = [{"duration": 1 + i % 5, "num_tokens": 5 + i % 7} for i in range(50)]
    bins = estimate_bins([1 + i % 5 for i in range(50)], [5 + i % 7 for i in range(50)], 2, 1)
    old = BucketingSampler(ListStream(examples), bins, batch_size=4, rank=0, world_size=1, infinite=True,
                           concurrent=False)
    next(iter(old))
    new = BucketingSampler(ListStream(examples), bins, batch_size=4, rank=0, world_size=2, infinite=True,
                           concurrent=False)
    with pytest.raises(ValueError, match="only an in-memory infinite sampler"):
        new.regroup_state([old.state_dict()])


def trained_model_and_optimizer(seed: int = 0):
    """A tiny AED and its AdamW after one step: every moment and step count is set."""
    torch.manual_seed(seed)
    model = AED(AEDConfig(**tiny_inference_state()["model_config"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    feats, tokens = torch.randn(2, 40, 80), torch.randint(0, 500, (2, 6))
    loss, n = model(feats, torch.tensor([40, 31]), tokens, torch.tensor([6, 4]), torch.tensor([2, 2]))
    loss.backward()
    optimizer.step()
    return model, optimizer


def write_earlier_format(state: dict, path) -> None:
    """A checkpoint as aed wrote it before DCP (one writer): meta.pt lists the model's keys and keeps
    the optimizer's state without its tensors; shard-000-of-001.pt holds every tensor by key."""
    tensors = {f"model/{k}": v for k, v in state["model"].items()}
    tensors |= {f"optimizer/{pid}/{k}": v for pid, ps in state["optimizer"]["state"].items() for k, v in ps.items()}
    meta = dict(state, shards=1, model=list(state["model"]), optimizer=dict(state["optimizer"], state={
        pid: {} for pid in state["optimizer"]["state"]}))
    path.mkdir()
    torch.save(tensors, path / "shard-000-of-001.pt")
    torch.save(meta, path / "meta.pt")
    (path / "COMPLETE").write_text("1\n")


def assert_same_training_state(model, optimizer, fresh, fresh_optimizer):
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    for p, q in zip(model.parameters(), fresh.parameters()):
        a, b = optimizer.state[p], fresh_optimizer.state[q]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        assert int(a["step"]) == int(b["step"]) == 1
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_a_checkpoint_restores_weights_and_optimizer_exactly(tmp_path):
    """What train.py resumes from: weights and AdamW moments come back bit for bit, and inference
    reads the model."""
    from aed.train_checkpoint import training_tensors
    model, optimizer = trained_model_and_optimizer()
    state = tiny_inference_state() | {"model": model.state_dict(), "step": 1}
    path = save_checkpoint(state | training_tensors(model, optimizer), tmp_path, 1, keep_last=1)
    fresh, fresh_optimizer = trained_model_and_optimizer(seed=1)  # other weights and moments
    load_training_state(fresh, fresh_optimizer, str(path))
    assert_same_training_state(model, optimizer, fresh, fresh_optimizer)
    loaded = load_model(str(path))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.model.state_dict().values()))


@pytest.mark.slow(seconds=15)
def test_a_checkpoint_from_before_dcp_is_refused_then_converted_exactly(tmp_path):
    """aed wrote per-rank shard files before DCP: reading one names the command that converts it,
    and the converted checkpoint resumes the run's model and optimizer bit for bit."""
    import dataclasses
    from aed.config import to_dict
    from aed.train_config import load_train_config
    from aed.train_setup import build_training_setup
    cfg = load_train_config("configs/tiny.yaml")

    def setup(seed):
        torch.manual_seed(seed)
        built = build_training_setup(cfg, torch.device("cpu"))
        sum(p.float().pow(2).sum() for p in built.model.parameters()).backward()
        built.optimizer.step()  # every moment set
        return built

    run = setup(0)
    state = {"model_config": dataclasses.asdict(run.cfg.model), "features": dataclasses.asdict(run.cfg.features),
             "tokenizer": pack_dir(run.cfg.train.tokenizer), "step": 1, "config": to_dict(run.cfg),
             "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict()}
    old = tmp_path / "old" / "ckpt-00000001"
    old.parent.mkdir()
    write_earlier_format(state, old)
    with pytest.raises(CheckpointError, match="tools/upgrade_checkpoint.py"):
        read_checkpoint(str(old))
    subprocess.run([sys.executable, "tools/upgrade_checkpoint.py", str(old.parent), "-o", str(tmp_path / "new")],
                   check=True, capture_output=True)
    path = str(tmp_path / "new" / "ckpt-00000001")
    fresh = setup(1)  # other weights and moments
    load_training_state(fresh.model, fresh.optimizer, path)
    assert_same_training_state(run.model, run.optimizer, fresh.model, fresh.optimizer)
    assert read_checkpoint(path, with_tensors=False)["config"] == state["config"]


@pytest.mark.slow
def test_a_stop_signal_skips_the_validation_that_is_due(tmp_path):
    """Preemption leaves ~30 s: a signal that arrives during a step saves right after it, without
    first decoding the validation set (which takes minutes at scale)."""
    cmd = [sys.executable, "train.py", "configs/tiny.yaml", f"run_dir={tmp_path}", *SMALL, "max_steps=1000",
           "ckpt_every=1000", "val.every=3", "val.max_utterances=8"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    for line in proc.stderr:
        if "step 2 |" in line:  # step 3, the one with validation, is running now (or about to)
            os.killpg(proc.pid, signal.SIGTERM)
            break
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 0, rest
    stopped = int(rest.split("stopping on signal at step ")[1].split(";")[0])
    assert stopped in (2, 3) and os.path.isdir(tmp_path / f"ckpt-{stopped:08d}")
    assert "validation @ step 3" not in rest


@pytest.mark.slow
def test_unreadable_validation_audio_is_logged_once_per_run(tmp_path):
    records = [json.loads(line) for line in open(os.path.join(ROOT, "data", "mini", "dev.jsonl")).read().splitlines()[:4]]
    for r in records:
        r["audio_filepath"] = os.path.join(ROOT, "data", "mini", r["audio_filepath"])
    (tmp_path / "corrupt.flac").write_bytes(b"fLaC but not really")
    records.append(dict(records[0], audio_filepath=str(tmp_path / "corrupt.flac")))
    manifest = tmp_path / "dev.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records))
    p = run_train(tmp_path / "run", "max_steps=3", "val.every=1", f"val.manifests=[{manifest}]")
    assert p.stderr.count("validation @ step") == 4  # steps 0-3, each meets the corrupt file
    assert p.stderr.count("validation: skipped unreadable audio") == 1, p.stderr[-3000:]
