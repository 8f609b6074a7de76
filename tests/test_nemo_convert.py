"""tools/convert_nemo.py checked against real NeMo, without NeMo.

tests/fixtures/nemo/ holds four small random-weight NeMo EncDecMultiTaskModel checkpoints, one per
released layout: "canary" (Canary-1B), "canary2" (180M-Flash: an encoder_decoder_proj), "canary2wide"
(1B-Flash: one width), all with NeMo's aggregate tokenizer, and "canary2bpe" (1B-v2: "canary2"
prompts and one CanaryBPETokenizer model); and NeMo's own outputs on data/mini utterances, made by
tests/fixtures/make_nemo_fixtures.py with nemo_toolkit 3.0.0. Float32 tolerances reached on this machine:
features 4.6e-5, encoder output 1.0e-6, decoder log-probs 1.0e-6 (asserted: 1e-4 / 1e-5 / 1e-5).
"""

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from convert_nemo import ConversionError, convert, read_nemo  # noqa: E402

from aed.data_audio import LogMel, load_audio  # noqa: E402
from aed.decode_search import DecodingOptions, greedy_search  # noqa: E402
from aed.model_checkpoint import list_checkpoints, load_model  # noqa: E402
from test_train import train_in_process  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "nemo"
NEMO_GREEDY = dict(max_repeats=0, max_tokens_per_second=None)  # NeMo's greedy search has no repetition or rate limit
MINI = ROOT / "data" / "mini"


PROMPT_FORMAT = {"canary": "canary", "canary2": "canary2", "canary2wide": "canary2", "canary2bpe": "canary2"}


@pytest.fixture(scope="module", params=list(PROMPT_FORMAT))
def conv(request, tmp_path_factory):
    """A fixture model converted once per module: model, tokenizer, features, NeMo's references, paths."""
    out = tmp_path_factory.mktemp(request.param) / f"{request.param}.pt"
    convert(FIXTURES / f"{request.param}.nemo", out)
    loaded = load_model(out)
    model, tokenizer, features = loaded.model, loaded.tokenizer, loaded.features
    ref = torch.load(FIXTURES / f"{request.param}.ref.pt", weights_only=False)
    return SimpleNamespace(name=request.param, out=out, model=model, tok=tokenizer, features=features, ref=ref)


def strip_eos(tokens, eos):
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def test_prompt_format_comes_from_the_checkpoint(conv):
    assert conv.tok.prompt_format == PROMPT_FORMAT[conv.name]
    assert conv.model.cfg.enc_xscaling == (conv.name != "canary")  # the fixtures cover both settings
    assert conv.model.cfg.n_mels == conv.features.n_mels == 128
    assert conv.model.cfg.conv_norm == "batch_norm"


def test_features_match_nemo(conv):
    logmel = LogMel(conv.features).eval()
    for u in conv.ref["utterances"]:
        wav = load_audio(MINI / u["audio"])
        assert wav.numel() == u["num_samples"]
        feats, feat_lens = logmel(wav[None], torch.tensor([wav.numel()]))
        assert int(feat_lens[0]) == u["feat_len"]
        torch.testing.assert_close(feats[0], u["feats"], atol=1e-4, rtol=0)


def test_encoder_matches_nemo_in_eval_mode(conv):
    for u in conv.ref["utterances"]:
        with torch.no_grad():
            memory, memory_lens = conv.model.encode(u["feats"][None], torch.tensor([u["feat_len"]]))
        assert int(memory_lens[0]) == u["memory"].shape[0]
        torch.testing.assert_close(memory[0], u["memory"], atol=1e-5, rtol=0)


