"""Validation's check that the decoder listens: the cross-entropy of each utterance's text with its
own audio against another utterance's, per source language, train.py's warning when they agree, and
the same check on training batches, which can end the attention guide."""

import logging
import re

import pytest
import torch
from test_model import tiny_config
from test_train import SMALL, losses, run_in_process

import aed.train_guide
from aed.data_batch import Batch
from aed.model import AED
from aed.train_validation import LISTENING_GAP, batch_listening_gap, ctc_transcripts, listening, not_listening


@pytest.mark.parametrize("loss_on_prompt", [True, False])
def test_token_nll_with_its_own_audio_is_the_training_loss(loss_on_prompt):
    torch.manual_seed(0)
    model = AED(tiny_config(ctc_loss_weight=0.0, loss_on_prompt=loss_on_prompt)).eval()
    feats, feat_lens = torch.randn(3, 80, 24), torch.tensor([80, 61, 40])
    tokens, token_lens, prompt_lens = torch.randint(2, 40, (3, 9)), torch.tensor([9, 7, 5]), torch.tensor([3, 3, 2])
    loss, n = model(feats, feat_lens, tokens, token_lens, prompt_lens)
    nll, count = model.token_nll(*model.encode(feats, feat_lens), tokens, token_lens, prompt_lens)
    assert nll.shape == count.shape == (3,)
    assert int(count.sum()) == int(n)
    torch.testing.assert_close(nll.sum(), loss)


