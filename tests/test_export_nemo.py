"""tools/export_nemo.py: aed checkpoints as NeMo .nemo archives, the inverse of tools/convert_nemo.py.

Without NeMo: the fixtures (tests/fixtures/nemo, written by NeMo 3.0.0) converted to aed and exported
back hold NeMo's tensors bit for bit, and the same config and tokenizer; a model trained by train.py
(DCP checkpoint directories, averaged) exports and reads back through tools/convert_nemo.py to the same weights
and greedy tokens; what NeMo cannot hold is named. With NeMo (`make test-nemo` installs it beside the
venv and runs this file; elsewhere the tests that need it skip): NeMo's restore_from loads each
export, and its features and greedy tokens are aed's.
"""

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from convert_nemo import ConversionError, convert, read_nemo  # noqa: E402
import export_nemo  # noqa: E402
from export_nemo import export  # noqa: E402

from aed.data_audio import FeatureConfig, LogMel, load_audio  # noqa: E402
from aed.data_tokenizer import Tokenizer  # noqa: E402
from aed.model import AED, AEDConfig  # noqa: E402
from aed.model_checkpoint import list_checkpoints, load_model, pack_dir  # noqa: E402
from aed.decode_search import DecodingOptions  # noqa: E402
from aed.decode_transcribe import make_request, transcribe  # noqa: E402
from test_train import run_in_process, train_in_process  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "nemo"
MINI = ROOT / "data" / "mini"
NEMO_GREEDY = dict(ctc_weight=0.0, max_repeats=0, max_tokens_per_second=None)  # NeMo's greedy search: no limits
MAX_DELTA = 50  # NeMo's max_generation_delta in the released configs
# ASR in the four languages, and AST both ways: (audio stem, source, target)
UTTERANCES = [("dev_en_000006", "en", "en"), ("dev_de_000008", "de", "de"), ("dev_fr_000002", "fr", "fr"),
              ("dev_es_000008", "es", "es"), ("dev_en-es_000004", "en", "es"), ("dev_es-en_000003", "es", "en")]


def nemo_members(path) -> tuple[dict, dict, dict]:
    """(config, state dict, {tokenizer block: {config key: member bytes}}) of a .nemo archive; the
    one model of a CanaryBPETokenizer is the block "all"."""
    config, state, files = read_nemo(path)
    section = config["tokenizer"]
    entries = section["langs"] if section["type"] == "agg" else {"all": section}
    tokenizer = {lang: {key: files[ref.removeprefix("nemo:")] for key, ref in entry.items()
                        if isinstance(ref, str) and ref.startswith("nemo:")}
                 for lang, entry in entries.items()}
    return config, state, tokenizer


def pieces(model: bytes) -> list:
    sp = spm.SentencePieceProcessor(model_proto=model)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


@pytest.fixture(scope="module", params=["canary", "canary2", "canary2wide", "canary2bpe"])
def round_trip(request, tmp_path_factory):
    """A fixture .nemo converted to aed and exported back."""
    tmp = tmp_path_factory.mktemp(request.param)
    convert(FIXTURES / f"{request.param}.nemo", tmp / "aed.pt")
    export(tmp / "aed.pt", tmp / "back.nemo")
    return FIXTURES / f"{request.param}.nemo", tmp / "back.nemo", tmp


def test_round_trip_weights_are_bit_identical(round_trip):
    original, exported, _ = round_trip
    _, state, _ = nemo_members(original)
    _, back, _ = nemo_members(exported)
    assert sorted(back) == sorted(state)  # window, filterbank, position table and tied output layer included
    for key, value in state.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


