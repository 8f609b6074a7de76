"""The decoder step on fixed-shape buffers: compiled (`CompiledAED`, what `infer.py --compile` and
`val.compile` run, a CUDA graph on CUDA) and exported (`export_model`, torch.export programs).

    compiled = CompiledAED(model)          # model in eval mode; on CUDA the step is also a CUDA graph
    hyps = decode(compiled, feats, feat_lens, prompt, eos_id, options)        # aed.decode_search, as with model
    hyps = search(compiled, memory, memory_lens, prompt, eos_id, options, ctc_log_probs)

Why: the eager decoder's KVCache (aed/model_decoder.py) has a Python-int length and its attention
reads the filled prefix, so every step has new shapes, and a step is a Python loop of a few dozen
small kernels per layer. On a GPU at batch 1 that step is bound by kernel launches. Here the same
KVCache has its length in a device tensor: buffers of a fixed shape, written at that position,
attention masked to the filled positions. So `torch.compile(fullgraph=True)` traces the whole step
once per shape, and on CUDA `mode="reduce-overhead"` captures it as a CUDA graph that replays in one
launch. On a CPU a batch-1 step is bound by reading the weights instead: compiling it gains little
there (int8 weights do: aed.model_checkpoint.quantize_int8).

Shapes are rounded up to buckets (rows to a power of two, decoder positions to a multiple of
POSITION_BUCKET, encoder frames to a multiple of FRAME_BUCKET), so a few compiled graphs serve every
batch. Each bucket's buffers are allocated on first use and reused by every later batch of that bucket:
a CUDA graph reads and writes fixed addresses. Padded frames are masked out and padded rows are dropped,
so the tokens are eager decoding's (tests/test_model_static.py; the attention sums over more, masked,
positions, which may change the last bits of a logit but has not changed a token there).

CompiledAED has what aed.decode_search uses of a model (cfg, encode_with_ctc, new_cache, decode_step); the
encoder stays eager: at batch 16 on a CPU it is compute-bound, and its input shapes change with every
batch.

Exported programs: the encoder, and one decoder step with its KV cache.

    encoder, step = export_model(model, max_len=256)     # torch.export.ExportedProgram, each
    torch.export.save(encoder, "encoder.pt2")           # tools/export_torch.py writes both, checked

    cross_kv, memory_lens, *ctc = encoder.module()(feats, feat_lens)
    logits, self_kv = step.module()(tokens, position, self_kv, cross_kv, memory_lens)

encoder: feats (B, T, F) log-mels (aed.data_audio.LogMel), feat_lens (B,) -> cross_kv (L, 2, B, H, T', d_k),
    the decoder's cross-attention keys and values, projected once per utterance; memory_lens (B,);
    with a CTC head also its log-probs (B, T', V + 1).
step: tokens (R, 1) at position (a () long tensor), self_kv (L, 2, R, H, U_max, d_k) holding
    positions [0, position), cross_kv and memory_lens (R rows of the encoder's) -> fp32 logits (R, V)
    of the next token and self_kv with `position` filled (a new tensor: the cache goes in and comes out).
    Inside, it is `AED.decode_step` on a KVCache with a tensor position, over a copy of self_kv.

B, T, R and T' are dynamic; U_max (prompt + output + EOS) is fixed when exporting. The programs are
traced in eval mode (no dropout; BatchNorm uses its running statistics). `ExportedAED` puts the two
programs' modules behind the model interface aed.decode_search uses, so greedy and beam search (joint
with CTC too) run on them with the searches' own loops:

    hyps = decode(ExportedAED(encoder.module(), step.module(), max_len=256), feats, feat_lens, prompt, eos_id)
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim, ExportedProgram, export

from aed.model import AED
from aed.model_decoder import KVCache


POSITION_BUCKET = 64  # decoder positions per bucket step: attention over up to 63 masked positions is cheap
FRAME_BUCKET = 128  # encoder frames (~10 s at 80 ms) per bucket step; the cross-attention over them is cheap too
RECOMPILE_LIMIT = 64  # graphs torch.compile keeps for the step: (row, position, frame) buckets x (prompt, step)


def bucket_rows(rows: int) -> int:
    return 1 << (rows - 1).bit_length()  # the next power of two


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class CompiledAED:
    """An eval-mode AED whose decoder step is compiled per shape bucket (see the module docstring).

    mode: torch.compile's; None picks "reduce-overhead" (CUDA graphs) on CUDA and "default" elsewhere.
    """

    def __init__(self, model: AED, mode: str | None = None):
        assert not model.training, "compile a model in eval mode: dropout would be traced into the step"
        device = next(model.parameters()).device
        self.model, self.cfg = model, model.cfg
        self.mode = mode or ("reduce-overhead" if device.type == "cuda" else "default")
        # Each bucket is one more graph of the same function: torch's default limit (8) would fall back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self._step = torch.compile(model.decode_step, fullgraph=True, dynamic=False, mode=self.mode)
        self._caches: dict[tuple, KVCache] = {}  # per bucket: allocated once, reused by every batch

    def encode_with_ctc(self, feats, feat_lens):
        return self.model.encode_with_ctc(feats, feat_lens)

    def new_cache(self, memory, memory_lens, max_len: int, rows_per_utterance: int = 1) -> KVCache:
        """AED.new_cache's cache with a tensor position, in the buffers of its shape bucket: memory (B, T', D),
        memory_lens (B,), `max_len` positions, R = B * rows_per_utterance rows (beams of an utterance adjacent)."""
        b, t, _ = memory.shape
        rows = b * rows_per_utterance
        cross_kv = self.model.decoder.cross_kv(memory).repeat_interleave(rows_per_utterance, dim=2)  # (L, 2, R, H, T', d_k)
        memory_mask = self.model.decoder.memory_mask(memory_lens, t).repeat_interleave(rows_per_utterance, dim=0)
        n_layers, _, _, heads, _, d_k = cross_kv.shape
        positions = min(round_up(max_len, POSITION_BUCKET), self.cfg.dec_max_len)
        key = (bucket_rows(rows), positions, round_up(t, FRAME_BUCKET), cross_kv.dtype, cross_kv.device)
        if key not in self._caches:
            r, u, frames, dtype, device = key
            keys, values = ([torch.zeros(r, heads, u, d_k, dtype=dtype, device=device) for _ in range(n_layers)]
                            for _ in range(2))
            cross = torch.zeros(n_layers, 2, r, heads, frames, d_k, dtype=dtype, device=device)
            mask = torch.zeros(r, 1, 1, frames, dtype=torch.bool, device=device)
            position = torch.zeros((), dtype=torch.long, device=device)
            if self.mode == "reduce-overhead":
                for buffer in keys + values + [cross, mask, position]:  # fixed addresses, read and written in place
                    torch._dynamo.mark_static_address(buffer)
            self._caches[key] = KVCache(keys, values, cross, mask, position)
        cache = self._caches[key]
        for buffer in cache.keys + cache.values:
            buffer.zero_()
        cache.cross_kv.zero_()
        cache.cross_kv[:, :, :rows, :, :t] = cross_kv
        cache.memory_mask.zero_()
        cache.memory_mask[:rows, :, :, :t] = memory_mask
        cache.memory_mask[rows:, :, :, 0] = True  # padding rows see one (zero) frame: no all-masked NaN rows
        cache.length.zero_()
        return cache

    def decode_step(self, tokens, cache: KVCache):
        """AED.decode_step on the cache's bucket: tokens (R, U) -> fp32 logits (R, V)."""
        r = tokens.size(0)
        padded = F.pad(tokens, (0, 0, 0, cache.rows - r))  # (R_bucket, U): padding rows feed token 0
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # each step is a new replay of the graph
            return self._step(padded, cache)[:r].clone()  # the graph's output memory is reused by the next replay
        return self._step(padded, cache)[:r]


