"""Convert a NeMo Canary checkpoint (`.nemo`, an EncDecMultiTaskModel) into an aed checkpoint.

    python tools/convert_nemo.py canary-1b-flash.nemo -o canary-1b-flash.pt
    python infer.py --ckpt canary-1b-flash.pt --source-lang en --target-lang en talk.wav
    python train.py canary-1b-flash.yaml init_from=canary-1b-flash.pt train.manifests='[my.jsonl]'

Writes three things next to each other:
    OUT.pt          model config, weights, feature settings and tokenizer: all infer.py needs
    OUT.tokenizer/  the tokenizer directory (tokenizer.json + one .model per block), for train.py
    OUT.yaml        a train.py config with the model, features and train.tokenizer of OUT.pt, so
                    fine-tuning with init_from=OUT.pt builds exactly this model

A `.nemo` file is a tar archive (gzipped before NeMo 1.7) holding `model_config.yaml`,
`model_weights.ckpt` (the state dict) and the tokenizer's SentencePiece models, which the config
names as `nemo:<file>`. It is read with the standard library, torch and pyyaml: NeMo is not needed.

What is mapped:
- preprocessor (AudioToMelSpectrogramPreprocessor) -> aed.data_audio.FeatureConfig: sample rate, mel
  bins, window and hop, n_fft, pre-emphasis, log guard, dither, pad value. The filterbank and window
  stored in the checkpoint are compared with the ones aed computes; a mismatch is an error.
- encoder (ConformerEncoder, FastConformer dw_striding 8x) and encoder_decoder_proj: same names.
- transf_decoder + log_softmax (TokenClassifier, weight tied to the embedding): renamed as listed
  in aed/model_decoder.py.
- tokenizer, with NeMo's ids and the checkpoint's prompt format ("canary" or "canary2"): the
  aggregate CanaryTokenizer of Canary-1B and the Flash models as [spl_tokens, lang1, lang2, ...]
  (every piece of the special-token model becomes a special token at the same id), or the one
  SentencePiece model of CanaryBPETokenizer (Canary-1B-v2), whose <|...|> pieces are its special tokens.
- not converted: the companion CTC model some archives carry for word timestamps
  (timestamps_asr_model_*, Canary-1B-v2's). aed times words with a model's own CTC head, which a
  converted Canary does not have (`--timestamps` says so); fine-tune with model.ctc_loss_weight > 0 to get one.

Any architecture option aed does not implement (learned decoder positions, post-LN
decoder, a Transformer encoder between encoder and decoder, another tokenizer, ...)
is an error that names the config key and its value. Training-only settings (SpecAugment, data,
optimiser, stochastic depth) are not converted: train.py has its own.
"""

import argparse
import dataclasses
import io
import math
import os
import re
import sys
import tarfile
import tempfile
from pathlib import Path

import sentencepiece as spm
import torch
import yaml

from aed.data_audio import FeatureConfig, LogMel
from aed.data_tokenizer import (PROMPT_FORMATS, SentencePieceBlock, SpecialBlock, Tokenizer, inline_special_pieces,
                                lang_token)
from aed.model import AED, AEDConfig
from aed.model_checkpoint import pack_dir
from aed.model_encoder import SUBSAMPLING_FACTORS

SPECIAL_BLOCK = "spl_tokens"  # NeMo's name of the special-token model in the aggregate tokenizer
TIMESTAMPS_MODEL = "timestamps_asr_model"  # members of the companion CTC model for timestamps: not read


class ConversionError(ValueError):
    """The .nemo file cannot be read, or uses options aed does not implement (each one named)."""


# --- reading the archive ------------------------------------------------------------------------