def test_round_trip_config_and_tokenizer_are_nemos(round_trip):
    original, exported, _ = round_trip
    config, _, tokenizer = nemo_members(original)
    back, _, back_tokenizer = nemo_members(exported)
    assert back["target"] == config["target"] and back["nemo_version"] == "3.0.0"
    for key in ("prompt_format", "sample_rate", "label_smoothing", "model_defaults"):
        assert back[key] == config[key], key
    for section in ("preprocessor", "encoder", "head", "transf_decoder", "transf_decoder.config_dict"):
        ours, theirs = back, config
        for part in section.split("."):
            ours, theirs = ours[part], theirs[part]
        for key, value in theirs.items():  # every key NeMo wrote, with its value (the vocabulary NeMo fills in)
            if not isinstance(value, dict) and not (key == "vocab_size" and value is None):
                assert ours[key] == value, f"{section}.{key}"
    assert back["transf_encoder"]["num_layers"] == 0 and back["tokenizer"]["type"] == config["tokenizer"]["type"]
    assert back["tokenizer"]["custom_tokenizer"] == config["tokenizer"]["custom_tokenizer"]
    assert list(back_tokenizer) == list(tokenizer)  # the block order is the id layout
    for lang, files in tokenizer.items():
        mine = back_tokenizer[lang]
        assert set(mine) == {"model_path", "vocab_path", "spe_tokenizer_vocab"}
        if lang == "all":  # CanaryBPETokenizer's one model, as it was; NeMo's own vocab.txt is SentencePiece's list
            assert mine["model_path"] == files["model_path"]
            assert mine["spe_tokenizer_vocab"] == files["spe_tokenizer_vocab"]
        elif lang == "spl_tokens":  # rebuilt from the token list: the same pieces, and NeMo's vocab.txt
            assert pieces(mine["model_path"]) == pieces(files["model_path"])
            assert mine["vocab_path"] == files["vocab_path"]
            names = [[line.split(b"\t")[0] for line in f["spe_tokenizer_vocab"].splitlines()] for f in (mine, files)]
            assert names[0] == names[1]  # the scores of a model never used to encode are not kept
        else:
            assert mine["model_path"] == files["model_path"]
            assert mine["spe_tokenizer_vocab"] == files["spe_tokenizer_vocab"]


def test_round_trip_converts_back_to_the_same_aed_checkpoint(round_trip):
    _, exported, tmp = round_trip
    first = torch.load(tmp / "aed.pt", weights_only=False)
    second = convert(exported, tmp / "again.pt")
    for key in ("model_config", "features", "tokenizer"):
        assert second[key] == first[key], key
    assert all(torch.equal(second["model"][k], v) for k, v in first["model"].items())


# --- a model trained by train.py ------------------------------------------------------------------


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """fine_tuned(name): two steps of fine-tuning of the converted fixture `name` with a CTC head, two
    checkpoints, and their average exported back to NeMo: (run, folder, export log). Made once each."""
    made = {}

    def make(name):
        if name not in made:
            tmp = tmp_path_factory.mktemp(f"trained-{name}")
            convert(FIXTURES / f"{name}.nemo", tmp / "init.pt")
            run = tmp / "run"
            p = train_in_process([str(tmp / "init.yaml"), f"init_from={tmp / 'init.pt'}", f"run_dir={run}",
                                  "model.ctc_loss_weight=0.3", "max_steps=2", "ckpt_every=1", "val.every=0",
                                  f"train.manifests=[{MINI / 'train.jsonl'}]", "train.num_buckets=2",
                                  "train.max_duration=8", "train.num_workers=0", "optim.warmup_steps=1",
                                  "optim.lr=1e-3"])
            assert p.returncode == 0, p.stderr[-4000:]
            assert len(list_checkpoints(run)) == 2
            lines = []
            export(run, tmp / "avg.nemo", average=2, log=lines.append)
            made[name] = run, tmp, lines
        return made[name]

    return make


def greedy(loaded, stem, source, target, limit=None):
    """aed's greedy tokens (no prompt, no EOS) on one data/mini/dev utterance."""
    options = DecodingOptions(max_delta=MAX_DELTA, max_new_tokens=limit, **NEMO_GREEDY)
    request = make_request(str(MINI / "audio" / f"{stem}.flac"), source, target)
    return transcribe(loaded, [request], options)[0][0].tokens


