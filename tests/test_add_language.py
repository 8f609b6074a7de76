"""tools/add_language.py and the growth behind it: a new language keeps every old id and output."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from tools.add_language import main as add_language

from aed.config import ConfigError
from aed.data_audio import FeatureConfig
from aed.data_batch import Batch
from aed.data_tokenizer import Tokenizer
from aed.decode_search import DecodingOptions
from aed.decode_transcribe import read_requests, transcribe
from aed.model import AED, AEDConfig
from aed.model_checkpoint import load_model, pack_dir
from aed.train_checkpoint import init_from_checkpoint, save_checkpoint
from aed.train_config import TrainConfig
from aed.train_setup import build_model, build_optimizer, new_tokens, train_mode, train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINI = os.path.join(ROOT, "data", "mini")
ITALIAN = ["Il gatto dorme sul divano.", "Domani andiamo al mare con gli amici.", "Quanto costa questo libro?",
           "La cena è pronta, venite a tavola.", "Non ho capito la domanda.", "Piove da tre giorni in città."]


def tiny_config(tokenizer: Tokenizer) -> AEDConfig:
    return AEDConfig(n_mels=32, vocab_size=tokenizer.padded_vocab_size, pad_id=tokenizer.pad, enc_d_model=32,
                     enc_layers=1, enc_heads=2, subsampling_channels=8, dec_d_model=32, dec_layers=1, dec_heads=2,
                     dec_max_len=64, ctc_loss_weight=0.3)


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """(old checkpoint path, new checkpoint path): a tiny model with a CTC head, then + Italian."""
    tmp = tmp_path_factory.mktemp("lang")
    torch.manual_seed(0)
    tokenizer = Tokenizer.load(os.path.join(MINI, "tokenizer"))
    cfg = tiny_config(tokenizer)
    model = AED(cfg)
    with torch.no_grad():  # a random decoder's logits are nearly flat; spread them as a trained one's are
        model.decoder.output_proj.weight.mul_(20)
    save_checkpoint({"model": model.state_dict(), "model_config": dataclasses.asdict(cfg),
                     "features": dataclasses.asdict(FeatureConfig(n_mels=32)), "max_train_duration": 4.5,
                     "tokenizer": pack_dir(os.path.join(MINI, "tokenizer"))}, str(tmp), 1, keep_last=1)
    manifest = tmp / "it.jsonl"
    manifest.write_text("".join(json.dumps({"audio_filepath": "x.wav", "text": t, "source_lang": "it",
                                            "target_lang": "it"}) + "\n" for t in ITALIAN))
    out = tmp / "it" / "model-it.pt"
    add_language(["--ckpt", str(tmp), "--lang", "it", "--manifest", str(manifest), "--vocab-size", "320",
                  "-o", str(out)])
    return str(tmp), str(out)


def test_old_ids_prompts_and_outputs_are_unchanged(grown):
    old_dir, new_path = grown
    old, new = load_model(old_dir), load_model(new_path)
    assert new.tokenizer.languages == old.tokenizer.languages + ["it"]
    assert new.tokenizer.vocab_size > old.tokenizer.vocab_size
    assert new.max_train_duration == 4.5
    for lang in old.tokenizer.languages:
        assert new.tokenizer.prompt_ids(lang, lang, True) == old.tokenizer.prompt_ids(lang, lang, True)
        assert new.tokenizer.encode("Cats are smarter than dogs.", lang) == old.tokenizer.encode(
            "Cats are smarter than dogs.", lang)
    ids = new.tokenizer.encode(ITALIAN[0], "it")
    assert min(ids) >= old.tokenizer.vocab_size and new.tokenizer.decode(ids) == ITALIAN[0]
    assert new.tokenizer.lang_id("it") in new.tokenizer.prompt_ids("it", "it", True)

    # Old-language inputs: identical greedy and beam outputs, old logits and CTC posteriors equal.
    requests = read_requests(os.path.join(MINI, "examples.jsonl"))
    for beam in (1, 3):
        options = DecodingOptions(beam_size=beam, max_new_tokens=8)
        before, _ = transcribe(old, requests, options)
        after, _ = transcribe(new, requests, options)
        assert [r.tokens for r in before] == [r.tokens for r in after] and all(r.tokens for r in before)
    feats = torch.randn(1, 200, 32)
    with torch.no_grad():
        enc_old, lens = old.model.encoder(feats, torch.tensor([200]))
        enc_new, _ = new.model.encoder(feats, torch.tensor([200]))
        ctc_old, ctc_new = old.model.ctc.proj(enc_old), new.model.ctc.proj(enc_new)
    v = old.model.cfg.vocab_size
    torch.testing.assert_close(ctc_new[..., :v], ctc_old[..., :v], rtol=0, atol=0)
    torch.testing.assert_close(ctc_new[..., -1], ctc_old[..., -1], rtol=0, atol=0)  # the blank moved last
    assert new.model.ctc.blank == new.model.cfg.vocab_size


def test_init_from_grows_the_ctc_head_and_keeps_its_blank_last(grown):
    old_dir, new_path = grown
    old = load_model(old_dir)
    bigger = AED(dataclasses.replace(old.model.cfg, vocab_size=old.model.cfg.vocab_size + 16))
    summary = init_from_checkpoint(bigger, old.path)
    assert "ctc.proj.weight grows from" in summary and "token_embedding.weight grows from" in summary
    v = old.model.cfg.vocab_size
    for name in ("weight", "bias"):
        new_rows, old_rows = getattr(bigger.ctc.proj, name), getattr(old.model.ctc.proj, name)
        assert torch.equal(new_rows[:v], old_rows[:v]) and torch.equal(new_rows[-1], old_rows[-1])
    assert torch.equal(bigger.decoder.output_proj.weight[:v], old.model.decoder.output_proj.weight)


def test_freeze_encoder_trains_only_the_decoder_and_ctc_head():
    tokenizer = Tokenizer.load(os.path.join(MINI, "tokenizer"))
    cfg = dataclasses.replace(TrainConfig(), model=tiny_config(tokenizer), freeze="encoder")
    model = build_model(cfg, tokenizer.vocab_size)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = build_optimizer(model, cfg.optim)
    tokens, prompt_len = tokenizer.encode_example("Ciao.", "en", "en", True)
    batch = Batch(torch.randn(2, 120, 32), torch.tensor([120, 90]), torch.tensor([tokens, tokens]),
                  torch.tensor([len(tokens)] * 2), torch.tensor([prompt_len] * 2), ["a", "b"], [0, 1], [])
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    train_mode(model, cfg.freeze)
    assert model.decoder.training and not any(m.training for m in model.encoder.modules())
    train_step(model, [batch], optimizer, scaler, lambda f, lens: f, "fp32", clip_grad=1.0,
               num_targets=2 * len(tokens))
    after = model.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}  # BatchNorm statistics included
    assert not [k for k in changed if k.startswith("encoder.")], [k for k in changed if k.startswith("encoder.")]
    assert any(k.startswith("decoder.") for k in changed) and any(k.startswith("ctc.") for k in changed)


def freeze_setup(new_path: str):
    """(cfg, tokenizer, added tokens, model initialised from the grown checkpoint, a batch of Italian)."""
    new = load_model(new_path)
    cfg = dataclasses.replace(TrainConfig(), model=new.model.cfg, freeze="all_but_new_tokens", init_from=new_path,
                              optim=dataclasses.replace(TrainConfig().optim, lr=1e-2, weight_decay=0.1))
    cfg.train.tokenizer = os.path.splitext(new_path)[0] + ".tokenizer"
    added = new_tokens(cfg, new.tokenizer.vocab_size)
    model = build_model(cfg, new.tokenizer.vocab_size, added)
    init_from_checkpoint(model, new_path)
    tokens, prompt_len = new.tokenizer.encode_example(ITALIAN[1], "it", "it", True)
    batch = Batch(torch.randn(2, 400, 32, generator=torch.Generator().manual_seed(0)), torch.tensor([400, 360]),
                  torch.tensor([tokens, tokens]), torch.tensor([len(tokens)] * 2), torch.tensor([prompt_len] * 2),
                  ["a", "b"], [0, 1], [])
    return cfg, new.tokenizer, added, model, batch


def assert_only_the_added_rows_trained(before: dict, after: dict, added: dict) -> None:
    """Bit-identical: weights, BatchNorm statistics, the old rows (weight decay included)."""
    v = before["decoder.output_proj.bias"].numel()
    new_rows = (torch.arange(v) >= added["first"]) | (torch.arange(v) == added["language_token"])  # (V,)
    rows = {"decoder.embedding.token_embedding.weight": new_rows, "decoder.output_proj.weight": new_rows,
            "decoder.output_proj.bias": new_rows, "ctc.proj.weight": torch.cat([new_rows, torch.tensor([False])]),
            "ctc.proj.bias": torch.cat([new_rows, torch.tensor([False])])}
    assert before.keys() == after.keys()
    for k in after:
        if k in rows:
            assert torch.equal(after[k][~rows[k]], before[k][~rows[k]]), f"{k}: an old row moved"
            assert not torch.equal(after[k][rows[k]], before[k][rows[k]]), f"{k}: no new row trained"
        else:
            assert torch.equal(after[k], before[k]), f"{k} changed"
    assert not torch.equal(after["decoder.embedding.token_embedding.weight"][added["language_token"]],
                           before["decoder.embedding.token_embedding.weight"][added["language_token"]])


def test_freeze_all_but_new_tokens_trains_only_the_added_rows(grown):
    old_dir, new_path = grown
    cfg, tokenizer, added, model, batch = freeze_setup(new_path)
    assert added == {"language": "it", "first": load_model(old_dir).tokenizer.vocab_size,
                     "language_token": tokenizer.lang_id("it"), "vocab_size": tokenizer.vocab_size}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = build_optimizer(model, cfg.optim)
    train_mode(model, cfg.freeze)
    for _ in range(3):
        train_step(model, [batch], optimizer, torch.amp.GradScaler("cpu", enabled=False), lambda f, lens: f, "fp32",
                   clip_grad=1.0, num_targets=int(batch.token_lens.sum()))
    assert_only_the_added_rows_trained(before, model.state_dict(), added)


@pytest.mark.slow
def test_freeze_all_but_new_tokens_under_fsdp_trains_only_the_added_rows(grown, tmp_path):
    """The same three steps on 2 ranks (gloo) with every layer and the root sharded: the row masks
    apply to the reduced, sharded gradients."""
    _, new_path = grown
    script = tmp_path / "fsdp_freeze.py"
    script.write_text(
        "import sys, torch, torch.distributed as dist\n"
        "from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict\n"
        "from aed.train_distributed import exit_worker, shard\n"
        "from aed.train_setup import build_optimizer, train_mode, train_step\n"
        "from test_add_language import freeze_setup\n"
        "dist.init_process_group('gloo')\n"
        "cfg, tokenizer, added, model, batch = freeze_setup(sys.argv[1])\n"
        "before = {k: v.clone() for k, v in model.state_dict().items()}\n"
        "model = shard(model, torch.device('cpu'), 2, 'fp32')\n"
        "optimizer = build_optimizer(model, cfg.optim)\n"
        "train_mode(model, cfg.freeze)\n"
        "for _ in range(3):\n"
        "    train_step(model, [batch], optimizer, torch.amp.GradScaler('cpu', enabled=False), lambda f, lens: f,\n"
        "               'fp32', clip_grad=1.0, num_targets=2 * int(batch.token_lens.sum()), world_size=2)\n"
        "after = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))\n"
        "if dist.get_rank() == 0:\n"
        "    torch.save({'before': before, 'after': after, 'added': added}, sys.argv[2])\n"
        "exit_worker()\n")
    out = tmp_path / "states.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests"),
                                                        os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script), new_path, str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    states = torch.load(out)
    assert_only_the_added_rows_trained(states["before"], states["after"], states["added"])


def test_freeze_all_but_new_tokens_refuses_a_checkpoint_without_the_record(grown):
    old_dir, new_path = grown
    with pytest.raises(ConfigError, match="freeze=all_but_new_tokens needs objective=aed, init_from"):
        TrainConfig(freeze="all_but_new_tokens")  # no init_from
    cfg = TrainConfig(freeze="all_but_new_tokens", init_from=load_model(old_dir).path)
    with pytest.raises(ConfigError, match="records no added tokens"):
        new_tokens(cfg, 1000)
    cfg = TrainConfig(freeze="all_but_new_tokens", init_from=new_path)
    with pytest.raises(ConfigError, match="train with the tokenizer directory add_language.py wrote"):
        new_tokens(cfg, Tokenizer.load(os.path.join(MINI, "tokenizer")).vocab_size)  # the old tokenizer
