"""Export a checkpoint as a Hugging Face transformers Canary model directory.

    python tools/export_hf.py --ckpt runs/tiny -o hf/tiny

    from transformers import AutoProcessor, CanaryForConditionalGeneration
    processor = AutoProcessor.from_pretrained("hf/tiny")
    model = CanaryForConditionalGeneration.from_pretrained("hf/tiny")
    inputs = processor.apply_transcription_request(wav, source_language="en", target_language="en")
    ids = model.generate(**inputs)      # prompt + aed's greedy tokens (DecodingOptions(ctc_weight=0)) + EOS
    print(processor.batch_decode(ids, skip_special_tokens=True))

Needs transformers with its Canary model (`transformers.models.canary`, 5.17 and later) and librosa,
which its feature extractor computes the mel filters with: `pip install -r tests/requirements-hf.txt`.

What is written, and how aed's names map to transformers' (read from transformers 5.18's
modeling_canary.py and modeling_parakeet.py):
- `model.safetensors`, `config.json`, `generation_config.json`: `CanaryForConditionalGeneration`.
  The encoder maps 1:1 (`pre_encode.conv.N` -> `subsampling.layers.N`, `linear_q` -> `q_proj`,
  `linear_pos` -> `relative_k_proj`, `pos_bias_u` -> `bias_u`, `conv.batch_norm` -> `conv.norm`, ...).
  The decoder's fixed positions are [sin | cos] halves in transformers and interleaved sin/cos in
  aed (NeMo's `FixedPositionalEncoding`); the table is not a weight, so the exporter permutes the
  decoder's width instead: every weight that reads or writes the decoder's residual stream has that
  dimension reordered, which computes the same function with transformers' table.
- the processor (`CanaryProcessor`): `ParakeetFeatureExtractor` with aed's feature settings, the
  tokenizer as one SentencePiece-style vocabulary in aed's id space (special tokens at their ids,
  then the SentencePiece pieces), and a chat template that writes aed's prompt (format "canary" or
  "canary2") for `apply_transcription_request`. NeMo's aggregate tokenizer (one SentencePiece block
  per language, as Canary-1B and the Flash models) becomes a decode-only vocabulary: every id decodes
  to aed's text, so `generate` and `batch_decode` are aed's, but one vocabulary cannot choose a
  block by language, so the tokenizer's own encoding of text is not aed's (said in aed_export.json).
- `aed_export.json`: the source checkpoint, what was left out, and the measured differences.

What transformers' Canary cannot hold stops the export with a message naming it (an
encoder_decoder_proj, as Canary-180M-Flash's 512-wide encoder feeding a 1024-wide decoder; a
layer_norm conv module; feature settings its extractor fixes). A CTC head is left out, and said so: transformers' Canary decodes with
its attention decoder alone, as aed does with ctc_weight=0.

Token ids agree exactly (encoding checked on the bundled transcripts) for a tokenizer with one
SentencePiece block. Decoding ids to text differs
in two corners, both from the tokenizers library: a run of byte pieces that is not valid UTF-8
becomes one U+FFFD per byte (SentencePiece keeps the valid bytes), and SentencePiece's own `<unk>`
piece is skipped (aed writes " ⁇ ").

Before writing, the exported model is loaded back and its logits compared with aed's on random
features and tokens (largest absolute difference printed; above --tolerance stops the tool).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from aed import load_model
from aed.data_audio import FeatureConfig
from aed.data_tokenizer import BOS, EOS, PAD, UNK, SentencePieceBlock, SpecialBlock, Tokenizer
from aed.model import AED
from aed.model_encoder import subsampled_length

HF_PACKAGES = "pip install -r tests/requirements-hf.txt (transformers>=5.17 with its Canary model, librosa)"
HF_LOG_GUARD = 2**-24  # fixed in ParakeetFeatureExtractor (LOG_ZERO_GUARD_VALUE)
HF_SAMPLE_RATE = 16000  # CanaryProcessor passes 16 kHz to its feature extractor


def import_transformers():
    """transformers' Canary classes, or SystemExit naming the packages to install."""
    try:
        import librosa  # noqa: F401  ParakeetFeatureExtractor builds its mel filters with it
        import transformers
        from transformers.models.canary import CanaryForConditionalGeneration  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"error: exporting needs transformers with Canary and librosa ({e}); {HF_PACKAGES}")
    return transformers