def test_trained_model_exports_and_reads_back(fine_tuned):
    run, tmp, lines = fine_tuned("canary2")
    assert len(lines) == 1 and "dropped the CTC head (ctc.proj.weight (449, 48), ctc.proj.bias (449,))" in lines[0]
    averaged = load_model(str(run), average=2)
    convert(tmp / "avg.nemo", tmp / "back.pt")
    back = load_model(str(tmp / "back.pt"))
    assert back.model.cfg.ctc_loss_weight == 0 and averaged.model.cfg.ctc_loss_weight == 0.3
    state = averaged.model.state_dict()
    assert sorted(back.model.state_dict()) == sorted(k for k in state if not k.startswith("ctc."))
    assert all(torch.equal(v, state[k]) for k, v in back.model.state_dict().items())
    for stem, source, target in UTTERANCES[:2]:
        assert greedy(back, stem, source, target) == greedy(averaged, stem, source, target)
    # A checkpoint directory of the run (DCP, the format of DDP and FSDP runs alike) exports as well.
    export(list_checkpoints(run)[-1], tmp / "last.nemo", log=lambda _: None)
    _, last, _ = nemo_members(tmp / "last.nemo")
    newest = load_model(list_checkpoints(run)[-1]).model.state_dict()
    assert torch.equal(last["encoder.layers.0.self_attn.linear_q.weight"], newest["encoder.layers.0.self_attn.linear_q.weight"])


def test_aeds_single_layout_exports_as_a_canary_bpe_tokenizer_with_the_same_ids(tmp_path):
    """[special, all] -> one SentencePiece model whose pieces are the special tokens, then the "all"
    model's: every id keeps its string (the "all" model's unused <unk> renamed), prompts and text ids stay."""
    ckpt = ROOT / "tests" / "fixtures" / "word_model.pt"
    config = export(ckpt, tmp_path / "w.nemo")
    assert config["tokenizer"]["type"] == "bpe"
    assert config["tokenizer"]["custom_tokenizer"]["_target_"].endswith(".CanaryBPETokenizer")
    ours = load_model(str(ckpt)).tokenizer
    convert(tmp_path / "w.nemo", tmp_path / "back.pt")
    back = load_model(str(tmp_path / "back.pt")).tokenizer
    assert back.specials_inline and back.vocab_size == ours.vocab_size and back.languages == ours.languages
    renamed = ours.blocks[0].size  # the "all" model's <unk>
    assert [back.id_to_token(i) for i in range(ours.vocab_size) if i != renamed] == \
           [ours.id_to_token(i) for i in range(ours.vocab_size) if i != renamed]
    assert back.id_to_token(renamed) == "<unk:all>"
    for lang in ours.languages:
        assert back.prompt_ids(lang, lang, True) == ours.prompt_ids(lang, lang, True)
    # Special as in NeMo: every <|...|> piece and <pad>; <unk> is the model's unknown piece there.
    assert [i for i in range(ours.vocab_size) if back.is_special(i)] == \
           [i for i in range(ours.vocab_size) if ours.is_special(i) and i != 0]
    text = ours.encode("one two three", "en")
    assert back.decode(text) == ours.decode(text) == "one two three"


def test_what_nemo_cannot_hold_is_named(tmp_path):
    convert(FIXTURES / "canary.nemo", tmp_path / "c.pt")
    ckpt = torch.load(tmp_path / "c.pt", weights_only=False)
    ckpt["model_config"]["pad_id"] = 0
    torch.save(ckpt, tmp_path / "bad.pt")
    with pytest.raises(ConversionError, match=r"model\.pad_id=0: NeMo uses the tokenizer's <pad> \(2\)"):
        export(tmp_path / "bad.pt", tmp_path / "x.nemo")
    assert not (tmp_path / "x.nemo").exists()
    p = run_in_process(export_nemo.main, ["--ckpt", str(tmp_path / "bad.pt"), "-o", str(tmp_path / "x.nemo")])
    assert p.returncode == 1 and "model.pad_id=0" in p.stderr


# --- NeMo itself ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nemo():
    if importlib.util.find_spec("nemo") is None:
        if os.environ.get("AED_REQUIRE_NEMO"):  # `make test-nemo`: a missing NeMo is a failure there
            pytest.fail("AED_REQUIRE_NEMO is set but NeMo does not import")
        pytest.skip("needs NeMo (nemo-toolkit==3.0.0): `make test-nemo` installs it and runs these tests")
    from nemo.collections.asr.models import EncDecMultiTaskModel
    from nemo.utils import logging

    logging.setLevel(logging.ERROR)
    return EncDecMultiTaskModel