def test_decoder_log_probs_under_teacher_forcing_match_nemo(conv):
    model = conv.model
    for u in conv.ref["utterances"]:
        tokens = torch.tensor([u["tokens"]])
        memory, memory_lens = u["memory"][None], torch.tensor([u["memory"].shape[0]])
        with torch.no_grad():
            hidden = model.decoder(tokens[:, :-1], memory, memory_lens)
            log_probs = torch.log_softmax(model.decoder.output_proj(hidden).float(), dim=-1)
        torch.testing.assert_close(log_probs[0], u["log_probs"], atol=1e-5, rtol=0)
        # The training loss is NeMo's summed NLL of the same targets (prompt included).
        with torch.no_grad():
            loss, n = model(u["feats"][None], torch.tensor([u["feat_len"]]), tokens,
                            torch.tensor([tokens.shape[1]]), torch.tensor([u["prompt_len"]]))
        nemo_nll = -u["log_probs"].gather(1, tokens[0, 1:, None]).sum()
        assert int(n) == tokens.shape[1] - 1
        torch.testing.assert_close(loss, nemo_nll, atol=1e-4, rtol=1e-5)


def test_greedy_tokens_match_nemo(conv):
    model, tok = conv.model, conv.tok
    logmel = LogMel(conv.features).eval()
    for u in conv.ref["utterances"]:
        p = u["prompt_len"]
        prompt = torch.tensor([u["tokens"][:p]])
        # NeMo's max_generation_delta bounds prompt + output and counts padded encoder frames;
        # ours bounds the output alone. Give both the same budget.
        max_delta, limit = conv.ref["max_generation_delta"], u["greedy_limit"]
        expected = strip_eos(u["greedy"], tok.eos)
        memory = u["memory"][None]
        options = DecodingOptions(max_delta=max_delta, max_new_tokens=limit, **NEMO_GREEDY)
        hyp = greedy_search(model, memory, torch.tensor([memory.shape[1]]), prompt, tok.eos, options)[0]
        assert hyp == expected
        # End to end from the audio file: our features, our encoder, our decoder.
        wav = load_audio(MINI / u["audio"])
        with torch.no_grad():
            memory, memory_lens = model.encode(*logmel(wav[None], torch.tensor([wav.numel()])))
        assert greedy_search(model, memory, memory_lens, prompt, tok.eos, options)[0] == expected


def test_tokenizer_ids_equal_nemo(conv):
    tok, ref = conv.tok, conv.ref
    assert tok.vocab_size == ref["vocab_size"]
    assert len(ref["special_tokens"]) > 20
    for token, i in ref["special_tokens"].items():  # every special token of NeMo's CanaryTokenizer
        assert tok.token_to_id(token) == i, token
        assert tok.is_special(i) and tok.id_to_token(i) == token
    assert set(ref["text_ids"]) == {"en", "es", "de", "fr"}
    for lang, texts in ref["texts"].items():
        for text, ids in zip(texts, ref["text_ids"][lang]):
            assert tok.encode(text, lang) == ids, (lang, text)
    for key, ids in ref["prompts"].items():
        src, tgt, pnc = key.split("-")
        assert tok.prompt_ids(src, tgt, pnc == "True") == ids, key
    for u in ref["utterances"]:  # prompt + text + eos, as NeMo's prompt formatter builds it
        assert tok.encode_example(u["text"], u["source_lang"], u["target_lang"], True)[0] == u["tokens"]


def test_canary_bpe_tokenizer_holds_its_special_tokens_and_prompts_as_nemo(conv):
    """Canary-1B-v2's layout: one model whose <|...|> pieces are the special tokens; NeMo encodes
    the prompt string with it, so the prompt starts with the model's word-start piece."""
    tok = conv.tok
    if conv.name != "canary2bpe":
        assert not tok.specials_inline
        return
    assert tok.specials_inline and len(tok.blocks) == 1 and tok.blocks[0].lang == "all"
    assert tok.languages == ["de", "en", "es", "fr", "it", "pt"]  # every <|xx|> piece, "it" and "pt" without text
    prompt = tok.prompt_ids("en", "es", True)
    assert tok.id_to_token(prompt[0]) == "▁" and len(prompt) == 10
    assert [tok.id_to_token(i) for i in prompt[1:3]] == ["<|startofcontext|>", "<|startoftranscript|>"]
    text = tok.encode("Hola, amigo.", "es")
    assert tok.decode([tok.eos, *text, tok.pad]) == "Hola, amigo." and not any(tok.is_special(i) for i in text)


