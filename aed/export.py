"""torch.export programs of a model: the encoder, and one decoder step with its KV cache.

    encoder, step = export_model(model, max_len=256)     # torch.export.ExportedProgram, each
    torch.export.save(encoder, "encoder.pt2")           # tools/export.py writes both, checked

    cross_kv, memory_lens, *ctc = encoder.module()(feats, feat_lens)
    logits, self_kv = step.module()(tokens, position, self_kv, cross_kv, memory_lens)

encoder: feats (B, T, F) log-mels (aed.audio.LogMel), feat_lens (B,) -> cross_kv (L, 2, B, H, T', d_k),
    the decoder's cross-attention keys and values, projected once per utterance; memory_lens (B,);
    with a CTC head also its log-probs (B, T', V + 1).
step: tokens (R, 1) at position (a () long tensor), self_kv (L, 2, R, H, U_max, d_k) holding
    positions [0, position), cross_kv and memory_lens (R rows of the encoder's) -> fp32 logits (R, V)
    of the next token and self_kv with `position` filled (a new tensor: the cache goes in and comes out).

B, T, R and T' are dynamic; U_max (prompt + output + EOS) is fixed when exporting. The prompt is fed
one token per step (`greedy`): the same causal attention as the eager decoder's prompt chunk.
The programs are traced in eval mode (no dropout; BatchNorm uses its running statistics).
"""

import torch
from torch import nn
from torch.export import Dim, ExportedProgram, export

from aed.model import AED

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
    """`TransformerDecoder.step` and the output layer: the next token's logits and the new cache."""

    def __init__(self, model: AED):
        super().__init__()
        self.model = model

    def forward(self, tokens, position, self_kv, cross_kv, memory_lens):
        decoder = self.model.decoder
        memory_mask = decoder.memory_mask(memory_lens, cross_kv.size(4))  # (R, 1, 1, T')
        hidden, self_kv = decoder.step(tokens, position, self_kv, cross_kv, memory_mask)
        return decoder.output_proj(hidden[:, -1]).float(), self_kv  # (R, V), (L, 2, R, H, U_max, d_k)


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
    return encoder, step


def greedy(encoder, step, feats, feat_lens, prompt: list[int], eos: int, max_len: int) -> list[list[int]]:
    """Argmax decoding with the exported programs' modules (`.module()`): the prompt one token per
    step, then the argmax until EOS or max_len positions -> generated ids per utterance (no EOS)."""
    cross_kv, memory_lens = encoder(feats, feat_lens)[:2]  # (L, 2, B, H, T', d_k), (B,)
    L, _, b, h, _, d_k = cross_kv.shape
    self_kv = torch.zeros(L, 2, b, h, max_len, d_k)
    token, generated = torch.full((b, 1), prompt[0]), []
    finished = torch.zeros(b, 1, dtype=torch.bool)
    for pos in range(max_len - 1):
        logits, self_kv = step(token, torch.tensor(pos), self_kv, cross_kv, memory_lens)
        if pos + 1 < len(prompt):
            token = torch.full((b, 1), prompt[pos + 1])
            continue
        token = logits.argmax(-1, keepdim=True).masked_fill(finished, eos)  # (B, 1); finished rows stay at EOS
        generated.append(token)
        finished |= token == eos
        if finished.all():
            break
    rows = torch.cat(generated, dim=1).tolist() if generated else [[] for _ in range(b)]  # (B, steps)
    return [row[: row.index(eos)] if eos in row else row for row in rows]
