"""Injected faults that used to lose work: corrupt checkpoints, replayed steps after a kill."""

import dataclasses
import json
import os

import pytest
import torch

from aed.audio import FeatureConfig
from aed.checkpoint import CheckpointError, TRAINING_KEYS, list_checkpoints, load_latest, pack_dir, save_checkpoint
from aed.inference import load_checkpoint
from aed.model import AED, AEDConfig
from test_train import ROOT, run_train

MINI_TOKENIZER = os.path.join(ROOT, "data", "mini", "tokenizer")


def fake_state(step: int) -> dict:
    return {k: {} for k in TRAINING_KEYS} | {"step": step}


def truncate(path) -> None:
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


def test_cleanup_keeps_the_checkpoint_it_just_saved_beside_a_corrupt_newer_one(tmp_path):
    for step in (1, 2):
        save_checkpoint(fake_state(step), tmp_path, step, keep_last=1)
    (tmp_path / "ckpt-00000009.pt").write_bytes(b"half a checkpoint")  # a killed copy, higher step
    save_checkpoint(fake_state(3), tmp_path, 3, keep_last=1)
    names = [os.path.basename(p) for p in list_checkpoints(tmp_path)]
    assert names == ["ckpt-00000003.pt", "ckpt-00000009.pt"]  # step 2 rotated out, 3 kept, 9 untouched
    path, ckpt = load_latest(tmp_path)
    assert path.endswith("ckpt-00000003.pt") and ckpt["step"] == 3


def test_newest_valid_checkpoint_is_found_and_the_bad_one_named(tmp_path, caplog):
    save_checkpoint(fake_state(1), tmp_path, 1, keep_last=3)
    save_checkpoint(fake_state(2), tmp_path, 2, keep_last=3)
    truncate(tmp_path / "ckpt-00000002.pt")
    torch.save({"step": 3}, tmp_path / "ckpt-00000003.pt")  # loads, but is not a training checkpoint
    path, ckpt = load_latest(tmp_path)
    assert ckpt["step"] == 1
    assert "ckpt-00000003.pt: not a complete aed checkpoint" in caplog.text
    assert "ckpt-00000002.pt: unreadable" in caplog.text


def test_run_dir_whose_only_checkpoint_is_corrupt_has_none_to_resume_from(tmp_path):
    save_checkpoint(fake_state(5), tmp_path, 5, keep_last=1)
    truncate(tmp_path / "ckpt-00000005.pt")
    with pytest.raises(CheckpointError, match="(?s)ckpt-00000005.pt: unreadable.*move them away"):
        load_latest(tmp_path)


@pytest.mark.slow
def test_train_py_does_not_restart_a_run_whose_checkpoints_are_all_corrupt(tmp_path):
    save_checkpoint(fake_state(5), tmp_path, 5, keep_last=1)
    truncate(tmp_path / "ckpt-00000005.pt")
    p = run_train(tmp_path, "max_steps=2", check=False)
    assert p.returncode != 0 and "cannot resume" in p.stderr and "ckpt-00000005.pt" in p.stderr
    assert not os.path.exists(tmp_path / "metrics.jsonl")  # no step was trained


@pytest.mark.slow
def test_steps_replayed_after_a_kill_are_logged_once(tmp_path):
    run_train(tmp_path, "max_steps=4", "ckpt_every=2")
    os.remove(tmp_path / "ckpt-00000004.pt")  # as if killed after step 4 was logged, before its save
    p = run_train(tmp_path, "max_steps=4", "ckpt_every=2")
    assert "resumed from" in p.stderr and "dropped 2 rows logged after step 2" in p.stderr
    with open(tmp_path / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if "train/loss" in line]
    assert steps == [1, 2, 3, 4]



def test_inference_on_a_run_dir_falls_back_past_a_truncated_newest_checkpoint(tmp_path, caplog):
    cfg = AEDConfig(n_mels=80, vocab_size=528, enc_d_model=32, enc_layers=1, enc_heads=2, subsampling_channels=8,
                    dec_d_model=32, dec_layers=1, dec_heads=2, dec_max_len=64)
    state = {"model_config": dataclasses.asdict(cfg), "model": AED(cfg).state_dict(),
             "features": dataclasses.asdict(FeatureConfig(n_mels=80)), "tokenizer": pack_dir(MINI_TOKENIZER)}
    save_checkpoint(state, tmp_path, 1, keep_last=2)
    save_checkpoint(state, tmp_path, 2, keep_last=2)
    truncate(tmp_path / "ckpt-00000002.pt")
    asr = load_checkpoint(str(tmp_path))
    assert asr.path.endswith("ckpt-00000001.pt") and "ckpt-00000002.pt: unreadable" in caplog.text
    with pytest.raises(CheckpointError, match="ckpt-00000002.pt: unreadable"):
        load_checkpoint(str(tmp_path / "ckpt-00000002.pt"))  # a file named explicitly: no substitute
