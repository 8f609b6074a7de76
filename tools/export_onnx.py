"""Export a checkpoint as ONNX graphs for onnxruntime, and optionally in sherpa-onnx's NeMo Canary layout.

    python tools/export_onnx.py --ckpt runs/tiny -o exported/tiny-onnx
    python tools/export_onnx.py --ckpt canary-180m-flash.pt -o exported/flash-onnx --int8 --sherpa
    python tools/export_onnx.py --decode exported/tiny-onnx a.wav --lang en     # greedy tokens with onnxruntime

Writes, in the output directory (shapes: N utterances, T feature frames, T' encoder frames, P tokens
decoded so far, L decoder layers, H heads, d_k = D / H):
    encoder.onnx   x (N, T, F) float log-mels (aed.data_audio.LogMel), x_len (N,) int64
                   -> cross_kv (L, 2, N, H, T', d_k): every decoder layer's cross-attention keys and
                   values, projected once per utterance; enc_len (N,) int64
    decoder.onnx   tokens (N, 1) int64, self_kv (L, 2, N, H, P, d_k), cross_kv, enc_len
                   -> logits (N, V) of the next token, self_kv (L, 2, N, H, P + 1, d_k).
                   The token's position is P, the cache's length: start from P = 0 and feed the prompt
                   a token at a time.
    encoder.int8.onnx, decoder.int8.onnx   with --int8: int8 weights (onnxruntime's quantize_dynamic)
    export.json    the log-mel settings, decoder positions and shapes the graphs were made for
    tokenizer/     the checkpoint's tokenizer (prompt ids, EOS, detokenisation)
    sherpa/        with --sherpa: encoder.onnx, decoder.onnx[, *.int8.onnx], tokens.txt for
                   sherpa_onnx.OfflineRecognizer.from_nemo_canary (`SherpaEncoder`, `SherpaDecoder`)

Before anything is written, every graph is run by onnxruntime on a batch of another size and other
lengths than it was traced with, and compared with the eager model; a difference above --tolerance
stops the tool with an error naming the graph and the output. `OnnxAED` decodes with the written
graphs through aed.decode_search.greedy_search, so its tokens are aed's greedy tokens (with
DecodingOptions(ctc_weight=0): the graphs have no CTC head).

The sherpa-onnx layout follows the contract of sherpa-onnx's C++ runtime
(sherpa-onnx/csrc/offline-canary-model.cc, offline-recognizer-canary-impl.h) and of its export script
for NeMo's canary-180m-flash (scripts/nemo/canary/export_onnx_180m_flash.py); see `SherpaDecoder`.
sherpa-onnx computes its own features (kaldi-native-fbank), which are close to but not NeMo's, so its
tokens can differ from aed's on the same audio (tests/test_export_onnx.py and bench/onnx_bench.py
measure how often).
"""

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from aed import load_model
from aed.data_audio import FeatureConfig, LogMel, load_audio
from aed.data_tokenizer import CONTEXT, EMO_UNDEFINED, NODIARIZE, NOITN, NOPNC, NOTIMESTAMP, PNC, Tokenizer
from aed.decode_search import DecodingOptions, greedy_search
from aed.decode_timing import frame_seconds
from aed.model import AED
from aed.model_static import MIN_FRAMES

OPSET = 18  # the lowest opset torch's ONNX exporter writes; onnxruntime >= 1.14 runs it
SHERPA_LANGUAGES = ("en", "es", "de", "fr")  # the language tokens sherpa-onnx's Canary recognizer looks up
SHERPA_PROMPT = (CONTEXT, "<|startoftranscript|>", EMO_UNDEFINED, None, None, None, NOITN, NOTIMESTAMP, NODIARIZE)
SHERPA_TOKENS = [t for t in SHERPA_PROMPT if t] + [PNC, NOPNC, "<|endoftext|>"]


# --- the graphs -------------------------------------------------------------------------------


