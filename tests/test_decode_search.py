import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from aed.decode_search import (DecodingOptions, beam_search, decode_features, ends_in_repeats, greedy_search, length_penalty,
                               no_speech_probs, search, token_budget)
from aed.model import AED, AEDConfig
from aed.model_decoder import KVCache

V = 40
PLAIN = dict(ctc_weight=0.0, max_repeats=0, max_tokens_per_second=None)  # the attention decoder alone, no guards


def random_model(seed=0, **overrides):
    """A float64 model whose random decoder produces varied sequences (not one token repeated).

    float64 keeps cached and recomputed scores equal to ~1e-12, so rankings never flip on rounding.
    """
    torch.manual_seed(seed)
    d = dict(n_mels=24, vocab_size=V, pad_id=1, enc_d_model=32, enc_layers=2, enc_heads=4, subsampling_channels=8,
             dec_d_model=48, dec_layers=2, dec_heads=4, dec_max_len=64)
    d.update(overrides)
    model = AED(AEDConfig(**d)).double().eval()
    with torch.no_grad():
        for p in model.decoder.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)  # N(0, 0.02) init makes a random decoder repeat its first token forever
        model.decoder.embedding.pos_enc.mul_(10)  # let the position change the prediction
    return model


def batch(lens=(120, 70, 33, 95), seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(len(lens), max(lens), 24, generator=g, dtype=torch.float64)
    lens = torch.tensor(lens)
    feats = feats.masked_fill(torch.arange(feats.size(1))[None, :, None] >= lens[:, None, None], 0.0)
    prompt = torch.randint(3, V - 1, (len(lens), 3), generator=g)
    return feats, lens, prompt


def pick_eos(model, memory, memory_lens, prompt):
    """A token that greedy decoding emits first at different steps in different rows: EOS at varied lengths."""
    with torch.no_grad():
        model.decoder.output_proj.bias[V - 1] = -1e9  # V-1 is never emitted: free-running sequences
    free = greedy_search(model, memory, memory_lens, prompt, V - 1, DecodingOptions(max_delta=10, **PLAIN))
    best, best_spread = None, 0
    for tok in range(V - 1):
        firsts = {row.index(tok) if tok in row else len(row) for row in free}
        if len(firsts) > best_spread:
            best, best_spread = tok, len(firsts)
    assert best_spread >= 3, f"random model too degenerate to test early stopping: {free}"
    return best


def recompute_logits(model, tokens, memory, memory_lens):
    """Reference without a cache: the full teacher-forced decoder over all tokens, last position."""
    return model.decoder.output_proj(model.decoder(tokens, memory, memory_lens)[:, -1]).float()


def test_cached_decoding_equals_full_recomputation_at_every_step():
    model = random_model()
    feats, lens, prompt = batch()
    memory, memory_lens = model.encode(feats, lens)
    tokens = torch.cat([prompt, torch.randint(2, V, (4, 12))], dim=1)
    cache = model.new_cache(memory, memory_lens, tokens.size(1))
    with torch.no_grad():
        got = model.decode_step(tokens[:, :3], cache)
        torch.testing.assert_close(got, recompute_logits(model, tokens[:, :3], memory, memory_lens), atol=1e-9, rtol=0)
        for i in range(3, tokens.size(1)):
            got = model.decode_step(tokens[:, i : i + 1], cache)
            ref = recompute_logits(model, tokens[:, : i + 1], memory, memory_lens)
            torch.testing.assert_close(got, ref, atol=1e-9, rtol=0, msg=f"step {i}")
    assert cache.length == tokens.size(1)


def test_kv_cache_update_writes_at_the_position_and_advance_commits_it():
    layers, rows, heads, max_len, d_k = 2, 3, 2, 5, 4
    keys, values = ([torch.zeros(rows, heads, max_len, d_k) for _ in range(layers)] for _ in range(2))
    cache = KVCache(keys, values, torch.randn(layers, 2, rows, heads, 7, d_k), torch.ones(rows, 1, 1, 7, dtype=torch.bool))
    prompt_k, prompt_v = torch.randn(rows, heads, 2, d_k), torch.randn(rows, heads, 2, d_k)
    k, v = cache.update(0, prompt_k, prompt_v)  # a Python-int length: the filled prefix comes back, no mask
    assert torch.equal(k, prompt_k) and torch.equal(v, prompt_v) and cache.length == 0 and cache.self_attn_mask(2) is None
    assert keys[1].abs().sum() == 0 and values[1].abs().sum() == 0, "a layer's update writes only that layer"
    cache.update(1, -prompt_k, -prompt_v)
    cache.advance(2)
    step_k, step_v = torch.randn(rows, heads, 1, d_k), torch.randn(rows, heads, 1, d_k)
    k, v = cache.update(0, step_k, step_v)
    assert torch.equal(k, torch.cat([prompt_k, step_k], dim=2)) and torch.equal(v, torch.cat([prompt_v, step_v], dim=2))
    again_k, _ = cache.update(0, 2 * step_k, step_v)  # not advanced yet: the same position is rewritten
    assert torch.equal(again_k[:, :, 2], 2 * step_k[:, :, 0])
    cache.advance(1)
    assert cache.length == 3
    assert [t.shape for t in cache.cross(1)] == [(rows, heads, 7, d_k)] * 2
    with pytest.raises(AssertionError, match="cache holds 5 positions, need 6"):
        cache.update(0, torch.randn(rows, heads, 3, d_k), torch.randn(rows, heads, 3, d_k))
    with pytest.raises(AssertionError, match="cache holds 5 positions, need 6"):
        cache.advance(3)


def test_cache_reorder_moves_histories_within_an_utterance():
    model = random_model()
    feats, lens, prompt = batch(lens=(50, 80))
    memory, memory_lens = model.encode(feats, lens)
    cache = model.new_cache(memory, memory_lens, 8, rows_per_utterance=2)  # rows: u0b0, u0b1, u1b0, u1b1
    assert torch.equal(cache.cross_kv[:, :, 2], cache.cross_kv[:, :, 3]) and torch.equal(*cache.memory_mask[:2])
    hist = torch.cat([prompt.repeat_interleave(2, dim=0), torch.tensor([[5, 6], [7, 8], [9, 10], [11, 12]])], dim=1)
    with torch.no_grad():
        model.decode_step(hist[:, :3], cache)
        model.decode_step(hist[:, 3:4], cache)
        model.decode_step(hist[:, 4:5], cache)
        index = torch.tensor([1, 1, 3, 2])
        cache.reorder(index)
        nxt = torch.tensor([[13], [14], [15], [16]])
        got = model.decode_step(nxt, cache)
        ref = recompute_logits(model, torch.cat([hist[index], nxt], dim=1), memory.repeat_interleave(2, 0), memory_lens.repeat_interleave(2))
    torch.testing.assert_close(got, ref, atol=1e-9, rtol=0)


def test_batched_greedy_equals_each_utterance_alone():
    model = random_model()
    feats, lens, prompt = batch()
    memory, memory_lens = model.encode(feats, lens)
    eos = pick_eos(model, memory, memory_lens, prompt)
    options = DecodingOptions(**PLAIN)  # this random decoder repeats itself: no guards
    hyps = decode_features(model, feats, lens, prompt, eos, options)[0]
    assert len({len(h) for h in hyps}) >= 3, f"rows should stop at different steps: {hyps}"
    assert all(eos not in h for h in hyps)
    for i in range(len(lens)):
        alone = decode_features(model, feats[i : i + 1, : lens[i]], lens[i : i + 1], prompt[i : i + 1], eos, options)[0]
        assert alone == [hyps[i]], f"utterance {i} decodes differently inside the padded batch"


@pytest.mark.parametrize("beam_size", [1, 3])
def test_search_after_the_encoder_equals_decode_features(beam_size):
    model = random_model()
    feats, lens, prompt = batch()
    memory, memory_lens = model.encode(feats, lens)
    eos = pick_eos(model, memory, memory_lens, prompt)
    options = DecodingOptions(beam_size=beam_size, max_delta=6)
    hyps = decode_features(model, feats, lens, prompt, eos, options)[0]
    assert search(model, memory, memory_lens, prompt, eos, options) == hyps


@pytest.mark.parametrize("per_second", [None, 0.0, 25.0])  # None or 0: no bound
def test_generation_budget_is_encoder_frames_plus_delta_capped_by_positions_and_rate(per_second):
    model = random_model(dec_max_len=40)
    feats, lens, prompt = batch(lens=(300, 60, 16))
    with torch.no_grad():
        model.decoder.output_proj.bias[V - 1] = -1e9  # EOS never wins: every row runs to its budget
    memory, memory_lens = model.encode(feats, lens)
    options = DecodingOptions(max_delta=5, max_repeats=0, max_tokens_per_second=per_second)
    limits = token_budget(model, memory_lens, prompt.size(1), options)
    rate = [int(t) * 2 if per_second else 10**9 for t in memory_lens]  # 25 tokens/s x 0.08 s per frame
    assert limits.tolist() == [min(int(t) + 5, 40 - 3, r) for t, r in zip(memory_lens, rate)]
    for beam_size in (1, 3):
        hyps = decode_features(model, feats, lens, prompt, V - 1, dataclasses.replace(options, beam_size=beam_size))[0]
        assert [len(h) for h in hyps] == limits.tolist()


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_size_one_equals_greedy(alpha):
    model = random_model(seed=1)
    feats, lens, prompt = batch(seed=1)
    memory, memory_lens = model.encode(feats, lens)
    eos = pick_eos(model, memory, memory_lens, prompt)
    greedy = greedy_search(model, memory, memory_lens, prompt, eos)
    assert beam_search(model, memory, memory_lens, prompt, eos, DecodingOptions(length_penalty=alpha)) == greedy


def log_add(*xs):
    m = max(xs)
    return m if m == -math.inf else m + math.log(sum(math.exp(x - m) for x in xs))


def reference_ctc_prefix(log_probs, prefix, end=False):
    """log psi(prefix), the CTC probability of every output that starts with `prefix` (end=True: of
    `prefix` itself), by the textbook forward over the extended labels (blank, l1, blank, ..., lU, blank),
    one frame and one state at a time: psi sums the ways of entering lU's state at each frame."""
    lp = log_probs.tolist()
    blank = len(lp[0]) - 1
    z = [blank] + [s for label in prefix for s in (label, blank)]
    alpha = [lp[0][blank], lp[0][z[1]] if prefix else -math.inf] + [-math.inf] * (len(z) - 2)
    psi = alpha[1] if len(prefix) == 1 else -math.inf
    for t in range(1, len(lp)):
        new = []
        for s in range(len(z)):
            skip = s >= 2 and z[s] != blank and z[s] != z[s - 2]  # blank may be skipped between different labels
            enter = log_add(alpha[s - 1] if s >= 1 else -math.inf, alpha[s - 2] if skip else -math.inf)
            new.append(log_add(alpha[s], enter) + lp[t][z[s]])
            if prefix and s == len(z) - 2:
                psi = log_add(psi, enter + lp[t][z[s]])
        alpha = new
    if end:
        return log_add(alpha[-1], alpha[-2]) if prefix else alpha[-1]
    return psi if prefix else 0.0


def reference_beam_search(model, memory, memory_lens, prompt, eos, k, alpha, max_delta, ctc=None, lm=None):
    """One utterance and one hypothesis at a time, logits recomputed from scratch (no cache, no batching).
    ctc = (log-probs (B, T', V+1), weight, candidates): joint scores over the attention decoder's best
    tokens and EOS, with CTC prefix probabilities recomputed from scratch too. lm = (an
    aed.decode_lm.NGramLM, weight): each candidate also scores weight x its n-gram log-probability
    after the hypothesis' own tokens (shallow fusion)."""
    out = []
    for b in range(memory.size(0)):
        mem, mem_lens = memory[b : b + 1, : memory_lens[b]], memory_lens[b : b + 1]
        limit = min(int(mem_lens) + max_delta, model.cfg.dec_max_len - prompt.size(1))
        beams = [([], 0.0, False)]  # (generated ids incl. EOS, summed log-prob, finished)
        for _ in range(limit):
            cands = []
            for gen, score, done in beams:
                if done:
                    cands.append((gen, score, True))
                    continue
                tokens = torch.tensor([prompt[b].tolist() + gen])
                logp = F.log_softmax(recompute_logits(model, tokens, mem, mem_lens).double(), -1)[0].tolist()
                steps = list(enumerate(logp))
                if ctc is not None:
                    log_probs, weight, n = ctc[0][b, : memory_lens[b]], ctc[1], ctc[2]
                    base = reference_ctc_prefix(log_probs, gen)
                    top = sorted((t for t in range(len(logp)) if t != eos), key=lambda t: -logp[t])[:n]
                    psi = {t: reference_ctc_prefix(log_probs, gen + [t]) for t in top}
                    psi[eos] = reference_ctc_prefix(log_probs, gen, end=True)
                    steps = [(t, (1 - weight) * logp[t] + weight * (psi[t] - base)) for t in top + [eos]]
                if lm is not None:
                    fused = lm[0].next_log_probs(tuple(gen)).tolist()
                    steps = [(t, step + lm[1] * fused[t]) for t, step in steps]
                for tok, step in steps:
                    new = gen + [tok]
                    cands.append((new, score + step, tok == eos or len(new) >= limit))
            cands.sort(key=lambda c: c[1] / length_penalty(torch.tensor(float(len(c[0]))), alpha).item(), reverse=True)
            beams = cands[:k]
        gen, _, _ = max(beams, key=lambda c: c[1] / length_penalty(torch.tensor(float(len(c[0]))), alpha).item())
        out.append(gen[: gen.index(eos)] if eos in gen else gen)
    return out


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_search_equals_slow_reference(alpha):
    model = random_model(seed=2)
    feats, lens, prompt = batch(lens=(100, 48, 75), seed=2)
    memory, memory_lens = model.encode(feats, lens)
    eos = pick_eos(model, memory, memory_lens, prompt)
    got = beam_search(model, memory, memory_lens, prompt, eos, DecodingOptions(3, alpha, max_delta=4, **PLAIN))
    ref = reference_beam_search(model, memory, memory_lens, prompt, eos, 3, alpha, max_delta=4)
    assert got == ref


@pytest.mark.parametrize("beam_size,alpha", [(1, 0.0), (3, 0.0), (3, 1.0)])
def test_joint_ctc_attention_search_equals_slow_reference(beam_size, alpha):
    model = random_model(seed=2, ctc_loss_weight=0.3)
    feats, lens, prompt = batch(lens=(100, 48, 75), seed=2)
    memory, memory_lens, ctc_log_probs = model.encode_with_ctc(feats, lens)
    eos = pick_eos(model, memory, memory_lens, prompt)
    options = DecodingOptions(beam_size, alpha, max_delta=4, ctc_weight=0.5, ctc_candidates=5, max_repeats=0,
                              max_tokens_per_second=None)
    got = search(model, memory, memory_lens, prompt, eos, options, ctc_log_probs)
    ref = reference_beam_search(model, memory, memory_lens, prompt, eos, beam_size, alpha, 4, (ctc_log_probs, 0.5, 5))
    assert got == ref
    plain = search(model, memory, memory_lens, prompt, eos, dataclasses.replace(options, ctc_weight=0.0))
    assert got != plain, "CTC should change some hypothesis, or this test shows nothing"


@pytest.mark.parametrize("beam_size", [1, 3])
def test_joint_search_with_ctc_weight_0_equals_attention_search(beam_size):
    """Weight 0 is the attention decoder's search exactly; so is a weight too small to reorder anything,
    which runs the joint machinery (pre-beam candidates, EOS column, CTC state selection)."""
    model = random_model(seed=3, ctc_loss_weight=0.3)
    feats, lens, prompt = batch(lens=(120, 100, 95, 140), seed=3)
    memory, memory_lens, ctc_log_probs = model.encode_with_ctc(feats, lens)
    eos = pick_eos(model, memory, memory_lens, prompt)
    options = DecodingOptions(beam_size, max_new_tokens=6, **PLAIN)  # 12+ frames: CTC fits any 6 tokens
    plain = search(model, memory, memory_lens, prompt, eos, options)
    assert plain == (greedy_search if beam_size == 1 else beam_search)(model, memory, memory_lens, prompt, eos, options)
    assert decode_features(model, feats, lens, prompt, eos, options)[0] == plain
    tiny = dataclasses.replace(options, ctc_weight=1e-9)
    assert search(model, memory, memory_lens, prompt, eos, tiny, ctc_log_probs) == plain


@pytest.mark.parametrize("beam_size", [1, 3])
def test_batched_joint_search_equals_each_utterance_alone(beam_size):
    model = random_model(seed=4, ctc_loss_weight=0.3)
    feats, lens, prompt = batch(seed=4)
    memory, memory_lens = model.encode(feats, lens)
    eos = pick_eos(model, memory, memory_lens, prompt)
    options = DecodingOptions(beam_size, max_delta=8)  # CTC, repetition and rate guards on (the defaults)
    hyps = decode_features(model, feats, lens, prompt, eos, options)[0]
    assert len({len(h) for h in hyps}) >= 2, hyps
    for i in range(len(lens)):
        alone = decode_features(model, feats[i : i + 1, : lens[i]], lens[i : i + 1], prompt[i : i + 1], eos, options)[0]
        assert alone == [hyps[i]], f"utterance {i} decodes differently inside the padded batch"


class FixedCTC(torch.nn.Module):
    """A CTC head whose log-probs are given: the audio "says" a chosen transcript."""

    def __init__(self, log_probs):
        super().__init__()
        self.log_probs = log_probs

    def forward(self, enc):
        return self.log_probs[:, : enc.size(1)]


@pytest.mark.parametrize("beam_size", [1, 3])
def test_ctc_rescues_an_attention_decoder_that_loops(beam_size):
    """The attention decoder always prefers token 20 (it would say it until the length limit); CTC
    frames say [5, 9, 7] and [11, 11, 6]. Joint decoding outputs exactly those and stops; the
    repetition guard alone stops the loop after max_repeats + 1 copies."""
    model = random_model(seed=5, ctc_loss_weight=0.3)
    feats, lens, prompt = batch(lens=(120, 95), seed=5)
    memory, memory_lens = model.encode(feats, lens)  # 15 and 12 frames
    eos, loop = V - 1, 20
    transcripts = [[5, 9, 7], [11, 11, 6]]
    logits = torch.zeros(2, 15, V + 1, dtype=torch.float64)
    logits[:, :, V] = 30.0  # blank, except where a token is said
    for b, (text, frames) in enumerate(zip(transcripts, [(2, 3, 6, 7, 11), (1, 4, 5, 9, 10)])):
        for tok, (t0, t1) in zip(text, [(frames[0], frames[1]), (frames[2], frames[3]), (frames[4], frames[4] + 1)]):
            logits[b, t0:t1, tok], logits[b, t0:t1, V] = 30.0, 0.0
    model.ctc = FixedCTC(F.log_softmax(logits, dim=-1))
    with torch.no_grad():
        model.decoder.output_proj.bias[loop] = 15.0
        model.decoder.output_proj.bias[[5, 9, 7, 11, 6, eos]] = 8.0  # plausible to the decoder, never its first choice
    options = DecodingOptions(beam_size, max_delta=10)
    assert decode_features(model, feats, lens, prompt, eos, dataclasses.replace(options, **PLAIN))[0] == [[loop] * 25, [loop] * 22]
    assert decode_features(model, feats, lens, prompt, eos, options)[0] == transcripts
    guard = dataclasses.replace(options, ctc_weight=0.0, max_repeats=3)
    assert decode_features(model, feats, lens, prompt, eos, guard)[0] == [[loop] * 4, [loop] * 4]


class ScriptedDecoder:
    """A decoder whose next-token probabilities are a function of the tokens generated so far
    (`probs(history) -> list`), behind the model interface the searches use."""

    class Cache:
        def __init__(self, rows):
            self.histories, self.prompted = [[] for _ in range(rows)], False

        def reorder(self, origin):
            self.histories = [list(self.histories[int(o)]) for o in origin]

    def __init__(self, probs, max_len=64):
        self.probs, self.cfg = probs, AEDConfig(n_mels=8, vocab_size=8, dec_max_len=max_len)

    def new_cache(self, memory, memory_lens, length, rows_per_utterance=1):
        return self.Cache(memory.size(0) * rows_per_utterance)

    def decode_step(self, tokens, cache):
        if cache.prompted:  # the first call holds the prompt, each later one the tokens just chosen
            for h, t in zip(cache.histories, tokens[:, 0].tolist()):
                h.append(t)
        cache.prompted = True
        return torch.tensor([self.probs(h) for h in cache.histories], dtype=torch.float64).log()


def test_beam_search_charges_a_stopped_loop_for_its_eos():
    """A loop grows ever more likely and never ends; the guard stops it after max_repeats + 1 copies.
    Stopped, it must still pay for the EOS it never said, or it outranks an ending hypothesis that is
    far more likely as a whole: [2, 2, 2, 2] + EOS has log-probability about -14.4, [1] + EOS -1.06."""
    loop, word, eos = 2, 1, 5

    def probs(history):
        p = [1e-9] * 6
        if not history:
            p[loop], p[word] = 0.6, 0.35
        elif history[-1] == word:
            p[eos] = 0.99
        else:
            p[loop], p[eos] = 0.97, 1e-6
        return p

    model = ScriptedDecoder(probs)
    memory, memory_lens, prompt = torch.zeros(1, 20, 4), torch.tensor([20]), torch.tensor([[3]])
    options = DecodingOptions(beam_size=2, max_repeats=3, ctc_weight=0.0, max_tokens_per_second=None)
    assert greedy_search(model, memory, memory_lens, prompt, eos, options) == [[loop] * 4]
    assert beam_search(model, memory, memory_lens, prompt, eos, options) == [[word]]


def test_repetition_guard_finds_repeated_ngrams_at_the_end():
    rows = [[4, 4, 4, 4, 4, 0],  # a unigram 5 times
            [1, 4, 4, 4, 4, 0],  # 4 times: allowed
            [3, 5, 3, 5, 3, 5],  # a bigram 3 times
            [1, 2, 3, 1, 2, 3],  # a trigram twice
            [6, 6, 6, 6, 6, 7]]  # 5 times, then another token
    tokens = torch.tensor(rows)
    assert ends_in_repeats(tokens, 5, max_repeats=4).tolist() == [True, False, False, False, True]
    assert ends_in_repeats(tokens, 6, max_repeats=2).tolist() == [False, False, True, False, False]
    assert ends_in_repeats(tokens, 6, max_repeats=1).tolist() == [False, False, True, True, False]
    assert ends_in_repeats(tokens, 3, max_repeats=2).tolist() == [True, False, False, False, True]


def test_the_no_speech_check_is_its_probability_and_with_a_logprob_threshold_whispers_second_condition():
    """Judged non-speech: the no-speech probability above no_speech_threshold; with a logprob_threshold
    (Whisper's rule), also the hypothesis' mean log-probability at most that: a confident transcript is
    kept whatever the probability."""
    default = DecodingOptions()
    assert (default.no_speech_threshold, default.logprob_threshold) == (0.1, None)
    assert default.no_speech(0.5, -0.5) and not default.no_speech(0.05, -5.0)  # the probability alone decides
    whisper = DecodingOptions(logprob_threshold=-1.0)
    assert whisper.no_speech(0.5, -1.5) and whisper.no_speech(0.5, -1.0)  # both ("at most": Whisper's <=)
    assert not whisper.no_speech(0.5, -0.5)  # confident: kept
    assert not whisper.no_speech(0.1, -5.0)  # speech by its probability, however unsure
    assert DecodingOptions(logprob_threshold=0.0).no_speech(0.5, -1e-9)  # 0: every mean log-probability meets it
    assert not DecodingOptions(no_speech_threshold=None).no_speech(1.0, -10.0)  # the check is off


@pytest.mark.parametrize("beam_size,ctc_weight", [(1, 0.0), (3, 0.0), (1, 0.5), (3, 0.5)])
def test_a_hypothesis_log_probability_is_the_decoders_own_score_of_it(beam_size, ctc_weight):
    """What the check's second condition reads: per row, the attention decoder's log-probability of the
    hypothesis the search returns (its tokens, and its EOS where it ended with one: Whisper's
    sum_logprob), as the uncached decoder scores it teacher-forced, whatever ranked it (a beam, joint
    CTC scores)."""
    model = random_model(seed=2, ctc_loss_weight=0.3)
    feats, lens, prompt = batch(lens=(100, 48, 75), seed=2)
    memory, memory_lens, ctc_log_probs = model.encode_with_ctc(feats, lens)
    eos = pick_eos(model, memory, memory_lens, prompt)
    options = DecodingOptions(beam_size, max_delta=4, ctc_weight=ctc_weight, max_repeats=0, max_tokens_per_second=None)
    hyps, logprobs = search(model, memory, memory_lens, prompt, eos, options, ctc_log_probs, with_logprobs=True)
    assert hyps == search(model, memory, memory_lens, prompt, eos, options, ctc_log_probs)
    budget, p = token_budget(model, memory_lens, prompt.size(1), options).tolist(), prompt.size(1)
    for i, ids in enumerate(hyps):
        said = ids + [eos] * (len(ids) < budget[i])  # EOS where it ended with one, not at its budget
        tokens = torch.cat([prompt[i], torch.tensor(said, dtype=torch.long)])[None]  # (1, P + len(said))
        with torch.no_grad():
            hidden = model.decoder(tokens[:, :-1], memory[i : i + 1], memory_lens[i : i + 1])
            logp = F.log_softmax(model.decoder.output_proj(hidden).float(), dim=-1)[0, p - 1 :]  # (len(said), V)
        expected = float(logp.gather(1, torch.tensor(said)[:, None]).sum())
        assert float(logprobs[i]) == pytest.approx(expected, rel=1e-5, abs=1e-4), (i, ids)


def test_decode_features_judges_each_row_by_its_own_two_numbers():
    """Per row: P(EOS) right after the prompt, the hypothesis' log-probability over its tokens + 1
    (Whisper's avg_logprob), and whether the check emptied it; a row without tokens has nothing to empty."""
    model = random_model(seed=2)
    feats, lens, prompt = batch(lens=(100, 48, 75, 120), seed=2)
    memory, memory_lens = model.encode(feats, lens)
    eos = pick_eos(model, memory, memory_lens, prompt)
    options = DecodingOptions(max_delta=4, **PLAIN, no_speech_threshold=None)
    plain, *_, unchecked = decode_features(model, feats, lens, prompt, eos, options)
    assert unchecked is None
    _, logprobs = search(model, memory, memory_lens, prompt, eos, options, with_logprobs=True)
    means = [lp / (len(h) + 1) for lp, h in zip(logprobs.tolist(), plain)]
    probs = no_speech_probs(model, memory, memory_lens, prompt, eos).tolist()
    ranked = sorted(means)
    threshold = (ranked[1] + ranked[2]) / 2  # two rows' means below it, two above
    judged = dataclasses.replace(options, no_speech_threshold=min(probs) / 2, logprob_threshold=threshold)
    hyps, *_, check = decode_features(model, feats, lens, prompt, eos, judged)
    assert check.probs == pytest.approx(probs, rel=1e-6) and check.avg_logprobs == pytest.approx(means, rel=1e-6)
    assert check.emptied == [bool(h) and m <= threshold for h, m in zip(plain, means)]
    assert any(check.emptied) and not all(check.emptied)
    assert hyps == [[] if e else h for h, e in zip(plain, check.emptied)]


@pytest.mark.slow
def test_tiny_model_overfits_eight_synthetic_utterances():
    """8 utterances whose features are a per-token spectrum held for 12 frames: learn to transcribe them all."""
    torch.manual_seed(0)
    vocab, pad, eos, bos = 24, 1, 2, 3
    cfg = AEDConfig(n_mels=16, vocab_size=vocab, pad_id=pad, enc_d_model=48, enc_layers=2, enc_heads=4, subsampling_channels=16,
                    dec_d_model=48, dec_layers=1, dec_heads=4, dec_max_len=32, enc_dropout=0.0, enc_dropout_pre_encoder=0.0,
                    enc_dropout_att=0.0, dec_dropout=0.0, dec_dropout_att=0.0)
    model = AED(cfg)
    g = torch.Generator().manual_seed(1)
    spectra = 2 * torch.randn(vocab, 16, generator=g)
    texts = [torch.randint(4, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist() for _ in range(8)]
    assert len({tuple(t) for t in texts}) == 8
    prompt = [bos, 4]
    utts = [torch.cat([spectra[tok].repeat(12, 1) for tok in t]) + 0.3 * torch.randn(12 * len(t), 16, generator=g) for t in texts]
    feat_lens = torch.tensor([u.size(0) for u in utts])
    feats = torch.zeros(8, int(feat_lens.max()), 16)
    seqs = [prompt + t + [eos] for t in texts]
    token_lens = torch.tensor([len(s) for s in seqs])
    tokens = torch.full((8, int(token_lens.max())), pad)
    for i, (u, s) in enumerate(zip(utts, seqs)):
        feats[i, : u.size(0)] = u
        tokens[i, : len(s)] = torch.tensor(s)
    prompt_lens = torch.full((8,), len(prompt))

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    hyps = None
    for step in range(1, 401):
        model.train()
        loss, count = model(feats, feat_lens, tokens, token_lens, prompt_lens)
        opt.zero_grad()
        (loss / count).backward()
        opt.step()
        if step % 25 == 0:
            model.eval()
            hyps = decode_features(model, feats, feat_lens, tokens[:, : len(prompt)], eos)[0]
            if hyps == texts:
                break
    assert hyps == texts, f"after {step} steps (loss {(loss / count).item():.3f}): {hyps} != {texts}"