# --- what transformers' Canary can hold ----------------------------------------------------------


def inexpressible(model: AED, tokenizer: Tokenizer, features: FeatureConfig) -> list[str]:
    """Everything of this checkpoint that transformers' Canary has no place for: empty if it exports."""
    cfg, problems = model.cfg, []
    if cfg.enc_d_model != cfg.dec_d_model:
        problems.append(f"encoder_decoder_proj (enc_d_model {cfg.enc_d_model} -> dec_d_model {cfg.dec_d_model}): "
                        "transformers' Canary feeds the encoder output to the decoder's cross-attention as it "
                        "is, so the two widths must be equal")
    if cfg.conv_norm != "batch_norm":
        problems.append(f"conv_norm {cfg.conv_norm!r}: the Parakeet encoder's conv module has a BatchNorm1d")
    hf_bins = cfg.n_mels // cfg.subsampling_factor
    if subsampled_length(cfg.n_mels, cfg.subsampling_factor) != hf_bins:
        problems.append(f"n_mels {cfg.n_mels}: the subsampling leaves {subsampled_length(cfg.n_mels, cfg.subsampling_factor)} "
                        f"mel bins, the Parakeet encoder assumes n_mels // {cfg.subsampling_factor} = {hf_bins}")
    if cfg.dec_d_model % 2:
        problems.append(f"dec_d_model {cfg.dec_d_model}: the decoder's sinusoidal positions need an even width")
    if features.log_guard != HF_LOG_GUARD:
        problems.append(f"features.log_guard {features.log_guard}: ParakeetFeatureExtractor fixes it at 2**-24")
    if features.pad_value != 0.0:
        problems.append(f"features.pad_value {features.pad_value}: ParakeetFeatureExtractor pads with 0")
    if features.sample_rate != HF_SAMPLE_RATE:
        problems.append(f"features.sample_rate {features.sample_rate}: CanaryProcessor feeds 16000 Hz audio")
    return problems


def left_out(model: AED, tokenizer: Tokenizer, code_to_name: dict) -> list[str]:
    """What the export drops or cannot request the way aed does, in words for the user."""
    notes = []
    if model.ctc is not None:
        notes.append("the CTC head (ctc.proj): transformers' Canary has none; its generate() equals aed's "
                     "decoding with DecodingOptions(ctc_weight=0), and CTC timestamps are not available")
    unlisted = sorted(set(tokenizer.languages) - set(code_to_name))
    if unlisted:
        notes.append(f"languages {unlisted} are not in transformers' Canary language table: "
                     "apply_transcription_request rejects them (apply_chat_template with their codes still works)")
    sp_blocks = [b for b in tokenizer.blocks if isinstance(b, SentencePieceBlock)]
    if len(sp_blocks) > 1:
        notes.append(f"text encoding: the SentencePiece blocks {[b.lang for b in sp_blocks]} (NeMo's aggregate "
                     "layout) share one transformers vocabulary, in which a piece of several blocks keeps its first "
                     "id; decoding (ids -> text, all generate needs) is aed's, but the tokenizer's encode() is not "
                     "aed's per-language encoding: fine-tune with aed's ids (Tokenizer.encode_example)")
    specials = {t for b in tokenizer.blocks if isinstance(b, SpecialBlock) for t in b.tokens}
    clashes = sorted({p for b in sp_blocks for p in map(b.sp.id_to_piece, range(b.size)) if p in specials})
    if clashes:
        notes.append(f"SentencePiece pieces {clashes} share their string with a special token: the transformers "
                     "tokenizer maps the string to the SentencePiece id and skips it in decoding")
    return notes