class Encoder(nn.Module):
    """`AED.encode`, then every decoder layer's cross-attention K/V: the decoder step then never
    re-projects the encoder output (NeMo's decoder does, at every step)."""

    def __init__(self, model: AED):
        super().__init__()
        self.model = model

    def forward(self, x, x_len):
        memory, enc_len = self.model.encode(x, x_len)  # (N, T', D), (N,)
        return self.model.decoder.cross_kv(memory), enc_len  # (L, 2, N, H, T', d_k)


class Decoder(nn.Module):
    """One token after P cached ones: the blocks of aed.model_decoder.DecoderBlock, with the cache as
    a tensor that grows by one position per call (ONNX graphs are pure functions)."""

    def __init__(self, model: AED):
        super().__init__()
        self.decoder = model.decoder

    def forward(self, tokens, self_kv, cross_kv, enc_len):
        dec = self.decoder
        p = self_kv.size(4)
        x = dec.embedding(tokens, torch.arange(p, p + 1))  # (N, 1, D) at position P
        memory_mask = dec.memory_mask(enc_len, cross_kv.size(4))  # (N, 1, 1, T')
        new_kv = []
        for i, layer in enumerate(dec.layers):
            h = layer.norm_self_attn(x)
            k, v = layer.self_attn.project_kv(h)  # (N, H, 1, d_k) each
            k, v = torch.cat([self_kv[i, 0], k], dim=2), torch.cat([self_kv[i, 1], v], dim=2)  # (N, H, P + 1, d_k)
            new_kv.append(torch.stack([k, v]))
            x = x + layer.self_attn(h, k, v)  # one query sees every position: no mask
            x = layer._cross_attn_and_ffn(x, cross_kv[i, 0], cross_kv[i, 1], memory_mask)
        logits = dec.output_proj(dec.final_layer_norm(x)[:, -1]).float()  # (N, V)
        return logits, torch.stack(new_kv)  # (L, 2, N, H, P + 1, d_k)


class SherpaEncoder(nn.Module):
    """sherpa-onnx's Canary encoder: x (N, T, F), x_len (N,) -> enc_states (N, T', D) after
    encoder_decoder_proj, enc_len (N,), enc_mask (N, T') bool. The runtime reads outputs 0 and 2."""

    def __init__(self, model: AED):
        super().__init__()
        self.model = model

    def forward(self, x, x_len):
        enc_states, enc_len = self.model.encode(x, x_len)
        enc_mask = torch.arange(enc_states.size(1))[None, :] < enc_len[:, None]  # (N, T')
        return enc_states, enc_len, enc_mask


class SherpaDecoder(nn.Module):
    """sherpa-onnx's Canary decoder step, NeMo's `return_mems` layout. Inputs, bound by position:
    decoder_input_ids (N, 2) int32 = [[token, position]], then K = L + 2 "mems" (N, P, D): the hidden
    states of every earlier position at the embedding output, after each layer, and after the final
    LayerNorm; then enc_states (N, T', D) and enc_mask (N, T'). Outputs: logits (N, 1, V) and the K mems
    with this position appended (N, P + 1, D). Self-attention keys and values are recomputed from the
    mems of each layer's input, and cross-attention K/V from enc_states, at every step: that is the layout.

    The position is taken from P, not from the input: the runtime feeds the 9 prompt tokens at
    positions 0..8 and then the generated tokens at 1, 2, 3, ... (offline-recognizer-canary-impl.h), while
    the model was trained with each token at its index in the sequence."""

    def __init__(self, model: AED):
        super().__init__()
        self.decoder = model.decoder

    def forward(self, decoder_input_ids, *mems_and_encoder):
        dec = self.decoder
        *mems, enc_states, enc_mask = mems_and_encoder
        p = mems[0].size(1)
        x = dec.embedding(decoder_input_ids[:, :1].long(), torch.arange(p, p + 1))  # (N, 1, D)
        memory_mask = enc_mask[:, None, None, :]  # (N, T') -> (N, 1, 1, T')
        out = [torch.cat([mems[0], x], dim=1)]
        for i, layer in enumerate(dec.layers):
            h_all = layer.norm_self_attn(out[i])  # (N, P + 1, D): the layer's inputs at every position
            k, v = layer.self_attn.project_kv(h_all)
            x = x + layer.self_attn(h_all[:, -1:], k, v)
            x = layer._cross_attn_and_ffn(x, *layer.cross_attn.project_kv(enc_states), memory_mask)
            out.append(torch.cat([mems[i + 1], x], dim=1))
        y = dec.final_layer_norm(x)
        out.append(torch.cat([mems[-1], y], dim=1))
        return (dec.output_proj(y).float(), *out)  # (N, 1, V), K x (N, P + 1, D)