def test_the_ctc_head_s_transcripts_are_of_the_transcribed_rows_in_batch_order():
    """Validation's ctc_wer scores the CTC head's best path on the rows whose text is their words:
    a head that always emits token 7 on one frame then blank gives one 7 per row, translations left out."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    model = AED(tiny_config(ctc_loss_weight=0.5)).eval()
    with torch.no_grad():
        model.ctc.proj.weight.zero_()
        model.ctc.proj.bias.fill_(-10).index_fill_(0, torch.tensor([7]), 10.0)  # every frame says 7: merged to one 7
    feats, feat_lens = torch.randn(3, 80, 24), torch.tensor([80, 61, 40])
    tokens = torch.randint(2, 40, (3, 9))
    batch = Batch(feats, feat_lens, tokens, torch.tensor([9, 7, 5]), torch.tensor([3, 3, 2]), ["a", "b", "c"],
                  [0, 1, 2], [], torch.tensor([True, False, True]))
    utts = [SimpleNamespace(source_lang=s, target_lang=t, text=x) for s, t, x in
            [("en", "en", "one"), ("en", "de", "eins"), ("de", "de", "drei")]]
    tokenizer = SimpleNamespace(decode=lambda ids: "+".join(map(str, ids)))
    with torch.no_grad():
        rows = ctc_transcripts(model, batch, utts, tokenizer)
    assert rows == [("asr", "en", "en", "one", "7"), ("asr", "de", "de", "drei", "7")]


def test_listening_sums_ranks_per_language_and_warns_below_the_gap():
    ranks = [{"en": [20.0, 60.0, 10], "de": [9.0, 9.5, 5]}, {"en": [10.0, 30.0, 5]}]
    res = listening("dev", ranks)
    assert res == pytest.approx({"dev/ce": 39 / 20, "dev/ce_other_audio": 99.5 / 20,
                                 "dev/ce_gap_de": 0.1, "dev/ce_gap_en": 4.0})
    assert not_listening(res) == []
    deaf = listening("dev", [{"en": [21.0, 21.0 + LISTENING_GAP * 10 * 0.5, 10]}])
    (line,) = not_listening(deaf)
    assert "the decoder is not using the audio on dev" in line and "within 0.12 nats/token" in line


def test_a_run_logs_the_check_and_warns_about_a_decoder_that_ignores_the_audio(tmp_path, caplog):
    """Two steps from random weights: the decoder cannot listen yet, so the step-2 validation warns
    (step 0's does not: nothing listens at initialisation)."""
    from aed.cli_train import main

    caplog.set_level(logging.WARNING, logger="train")
    p = run_in_process(main, ["configs/tiny.yaml", f"run_dir={tmp_path}", *SMALL, "max_steps=2", "val.every=2",
                                    "val.max_utterances=8", "train.num_workers=0"])
    assert p.returncode == 0, p.stderr[-3000:]
    warned = [r.getMessage() for r in caplog.records if "not using the audio" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("step 2: "), warned
    rows = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "val/dev/ce_other_audio" in line]
    assert len(rows) == 2  # step 0 and step 2


def test_validation_drops_utterances_longer_than_the_decoder_as_training_does(tmp_path):
    """A dev utterance whose prompt + text exceed model.dec_max_len is dropped and counted, not fed to
    the decoder, whose position table it would overrun (that stopped a run at its step-0 validation)."""
    from aed.cli_train import main

    from aed.data_batch import encodable
    from aed.data_manifest import read_manifest
    from aed.data_tokenizer import Tokenizer

    limit = 40
    _, counts = encodable(read_manifest("data/mini/dev.jsonl", False), Tokenizer.load("data/mini/tokenizer"), False)
    over = sum(n > limit for n in counts)
    assert 0 < over < len(counts)
    p = run_in_process(main, ["configs/tiny.yaml", f"run_dir={tmp_path}", *SMALL, f"model.dec_max_len={limit}",
                                    "max_steps=1", "val.every=1", "train.num_workers=0"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"validation on data/mini/dev.jsonl: dropping {over} utterances" in p.stderr
    assert "training: dropping" in p.stderr
    rows = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "val/dev/loss" in line]
    assert len(rows) == 2  # steps 0 and 1


def test_batch_listening_gap_is_the_token_mean_of_swapped_minus_own_and_zero_for_a_deaf_decoder():
    torch.manual_seed(0)
    model = AED(tiny_config(ctc_loss_weight=0.0)).train()
    with torch.no_grad():  # at initialisation the audio barely moves the output: make it matter
        for layer in model.decoder.layers:
            layer.cross_attn.out_projection.weight.mul_(30)
    feats, feat_lens = torch.randn(3, 80, 24) * torch.tensor([1.0, 3.0, 9.0])[:, None, None], torch.tensor([80, 61, 40])
    tokens, token_lens, prompt_lens = torch.randint(2, 40, (3, 9)), torch.tensor([9, 7, 5]), torch.tensor([3, 3, 2])
    batch = Batch(feats, feat_lens, tokens, token_lens, prompt_lens, ["a", "b", "c"], [0, 1, 2], [])
    cpu = torch.device("cpu")
    gap = batch_listening_gap(lambda: model, batch, cpu, "fp32", "none")
    assert model.training  # put back in training mode
    with torch.no_grad():
        memory, memory_lens = model.eval().encode(feats, feat_lens)
        own, count = model.token_nll(memory, memory_lens, tokens, token_lens, prompt_lens)
        other, _ = model.token_nll(memory.roll(1, 0), memory_lens.roll(1, 0), tokens, token_lens, prompt_lens)
    assert gap == pytest.approx(float((other - own).sum() / count.sum()), rel=1e-5) and abs(gap) > 1e-4
    for layer in model.decoder.layers:  # cross-attention that adds nothing: the audio cannot matter
        torch.nn.init.zeros_(layer.cross_attn.out_projection.weight)
        torch.nn.init.zeros_(layer.cross_attn.out_projection.bias)
    assert batch_listening_gap(lambda: model, batch, cpu, "fp32", "none") == pytest.approx(0.0, abs=1e-6)
    one = Batch(feats[:1], feat_lens[:1], tokens[:1], token_lens[:1], prompt_lens[:1], ["a"], [0], [])
    # no other row to take audio from: None, and the model is not asked for (FSDP2 would gather it)
    assert batch_listening_gap(lambda: pytest.fail("built"), one, cpu, "fp32", "none") is None


def test_the_guide_ramps_up_to_its_weight_then_ends_at_its_steps():
    """train.attention_guide_ramp: the weight rises linearly from 0 over the ramp's steps, holds, and
    is 0 from the guide's last step on; without a ramp it is full from step 0."""
    from types import SimpleNamespace

    from aed.train_config import load_train_config
    from aed.train_guide import GuideState, set_attention_guide

    def weights(*overrides):
        cfg = load_train_config("configs/tiny.yaml", ["train.attention_guide=[2.0,300]", *overrides])
        setup = SimpleNamespace(cfg=cfg, model=SimpleNamespace())
        out = []
        for step in (0, 50, 100, 250, 299, 300):
            set_attention_guide(setup, None, step, GuideState())
            out.append(setup.model.attention_guide)
        return out

    assert weights("train.attention_guide_ramp=100") == [0.0, 1.0, 2.0, 2.0, 2.0, 0.0]
    assert weights() == [2.0, 2.0, 2.0, 2.0, 2.0, 0.0]


@pytest.mark.slow(seconds=40)
def test_the_guide_until_listening_ends_at_the_first_check_that_listens_and_resumes_where_it_stood(tmp_path,
                                                                                                     monkeypatch):
    """The check (faked: nothing to swap at step 2, so it is due again at 3: deaf; listening at 4)
    ends the guide at step 4 exactly as a guide of 4 steps ends. A run resumed in between checks at
    step 3 as the uninterrupted one did, and one resumed after the end keeps the guide off although
    its checks would say deaf."""
    from aed.cli_train import main

    gaps = []
    monkeypatch.setattr(aed.train_guide, "GUIDE_CHECK_EVERY", 2)
    monkeypatch.setattr(aed.train_guide, "batch_listening_gap", lambda *args: gaps.pop(0))

    def run(run_dir, *overrides):
        p = run_in_process(main, ["configs/tiny.yaml", f"run_dir={run_dir}", *SMALL, "ckpt_every=100",
                                        "train.attention_guide=[1.0,100]", "train.num_workers=0", *overrides])
        assert p.returncode == 0, p.stderr[-3000:]
        return p

    gaps[:] = [None, 0.0, LISTENING_GAP]
    p = run(tmp_path / "a", "max_steps=6", "train.attention_guide_until=listening")
    assert "step 2: the decoder's" not in p.stderr and "step 2: no rank has two utterances" in p.stderr
    assert "step 3: the decoder's cross-entropy on its training batch is 0.00 nats/token" in p.stderr
    assert "attention guide stays on until" in p.stderr and "step 4: " in p.stderr
    assert "it listens, attention guide off" in p.stderr
    assert gaps == []  # no check after the guide ended
    run(tmp_path / "steps", "max_steps=6", "train.attention_guide=[1.0,4]")
    assert losses(tmp_path / "a") == losses(tmp_path / "steps")  # bitwise: the same guided steps
    gaps[:] = [None]
    run(tmp_path / "b", "max_steps=3", "train.attention_guide_until=listening")  # its last step checks
    assert gaps == []
    gaps[:] = [0.0, LISTENING_GAP]  # the checkpoint says a check is due at step 3
    run(tmp_path / "b", "max_steps=5", "train.attention_guide_until=listening")
    assert gaps == []
    gaps[:] = [0.0] * 3  # deaf, were it asked: the checkpoint's guide_ended keeps the guide off
    p = run(tmp_path / "b", "max_steps=6", "train.attention_guide_until=listening")
    assert "its attention guide ended at step 4" in p.stderr and len(gaps) == 3
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert all(la[k] == lb[k] for k in range(1, 7)), (la, lb)


@pytest.mark.slow(seconds=15)
def test_the_listening_check_runs_on_a_sharded_model(tmp_path, monkeypatch):
    """FSDP2 runs a sharded model's layers only inside its forward: the check measures the whole copy
    validation uses, and logs a measured gap."""
    from aed.cli_train import main

    monkeypatch.setattr(aed.train_guide, "GUIDE_CHECK_EVERY", 2)
    p = run_in_process(main, ["configs/tiny.yaml", f"run_dir={tmp_path}", *SMALL, "max_steps=3", "ckpt_every=100",
                                    "train.attention_guide=[1.0,100]", "train.attention_guide_until=listening",
                                    "train.strategy=fsdp", "train.num_workers=0"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"step 2: the decoder's cross-entropy on its training batch is -?\d+\.\d\d nats/token", p.stderr)


def test_a_decoder_restart_draws_the_decoder_anew_alike_on_every_rank_and_keeps_the_encoder():
    """restart_decoder: the decoder's and its input projection's weights become a new model's (the
    same for the same step, as every rank must draw), the encoder and CTC head keep theirs, and the
    optimizer forgets the restarted parameters' moments only."""
    from types import SimpleNamespace

    from aed.train_config import OBJECTIVES, load_train_config
    from aed.train_guide import restart_decoder

    cfg = load_train_config("configs/tiny.yaml", [])
    cfg.model.vocab_size, cfg.model.pad_id = 40, 1  # what the tokenizer sets in a run
    objective = OBJECTIVES["aed"]

    def trained_setup():
        torch.manual_seed(5)
        model = objective.build(cfg, 40)
        optimizer = torch.optim.AdamW(model.parameters())
        loss = sum(p.sum() for p in model.parameters())  # a gradient of 1 everywhere
        loss.backward()
        optimizer.step()  # every parameter moves off its initial value and gets moments
        return SimpleNamespace(cfg=cfg, model=model, optimizer=optimizer, objective=objective,
                               tokenizer=SimpleNamespace(vocab_size=40))

    a, b = trained_setup(), trained_setup()
    before = {k: v.clone() for k, v in a.model.state_dict().items()}
    restart_decoder(a, 300, None)
    restart_decoder(b, 300, None)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed + 300)
        new = objective.build(cfg, 40).state_dict()
    params = dict(a.model.named_parameters())
    restarted = [k for k in params if k.startswith(("decoder.", "encoder_decoder_proj."))]
    kept = [k for k in params if k not in restarted]
    assert restarted and any(k.startswith("encoder.") for k in kept) and any(k.startswith("ctc.") for k in kept)
    for k in restarted:
        assert torch.equal(params[k], new[k]) and not torch.equal(params[k], before[k]), k
        assert params[k] not in a.optimizer.state
    for k in kept:
        assert torch.equal(params[k], before[k]), k
        assert params[k] in a.optimizer.state
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))