# --- weights -----------------------------------------------------------------------------------


def interleaved_to_halves(d: int) -> torch.Tensor:
    """Channel order that turns aed's interleaved [sin0, cos0, sin1, cos1, ...] into transformers'
    [sin0, sin1, ..., cos0, cos1, ...]: hf[..., j] = aed[..., perm[j]]."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


ENCODER_RENAMES = [  # aed substring -> transformers' (modeling_parakeet.py)
    ("pre_encode.conv.", "subsampling.layers."),
    ("pre_encode.out.", "subsampling.linear."),
    ("self_attn.linear_q.", "self_attn.q_proj."),
    ("self_attn.linear_k.", "self_attn.k_proj."),
    ("self_attn.linear_v.", "self_attn.v_proj."),
    ("self_attn.linear_out.", "self_attn.o_proj."),
    ("self_attn.linear_pos.", "self_attn.relative_k_proj."),
    ("self_attn.pos_bias_u", "self_attn.bias_u"),
    ("self_attn.pos_bias_v", "self_attn.bias_v"),
    ("conv.batch_norm.", "conv.norm."),
]

# aed decoder layer names -> (transformers' name, how the residual width enters the weight):
# "in" reads the residual stream (weight columns permuted), "out" writes it (rows and bias),
# "norm" is a LayerNorm over it (both vectors), "memory" reads the encoder output (unchanged).
DECODER_LAYER = {
    "norm_self_attn": ("input_layernorm", "norm"),
    "self_attn.query_net": ("self_attn.q_proj", "in"),
    "self_attn.key_net": ("self_attn.k_proj", "in"),
    "self_attn.value_net": ("self_attn.v_proj", "in"),
    "self_attn.out_projection": ("self_attn.o_proj", "out"),
    "norm_cross_attn": ("post_attention_layernorm", "norm"),
    "cross_attn.query_net": ("encoder_attn.q_proj", "in"),
    "cross_attn.key_net": ("encoder_attn.k_proj", "memory"),
    "cross_attn.value_net": ("encoder_attn.v_proj", "memory"),
    "cross_attn.out_projection": ("encoder_attn.o_proj", "out"),
    "norm_ffn": ("final_layernorm", "norm"),
    "ffn.dense_in": ("mlp.fc1", "in"),
    "ffn.dense_out": ("mlp.fc2", "out"),
}
DECODER_OTHER = {
    "decoder.embedding.token_embedding.weight": ("model.decoder.embed_tokens.weight", "in"),
    "decoder.embedding.layer_norm": ("model.decoder.embedding_layernorm", "norm"),
    "decoder.final_layer_norm": ("model.decoder.norm", "norm"),
    "decoder.output_proj": ("proj_out", "in"),
}


def permute(tensor, role: str, perm):
    if role == "norm" or (role == "out" and tensor.dim() == 1):
        return tensor[perm]
    if role == "out":
        return tensor[perm, :]
    if role == "in" and tensor.dim() == 2:
        return tensor[:, perm]
    return tensor  # a bias of a layer that reads the stream, or a weight reading the encoder output


def convert_state_dict(state: dict, dec_d_model: int) -> dict:
    """aed state dict -> CanaryForConditionalGeneration's, the decoder width permuted to [sin | cos] order."""
    perm = interleaved_to_halves(dec_d_model)
    out = {}
    for key, tensor in state.items():
        if key.startswith("encoder."):
            name = key
            for old, new in ENCODER_RENAMES:
                name = name.replace(old, new)
            out["model." + name] = tensor
        elif key.startswith("decoder.layers."):
            _, _, n, rest = key.split(".", 3)
            module, param = rest.rsplit(".", 1)
            name, role = DECODER_LAYER[module]
            out[f"model.decoder.layers.{n}.{name}.{param}"] = permute(tensor, role, perm)
        elif key == "decoder.embedding.pos_enc" or key.startswith("ctc."):
            continue  # transformers computes the positions itself; the CTC head has no place (left_out)
        else:
            module, param = (key, None) if key in DECODER_OTHER else key.rsplit(".", 1)
            if module not in DECODER_OTHER:
                raise ValueError(f"state dict entry {key!r} has no transformers Canary counterpart")
            name, role = DECODER_OTHER[module]
            out[name if param is None else f"{name}.{param}"] = permute(tensor, role, perm)
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def canary_config(transformers, model: AED, tokenizer: Tokenizer, prompt_start: int, tied: bool):
    cfg = model.cfg
    encoder = dict(
        model_type="parakeet_encoder", hidden_size=cfg.enc_d_model, num_hidden_layers=cfg.enc_layers,
        num_attention_heads=cfg.enc_heads, intermediate_size=cfg.enc_ff_mult * cfg.enc_d_model,
        conv_kernel_size=cfg.conv_kernel, subsampling_factor=cfg.subsampling_factor,
        subsampling_conv_channels=cfg.subsampling_channels, num_mel_bins=cfg.n_mels, scale_input=cfg.enc_xscaling,
        dropout=cfg.enc_dropout_pre_encoder, activation_dropout=cfg.enc_dropout, attention_dropout=cfg.enc_dropout_att,
        layerdrop=0.0,
    )
    decoder = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dec_d_model, intermediate_size=cfg.dec_ff_mult * cfg.dec_d_model,
        num_hidden_layers=cfg.dec_layers, num_attention_heads=cfg.dec_heads, num_key_value_heads=cfg.dec_heads,
        head_dim=cfg.dec_d_model // cfg.dec_heads, max_position_embeddings=cfg.dec_max_len,
        attention_dropout=cfg.dec_dropout_att, pad_token_id=tokenizer.pad, bos_token_id=tokenizer.bos,
        eos_token_id=tokenizer.eos,
    )
    return transformers.CanaryConfig(
        encoder_config=encoder, decoder_config=decoder, vocab_size=cfg.vocab_size, tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad, bos_token_id=tokenizer.bos, eos_token_id=tokenizer.eos,
        decoder_start_token_id=prompt_start,
    )


