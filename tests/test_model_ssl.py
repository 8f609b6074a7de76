"""BEST-RQ (aed/model_ssl.py): seeded targets, masks inside the utterances, a loss that learns, and
manifests without text: read for ssl, refused with the line and field named for the rest."""

import dataclasses
import json
import os

import pytest
import torch

from aed.data_audio import FeatureConfig, LogMel, SpecAugment
from aed.data_batch import Collate, ExampleDataset
from aed.data_manifest import ManifestError, read_manifest
from aed.model import AEDConfig
from aed.model_encoder import subsampled_length
from aed.model_ssl import BestRQ, RandomProjectionQuantizer, SSLConfig, span_mask, target_mask
from aed.train_config import OptimConfig
from aed.train_setup import build_optimizer, count_targets, train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINI = os.path.join(ROOT, "data", "mini")
N_MELS = 80


def tiny_model(seed=0, factor=8, **ssl):
    cfg = AEDConfig(n_mels=N_MELS, vocab_size=8, pad_id=1, enc_d_model=48, enc_layers=2, enc_heads=2,
                    subsampling_channels=16, subsampling_factor=factor, enc_dropout=0.0,
                    enc_dropout_pre_encoder=0.0, enc_dropout_att=0.0)
    return BestRQ(cfg, SSLConfig(**{"codebook_size": 64, **ssl}), seed=seed)


def audio_only_manifest(tmp_path, n=None):
    """data/mini/train.jsonl reduced to audio_filepath and duration (absolute paths)."""
    path = tmp_path / "audio.jsonl"
    with open(os.path.join(MINI, "train.jsonl")) as f, open(path, "w") as out:
        for line in list(f)[:n]:
            d = json.loads(line)
            out.write(json.dumps({"audio_filepath": os.path.join(MINI, d["audio_filepath"]),
                                  "duration": d["duration"]}) + "\n")
    return str(path)


def test_targets_are_a_function_of_the_seed_and_of_each_utterance_alone():
    feats = torch.randn(3, 50, N_MELS)
    a, b, c = (RandomProjectionQuantizer(N_MELS, 8, 16, 512, 2, seed=s) for s in (0, 0, 1))
    torch.manual_seed(123)  # the global RNG plays no part
    assert torch.equal(a.projection, b.projection) and torch.equal(a.codebook, b.codebook)
    assert torch.equal(a(feats), b(feats))
    assert not torch.equal(a(feats), c(feats))
    targets = a(feats)
    assert targets.shape == (3, 2, subsampled_length(50)) and targets.dtype == torch.long
    assert len(targets.unique()) > 10  # spread over the codebook, not collapsed on a few codewords
    # An utterance alone and inside a zero-padded batch: the same targets for its frames.
    alone = a(feats[:1, :37])
    padded = a(torch.cat([feats[:1, :37], torch.zeros(1, 13, N_MELS)], dim=1))
    assert torch.equal(alone, padded[:, :, : alone.shape[2]])


def test_masks_never_touch_padding_and_every_utterance_gets_one():
    lengths = torch.tensor([400, 120, 30, 1, 41])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        mask = span_mask(lengths, 420, prob=0.01, span=40, generator=g)
        pos = torch.arange(420)[None, :]
        assert not (mask & (pos >= lengths[:, None])).any()
        assert mask.any(1).all()  # the forced span: every utterance has something to predict
        assert mask[2, :30].all() and mask[3, 0]  # shorter than a span: all of it
    # The masked share follows 1 - (1 - p)^span for long utterances (BEST-RQ's p=0.01, 40 frames: ~33%).
    long = span_mask(torch.full((200,), 2000), 2000, prob=0.01, span=40, generator=g)
    assert abs(long.float().mean().item() - (1 - 0.99**40)) < 0.02
    # Targets: encoder frames whose valid stacked frames are >= 80% masked, none past the length.
    frame_mask = torch.zeros(2, 40, dtype=torch.bool)
    frame_mask[0, 8:15] = True  # 7 of encoder frame 1's 8 frames: 87.5%
    frame_mask[0, 16:22] = True  # 6 of 8: 75%, not a target
    frame_mask[1, 32:34] = True  # row 1 has 34 frames: its last encoder frame holds 2, both masked
    assert target_mask(frame_mask, torch.tensor([40, 34]), 8).tolist() == [
        [False, True, False, False, False], [False, False, False, False, True]]
    # At 4x, row 0's encoder frames 2 and 4 (frames 8-11, 16-19) are all masked; 3 holds 3 of 4, 5 holds 2 of 4.
    assert target_mask(frame_mask, torch.tensor([40, 34]), 4)[0, :6].tolist() == [False, False, True, False, True, False]


@pytest.mark.parametrize("factor", [8, 4])
def test_the_model_masks_with_noise_inside_utterances_only(factor):
    model = tiny_model(factor=factor)
    seen = {}
    model.encoder.register_forward_pre_hook(lambda m, args: seen.update(x=args[0].clone()))
    feats = torch.randn(2, 100, N_MELS)
    feats[1, 60:] = 0.0  # padding
    lens = torch.tensor([100, 60])
    torch.manual_seed(0)
    loss, n = model(feats, lens)
    changed = (seen["x"] != feats).any(-1)  # (B, T) frames the encoder saw replaced
    assert changed[0].any() and changed[1, :60].any() and not changed[1, 60:].any()
    assert n == subsampled_length(lens, factor).sum() and torch.isfinite(loss)