def n_mems(model: AED) -> int:
    return len(model.decoder.layers) + 2


def export_graph(module: nn.Module, args: tuple, path: str, input_names: list, output_names: list,
                 dynamic_shapes) -> None:
    # Under no_grad: with autograd on, torch 2.14's exporter fails to decompose the encoder attention's
    # reshape of a transposed tensor with symbolic frames.
    module.eval()
    with torch.no_grad():
        torch.onnx.export(module, args, path, input_names=input_names, output_names=output_names,
                          dynamic_shapes=dynamic_shapes, opset_version=OPSET, dynamo=True, external_data=False,
                          verbose=False)


def export_native(model: AED, out: str) -> None:
    """encoder.onnx and decoder.onnx, traced on 2 utterances (4 and 3 x MIN_FRAMES frames) and 3 cached tokens."""
    dim = torch.export.Dim
    n, t = dim("N", min=1, max=4096), dim("T", min=MIN_FRAMES, max=100_000)
    x, x_len = torch.randn(2, 4 * MIN_FRAMES, model.cfg.n_mels), torch.tensor([4 * MIN_FRAMES, 3 * MIN_FRAMES])
    export_graph(Encoder(model), (x, x_len), os.path.join(out, "encoder.onnx"), ["x", "x_len"],
                 ["cross_kv", "enc_len"], ({0: n, 1: t}, {0: n}))
    with torch.no_grad():
        cross_kv, enc_len = Encoder(model)(x, x_len)
    dec = model.decoder
    self_kv = torch.zeros(len(dec.layers), 2, 2, dec.n_heads, 3, dec.d_model // dec.n_heads)
    p, t_enc = dim("P", min=0, max=model.cfg.dec_max_len - 1), dim("T_enc", min=3, max=100_000)
    export_graph(Decoder(model), (torch.zeros(2, 1, dtype=torch.long), self_kv, cross_kv, enc_len),
                 os.path.join(out, "decoder.onnx"), ["tokens", "self_kv", "cross_kv", "enc_len"], ["logits", "self_kv_out"],
                 ({0: n}, {2: n, 4: p}, {2: n, 4: t_enc}, {0: n}))


def export_sherpa(model: AED, out: str) -> None:
    """sherpa/encoder.onnx and sherpa/decoder.onnx (batch 1, as the runtime runs them)."""
    dim = torch.export.Dim
    t = dim("T", min=MIN_FRAMES, max=100_000)
    x, x_len = torch.randn(1, 4 * MIN_FRAMES, model.cfg.n_mels), torch.tensor([4 * MIN_FRAMES])
    export_graph(SherpaEncoder(model), (x, x_len), os.path.join(out, "encoder.onnx"), ["x", "x_len"],
                 ["enc_states", "enc_len", "enc_mask"], ({1: t}, None))
    with torch.no_grad():
        enc_states, _, enc_mask = SherpaEncoder(model)(x, x_len)
    k = n_mems(model)
    mems = tuple(torch.zeros(1, 3, model.cfg.dec_d_model) for _ in range(k))
    p, t_enc = dim("P", min=0, max=model.cfg.dec_max_len - 1), dim("T_enc", min=3, max=100_000)
    names = [f"decoder_mems_list_{i}" for i in range(k)]
    export_graph(SherpaDecoder(model), (torch.tensor([[0, 0]], dtype=torch.int32), *mems, enc_states, enc_mask),
                 os.path.join(out, "decoder.onnx"), ["decoder_input_ids", *names, "enc_states", "enc_mask"],
                 ["logits", *[f"next_{name}" for name in names]],
                 (None, (*[{1: p}] * k, {1: t_enc}, {1: t_enc})))  # the varargs' shapes as one tuple


# --- checks against the eager model ---------------------------------------------------------


def session(path: str, threads: int = 1):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def check_inputs(model: AED):
    """3 utterances of unequal length (the graphs were traced with 2 or 1) and 5 tokens."""
    g = torch.Generator().manual_seed(0)
    x_len = torch.tensor([400, 300, 123])
    x = torch.randn(3, 400, model.cfg.n_mels, generator=g)
    tokens = torch.randint(0, model.cfg.vocab_size, (3, min(5, model.cfg.dec_max_len)), generator=g)
    return x, x_len, tokens


def largest(a, b) -> float:
    return (torch.as_tensor(a) - b).abs().max().item()


def native_errors(model: AED, out: str) -> dict:
    """|onnxruntime - eager| of encoder.onnx's outputs and of decoder.onnx's logits over several steps."""
    x, x_len, tokens = check_inputs(model)
    with torch.no_grad():
        memory, memory_lens = model.encode(x, x_len)
        cache = model.new_cache(memory, memory_lens, tokens.size(1))
        ref = [model.decode_step(tokens[:, i : i + 1], cache) for i in range(tokens.size(1))]
    cross_kv, enc_len = session(os.path.join(out, "encoder.onnx")).run(None, {"x": x.numpy(), "x_len": x_len.numpy()})
    if not (enc_len == memory_lens.numpy()).all():
        return {"encoder.onnx enc_len": float("inf")}
    decoder = session(os.path.join(out, "decoder.onnx"))
    self_kv, logits_err = torch.zeros(*cache.cross_kv.shape[:4], 0, cache.cross_kv.size(5)).numpy(), 0.0
    for i in range(tokens.size(1)):
        logits, self_kv = decoder.run(None, {"tokens": tokens[:, i : i + 1].numpy(), "self_kv": self_kv,
                                             "cross_kv": cross_kv, "enc_len": enc_len})
        logits_err = max(logits_err, largest(logits, ref[i]))
    return {"encoder.onnx cross_kv": largest(cross_kv, cache.cross_kv), "decoder.onnx logits": logits_err}


def sherpa_errors(model: AED, out: str) -> dict:
    """The same for the sherpa-onnx graphs, one utterance at a time (the runtime's batch), positions
    fed as the runtime feeds them after the prompt (wrong on purpose: the graph must ignore them)."""
    x, x_len, tokens = check_inputs(model)
    encoder, decoder = session(os.path.join(out, "encoder.onnx")), session(os.path.join(out, "decoder.onnx"))
    errors = {"sherpa encoder.onnx enc_states": 0.0, "sherpa decoder.onnx logits": 0.0}
    for b in range(x.size(0)):
        feats = x[b : b + 1, : x_len[b]]
        with torch.no_grad():
            memory, memory_lens = model.encode(feats, x_len[b : b + 1])
            cache = model.new_cache(memory, memory_lens, tokens.size(1))
            ref = [model.decode_step(tokens[b : b + 1, i : i + 1], cache) for i in range(tokens.size(1))]
        enc_states, enc_len, enc_mask = encoder.run(None, {"x": feats.numpy(), "x_len": x_len[b : b + 1].numpy()})
        if enc_len.tolist() != memory_lens.tolist() or not enc_mask.all():
            return {"sherpa encoder.onnx enc_len/enc_mask": float("inf")}
        errors["sherpa encoder.onnx enc_states"] = max(errors["sherpa encoder.onnx enc_states"], largest(enc_states, memory))
        mems = [torch.zeros(1, 0, model.cfg.dec_d_model).numpy() for _ in range(n_mems(model))]
        names = [i.name for i in decoder.get_inputs()]
        for i in range(tokens.size(1)):
            ids = torch.tensor([[tokens[b, i], max(i - 2, 0)]], dtype=torch.int32).numpy()
            logits, *mems = decoder.run(None, dict(zip(names, [ids, *mems, enc_states, enc_mask])))
            errors["sherpa decoder.onnx logits"] = max(errors["sherpa decoder.onnx logits"], largest(logits[:, 0], ref[i]))
    return errors


def check(errors: dict, tolerance: float) -> None:
    """SystemExit naming every output that differs from the eager model by more than `tolerance`."""
    for name, err in errors.items():
        print(f"  largest |onnxruntime - eager| of {name}: {err:.2e}")
    bad = [f"{name} ({err:.2e})" for name, err in errors.items() if not err <= tolerance]
    if bad:
        sys.exit(f"error: exported graphs differ from the eager model by more than {tolerance} on inputs of other "
                 f"sizes than traced: {', '.join(bad)}; nothing was written")


# --- sherpa-onnx's contract -----------------------------------------------------------------


def sherpa_unsupported(tokenizer: Tokenizer) -> list[str]:
    """What of `tokenizer` sherpa-onnx's Canary recognizer cannot express (empty: nothing)."""
    problems = []
    if tokenizer.prompt_format != "canary2":
        problems.append(f"prompt format {tokenizer.prompt_format!r} (the runtime builds only the 9-token "
                        f"'canary2' prompt of the Flash models)")
    missing = [lang for lang in SHERPA_LANGUAGES if lang not in tokenizer.languages]
    if missing:
        problems.append(f"languages {missing} (the runtime looks up <|en|>, <|es|>, <|de|> and <|fr|>)")
    extra = sorted(set(tokenizer.languages) - set(SHERPA_LANGUAGES))
    if extra:
        problems.append(f"languages {extra} (the runtime knows only {list(SHERPA_LANGUAGES)} and decodes any other as en)")
    for token in SHERPA_TOKENS:
        try:
            tokenizer.token_to_id(token)
        except KeyError:
            problems.append(f"special token {token} (the runtime looks it up in tokens.txt)")
    return problems


def write_tokens(tokenizer: Tokenizer, vocab_size: int, path: str) -> None:
    """tokens.txt, '<symbol> <id>' per line for each of the model's `vocab_size` logits (the runtime
    checks that the counts agree): ids past the tokenizer's (the model's padding to a multiple of 8)
    get placeholder symbols. SentencePiece's word boundary is U+2581, which the runtime turns into a space."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(vocab_size):
            symbol = tokenizer.id_to_token(i) if i < tokenizer.vocab_size else f"<unused{i}>"
            f.write(f"{symbol} {i}\n")


def add_metadata(path: str, meta: dict) -> None:
    import onnx

    graph = onnx.load(path)
    for key, value in meta.items():
        entry = graph.metadata_props.add()
        entry.key, entry.value = key, str(value)
    onnx.save(graph, path)


def sherpa_metadata(model: AED, features: FeatureConfig) -> dict:
    """What sherpa-onnx reads from the encoder's metadata; num_decoder_layers is the number of mems."""
    return {"model_type": "EncDecMultiTaskModel", "vocab_size": model.cfg.vocab_size,
            "subsampling_factor": model.cfg.subsampling_factor, "feat_dim": features.n_mels,
            "normalize_type": "per_feature", "num_decoder_layers": n_mems(model),
            "decoder_hidden_size": model.cfg.dec_d_model}


def quantize(out: str) -> None:
    """encoder.int8.onnx and decoder.int8.onnx beside the fp32 graphs: int8 MatMul weights, activations
    quantized per call (onnxruntime's dynamic quantization)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    for name in ("encoder", "decoder"):
        quantize_dynamic(os.path.join(out, f"{name}.onnx"), os.path.join(out, f"{name}.int8.onnx"),
                         weight_type=QuantType.QInt8, per_channel=True)


# --- decoding with onnxruntime ---------------------------------------------------------------


class OnnxCache:
    """decoder.onnx's cache between calls: self_kv (L, 2, R, H, P, d_k), cross_kv, enc_len as numpy."""

    def __init__(self, self_kv, cross_kv, enc_len):
        self.self_kv, self.cross_kv, self.enc_len = self_kv, cross_kv, enc_len


class OnnxAED:
    """The graphs of an export directory behind what aed.decode_search.greedy_search uses of a model
    (cfg.dec_max_len, encode_with_ctc, new_cache, decode_step), so that decoding runs aed's own loop,
    length limits and repetition guard. The "memory" handed to the search is encoder.onnx's
    cross-attention K/V with the batch first, (N, T', L, 2, H, d_k), read by new_cache only."""

    def __init__(self, directory: str, int8: bool = False, threads: int = 1):
        with open(os.path.join(directory, "export.json")) as f:
            meta = json.load(f)
        suffix = ".int8.onnx" if int8 else ".onnx"
        self.encoder = session(os.path.join(directory, "encoder" + suffix), threads)
        self.decoder = session(os.path.join(directory, "decoder" + suffix), threads)
        self.features = FeatureConfig(**meta["features"])
        self.cfg = SimpleNamespace(dec_max_len=meta["dec_max_len"], subsampling_factor=meta["subsampling_factor"])
        self.tokenizer = Tokenizer.load(os.path.join(directory, "tokenizer"))
        self.logmel = LogMel(self.features).eval()

    def encode_with_ctc(self, feats, feat_lens):
        cross_kv, enc_len = self.encoder.run(None, {"x": feats.float().numpy(), "x_len": feat_lens.numpy()})
        memory = torch.from_numpy(cross_kv).permute(2, 4, 0, 1, 3, 5)  # (L, 2, N, H, T', d_k) -> (N, T', L, 2, H, d_k)
        return memory, torch.from_numpy(enc_len), None

    def new_cache(self, memory, memory_lens, max_len: int, rows_per_utterance: int = 1) -> OnnxCache:
        assert rows_per_utterance == 1, "the ONNX graphs decode greedily (one row per utterance)"
        cross_kv = memory.permute(2, 3, 0, 4, 1, 5).contiguous()  # (L, 2, N, H, T', d_k)
        self_kv = torch.zeros(*cross_kv.shape[:4], 0, cross_kv.size(5))  # (L, 2, N, H, 0, d_k)
        return OnnxCache(self_kv.numpy(), cross_kv.numpy(), memory_lens.numpy())

    def decode_step(self, tokens, cache: OnnxCache):
        """tokens (R, U), fed one per decoder.onnx call -> logits (R, V) after the last."""
        for j in range(tokens.size(1)):
            logits, cache.self_kv = self.decoder.run(None, {"tokens": tokens[:, j : j + 1].numpy(),
                                                            "self_kv": cache.self_kv, "cross_kv": cache.cross_kv,
                                                            "enc_len": cache.enc_len})
        return torch.from_numpy(logits)

    @torch.inference_mode()
    def decode(self, wav, prompt: list[int], options: DecodingOptions = DecodingOptions(ctc_weight=0)) -> list[int]:
        """Mono 16 kHz samples (S,) -> generated ids (no prompt, no EOS): aed's log-mels, then
        greedy_search with the model's frame length (as aed.decode_transcribe.transcribe sets it). The
        samples are one chunk: transcribe cuts a file longer than the model's training maximum, this does not."""
        feats, feat_lens = self.logmel(wav[None].float(), torch.tensor([wav.numel()]))  # (1, T, F)
        options = dataclasses.replace(options, frame_seconds=frame_seconds(self.features, self.cfg.subsampling_factor))
        memory, memory_lens, _ = self.encode_with_ctc(feats, feat_lens)
        return greedy_search(self, memory, memory_lens, torch.tensor([prompt]), self.tokenizer.eos, options)[0]

    def transcribe(self, path: str, source_lang: str = "en", target_lang: str | None = None,
                   pnc: bool = True) -> list[int]:
        """A file's greedy ids with the task's prompt (ASR when target = source)."""
        target_lang = target_lang or source_lang
        task = "transcribe" if target_lang == source_lang else "translate"
        prompt = self.tokenizer.prompt_ids(source_lang, target_lang, pnc, task)
        return self.decode(load_audio(path, sample_rate=self.features.sample_rate), prompt)


# --- the tool ---------------------------------------------------------------------------------


def export(ckpt: str, out: str, int8: bool = False, sherpa: bool = False, tolerance: float = 1e-3,
           average: int = 1) -> None:
    """Export, check against the eager model, then write `out` (see the module docstring). Export and
    checks run in a temporary directory, so a failed check leaves nothing in `out`. `ckpt` and `average`
    as aed.model_checkpoint.load_model takes them (DDP and FSDP runs' checkpoints, averaged weights)."""
    asr = load_model(ckpt, average=average)
    model = asr.model.float().eval()
    if sherpa:
        problems = sherpa_unsupported(asr.tokenizer)
        if problems:
            sys.exit(f"error: {asr.path} cannot be expressed in sherpa-onnx's Canary layout: {'; '.join(problems)}")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent) as tmp:  # beside `out`: moved into it by renames
        print(f"exporting {asr.path}")
        export_native(model, tmp)
        errors = native_errors(model, tmp)
        if sherpa:
            os.makedirs(os.path.join(tmp, "sherpa"))
            export_sherpa(model, os.path.join(tmp, "sherpa"))
            errors |= sherpa_errors(model, os.path.join(tmp, "sherpa"))
        check(errors, tolerance)
        if int8:
            quantize(tmp)
        if sherpa:
            add_metadata(os.path.join(tmp, "sherpa", "encoder.onnx"), sherpa_metadata(model, asr.features))
            write_tokens(asr.tokenizer, model.cfg.vocab_size, os.path.join(tmp, "sherpa", "tokens.txt"))
            if int8:
                quantize(os.path.join(tmp, "sherpa"))  # metadata first: quantize_dynamic keeps it
        with open(os.path.join(tmp, "export.json"), "w") as f:
            json.dump({"features": dataclasses.asdict(asr.features), "dec_max_len": model.cfg.dec_max_len,
                       "subsampling_factor": model.cfg.subsampling_factor, "checkpoint": asr.path,
                       "tolerance": tolerance, "errors": errors}, f, indent=2)
        asr.tokenizer.save(os.path.join(tmp, "tokenizer"))
        os.makedirs(out, exist_ok=True)
        for name in sorted(os.listdir(tmp)):
            target = os.path.join(out, name)
            if os.path.isdir(target):
                for old in os.listdir(target):
                    os.remove(os.path.join(target, old))
                os.rmdir(target)
            os.replace(os.path.join(tmp, name), target)
    print(f"wrote {out}/: {', '.join(sorted(os.listdir(out)))}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="checkpoint file or directory, or a run directory (its newest)")
    p.add_argument("-o", "--out", help="output directory")
    p.add_argument("--int8", action="store_true", help="also write int8-weight graphs (*.int8.onnx)")
    p.add_argument("--sherpa", action="store_true", help="also write sherpa-onnx's NeMo Canary layout in OUT/sherpa")
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest accepted |onnxruntime - eager|")
    p.add_argument("--average", type=int, default=1, help="export the mean weights of a run's newest N checkpoints")
    p.add_argument("--decode", nargs=2, metavar=("DIR", "AUDIO"), help="greedy-decode AUDIO with DIR's graphs")
    p.add_argument("--lang", default="en", help="with --decode: the audio's language")
    p.add_argument("--target-lang", help="with --decode: translate into this language")
    args = p.parse_args(argv)
    if args.decode:
        runtime = OnnxAED(args.decode[0])
        ids = runtime.transcribe(args.decode[1], args.lang, args.target_lang)
        print(f"{args.decode[1]}\t{runtime.tokenizer.decode_hypothesis(ids)}\t{ids}")
        return
    if not args.ckpt or not args.out:
        p.error("--ckpt and -o are required to export (or --decode DIR AUDIO)")
    export(args.ckpt, args.out, args.int8, args.sherpa, args.tolerance, args.average)


if __name__ == "__main__":
    main()
