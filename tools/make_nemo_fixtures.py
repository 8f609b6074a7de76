"""Build the NeMo reference fixtures of tests/test_nemo_convert.py. Needs NeMo; the tests do not.

Run it in a scratch environment, never in the project's .venv:

    python3 -m venv /tmp/nemo-venv
    /tmp/nemo-venv/bin/pip install torch==2.14.1 torchaudio==2.11.0 "nemo_toolkit[asr]"  # made with 3.0.0
    /tmp/nemo-venv/bin/python tools/make_nemo_fixtures.py -o tests/fixtures/nemo

For each prompt format it builds a small NeMo EncDecMultiTaskModel with random weights, shaped like
the released checkpoints (128 mel bins, 8x dw_striding FastConformer with batch norm in the conv
module, pre-LN Transformer decoder, tied output layer) and NeMo's aggregate CanaryTokenizer
[spl_tokens, en, es, de, fr], whose language models are trained on data/mini/train.jsonl:

    canary.nemo   Canary-1B style: 2 + 2 layers, encoder width = decoder width, "canary" prompts
    canary2.nemo  Flash style: 3 + 1 layers, 48-wide encoder -> 32-wide decoder through
                  encoder_decoder_proj (as Canary-180M-Flash), "canary2" prompts, xscaling on (NeMo's default)

and saves NeMo's answers next to each (MODEL.ref.pt), computed on the restored .nemo in eval mode,
one utterance at a time: features, encoder output (after encoder_decoder_proj), decoder log-probs
under teacher forcing, greedy tokens; and the tokenizer's ids for dev texts in all four languages,
for every special token, and for prompts. The preprocessor has dither 0 and pad_to 0.

Weights are random, but not NeMo's initial values: norms, biases, the Transformer-XL position
biases and the batch-norm running statistics are perturbed too, so each of them is exercised.
Random weights make greedy search emit mostly one repeated token for the whole length budget; the
test still compares every token, and the log-probs under teacher forcing cover the decoder.
"""

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import sentencepiece as spm
import soundfile as sf
import torch
from omegaconf import OmegaConf

from nemo.collections.asr.models import EncDecMultiTaskModel
from nemo.collections.common.tokenizers.canary_tokenizer import CanaryTokenizer

ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "data" / "mini"
LANGS = {"en": 128, "es": 96, "de": 112, "fr": 80}  # unequal sizes, so a wrong block offset shows
# Task, language, pnc and the canary2 fields; plus language tokens without a SentencePiece block,
# as the released special-token models have.
SPECIAL = ["translate", "transcribe", "en", "es", "de", "fr", "it", "pt",
           "<|startofcontext|>", "emo:undefined", "emo:neutral", "emo:angry", "emo:happy", "emo:sad",
           "itn", "noitn", "timestamp", "notimestamp", "diarize", "nodiarize"]
UTTERANCES = {  # dev utterances (audio file stem) per model: ASR in four languages and AST
    "canary": ["dev_en_000006", "dev_de_000008", "dev_fr_000002", "dev_en-es_000004"],
    "canary2": ["dev_es_000008", "dev_es-en_000003", "dev_en_000004", "dev_fr_000004"],
}
ARCH = {  # (encoder width, encoder layers, decoder width, decoder layers, encoder xscaling)
    "canary": (32, 2, 32, 2, False),
    "canary2": (48, 3, 32, 1, True),  # xscaling: NeMo's default, as in the released FastConformer configs
}
MAX_DELTA = 50  # NeMo's max_generation_delta in the released configs