def read_nemo(path) -> tuple[dict, dict, dict]:
    """(config, state_dict, {file name: bytes} of every other member) of a .nemo archive."""
    try:
        tar = tarfile.open(path, "r:*")  # "r:*" also opens the gzipped archives of old NeMo versions
    except (OSError, tarfile.TarError) as e:
        raise ConversionError(f"{path}: not a readable .nemo (tar) archive: {e}") from e
    files = {}
    with tar:
        for entry in tar.getmembers():
            name = os.path.basename(entry.name)
            if entry.isfile() and not name.startswith(TIMESTAMPS_MODEL):
                files[name] = tar.extractfile(entry).read()
    for name in ("model_config.yaml", "model_weights.ckpt"):
        if name not in files:
            raise ConversionError(f"{path}: archive has no {name} (members: {sorted(files)})")
    config = yaml.safe_load(files.pop("model_config.yaml").decode("utf-8"))
    # weights_only: a state dict is plain tensors, and loading must not run code from the file.
    state = torch.load(io.BytesIO(files.pop("model_weights.ckpt")), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:  # a Lightning checkpoint wrapped in the archive
        state = state["state_dict"]
    return config, state, files


# --- checking options -------------------------------------------------------------------------


class Options:
    """Looks up config keys, with NeMo's defaults, and collects every unsupported setting."""

    def __init__(self, config: dict):
        self.config = config
        self.problems = []

    def get(self, key: str, default=None):
        """The value at a dotted key; `default` only when the key is absent (an explicit null stays None)."""
        node = self.config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def require(self, key: str, ok, default, why: str):
        """Value of `key`; records a problem naming it when `ok(value)` is false."""
        value = self.get(key, default)
        if not ok(value):
            self.problems.append(f"{key}={value!r}: {why}")
        return value

    def raise_problems(self, path):
        if self.problems:
            raise ConversionError(f"{path}: options aed does not support:\n  " + "\n  ".join(self.problems))


def feature_config(opt: Options) -> FeatureConfig:
    """NeMo AudioToMelSpectrogramPreprocessor settings -> FeatureConfig (NeMo's defaults where unset)."""
    p = "preprocessor."
    opt.require(p + "_target_", lambda v: str(v).endswith("AudioToMelSpectrogramPreprocessor"), "",
                 "aed computes log-mel features (AudioToMelSpectrogramPreprocessor) only")
    sample_rate = opt.get(p + "sample_rate", 16000)
    win_length = opt.get(p + "n_window_size") or int(opt.get(p + "window_size", 0.02) * sample_rate)
    hop_length = opt.get(p + "n_window_stride") or int(opt.get(p + "window_stride", 0.01) * sample_rate)
    opt.require(p + "window", lambda v: v == "hann", "hann", "aed uses a Hann window")
    opt.require(p + "normalize", lambda v: v == "per_feature", "per_feature", "aed normalises per mel bin")
    opt.require(p + "log", lambda v: v is True, True, "aed computes log-mel features")
    opt.require(p + "log_zero_guard_type", lambda v: v == "add", "add", "aed adds the log guard")
    guard = opt.require(p + "log_zero_guard_value", lambda v: isinstance(v, (int, float)), 2**-24,
                        "aed needs a numeric log guard")
    opt.require(p + "frame_splicing", lambda v: v == 1, 1, "aed does not stack frames")
    opt.require(p + "exact_pad", lambda v: v is False, False, "aed's STFT is centred (exact_pad: false)")
    opt.require(p + "mag_power", lambda v: v == 2.0, 2.0, "aed uses the power spectrum")
    opt.require(p + "mel_norm", lambda v: v == "slaney", "slaney", "aed uses Slaney-normalised mel filters")
    opt.require(p + "lowfreq", lambda v: v == 0, 0, "aed's mel filters start at 0 Hz")
    opt.require(p + "highfreq", lambda v: v in (None, sample_rate / 2), None, "aed's mel filters end at Nyquist")
    # pad_to only appends padded frames, which aed's encoder masks: it does not change outputs.
    return FeatureConfig(
        sample_rate=sample_rate,
        n_mels=opt.get(p + "features", 64),
        win_length=win_length,
        hop_length=hop_length,
        n_fft=opt.get(p + "n_fft") or 2 ** math.ceil(math.log2(win_length)),
        preemph=opt.require(p + "preemph", lambda v: isinstance(v, float), 0.97, "aed always pre-emphasises"),
        log_guard=float(guard) if isinstance(guard, (int, float)) else 2**-24,
        dither=float(opt.get(p + "dither", 1e-5)),
        pad_value=float(opt.get(p + "pad_value", 0.0)),
    )


def model_config(opt: Options, vocab_size: int, pad_id: int, n_mels: int) -> AEDConfig:
    """NeMo encoder / transf_decoder / head settings -> AEDConfig."""
    e, d = "encoder.", "transf_decoder.config_dict."
    opt.require("encoder._target_", lambda v: str(v).endswith("ConformerEncoder"), "",
                "aed's encoder is a ConformerEncoder")
    opt.require(e + "feat_in", lambda v: v == n_mels, None, f"must equal preprocessor.features ({n_mels})")
    opt.require(e + "subsampling", lambda v: v == "dw_striding", "striding", "aed implements dw_striding subsampling")
    factor = opt.require(e + "subsampling_factor", lambda v: v in SUBSAMPLING_FACTORS, 4,
                         f"aed's dw_striding subsampling takes the factors {SUBSAMPLING_FACTORS}")
    opt.require(e + "causal_downsampling", lambda v: v is False, False, "aed's subsampling is not causal")
    opt.require(e + "reduction", lambda v: v is None, None, "aed has no time reduction inside the encoder")
    opt.require(e + "self_attention_model", lambda v: v == "rel_pos", "rel_pos", "aed uses relative positions")
    opt.require(e + "att_context_size", lambda v: v in (None, [-1, -1]), None, "aed's attention sees all frames")
    opt.require(e + "att_context_style", lambda v: v == "regular", "regular", "aed has no chunked attention")
    xscaling = opt.require(e + "xscaling", lambda v: isinstance(v, bool), True, "must be true or false")
    opt.require(e + "use_bias", lambda v: v is True, True, "aed's encoder layers have biases")
    opt.require(e + "conv_norm_type", lambda v: v in ("batch_norm", "layer_norm"), "batch_norm",
                "aed's conv module uses batch_norm or layer_norm")
    kernel = opt.get(e + "conv_kernel_size", 31)
    opt.require(e + "conv_context_size", lambda v: v in (None, [(kernel - 1) // 2] * 2), None,
                "aed's depthwise conv is centred")
    opt.require(e + "conv_context_style", lambda v: v == "regular", "regular", "aed's depthwise conv is centred")
    for key in (e + "d_model", e + "n_layers", d + "hidden_size", d + "num_layers"):
        opt.require(key, lambda v: isinstance(v, int) and v > 0, None, "must be a positive integer")
    d_model = opt.get(e + "d_model")
    opt.require(e + "feat_out", lambda v: v in (-1, d_model), -1, "aed has no encoder output projection")
    ff = opt.require(e + "ff_expansion_factor", lambda v: isinstance(v, (int, float)) and float(v).is_integer(), 4,
                     "must be an integer")
    opt.require("transf_encoder.num_layers", lambda v: v == 0, 0,
                "aed has no Transformer encoder between the Conformer and the decoder")

    opt.require("transf_decoder._target_", lambda v: str(v).endswith(("get_nemo_transformer", "TransformerDecoderNM")),
                "", "aed's decoder is NeMo's own Transformer decoder")
    opt.require("transf_decoder.model_name", lambda v: v is None, None,
                "aed cannot load a pretrained HF/Megatron decoder")
    opt.require("transf_decoder.pre_ln_final_layer_norm", lambda v: v is True, True,
                "aed's decoder ends with a LayerNorm")
    opt.require(d + "pre_ln", lambda v: v is True, False, "aed's decoder is pre-LN")
    opt.require(d + "learn_positional_encodings", lambda v: v is False, False,
                "aed's decoder uses fixed sinusoidal positions")
    opt.require(d + "hidden_act", lambda v: v == "relu", "relu", "aed's decoder FFN uses ReLU")
    hidden = opt.get(d + "hidden_size")
    inner = opt.require(d + "inner_size", lambda v: isinstance(v, int) and isinstance(hidden, int) and v % hidden == 0,
                        None, "must be a multiple of hidden_size")
    opt.require("head._target_", lambda v: str(v).endswith("TokenClassifier"), "",
                "aed's output layer is a TokenClassifier")
    opt.require("head.num_layers", lambda v: v == 1, 2, "aed's output layer is one Linear tied to the embedding")
    opt.require("model_defaults.asr_enc_hidden", lambda v: v == d_model, None,
                f"must equal encoder.d_model ({d_model})")
    opt.require("model_defaults.lm_dec_hidden", lambda v: v == hidden, None, f"must equal {d}hidden_size ({hidden})")
    opt.raise_problems("model_config.yaml")

    return AEDConfig(
        n_mels=n_mels,
        vocab_size=vocab_size,
        pad_id=pad_id,
        enc_d_model=d_model,
        enc_layers=opt.get(e + "n_layers"),
        enc_heads=opt.get(e + "n_heads", 4),
        enc_ff_mult=int(ff),
        enc_xscaling=xscaling,
        subsampling_factor=factor,
        conv_kernel=kernel,
        conv_norm=opt.get(e + "conv_norm_type", "batch_norm"),
        subsampling_channels=d_model if opt.get(e + "subsampling_conv_channels", -1) == -1
        else opt.get(e + "subsampling_conv_channels"),
        dec_d_model=hidden,
        dec_layers=opt.get(d + "num_layers"),
        dec_heads=opt.get(d + "num_attention_heads", 1),
        dec_ff_mult=inner // hidden,
        dec_max_len=opt.get(d + "max_sequence_length", 512),
        enc_dropout=opt.get(e + "dropout", 0.1),
        enc_dropout_pre_encoder=opt.get(e + "dropout_pre_encoder", 0.1),
        enc_dropout_att=opt.get(e + "dropout_att", 0.0),
        dec_dropout=opt.get(d + "ffn_dropout", 0.0),
        dec_dropout_att=opt.get(d + "attn_score_dropout", 0.0),
        label_smoothing=float(opt.get("label_smoothing", 0.0)),
        # NeMo scores the prompt unless use_loss_mask_for_prompt is set.
        loss_on_prompt=not opt.get("use_loss_mask_for_prompt", False),
    )


# --- tokenizer --------------------------------------------------------------------------------


def member(files: dict, ref, where: str) -> bytes:
    """The archive member a config value `nemo:<file>` names."""
    if not isinstance(ref, str):
        raise ConversionError(f"model_config.yaml: {where} is missing")
    name = os.path.basename(ref.removeprefix("nemo:"))
    if name not in files:
        raise ConversionError(f"model_config.yaml: {where} names {name}, which is not in the archive")
    return files[name]


LANGUAGE_TOKEN = re.compile(r"<\|([a-z]{2}(-[A-Z]{2})?)\|>")  # <|en|>, <|en-US|>


def convert_tokenizer(opt: Options, files: dict) -> Tokenizer:
    """NeMo's Canary tokenizer -> Tokenizer with the same ids: the aggregate CanaryTokenizer as
    [spl_tokens, lang1, lang2, ...], the CanaryBPETokenizer (Canary-1B-v2) as one "all" block whose
    model holds the special tokens (its languages: every <|xx|> piece with a language code)."""
    prompt_format = opt.require("prompt_format", lambda v: v in PROMPT_FORMATS, None,
                                f"aed implements the prompt formats {sorted(PROMPT_FORMATS)}")
    kind = opt.require("tokenizer.type", lambda v: v in ("agg", "bpe"), None,
                       "aed converts NeMo's Canary tokenizers: aggregate (type: agg) or one SentencePiece model (bpe)")
    target = {"agg": "CanaryTokenizer", "bpe": "CanaryBPETokenizer"}.get(kind, "")
    opt.require("tokenizer.custom_tokenizer._target_", lambda v: str(v).endswith("." + target), "",
                f"aed converts NeMo's {target} for tokenizer.type {kind!r}")
    if kind == "agg":
        opt.require("tokenizer.langs", lambda v: isinstance(v, dict) and SPECIAL_BLOCK in v, None,
                    f"needs a '{SPECIAL_BLOCK}' special-token model")
    opt.raise_problems("model_config.yaml")

    if kind == "bpe":
        sp = spm.SentencePieceProcessor(model_proto=member(files, opt.get("tokenizer.model_path"),
                                                          "tokenizer.model_path"))
        block = SentencePieceBlock("all", sp)
        blocks = [block]
        languages = sorted(m.group(1) for piece in inline_special_pieces(sp) if (m := LANGUAGE_TOKEN.fullmatch(piece)))
    else:
        blocks = []
        for lang, sub in opt.get("tokenizer.langs").items():  # YAML keeps the order, and the order is the id layout
            ref = sub.get("model_path") if isinstance(sub, dict) else None
            sp = spm.SentencePieceProcessor(model_proto=member(files, ref, f"tokenizer.langs.{lang}.model_path"))
            if lang == SPECIAL_BLOCK:
                # NeMo's special-token model: piece i is special token i (<unk>, then the user-defined tokens).
                blocks.append(SpecialBlock([sp.id_to_piece(i) for i in range(sp.get_piece_size())]))
            else:
                blocks.append(SentencePieceBlock(lang, sp))
        if not isinstance(blocks[0], SpecialBlock):
            raise ConversionError(f"model_config.yaml: tokenizer.langs must start with '{SPECIAL_BLOCK}' "
                                  f"(NeMo's Canary layout), got {list(opt.get('tokenizer.langs'))}")
        languages = [b.lang for b in blocks[1:]]
        missing = [lang_token(lang) for lang in languages if lang_token(lang) not in blocks[0].tokens]
        if missing:
            raise ConversionError(f"model_config.yaml: tokenizer.langs.{SPECIAL_BLOCK} has no language tokens {missing}")
    try:
        tokenizer = Tokenizer(blocks, languages, prompt_format)
        tokenizer.prompt_ids(languages[0], languages[0], pnc=True)  # every token of the prompt format exists
    except (ValueError, KeyError, IndexError) as e:
        raise ConversionError(f"model_config.yaml: tokenizer: {e or 'no language tokens'}") from e
    return tokenizer


# --- weights ----------------------------------------------------------------------------------

NAMES = [  # (NeMo prefix, aed prefix), tried in order, {n} a layer index; see aed/model_decoder.py.
    # Encoder names are the same on both sides. tools/export_nemo.py reads this table the other way.
    ("transf_decoder._embedding.position_embedding.pos_enc", "decoder.embedding.pos_enc"),
    ("transf_decoder._embedding.", "decoder.embedding."),
    ("transf_decoder._decoder.final_layer_norm.", "decoder.final_layer_norm."),
    ("transf_decoder._decoder.layers.{n}.layer_norm_1.", "decoder.layers.{n}.norm_self_attn."),
    ("transf_decoder._decoder.layers.{n}.first_sub_layer.", "decoder.layers.{n}.self_attn."),
    ("transf_decoder._decoder.layers.{n}.layer_norm_2.", "decoder.layers.{n}.norm_cross_attn."),
    ("transf_decoder._decoder.layers.{n}.second_sub_layer.", "decoder.layers.{n}.cross_attn."),
    ("transf_decoder._decoder.layers.{n}.layer_norm_3.", "decoder.layers.{n}.norm_ffn."),
    ("transf_decoder._decoder.layers.{n}.third_sub_layer.", "decoder.layers.{n}.ffn."),
    ("log_softmax.mlp.layer0.", "decoder.output_proj."),
]


def rename(key: str, to_aed: bool = True) -> str:
    """A NeMo state-dict name in aed's naming (to_aed), or an aed name in NeMo's: NAMES read either way."""
    for nemo, ours in NAMES:
        source, target = (nemo, ours) if to_aed else (ours, nemo)
        m = re.match(re.escape(source).replace(re.escape("{n}"), r"(\d+)"), key)
        if m:
            return target.replace("{n}", "".join(m.groups())) + key[m.end():]
    return key


# NeMo tensors with no counterpart in aed: recomputed (features, encoder positions) or unused at
# inference (token types are never passed by EncDecMultiTaskModel).
DROPPED = re.compile(r"^(preprocessor\.|encoder\.pos_enc\.|transf_decoder\._embedding\.token_type_embedding\.)")


def convert_weights(state: dict, model: AED) -> dict:
    """NeMo state dict -> aed state dict for `model`; every tensor must find its place, with its shape."""
    own = model.state_dict()
    out, unknown = {}, []
    for key, value in state.items():
        if DROPPED.match(key):
            continue
        new = rename(key)
        if new not in own:
            unknown.append(key)
            continue
        if value.shape != own[new].shape:
            raise ConversionError(f"model_weights.ckpt: {key} has shape {tuple(value.shape)}, "
                                  f"aed's {new} expects {tuple(own[new].shape)}")
        out[new] = value.float()
    tied = "decoder.output_proj.weight"
    if tied in out and not torch.equal(out[tied], out["decoder.embedding.token_embedding.weight"]):
        raise ConversionError("model_weights.ckpt: log_softmax.mlp.layer0.weight is not tied to the decoder "
                              "embedding; aed's output layer shares the embedding matrix")
    out.setdefault(tied, out.get("decoder.embedding.token_embedding.weight"))
    missing = sorted(k for k in own if k not in out)
    if unknown or missing:
        raise ConversionError("model_weights.ckpt does not match aed's model (an architecture option this "
                              f"converter does not know?): NeMo tensors without a place: {unknown[:8]}; "
                              f"aed tensors not in the file: {missing[:8]}")
    return out


def check_features(state: dict, features: FeatureConfig, tolerance=1e-6):
    """The checkpoint's own mel filterbank and window must equal those aed computes from the config."""
    ours = LogMel(features)
    for key, mine in (("preprocessor.featurizer.fb", ours.mel_fb), ("preprocessor.featurizer.window", ours.window)):
        if key not in state:
            continue
        theirs = state[key].float().reshape(mine.shape)
        diff = (theirs - mine).abs().max().item()
        if diff > tolerance:
            raise ConversionError(f"model_weights.ckpt: {key} differs from aed's (max abs diff {diff:.2e}); "
                                  "the preprocessor uses a setting aed does not reproduce")


# --- entry point ------------------------------------------------------------------------------


def convert(nemo_path, out_path, tokenizer_dir=None, config_path=None) -> dict:
    """Convert `nemo_path` and write OUT.pt, the tokenizer directory and the train.py YAML. Returns the checkpoint."""
    out_path = Path(out_path)
    stem = out_path.with_suffix("")
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else stem.parent / (stem.name + ".tokenizer")
    config_path = Path(config_path) if config_path else stem.with_suffix(".yaml")

    config, state, files = read_nemo(nemo_path)
    opt = Options(config)
    features = feature_config(opt)
    tokenizer = convert_tokenizer(opt, files)
    # NeMo sizes the decoder to the tokenizer rounded up to a multiple of 8, as we do.
    cfg = model_config(opt, tokenizer.padded_vocab_size, tokenizer.pad, features.n_mels)
    check_features(state, features)
    with torch.device("meta"):  # shapes only; the weights come from the file
        model = AED(cfg)
    weights = convert_weights(state, model)

    with tempfile.TemporaryDirectory() as tmp:  # packed from a fresh directory: no stale files
        tokenizer.save(tmp)
        packed = pack_dir(tmp)
    tokenizer.save(tokenizer_dir)
    ckpt = {
        "model_config": dataclasses.asdict(cfg),
        "model": weights,
        "features": dataclasses.asdict(features),
        "tokenizer": packed,
        "converted_from": os.path.abspath(nemo_path),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out_path.parent, delete=False) as tmp:
        torch.save(ckpt, tmp)
    os.replace(tmp.name, out_path)  # a killed conversion never leaves half a checkpoint
    train_config = {  # n_mels and the vocabulary come from the features and the tokenizer there
        "model": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("n_mels", "vocab_size", "pad_id")},
        "features": dataclasses.asdict(features),
        "train": {"tokenizer": str(tokenizer_dir.resolve())},
    }
    config_path.write_text(f"# Converted from {nemo_path} by tools/convert_nemo.py; fine-tune with\n"
                           f"#   python train.py {config_path} init_from={out_path} train.manifests=[...]\n"
                           + yaml.safe_dump(train_config, sort_keys=False))
    return ckpt


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("nemo", help="a .nemo file of a NeMo EncDecMultiTaskModel (Canary)")
    parser.add_argument("-o", "--out", required=True, help="aed checkpoint to write (OUT.pt)")
    parser.add_argument("--tokenizer-dir", help="where to write the tokenizer directory (default: OUT.tokenizer/)")
    parser.add_argument("--config", help="where to write the train.py config (default: OUT.yaml)")
    args = parser.parse_args()
    try:
        ckpt = convert(args.nemo, args.out, args.tokenizer_dir, args.config)
    except (ConversionError, OSError) as e:
        sys.exit(f"error: {e}")
    cfg = ckpt["model_config"]
    n = sum(t.numel() for k, t in ckpt["model"].items() if k != "decoder.output_proj.weight")
    print(f"{args.nemo} -> {args.out}: {n / 1e6:.1f}M parameters, encoder {cfg['enc_layers']} x "
          f"{cfg['enc_d_model']}, decoder {cfg['dec_layers']} x {cfg['dec_d_model']}, vocabulary "
          f"{cfg['vocab_size']}, {cfg['n_mels']} mel bins")


if __name__ == "__main__":
    main()