MIN_FRAMES = 17  # feature frames the exporter may assume: 3 encoder frames (rel_shift's view needs T' > 2)


class EncoderProgram(nn.Module):
    """What one utterance needs before decoding: `AED.encode_with_ctc`, then every decoder layer's
    cross-attention keys and values (as `TransformerDecoder.new_cache` computes them)."""

    def __init__(self, model: AED):
        super().__init__()
        self.model = model

    def forward(self, feats, feat_lens):
        memory, memory_lens, ctc_log_probs = self.model.encode_with_ctc(feats, feat_lens)
        out = (self.model.decoder.cross_kv(memory), memory_lens)  # (L, 2, B, H, T', d_k), (B,)
        return out + (ctc_log_probs,) if ctc_log_probs is not None else out


class StepProgram(nn.Module):
    """`AED.decode_step` of one token on a KVCache with a tensor position: the next token's logits and
    the new cache. The cache's buffers are views of a copy of self_kv, so the inputs stay unchanged."""

    def __init__(self, model: AED):
        super().__init__()
        self.model = model

    def forward(self, tokens, position, self_kv, cross_kv, memory_lens):
        self_kv = self_kv.clone()  # (L, 2, R, H, U_max, d_k): written at `position` below, then returned
        memory_mask = self.model.decoder.memory_mask(memory_lens, cross_kv.size(4))  # (R, 1, 1, T')
        layers = range(self_kv.size(0))  # views one by one: unbind's views may not be written in place under autograd
        cache = KVCache([self_kv[i, 0] for i in layers], [self_kv[i, 1] for i in layers], cross_kv, memory_mask,
                        position.clone())
        return self.model.decode_step(tokens, cache), self_kv  # (R, V), (L, 2, R, H, U_max, d_k)


