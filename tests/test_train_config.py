import os
import re
import subprocess
import sys

import pytest

from aed.config import ConfigError, describe
from aed.train_config import TrainConfig, help_text, load_train_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_model_fields_with_another_source_are_rejected_and_n_mels_follows_the_features():
    cfg = load_train_config(os.path.join(ROOT, "configs/tiny.yaml"), ["features.n_mels=64"])
    assert cfg.model.n_mels == cfg.features.n_mels == 64
    for key, source in [("model.n_mels=80", "features.n_mels"), ("model.vocab_size=528", "tokenizer"),
                        ("model.pad_id=1", "tokenizer")]:
        with pytest.raises(ConfigError, match=rf"{key.split('=')[0]} is set from .*{source}"):
            load_train_config(os.path.join(ROOT, "configs/tiny.yaml"), [key])


def test_later_yaml_files_override_earlier_ones_and_train_py_takes_them_in_order(tmp_path):
    from aed.train_config import parse_config

    tiny = os.path.join(ROOT, "configs/tiny.yaml")
    buckets = tmp_path / "buckets.yaml"  # what oom.py --out writes
    buckets.write_text("train:\n  batch_sizes: b.json\n  max_tps: [20.5, 16]\n")
    cfg, _ = parse_config([tiny, str(buckets), "train.num_buckets=3"])
    assert cfg.train.batch_sizes == "b.json" and cfg.train.max_tps == [20.5, 16.0]
    assert cfg.train.num_buckets == 3 and cfg.train.sub_buckets == 2 and cfg.model.enc_d_model == 144  # tiny's
    with pytest.raises(ConfigError, match="max_tps"):
        load_train_config([tiny, str(buckets)], ["train.max_tps=[fast]"])
    with pytest.raises(ConfigError, match="missing.yaml: cannot read the config file"):
        load_train_config([tiny, str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(ROOT, "configs"))))
def test_every_shipped_config_loads(name):
    cfg = load_train_config(os.path.join(ROOT, "configs", name))
    assert cfg.model.n_mels == cfg.features.n_mels


def test_choices_are_checked_with_the_key_named():
    for override, key in [("objective=ctc", "objective"), ("precision=int8", "precision"),
                          ("train.allocation=loose", "train.allocation"), ("model.enc_heads=5", "model"),
                          ("optim.schedule=linear", "optim.schedule"),
                          ("spec_augment.freq_warp=1.0", "spec_augment"),
                          ("train.attention_guide_to=alignment", "train.attention_guide_to"),
                          ("train.attention_guide_ramp=-1", "train.attention_guide_ramp")]:
        with pytest.raises(ConfigError, match=key):
            load_train_config(os.path.join(ROOT, "configs/tiny.yaml"), [override])
    # the CTC alignment needs a CTC head; the diagonal does not
    guide = ["train.attention_guide=[1.0,10]", "model.ctc_loss_weight=0"]
    assert load_train_config(os.path.join(ROOT, "configs/tiny.yaml"), guide).train.attention_guide_to == "diagonal"
    with pytest.raises(ConfigError, match="attention_guide_to=ctc .* needs model.ctc_loss_weight > 0"):
        load_train_config(os.path.join(ROOT, "configs/tiny.yaml"), [*guide, "train.attention_guide_to=ctc"])