def test_the_companion_timestamps_model_is_not_read(tmp_path):
    """Canary-1B-v2's archive carries a CTC model for NeMo's timestamps; aed converts the AED model alone."""
    bigger = tmp_path / "with_ts.nemo"
    with tarfile.open(FIXTURES / "canary2bpe.nemo") as tin, tarfile.open(bigger, "w") as tout:
        for member in tin.getmembers():
            tout.addfile(member, tin.extractfile(member) if member.isfile() else None)
        for name in ("timestamps_asr_model_config.yaml", "timestamps_asr_model_weights.ckpt"):
            info = tarfile.TarInfo(f"./{name}")
            info.size = 4
            tout.addfile(info, io.BytesIO(b"junk"))
    _, _, files = read_nemo(bigger)
    assert not any(name.startswith("timestamps_asr_model") for name in files)
    convert(bigger, tmp_path / "x.pt")
    assert load_model(tmp_path / "x.pt").model.ctc is None


def test_canary2_prompt_has_no_task_token(conv):
    if conv.tok.prompt_format == "canary2":
        assert conv.tok.prompt_ids("en", "es", True, "translate") == conv.tok.prompt_ids("en", "es", True)
        with pytest.raises(ValueError, match="no task token"):
            conv.tok.prompt_ids("en", "en", True, "translate")
    else:
        assert conv.tok.prompt_ids("en", "en", True, "translate") != conv.tok.prompt_ids("en", "en", True)