def test_ssl_loss_goes_down_on_the_bundled_audio(tmp_path):
    """30 steps of the shared training step on 8 bundled utterances read from an audio-only
    manifest: the masked-prediction loss ends below the entropy of the targets' own distribution,
    the best any predictor that ignores the audio can do, so the encoder uses the unmasked context."""
    utts = read_manifest(audio_only_manifest(tmp_path, 8), needs_text=False)
    ds = ExampleDataset(utts, None, LogMel(FeatureConfig(n_mels=N_MELS)).eval())
    batch = Collate(0)([ds[i] for i in range(len(utts))])
    assert batch.tokens.shape == (8, 0) and batch.prompt_lens.tolist() == [0] * 8
    torch.manual_seed(0)
    model = tiny_model().train()
    optimizer = build_optimizer(model, OptimConfig(lr=5e-3))
    scaler, no_aug = torch.amp.GradScaler("cpu", enabled=False), SpecAugment().eval()
    losses = []
    for _ in range(30):
        n = count_targets(model, [batch])
        result = train_step(model, [batch], optimizer, scaler, no_aug, "fp32", 1.0, n)
        assert result.count == n  # the host's count is the forward's
        losses.append(result.loss.item() / n)
    targets = model.quantizer(batch.feats)[:, 0]  # (B, T')
    valid = torch.arange(targets.shape[1])[None, :] < subsampled_length(batch.feat_lens)[:, None]
    p = torch.bincount(targets[valid], minlength=64).float() / valid.sum()
    unigram = -(p[p > 0] * p[p > 0].log()).sum().item()  # ~3.5 nats here, ln 64 = 4.16
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < unigram < first, (unigram, losses)


def test_audio_only_manifests_are_read_for_ssl_and_refused_with_line_and_field_otherwise(tmp_path):
    path = audio_only_manifest(tmp_path, 5)
    utts = read_manifest(path, needs_text=False)
    assert len(utts) == 5 and utts[0].duration > 0 and utts[0].text == ""
    for skip_invalid in (False, True):  # skipping every line would leave nothing: refused either way
        with pytest.raises(ManifestError, match=rf"{path}:1: field 'text': missing.*audio-only"
                           if skip_invalid else rf"{path}:1: field 'text': missing"):
            read_manifest(path, skip_invalid=skip_invalid)


@pytest.mark.parametrize("objective", ["aed", "rnnt"])
def test_train_py_refuses_an_audio_only_manifest_for_objectives_that_need_text(tmp_path, monkeypatch, objective):
    from aed.cli_train import main

    monkeypatch.chdir(ROOT)
    path = audio_only_manifest(tmp_path, 3)
    with pytest.raises(SystemExit, match=rf"data error: {path}:1: field 'text': missing"):
        main(["configs/tiny.yaml", f"run_dir={tmp_path / 'run'}", f"objective={objective}", "cpu_threads=1",
                    f"train.manifests=[{path}]", "train.num_workers=0"])


def test_oom_sizes_ssl_batches_on_1d_buckets():
    """oom.py's artificial step runs BEST-RQ on duration-only buckets (2-token batches: no text)."""
    from bins import estimate_bins
    from aed.train_data import bucket_shapes
    from aed.memory_oomptimizer import TrainingStep

    bins = estimate_bins([1.0, 2.0, 3.0, 4.0] * 10, [0] * 40, 2, 1)
    shapes = bucket_shapes(bins, FeatureConfig(n_mels=N_MELS), 128, max_tps=0.0)
    assert [u for _, _, u in shapes] == [2, 2]
    model = tiny_model().train()
    step = TrainingStep(model, build_optimizer(model, OptimConfig()), spec_augment=SpecAugment().eval())
    step.warm_up(*shapes[-1][1:])
    peaks = [step.peak(n, shapes[-1][1], 2) for n in (1, 4)]
    assert 0 < peaks[0] < peaks[1]  # memory grows with the batch: what the search relies on


def test_a_simulated_ssl_step_bounds_the_real_one_from_above():
    """Fake tensors cannot know BEST-RQ's random masks: the simulator lets them select every frame,
    so the simulated peak is at least the real one (never under), and not wildly above it."""
    from aed.memory_measure import SimulatedDevice
    from aed.memory_oomptimizer import TrainingStep

    def step():
        torch.manual_seed(0)
        model = tiny_model().train()
        s = TrainingStep(model, build_optimizer(model, OptimConfig()))
        s.warm_up(101, 2)
        return s

    real = step().peak(4, 401, 2)
    with SimulatedDevice():
        simulated = step().peak(4, 401, 2)
    assert real <= simulated < 2 * real, (real, simulated)


@pytest.mark.parametrize("encoder_only", [True, False])
def test_an_ssl_checkpoint_initialises_the_encoder_of_an_aed_and_a_transducer(tmp_path, encoder_only):
    """init_from: the pretrained encoder loads into an AED with a CTC head and into a transducer; the
    BEST-RQ quantizer and heads have no place there and are dropped, the rest stays fresh."""
    from aed.train_checkpoint import init_from_checkpoint, save_checkpoint
    from aed.model import AED
    from aed.model_transducer import TransducerASR

    ssl = tiny_model()
    path = save_checkpoint({"model": ssl.state_dict()}, str(tmp_path), 7, keep_last=1)
    cfg = dataclasses.replace(ssl.cfg, vocab_size=40, dec_d_model=48, dec_layers=1, dec_heads=2, ctc_loss_weight=0.3)
    for model in (AED(cfg), TransducerASR(cfg, 38, pred_dim=32, joint_dim=32)):
        fresh = {k: v.clone() for k, v in model.state_dict().items()}
        note = init_from_checkpoint(model, path, encoder_only)
        assert "not in this model, dropped: heads, quantizer" in note
        for k, v in model.state_dict().items():
            if k.startswith("encoder."):
                assert torch.equal(v, ssl.state_dict()[k]), k
            else:
                assert torch.equal(v, fresh[k]), k  # decoder, CTC head, transducer: as initialised
