"""A compiled decoder step on fixed-shape buffers: what `infer.py --compile` and `val.compile` run.

    compiled = CompiledAED(model)          # model in eval mode; on CUDA the step is also a CUDA graph
    hyps = decode(compiled, feats, feat_lens, prompt, eos_id, options)        # aed.decoding, as with model
    hyps = search(compiled, memory, memory_lens, prompt, eos_id, options, ctc_log_probs)

Why: the eager decoder's KVCache grows by a Python int and its attention reads the filled slice, so
every step has new shapes, and a step is a Python loop of a few dozen small kernels per layer. On a
GPU at batch 1 that step is bound by kernel launches. Here it runs on a StaticKVCache (aed/decoder.py):
buffers of a fixed shape, written at a position tensor, attention masked to the filled positions. So
`torch.compile(fullgraph=True)` traces the whole step once per shape, and on CUDA `mode="reduce-overhead"`
captures it as a CUDA graph that replays in one launch. On a CPU a batch-1 step is bound by reading the
weights instead: compiling it gains little there (int8 weights do: aed.inference.quantize_int8).

Shapes are rounded up to buckets (rows to a power of two, decoder positions to a multiple of
POSITION_BUCKET, encoder frames to a multiple of FRAME_BUCKET), so a few compiled graphs serve every
batch. Each bucket's buffers are allocated on first use and reused by every later batch of that bucket:
a CUDA graph reads and writes fixed addresses. Padded frames are masked out and padded rows are dropped,
so the tokens are eager decoding's (tests/test_compiled.py; the attention sums over more, masked,
positions, which may change the last bits of a logit but has not changed a token there).

CompiledAED has what aed.decoding uses of a model (cfg, encode_with_ctc, new_cache, decode_step); the
encoder stays eager: at batch 16 on a CPU it is compute-bound, and its input shapes change with every
batch.
"""

import torch
import torch.nn.functional as F

from aed.decoder import StaticKVCache
from aed.model import AED

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
        self._caches: dict[tuple, StaticKVCache] = {}  # per bucket: allocated once, reused by every batch

    def encode_with_ctc(self, feats, feat_lens):
        return self.model.encode_with_ctc(feats, feat_lens)

    def new_cache(self, memory, memory_lens, max_len: int, rows_per_utterance: int = 1) -> StaticKVCache:
        """AED.new_cache's cache, in the buffers of its shape bucket: memory (B, T', D), memory_lens (B,),
        `max_len` positions, R = B * rows_per_utterance rows (beams of an utterance adjacent)."""
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
            self._caches[key] = StaticKVCache(keys, values, cross, mask, position)
        cache = self._caches[key]
        for buffer in cache.keys + cache.values:
            buffer.zero_()
        cache.cross_kv.zero_()
        cache.cross_kv[:, :, :rows, :, :t] = cross_kv
        cache.memory_mask.zero_()
        cache.memory_mask[:rows, :, :, :t] = memory_mask
        cache.memory_mask[rows:, :, :, 0] = True  # padding rows see one (zero) frame: no all-masked NaN rows
        cache.position.zero_()
        return cache

    def decode_step(self, tokens, cache: StaticKVCache):
        """AED.decode_step on the cache's bucket: tokens (R, U) -> fp32 logits (R, V)."""
        r = tokens.size(0)
        padded = F.pad(tokens, (0, 0, 0, cache.rows - r))  # (R_bucket, U): padding rows feed token 0
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # each step is a new replay of the graph
            return self._step(padded, cache)[:r].clone()  # the graph's output memory is reused by the next replay
        return self._step(padded, cache)[:r]