def empty_cache(model: AED, rows: int, max_len: int, dtype=torch.float32) -> torch.Tensor:
    """A zero self-attention cache for `rows` hypotheses of up to `max_len` tokens: (L, 2, R, H, U_max, d_k)."""
    dec = model.decoder
    return torch.zeros(len(dec.layers), 2, rows, dec.n_heads, max_len, dec.d_model // dec.n_heads, dtype=dtype)


def export_model(model: AED, max_len: int, max_frames: int = 100_000) -> tuple[ExportedProgram, ExportedProgram]:
    """The encoder and decoder-step programs of `model` (put in eval mode), for batches of any size,
    inputs of MIN_FRAMES to max_frames feature frames, and up to max_len decoder positions."""
    model.eval()
    if max_len > model.cfg.dec_max_len:
        raise ValueError(f"max_len {max_len} exceeds the decoder's {model.cfg.dec_max_len} positions")
    batch, frames = Dim("batch", min=1, max=4096), Dim("frames", min=MIN_FRAMES, max=max_frames)
    feats = torch.randn(2, 4 * MIN_FRAMES, model.cfg.n_mels)
    feat_lens = torch.tensor([4 * MIN_FRAMES, 3 * MIN_FRAMES])
    with torch.no_grad():
        encoder = export(EncoderProgram(model), (feats, feat_lens), dynamic_shapes=({0: batch, 1: frames}, {0: batch}))
        cross_kv, memory_lens = encoder.module()(feats, feat_lens)[:2]
        rows, enc_frames = Dim("rows", min=1, max=4096), Dim("enc_frames", min=3, max=max_frames)
        step_inputs = (torch.zeros(2, 1, dtype=torch.long), torch.tensor(0), empty_cache(model, 2, max_len),
                       cross_kv, memory_lens)
        step = export(StepProgram(model), step_inputs,
                      dynamic_shapes=({0: rows}, None, {2: rows}, {2: rows, 4: enc_frames}, {0: rows}))
    # Functional ops only (no decompositions): the cache writes become out-of-place index_put, so the
    # program runs under autograd too, as a pure function of its inputs.
    return encoder, step.run_decompositions({})


class ExportedCache:
    """The exported step's cache between calls: self_kv (L, 2, R, H, U_max, d_k), the rows' cross-attention
    K/V (L, 2, R, H, T', d_k) and encoder lengths (R,), and `length`, the positions filled (a Python int)."""

    def __init__(self, self_kv, cross_kv, memory_lens):
        self.self_kv, self.cross_kv, self.memory_lens, self.length = self_kv, cross_kv, memory_lens, 0

    def reorder(self, index) -> None:
        """Row r takes the history of row index[r] (KVCache.reorder)."""
        self.self_kv = self.self_kv.index_select(2, index)


class ExportedAED:
    """The exported programs' modules (`.module()` of export_model's two, or of loaded .pt2 files) behind
    what aed.decode_search uses of a model (cfg.dec_max_len, encode_with_ctc, new_cache, decode_step),
    so the searches decode with them. A thin adapter: the "memory" it hands the search is the encoder
    program's cross-attention K/V with the batch first (B, T', L, 2, H, d_k), which only new_cache
    reads, and a chunk of tokens (the prompt) goes through the one-token step a token at a time."""

    def __init__(self, encoder, step, max_len: int):
        self.encoder, self.step, self.max_len = encoder, step, max_len
        self.cfg = SimpleNamespace(dec_max_len=max_len)  # token_budget's position limit: U_max

    def encode_with_ctc(self, feats, feat_lens):
        cross_kv, memory_lens, *ctc = self.encoder(feats, feat_lens)  # (L, 2, B, H, T', d_k), (B,)[, (B, T', V + 1)]
        return cross_kv.permute(2, 4, 0, 1, 3, 5), memory_lens, ctc[0] if ctc else None  # (B, T', L, 2, H, d_k)

    def new_cache(self, memory, memory_lens, max_len: int, rows_per_utterance: int = 1) -> ExportedCache:
        assert max_len <= self.max_len, f"the exported step holds {self.max_len} positions, need {max_len}"
        cross_kv = memory.permute(2, 3, 0, 4, 1, 5).repeat_interleave(rows_per_utterance, dim=2)  # (L, 2, R, H, T', d_k)
        n_layers, _, rows, heads, _, d_k = cross_kv.shape
        self_kv = cross_kv.new_zeros(n_layers, 2, rows, heads, self.max_len, d_k)  # the fixed U_max of the program
        return ExportedCache(self_kv, cross_kv, memory_lens.repeat_interleave(rows_per_utterance))

    def decode_step(self, tokens, cache: ExportedCache):
        """tokens (R, U), fed one per step call -> fp32 logits (R, V) after the last."""
        for j in range(tokens.size(1)):
            logits, cache.self_kv = self.step(tokens[:, j : j + 1], torch.tensor(cache.length, device=tokens.device),
                                              cache.self_kv, cache.cross_kv, cache.memory_lens)
            cache.length += 1
        return logits
