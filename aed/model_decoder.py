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
from torch.utils.checkpoint import checkpoint


class KVCache:
    """Decoding state of R rows (utterances, or utterances x beams), in gpt-fast's manner: preallocated
    buffers that every step writes at its positions, read by one decoder forward
    (`TransformerDecoder.forward_cached`) for the prompt chunk and for each later token. Eager,
    compiled (aed/model_static.py `CompiledAED`) and exported (`StepProgram`) decoding all use it.

    keys, values: L tensors (R, H, U_max, d_k) each, the self-attention keys and values of each layer.
        Separate tensors, or views of one (L, 2, R, H, U_max, d_k) tensor where nothing compiles them:
        torch.compile writes a whole input tensor in place, while its writes into views of one stacked
        input became a copy of that input at every step.
    cross_kv: (L, 2, R, H, T', d_k) cross-attention keys and values, projected once from the encoder
        output (NeMo re-projects them at every step: about 2/3 of its decode time).
    memory_mask: (R, 1, 1, T') True at valid encoder frames (SDPA's boolean mask convention).
    length: positions written so far, so the next one to write (gpt-fast's `input_pos`). Its type
        picks how attention reads the buffers:
        - a Python int (eager decoding, `TransformerDecoder.new_cache`): attention reads the filled
          prefix only, unmasked, so shapes grow by a position per step; the loop never syncs with the device.
        - a () long tensor on the device (compiled and exported steps): attention reads all U_max
          positions, masked to those written, so no shape and no Python value changes from one step
          to the next: the step compiles whole (fullgraph), a CUDA graph replays it on the same
          buffers, and torch.export takes the position as an input.
        - an (R,) long tensor: the same, each row at its own position (streams whose committed
          prefixes differ in length, decoded as one batch: aed/decode_stream.py).
    R and T' may be padded past the real rows and frames (a padded frame is False in memory_mask).

    A decoder step calls `update` once per layer with the new positions' keys and values, then
    `advance` once: every layer of a step writes at the same positions.
    """

    def __init__(self, keys: list, values: list, cross_kv, memory_mask, length: "int | torch.Tensor" = 0):
        self.keys, self.values, self.cross_kv, self.memory_mask, self.length = keys, values, cross_kv, memory_mask, length

    @property
    def static(self) -> bool:
        """True where the position is a device tensor: fixed shapes (see the class docstring)."""
        return isinstance(self.length, torch.Tensor)

    @property
    def length_per_row(self) -> bool:
        return self.static and self.length.dim() == 1

    @property
    def rows(self) -> int:
        return self.keys[0].size(0)

    @property
    def max_len(self) -> int:
        return self.keys[0].size(2)

    def cross(self, layer: int):
        """Cross-attention keys, values of `layer`: (R, H, T', d_k) each."""
        return self.cross_kv[layer, 0], self.cross_kv[layer, 1]

    def positions(self, u: int):
        """The next u positions: a slice (Python-int length), or a (U,) long tensor, or (R, U) for
        per-row lengths. The tensor is not bound-checked (that would read the device): the search sizes
        the cache, and indexing rejects a position past U_max."""
        if self.static:
            return self.length[..., None] + torch.arange(u, device=self.length.device)
        assert self.length + u <= self.max_len, f"cache holds {self.max_len} positions, need {self.length + u}"
        return slice(self.length, self.length + u)

    def update(self, layer: int, k, v):
        """Write `layer`'s keys and values (R, H, U, d_k) at the next U positions and return what its
        attention reads: keys and values of positions [0, length + U) (R, H, length + U, d_k) each, or
        the whole buffers (R, H, U_max, d_k), to be read through `self_attn_mask`."""
        index = self.positions(k.size(2))
        if self.length_per_row:  # buffer[r, :, index[r, u]] = k[r, :, u]: the indexed dims lead, (R, U, H, d_k)
            rows = torch.arange(self.rows, device=index.device)[:, None]
            self.keys[layer][rows, :, index] = k.transpose(1, 2)
            self.values[layer][rows, :, index] = v.transpose(1, 2)
        else:  # indexed assignment, as gpt-fast writes its cache: a slice or index_put_
            self.keys[layer][:, :, index] = k
            self.values[layer][:, :, index] = v
        if self.static:
            return self.keys[layer], self.values[layer]
        return self.keys[layer][:, :, : index.stop], self.values[layer][:, :, : index.stop]

    def self_attn_mask(self, u: int):
        """What the next u positions may see: None where `update` returns only the filled positions (a
        single token sees all of them, a prompt chunk, which starts at 0, needs just the causal mask);
        else (1, 1, U, U_max), True up to position length + j for the new position j (causal in a chunk),
        or (R, 1, U, U_max) for per-row lengths."""
        if not self.static:
            return None
        filled = torch.arange(self.max_len, device=self.length.device) <= self.positions(u)[..., None]  # ([R,] U, U_max)
        return filled[:, None] if self.length_per_row else filled[None, None]

    def advance(self, n: int) -> None:
        """Commit the n positions every layer has just written with `update`."""
        if self.static:
            self.length.add_(n)  # in place: a compiled step mutates this buffer, never rebinds the attribute
            return
        assert self.length + n <= self.max_len, f"cache holds {self.max_len} positions, need {self.length + n}"
        self.length += n

    def reorder(self, index) -> None:
        """Row r takes the self-attention history of row index[r] (beam search survivors), for the first
        index.numel() rows; rows past those (the padding of a compiled shape bucket) keep their own.

        `index` must map each row to a row of the same utterance: the cross-attention K/V, identical
        across an utterance's beams, are left untouched.
        """
        if index.numel() < self.rows:
            index = torch.cat([index, torch.arange(index.numel(), self.rows, device=index.device)])  # (R,)
        for buffer in self.keys + self.values:
            filled = buffer if self.static else buffer[:, :, : self.length]  # eager: only the filled prefix
            filled.copy_(filled.index_select(0, index))


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

    def forward(self, x, k, v, attn_mask=None, is_causal=False, weights: list | None = None):
        """With a `weights` list (cross-attention in training, for a loss on where it looks), the
        attention weights (B, H, U, S) are computed in the open and appended to it; else SDPA's kernel."""
        q = self._heads(self.query_net(x))
        dropout = self.dropout_att if self.training else 0.0
        if weights is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout)
        else:
            scores = (q @ k.transpose(-2, -1)) * self.d_k**-0.5  # (B, H, U, S)
            w = scores.masked_fill(~attn_mask, float("-inf")).softmax(-1)
            weights.append(w)
            out = F.dropout(w, dropout, self.training) @ v
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

    def forward(self, x, cross_k, cross_v, memory_mask, cache: KVCache | None = None, layer: int = 0,
                memory=None, weights: list | None = None):
        """x (B, U, D) -> (B, U, D). With a cache, x holds the positions after the cached ones and this
        block's self-attention keys/values go to the cache as `layer`. With `memory` (B, T', D) instead
        of cross_k and cross_v, they are projected here: inside the block's own forward, where FSDP
        has gathered its weights (training). A `weights` list receives the cross-attention's weights."""
        if memory is not None:
            cross_k, cross_v = self.cross_attn.project_kv(memory)
        u = x.size(1)
        h = self.norm_self_attn(x)
        k, v = self.self_attn.project_kv(h)
        mask = None
        if cache is not None:
            k, v = cache.update(layer, k, v)
            mask = cache.self_attn_mask(u)
        # Unmasked: causal where queries and keys are the same positions (no cache, or a prompt chunk into an
        # empty one); a single query after the cached keys attends to all of them. Decided without reading
        # u in training, where torch.compile keeps it symbolic and SDPA takes no symbolic is_causal.
        causal = mask is None and (cache is None or u > 1)
        x = x + self.dropout(self.self_attn(h, k, v, attn_mask=mask, is_causal=causal))
        return self._cross_attn_and_ffn(x, cross_k, cross_v, memory_mask, weights)

    def _cross_attn_and_ffn(self, x, cross_k, cross_v, memory_mask, weights=None):
        h = self.norm_cross_attn(x)
        x = x + self.dropout(self.cross_attn(h, cross_k, cross_v, attn_mask=memory_mask, weights=weights))
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

    def forward(self, tokens, positions=None):
        """tokens (B, U) at `positions` (KVCache.positions: a slice, a (U,) or a per-row (B, U) long tensor),
        or None for 0..U-1."""
        u = tokens.size(1)
        assert u <= self.pos_enc.size(0), f"{u} positions exceed decoder max length {self.pos_enc.size(0)}"
        x = self.token_embedding(tokens)  # (B, U, D)
        # The buffer stays fp32 where FSDP's bf16 policy casts only the parameters: add it in x's dtype.
        x = x + self.pos_enc[slice(0, u) if positions is None else positions].to(x.dtype)
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
        # Set by train.py (activation_checkpointing): recompute each block in backward instead of storing
        # its activations, the B x H x U x T' cross-attention among them.
        self.checkpoint_activations = False

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

    def forward(self, tokens, memory, memory_lens, weights: list | None = None):
        """Teacher-forced pass (training): tokens (B, U), memory (B, T', D), memory_lens (B,) -> (B, U, D).

        Returns hidden states after the final LayerNorm; apply `output_proj` for logits. A `weights`
        list receives every layer's cross-attention weights (B, H, U, T'), in layer order.
        """
        assert tokens.dim() == 2 and tokens.size(0) == memory.size(0), (
            f"tokens {tuple(tokens.shape)} and memory {tuple(memory.shape)} disagree on the batch size"
        )
        memory_mask = self.memory_mask(memory_lens, memory.size(1))
        x = self.embedding(tokens)
        recompute = self.checkpoint_activations and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:  # a recomputed block appends its weights again in backward: unused, dropped with the list
                x = checkpoint(layer, x, None, None, memory_mask, memory=memory, weights=weights, use_reentrant=False)
            else:
                x = layer(x, None, None, memory_mask, memory=memory, weights=weights)
        return self.final_layer_norm(x)

    def forward_cached(self, tokens, cache: KVCache):
        """Continue the cached positions: a prompt chunk into an empty cache, then one token per step
        (or, on a cache with a tensor position, any chunk after it). The one decoding forward: eager,
        compiled and exported steps all run it.

        tokens (R, U) -> hidden states (R, U, D); the cache advances by U positions.
        """
        u = tokens.size(1)
        if not cache.static:  # an unmasked chunk is causal from position 0 only; a tensor position is not read
            assert cache.length == 0 or u == 1, f"after the prompt, feed one token per step (got {u} at {cache.length})"
        x = self.embedding(tokens, cache.positions(u))
        for i, layer in enumerate(self.layers):
            x = layer(x, *cache.cross(i), cache.memory_mask, cache, i)
        cache.advance(u)
        return self.final_layer_norm(x)

    @staticmethod
    def memory_mask(memory_lens, max_len):
        return (torch.arange(max_len, device=memory_lens.device)[None, :] < memory_lens[:, None])[:, None, None, :]  # (B, 1, 1, T')

    def cross_kv(self, memory):
        """Every layer's cross-attention keys and values of memory (B, T', D): (L, 2, B, H, T', d_k)."""
        return torch.stack([torch.stack(layer.cross_attn.project_kv(memory)) for layer in self.layers])

    def new_cache(self, memory, memory_lens, max_len: int, rows_per_utterance: int = 1) -> KVCache:
        """An empty eager cache (Python-int length): self-attention buffers for `max_len` positions and
        the projected cross-attention K/V, for rows_per_utterance adjacent rows per utterance (beams):
        R = B * rows_per_utterance."""
        b, t, _ = memory.shape
        shape = (b * rows_per_utterance, self.n_heads, max_len, self.d_model // self.n_heads)  # (R, H, U_max, d_k)
        keys, values = ([memory.new_zeros(shape) for _ in self.layers] for _ in range(2))
        cross_kv = self.cross_kv(memory).repeat_interleave(rows_per_utterance, dim=2)  # projected once per utterance
        memory_mask = self.memory_mask(memory_lens, t).repeat_interleave(rows_per_utterance, dim=0)
        return KVCache(keys, values, cross_kv, memory_mask)
