"""Export an aed checkpoint as a NeMo Canary checkpoint (`.nemo`, an EncDecMultiTaskModel): the
inverse of tools/convert_nemo.py.

    python tools/export_nemo.py --ckpt runs/my-run -o my-model.nemo              # newest checkpoint of a run
    python tools/export_nemo.py --ckpt runs/my-run --average 5 -o my-model.nemo  # mean of the newest 5, as infer.py
    python tools/export_nemo.py --ckpt canary-1b-flash.pt -o canary-1b-flash.nemo

    # then, with NeMo installed:
    from nemo.collections.asr.models import EncDecMultiTaskModel
    model = EncDecMultiTaskModel.restore_from("my-model.nemo")

--ckpt takes what infer.py takes: a checkpoint file, a `ckpt-*` directory of a DDP or FSDP run, or a
run directory (its newest valid checkpoint). The archive is the tar NeMo writes: model_config.yaml
(sections preprocessor, encoder, transf_encoder, transf_decoder, head, loss, model_defaults, tokenizer,
prompt_format, target, nemo_version), model_weights.ckpt (the state dict under NeMo's names, with the
buffers NeMo loads: the preprocessor's window and mel filterbank, the decoder's position table, the
output layer tied to the embedding) and the tokenizer as NeMo's aggregate CanaryTokenizer: a
`spl_tokens` SentencePiece model whose piece i is special token i, then one SentencePiece model per
language, each as NeMo stores it (`nemo:<id>_tokenizer.model`, `_tokenizer.vocab`, `_vocab.txt`).

What NeMo's EncDecMultiTaskModel cannot hold:
- the CTC head (model.ctc_loss_weight > 0): dropped, and the export says so. NeMo decodes with the
  attention decoder alone; joint CTC/attention decoding and CTC word timestamps are aed's only.
- a tokenizer that is not [special tokens, one SentencePiece model per language] (our "single"
  layout, with one model for all languages): an error, as is any other setting NeMo's model would
  compute differently (named in the message).
Settings used only by training (SpecAugment, data, optimiser) are not exported; NeMo's own decoding
defaults are left to NeMo.
"""

import argparse
import dataclasses
import hashlib
import io
import math
import os
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml
from sentencepiece import sentencepiece_model_pb2 as sp_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run from anywhere: convert_nemo is beside us
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from convert_nemo import SPECIAL_BLOCK, ConversionError, check_features, rename  # noqa: E402

from aed import load_model  # noqa: E402
from aed.data_audio import FeatureConfig, LogMel  # noqa: E402
from aed.data_tokenizer import UNK, SentencePieceBlock, SpecialBlock, Tokenizer  # noqa: E402
from aed.model import AEDConfig  # noqa: E402

NEMO_VERSION = "3.0.0"  # the NeMo release this layout was checked against (tests/test_export_nemo.py)
TARGET = "nemo.collections.asr.models.aed_multitask_models.EncDecMultiTaskModel"
# FeatureConfig fields written below; a new one is an error until NeMo's preprocessor is shown to reproduce it.
FEATURE_FIELDS = {"sample_rate", "n_mels", "win_length", "hop_length", "n_fft", "preemph", "log_guard", "dither",
                  "pad_value"}


# --- checks -------------------------------------------------------------------------------------


def check_exportable(cfg: AEDConfig, features: FeatureConfig, tokenizer: Tokenizer) -> None:
    """ConversionError naming everything of this model that NeMo's EncDecMultiTaskModel would not reproduce."""
    problems = []
    unknown = sorted(set(dataclasses.asdict(features)) - FEATURE_FIELDS)
    if unknown:
        problems.append(f"features {unknown}: no NeMo preprocessor setting is known to reproduce them")
    padded = 8 * math.ceil(tokenizer.vocab_size / 8)  # NeMo sizes its decoder from the tokenizer this way
    if cfg.vocab_size != padded:
        problems.append(f"model.vocab_size={cfg.vocab_size}: NeMo builds {padded} rows for a tokenizer of "
                        f"{tokenizer.vocab_size} ids (its size rounded up to a multiple of 8)")
    if cfg.pad_id != tokenizer.pad:
        problems.append(f"model.pad_id={cfg.pad_id}: NeMo uses the tokenizer's <pad> ({tokenizer.pad})")
    problems += tokenizer_problems(tokenizer)
    if problems:
        raise ConversionError("this model cannot be exported to NeMo:\n  " + "\n  ".join(problems))