def nemo_greedy(model, wav, source, target):
    """NeMo's features of `wav` and its greedy tokens (no prompt, no EOS) with its default prompt
    slots, and the token budget NeMo allowed (prompt excluded)."""
    slots = {"source_lang": source, "target_lang": target, "pnc": "yes"}
    if model.cfg.prompt_format == "canary":
        slots["task"] = "asr" if source == target else "ast"
    else:
        slots.update(decodercontext="", emotion="<|emo:undefined|>", itn="no", timestamp="no", diarize="no")
    prompt = model.prompt.encode_dialog([{"role": "user", "slots": slots}])["context_ids"][None]
    with torch.no_grad():
        feats, feat_lens = model.preprocessor(input_signal=wav[None], length=torch.tensor([wav.numel()]))
        encoded, enc_lens = model.encoder(audio_signal=feats, length=feat_lens)
        memory = model.encoder_decoder_proj(encoded.transpose(1, 2))  # (1, T', D_dec)
        mask = (torch.arange(memory.shape[1]) < enc_lens[:, None]).to(memory.dtype)
        best = model.decoding.decoding.greedy_search(encoder_hidden_states=memory, encoder_input_mask=mask,
                                                     decoder_input_ids=prompt)[0]
    tokens = best[0, prompt.shape[1]:].tolist()
    eos = model.tokenizer.eos_id
    limit = min(model.transf_decoder.max_sequence_length, memory.shape[1] + MAX_DELTA) - prompt.shape[1]
    return feats[0, :, : feat_lens[0]].T, tokens[: tokens.index(eos)] if eos in tokens else tokens, limit


def tiny_checkpoint(path: Path, subsampling: int = 8) -> Path:
    """configs/tiny.yaml's model (`make demo`'s), random weights, data/mini's tokenizer (the single
    layout, canary2 prompts: what train_tokenizer.py makes by default)."""
    tokenizer = MINI / "tokenizer"
    cfg = dataclasses.replace(AEDConfig.from_yaml(ROOT / "configs" / "tiny.yaml"), subsampling_factor=subsampling, n_mels=80,
                              vocab_size=Tokenizer.load(tokenizer).padded_vocab_size, ctc_loss_weight=0.0)
    torch.manual_seed(0)
    model = AED(cfg).eval()
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(cfg),
                "features": dataclasses.asdict(FeatureConfig(n_mels=80)), "tokenizer": pack_dir(tokenizer)}, path)
    return path


def test_4x_subsampling_exports_and_reads_back(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "x4.pt", subsampling=4)
    config = export(ckpt, tmp_path / "x4.nemo")
    assert config["encoder"]["subsampling_factor"] == 4
    convert(tmp_path / "x4.nemo", tmp_path / "back.pt")
    ours, back = load_model(str(ckpt)), load_model(str(tmp_path / "back.pt"))
    assert back.model.cfg.subsampling_factor == 4
    assert all(torch.equal(v, ours.model.state_dict()[k]) for k, v in back.model.state_dict().items())


@pytest.mark.parametrize("which", ["fine-tuned canary", "fine-tuned canary2", "fine-tuned canary2wide",
                                   "fine-tuned canary2bpe", "canary", "canary2bpe", "single", "tiny", "4x"])