# --- processor ---------------------------------------------------------------------------------


# Appended to a text piece already in the vocabulary under earlier ids (the same piece in several
# language blocks of an aggregate tokenizer), and removed again by the decoder: a private-use
# character, which no text holds, so the tokenizer never encodes to the marked piece.
DUPLICATE_MARK = "\ue000"


def unified_sentencepiece(tokenizer: Tokenizer) -> bytes:
    """One SentencePiece model proto in aed's id space, blocks in order: each special token a
    user-defined piece at its id, each SentencePiece block's pieces at theirs: the layout of the
    unified Canary tokenizers that transformers converts (convert_slow_tokenizer.CanaryConverter).
    A text or byte piece that earlier blocks have too gets DUPLICATE_MARK once per earlier copy, so
    that every id keeps a string of its own."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    kind = pb.ModelProto.SentencePiece
    sp_blocks = [b for b in tokenizer.blocks if isinstance(b, SentencePieceBlock)]
    unified = pb.ModelProto.FromString(sp_blocks[0].sp.serialized_model_proto())
    del unified.pieces[:]
    copies = {}  # piece -> how many blocks so far have it
    for block in tokenizer.blocks:
        if isinstance(block, SpecialBlock):
            for token in block.tokens:
                unified.pieces.add(piece=token, score=0.0, type=kind.USER_DEFINED)
            continue
        for piece in pb.ModelProto.FromString(block.sp.serialized_model_proto()).pieces:
            if piece.type in (kind.NORMAL, kind.BYTE):
                n = copies.get(piece.piece, 0)
                copies[piece.piece] = n + 1
                piece.piece += DUPLICATE_MARK * n
            unified.pieces.append(piece)
    return unified.SerializeToString()


def chat_template(tokenizer: Tokenizer) -> str:
    """A Jinja template that writes aed's prompt from apply_transcription_request's fields
    (source_language, target_language as codes, punctuation), one line so that no whitespace
    reaches the tokenizer. Unknown languages raise instead of becoming text."""
    langs = json.dumps(sorted(tokenizer.languages))
    head = ("{%- for message in messages -%}{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}"
            "{%- set src = item['source_language'] -%}{%- set tgt = item['target_language'] or src -%}"
            f"{{%- for lang in [src, tgt] -%}}{{%- if lang not in {langs} -%}}"
            "{{ raise_exception('language ' ~ lang ~ ' is not one of this model\\'s: " + ", ".join(sorted(tokenizer.languages)) + "') }}"
            "{%- endif -%}{%- endfor -%}"
            "{%- set pnc = '<|pnc|>' if item.get('punctuation', true) else '<|nopnc|>' -%}")
    tail = "{%- endif -%}{%- endfor -%}{%- endfor -%}"
    if tokenizer.prompt_format == "canary":
        body = ("<|startoftranscript|><|{{ src }}|>{{ '<|transcribe|>' if src == tgt else '<|translate|>' }}"
                "<|{{ tgt }}|>{{ pnc }}")
    else:  # canary2: no task token, translation is a target language different from the source
        body = ("<|startofcontext|><|startoftranscript|><|emo:undefined|><|{{ src }}|><|{{ tgt }}|>{{ pnc }}"
                "<|noitn|><|notimestamp|><|nodiarize|>")
    return head + body + tail


def build_processor(transformers, tokenizer: Tokenizer, features: FeatureConfig):
    from tokenizers import AddedToken, decoders
    from transformers.convert_slow_tokenizer import CanaryConverter

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "unified.model")
        with open(path, "wb") as f:
            f.write(unified_sentencepiece(tokenizer))
        backend = CanaryConverter(path).converted()
    # The converter's decoder leaves byte pieces as "<0xF6>" text; SentencePiece turns them into bytes.
    # Duplicate pieces lose their mark first (unified_sentencepiece).
    backend.decoder = decoders.Sequence([decoders.Replace(DUPLICATE_MARK, ""), decoders.ByteFallback(),
                                         backend.decoder])
    specials = [t for b in tokenizer.blocks if isinstance(b, SpecialBlock) for t in b.tokens]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    hf_tokenizer = transformers.TokenizersBackend(tokenizer_object=backend, bos_token=BOS, eos_token=EOS,
                                                  pad_token=PAD, unk_token=UNK)
    extractor = transformers.ParakeetFeatureExtractor(
        feature_size=features.n_mels, sampling_rate=features.sample_rate, hop_length=features.hop_length,
        n_fft=features.n_fft, win_length=features.win_length, preemphasis=features.preemph, padding_value=0.0,
    )
    return transformers.CanaryProcessor(extractor, hf_tokenizer, chat_template=chat_template(tokenizer))


# --- check -------------------------------------------------------------------------------------


@torch.no_grad()
def largest_logit_error(model: AED, hf_model) -> float:
    """Largest |transformers - aed| of teacher-forced logits on a random batch of 2 utterances of
    unequal length (padding included) and random tokens."""
    gen = torch.Generator().manual_seed(0)
    feat_lens = torch.tensor([300, 211])
    feats = torch.randn(2, 300, model.cfg.n_mels, generator=gen)
    feats[1, 211:] = 0.0  # the feature extractor's padding
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 6), generator=gen)
    memory, memory_lens = model.encode(feats, feat_lens)
    ref = model.decoder.output_proj(model.decoder(tokens, memory, memory_lens))
    mask = (torch.arange(300)[None, :] < feat_lens[:, None]).long()
    got = hf_model(input_features=feats, attention_mask=mask, decoder_input_ids=tokens).logits
    return (got - ref).abs().max().item()


def position_error(model: AED, hf_model) -> float:
    """Largest |transformers' position table (back in aed's order) - aed's| over the decoder's positions."""
    perm = interleaved_to_halves(model.cfg.dec_d_model)
    table = hf_model.model.decoder.pos_emb(torch.arange(model.cfg.dec_max_len))  # (U, D), [sin | cos]
    aed_table = torch.empty_like(table)
    aed_table[:, perm] = table
    return (aed_table - model.decoder.embedding.pos_enc).abs().max().item()


def export(ckpt: str, out: str, tolerance: float = 1e-3) -> dict:
    """Write `out` from checkpoint `ckpt`; returns what aed_export.json holds. ValueError names what
    transformers' Canary cannot hold, or a check that failed."""
    transformers = import_transformers()
    from transformers.models.canary.processing_canary import LANGUAGE_CODE_TO_NAME

    loaded = load_model(ckpt)
    model, tokenizer = loaded.model.float().eval(), loaded.tokenizer
    problems = inexpressible(model, tokenizer, loaded.features)
    if problems:
        raise ValueError(f"{loaded.path}: transformers' Canary cannot hold:\n  - " + "\n  - ".join(problems))
    notes = left_out(model, tokenizer, LANGUAGE_CODE_TO_NAME)
    state = model.state_dict()
    tied = torch.equal(state["decoder.output_proj.weight"], state["decoder.embedding.token_embedding.weight"])
    prompt_start = tokenizer.prompt_ids(tokenizer.languages[0], tokenizer.languages[0], True)[0]
    config = canary_config(transformers, model, tokenizer, prompt_start, tied)

    with tempfile.TemporaryDirectory() as staging:  # written whole, loaded back, checked, then moved
        hf_model = transformers.CanaryForConditionalGeneration(config)
        missing, unexpected = hf_model.load_state_dict(convert_state_dict(state, model.cfg.dec_d_model), strict=False)
        missing = [k for k in missing if not (tied and k == "proj_out.weight")]
        if missing or unexpected:
            raise ValueError(f"weights do not match transformers' Canary: missing {missing}, unexpected {unexpected}")
        hf_model.generation_config = transformers.GenerationConfig(
            decoder_start_token_id=prompt_start, bos_token_id=tokenizer.bos, eos_token_id=tokenizer.eos,
            pad_token_id=tokenizer.pad, max_length=model.cfg.dec_max_len, do_sample=False, num_beams=1)
        hf_model.save_pretrained(staging)
        build_processor(transformers, tokenizer, loaded.features).save_pretrained(staging)

        reloaded = transformers.CanaryForConditionalGeneration.from_pretrained(staging).eval()
        errors = {"logits": largest_logit_error(model, reloaded), "decoder_positions": position_error(model, reloaded)}
        print(f"largest |transformers - aed|: logits {errors['logits']:.2e}, "
              f"decoder positions {errors['decoder_positions']:.2e}")
        if max(errors.values()) > tolerance:
            raise ValueError(f"the exported model differs from aed's by more than --tolerance {tolerance}: {errors}")
        summary = {"source": loaded.path, "transformers": transformers.__version__,
                   "prompt_format": tokenizer.prompt_format, "left_out": notes, "largest_errors": errors}
        with open(os.path.join(staging, "aed_export.json"), "w") as f:
            json.dump(summary, f, indent=2)
        os.makedirs(out, exist_ok=True)
        for name in os.listdir(staging):
            shutil.move(os.path.join(staging, name), os.path.join(out, name))
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint file or directory, or a run directory (its newest)")
    p.add_argument("-o", "--out", required=True, help="output directory (from_pretrained reads it)")
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest accepted |transformers - aed| of logits")
    args = p.parse_args(argv)
    try:
        summary = export(args.ckpt, args.out, args.tolerance)
    except ValueError as e:
        sys.exit(f"error: {e}")
    for note in summary["left_out"]:
        print(f"left out: {note}")
    print(f"wrote {args.out}/ for transformers {summary['transformers']} (CanaryForConditionalGeneration, AutoProcessor)")


if __name__ == "__main__":
    main()