def tokenizer_layout(tokenizer: Tokenizer) -> str:
    """NeMo's tokenizer for this layout: "agg" (CanaryTokenizer: [special, en, es, ...]) or "bpe"
    (CanaryBPETokenizer: aed's single layout [special, all], or one "all" model holding its own
    special tokens, as Canary-1B-v2's)."""
    langs = [b.lang for b in tokenizer.blocks if isinstance(b, SentencePieceBlock)]
    return "bpe" if langs == ["all"] else "agg"


def tokenizer_problems(tokenizer: Tokenizer) -> list[str]:
    """What of the tokenizer neither of NeMo's Canary tokenizers can hold."""
    special = [b for b in tokenizer.blocks if isinstance(b, SpecialBlock)]
    first = tokenizer.blocks[0]
    if len(special) > 1 or (special and not isinstance(first, SpecialBlock)):
        return [f"tokenizer {tokenizer}: NeMo's Canary tokenizers hold one block of special tokens, the first"]
    if special and (not first.tokens or first.tokens[0] != UNK):
        return [f"tokenizer: the special block must start with {UNK} (the unknown piece of NeMo's SentencePiece "
                f"model), got {first.tokens[:1]}"]
    if tokenizer_layout(tokenizer) == "agg" and (not special or any(b.lang == "all" for b in tokenizer.blocks[1:])):
        return [f"tokenizer {tokenizer}: NeMo's CanaryTokenizer needs the special tokens first, then one "
                "SentencePiece model per language"]
    return []


# --- config -------------------------------------------------------------------------------------


def window_keys(samples: int, sample_rate: int, name: str) -> dict:
    """NeMo's window_size / window_stride in seconds where NeMo's int(seconds * rate) gives back
    `samples`, else n_window_size / n_window_stride in samples."""
    seconds = samples / sample_rate
    if int(seconds * sample_rate) == samples:
        return {f"window_{name}": seconds}
    return {f"window_{name}": None, f"n_window_{name}": samples}


def nemo_config(cfg: AEDConfig, features: FeatureConfig, tokenizer: Tokenizer, tokenizer_section: dict) -> dict:
    """model_config.yaml of an EncDecMultiTaskModel with this model's architecture and the given
    tokenizer section. Each key is one that tools/convert_nemo.py reads back."""
    f = features
    return {
        "sample_rate": f.sample_rate,
        "label_smoothing": cfg.label_smoothing,
        "use_loss_mask_for_prompt": not cfg.loss_on_prompt,
        "prompt_format": tokenizer.prompt_format,
        "restore_timestamps_model": False,  # NeMo would fetch a separate CTC model for timestamps
        "model_defaults": {"asr_enc_hidden": cfg.enc_d_model, "lm_enc_hidden": cfg.dec_d_model,
                           "lm_dec_hidden": cfg.dec_d_model},
        "tokenizer": tokenizer_section,
        "preprocessor": {
            "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
            "sample_rate": f.sample_rate, "normalize": "per_feature",
            **window_keys(f.win_length, f.sample_rate, "size"), **window_keys(f.hop_length, f.sample_rate, "stride"),
            "window": "hann", "features": f.n_mels, "n_fft": f.n_fft, "log": True, "frame_splicing": 1,
            "dither": f.dither, "pad_to": 0, "pad_value": f.pad_value, "preemph": f.preemph,
            "log_zero_guard_type": "add", "log_zero_guard_value": f.log_guard, "mag_power": 2.0,
            "mel_norm": "slaney", "lowfreq": 0, "highfreq": None, "exact_pad": False,
        },
        "encoder": {
            "_target_": "nemo.collections.asr.modules.ConformerEncoder",
            "feat_in": cfg.n_mels, "feat_out": -1, "n_layers": cfg.enc_layers, "d_model": cfg.enc_d_model,
            "subsampling": "dw_striding", "subsampling_factor": cfg.subsampling_factor,
            "subsampling_conv_channels": cfg.subsampling_channels, "causal_downsampling": False,
            "ff_expansion_factor": cfg.enc_ff_mult, "self_attention_model": "rel_pos", "n_heads": cfg.enc_heads,
            "att_context_size": [-1, -1], "xscaling": cfg.enc_xscaling,
            "untie_biases": True,  # each layer has its own pos_bias_u / pos_bias_v, as aed's
            "pos_emb_max_len": 5000, "conv_kernel_size": cfg.conv_kernel, "conv_norm_type": cfg.conv_norm,
            "conv_context_size": None, "dropout": cfg.enc_dropout, "dropout_pre_encoder": cfg.enc_dropout_pre_encoder,
            "dropout_emb": 0.0, "dropout_att": cfg.enc_dropout_att,
        },
        "transf_encoder": {"num_layers": 0},
        "transf_decoder": {
            "_target_": "nemo.collections.asr.modules.transformer.get_nemo_transformer",
            "model_name": None, "pretrained": False, "encoder": None, "pre_ln_final_layer_norm": True,
            "config_dict": {
                "max_sequence_length": cfg.dec_max_len, "num_token_types": 0, "embedding_dropout": cfg.dec_dropout,
                "learn_positional_encodings": False, "hidden_size": cfg.dec_d_model,
                "inner_size": cfg.dec_ff_mult * cfg.dec_d_model, "num_layers": cfg.dec_layers,
                "num_attention_heads": cfg.dec_heads, "ffn_dropout": cfg.dec_dropout,
                "attn_score_dropout": cfg.dec_dropout_att, "attn_layer_dropout": cfg.dec_dropout,
                "hidden_act": "relu", "pre_ln": True, "vocab_size": cfg.vocab_size,
            },
        },
        "head": {
            "_target_": "nemo.collections.asr.parts.submodules.token_classifier.TokenClassifier",
            "num_layers": 1, "activation": "relu", "log_softmax": True, "hidden_size": cfg.dec_d_model,
            "num_classes": cfg.vocab_size, "dropout": 0.0, "use_transformer_init": True,
        },
        "loss": {"_target_": "nemo.collections.common.losses.smoothed_cross_entropy.SmoothedCrossEntropyLoss",
                 "label_smoothing": cfg.label_smoothing, "pad_id": cfg.pad_id},
        "target": TARGET,
        "nemo_version": NEMO_VERSION,
    }


