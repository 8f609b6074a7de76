"""NVIDIA NeMo's own Canary (EncDecMultiTaskModel) at an aed layout's shapes, with random weights: the
NeMo peer of `bench/infer_speed_bench.py --nemo`.

Built offline from a config, as NeMo's fast-conformer_aed.yaml and the released Canary-flash models set
it up: FastConformer encoder (rel-pos attention, 8x dw_striding subsampling, conv kernel 9), a Linear
bridging encoder and decoder widths, pre-LN Transformer decoder, output layer tied to the embedding,
the canary2 prompt, greedy search. Same parameter count as aed's layout (182,643,840 for
canary-180m-flash, 883,554,432 for canary-1b-flash). Its tokenizer is Canary's aggregate layout,
trained here on pseudo-words: 1152 special tokens and one BPE model per language, 5248 in all.

Fixed work, as every system in the bench: the output layer's biases of EOS and pad are set to -1e9 (NeMo
strips trailing pads) and the greedy search's length limit to prompt + `tokens`, so that every
utterance decodes exactly `tokens` tokens; both are restored afterwards and the counts are checked.

Install, outside the project venv (NeMo's transformers pin clashes with the faster-whisper peers'):
    .venv/bin/pip install --target /tmp/nemo-peers --no-deps -r bench/requirements-nemo-peers.txt
    PYTHONPATH=/tmp/nemo-peers .venv/bin/python bench/infer_speed_bench.py --nemo --no-peers
"""

import contextlib
import itertools
import random
import shutil
import time
from pathlib import Path

import soundfile as sf
import torch

LANGS = ("en", "de", "es", "fr")
N_SPECIAL = 1152  # Canary's special-token vocabulary; the rest is split among the languages' BPE models
CANARY2_TOKENS = ["<|startofcontext|>", "<|transcribe|>", "<|translate|>", "<|emo:undefined|>", "<|itn|>",
                  "<|noitn|>", "<|timestamp|>", "<|notimestamp|>", "<|diarize|>", "<|nodiarize|>"] \
    + [f"<|{lang}|>" for lang in LANGS]  # what the canary2 prompt needs beyond NeMo's DEFAULT_TOKENS