def rewrite_nemo(src, dst, edit):
    """Copy a .nemo archive with `edit(config)` applied to its model_config.yaml."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for member in tin.getmembers():
            data = tin.extractfile(member).read() if member.isfile() else None
            if member.name.endswith("model_config.yaml"):
                config = yaml.safe_load(data)
                edit(config)
                data = yaml.safe_dump(config, sort_keys=False).encode()
                member.size = len(data)
            tout.addfile(member, io.BytesIO(data) if data is not None else None)


@pytest.mark.parametrize("edit, named", [
    (lambda c: c["encoder"].update(self_attention_model="abs_pos"), "encoder.self_attention_model='abs_pos'"),
    (lambda c: c["transf_decoder"]["config_dict"].update(learn_positional_encodings=True),
     "transf_decoder.config_dict.learn_positional_encodings=True"),
    (lambda c: c["transf_encoder"].update(num_layers=2), "transf_encoder.num_layers=2"),
    (lambda c: c.update(prompt_format="whisper"), "prompt_format='whisper'"),
])
def test_unsupported_option_is_a_clear_error(tmp_path, edit, named):
    bad = tmp_path / "bad.nemo"
    rewrite_nemo(FIXTURES / "canary.nemo", bad, edit)
    with pytest.raises(ConversionError, match=named.replace("[", r"\[").replace(".", r"\.")):
        convert(bad, tmp_path / "bad.pt")
    assert not (tmp_path / "bad.pt").exists()


@pytest.mark.slow
def test_cli_reports_the_unsupported_option(tmp_path):
    bad = tmp_path / "bad.nemo"
    rewrite_nemo(FIXTURES / "canary2.nemo", bad, lambda c: c["encoder"].update(subsampling_factor=16))
    p = subprocess.run([sys.executable, "tools/convert_nemo.py", str(bad), "-o", str(tmp_path / "x.pt")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert "encoder.subsampling_factor=16" in p.stderr and "subsampling takes the factors (4, 8)" in p.stderr


@pytest.mark.slow
def test_converted_checkpoint_fine_tunes_and_still_decodes(tmp_path):
    """train.py with the YAML the converter writes and init_from= its checkpoint (the Flash-style model)."""
    out = tmp_path / "flash.pt"
    convert(FIXTURES / "canary2.nemo", out)
    converted = load_model(out).model
    run = tmp_path / "run"
    p = train_in_process([str(out.with_suffix(".yaml")), f"init_from={out}",
                          f"run_dir={run}", "max_steps=3", "ckpt_every=3", "log_every=1", "val.every=3",
                          "val.max_utterances=2", f"val.manifests=[{MINI / 'dev.jsonl'}]",
                          f"train.manifests=[{MINI / 'train.jsonl'}]", "train.num_buckets=2", "train.max_duration=8",
                          "train.num_workers=0", "optim.warmup_steps=1", "optim.lr=1e-3"])
    assert p.returncode == 0, p.stderr[-4000:]
    assert "left random: nothing" in p.stderr  # every tensor came from the converted checkpoint
    assert "dev/wer" in p.stderr  # validation decoded the dev utterances

    ckpt = list_checkpoints(run)[-1]
    loaded = load_model(ckpt)
    model, tok = loaded.model, loaded.tokenizer
    assert tok.prompt_format == "canary2"
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, converted.state_dict()[k])]
    assert any(k.startswith("decoder.") for k in changed) and any(k.startswith("encoder.") for k in changed)
    u = torch.load(FIXTURES / "canary2.ref.pt", weights_only=False)["utterances"][0]
    prompt = torch.tensor([tok.prompt_ids(u["source_lang"], u["target_lang"], True)])
    with torch.no_grad():
        memory, memory_lens = model.encode(u["feats"][None], torch.tensor([u["feat_len"]]))
    hyp = greedy_search(model, memory, memory_lens, prompt, tok.eos, DecodingOptions(max_delta=5, **NEMO_GREEDY))[0]
    assert 0 < len(hyp) <= memory.shape[1] + 5 and all(0 <= t < tok.vocab_size + 8 for t in hyp)


@pytest.mark.slow
def test_fine_tuning_with_a_new_language_block_appended(tmp_path):
    """A sub-tokenizer appended to the converted aggregate tokenizer keeps every old id and row."""
    out = tmp_path / "canary.pt"
    convert(FIXTURES / "canary.nemo", out)
    loaded = load_model(out)
    converted, old_tok = loaded.model, loaded.tokenizer
    tok_dir = tmp_path / "with_it"
    shutil.copytree(out.with_suffix(".tokenizer"), tok_dir)
    config = json.loads((tok_dir / "tokenizer.json").read_text())
    shutil.copy(tok_dir / "fr.model", tok_dir / "it.model")  # stands in for an Italian model
    config["blocks"].append({"kind": "sentencepiece", "lang": "it", "model": "it.model", "size": 80})
    config["languages"].append("it")  # <|it|> is already one of the special tokens
    (tok_dir / "tokenizer.json").write_text(json.dumps(config))

    run = tmp_path / "run"
    p = train_in_process([str(out.with_suffix(".yaml")), f"init_from={out}", f"run_dir={run}",
                          f"train.tokenizer={tok_dir}", "max_steps=1", "ckpt_every=1", "val.every=0",
                          f"train.manifests=[{MINI / 'train.jsonl'}]", "train.num_buckets=2", "train.max_duration=8",
                          "train.num_workers=0", "optim.warmup_steps=1", "optim.lr=1e-6", "optim.min_lr=1e-7"])
    assert p.returncode == 0, p.stderr[-4000:]
    assert "token_embedding.weight grows from 448 to 528 rows" in p.stderr

    loaded = load_model(list_checkpoints(run)[-1])
    model, tok = loaded.model, loaded.tokenizer
    assert tok.vocab_size == old_tok.vocab_size + 80
    assert tok.prompt_ids("en", "es", True) == old_tok.prompt_ids("en", "es", True)
    new, old = model.decoder.output_proj, converted.decoder.output_proj
    torch.testing.assert_close(new.weight[:448], old.weight, atol=1e-4, rtol=0)  # one step at lr 1e-6
    torch.testing.assert_close(new.bias[:448], old.bias, atol=1e-4, rtol=0)
    u = torch.load(FIXTURES / "canary.ref.pt", weights_only=False)["utterances"][0]
    with torch.no_grad():
        memory, memory_lens = model.encode(u["feats"][None], torch.tensor([u["feat_len"]]))
    prompt = torch.tensor([tok.prompt_ids("en", "it", True)])
    assert len(greedy_search(model, memory, memory_lens, prompt, tok.eos, DecodingOptions(max_delta=3))[0]) > 0