# --- tokenizer ----------------------------------------------------------------------------------


def special_model(tokens: list[str]) -> bytes:
    """The spl_tokens SentencePiece model: piece i is special token i (piece 0 the unknown piece).
    NeMo looks the special tokens up by piece; text is never encoded with it."""
    proto = sp_model.ModelProto()
    for i, token in enumerate(tokens):
        piece = proto.pieces.add()
        piece.piece, piece.score = token, 0.0
        # "▁" is the one ordinary piece of the models NeMo's build_special_tokenizer trains.
        piece.type = (sp_model.ModelProto.SentencePiece.UNKNOWN if i == 0 else
                      sp_model.ModelProto.SentencePiece.NORMAL if token == "▁" else
                      sp_model.ModelProto.SentencePiece.USER_DEFINED)
    proto.trainer_spec.model_type = sp_model.TrainerSpec.UNIGRAM
    proto.trainer_spec.vocab_size = len(tokens)
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 0, -1, -1
    proto.normalizer_spec.name = "identity"
    return proto.SerializeToString()


def vocab_files(model: bytes) -> tuple[bytes, bytes]:
    """(tokenizer.vocab, vocab.txt) of a SentencePiece model, as SentencePiece's trainer and NeMo's
    create_spt_model write them: "piece<TAB>score" lines, and the WordPiece-style list of ordinary
    pieces. NeMo registers both as artifacts; neither changes what the model encodes."""
    proto = sp_model.ModelProto()
    proto.ParseFromString(model)
    ordinary = sp_model.ModelProto.SentencePiece.NORMAL
    scores = "".join(f"{p.piece}\t{p.score:g}\n" for p in proto.pieces)
    words = [p.piece[1:] or p.piece if p.piece.startswith("▁") else f"##{p.piece}"
             for p in proto.pieces if p.type == ordinary and p.piece not in ("<s>", "</s>", "<pad>", "<unk>")]
    return scores.encode(), "".join(w + "\n" for w in words).encode()