@pytest.mark.slow(seconds=90)
def test_a_guided_decoder_that_never_listens_is_restarted_or_the_run_stops_saying_what_it_measured(tmp_path):
    """Transcripts given to other utterances' audio: no decoder can listen, and no CTC head learn.
    With the guide until listening for 4 steps and validation (whose CTC WER is ~100%), the run stops
    at step 4 (exit status 1) saying the encoder has not learned the sounds either, with a checkpoint;
    rerun as it is, it stops again at once. Without validation to tell, the decoder is restarted at
    step 4 and the run stops at step 8; resumed with train.decoder_restarts=2, it restarts again."""
    from test_train import deaf_manifest, run_train

    guided = ["max_steps=20", "ckpt_every=100", "train.num_workers=0", f"train.manifests=[{deaf_manifest(tmp_path)}]",
              "val.manifests=[data/mini/digits/dev.jsonl]", "val.max_utterances=16",
              "train.attention_guide=[1.0,4]", "train.attention_guide_until=listening"]

    def stop_line(p):
        assert p.returncode == 1, p.stderr[-3000:]
        (line,) = [x for x in p.stderr.splitlines() if x.startswith("stopping: the decoder does not use the audio")]
        assert "Rerun the same command to resume" in line
        return line

    validated = tmp_path / "validated"
    line = stop_line(run_train(validated, *guided, "val.every=2", check=False))
    assert "after 0 decoder restart(s): after 4 guided steps (step 4)" in line
    assert re.search(r"the CTC head's WER at the last validation: dev (9\d|1\d\d)\.\d%", line)
    assert "The encoder has not learned the sounds either" in line
    assert (validated / "ckpt-00000004").is_dir() and max(losses(validated)) == 4
    line = stop_line(run_train(validated, *guided, "val.every=2", check=False))  # resumed: checks at once
    assert "(step 4)" in line and max(losses(validated)) == 4

    blind = tmp_path / "blind"
    p = run_train(blind, *guided, "val.every=0", check=False)
    assert "*** the decoder does not use the audio: after 4 guided steps (step 4)" in p.stderr
    assert "(restart 1 of train.decoder_restarts=1) ***" in p.stderr
    line = stop_line(p)
    assert "after 1 decoder restart(s): after 4 guided steps (step 8)" in line and "Validate (val.manifests" in line
    assert (blind / "ckpt-00000008").is_dir() and max(losses(blind)) == 8
    p = run_train(blind, *guided, "val.every=0", "max_steps=10", "train.decoder_restarts=2", check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "(restart 2 of train.decoder_restarts=2)" in p.stderr and max(losses(blind)) == 10


@pytest.mark.slow(seconds=45)
def test_the_guide_resumes_when_validation_and_the_training_batch_find_the_decoder_deaf_after_it_ended(
        tmp_path, monkeypatch):
    """The guide ends at a check that (faked) says the decoder listens; validation at step 4 measures
    the real 4-step decoder, which cannot listen yet, so step 4 checks its training batch: deaf there
    too (faked), the guide resumes from step 4, and its checks with it (the next at step 6); listening
    there, the guide stays off and no further check runs."""
    from aed.cli_train import main

    gaps = []
    monkeypatch.setattr(aed.train_guide, "GUIDE_CHECK_EVERY", 2)
    monkeypatch.setattr(aed.train_guide, "batch_listening_gap", lambda *args: gaps.pop(0))

    def run(run_dir):
        p = run_in_process(main, ["configs/tiny.yaml", f"run_dir={run_dir}", *SMALL, "max_steps=7", "val.every=4",
                                        "val.max_utterances=8", "train.num_workers=0",
                                        "train.attention_guide=[1.0,100]", "train.attention_guide_until=listening"])
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stderr

    gaps[:] = [LISTENING_GAP, 0.0, 0.0]
    err = run(tmp_path / "deaf")
    assert "step 2: the decoder's cross-entropy on its training batch is 0.25" in err
    assert ("*** step 4: the decoder no longer uses the audio (0.00 nats/token on its training batch, and deaf at the "
            "last validation), though it did when its attention guide ended at step 2: the guide resumes for up to "
            "100 steps ***") in err
    assert "step 6: the decoder's cross-entropy on its training batch is 0.00" in err and gaps == []
    gaps[:] = [LISTENING_GAP, 0.5]
    err = run(tmp_path / "listening")
    assert "step 4: the decoder's cross-entropy on its training batch is 0.50 nats/token higher" in err
    assert "the attention guide stays off" in err and "guide resumes" not in err and gaps == []


def test_validation_decodes_with_the_options_of_the_val_decoding_section():
    """The val.decoding section is DecodingOptions itself: validation searches with what it sets,
    its frame_seconds the model's (40 ms at subsampling 4)."""
    import dataclasses

    from aed.data_manifest import Faults
    from aed.data_sources import ManifestEntry
    from aed.decode_search import DecodingOptions
    from aed.train_config import load_train_config
    from aed.train_setup import build_training_setup
    from aed.train_validation import evaluate

    asked = ["val.decoding.beam_size=2", "val.decoding.ctc_weight=0.5", "val.decoding.max_repeats=2",
             "val.decoding.no_speech_threshold=null", "val.max_utterances=2", "model.subsampling_factor=4"]
    cfg = load_train_config("configs/tiny.yaml", [*SMALL, *asked])
    assert cfg.val.decoding == DecodingOptions(beam_size=2, ctc_weight=0.5, max_repeats=2, no_speech_threshold=None)
    setup = build_training_setup(cfg, torch.device("cpu"), "fp32")
    searched = []

    def hypotheses(model, batch, eos_id, options, amp, decoder=None):
        searched.append(options)
        return [[] for _ in range(len(batch))]

    setup = dataclasses.replace(setup, objective=dataclasses.replace(setup.objective, hypotheses=hypotheses))
    results = evaluate(setup, setup.model, {"dev": ManifestEntry.of("data/mini/dev.jsonl")}, 0, 1, False, Faults())
    assert "dev/wer" in results and searched
    assert set(searched) == {dataclasses.replace(cfg.val.decoding, frame_seconds=0.04)}
