"""tools/export_hf.py: transformers' Canary, loaded from the exported directory, generates aed's greedy
tokens. Needs the optional packages of tests/requirements-hf.txt (transformers with Canary, librosa);
skipped without them."""

import dataclasses
import os

import pytest
import torch

from aed.data_audio import FeatureConfig, LogMel, load_audio
from aed.data_tokenizer import SentencePieceBlock, SpecialBlock, Tokenizer, default_special_tokens
from aed.decode_search import DecodingOptions
from aed.decode_transcribe import transcribe
from aed.model import AED, AEDConfig
from aed.model_checkpoint import load_model, pack_dir

try:
    import librosa  # noqa: F401
    import transformers
    from transformers.models.canary import CanaryForConditionalGeneration
except ImportError as e:
    pytest.skip(f"needs the pip packages transformers (>=5.17, with Canary) and librosa: "
                f"pip install -r tests/requirements-hf.txt ({e})", allow_module_level=True)

from tools.export_hf import export, inexpressible, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUDIO = os.path.join(ROOT, "data", "mini", "audio")
TOKENIZER = os.path.join(ROOT, "data", "mini", "tokenizer")
WORD_MODEL = os.path.join(ROOT, "tests", "fixtures", "word_model.pt")
FEATURE_TOLERANCE = 1e-4  # largest |transformers' features - aed's| accepted (measured: 1.9e-5 over 29 files, 32 bins)
# No repetition or rate limits: transformers' greedy search has neither; both stop at EOS or after N tokens.
MAX_NEW = 12
OPTIONS = DecodingOptions(ctc_weight=0.0, max_repeats=0, max_tokens_per_second=None, max_new_tokens=MAX_NEW)
ASR = [f"dev_{lang}_000001.flac" for lang in ("de", "en", "es", "fr")] + ["dev_en_000002.flac"]


def load_hf(directory):
    return (transformers.AutoProcessor.from_pretrained(directory),
            CanaryForConditionalGeneration.from_pretrained(directory).eval())


def hf_generate(hf, paths, source_lang, target_lang, sample_rate=16000):
    """Generated ids (no prompt, cut at EOS), texts and inputs of transformers' Canary `hf` (load_hf), one batch."""
    processor, model = hf
    wavs = [load_audio(p, sample_rate=sample_rate).numpy() for p in paths]
    inputs = processor.apply_transcription_request(wavs, source_language=source_lang, target_language=target_lang)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, num_beams=1)
    eos, prompt_len = model.generation_config.eos_token_id, inputs["decoder_input_ids"].shape[1]
    ids = [row[prompt_len:] for row in out.tolist()]
    ids = [row[: row.index(eos)] if eos in row else row for row in ids]
    return ids, processor.batch_decode(ids, skip_special_tokens=True), inputs


def aed_transcribe(loaded, paths, source_lang, target_lang):
    results, _ = transcribe(loaded, paths, OPTIONS, source_lang=source_lang, target_lang=target_lang)
    assert all(r.error is None for r in results), [r.error for r in results]
    return [r.tokens for r in results], [r.pred_text for r in results]


