"""Pre-LN Transformer decoder with an explicit KV cache (NeMo's `TransformerDecoderNM` + `TokenClassifier`).

NeMo state_dict names -> ours (the converter renames only these):
    transf_decoder._embedding.position_embedding.pos_enc -> decoder.embedding.pos_enc
    transf_decoder._embedding.*                 -> decoder.embedding.*  (token_embedding, layer_norm)
    transf_decoder._decoder.layers.N.layer_norm_1 / first_sub_layer   -> decoder.layers.N.norm_self_attn / self_attn
    transf_decoder._decoder.layers.N.layer_norm_2 / second_sub_layer  -> decoder.layers.N.norm_cross_attn / cross_attn
    transf_decoder._decoder.layers.N.layer_norm_3 / third_sub_layer   -> decoder.layers.N.norm_ffn / ffn
    transf_decoder._decoder.final_layer_norm    -> decoder.final_layer_norm
    log_softmax.mlp.layer0.{weight,bias}        -> decoder.output_proj.{weight,bias} (weight tied to the embedding)
Inside attention and FFN the names are NeMo's (query_net, key_net, value_net, out_projection, dense_in, dense_out).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class KVCache:
    """Decoding state for a batch of R rows (utterances, or utterances x beams), in preallocated buffers.

    self_kv:  (L, 2, R, H, U_max, d_k) self-attention keys and values; positions [0, length) are filled.
    cross_kv: (L, 2, R, H, T', d_k) cross-attention keys and values, projected once from the encoder output
              (NeMo re-projects them at every step: about 2/3 of its decode time).
    memory_mask: (R, 1, 1, T') True at valid encoder frames (SDPA's boolean mask convention).
    length: positions written so far; a Python int shared by all rows, so the loop never syncs with the device.

    A decoder step calls `update` once per layer with the new positions' keys and values, then
    `advance` once: every layer of a step writes at the same positions.
    """

    def __init__(self, self_kv, cross_kv, memory_mask, length: int = 0):
        self.self_kv, self.cross_kv, self.memory_mask = self_kv, cross_kv, memory_mask
        self.length = length

    @property
    def max_len(self) -> int:
        return self.self_kv.size(4)

    def cross(self, layer: int):
        """Cross-attention keys, values of `layer`: (R, H, T', d_k) each."""
        return self.cross_kv[layer, 0], self.cross_kv[layer, 1]

    def update(self, layer: int, k, v):
        """Write `layer`'s keys and values (R, H, U, d_k) of positions [length, length + U) and return
        its keys and values of positions [0, length + U): (R, H, length + U, d_k) each."""
        end = self.length + k.size(2)
        assert end <= self.max_len, f"cache holds {self.max_len} positions, need {end}"
        self.self_kv[layer, 0, :, :, self.length : end] = k
        self.self_kv[layer, 1, :, :, self.length : end] = v
        return self.self_kv[layer, 0, :, :, :end], self.self_kv[layer, 1, :, :, :end]

    def advance(self, n: int) -> None:
        """Commit the n positions every layer has just written with `update`."""
        assert self.length + n <= self.max_len, f"cache holds {self.max_len} positions, need {self.length + n}"
        self.length += n

    def repeat_interleave(self, repeats: int) -> "KVCache":
        """A new cache with each row repeated `repeats` times, copies adjacent (B -> B*repeats rows): starts a beam search."""
        return KVCache(
            self.self_kv.repeat_interleave(repeats, dim=2),
            self.cross_kv.repeat_interleave(repeats, dim=2),
            self.memory_mask.repeat_interleave(repeats, dim=0),
            self.length,
        )

    def reorder(self, index) -> None:
        """Row r takes the self-attention history of row index[r] (beam search survivors).

        `index` must map each row to a row of the same utterance: the cross-attention K/V, identical
        across an utterance's beams, are left untouched.
        """
        filled = self.self_kv[:, :, :, :, : self.length]
        filled.copy_(filled.index_select(2, index))  # only the filled prefix, not the whole buffer


class DecoderAttention(nn.Module):
    """NeMo's transformer `MultiHeadAttention`: q/k/v/out projections with bias, scaled dot product."""

    def __init__(self, d_model: int, n_heads: int, dropout_att: float):
        super().__init__()
        assert d_model % n_heads == 0, f"decoder d_model {d_model} not divisible by n_heads {n_heads}"
        self.h, self.d_k = n_heads, d_model // n_heads
        self.query_net = nn.Linear(d_model, d_model)
        self.key_net = nn.Linear(d_model, d_model)
        self.value_net = nn.Linear(d_model, d_model)
        self.out_projection = nn.Linear(d_model, d_model)
        self.dropout_att = dropout_att

    def _heads(self, x):
        return x.view(x.size(0), -1, self.h, self.d_k).transpose(1, 2)  # (B, U, D) -> (B, H, U, d_k)

    def project_kv(self, x):
        """(B, S, D) -> keys, values (B, H, S, d_k)."""
        return self._heads(self.key_net(x)), self._heads(self.value_net(x))

    def forward(self, x, k, v, attn_mask=None, is_causal=False):
        q = self._heads(self.query_net(x))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=self.dropout_att if self.training else 0.0
        )
        return self.out_projection(out.transpose(1, 2).reshape(x.shape))  # (B, H, U, d_k) -> (B, U, D)


class PositionWiseFF(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.dense_in = nn.Linear(d_model, d_ff)
        self.dense_out = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.dense_out(F.relu(self.dense_in(x)))


class DecoderBlock(nn.Module):
    """x += SelfAttn(LN(x)); x += CrossAttn(LN(x), memory); x += FFN(LN(x))."""

    def __init__(self, d_model, n_heads, ff_mult, dropout, dropout_att):
        super().__init__()
        self.norm_self_attn = nn.LayerNorm(d_model)
        self.self_attn = DecoderAttention(d_model, n_heads, dropout_att)
        self.norm_cross_attn = nn.LayerNorm(d_model)
        self.cross_attn = DecoderAttention(d_model, n_heads, dropout_att)
        self.norm_ffn = nn.LayerNorm(d_model)
        self.ffn = PositionWiseFF(d_model, ff_mult * d_model)
        self.dropout = nn.Dropout(dropout)  # NeMo: attn_layer_dropout and ffn_dropout, on each sublayer output

    def forward(self, x, cross_k, cross_v, memory_mask, cache: KVCache | None = None, layer: int = 0, memory=None):
        """x (B, U, D) -> (B, U, D). With a cache, x holds the positions after the cached ones and this
        block's self-attention keys/values go to the cache as `layer`. With `memory` (B, T', D) instead
        of cross_k and cross_v, they are projected here: inside the block's own forward, where FSDP
        has gathered its weights (training)."""
        if memory is not None:
            cross_k, cross_v = self.cross_attn.project_kv(memory)
        u = x.size(1)
        h = self.norm_self_attn(x)
        k, v = self.self_attn.project_kv(h)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        # A single new token may see every cached position; a chunk starting at 0 needs the causal mask.
        x = x + self.dropout(self.self_attn(h, k, v, is_causal=u > 1))
        return self._cross_attn_and_ffn(x, cross_k, cross_v, memory_mask)

    def step(self, x, keys, values, position, visible, cross_k, cross_v, memory_mask):
        """`forward` of one token with a cache, as a pure function (`TransformerDecoder.step`).
        x (R, 1, D); keys, values (R, H, U_max, d_k) of the earlier positions; position () long;
        visible (1, 1, 1, U_max) True up to position -> x (R, 1, D), keys and values with `position` written."""
        h = self.norm_self_attn(x)
        k, v = self.self_attn.project_kv(h)  # (R, H, 1, d_k)
        keys, values = keys.index_copy(2, position.view(1), k), values.index_copy(2, position.view(1), v)
        x = x + self.dropout(self.self_attn(h, keys, values, attn_mask=visible))
        return self._cross_attn_and_ffn(x, cross_k, cross_v, memory_mask), keys, values

    def _cross_attn_and_ffn(self, x, cross_k, cross_v, memory_mask):
        h = self.norm_cross_attn(x)
        x = x + self.dropout(self.cross_attn(h, cross_k, cross_v, attn_mask=memory_mask))
        return x + self.dropout(self.ffn(self.norm_ffn(x)))


def sinusoidal_positions(max_len: int, d_model: int):
    """NeMo's `FixedPositionalEncoding`: sin on even, cos on odd channels, divided by sqrt(D): (max_len, D)."""
    positions = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    angles = positions[:, None] * freqs[None, :]  # (max_len, D/2)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1) / math.sqrt(d_model)


class TransformerEmbedding(nn.Module):
    """Token embedding (no sqrt(D) scaling) + fixed positions, LayerNorm, dropout."""

    def __init__(self, vocab_size, d_model, max_len, pad_id, dropout):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        # Persistent although fixed: a model built on the meta device gets it back from load_state_dict.
        self.register_buffer("pos_enc", sinusoidal_positions(max_len, d_model))
        self.layer_norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens, offset=0):
        u = tokens.size(1)
        assert offset + u <= self.pos_enc.size(0), f"positions up to {offset + u} exceed decoder max length {self.pos_enc.size(0)}"
        return self._finish(self.token_embedding(tokens) + self.pos_enc[offset : offset + u])  # (B, U, D)

    def at(self, tokens, position):
        """tokens (R, 1) at `position`, a () long tensor (an input of an exported step, not a constant)."""
        return self._finish(self.token_embedding(tokens) + self.pos_enc.index_select(0, position.view(1)))

    def _finish(self, x):
        return self.dropout(self.layer_norm(x))


class TransformerDecoder(nn.Module):
    def __init__(self, vocab_size, pad_id, d_model, n_layers, n_heads, ff_mult, max_len, dropout, dropout_att):
        super().__init__()
        self.n_heads, self.d_model = n_heads, d_model
        self.embedding = TransformerEmbedding(vocab_size, d_model, max_len, pad_id, dropout)
        self.layers = nn.ModuleList(DecoderBlock(d_model, n_heads, ff_mult, dropout, dropout_att) for _ in range(n_layers))
        self.final_layer_norm = nn.LayerNorm(d_model)
        self.output_proj = nn.Linear(d_model, vocab_size)
        self.apply(self._init_weights)
        self.output_proj.weight = self.embedding.token_embedding.weight  # tied, with its own bias (as in Canary)

    @staticmethod
    def _init_weights(module):
        # NeMo's transformer_weights_init (use_transformer_init: true): N(0, 0.02) weights, zero biases.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()

    def forward(self, tokens, memory, memory_lens):
        """Teacher-forced pass (training): tokens (B, U), memory (B, T', D), memory_lens (B,) -> (B, U, D).

        Returns hidden states after the final LayerNorm; apply `output_proj` for logits.
        """
        assert tokens.dim() == 2 and tokens.size(0) == memory.size(0), (
            f"tokens {tuple(tokens.shape)} and memory {tuple(memory.shape)} disagree on the batch size"
        )
        memory_mask = self.memory_mask(memory_lens, memory.size(1))
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x, None, None, memory_mask, memory=memory)
        return self.final_layer_norm(x)

    def forward_cached(self, tokens, cache: KVCache):
        """Continue the cached positions: a prompt chunk into an empty cache, then one token per step.

        tokens (R, U) -> hidden states (R, U, D); the cache advances by U positions.
        """
        offset, u = cache.length, tokens.size(1)
        assert offset == 0 or u == 1, f"after the prompt, feed one token per step (got {u} at position {offset})"
        x = self.embedding(tokens, offset)
        for i, layer in enumerate(self.layers):
            x = layer(x, *cache.cross(i), cache.memory_mask, cache, i)
        cache.advance(u)
        return self.final_layer_norm(x)

    def step(self, tokens, position, self_kv, cross_kv, memory_mask):
        """One cached decoding step as a pure function of its inputs, for torch.export: the cache goes
        in and the updated cache comes out (no in-place writes, no Python-int position), and the
        self-attention reads the whole U_max buffer with positions after `position` masked out.
        `forward_cached` (used by search) is the same computation on a KVCache; the two agree to
        float rounding (tests/test_export.py).

        tokens (R, 1), the token at position (a () long tensor); self_kv (L, 2, R, H, U_max, d_k)
        holding positions [0, position); cross_kv (L, 2, R, H, T', d_k) and memory_mask (R, 1, 1, T')
        as in `new_cache` -> hidden states (R, 1, D) and self_kv with `position` filled.
        """
        x = self.embedding.at(tokens, position)
        visible = (torch.arange(self_kv.size(4), device=tokens.device) <= position)[None, None, None]  # (1, 1, 1, U_max)
        layers_kv = []
        for i, layer in enumerate(self.layers):
            x, k, v = layer.step(x, self_kv[i, 0], self_kv[i, 1], position, visible, cross_kv[i, 0], cross_kv[i, 1],
                                 memory_mask)
            layers_kv.append(torch.stack([k, v]))  # (2, R, H, U_max, d_k)
        return self.final_layer_norm(x), torch.stack(layers_kv)  # (R, 1, D), (L, 2, R, H, U_max, d_k)

    @staticmethod
    def memory_mask(memory_lens, max_len):
        return (torch.arange(max_len, device=memory_lens.device)[None, :] < memory_lens[:, None])[:, None, None, :]  # (B, 1, 1, T')

    def new_cache(self, memory, memory_lens, max_len: int) -> KVCache:
        """Empty self-attention buffers for `max_len` positions and the projected cross-attention K/V."""
        b, t, _ = memory.shape
        d_k = self.d_model // self.n_heads
        self_kv = memory.new_zeros(len(self.layers), 2, b, self.n_heads, max_len, d_k)
        cross_kv = torch.stack([torch.stack(layer.cross_attn.project_kv(memory)) for layer in self.layers])  # (L, 2, B, H, T', d_k)
        return KVCache(self_kv, cross_kv, self.memory_mask(memory_lens, t))