def test_nemo_restores_the_export_and_decodes_as_aed(nemo, which, fine_tuned, tmp_path):
    """Round trips of the four released layouts (Canary-1B's; 180M-Flash's with its encoder_decoder_proj;
    1B-Flash's without; 1B-v2's CanaryBPETokenizer) fine-tuned in aed; a converted Canary-1B and 1B-v2
    layout exported back as they are; models with aed's single-layout tokenizer exported as a
    CanaryBPETokenizer (the word model: "canary" prompts; `make demo`'s model: canary2); and a model
    at 4x subsampling."""
    if which.startswith("fine-tuned "):
        run, tmp, _ = fine_tuned(which.split()[1])
        path, loaded = tmp / "avg.nemo", load_model(str(run), average=2)
    elif which in ("single", "tiny", "4x"):
        ckpt = ROOT / "tests" / "fixtures" / "word_model.pt" if which == "single" else \
            tiny_checkpoint(tmp_path / "t.pt", subsampling=4 if which == "4x" else 8)
        export(ckpt, tmp_path / "w.nemo", log=lambda _: None)
        path, loaded = tmp_path / "w.nemo", load_model(str(ckpt))
    else:
        convert(FIXTURES / f"{which}.nemo", tmp_path / "c.pt")
        export(tmp_path / "c.pt", tmp_path / "c.nemo")
        path, loaded = tmp_path / "c.nemo", load_model(str(tmp_path / "c.pt"))
    torch.manual_seed(0)
    model = nemo.restore_from(str(path), map_location="cpu").eval()
    decoding = model.cfg.decoding
    decoding.strategy, decoding.greedy.max_generation_delta = "greedy", MAX_DELTA
    model.change_decoding_strategy(decoding)
    model.eval()
    logmel = LogMel(loaded.features).eval()
    for stem, source, target in UTTERANCES:
        wav = load_audio(MINI / "audio" / f"{stem}.flac")
        feats, tokens, limit = nemo_greedy(model, wav, source, target)
        ours, _ = logmel(wav[None], torch.tensor([wav.numel()]))
        torch.testing.assert_close(ours[0], feats, atol=1e-4, rtol=0)
        assert greedy(loaded, stem, source, target, limit) == tokens, stem
        model.eval()  # NeMo's greedy search leaves its decoder in training mode


def test_nemos_own_transcribe_reads_the_export_as_aed_reads_nemos_padded_audio(nemo, tmp_path):
    """NeMo's own `transcribe(paths)` on an export of the word model, as a NeMo user runs it (its loader,
    features and greedy search): a file shorter than 1 s is padded with zeros to 1 s, half before and
    half after (`pad_min_duration`, `pad_direction: both`), and its text is aed's of that padded audio;
    a longer file's is aed's of the file. What the padding does to a model's text is then the model's
    own robustness (bench/onnx_bench.py agreement counts it on the demo model)."""
    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    from make_word_model import load_clips, word_sequence

    import soundfile as sf

    ckpt = ROOT / "tests" / "fixtures" / "word_model.pt"
    export(ckpt, tmp_path / "w.nemo", log=lambda _: None)
    loaded = load_model(str(ckpt))
    clips, gen = load_clips(), torch.Generator().manual_seed(0)
    sequences = [["red"], ["water"], ["seven"], ["blue", "house"], ["green", "table", "morning"]]
    paths, wavs = [], []
    for k, words in enumerate(sequences):
        wav, _ = word_sequence(clips, words, [0.15] * len(words), 0.05, 1e-3, gen)
        paths.append(str(tmp_path / f"{k}.wav"))
        sf.write(paths[-1], wav.numpy(), 16000, subtype="FLOAT")
        wavs.append(load_audio(paths[-1]))
    assert sum(w.numel() < 16000 for w in wavs) >= 2  # NeMo pads these
    model = nemo.restore_from(str(tmp_path / "w.nemo"), map_location="cpu").eval()
    got = model.transcribe(paths, batch_size=1, verbose=False, source_lang="en", target_lang="en", pnc="yes")
    got = [h if isinstance(h, str) else h.text for h in got]
    options = DecodingOptions(max_delta=MAX_DELTA, **NEMO_GREEDY)
    for k, (wav, text) in enumerate(zip(wavs, got)):
        pad = max(0, 16000 - wav.numel())
        readings = set()
        for before in {pad // 2, pad - pad // 2}:  # NeMo halves the padding in seconds: either rounding
            padded = torch.cat([torch.zeros(before), wav, torch.zeros(pad - before)])
            path = tmp_path / f"{k}-padded-{before}.wav"
            sf.write(path, padded.numpy(), 16000, subtype="FLOAT")
            results, _ = transcribe(loaded, [str(path)], options, source_lang="en", target_lang="en")
            readings.add(results[0].pred_text.strip())
        assert text.strip() in readings, (sequences[k], text, readings)
    assert any(text.strip() for text in got)  # the model hears words: the comparison is of texts, not of silences