def canary_bpe_model(tokenizer: Tokenizer) -> bytes:
    """The one SentencePiece model of NeMo's CanaryBPETokenizer, with aed's ids: a converted one as
    it is; aed's single layout [special, all] as the special tokens (user-defined pieces, as NeMo
    trains them; <unk> the unknown piece) followed by the "all" model's pieces. That model's own
    unknown piece, which byte fallback never emits, becomes the control piece <unk:all>: a model
    has one unknown piece and no two pieces share a string. NeMo encodes the prompt as text with
    this model; without the dummy prefix that gives aed's prompt, not "▁" and then aed's prompt,
    which the model never saw. (Text NeMo encodes to fine-tune then starts without the word-start
    mark; decoding is the same.)"""
    *special, block = tokenizer.blocks
    if not special:
        return block.sp.serialized_model_proto()
    kind = sp_model.ModelProto.SentencePiece
    proto = sp_model.ModelProto.FromString(block.sp.serialized_model_proto())
    pieces = [sp_model.ModelProto.SentencePiece.FromString(p.SerializeToString()) for p in proto.pieces]
    del proto.pieces[:]
    for i, token in enumerate(special[0].tokens):
        proto.pieces.add(piece=token, score=0.0, type=kind.UNKNOWN if i == 0 else kind.USER_DEFINED)
    for piece in pieces:
        if piece.type == kind.UNKNOWN:
            piece.piece, piece.type = "<unk:all>", kind.CONTROL
        proto.pieces.append(piece)
    proto.trainer_spec.unk_id, proto.trainer_spec.vocab_size = 0, len(proto.pieces)
    proto.normalizer_spec.add_dummy_prefix = False
    return proto.SerializeToString()


def artifacts(name: str, model: bytes) -> tuple[dict, dict]:
    """({config key: "nemo:<member>"}, {member: bytes}) of one SentencePiece model as NeMo stores it:
    the model, its vocab.txt and tokenizer.vocab. Members are named `<id>_<file>` as NeMo names them;
    the id is a hash of the contents, so one model always gives the same archive."""
    entry, files = {}, {}
    scores, words = vocab_files(model)
    for key, file, data in (("model_path", "tokenizer.model", model), ("vocab_path", "vocab.txt", words),
                            ("spe_tokenizer_vocab", "tokenizer.vocab", scores)):
        member = f"{hashlib.md5(name.encode() + data).hexdigest()}_{file}"
        entry[key] = f"nemo:{member}"
        files[member] = data
    return entry, files


def tokenizer_artifacts(tokenizer: Tokenizer) -> tuple[dict, dict]:
    """(the config's tokenizer section, {archive member: bytes}): NeMo's CanaryBPETokenizer for one
    "all" model, else its aggregate CanaryTokenizer with one entry per block in block order, which
    is the id layout."""
    target = "nemo.collections.common.tokenizers.canary_tokenizer."
    if tokenizer_layout(tokenizer) == "bpe":
        entry, files = artifacts("all", canary_bpe_model(tokenizer))
        return {"dir": None, "type": "bpe", **entry, "custom_tokenizer": {"_target_": target + "CanaryBPETokenizer"}}, files
    langs, files = {}, {}
    for block in tokenizer.blocks:
        if isinstance(block, SpecialBlock):
            name, model = SPECIAL_BLOCK, special_model(block.tokens)
        else:
            name, model = block.lang, block.sp.serialized_model_proto()
        entry, more = artifacts(name, model)
        langs[name] = {"dir": None, "type": "bpe", **entry}
        files.update(more)
    return {"dir": None, "type": "agg", "langs": langs, "custom_tokenizer": {"_target_": target + "CanaryTokenizer"}}, files


# --- weights ------------------------------------------------------------------------------------