def read_manifest(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def train_tokenizers(work: Path) -> dict:
    """Language SentencePiece models (identity normalisation keeps the files small) + NeMo's special-token model."""
    dirs = {}
    train = read_manifest(MINI / "train.jsonl")
    for lang, size in LANGS.items():
        d = work / lang
        d.mkdir(parents=True)
        (d / "text.txt").write_text("\n".join(u["text"] for u in train if u["target_lang"] == lang) + "\n")
        spm.SentencePieceTrainer.train(
            input=str(d / "text.txt"), model_prefix=str(d / "tokenizer"), vocab_size=size, model_type="bpe",
            character_coverage=1.0, bos_id=-1, eos_id=-1, normalization_rule_name="identity", minloglevel=2,
        )
        (d / "vocab.txt").write_text("".join(line.split("\t")[0] + "\n"
                                             for line in (d / "tokenizer.vocab").read_text().splitlines()))
        dirs[lang] = d
    dirs["spl_tokens"] = work / "spl_tokens"
    CanaryTokenizer.build_special_tokenizer(SPECIAL, dirs["spl_tokens"], force_rebuild=True)
    return dirs


def model_config(prompt_format: str, tokenizer_dirs: dict) -> dict:
    enc_d, enc_layers, dec_d, dec_layers, xscaling = ARCH[prompt_format]
    langs = {"spl_tokens": {"dir": str(tokenizer_dirs["spl_tokens"]), "type": "bpe"}}
    langs.update({lang: {"dir": str(tokenizer_dirs[lang]), "type": "bpe"} for lang in LANGS})
    return {
        "sample_rate": 16000,
        "label_smoothing": 0.0,
        "prompt_format": prompt_format,
        "restore_timestamps_model": False,  # no companion CTC model for timestamps
        "model_defaults": {"asr_enc_hidden": enc_d, "lm_enc_hidden": dec_d, "lm_dec_hidden": dec_d},
        "tokenizer": {
            "dir": None, "type": "agg", "langs": langs,
            "custom_tokenizer": {"_target_": "nemo.collections.common.tokenizers.canary_tokenizer.CanaryTokenizer"},
        },
        "preprocessor": {
            "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
            "sample_rate": 16000, "normalize": "per_feature", "window_size": 0.025, "window_stride": 0.01,
            "window": "hann", "features": 128, "n_fft": 512, "log": True, "frame_splicing": 1,
            "dither": 0.0, "pad_to": 0, "pad_value": 0.0,
        },
        "encoder": {
            "_target_": "nemo.collections.asr.modules.ConformerEncoder",
            "feat_in": 128, "feat_out": -1, "n_layers": enc_layers, "d_model": enc_d,
            "subsampling": "dw_striding", "subsampling_factor": 8, "subsampling_conv_channels": 16,
            "causal_downsampling": False, "ff_expansion_factor": 4, "self_attention_model": "rel_pos",
            "n_heads": 2, "att_context_size": [-1, -1], "xscaling": xscaling, "untie_biases": True,
            "pos_emb_max_len": 5000, "conv_kernel_size": 9, "conv_norm_type": "batch_norm",
            "conv_context_size": None, "dropout": 0.1, "dropout_pre_encoder": 0.1, "dropout_emb": 0.0,
            "dropout_att": 0.1,
        },
        "transf_encoder": {
            "_target_": "nemo.collections.asr.modules.transformer.transformer_encoders.TransformerEncoder",
            "num_layers": 0, "hidden_size": dec_d, "inner_size": 4 * dec_d, "num_attention_heads": 4,
        },
        "transf_decoder": {
            "_target_": "nemo.collections.asr.modules.transformer.get_nemo_transformer",
            "model_name": None, "pretrained": False, "encoder": None, "pre_ln_final_layer_norm": True,
            "config_dict": {
                "max_sequence_length": 128, "num_token_types": 0, "embedding_dropout": 0.1,
                "learn_positional_encodings": False, "hidden_size": dec_d, "inner_size": 4 * dec_d,
                "num_layers": dec_layers, "num_attention_heads": 2, "ffn_dropout": 0.1,
                "attn_score_dropout": 0.1, "attn_layer_dropout": 0.1, "hidden_act": "relu", "pre_ln": True,
                "vocab_size": None,
            },
        },
        "head": {
            "_target_": "nemo.collections.asr.parts.submodules.token_classifier.TokenClassifier",
            "num_layers": 1, "activation": "relu", "log_softmax": True, "hidden_size": dec_d,
            "num_classes": None, "dropout": 0.0, "use_transformer_init": True,
        },
        "loss": {"_target_": "nemo.collections.common.losses.smoothed_cross_entropy.SmoothedCrossEntropyLoss",
                 "label_smoothing": 0.0, "pad_id": None},
        "optim": {"name": "adamw", "lr": 3e-4},
    }


@torch.no_grad()
def perturb(model, gen):
    """Move the values NeMo initialises to constants (norm scales, biases, pos_bias_u/v, BN statistics)."""
    for name, p in model.named_parameters():
        # The output bias stays at zero: a random one would make greedy search repeat its largest entry.
        if ("norm" in name or name.endswith("bias") or "pos_bias" in name) and not name.startswith("log_softmax"):
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
        # Decoder sublayers scaled up against the residual token embedding, which the tied output layer
        # would otherwise score highest: greedy outputs then vary a little (mostly they still repeat).
        if name.startswith("transf_decoder") and name.endswith(("out_projection.weight", "dense_out.weight")):
            p.mul_(4.0)
    for name, b in model.named_buffers():
        if name.endswith("running_mean"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
        elif name.endswith("running_var"):
            b.copy_(0.5 + torch.rand(b.shape, generator=gen))


def prompt_slots(prompt_format, src, tgt, pnc=True):
    slots = {"source_lang": src, "target_lang": tgt, "pnc": "yes" if pnc else "no"}
    if prompt_format == "canary":
        slots["task"] = "asr" if src == tgt else "ast"
    else:  # the defaults of the released Flash configs (prompt_defaults)
        slots.update(decodercontext="", emotion="<|emo:undefined|>", itn="no", timestamp="no", diarize="no")
    return slots


@torch.no_grad()
def references(model, prompt_format: str) -> dict:
    """NeMo's outputs on each utterance alone, and its tokenizer's ids."""
    tok = model.tokenizer
    dev = {Path(u["audio_filepath"]).stem: u for u in read_manifest(MINI / "dev.jsonl")}
    generator = model.decoding.decoding.greedy_search  # the greedy GreedySequenceGenerator of NeMo
    utts = []
    for stem in UTTERANCES[prompt_format]:
        u = dev[stem]
        wav, rate = sf.read(MINI / u["audio_filepath"], dtype="float32")
        assert rate == 16000 and wav.ndim == 1, (stem, rate, wav.shape)
        wav = torch.from_numpy(wav)[None]
        feats, feat_lens = model.preprocessor(input_signal=wav, length=torch.tensor([wav.shape[1]]))
        encoded, enc_lens = model.encoder(audio_signal=feats, length=feat_lens)
        # NeMo's STFT keeps one frame past the valid ones, so the encoder output may be one frame
        # longer than enc_lens; the mask hides it from the decoder, as in EncDecMultiTaskModel.forward.
        memory = model.encoder_decoder_proj(encoded.transpose(1, 2))  # (1, T', D_dec)
        memory_mask = (torch.arange(memory.shape[1]) < enc_lens[:, None]).to(memory.dtype)
        turns = [{"role": "user", "slots": prompt_slots(prompt_format, u["source_lang"], u["target_lang"])},
                 {"role": "assistant", "slots": {"text": u["text"], "prompt_language": u["target_lang"]}}]
        encoded_dialog = model.prompt.encode_dialog(turns)
        tokens = encoded_dialog["input_ids"][None]  # (1, U): prompt + text + eos
        prompt = encoded_dialog["context_ids"][None]
        hidden = model.transf_decoder(input_ids=tokens[:, :-1], decoder_mask=torch.ones_like(tokens[:, :-1]),
                                      encoder_embeddings=memory, encoder_mask=memory_mask)
        log_probs = model.log_softmax(hidden_states=hidden)  # (1, U-1, V)
        best = generator(encoder_hidden_states=memory, encoder_input_mask=memory_mask, decoder_input_ids=prompt)[0]
        utts.append({
            "audio": u["audio_filepath"], "source_lang": u["source_lang"], "target_lang": u["target_lang"],
            "text": u["text"], "num_samples": wav.shape[1],
            "feats": feats[0, :, : feat_lens[0]].T.contiguous(),  # (T, F), valid frames only
            "feat_len": int(feat_lens[0]),
            "memory": memory[0, : enc_lens[0]].contiguous(),  # (T', D_dec), valid frames only
            "tokens": tokens[0].tolist(), "prompt_len": prompt.shape[1],
            "log_probs": log_probs[0].contiguous(),
            "greedy": best[0, prompt.shape[1]:].tolist(),
            # NeMo allows min(max_sequence_length, T' + max_generation_delta) tokens in all, prompt
            # included, with T' the padded encoder length (here one frame past the valid ones at times).
            "greedy_limit": min(model.transf_decoder.max_sequence_length, memory.shape[1] + MAX_DELTA) - prompt.shape[1],
        })

    texts = {lang: [u["text"] for u in read_manifest(MINI / "dev.jsonl") if u["target_lang"] == lang][:3]
             for lang in LANGS}
    prompts = {f"{s}-{t}-{p}": model.prompt.encode_dialog([{"role": "user", "slots": prompt_slots(
                   prompt_format, s, t, p)}])["input_ids"].tolist()
               for s, t in [("en", "en"), ("de", "de"), ("es", "es"), ("fr", "fr"), ("en", "es"), ("es", "en")]
               for p in (True, False)}
    return {
        "utterances": utts,
        "vocab_size": tok.vocab_size,
        "special_tokens": dict(tok.special_tokens),
        "text_ids": {lang: [tok.text_to_ids(t, lang) for t in ts] for lang, ts in texts.items()},
        "texts": texts,
        "prompts": prompts,
        "max_generation_delta": MAX_DELTA,
        "nemo_version": __import__("nemo").__version__,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--out", default=str(ROOT / "tests" / "fixtures" / "nemo"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dirs = train_tokenizers(Path(tmp) / "tokenizers")
        for i, prompt_format in enumerate(ARCH):
            torch.manual_seed(args.seed + i)
            random.seed(args.seed + i)
            model = EncDecMultiTaskModel(cfg=OmegaConf.create(model_config(prompt_format, tokenizer_dirs)))
            perturb(model, torch.Generator().manual_seed(args.seed + i))
            path = out / f"{prompt_format}.nemo"
            model.save_to(str(path))
            # References come from the restored file, so they are what a user of the .nemo gets.
            restored = EncDecMultiTaskModel.restore_from(str(path), map_location="cpu").eval()
            decoding = restored.cfg.decoding
            decoding.strategy, decoding.greedy.max_generation_delta = "greedy", MAX_DELTA
            restored.change_decoding_strategy(decoding)
            ref = references(restored, prompt_format)
            torch.save(ref, out / f"{prompt_format}.ref.pt")
            print(f"{path}: {path.stat().st_size / 1e3:.0f} kB, greedy lengths "
                  f"{[len(u['greedy']) for u in ref['utterances']]}", file=sys.stderr)


if __name__ == "__main__":
    main()
