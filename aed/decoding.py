"""Batched greedy and beam search over the KV-cached decoder.

    model.eval()
    options = DecodingOptions(beam_size=4)
    hyps = decode(model, feats, feat_lens, prompt, eos_id, options)
    hyps = search(model, *model.encode(feats, feat_lens), prompt, eos_id, options)  # the same, in two steps

`prompt` (B, P) holds the same-length Canary prompt per utterance (`<|startoftranscript|><|src|><|task|>
<|tgt|><|pnc|>`); the result is, per utterance, the generated ids after the prompt, without EOS.
Both searches run one batched decoder step per token for the whole batch, keep finished rows at EOS,
and look at the device (to stop early) only every SYNC_EVERY steps.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SYNC_EVERY = 8  # steps between "all finished?" checks: each check waits for the device, stalling the GPU queue


@dataclass(frozen=True)
class DecodingOptions:
    beam_size: int = 1  # 1: batched greedy search; >1: vectorised beam search over B x beam_size rows
    length_penalty: float = 0.0  # GNMT alpha: rank by logP / ((5 + len) / 6)^alpha; 0 ranks by logP (Canary's default)
    max_delta: int = 50  # at most encoder frames + max_delta new tokens per utterance (NeMo's max_generation_delta)
    max_new_tokens: int | None = None  # an absolute cap on new tokens per utterance, on top of max_delta


@torch.inference_mode()
def decode(model, feats, feat_lens, prompt, eos_id: int, options: DecodingOptions = DecodingOptions()) -> list[list[int]]:
    """feats (B, T, F), feat_lens (B,), prompt (B, P) long -> B lists of generated ids (no prompt, no EOS)."""
    memory, memory_lens = model.encode(feats, feat_lens)
    return search(model, memory, memory_lens, prompt, eos_id, options)


@torch.inference_mode()
def search(model, memory, memory_lens, prompt, eos_id: int,
           options: DecodingOptions = DecodingOptions()) -> list[list[int]]:
    """`decode` after the encoder: memory (B, T', D) and memory_lens (B,) from model.encode. For callers
    that time or batch the encoder themselves (aed/inference.py)."""
    if options.beam_size == 1:
        return greedy_search(model, memory, memory_lens, prompt, eos_id, options.max_delta, options.max_new_tokens)
    return beam_search(model, memory, memory_lens, prompt, eos_id, options.beam_size, options.length_penalty,
                       options.max_delta, options.max_new_tokens)


def token_budget(model, memory_lens, prompt_len: int, max_delta: int, max_new_tokens: int | None = None):
    """(B,) new tokens each utterance may generate: encoder frames + delta, at most max_new_tokens, and
    prompt + generated must fit the decoder's positions.

    Per utterance (not per batch), so an utterance decodes the same alone and inside a padded batch.
    """
    assert prompt_len < model.cfg.dec_max_len, f"prompt of {prompt_len} tokens leaves no room in {model.cfg.dec_max_len} positions"
    limit = model.cfg.dec_max_len - prompt_len
    return (memory_lens + max_delta).clamp(max=limit if max_new_tokens is None else min(limit, max_new_tokens))


def _check_prompt(prompt, memory):
    assert prompt.dim() == 2 and prompt.size(0) == memory.size(0), (
        f"prompt must be (B, P) with B = {memory.size(0)} (one equal-length prompt per utterance), got {tuple(prompt.shape)}"
    )


def _strip(tokens, eos_id: int) -> list[list[int]]:
    """(R, S) ids, EOS-filled after each hypothesis ends -> lists cut at the first EOS (one host transfer)."""
    out = []
    for row in tokens.tolist():
        out.append(row[: row.index(eos_id)] if eos_id in row else row)
    return out


@torch.inference_mode()
def greedy_search(model, memory, memory_lens, prompt, eos_id: int, max_delta: int = 50,
                  max_new_tokens: int | None = None) -> list[list[int]]:
    """Argmax decoding for the whole batch at once; memory (B, T', D) from model.encode."""
    _check_prompt(prompt, memory)
    b, p = prompt.shape
    limits = token_budget(model, memory_lens, p, max_delta, max_new_tokens)  # (B,)
    steps = int(limits.max())  # the one sync before the loop
    cache = model.new_cache(memory, memory_lens, p + steps)
    logits = model.decode_step(prompt, cache)  # (B, V): the prompt in one chunk
    out = torch.full((b, steps), eos_id, dtype=torch.long, device=memory.device)
    finished = torch.zeros(b, dtype=torch.bool, device=memory.device)
    for i in range(steps):
        token = logits.argmax(dim=-1).masked_fill(finished, eos_id)  # finished rows stay at EOS
        out[:, i] = token
        finished |= (token == eos_id) | (i + 1 >= limits)
        if i + 1 == steps or ((i + 1) % SYNC_EVERY == 0 and bool(finished.all())):
            break
        logits = model.decode_step(token[:, None], cache)
    return _strip(out, eos_id)


def length_penalty(lengths, alpha: float):
    """GNMT length normaliser ((5 + len) / 6)^alpha (Wu et al. 2016), as in NeMo's beam search."""
    return ((5.0 + lengths) / 6.0).pow(alpha)


@torch.inference_mode()
def beam_search(model, memory, memory_lens, prompt, eos_id: int, beam_size: int = 4, alpha: float = 0.0,
                max_delta: int = 50, max_new_tokens: int | None = None) -> list[list[int]]:
    """Beam search vectorised over R = B * K rows (K = beam_size); returns the best hypothesis per utterance.

    Each step: one log-softmax, one topk over the K*V candidates of each utterance, one cache reorder.
    Finished hypotheses stay in the beam and may only extend with EOS at no cost, so they compete with
    live ones on the same (length-normalised) score. Row b*K + j is beam j of utterance b.
    """
    _check_prompt(prompt, memory)
    (b, p), k = prompt.shape, beam_size
    device = memory.device
    limits = token_budget(model, memory_lens, p, max_delta, max_new_tokens).repeat_interleave(k)  # (R,)
    steps = int(limits.max())
    cache = model.new_cache(memory, memory_lens, p + steps)
    logits = model.decode_step(prompt, cache)  # (B, V): the prompt runs once per utterance, not once per beam
    cache = cache.repeat_interleave(k)
    logp = F.log_softmax(logits, dim=-1).repeat_interleave(k, dim=0)  # (R, V)
    v = logp.size(1)
    assert k <= v, f"beam_size {k} exceeds the vocabulary {v}"

    # Only beam 0 is alive at first: otherwise the K identical starting beams would fill the beam with copies.
    scores = torch.full((b, k), float("-inf"), device=device)
    scores[:, 0] = 0.0
    scores = scores.flatten()  # (R,) summed log-probabilities
    lengths = torch.zeros(b * k, dtype=torch.long, device=device)  # generated tokens, EOS included
    finished = torch.zeros(b * k, dtype=torch.bool, device=device)
    eos_only = torch.full((v,), float("-inf"), device=device)
    eos_only[eos_id] = 0.0  # the one continuation of a finished hypothesis
    row0 = torch.arange(b, device=device)[:, None] * k  # (B, 1) first row of each utterance
    tokens = torch.full((b * k, steps), eos_id, dtype=torch.long, device=device)
    for i in range(steps):
        logp = torch.where(finished[:, None], eos_only, logp)
        cand = scores[:, None] + logp  # (R, V)
        cand_len = lengths + (~finished).long()
        ranked = cand / length_penalty(cand_len, alpha)[:, None].to(cand.dtype)
        _, idx = ranked.view(b, k * v).topk(k, dim=-1)  # (B, K) among each utterance's K*V candidates
        origin = (row0 + idx // v).flatten()  # (R,) the row each survivor extends
        token = (idx % v).flatten()
        scores = cand.view(b, k * v).gather(1, idx).flatten()
        lengths = cand_len[origin]
        tokens[:, :i] = tokens[origin, :i]
        tokens[:, i] = token
        finished = finished[origin] | (token == eos_id) | (lengths >= limits)
        if i + 1 == steps or ((i + 1) % SYNC_EVERY == 0 and bool(finished.all())):
            break
        cache.reorder(origin)
        logp = F.log_softmax(model.decode_step(token[:, None], cache), dim=-1)

    best = (scores / length_penalty(lengths, alpha).to(scores.dtype)).view(b, k).argmax(dim=-1) + row0[:, 0]  # (B,)
    return _strip(tokens[best], eos_id)