def nemo_filterbank(f: FeatureConfig) -> torch.Tensor:
    """Slaney mel filterbank (F, n_fft // 2 + 1) as NeMo stores it: librosa.filters.mel's float64
    arithmetic, its ramps rounded to float32 before the area normalisation, as librosa does. aed's
    own (torchaudio, float32) differs by ~3e-7: this one makes a converted model export bit for bit."""
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, np.log(6.4) / 27.0  # Slaney: linear below 1 kHz, log above
    min_log_mel = min_log_hz / f_sp

    def hz_to_mel(hz):
        return np.where(hz >= min_log_hz, min_log_mel + np.log(np.maximum(hz, min_log_hz) / min_log_hz) / logstep,
                        hz / f_sp)

    def mel_to_hz(mel):
        return np.where(mel >= min_log_mel, min_log_hz * np.exp(logstep * (mel - min_log_mel)), f_sp * mel)

    fft_hz = np.fft.rfftfreq(n=f.n_fft, d=1.0 / f.sample_rate)
    mel_hz = mel_to_hz(np.linspace(hz_to_mel(np.float64(0.0)), hz_to_mel(np.float64(f.sample_rate / 2)), f.n_mels + 2))
    widths = np.diff(mel_hz)
    ramps = np.subtract.outer(mel_hz, fft_hz)  # (F + 2, n_fft // 2 + 1)
    weights = np.zeros((f.n_mels, len(fft_hz)), dtype=np.float32)
    for i in range(f.n_mels):
        weights[i] = np.maximum(0, np.minimum(-ramps[i] / widths[i], ramps[i + 2] / widths[i + 1]))
    weights *= (2.0 / (mel_hz[2:] - mel_hz[:-2]))[:, None]  # area normalisation, in float64, stored float32
    return torch.from_numpy(weights)


def nemo_state_dict(model_state: dict, features: FeatureConfig) -> tuple[dict, list[str]]:
    """aed state dict -> NeMo's names, plus the preprocessor buffers NeMo loads; and the names dropped."""
    state, dropped = {}, []
    for key, value in model_state.items():
        if key.startswith("ctc."):
            dropped.append(f"{key} {tuple(value.shape)}")
            continue
        value = value.detach()  # the tied output layer keeps sharing the embedding's storage in the file
        state[rename(key, to_aed=False)] = value.float() if value.is_floating_point() else value  # fp32, as NeMo's
    state["preprocessor.featurizer.window"] = LogMel(features).window.clone()
    state["preprocessor.featurizer.fb"] = nemo_filterbank(features)[None]  # (1, F, n_fft // 2 + 1)
    check_features(state, features)  # the features NeMo computes are the ones the model was trained on
    return state, dropped


# --- entry point --------------------------------------------------------------------------------


def export(ckpt, out_path, average: int = 1, log=print) -> dict:
    """Write `ckpt` (anything infer.py loads) as the .nemo archive `out_path`. Returns its config.
    What NeMo cannot hold either stops the export (ConversionError) or is dropped and reported to `log`."""
    loaded = load_model(str(ckpt), average=average)
    cfg, features, tokenizer = loaded.model.cfg, loaded.features, loaded.tokenizer
    check_exportable(cfg, features, tokenizer)
    state, dropped = nemo_state_dict(loaded.model.state_dict(), features)
    if dropped:
        log(f"dropped the CTC head ({', '.join(dropped)}): NeMo's EncDecMultiTaskModel has none; the export "
            "decodes with the attention decoder alone (no joint CTC/attention decoding, no CTC timestamps)")
    section, files = tokenizer_artifacts(tokenizer)
    config = nemo_config(cfg, features, tokenizer, section)
    weights = io.BytesIO()
    torch.save(state, weights)
    files = {"model_config.yaml": yaml.safe_dump(config, sort_keys=False, allow_unicode=True).encode(),
             "model_weights.ckpt": weights.getvalue(), **files}

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out_path.parent, delete=False) as tmp:
        with tarfile.open(fileobj=tmp, mode="w") as tar:  # uncompressed, as NeMo >= 1.7 writes it
            for name, data in files.items():
                info = tarfile.TarInfo(f"./{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    os.replace(tmp.name, out_path)  # a failed export never leaves half an archive
    return config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="checkpoint file, ckpt-* directory or run directory")
    parser.add_argument("-o", "--out", required=True, help=".nemo archive to write")
    parser.add_argument("--average", type=int, default=1, help="average the newest N checkpoints of a run directory")
    args = parser.parse_args(argv)
    try:
        config = export(args.ckpt, args.out, args.average)
    except (ConversionError, OSError, ValueError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    enc, dec = config["encoder"], config["transf_decoder"]["config_dict"]
    print(f"{args.ckpt} -> {args.out}: encoder {enc['n_layers']} x {enc['d_model']}, decoder {dec['num_layers']} x "
          f"{dec['hidden_size']}, vocabulary {config['head']['num_classes']}, prompt format {config['prompt_format']}, "
          f"tokenizer {config['tokenizer']['custom_tokenizer']['_target_'].rsplit('.', 1)[1]}")


if __name__ == "__main__":
    main()