@pytest.fixture(scope="module")
def word_export(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf_word"))
    summary = export(WORD_MODEL, out)
    return out, summary


@pytest.mark.slow(seconds=5)
def test_word_model_asr_and_ast_tokens_equal_aed(word_export):
    out, summary = word_export
    assert summary["largest_errors"]["logits"] < 1e-4
    assert any("CTC head" in note for note in summary["left_out"])  # said, not silently dropped
    loaded = load_model(WORD_MODEL)
    words = [os.path.join(ROOT, "tests", "fixtures", "words", f"{w}.flac") for w in ("seven", "water")]
    paths = words + [os.path.join(AUDIO, name) for name in ASR]
    ref_ids, ref_text = aed_transcribe(loaded, paths, "en", "en")
    hf = load_hf(out)
    ids, text, inputs = hf_generate(hf, paths, "en", "en")
    assert ids == ref_ids
    assert text == ref_text
    assert any(ref_ids[:2])  # the word clips are recognised, not all-EOS
    assert inputs["decoder_input_ids"][0].tolist() == loaded.tokenizer.prompt_ids("en", "en", True)
    # AST: the "canary" prompt's <|translate|> token (the word model never learned it; the tokens must still agree)
    paths = [os.path.join(AUDIO, f"dev_en-es_00000{i}.flac") for i in (1, 2)]
    ref_ids, _ = aed_transcribe(loaded, paths, "en", "es")
    ids, _, inputs = hf_generate(hf, paths, "en", "es")
    assert inputs["decoder_input_ids"][0].tolist() == loaded.tokenizer.prompt_ids("en", "es", True)
    assert ids == ref_ids


def test_features_and_tokenizer_match_aed(word_export):
    out, _ = word_export
    processor = transformers.AutoProcessor.from_pretrained(out)
    loaded = load_model(WORD_MODEL)
    wavs = [load_audio(os.path.join(AUDIO, name)) for name in ASR[:3]]
    lens = torch.tensor([w.numel() for w in wavs])
    padded = torch.zeros(len(wavs), int(lens.max()))
    for b, w in enumerate(wavs):
        padded[b, : w.numel()] = w
    ref, ref_lens = LogMel(loaded.features).eval()(padded, lens)
    got = processor.feature_extractor([w.numpy() for w in wavs], sampling_rate=16000, return_tensors="pt")
    assert got["attention_mask"].sum(1).tolist() == ref_lens.tolist()
    valid = got["attention_mask"][:, : ref.shape[1], None].bool()
    assert (got["input_features"][:, : ref.shape[1]] - ref).masked_fill(~valid, 0).abs().max() < FEATURE_TOLERANCE
    tok = loaded.tokenizer
    for text, lang in [("Der ganze Teich ward angesteckt.", "de"), ("¿Qué  tal?  Très   bien!", "es")]:
        ids = tok.encode(text, lang)
        assert processor.tokenizer.encode(text, add_special_tokens=False) == ids
        assert processor.tokenizer.decode(ids + [tok.eos], skip_special_tokens=True) == tok.decode(ids)


def flash_like_checkpoint(path, tokenizer_dir):
    """A random-weight model with Canary-1B-Flash's layout (configs/canary-1b-flash.yaml: 32 + 4
    layers, 8 heads, 128 mel bins, 1024 decoder positions) at 1/16 of its width, and a "canary2"
    tokenizer; decoder weights of std 0.2 so that its random logits are far from ties."""
    torch.manual_seed(0)
    special = default_special_tokens(["de", "en", "es", "fr"])
    base = Tokenizer.load(TOKENIZER)
    sp = [b for b in base.blocks if isinstance(b, SentencePieceBlock)][0]
    tokenizer = Tokenizer([SpecialBlock(special), sp], base.languages, prompt_format="canary2")
    tokenizer.save(tokenizer_dir)
    cfg = AEDConfig.from_yaml(os.path.join(ROOT, "configs", "canary-1b-flash.yaml"))
    cfg = dataclasses.replace(cfg, enc_d_model=64, dec_d_model=64, subsampling_channels=16,
                              vocab_size=tokenizer.padded_vocab_size, pad_id=tokenizer.pad)
    model = AED(cfg).eval()
    with torch.no_grad():
        for p in model.decoder.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    ckpt = {"model": model.state_dict(), "model_config": dataclasses.asdict(cfg),
            "features": dataclasses.asdict(FeatureConfig(n_mels=cfg.n_mels)), "tokenizer": pack_dir(tokenizer_dir)}
    torch.save(ckpt, path)
    return cfg


@pytest.mark.slow(seconds=20)
def test_flash_layout_canary2_asr_and_ast(tmp_path):
    ckpt = str(tmp_path / "flash.pt")
    cfg = flash_like_checkpoint(ckpt, str(tmp_path / "tokenizer"))
    assert (cfg.enc_layers, cfg.dec_layers, cfg.enc_heads, cfg.n_mels) == (32, 4, 8, 128)
    out = str(tmp_path / "hf")
    summary = export(ckpt, out)
    assert summary["largest_errors"]["logits"] < 1e-3
    assert not any("CTC" in note for note in summary["left_out"])
    loaded, hf = load_model(ckpt), load_hf(out)
    for src, tgt, names in [("fr", "fr", ["dev_fr_000002.flac", "dev_de_000002.flac"]),
                            ("en", "es", ["dev_en-es_000003.flac"]), ("es", "en", ["dev_es-en_000001.flac"])]:
        paths = [os.path.join(AUDIO, n) for n in names]
        ref_ids, ref_text = aed_transcribe(loaded, paths, src, tgt)
        ids, text, inputs = hf_generate(hf, paths, src, tgt)
        assert inputs["decoder_input_ids"][0].tolist() == loaded.tokenizer.prompt_ids(src, tgt, True)
        assert ids == ref_ids, (src, tgt)
        assert text == ref_text
        assert len(ref_ids[0]) == MAX_NEW  # random weights: generated to the limit, so every step was compared


@pytest.mark.slow(seconds=10)
def test_aggregate_tokenizer_exports_decode_only_and_generates_aeds_tokens(tmp_path):
    """Canary-1B's layout (tests/fixtures/nemo/canary.nemo converted: NeMo's aggregate tokenizer, one
    SentencePiece block per language, "canary" prompts): ids decode to aed's text in every block,
    generate gives aed's tokens, and the export says its tokenizer's encode() is not aed's."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from convert_nemo import convert

    convert(os.path.join(ROOT, "tests", "fixtures", "nemo", "canary.nemo"), tmp_path / "c.pt")
    summary = export(str(tmp_path / "c.pt"), str(tmp_path / "hf"))
    assert any("decoding (ids -> text, all generate needs) is aed's" in note for note in summary["left_out"])
    loaded, hf = load_model(str(tmp_path / "c.pt")), load_hf(str(tmp_path / "hf"))
    tok = loaded.tokenizer
    assert len([b for b in tok.blocks if isinstance(b, SentencePieceBlock)]) == 4
    for text, lang in [("Der ganze Teich ward angesteckt.", "de"), ("¿Qué tal? Muy bien.", "es"),
                       ("Hello there, my friend.", "en"), ("Il fait beau, merci.", "fr")]:
        ids = tok.encode(text, lang)  # characters each block has seen: no <unk> (a corner named in the tool)
        assert hf[0].tokenizer.decode(ids + [tok.eos], skip_special_tokens=True) == tok.decode(ids) == text
    every = [i for i in range(tok.vocab_size) if not tok.is_special(i) and not tok.id_to_token(i).startswith("<")]
    assert hf[0].tokenizer.batch_decode([[i] for i in every]) == [tok.decode([i]) for i in every]
    for src, tgt, names in [("de", "de", ["dev_de_000002.flac"]), ("en", "es", ["dev_en-es_000003.flac"])]:
        paths = [os.path.join(AUDIO, n) for n in names]
        ref_ids, ref_text = aed_transcribe(loaded, paths, src, tgt)
        ids, text, inputs = hf_generate(hf, paths, src, tgt)
        assert inputs["decoder_input_ids"][0].tolist() == tok.prompt_ids(src, tgt, True)
        assert ids == ref_ids and text == ref_text, (src, tgt)


def test_what_transformers_cannot_hold(tmp_path):
    tokenizer, features = Tokenizer.load(TOKENIZER), FeatureConfig(n_mels=32)
    small = dict(n_mels=32, vocab_size=tokenizer.padded_vocab_size, enc_d_model=32, enc_layers=1, enc_heads=2,
                 subsampling_channels=8, dec_d_model=32, dec_layers=1, dec_heads=2, dec_max_len=32)
    assert inexpressible(AED(AEDConfig(**small)), tokenizer, features) == []
    flash180m = AED(AEDConfig(**{**small, "dec_d_model": 64}))  # Canary-180M-Flash: 512-wide encoder, 1024 decoder
    assert "encoder_decoder_proj (enc_d_model 32 -> dec_d_model 64)" in inexpressible(flash180m, tokenizer, features)[0]
    layer_norm = AED(AEDConfig(**{**small, "conv_norm": "layer_norm"}))
    assert "conv_norm 'layer_norm'" in inexpressible(layer_norm, tokenizer, features)[0]
    odd_guard = dataclasses.replace(features, log_guard=1e-6)
    assert "features.log_guard" in inexpressible(AED(AEDConfig(**small)), tokenizer, odd_guard)[0]
    # the command line names the problem and writes nothing
    model = AED(AEDConfig(**{**small, "dec_d_model": 64}))
    ckpt = {"model": model.state_dict(), "model_config": dataclasses.asdict(model.cfg),
            "features": dataclasses.asdict(features), "tokenizer": pack_dir(TOKENIZER)}
    torch.save(ckpt, tmp_path / "proj.pt")
    with pytest.raises(SystemExit, match="encoder_decoder_proj"):
        main(["--ckpt", str(tmp_path / "proj.pt"), "-o", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