def test_validation_decodes_with_the_val_decoding_section_and_its_old_key_names_the_new_one(tmp_path):
    """val.decoding is DecodingOptions, infer.py's decoding flags as keys with their defaults and
    checks; the decoding weight once at val.ctc_weight gives an error naming its new key."""
    from aed.decode_search import DecodingOptions

    tiny = os.path.join(ROOT, "configs/tiny.yaml")
    assert load_train_config(tiny).val.decoding == DecodingOptions()
    cfg = load_train_config(tiny, ["val.decoding.ctc_weight=0", "val.decoding.beam_size=4"])
    assert cfg.val.decoding == DecodingOptions(ctc_weight=0.0, beam_size=4)
    old = tmp_path / "old.yaml"
    old.write_text("val:\n  ctc_weight: 0.3\n")
    for files, overrides in (([tiny], ["val.ctc_weight=0.3"]), ([tiny, str(old)], [])):
        with pytest.raises(ConfigError, match=r"^val\.ctc_weight is now val\.decoding\.ctc_weight$"):
            load_train_config(files, overrides)
    with pytest.raises(ConfigError, match=r"^val\.decoding: CTC weight 2\.0 must lie in \[0, 1\]$"):
        load_train_config(tiny, ["val.decoding.ctc_weight=2"])
    with pytest.raises(ConfigError, match=r"val\.decoding\.frame_seconds is set from the model"):
        load_train_config(tiny, ["val.decoding.frame_seconds=0.04"])
    assert re.search(r"^  val\.decoding\.ctc_weight +float = 0\.3\n +joint CTC/attention decoding weight",
                     help_text(), re.M)


def test_the_old_ctc_loss_weight_key_names_the_new_one_and_saved_configs_read_as_today_s(tmp_path):
    """The CTC loss weight was model.ctc_weight, the name decoding's weight keeps: a config or override
    that sets it is an error naming model.ctc_loss_weight; a run's saved config (a checkpoint's, which
    tools/upgrade_checkpoint.py rebuilds) is read with both old keys renamed."""
    from aed.config import renamed
    from aed.model import AEDConfig

    tiny = os.path.join(ROOT, "configs/tiny.yaml")
    assert load_train_config(tiny, ["model.ctc_loss_weight=1.0"]).model.ctc_loss_weight == 1.0
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  enc_d_model: 64\n  ctc_weight: 0.3\n")
    for files, overrides in (([tiny], ["model.ctc_weight=0.3"]), ([tiny, str(old)], [])):
        with pytest.raises(ConfigError, match=r"^model\.ctc_weight is now model\.ctc_loss_weight$"):
            load_train_config(files, overrides)
    with pytest.raises(ConfigError, match=r"^model\.ctc_weight is now model\.ctc_loss_weight$"):
        AEDConfig.from_yaml(old)
    saved = {"model": {"enc_d_model": 64, "ctc_weight": 0.3}, "val": {"every": 5, "ctc_weight": 0.5,
                                                                      "decoding": {"beam_size": 2}}}
    assert renamed(TrainConfig, saved) == {"model": {"enc_d_model": 64, "ctc_loss_weight": 0.3},
                                           "val": {"every": 5, "decoding": {"ctc_weight": 0.5, "beam_size": 2}}}


def test_every_key_is_described_with_type_and_default():
    rows = describe(TrainConfig)
    keys = {k for k, *_ in rows}
    assert {"optim.lr", "train.manifests", "model.ctc_loss_weight", "spec_augment.time_masks", "val.every"} <= keys
    for key, type_name, default, text in rows:
        assert type_name and default and len(text) > 10, (key, type_name, default, text)
    lr = next(r for r in rows if r[0] == "optim.lr")
    assert lr[1:3] == ("float", "0.0003") and "learning rate" in lr[3]
    assert re.search(r"^  model\.vocab_size .*\n +\(set from the tokenizer", help_text(), re.M)


@pytest.mark.slow
def test_the_commands_import_without_running_and_train_py_prints_its_keys():
    p = subprocess.run([sys.executable, "-c", "import aed.cli_train, aed.cli_oom, aed.cli_infer, sampler; print('imported')"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "imported\n" and "config" not in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0
    assert re.search(r"^  optim\.warmup_steps +int = 2500\n +linear warmup", p.stdout, re.M), p.stdout[-2000:]
    assert "torchrun --nproc_per_node 8 train.py" in p.stdout  # the usage, above the keys
    p = subprocess.run([sys.executable, "oom.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--simulate-memory SIZE" in p.stdout, p.stdout + p.stderr
    p = subprocess.run([sys.executable, "infer.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "usage: infer.py" in p.stdout and "--stream-chunk S" in p.stdout, p.stdout + p.stderr