def pseudo_text(path: Path, seed: int, lines: int = 20000) -> None:
    """Words made of random syllables at Zipf-like frequencies: enough distinct merges for BPE."""
    rng = random.Random(seed)
    onsets = ["", "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "ch", "st", "tr"]
    nuclei = ["a", "e", "i", "o", "u", "ai", "au", "ee", "ie", "ou"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng"]
    words = ["".join(rng.choice(onsets) + rng.choice(nuclei) + rng.choice(codas) for _ in range(rng.randint(1, 4)))
             for _ in range(30000)]
    cumulative = list(itertools.accumulate(1.0 / (i + 1) for i in range(len(words))))
    path.write_text("\n".join(" ".join(rng.choices(words, cum_weights=cumulative, k=12)) for _ in range(lines)) + "\n")


def canary_tokenizer(vocab_size: int, directory: Path) -> dict:
    """The `tokenizer` section of a Canary config, its SentencePiece models built in `directory` (kept)."""
    from nemo.collections.common.tokenizers.canary_tokenizer import DEFAULT_TOKENS, CanaryTokenizer
    from nemo.collections.common.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer, create_spt_model

    special = directory / "spl_tokens"
    if not (special / "tokenizer.model").exists():
        needed = list(dict.fromkeys(DEFAULT_TOKENS + CANARY2_TOKENS))
        fillers = N_SPECIAL - len(needed)
        for _ in range(3):  # the builder adds a few pieces of its own (<unk>, characters): size it to N_SPECIAL
            shutil.rmtree(special, ignore_errors=True)
            CanaryTokenizer.build_special_tokenizer(needed + [f"<|spltoken{i}|>" for i in range(fillers)], special)
            extra = SentencePieceTokenizer(str(special / "tokenizer.model")).vocab_size - N_SPECIAL
            if extra == 0:
                break
            fillers -= extra
    langs = {"spl_tokens": {"dir": str(special), "type": "bpe"}}
    rest = vocab_size - N_SPECIAL
    for i, lang in enumerate(LANGS):
        pieces = rest // len(LANGS) + (i < rest % len(LANGS))
        folder = directory / lang
        if not (folder / "tokenizer.model").exists():
            folder.mkdir(parents=True, exist_ok=True)
            pseudo_text(folder / "text.txt", seed=1000 + i)
            create_spt_model(str(folder / "text.txt"), vocab_size=pieces, sample_size=-1, do_lower_case=False,
                             tokenizer_type="bpe", output_dir=str(folder))
        langs[lang] = {"dir": str(folder), "type": "bpe"}
    return {"dir": None, "type": "agg", "langs": langs,
            "custom_tokenizer": {"_target_": "nemo.collections.common.tokenizers.canary_tokenizer.CanaryTokenizer"}}


def canary_config(cfg, n_mels: int, tokenizer: dict) -> dict:
    """EncDecMultiTaskModel config for aed's AEDConfig `cfg` (widths, layers, heads), dropout as NeMo's."""
    return {
        "sample_rate": 16000, "prompt_format": "canary2", "restore_timestamps_model": False,
        "prompt_defaults": [{"role": "user", "slots": {
            "decodercontext": "", "emotion": "<|emo:undefined|>", "source_lang": "en", "target_lang": "en",
            "pnc": "yes", "itn": "no", "timestamp": "no", "diarize": "no"}}],
        "model_defaults": {"asr_enc_hidden": cfg.enc_d_model, "lm_enc_hidden": cfg.dec_d_model,
                           "lm_dec_hidden": cfg.dec_d_model},
        "tokenizer": tokenizer,
        "preprocessor": {
            "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor", "sample_rate": 16000,
            "normalize": "per_feature", "window_size": 0.025, "window_stride": 0.01, "window": "hann",
            "features": n_mels, "n_fft": 512, "log": True, "frame_splicing": 1, "dither": 0.0, "pad_to": 0},
        "spec_augment": None,
        "encoder": {
            "_target_": "nemo.collections.asr.modules.ConformerEncoder", "feat_in": n_mels, "feat_out": -1,
            "n_layers": cfg.enc_layers, "d_model": cfg.enc_d_model, "n_heads": cfg.enc_heads,
            "subsampling": "dw_striding", "subsampling_factor": 8,
            "subsampling_conv_channels": cfg.subsampling_channels, "ff_expansion_factor": 4,
            "self_attention_model": "rel_pos", "att_context_size": [-1, -1], "xscaling": False,
            "untie_biases": True, "pos_emb_max_len": 5000, "conv_kernel_size": 9, "conv_norm_type": "batch_norm",
            "dropout": 0.1, "dropout_pre_encoder": 0.1, "dropout_emb": 0.0, "dropout_att": 0.1},
        "transf_encoder": {"num_layers": 0},
        "transf_decoder": {
            "_target_": "nemo.collections.asr.modules.transformer.get_nemo_transformer", "model_name": None,
            "pretrained": False, "encoder": None, "pre_ln_final_layer_norm": True,
            "config_dict": {
                "max_sequence_length": cfg.dec_max_len, "num_token_types": 0, "embedding_dropout": 0.1,
                "learn_positional_encodings": False, "hidden_size": cfg.dec_d_model,
                "inner_size": 4 * cfg.dec_d_model, "num_layers": cfg.dec_layers,
                "num_attention_heads": cfg.dec_heads, "ffn_dropout": 0.1, "attn_score_dropout": 0.1,
                "attn_layer_dropout": 0.1, "hidden_act": "relu", "pre_ln": True, "vocab_size": None}},
        "head": {
            "_target_": "nemo.collections.asr.parts.submodules.token_classifier.TokenClassifier", "num_layers": 1,
            "activation": "relu", "log_softmax": True, "hidden_size": cfg.dec_d_model, "num_classes": None,
            "dropout": 0.0, "use_transformer_init": True},
        "loss": {"_target_": "nemo.collections.common.losses.smoothed_cross_entropy.SmoothedCrossEntropyLoss",
                 "label_smoothing": 0.0, "pad_id": None},
    }


def build(cfg, n_mels: int, directory: Path):
    """A random-weight NeMo Canary with aed's AEDConfig `cfg` shapes, on the CPU, in eval mode."""
    from nemo.collections.asr.models import EncDecMultiTaskModel
    from nemo.collections.asr.parts.submodules.multitask_decoding import MultiTaskDecodingConfig
    from nemo.utils import logging
    from omegaconf import OmegaConf

    logging.setLevel(logging.ERROR)
    tokenizer = canary_tokenizer(cfg.vocab_size, directory / f"nemo-canary-tokenizer-{cfg.vocab_size}")
    config = OmegaConf.create(canary_config(cfg, n_mels, tokenizer))
    config.decoding = OmegaConf.structured(MultiTaskDecodingConfig(strategy="greedy"))
    torch.manual_seed(0)
    model = EncDecMultiTaskModel(cfg=config, trainer=None).eval()
    vocab = model.log_softmax.mlp.layer0.out_features
    if vocab != cfg.vocab_size:
        raise RuntimeError(f"NeMo's Canary has a vocabulary of {vocab}, aed's layout {cfg.vocab_size}")
    return model


@contextlib.contextmanager
def fixed_tokens(model, tokens: int, prompt_len: int):
    """Every utterance decodes exactly `tokens` tokens: EOS and pad never win, and the greedy search
    (max_generation_delta -1) runs to its max_seq_length."""
    search = model.decoding.decoding.greedy_search
    bias = model.log_softmax.mlp.layer0.bias
    banned = [model.tokenizer.eos, model.tokenizer.pad]
    saved = search.max_seq_length, search.max_delta_len, bias.detach()[banned].clone()
    with torch.no_grad():
        bias[banned] = -1e9
    search.max_seq_length, search.max_delta_len = prompt_len + tokens, -1
    try:
        yield
    finally:
        search.max_seq_length, search.max_delta_len = saved[0], saved[1]
        with torch.no_grad():
            bias[banned] = saved[2]


def transcribe_groups(model, groups: list[list[str]], tokens: int) -> dict:
    """NeMo's own pipeline without its data loader (whose per-call setup would be timed too): read the
    files, NeMo's preprocessor and encoder, then its greedy search, one batch per group.
    -> wall, encoder and decoder seconds and the tokens decoded."""
    turns = model.prompt.get_default_dialog_slots()
    prompt = model.prompt.encode_dialog(turns=turns)["context_ids"]  # the canary2 prompt transcribe() builds
    wall = encoder = decoder = 0.0
    count = 0
    with fixed_tokens(model, tokens, len(prompt)), torch.inference_mode():
        for group in groups:
            model.eval()  # NeMo's greedy search leaves its decoder in training mode
            start = time.perf_counter()
            waves = [torch.from_numpy(sf.read(p, dtype="float32")[0]) for p in group]
            lengths = torch.tensor([len(w) for w in waves])
            audio = torch.nn.utils.rnn.pad_sequence(waves, batch_first=True)  # (B, samples)
            _, _, states, mask = model.forward(input_signal=audio, input_signal_length=lengths)
            encoded = time.perf_counter()
            hyps = model.decoding.decode_predictions_tensor(
                encoder_hidden_states=states, encoder_input_mask=mask,
                decoder_input_ids=prompt.unsqueeze(0).repeat(len(group), 1), return_hypotheses=True)
            end = time.perf_counter()
            wall, encoder, decoder = wall + end - start, encoder + encoded - start, decoder + end - encoded
            lengths = [len(h.y_sequence) for h in hyps]
            if set(lengths) != {tokens}:
                raise RuntimeError(f"NeMo decoded {lengths} tokens, expected {tokens} each")
            count += sum(lengths)
    model.eval()
    return {"wall_s": wall, "encoder_s": encoder, "decoder_s": decoder, "tokens": count}
